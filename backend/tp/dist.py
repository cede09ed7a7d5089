"""The ``torch.distributed`` side of tensor parallelism: a process group's sum as a ``Collective``
(gloo on CPU tensors, NCCL where the tensors are on CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ProcessGroupCollective"]


class ProcessGroupCollective:
    """``all_reduce_sum`` over a ``torch.distributed`` process group (the default group if None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """Replace ``t`` with its sum over every rank of the group, in place (``torch.distributed.all_reduce``)."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
