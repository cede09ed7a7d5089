"""``compiler.tools.bench_iteration`` runs every phase of an iteration on real models and reports it
in target-decode units (the figures themselves are measured by the benchmark, never asserted)."""

from __future__ import annotations

from compiler.tools.bench_iteration import run_iteration_bench
from tests.helpers import tiny_models


def test_every_phase_is_timed_in_decode_units() -> None:
    target, draft = tiny_models()
    report = run_iteration_bench(target, draft, rows=3, k=2, repeats=1)
    per = {p.phase: p for p in report.phases}
    assert list(per) == ["decode", "verify", "commit", "propose", "draft commit", "propose k", "draft extend"]
    assert per["decode"].decodes == 1.0
    assert all(p.seconds > 0 and p.decodes > 0 for p in report.phases)
    assert report.iteration_decodes == per["verify"].decodes + per["commit"].decodes + per["propose"].decodes + per["draft commit"].decodes
    assert report.replaced_iteration_decodes == (
        per["verify"].decodes + per["commit"].decodes + per["propose k"].decodes + per["draft extend"].decodes
    )
    assert (report.rows, report.k, report.repeats) == (3, 2, 1)


def test_a_head_adds_its_phases_and_its_iteration() -> None:
    from backend.hybrid.head import HeadConfig, HeadModel

    target, draft = tiny_models()
    head = HeadModel.from_seed(HeadConfig.for_target(target.config, ("mamba", "attn")), target, 0)
    report = run_iteration_bench(target, draft, rows=3, k=2, repeats=1, head=head)
    per = {p.phase: p.decodes for p in report.phases}
    assert list(per)[-2:] == ["head propose", "head commit"] and per["head propose"] > 0 and per["head commit"] > 0
    assert dict(report.iterations) == {
        "model": report.iteration_decodes, "mtp": per["verify"] + per["commit"] + per["head propose"] + per["head commit"],
    }
    assert [i["draft"] for i in report.to_json()["iterations"]] == ["model", "mtp"]  # type: ignore[attr-defined]  # (to_json: a dict of objects)


def test_a_head_alone_is_timed_without_a_separate_draft() -> None:
    """A target with only a head (a Hugging Face checkpoint and the head trained for it, say)."""
    from backend.hybrid.head import HeadConfig, HeadModel

    target, _ = tiny_models()
    head = HeadModel.from_seed(HeadConfig.for_target(target.config, ("mamba",)), target, 0)
    report = run_iteration_bench(target, None, rows=2, k=3, repeats=1, head=head)
    assert [p.phase for p in report.phases] == ["decode", "verify", "commit", "head propose", "head commit"]
    assert report.iteration_decodes is None and report.replaced_iteration_decodes is None and [kind for kind, _ in report.iterations] == ["mtp"]


def test_the_rows_hold_the_context_asked_for() -> None:
    """``context``: the tokens each row holds before the phases are timed (served requests hold
    hundreds; a decode over a longer context costs more, and it is the unit)."""
    import pytest

    from compiler.cli.args import ITERATION_CONTEXT
    from compiler.tools.bench_iteration import PROMPT_LEN, _Side

    target, draft = tiny_models()
    side = _Side(target, 2, 2, 30)
    assert side.next_loc == 2 * 30 + 1 and side.table.max_len == 30 + 4 * 3
    assert side.table.table[1, :30].tolist() == list(range(1, 31)) and side.table.table[2, :30].tolist() == list(range(31, 61))
    report = run_iteration_bench(target, draft, rows=2, k=2, repeats=1, context=30)
    assert report.context == 30 and report.to_json()["context"] == 30
    assert run_iteration_bench(target, draft, rows=2, k=1, repeats=1).context == PROMPT_LEN == ITERATION_CONTEXT
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="context must be a positive int"):
            run_iteration_bench(target, draft, rows=2, k=1, repeats=1, context=bad)
