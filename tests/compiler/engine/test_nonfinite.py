"""Logits that are not finite end the requests whose next token they would give, with the engine's
``Ending.ERROR`` (``Engine.errored``, ``StepReport.errored``): the others are served as without the
poison, and nothing a flagged row emits comes from such logits, at k = 0 (mixed forwards on and
off) and through the verify at k > 0."""

from __future__ import annotations

import numpy as np
import pytest

from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from backend.sampling import NON_FINITE, greedy_or_flag
from compiler.engine import Engine
from compiler.engine.nonfinite import bonus_tokens
from ir.ids import RequestId
from ir.results import Verified
from ir.spec import VerifyBatch
from passes.accept import accept

NEW = 8


def test_greedy_or_flag_flags_rows_whose_maximum_is_nan_or_infinite() -> None:
    import torch

    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, 3.0, 3.0, 2.0],  # a tie: the lowest id, as argmax
        [2.0, nan, 1.0, 2.0],  # a NaN anywhere is the row's maximum
        [-inf, -inf, -inf, -inf],
        [1.0, inf, 0.0, 5.0],
        [0.0, -inf, 4.0, -inf],  # a finite maximum decides: the greedy token is well defined
        [nan, nan, nan, nan],
    ])
    assert greedy_or_flag(logits).tolist() == [1, NON_FINITE, NON_FINITE, NON_FINITE, 2, NON_FINITE]
    assert greedy_or_flag(logits[:4].reshape(2, 2, 4)).tolist() == [[1, NON_FINITE], [NON_FINITE, NON_FINITE]]
    clean = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy_or_flag(clean), clean.argmax(dim=-1))


def test_a_flag_in_a_verify_window_is_never_accepted_and_is_the_bonus_where_acceptance_stops() -> None:
    k = 3
    proposals = np.array([5, 0, 7, 4, 4, 4], dtype=np.int64)
    # row 0: the target agrees with 5, then its logits are not finite where the draft said 0
    # row 1: it disagrees at position 1 already; the flag at position 2 lies beyond its bonus
    targets = np.array([5, NON_FINITE, NON_FINITE, 9, 4, 8, NON_FINITE, 1], dtype=np.int64)
    verify = VerifyBatch(
        k=k, verify_id=1, draft_id=2, rids=[1, 2], slots=[1, 2], seq_lens=[4, 4],
        input_ids=np.concatenate([np.zeros((2, 1), dtype=np.int64), proposals.reshape(2, k)], axis=1).reshape(-1), kv_locs=range(8),
    )
    result = accept(verify, Verified(k=k, verify_id=verify.verify_id, rids=verify.rids, tokens=targets))
    assert result.accepted.tolist() == [1, 1]
    assert result.bonus.tolist() == bonus_tokens(targets, [1, 1], k) == [NON_FINITE, 8]
    clean = np.arange(8, dtype=np.int64)
    assert accept(verify, Verified(k=k, verify_id=verify.verify_id, rids=verify.rids, tokens=clean)).accepted.tolist() == [0, 1]


def _serve(target: HybridModel, draft: HybridModel | None, k: int, prompts: dict[int, list[int]], mixed: bool = True) -> tuple[Engine, set[int]]:
    drv = Engine(target, draft, k=k, capacity=8, kv_capacity=512, max_len=64, mixed=mixed)
    for i, (rid, prompt) in enumerate(prompts.items()):
        drv.admit(RequestId(rid), prompt, max_new_tokens=NEW + i)
    reported: set[int] = set()
    for _ in range(200):
        if not drv.live:
            break
        reported |= {int(r) for r in drv.step().errored}
    drv.sync()
    drv.drop_cache()
    assert not drv.live and drv.slots.num_live == 0 and drv.kv.num_live == 0 and not drv.ledger.outstanding()
    return drv, reported


PROMPTS = {1: list(b"the cat sat"), 2: list(b"on the mat "), 3: list(b"and then it ")}


@pytest.fixture(scope="module")
def clean() -> dict[int, list[int]]:
    """The outputs without the poison (greedy, so the same at every k and with mixed forwards or not)."""
    drv, _ = _serve(HybridModel.from_seed(tiny(), seed=0), None, 0, PROMPTS)
    return {int(r): out for r, out in drv.outputs.items()}


@pytest.mark.parametrize(("k", "mixed"), [(0, True), (0, False), (2, True)], ids=["k0-mixed", "k0", "k2"])
def test_requests_whose_logits_are_not_finite_end_in_error_and_the_others_are_served(
    clean: dict[int, list[int]], k: int, mixed: bool,
) -> None:
    prompts = dict(PROMPTS)
    draft = HybridModel.from_seed(tiny(), seed=1) if k else None
    want = clean
    # a token request 2 generates (not first), that neither its prompt nor request 3 ever holds;
    # request 1's prompt is made to hold it too
    at, poison = next((j, t) for j, t in enumerate(want[2]) if j >= 1 and t not in want[2][:j] and t not in prompts[2]
                      and t not in prompts[3] + want[3])
    prompts[1] = prompts[1] + [poison] + list(b" too")
    target = HybridModel.from_seed(tiny(), seed=0)
    target.weights["embed"][poison, 0] = float("inf")  # a position fed this token has NaN logits, and so does every later one
    drv, reported = _serve(target, draft, k, prompts, mixed)
    assert drv.errored == {1, 2} and reported == {1, 2}
    assert drv.outputs[RequestId(1)] == []  # its prefill's last logits already are NaN
    out2 = drv.outputs[RequestId(2)]
    if k == 0:
        assert out2 == want[2][: at + 1]  # the poisoned token itself came from finite logits
    else:  # a later NaN in a verify window can flag its earlier positions (masked products): a prefix
        assert out2 == want[2][: len(out2)] and len(out2) <= at + 1
    assert drv.outputs[RequestId(3)] == want[3] and 3 not in drv.errored
