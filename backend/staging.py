"""Staging plans into tensors: the hand-off from host IR columns to device memory.

Each plan's columns are packed into one host int64 array and moved in one copy (one H2D transfer
on a GPU). A staged decode keeps that one ``[5, n]`` tensor and hands out per-field rows as views
on access (making five tensor views up front costs more than the rest of the decode step's host
work). On the CPU the staged tensors alias a fresh array, so a staged plan stays valid after the
next one is staged; the fields of a staged extend or window are cut from that array in numpy, one
tensor each (torch's own slicing costs several times more per field on the host).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch

from backend.pool import MambaStatePool
from ir.head import HeadCommitBatch, HeadExtendPlan
from ir.plan import DecodePlan, ExtendPlan
from ir.spec import DraftBatch, DraftExtendBatch, VerifyBatch

__all__ = ["Captures", "StagedDecode", "StagedExtend", "StagedWindow", "stage_decode", "stage_extend", "stage_window"]


@attrs.frozen(kw_only=True, eq=False)
class Captures:
    """The prefix-cache snapshots of an extend taken inside a request's chunk
    (``MambaSnapshot.at`` below the request's ``extend_len``): the model hook stores the state of
    extend row ``seq[j]`` after its first ``at[j]`` tokens (every Mamba layer's conv and SSM state)
    in row ``j + 1`` of ``into``, a scratch pool of the executor pool's layout (row 0 is its
    padding row), and the snapshot copies that row for its entry ``entries[j]``."""

    seq: tuple[int, ...]
    at: tuple[int, ...]
    entries: tuple[int, ...]
    into: MambaStatePool


@attrs.frozen(kw_only=True, eq=False)
class StagedExtend:
    """An extend-shaped plan's columns as int64 tensors on the pool's device: what a model hook's
    ``forward`` (and a head hook's ``extend``) reads for a prefill chunk.

    Per request ``i`` of ``n``: ``slots[i]`` (its state row), ``prefix_lens[i]`` (tokens already in
    its state) and ``cu_seqlens`` (``[n + 1]``, cumulative chunk lengths from 0: request ``i`` owns
    tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``). Per token, packed in request order: ``input_ids``,
    ``positions`` (token ``j`` of request ``i`` is at ``prefix_lens[i] + j``) and ``kv_locs`` (where its
    keys and values go). ``captures``: the states the hook must store inside the chunk, or ``None``.
    The tensors are the hook's inputs, never its scratch: an executor that watches (``BATCHC_VERIFY=2``)
    reports a hook that writes one."""

    slots: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_locs: torch.Tensor
    cu_seqlens: torch.Tensor
    prefix_lens: torch.Tensor
    captures: Captures | None = None
    """States the hook must capture inside the chunks (``None``: none)."""


@attrs.frozen(eq=False)
class StagedDecode:
    """A decode plan's columns as one ``[5, n]`` int64 tensor on the pool's device, one column per
    request; the fields are views of its rows, made on access. A model hook reads it, never writes it."""

    packed: torch.Tensor
    """``[5, n]``: slots, input ids, positions (``seq_lens - 1``), KV locations, sequence lengths."""

    @property
    def slots(self) -> torch.Tensor:
        """``[n]``: each request's state row."""
        return self.packed[0]

    @property
    def input_ids(self) -> torch.Tensor:
        """``[n]``: the token each request feeds (the one generated last)."""
        return self.packed[1]

    @property
    def positions(self) -> torch.Tensor:
        """``[n]``: the position of that token, ``seq_lens - 1``."""
        return self.packed[2]

    @property
    def kv_locs(self) -> torch.Tensor:
        """``[n]``: where that token's keys and values go."""
        return self.packed[3]

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[n]``: each request's length with that token, so its context is ``seq_lens`` positions."""
        return self.packed[4]


def _to_device(packed: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(packed)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def stage_decode(plan: DecodePlan, device: torch.device, input_ids: npt.NDArray[np.int64] | None = None) -> StagedDecode:
    """``plan``'s columns as one ``StagedDecode`` on ``device`` (one host-to-device copy).
    ``input_ids``: the resolved inputs of a plan that names them (``DecodePlan.inputs_from``)."""
    tokens = plan.input_ids if input_ids is None else input_ids
    n = plan.slots.shape[0]  # (one concatenate: np.stack is a Python-level wrapper around it)
    packed = np.concatenate((plan.slots, tokens, plan.seq_lens - 1, plan.kv_locs, plan.seq_lens)).reshape(5, n)
    return StagedDecode(_to_device(packed, device))


def stage_extend(plan: ExtendPlan | DraftExtendBatch | HeadExtendPlan | HeadCommitBatch, device: torch.device) -> StagedExtend:
    """``plan``'s columns as one ``StagedExtend`` on ``device``: one packed host array, one
    host-to-device copy (on the CPU, tensors cut from a fresh array, valid after the next staging)."""
    n, tokens = plan.num_requests, plan.input_ids.shape[0]
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(plan.extend_lens, out=cu[1:])
    # position of token j of request i is prefix_lens[i] + j
    positions = np.arange(tokens, dtype=np.int64) - np.repeat(cu[:-1] - plan.prefix_lens, plan.extend_lens)
    packed = np.concatenate((plan.slots, plan.prefix_lens, cu, plan.input_ids, positions, plan.kv_locs))
    o = 2 * n + n + 1
    if device.type == "cpu":  # views cut in numpy, each wrapped once: a torch slice costs several times more
        f = torch.from_numpy
        return StagedExtend(
            slots=f(packed[0:n]), prefix_lens=f(packed[n : 2 * n]), cu_seqlens=f(packed[2 * n : o]), input_ids=f(packed[o : o + tokens]),
            positions=f(packed[o + tokens : o + 2 * tokens]), kv_locs=f(packed[o + 2 * tokens :]),
        )
    t = _to_device(packed, device)
    return StagedExtend(
        slots=t[0:n],
        prefix_lens=t[n : 2 * n],
        cu_seqlens=t[2 * n : o],
        input_ids=t[o : o + tokens],
        positions=t[o + tokens : o + 2 * tokens],
        kv_locs=t[o + 2 * tokens :],
    )


@attrs.frozen(kw_only=True, eq=False)
class StagedWindow:
    """A speculative phase's rows: ``T`` positions per row (``T = 1`` fed token for a draft
    proposal, ``k + 1`` for a verify), starting at position ``seq_lens - 1``."""

    slots: torch.Tensor
    input_ids: torch.Tensor
    """``[n]`` for a draft proposal (the pending token), ``[n, k + 1]`` for a verify."""
    positions: torch.Tensor
    """``[n, k + 1]``: the window's positions."""
    kv_locs: torch.Tensor
    """``[n, k + 1]``: the window's KV locations."""


def stage_window(batch: DraftBatch | VerifyBatch, device: torch.device) -> StagedWindow:
    """A draft's or verify's rows as one ``StagedWindow`` on ``device``: the window of ``k + 1``
    positions from ``seq_lens - 1``, in one host-to-device copy."""
    n, w = batch.num_requests, batch.k + 1
    positions = (batch.seq_lens - 1)[:, None] + np.arange(w, dtype=np.int64)[None, :]
    ids = batch.input_ids if isinstance(batch, DraftBatch) else batch.input_ids.reshape(n, w)
    packed = np.concatenate((batch.slots, ids.reshape(-1), positions.reshape(-1), batch.kv_locs))
    m = ids.size
    if device.type == "cpu":  # (as ``stage_extend``)
        f = torch.from_numpy
        return StagedWindow(
            slots=f(packed[:n]), input_ids=f(packed[n : n + m].reshape(ids.shape)), positions=f(packed[n + m : n + m + n * w].reshape(n, w)),
            kv_locs=f(packed[n + m + n * w :].reshape(n, w)),
        )
    t = _to_device(packed, device)
    return StagedWindow(
        slots=t[:n],
        input_ids=t[n : n + m].view(ids.shape),
        positions=t[n + m : n + m + n * w].view(n, w),
        kv_locs=t[n + m + n * w :].view(n, w),
    )
