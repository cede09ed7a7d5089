"""Staging plans into tensors: the hand-off from host IR columns to device memory.

Each plan's columns are packed into one host int64 array and moved in one copy (one H2D transfer
on a GPU). A staged decode keeps that one ``[5, n]`` tensor and hands out per-field rows as views
on access (making five tensor views up front costs more than the rest of the decode step's host
work). Every staged column is marked with the host values it was staged from
(``backend.readback.staged``), so a check or a torch path that needs them reads them on the host
instead of reading the device tensor back (a synchronisation on a GPU). On a CUDA device the packed
array is copied from pinned memory, asynchronously. On the CPU the staged tensors alias a fresh array, so a staged plan stays valid after the
next one is staged; the fields of a staged extend or window are cut from that array in numpy, one
tensor each (torch's own slicing costs several times more per field on the host).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch

from backend.pool import MambaStatePool
from backend.readback import staged
from ir.head import HeadCommitBatch, HeadExtendPlan
from ir.plan import DecodePlan, ExtendPlan
from ir.spec import DraftBatch, DraftExtendBatch, VerifyBatch

__all__ = ["Captures", "StagedDecode", "StagedExtend", "StagedWindow", "stage_decode", "stage_extend", "stage_window", "to_device"]


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
    host: npt.NDArray[np.int64] | None = None
    """The host array ``packed`` was staged from (``None``: not known; each field is then read back
    where its values are needed). Input ids resolved on the device are never in it."""

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slots, input_ids, positions, kv_locs, seq_lens)`` in one call (``packed.unbind``), each
        marked with its host values as the properties' are."""
        slots, input_ids, positions, kv_locs, seq_lens = self.packed.unbind(0)
        if self.host is not None:
            for i, t in ((0, slots), (2, positions), (3, kv_locs), (4, seq_lens)):
                staged(t, self.host[i])
        return slots, input_ids, positions, kv_locs, seq_lens

    def _row(self, i: int) -> torch.Tensor:
        t = self.packed[i]
        return t if self.host is None else staged(t, self.host[i])

    @property
    def slots(self) -> torch.Tensor:
        """``[n]``: each request's state row."""
        return self._row(0)

    @property
    def input_ids(self) -> torch.Tensor:
        """``[n]``: the token each request feeds (the one generated last)."""
        return self.packed[1]

    @property
    def positions(self) -> torch.Tensor:
        """``[n]``: the position of that token, ``seq_lens - 1``."""
        return self._row(2)

    @property
    def kv_locs(self) -> torch.Tensor:
        """``[n]``: where that token's keys and values go."""
        return self._row(3)

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[n]``: each request's length with that token, so its context is ``seq_lens`` positions."""
        return self._row(4)


def to_device(values: npt.NDArray[np.generic], device: torch.device) -> torch.Tensor:
    """The host array ``values`` as a tensor on ``device`` without waiting for the device: on the CPU
    the tensor shares ``values``; on a CUDA device it is copied from pinned memory, asynchronously
    (a copy from pageable memory would make the host wait); ``values`` must not change afterwards."""
    return _to_device(values, device)


def _to_device(packed: npt.NDArray[np.generic], device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(packed)
    if device.type == "cpu":
        return host
    if device.type == "cuda":  # (pinned: the copy is asynchronous; torch keeps the pinned block until it is done)
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def stage_decode(plan: DecodePlan, device: torch.device, input_ids: npt.NDArray[np.int64] | None = None) -> StagedDecode:
    """``plan``'s columns as one ``StagedDecode`` on ``device`` (one host-to-device copy).
    ``input_ids``: the resolved inputs of a plan that names them (``DecodePlan.inputs_from``)."""
    tokens = plan.input_ids if input_ids is None else input_ids
    n = plan.slots.shape[0]  # (one concatenate: np.stack is a Python-level wrapper around it)
    packed = np.concatenate((plan.slots, tokens, plan.seq_lens - 1, plan.kv_locs, plan.seq_lens)).reshape(5, n)
    return StagedDecode(_to_device(packed, device), packed)


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
    # on the CPU, views cut in numpy, each wrapped once: a torch slice costs several times more
    t = _to_device(packed, device) if device.type != "cpu" else None

    def cut(at: slice) -> torch.Tensor:
        return staged(torch.from_numpy(packed[at]) if t is None else t[at], packed[at])

    return StagedExtend(
        slots=cut(slice(0, n)), prefix_lens=cut(slice(n, 2 * n)), cu_seqlens=cut(slice(2 * n, o)), input_ids=cut(slice(o, o + tokens)),
        positions=cut(slice(o + tokens, o + 2 * tokens)), kv_locs=cut(slice(o + 2 * tokens, None)),
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
    t = _to_device(packed, device) if device.type != "cpu" else None  # (as ``stage_extend``)

    def cut(at: slice, shape: tuple[int, ...]) -> torch.Tensor:
        host = packed[at].reshape(shape)
        return staged(torch.from_numpy(host) if t is None else t[at].view(shape), host)

    return StagedWindow(
        slots=cut(slice(0, n), (n,)), input_ids=cut(slice(n, n + m), ids.shape), positions=cut(slice(n + m, n + m + n * w), (n, w)),
        kv_locs=cut(slice(n + m + n * w, None), (n, w)),
    )
