"""Golden IR dumps: one file per pass, holding every output of that pass in the built-in scenario.

The scenario (``compiler.tools.scenario``) takes every pass of the non-speculative path: prefill with a
clear and a COW, chunked prefill in MIXED forwards, decode, filter, merge, abort and idle. The
speculative scenario (``golden/spec/``) takes draft, verify, commit and draft extend on the seeded
tiny hybrid model (float32, deterministic on the CPU). A change
to a pass or the printer shows up here as a diff of the full dump. To accept an intended change,
rerun with ``BATCHC_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compiler.manager import PassManager
from compiler.tools.scenario import build_driver, run_scenario, run_spec_scenario

GOLDEN = Path(__file__).resolve().parent / "golden"
PASSES = ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch", "mix_with_running", "lower")
SPEC_PASSES = (
    "prepare_for_extend", "merge_batch", "prepare_for_draft", "prepare_for_verify", "commit",
    "prepare_for_draft_extend", "filter_batch", "lower",
)


def _dumps_by_pass(spec: bool = False) -> dict[str, str]:
    pm = PassManager(verify_level=2, record=True)
    if spec:
        run_spec_scenario(pm)
    else:
        driver, checkpoint = build_driver(pm)
        run_scenario(driver, checkpoint)
        driver.ledger.assert_drained()
    assert pm.trace is not None
    out: dict[str, list[str]] = {}
    for i, (name, text) in enumerate(pm.trace, 1):
        out.setdefault(name, []).append(f"-- step {i:03d} --\n{text}")
    return {name: "".join(texts) for name, texts in out.items()}


def test_scenario_takes_every_pass() -> None:
    assert set(_dumps_by_pass()) == set(PASSES)
    assert set(_dumps_by_pass(spec=True)) == set(SPEC_PASSES)


@pytest.mark.parametrize(
    ("spec", "name"), [(False, p) for p in PASSES] + [(True, p) for p in SPEC_PASSES],
    ids=[p for p in PASSES] + [f"spec-{p}" for p in SPEC_PASSES],
)
def test_golden_dump(spec: bool, name: str) -> None:
    actual = _dumps_by_pass(spec)[name]
    path = GOLDEN / ("spec" if spec else "") / f"{name}.txt"
    if os.environ.get("BATCHC_UPDATE_GOLDEN") == "1":
        path.write_text(actual)
    assert path.exists(), f"missing {path}; run with BATCHC_UPDATE_GOLDEN=1"
    assert actual == path.read_text()


def test_dump_is_deterministic_across_runs() -> None:
    assert _dumps_by_pass() == _dumps_by_pass()
