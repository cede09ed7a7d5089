"""The target's hidden states as a typed, one-shot value: what a draft head reads.

A draft head (MTP/EAGLE) pairs the target's hidden state at position ``j - 1`` (its residual stream
after the last layer, before the final norm) with the token at ``j``. The states themselves are
tensors that never leave the backend that computed them; the IR names them with a ``HiddenStates``
handle, produced by the target's forward and consumed by exactly one head phase:

- a plan asks for them: ``ExtendPlan.keep_hidden`` (a prefill chunk; a ``MixedPlan``'s through its
  extend part) or ``VerifyPlan.keep_hidden`` (a verify), a fresh ``HiddenId``
  (``ir.mint.mint_hidden_id``; ``compiler.steps.Pipeline`` mints it for ``keep_hidden=True``);
- the target's result hands the handle back: ``Sampled.hidden`` / ``Verified.hidden``, equal to
  ``asked_hidden(plan)``, and ``None`` for a plan that asked for none
  (``backend.boundary.checked`` refuses any other);
- one head phase consumes it: ``passes.prepare_for_head_extend`` (an extend's) or
  ``passes.prepare_for_head_commit`` (a verify's), through ``Pipeline.head_extend`` /
  ``Pipeline.head_commit``, which are ``@consumes``: a second head phase given the same handle, or
  the handle (or the result holding it) kept past the step, is a mypy error (``linear-reuse``,
  ``linear-escape``; ``ir.mypy_linear``). The head plan names the states by ``hidden_id`` only.

Invariants of a ``HiddenStates`` (checked on construction): ``hidden_id`` positive; one row per
request of the producing plan, in its order (``rids``); row ``i`` kept the states of positions
``starts[i] .. starts[i] + lens[i] - 1`` (``lens >= 1``, ``starts >= 0``): an extend row its chunk
(``starts = prefix_lens``, ``lens = extend_lens``), a verify row its window (``starts = seq_lens -
1``, ``lens = k + 1``); ``verify_id`` names the producing verify exactly when ``source`` is
``VERIFY``.

What the backend must check at run time (the type check does not see values held as ``Any``, a
pickled copy, or another process):

- the target's executor, running a plan with ``keep_hidden = h``, keeps the rows' states under
  ``h`` in a store it shares with the head's executor (same process or rank), and refuses a plan
  whose ``h`` is already held or was ever consumed;
- the head's executor, running a ``HeadExtendPlan`` or ``HeadCommitPlan`` naming ``h``, takes the
  states out of the store (one use: a second plan naming ``h``, a replay or a copy, finds none and
  is refused naming ``h``; so is an ``h`` never kept), and refuses states whose rows or lengths
  differ from the plan's: a head extend reads all ``lens[i] == extend_lens[i]`` positions of row
  ``i`` at ``starts[i] == prefix_lens[i]``; a head commit reads window positions ``0 ..
  accept_pos[i]`` of row ``i``'s ``k + 1``;
- kept states nobody will read (their requests were aborted before the head phase) are dropped with
  the verifies' and drafts' (``Backend.forget_verifies``), never left to grow the store.
"""

from __future__ import annotations

import enum
from typing import final

import attrs
import numpy as np

from ir.columns import I64, REQUEST, ColumnNode, as_i64, check_int, column, frozen_i64, per
from ir.errors import IRValidationError
from ir.ids import HiddenId, VerifyId
from ir.linear import linear
from ir.plan import ExtendPlan, MixedPlan
from ir.spec import VerifyPlan

__all__ = [
    "HiddenSource",
    "HiddenStates",
    "asked_hidden",
]


class HiddenSource(enum.Enum):
    """Which target forward produced a ``HiddenStates``."""

    EXTEND = "extend"
    """A prefill chunk (an ``ExtendPlan``, or a ``MixedPlan``'s extend part): read by a head extend."""
    VERIFY = "verify"
    """A verify window: read by a head commit."""


@final
@linear
@attrs.frozen(kw_only=True)
class HiddenStates(ColumnNode):
    """A handle on the target hidden states a backend keeps under ``hidden_id`` (see the module).
    A linear value: one head phase consumes it."""

    hidden_id: HiddenId
    source: HiddenSource
    verify_id: VerifyId | None = None
    """The verify that produced them (``source`` ``VERIFY``), else ``None``."""
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
    starts: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0))
    """Row ``i``'s first kept position."""
    lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=1))
    """How many positions row ``i`` kept, from ``starts[i]`` on."""

    def _check_first(self) -> None:
        if check_int(self, "hidden_id", self.hidden_id) < 1:
            raise IRValidationError("HiddenStates", "hidden_id", self.hidden_id, "must be positive (use ir.mint.mint_hidden_id())")
        if not isinstance(self.source, HiddenSource):
            raise IRValidationError("HiddenStates", "source", self.source, "must be a HiddenSource")
        if (self.source is HiddenSource.VERIFY) != (self.verify_id is not None):
            raise IRValidationError(
                "HiddenStates", "verify_id", self.verify_id, f"names the producing verify exactly when source is verify (source={self.source.value})"
            )
        if self.verify_id is not None and check_int(self, "verify_id", self.verify_id) < 1:
            raise IRValidationError("HiddenStates", "verify_id", self.verify_id, "must be positive")

    def described(self) -> str:
        """One phrase naming the handle, its producer and its rows, for refusals:
        ``hidden #5 of an extend (rows [3, 4], positions 0..3, 8..9)``."""
        producer = f"verify #{self.verify_id}" if self.verify_id is not None else "an extend"
        spans = ", ".join(f"{s}..{s + n - 1}" for s, n in zip(self.starts.tolist()[:8], self.lens.tolist()[:8], strict=True))
        return f"hidden #{self.hidden_id} of {producer} (rows {self.rids.tolist()[:8]}, positions {spans})"


_last_asked: tuple[object, HiddenStates] | None = None
"""The last plan that asked for a handle, and that handle: the backend builds its result's handle
and ``checked`` then compares with the same plan's, so the second call finds the first's. The plan
is held, so its identity cannot be reused while it is here, and it is immutable, so its handle is
the same node whenever it is asked for."""


def asked_hidden(plan: ExtendPlan | MixedPlan | VerifyPlan) -> HiddenStates | None:
    """The handle ``plan``'s forward must hand back (``Sampled.hidden``/``Verified.hidden``), or
    ``None`` when it asked for none: the backend builds its result's handle with this, and
    ``backend.boundary.checked`` compares the result's with it."""
    global _last_asked
    last = _last_asked
    if last is not None and last[0] is plan:
        return last[1]
    handle = _asked(plan)
    if handle is not None:
        _last_asked = (plan, handle)
    return handle


def _asked(plan: ExtendPlan | MixedPlan | VerifyPlan) -> HiddenStates | None:
    match plan:
        case VerifyPlan():
            if plan.keep_hidden is None:
                return None
            b = plan.batch
            return HiddenStates(
                hidden_id=plan.keep_hidden, source=HiddenSource.VERIFY, verify_id=b.verify_id, rids=b.rids,
                starts=frozen_i64(b.seq_lens - 1), lens=frozen_i64(np.full(b.num_requests, b.k + 1, dtype=np.int64)),
            )
        case MixedPlan():
            return _asked(plan.extend)
        case ExtendPlan():
            if plan.keep_hidden is None:
                return None
            return HiddenStates(
                hidden_id=plan.keep_hidden, source=HiddenSource.EXTEND, rids=plan.rids, starts=plan.prefix_lens, lens=plan.extend_lens
            )
