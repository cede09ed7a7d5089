"""Golden IR dumps: one file per pass, holding every output of that pass in the built-in scenario.

The scenario (``compiler.scenario``) takes every pass of the non-speculative path: prefill with a
clear and a COW, chunked prefill in MIXED forwards, decode, filter, merge, abort and idle. A change
to a pass or the printer shows up here as a diff of the full dump. To accept an intended change,
rerun with ``BATCHC_UPDATE_GOLDEN=1`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from compiler.manager import PassManager
from compiler.scenario import build_driver, run_scenario

GOLDEN = Path(__file__).resolve().parent / "golden"
PASSES = ("prepare_for_extend", "prepare_for_decode", "filter_batch", "merge_batch", "mix_with_running", "lower")


def _dumps_by_pass() -> dict[str, str]:
    pm = PassManager(verify_level=2, record=True)
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


@pytest.mark.parametrize("name", PASSES)
def test_golden_dump(name: str) -> None:
    actual = _dumps_by_pass()[name]
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("BATCHC_UPDATE_GOLDEN") == "1":
        path.write_text(actual)
    assert path.exists(), f"missing {path}; run with BATCHC_UPDATE_GOLDEN=1"
    assert actual == path.read_text()


def test_dump_is_deterministic_across_runs() -> None:
    assert _dumps_by_pass() == _dumps_by_pass()
