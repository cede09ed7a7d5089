"""What running a plan gives back: frozen result nodes keyed by the plan's request ids.

A backend answers every plan with exactly one of these (``backend.boundary.result_type`` maps plan
types to result types; the engine's runner is typed by the same map, so a result the engine reads
is never missing or of another kind):

- ``Sampled`` for a prefill, decode, mixed or draft-extend forward: the token the backend's sampler
  (``backend.sampling``) chose for each row, in the plan's row order (for a ``MixedPlan``: the
  extend rows, then the decode rows). An extend row whose prompt has more chunks still gets one
  (from its chunk's last position); the engine emits only those of completed prompts.
- ``Proposals`` (``ir.spec``) for a draft: ``k`` tokens per row.
- ``Verified`` for a verify: the target's token at each of the ``k + 1`` window positions of each
  row, row-major, named by the verify's ``verify_id`` and rows; the accept pass compares them with
  the proposals of that verify only (``passes.accept`` refuses another verify's, naming both).
- ``Ran`` for a plan that samples nothing (commits, draft commits, idle).

A token is ``NON_FINITE`` (``-1``, never a token id) where the logits behind it held a NaN or an
infinity: whoever reads it ends that request instead of emitting it.

``Sampled`` and ``Verified`` carry ``logprobs`` (a ``Logprobs``, one entry per token: per row, or per
window position) when a row of the plan asked for them (``SamplingRows.logprobs >= 0``), else ``None``.

They also carry ``hidden``: the handle on the target hidden states the plan asked the forward to
keep (``ExtendPlan.keep_hidden``, ``VerifyPlan.keep_hidden``), equal to ``ir.hidden.asked_hidden(plan)``,
else ``None``. The handle is linear (one head phase consumes it), so ``Sampled`` and ``Verified``
are declared ``@linear`` too: a result holding one must not outlive the step either
(``ir.mypy_linear``'s ``linear-escape``), and handing the same result's handle to two head phases
is ``linear-reuse``.
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias, final

import attrs

from ir.columns import F64, I64, REQUEST, WINDOW, ColumnNode, RequestRows, as_f64, as_i64, check_int, column, per, shown, tokens_of
from ir.errors import IRValidationError
from ir.hidden import HiddenStates
from ir.ids import VerifyId
from ir.linear import linear
from ir.sampling import MAX_LOGPROBS
from ir.spec import Proposals, check_k

__all__ = [
    "NON_FINITE",
    "Logprobs",
    "Sampled",
    "Verified",
    "Ran",
    "Result",
]

NON_FINITE = -1
"""The token a sampler gives a row whose logits were not finite (a NaN or an infinity)."""


@final
@attrs.frozen(kw_only=True)
class Logprobs(ColumnNode):
    """Log-probabilities of a result's tokens, one entry per token (``backend.logprobs``: the target's
    distribution before any sampling transform): ``logprob`` of the token (NaN where its row asked
    for none, or its logits were not finite) and its row's ``top_lens`` best alternatives, packed
    (``top_ids``, best first; ``top_logprobs``). Invariants: ``top_lens`` in [0, MAX_LOGPROBS];
    the packed columns hold ``sum(top_lens)`` entries; ids are >= ``NON_FINITE``."""

    logprob: F64 = column(converter=as_f64, metadata=per(REQUEST))
    top_lens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=0, max=MAX_LOGPROBS))
    top_ids: I64 = column(converter=as_i64, metadata=per(tokens_of("top_lens"), min=NON_FINITE))
    top_logprobs: F64 = column(converter=as_f64, metadata=per(tokens_of("top_lens")))

    def entry(self, i: int) -> dict[str, Any]:
        """Entry ``i`` as an output line writes it: ``{"id", "logprob", "top": [{"id", "logprob"}]}``
        without the ``id`` (the caller knows the token); NaN becomes ``None``."""
        start = int(self.top_lens[:i].sum())
        end = start + int(self.top_lens[i])
        return {
            "logprob": _num(float(self.logprob[i])),
            "top": [{"id": int(t), "logprob": _num(float(v))} for t, v in zip(self.top_ids[start:end].tolist(), self.top_logprobs[start:end].tolist(), strict=True)],
        }


def _num(v: float) -> float | None:
    return None if math.isnan(v) else v


def _check_logprobs(node: ColumnNode, logprobs: object, n: int) -> None:
    if logprobs is None:
        return
    if not isinstance(logprobs, Logprobs):
        raise IRValidationError(type(node).__name__, "logprobs", logprobs, "must be a Logprobs or None")
    if logprobs.num_requests != n:
        raise IRValidationError(type(node).__name__, "logprobs", logprobs.num_requests, f"must hold one entry per token ({n})")


@final
@linear  # its ``hidden`` handle is one-shot
@attrs.frozen(kw_only=True)
class Sampled(ColumnNode, RequestRows):
    """One chosen token per row of a forward, in the plan's row order."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
    tokens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=NON_FINITE))
    logprobs: Logprobs | None = attrs.field(default=None)
    hidden: HiddenStates | None = attrs.field(default=None)
    """The kept hidden states of a prefill that asked for them (its extend rows), else ``None``."""

    def _check(self) -> None:
        _check_logprobs(self, self.logprobs, int(self.tokens.shape[0]))


@final
@linear  # its ``hidden`` handle is one-shot
@attrs.frozen(kw_only=True)
class Verified(ColumnNode, RequestRows):
    """The target's token at every window position of verify ``verify_id`` (``k + 1`` per row,
    row-major), for its rows ``rids`` in its order: the backend names the result by the verify it
    ran (``backend.boundary.checked`` refuses one named otherwise), and ``passes.accept`` judges only
    that verify with it."""

    k: int
    verify_id: VerifyId = attrs.field(metadata=shown("verify", "#"))
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
    tokens: I64 = column(converter=as_i64, metadata=per(WINDOW, min=NON_FINITE))
    logprobs: Logprobs | None = attrs.field(default=None)
    """One entry per window position (row-major), as ``tokens``."""
    hidden: HiddenStates | None = attrs.field(default=None)
    """The kept hidden states of a verify that asked for them, else ``None``."""

    def _check_first(self) -> None:
        check_k(self, self.k)
        if check_int(self, "verify_id", self.verify_id) < 1:
            raise IRValidationError(type(self).__name__, "verify_id", self.verify_id, "must be positive (the VerifyBatch's verify_id)")

    def _check(self) -> None:
        _check_logprobs(self, self.logprobs, int(self.tokens.shape[0]))


@final
@attrs.frozen(kw_only=True)
class Ran(ColumnNode, RequestRows):
    """A plan that samples nothing ran: its rows."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))


Result: TypeAlias = Sampled | Proposals | Verified | Ran
"""Every kind of result a backend gives back for a plan."""
