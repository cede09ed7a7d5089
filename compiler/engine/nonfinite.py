"""Requests whose next token would come from logits that are not finite.

The target's greedy tokens carry ``backend.sampling.NON_FINITE`` (``-1``) for a row, or a verify
window position, whose logits hold a NaN or an infinity. The engine emits the tokens of a row up to
the first flag; if the request is not done by then it ends with ``Ending.ERROR`` (reported with
``finish_reason`` ``"error"`` and ``ERROR_MESSAGE``) instead of receiving a token that is noise.

Speculative rows: a verify window position is read only up to the row's bonus position (the first
rejected draft, or the end of the window), so a flag beyond it changes nothing, as at ``k = 0``
where those positions are never computed. The accept pass never accepts a flag (a draft token is
never ``-1``), so acceptance stops at the first flag at the latest and the flag (from
``bonus_tokens``) is what the row emits last. A NaN at a later window
position can make earlier positions of the same row NaN too (attention and the chunked scan mask
later positions by multiplying them by zero, and ``0 * NaN`` is NaN), so at ``k > 0`` an errored
request may end a few tokens before it would at ``k = 0``: every token it emitted still came from
finite logits, and other rows are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["ERROR_MESSAGE", "bonus_tokens"]

ERROR_MESSAGE = "the model's logits for its next token were not finite (NaN or infinity)"
"""What an errored request's record says (one line)."""


def bonus_tokens(target_tokens: npt.NDArray[np.int64], accepted: Sequence[int], k: int) -> list[int]:
    """Each row's bonus token as the verify gave it: the target token at its accepted position,
    ``NON_FINITE`` where that position's logits were not finite."""
    targets = np.asarray(target_tokens, dtype=np.int64).reshape(-1, k + 1)
    return [int(targets[row, m]) for row, m in enumerate(accepted)]
