"""Where the target's hidden states wait for the draft head's phase that reads them, once.

A target forward whose plan asks for them (``ExtendPlan.keep_hidden``, ``VerifyPlan.keep_hidden``)
keeps its hidden states here under that ``HiddenId``; the head's executor, in the same process (or
rank), takes them out for the ``HeadExtendPlan`` or ``HeadCommitPlan`` naming the id. The IR's
handle (``ir.hidden.HiddenStates``) makes a second use a mypy error; this store makes it a runtime
one, for the values the type check does not see (a replayed or copied plan, a plan built by hand).

Invariants:

- an id is kept at most once: keeping an id the store holds, or held before, is refused;
- an id is taken at most once (``read_*`` then ``taken`` once the phase ran): reading an id the store does not hold (already taken, dropped by
  ``forget``, or never kept) is refused naming it, and so is taking it for other rows, positions or
  another kind of phase than the states were kept for (an extend's states by a head extend of the
  same chunk; a verify's by the head commit of that verify's rows, reading window positions
  ``0 .. accept_pos[i]``);
- ``forget`` (the engine aborted the requests the states belonged to) drops every held entry, so
  the store never grows past the phases in flight (one extend's or one verify's states in the
  engine's step).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from ir.errors import PlanExecutionError
from ir.head import HeadCommitPlan, HeadExtendPlan
from ir.hidden import HiddenSource, HiddenStates
from ir.ids import HiddenId
from ir.init import SERIAL_COUNTER_BITS, serial_epoch
from ir.linear import keeps_linear

__all__ = ["HiddenStore"]


@keeps_linear  # its job: the handle waits here for the head phase that reads it
@attrs.frozen(kw_only=True, eq=False)
class _Held:
    handle: HiddenStates
    states: torch.Tensor
    """An extend's ``[sum(lens), d]`` (packed like its tokens) or a verify's ``[n, k + 1, d]``."""


class HiddenStore:
    """Hidden states by ``HiddenId`` between the target's forward and the head's phase (module)."""

    def __init__(self) -> None:
        self._held: dict[HiddenId, _Held] = {}
        self._upto: dict[int, int] = {}
        """Per minting epoch, the newest id ever kept: ids are minted in order, so an id at or
        below it that is not held was kept (and taken or dropped) before."""

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, handle: HiddenStates, states: torch.Tensor) -> None:
        """Keep ``states`` (see ``_Held.states``) under ``handle.hidden_id``."""
        hid = handle.hidden_id
        epoch, n = serial_epoch(hid), hid & ((1 << SERIAL_COUNTER_BITS) - 1)
        if hid in self._held or n <= self._upto.get(epoch, 0):
            raise PlanExecutionError(f"hidden #{hid} was kept before (each plan's keep_hidden is a fresh id: ir.mint.mint_hidden_id())")
        rows, total = int(handle.rids.shape[0]), int(handle.lens.sum())
        if handle.source is HiddenSource.EXTEND:
            ok = states.dim() == 2 and states.shape[0] == total
            want = f"[{total}, d_model]"
        else:
            width = int(handle.lens[0]) if rows else 0
            ok = states.dim() == 3 and states.shape[0] == rows and (rows == 0 or states.shape[1] == width)
            want = f"[{rows}, {width}, d_model]"
        if not ok:
            raise PlanExecutionError(f"{handle.described()}: the model gave hidden states of shape {tuple(states.shape)}, not {want}")
        self._held[hid] = _Held(handle=handle, states=states)
        self._upto[epoch] = n

    def _take(self, hid: HiddenId, phase: str, source: HiddenSource) -> _Held:
        held = self._held.get(hid)
        if held is None:
            raise PlanExecutionError(
                f"{phase} reads hidden #{hid}, which is not held here: already read by a head phase, dropped with aborted requests, "
                "or never kept by a target forward in this process"
            )
        if held.handle.source is not source:
            raise PlanExecutionError(f"{phase} reads {held.handle.described()}; it needs a {source.value}'s hidden states")
        return held

    def read_extend(self, plan: HeadExtendPlan) -> torch.Tensor:
        """The states a head extend reads: its chunk's, packed like its tokens. They stay held until
        ``taken`` (a transactional forward that fails runs again and reads them again)."""
        held = self._take(plan.hidden_id, "HeadExtendPlan", HiddenSource.EXTEND)
        h = held.handle
        if h.rids.tobytes() != plan.rids.tobytes() or h.starts.tobytes() != plan.prefix_lens.tobytes() or h.lens.tobytes() != plan.extend_lens.tobytes():
            raise PlanExecutionError(
                f"HeadExtendPlan of requests {plan.rids.tolist()[:8]} at positions {plan.prefix_lens.tolist()[:8]} "
                f"(+{plan.extend_lens.tolist()[:8]}) reads {h.described()}"
            )
        return held.states

    def read_commit(self, plan: HeadCommitPlan) -> torch.Tensor:
        """The states a head commit reads: row ``i``'s verify window positions ``0 .. accept_pos[i]``,
        packed row by row ``[sum(accept_pos + 1), d]`` like the commit's tokens (held until ``taken``)."""
        b = plan.batch
        held = self._take(b.hidden_id, "HeadCommitPlan", HiddenSource.VERIFY)
        h = held.handle
        if h.rids.tobytes() != b.rids.tobytes() or h.starts.tobytes() != b.prefix_lens.tobytes() or (h.lens != b.k + 1).any():
            raise PlanExecutionError(
                f"HeadCommitPlan of requests {b.rids.tolist()[:8]} at positions {b.prefix_lens.tolist()[:8]} with k={b.k} reads {h.described()}"
            )
        states = held.states
        flat = states.reshape(-1, states.shape[-1])
        keep = (np.arange(b.k + 1)[None, :] <= b.accept_pos[:, None]).reshape(-1)
        if keep.all():
            return flat
        return flat.index_select(0, torch.from_numpy(np.flatnonzero(keep)).to(states.device))

    def taken(self, hid: HiddenId) -> None:
        """The phase that read ``hid`` ran: the states are no longer held (a replay finds none)."""
        del self._held[hid]

    def __contains__(self, hid: object) -> bool:
        return hid in self._held

    def hand_over(self, hid: HiddenId) -> tuple[HiddenStates, torch.Tensor]:
        """Give the states held under ``hid`` to another process's store (``backend.remote``: a
        target's executor process hands them back with its result, the scheduler hands them on with
        the head's plan); this store no longer holds them, as if a phase had taken them."""
        held = self._held.pop(hid, None)
        if held is None:
            raise PlanExecutionError(f"hidden #{hid} is not held here: already handed over or read by a head phase, or dropped")
        return held.handle, held.states

    def forget(self) -> None:
        """Drop every held entry (their requests were aborted; a head phase naming one finds none)."""
        self._held.clear()
