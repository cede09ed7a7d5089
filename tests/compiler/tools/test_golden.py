"""Golden IR dumps: one file per pass, holding every output of that pass in the built-in scenario.

The scenario (``compiler.tools.scenario``, the engine at k = 0 on the seeded tiny hybrid model) takes
every pass of the non-speculative path: prefill with a clear and a COW from the engine's prefix cache,
chunked prefill in MIXED forwards, decode, filter, merge, abort and idle. The speculative scenario
(``golden/spec/``) takes draft, verify, commit and draft commit on the seeded tiny hybrid model
(float32, deterministic on the CPU). A change
to a pass or the printer shows up here as a diff of the full dump. To accept an intended change,
rerun with ``BATCHC_UPDATE_GOLDEN=1`` (or ``--batchc-update-golden``) and review the diff
(``compiler.testing.golden.assert_golden_ir``: the dumps must also parse back with ``ir.parse``).
"""

from __future__ import annotations

import pytest

from compiler.engine import StepKind
from compiler.manager import PassManager
from compiler.testing.golden import assert_golden_ir
from compiler.tools.scenario import CACHE_BLOCK, PROMPTS, run_scenario, run_spec_scenario
from ir.ids import TARGET_POOL, RequestId
from tests.helpers import GOLDEN

PASSES = ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch", "mix_with_running", "lower")
SPEC_PASSES = (
    "prepare_for_extend", "merge_batch", "prepare_for_draft", "prepare_for_verify", "commit",
    "prepare_for_draft_commit", "filter_batch", "lower",
)


def _dumps_by_pass(spec: bool = False) -> dict[str, str]:
    pm = PassManager(verify_level=2, record=True)
    if spec:
        run_spec_scenario(pm)
    else:
        run_scenario(pm)
    assert pm.trace is not None
    out: dict[str, list[str]] = {}
    for i, (name, text) in enumerate(pm.trace, 1):
        out.setdefault(name, []).append(f"-- step {i:03d} --\n{text}")
    return {name: "".join(texts) for name, texts in out.items()}


def test_scenario_takes_every_pass() -> None:
    assert set(_dumps_by_pass()) == set(PASSES)
    assert set(_dumps_by_pass(spec=True)) == set(SPEC_PASSES)


def test_scenario_has_a_clear_a_cow_from_the_prefix_cache_chunks_in_mixed_forwards_and_an_abort() -> None:
    """What the goldens are traces of, asserted on the engine rather than read off the dumps."""
    engine, reports = run_scenario(PassManager(verify_level=2, record=True))
    kinds = [r.kind for r in reports]
    assert kinds[:2] == [StepKind.EXTEND, StepKind.EXTEND]  # request 0's first chunk; its last and request 1's COW
    assert kinds.count(StepKind.MIXED) >= 2 and {StepKind.DECODE, StepKind.IDLE} <= set(kinds)
    assert reports[0].prefill_tokens == CACHE_BLOCK  # request 0's first chunk ends at the cached boundary
    cache = engine.cache
    assert cache is not None
    assert (cache.stats.snapshots, cache.stats.hits, cache.stats.hit_tokens) == (1, 1, CACHE_BLOCK)
    counts = engine.ledger.counts(TARGET_POOL)
    assert (counts.clears, counts.cows, counts.snapshots) == (3, 1, 1)  # requests 0, 2, 3 fresh; 1 copied
    assert engine.stats.mixed >= 2 and engine.stats.aborts == 1
    assert len(engine.outputs[RequestId(3)]) == 1  # aborted right after its prefill's first token
    assert all(len(engine.outputs[RequestId(i)]) == 4 for i in (0, 1, 2)) and sorted(engine.outputs) == sorted(PROMPTS)
    assert engine.slots.num_live == 0 and engine.kv.num_live == 0


@pytest.mark.parametrize(
    ("spec", "name"), [(False, p) for p in PASSES] + [(True, p) for p in SPEC_PASSES],
    ids=[p for p in PASSES] + [f"spec-{p}" for p in SPEC_PASSES],
)
def test_golden_dump(spec: bool, name: str) -> None:
    assert_golden_ir(_dumps_by_pass(spec)[name], GOLDEN / ("spec" if spec else "") / f"{name}.txt")


def test_dump_is_deterministic_across_runs() -> None:
    assert _dumps_by_pass() == _dumps_by_pass()
