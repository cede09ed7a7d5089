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
  row, row-major; the accept pass compares them with the proposals.
- ``Ran`` for a plan that samples nothing (commits, draft commits, idle).

A token is ``NON_FINITE`` (``-1``, never a token id) where the logits behind it held a NaN or an
infinity: whoever reads it ends that request instead of emitting it.
"""

from __future__ import annotations

from typing import TypeAlias, final

import attrs

from ir.columns import I64, REQUEST, WINDOW, ColumnNode, RequestRows, as_i64, column, per
from ir.spec import Proposals, check_k

NON_FINITE = -1
"""The token a sampler gives a row whose logits were not finite (a NaN or an infinity)."""


@final
@attrs.frozen(kw_only=True)
class Sampled(ColumnNode, RequestRows):
    """One chosen token per row of a forward, in the plan's row order."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
    tokens: I64 = column(converter=as_i64, metadata=per(REQUEST, min=NON_FINITE))


@final
@attrs.frozen(kw_only=True)
class Verified(ColumnNode, RequestRows):
    """The target's token at every window position of a verify (``k + 1`` per row, row-major)."""

    k: int
    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))
    tokens: I64 = column(converter=as_i64, metadata=per(WINDOW, min=NON_FINITE))

    def _check_first(self) -> None:
        check_k(self, self.k)


@final
@attrs.frozen(kw_only=True)
class Ran(ColumnNode, RequestRows):
    """A plan that samples nothing ran: its rows."""

    rids: I64 = column(converter=as_i64, metadata=per(REQUEST))


Result: TypeAlias = Sampled | Proposals | Verified | Ran
"""Every kind of result a backend gives back for a plan."""
