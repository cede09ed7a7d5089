"""``batchc bench serve``: the JSON rows of the bench (built-in workload and the running-batch
sweep), their medians and ratios, the sampled rows (``--temperature``, ``--top-p``: the compiled
engine only, with acceptance and the sampler's time), and the mutable baseline's serving loop the
bench shares with ``run --compare-mutable``. Tiny workloads; performance is measured by the bench,
never asserted here."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import attrs
import pytest
import torch

from backend.hybrid.checkpoint import HEAD_FILE, bundled_path, default_draft
from backend.hybrid.head import HeadModel, load_head
from backend.hybrid.model import HybridModel
from backend.hybrid.outputs import ForwardOut, VerifyStates
from compiler.cli import main
from compiler.engine import StepKind, StepReport
from compiler.offline import Request, ServeConfig, make_engine, serve
from compiler.offline.latency import Latencies
from compiler.offline.models import load_served
from compiler.tools import bench_serve
from compiler.tools.bench_serve import (
    ENGINES,
    GREEDY_SAMPLING,
    REPLAY_MAX_TIMES,
    REPLAY_MIN_TIMES,
    BenchCase,
    Sampling,
    ServeRun,
    builtin_cases,
    measure,
    percentile,
    summarise,
    sweep_cases,
    sweep_workload,
)
from compiler.tools.compare_mutable import make_mutable, serve_mutable
from compiler.tools.timed import NO_STATES, ReplayDiverged, Tape, TimedHead, TimedModel, recording, replaying, timing_sampler
from compiler.workload import SWEEP_NEW_TOKENS
from ir.ids import RequestId
from tests.helpers import REVIEW_NEW, REVIEW_PROMPTS, run_cli, tiny_models

ROW_FIELDS = {
    "k": int, "engine": str, "overlap": bool, "running": int, "tokens_per_s": float, "host_ms_per_step": float,
    "steps": int, "tokens": int, "wall_s": float, "model_s": float, "repeats": int, "runs": list, "workload": str,
    "arrivals": str, "max_running": int, "tokens_per_s_min": float, "tokens_per_s_max": float, "sampling": str, "temperature": float,
    "top_p": float, "proposed": int, "accepted": int,
}


def _rows(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[dict[str, object]], str]:
    path = tmp_path / "bench.json"
    assert main(["bench", "serve", *args, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())
    assert isinstance(rows, list)
    for row in rows:
        for name, kind in ROW_FIELDS.items():
            assert isinstance(row[name], kind) and not (kind is int and isinstance(row[name], bool)), (name, row)
        assert row["engine"] in ENGINES and (row["overlap"] is False or row["engine"] == "compiled")
        assert row["repeats"] == len(row["runs"]) and row["steps"] > 0 and row["tokens"] > 0
        for run in row["runs"]:  # every forward the model clock counts lies within the run's wall time
            assert 0.0 < run["model_s"] < run["wall_s"], run
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p90"]  # type: ignore[operator]  # JSON numbers
        sampled = row["temperature"] > 0  # type: ignore[operator]  # a JSON number
        assert row["sampling"] == ("greedy" if not sampled else f"t={row['temperature']:g}" + (f" p={row['top_p']:g}" if row["top_p"] != 1 else ""))
        assert row["engine"] == "compiled" or not sampled  # the baselines decode greedily only
        assert (row["tokens_per_s_vs_greedy"] is None) == (not sampled)
        assert sampled or row["tokens_per_s_vs_mutable_fixed"] is not None or row["engine"] != "mutable-fixed"
        assert not sampled or row["tokens_per_s_vs_mutable_fixed"] is None
        # acceptance at k > 0 for every engine (the engine's counts, warm-up excluded); none at k = 0
        if row["k"] == 0:
            assert row["acceptance"] is None and row["proposed"] == 0
        else:
            assert row["proposed"] > 0 and row["acceptance"] == pytest.approx(row["accepted"] / row["proposed"])  # type: ignore[operator]
            assert row["proposed"] == sum(run["proposed"] for run in row["runs"])  # type: ignore[attr-defined]  # JSON lists
        # the sampler's time: the compiled engine in one process only, always some, never more than the run's host time
        if row["engine"] == "compiled" and not row["overlap"]:
            assert row["sampler_share"] > 0  # type: ignore[operator]  # a JSON number
            for run in row["runs"]:  # type: ignore[attr-defined]  # JSON lists
                assert 0.0 < run["sampler_s"] < run["wall_s"] - run["model_s"], run
        else:
            assert row["sampler_share"] is None and all(run["sampler_s"] is None for run in row["runs"])  # type: ignore[attr-defined]
    return rows, out


def test_bench_serve_json_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _rows(["--requests", "2", "--max-new-tokens", "2", "--repeats", "1"], tmp_path, capsys)
    assert [(r["arrivals"], r["k"], r["engine"]) for r in rows] == [(a, k, e) for a in ("bursts", "trickle") for k in (0, 2) for e in ENGINES]
    for row in rows:
        assert row["workload"] == "builtin" and row["repeats"] == 1 and row["max_running"] == ServeConfig().max_running
        if row["arrivals"] == "bursts":
            assert row["running"] == 2  # both requests arrive in the first burst
        assert row["tokens"] == rows[0]["tokens"]  # every engine generates the same tokens
        same = [r for r in rows if r["k"] == row["k"] and r["arrivals"] == row["arrivals"]]
        assert row["tokens_per_s_vs_mutable_fixed"] == pytest.approx(
            row["tokens_per_s"] / next(r["tokens_per_s"] for r in same if r["engine"] == "mutable-fixed"))
        k0 = next(r for r in rows if r["k"] == 0 and r["engine"] == row["engine"] and r["arrivals"] == row["arrivals"])
        assert row["tokens_per_s_vs_k0"] == pytest.approx(row["tokens_per_s"] / k0["tokens_per_s"])
        # one repeat: its one paired ratio is the ratio of the medians
        assert row["paired_vs_mutable_fixed"] == [pytest.approx(row["tokens_per_s_vs_mutable_fixed"])]
        assert row["paired_vs_k0"] == [pytest.approx(row["tokens_per_s_vs_k0"])]
        assert row["tpot_ms_p50"] is not None  # two new tokens each: one gap per request
        # a speculative step's wall time in the same engine's decode steps at k = 0 (each request's second token comes from a
        # decode step, or on the compiled engine from a MIXED forward that also prefills: then there is no decode step to divide by)
        if row["k"] == 0:
            assert row["spec_step_ms"] is None and row["iteration_decodes"] is None
            assert row["decode_step_ms"] is not None or row["engine"] == "compiled"
        else:
            assert row["decode_step_ms"] is None and row["spec_step_ms"] > 0  # type: ignore[operator]
            assert row["iteration_decodes"] == (
                pytest.approx(row["spec_step_ms"] / k0["decode_step_ms"]) if k0["decode_step_ms"] is not None else None)  # type: ignore[operator]
    assert "median of 1 interleaved repeats per (arrivals, k, engine, running, sampling), with their range" in out
    assert "vs fixed" in out and "paired" in out and "vs k=0" in out and "host ms" in out and "TTFT" in out and "TPOT" in out
    assert "mutable-fixed" in out  # the widest engine name is not cut: the table fits a pipe's width
    flat = " ".join(out.split())  # (the console wraps the caption where the terminal width falls)
    assert "sampling" in out and "accept" in out and "sampler" in out and "batchc bench sampler" in flat and "it/dec" in out
    assert "vs greedy" not in out and {r["sampling"] for r in rows} == {"greedy"}


def test_bench_serve_samples_on_the_compiled_engine_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--requests", "3", "--max-new-tokens", "4", "--repeats", "2", "--arrivals", "bursts"]
    rows, out = _rows([*args, "--temperature", "1", "--top-p", "0.9"], tmp_path, capsys)
    greedy = [(r["k"], r["engine"], r["sampling"]) for r in rows if r["sampling"] == "greedy"]
    assert greedy == [(k, e, "greedy") for k in (0, 2) for e in ENGINES]  # the greedy rows as without --temperature
    sampled = [r for r in rows if r["sampling"] != "greedy"]
    assert [(r["k"], r["engine"], r["sampling"], r["temperature"], r["top_p"]) for r in sampled] == [
        (k, "compiled", "t=1 p=0.9", 1.0, 0.9) for k in (0, 2)
    ]
    for r in sampled:
        assert r["repeats"] == 2 and r["tokens_per_s_vs_mutable_fixed"] is None
        base = next(g for g in rows if g["sampling"] == "greedy" and g["engine"] == "compiled" and g["k"] == r["k"])
        assert r["tokens_per_s_vs_greedy"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])  # type: ignore[operator]
        k0 = next(s for s in sampled if s["k"] == 0)
        assert r["tokens_per_s_vs_k0"] == pytest.approx(r["tokens_per_s"] / k0["tokens_per_s"])  # type: ignore[operator]
        assert len({run["tokens"] for run in r["runs"]}) == 1  # type: ignore[attr-defined]  # seeded: every repeat samples the same tokens
    assert next(r for r in sampled if r["k"] == 2)["acceptance"] is not None
    assert "vs greedy" in out and "t=1 p=0.9" in out and "temperature 1, top_p 0.9" in " ".join(out.split())
    # --temperature 0 is greedy: no sampled rows
    zero, out = _rows([*args, "--temperature", "0"], tmp_path, capsys)
    assert [(r["k"], r["engine"], r["sampling"]) for r in zero] == greedy and "vs greedy" not in out




@pytest.mark.parametrize(("argv", "message"), [
    (["--top-p", "0.9"], "--top-p 0.9 without --temperature > 0"),
    (["--temperature", "0", "--top-p", "0.5"], "--top-p 0.5 without --temperature > 0"),
    (["--temperature", "1", "--tp", "2"], "--temperature 1 with --tp 2"),
    (["--temperature", "-1"], "argument --temperature: expected a finite number in [0, inf), got -1"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number"),
    (["--top-p", "0", "--temperature", "1"], "argument --top-p: expected a finite number in (0, 1], got 0"),
    (["--top-p", "1.5", "--temperature", "1"], "argument --top-p: expected a finite number in (0, 1], got 1.5"),
])
def test_bench_serve_refuses_bad_sampling_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", "serve", "--requests", "1", "--max-new-tokens", "1", "--repeats", "1", *argv])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code  # type: ignore[assignment]  # an int here
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_sampled_cases_are_the_greedy_workload_sampled() -> None:
    t1 = Sampling(temperature=1.0, top_p=0.9)
    cases = builtin_cases(requests=5, max_new_tokens=6, arrivals=("trickle",), sampled=t1)
    assert [(c.k, c.sampling) for c in cases] == [(0, GREEDY_SAMPLING), (2, GREEDY_SAMPLING), (0, t1), (2, t1)]
    greedy, sampled = cases[0].requests, cases[2].requests
    for g, s in zip(greedy, sampled, strict=True):  # the same prompts, lengths and arrivals; the seed left to the engine
        assert (g.rid, g.prompt, g.max_new_tokens, g.arrival) == (s.rid, s.prompt, s.max_new_tokens, s.arrival)
        assert g.sampling.temperature == 0 and (s.sampling.temperature, s.sampling.top_p, s.sampling.seed) == (1.0, 0.9, None)
    assert cases[2].engines == ("compiled",) and cases[0].engines == ENGINES
    assert builtin_cases(requests=5, max_new_tokens=6, arrivals=("trickle",), sampled=Sampling()) == cases[:2]
    assert (Sampling().label, Sampling(temperature=0.5).label, t1.label) == ("greedy", "t=0.5", "t=1 p=0.9")
    target, draft = tiny_models()
    with pytest.raises(ValueError, match="for a t=1 p=0.9 case, got 'mutable-fixed'"):
        measure(cases[2], "mutable-fixed", TimedModel(target), TimedModel(draft))


def test_the_sampler_clock_times_the_executors_sampler_calls_and_restores_them() -> None:
    import backend.executor as executor
    import backend.plan_sampling as plan_sampling

    target, draft = tiny_models()
    case = builtin_cases(requests=2, max_new_tokens=4, arrivals=("bursts",), sampled=Sampling(temperature=1.0))[3]
    with timing_sampler() as clock:
        assert executor.sample_logits is not plan_sampling.sample_logits
        with pytest.raises(RuntimeError, match="already timed"), timing_sampler():
            pass
        run = measure(case, "compiled", TimedModel(target), TimedModel(draft), sampler=clock)
        assert run.sampler_s is not None and run.sampler_s == clock.seconds > 0 and run.proposed > 0
        untimed = measure(case, "compiled", TimedModel(target), TimedModel(draft))
        assert untimed.sampler_s is None and untimed.sampler_share is None
    assert executor.sample_logits is plan_sampling.sample_logits and executor.verify_tokens is plan_sampling.verify_tokens


def test_bench_serve_measures_the_arrival_patterns_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, _ = _rows(["--requests", "2", "--max-new-tokens", "2", "--repeats", "1", "--arrivals", "trickle"], tmp_path, capsys)
    assert {r["arrivals"] for r in rows} == {"trickle"} and len(rows) == 2 * len(ENGINES)
    assert main(["bench", "serve", "--sweep", "2", "--arrivals", "bursts"]) == 2
    assert "--arrivals bursts with --sweep" in capsys.readouterr().err
    assert main(["bench", "serve", "--sweep", "2", "--prefill-streak", "1"]) == 2
    assert "--prefill-streak 1 with --sweep" in capsys.readouterr().err


def test_bench_serve_takes_the_compiled_engines_scheduling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _rows(["--requests", "2", "--max-new-tokens", "2", "--repeats", "1", "--arrivals", "bursts", "--chunk-size", "16",
                       "--token-budget", "32", "--prefill-streak", "1", "--cache-entries", "2"], tmp_path, capsys)
    assert "chunks of 16, 32 prefill tokens a step, alternate, 2 cache entries" in " ".join(out.split())
    default = _rows(["--requests", "2", "--max-new-tokens", "2", "--repeats", "1", "--arrivals", "bursts"], tmp_path, capsys)[0]
    by_engine = {(r["k"], r["engine"]): r for r in default}
    for r in rows:  # small chunks take more steps on the compiled engine; the baselines do not take the options
        steps = by_engine[(r["k"], r["engine"])]["steps"]
        assert r["steps"] > steps if r["engine"] == "compiled" else r["steps"] == steps


def test_bench_serve_overlap_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _rows(["--requests", "3", "--max-new-tokens", "2", "--repeats", "1", "--overlap", "--arrivals", "bursts"], tmp_path, capsys)
    assert [(r["k"], r["engine"], r["overlap"]) for r in rows] == [
        (k, e, o) for k in (0, 2) for e in ENGINES for o in ((False, True) if e == "compiled" else (False,))
    ]
    assert len({r["tokens"] for r in rows}) == 1  # the overlapped engine generates the same tokens
    assert "compiled +overlap" in out


def test_bench_serve_sweep_rows_are_sized_by_the_running_batch_and_sampled_on_the_compiled_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rows, out = _rows(["--sweep", "3", "2", "3", "--repeats", "1", "--temperature", "0.7"], tmp_path, capsys)
    greedy = [r for r in rows if r["sampling"] == "greedy"]
    assert len(greedy) == 2 * 2 * len(ENGINES)  # B = 3 and 2 (the repeated 3 once), k = 0 and 2, every engine
    assert {(r["running"], r["k"], r["engine"]) for r in greedy} == {(b, k, e) for b in (2, 3) for k in (0, 2) for e in ENGINES}
    # each running batch sampled too, on the compiled engine only
    assert sorted((r["running"], r["k"], r["engine"], r["sampling"]) for r in rows if r["sampling"] != "greedy") == [
        (b, k, "compiled", "t=0.7") for b in (2, 3) for k in (0, 2)
    ]
    for row in rows:
        assert row["workload"] == "sweep"
        assert row["tokens"] == row["running"] * SWEEP_NEW_TOKENS
    assert "sweep, running = B requests arriving together" in out


def test_bench_serve_sweep_takes_the_new_tokens_of_every_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _rows(["--sweep", "2", "--max-new-tokens", "11", "--k", "0", "--repeats", "1"], tmp_path, capsys)
    assert [(r["running"], r["engine"], r["tokens"]) for r in rows] == [(2, e, 2 * 11) for e in ENGINES]
    assert "11 new tokens each" in " ".join(out.split())


def test_sweep_prompts_of_a_given_length() -> None:
    """``prompt_len``: every prompt exactly that many bytes, starting as the default prompt does (the
    shared system prefixes stay shared) and continued with bundled snippets; without it the prompts
    are the default ones; the engines' contexts are sized for it."""
    default = sweep_workload(6)
    for n in (5, 300, 1500):
        longer = sweep_workload(6, prompt_len=n)
        assert [len(r.prompt) for r in longer] == [n] * 6
        assert all(r.prompt[: min(n, len(d.prompt))] == d.prompt[: min(n, len(d.prompt))] for r, d in zip(longer, default, strict=True))
    assert sweep_workload(6, prompt_len=None) == default
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="prompt_len must be a positive int"):
            sweep_workload(2, prompt_len=bad)
    (case,) = sweep_cases([4], ks=(0,), prompt_len=1000)
    assert {len(r.prompt) for r in case.requests} == {1000} and case.cfg.max_len >= 1000 + SWEEP_NEW_TOKENS + 1


def test_bench_serve_takes_a_sweep_prompt_length_and_refuses_it_without_a_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows, out = _rows(["--sweep", "2", "--prompt-len", "70", "--max-new-tokens", "2", "--k", "0", "--repeats", "1"], tmp_path, capsys)
    assert [(r["running"], r["tokens"]) for r in rows] == [(2, 4)] * len(ENGINES)
    assert "prompts of 70 bytes" in " ".join(out.split())
    assert run_cli(["bench", "serve", "--prompt-len", "70"]) == 2
    assert "--prompt-len 70 without --sweep" in capsys.readouterr().err


def test_sweep_cases_size_every_engine_for_the_batch() -> None:
    workload = sweep_workload(256)
    assert len(workload) == 256 and {r.arrival for r in workload} == {0}
    assert {r.max_new_tokens for r in workload} == {SWEEP_NEW_TOKENS}
    for case in sweep_cases([256]):
        cfg = case.cfg
        assert cfg.max_running == 256 and cfg.token_budget == 256 * cfg.chunk_size
        assert max(len(r.prompt) for r in case.requests) + SWEEP_NEW_TOKENS + cfg.reserve <= cfg.max_len


def _run(engine: str, k: int, tokens_per_s: float, repeat: int, running: int = 8, overlap: bool = False,
         sampling: Sampling = GREEDY_SAMPLING) -> ServeRun:
    return ServeRun(workload="builtin", arrivals="bursts", k=k, engine=engine, overlap=overlap, running=running, max_running=running,
                    tokens=100, steps=10,
                    wall_s=100 / tokens_per_s, model_s=0.5 * 100 / tokens_per_s, repeat=repeat, sampling=sampling)


def test_sampled_rows_compare_with_the_greedy_row_and_pool_their_acceptance() -> None:
    t1 = Sampling(temperature=1.0, top_p=0.9)
    runs = [_run(e, k, 100.0 * (1 + k), 0) for k in (0, 2) for e in ENGINES]
    runs += [attrs.evolve(_run("compiled", k, 50.0 * (1 + k) * (1 + rep), rep, sampling=t1), proposed=10 * k * (1 + rep),
                          accepted=k * (1 + 3 * rep), sampler_s=0.01 * (1 + rep)) for k in (0, 2) for rep in range(3)]
    rows = {(r.k, r.engine, r.sampling): r for r in summarise(runs)}
    assert len(rows) == 2 * len(ENGINES) + 2
    s2 = rows[(2, "compiled", t1)]
    assert s2.repeats == 3 and s2.tokens_per_s == pytest.approx(300.0)
    assert s2.vs_greedy == pytest.approx(1.0) and s2.vs_mutable_fixed is None and s2.vs_k0 == pytest.approx(3.0)
    assert s2.acceptance == pytest.approx((2 + 8 + 14) / (20 + 40 + 60))  # pooled over the repeats, not a median of rates
    # each run's sampler time over its model time (0.01 / (1/3), 0.02 / (1/6), 0.03 / (1/9)): their median
    assert s2.sampler_share == pytest.approx(0.12)
    assert rows[(0, "compiled", t1)].acceptance is None and rows[(0, "compiled", t1)].vs_greedy == pytest.approx(1.0)
    assert summarise([*runs, attrs.evolve(runs[-1], repeat=3, sampler_s=None)])[-1].sampler_share is None  # not measured in every run
    assert rows[(2, "compiled", GREEDY_SAMPLING)].vs_greedy is None and rows[(2, "mutable", GREEDY_SAMPLING)].sampler_share is None
    assert s2.to_json()["sampling"] == "t=1 p=0.9" and s2.to_json()["temperature"] == 1.0 and s2.to_json()["top_p"] == 0.9


def test_rows_report_the_median_of_the_repeats_and_ratios_of_the_medians() -> None:
    runs = [_run(e, k, tps * (1 + k) * (2 if e == "compiled" else 1), rep)
            for rep, tps in enumerate((100.0, 300.0, 200.0)) for k in (0, 2) for e in ENGINES]
    rows = {(r.k, r.engine): r for r in summarise(runs)}
    assert len(rows) == 6
    compiled0 = rows[(0, "compiled")]
    assert compiled0.tokens_per_s == pytest.approx(400.0) and compiled0.repeats == 3
    assert (compiled0.tokens_per_s_min, compiled0.tokens_per_s_max) == pytest.approx((200.0, 600.0))
    assert compiled0.wall_s == pytest.approx(0.25) and compiled0.host_ms_per_step == pytest.approx(12.5)
    assert compiled0.vs_mutable_fixed == pytest.approx(2.0) and compiled0.vs_k0 == pytest.approx(1.0)
    assert rows[(2, "compiled")].vs_k0 == pytest.approx(3.0)
    assert rows[(2, "mutable")].vs_mutable_fixed == pytest.approx(1.0)
    assert all(not r.overlap for r in rows.values())


def test_paired_ratios_divide_runs_of_the_same_repeat() -> None:
    # the machine drifts from repeat to repeat (100, 80, 60 tokens/s for the fixed baseline) and the
    # compiled engine is 1.1x in each; a load spike halves the compiled run of repeat 1 and the fixed
    # run of repeat 2. The ratio of the medians (66 over 80) says 0.825x; the per-repeat ratios say
    # 1.1x, 0.55x and 2.2x: their median is the engine's 1.1x, their range shows the spikes
    compiled, fixed = (110.0, 88.0 / 2, 66.0), (100.0, 80.0, 60.0 / 2)
    runs = [_run("compiled", k, compiled[rep] * (1 + k), rep) for rep in range(3) for k in (0, 2)]
    runs += [_run("mutable-fixed", k, fixed[rep], rep) for rep in range(3) for k in (0, 2)]
    rows = {(r.k, r.engine): r for r in summarise(runs)}
    c0 = rows[(0, "compiled")]
    assert c0.vs_mutable_fixed == pytest.approx(66.0 / 80.0)
    assert c0.paired_vs_mutable_fixed == pytest.approx((1.1, 0.55, 2.2))  # in repeat order
    assert c0.paired_fixed == pytest.approx((1.1, 0.55, 2.2))  # median, lowest, highest
    assert c0.to_json()["paired_vs_mutable_fixed"] == pytest.approx([1.1, 0.55, 2.2])
    assert rows[(2, "compiled")].paired_vs_k0 == pytest.approx((3.0, 3.0, 3.0)) and rows[(2, "compiled")].paired_k0 == pytest.approx((3.0, 3.0, 3.0))
    assert rows[(2, "mutable-fixed")].paired_fixed == pytest.approx((1.0, 1.0, 1.0))
    # a repeat the baseline did not run pairs with nothing; without the baseline there are no pairs
    partial = summarise([r for r in runs if not (r.engine == "mutable-fixed" and r.repeat == 1)])
    assert next(r for r in partial if (r.k, r.engine) == (0, "compiled")).paired_vs_mutable_fixed == pytest.approx((1.1, 2.2))
    alone = summarise([r for r in runs if r.engine == "compiled"])
    assert alone[0].paired_vs_mutable_fixed == () and alone[0].paired_fixed is None


def test_an_overlapped_engine_is_its_own_row_compared_with_the_fixed_baseline_and_its_own_k0() -> None:
    runs = [_run("compiled", k, 100.0 * (1 + k) * (1 + over), 0, overlap=bool(over)) for k in (0, 2) for over in (0, 1)]
    runs += [_run("mutable-fixed", k, 100.0, 0) for k in (0, 2)]
    rows = {(r.k, r.overlap): r for r in summarise(runs) if r.engine == "compiled"}
    assert len(rows) == 4
    assert rows[(2, True)].vs_mutable_fixed == pytest.approx(6.0) and rows[(2, True)].vs_k0 == pytest.approx(3.0)
    assert rows[(0, False)].vs_mutable_fixed == pytest.approx(1.0)
    assert rows[(2, True)].to_json()["overlap"] is True


def test_a_different_running_batch_is_a_different_row() -> None:
    rows = summarise([_run("compiled", 0, 100.0, 0, running=8), _run("compiled", 0, 100.0, 1, running=4)])
    assert [(r.running, r.repeats, r.vs_mutable_fixed) for r in rows] == [(8, 1, None), (4, 1, None)]


def test_runs_that_reached_different_peaks_under_one_limit_are_one_row() -> None:
    # a trickle reaches fewer live requests in some runs than in others: the rows compare by the limit
    runs = [attrs.evolve(_run("compiled", 0, 100.0 * (1 + rep), rep, running=8), running=5 + rep) for rep in range(3)]
    runs.append(attrs.evolve(_run("mutable-fixed", 0, 100.0, 0, running=8), running=7))
    rows = {r.engine: r for r in summarise(runs)}
    assert rows["compiled"].repeats == 3 and rows["compiled"].running == 7 and rows["compiled"].max_running == 8
    assert rows["compiled"].vs_mutable_fixed == pytest.approx(2.0)


def test_latency_quantiles_pool_every_request_of_every_repeat() -> None:
    assert percentile([], 0.5) is None
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    runs = [attrs.evolve(_run("compiled", 0, 100.0, rep), ttft_ms=(1.0 + rep, 10.0 + rep), tpot_ms=(2.0,)) for rep in range(2)]
    row = summarise(runs)[0]
    assert row.latency("ttft", 0.5) == pytest.approx(6.0) and row.latency("tpot", 0.9) == pytest.approx(2.0)
    assert row.to_json()["ttft_ms_p50"] == pytest.approx(6.0)


def test_latencies_start_at_arrival_and_count_tokens_after_the_first() -> None:
    lat = Latencies()
    lat.arrive([RequestId(1), RequestId(2)], 1.0)
    lat.arrive([RequestId(1)], 5.0)  # arriving again does not move the clock
    lat.step(_report(emitted=(RequestId(1),)), 1.5)
    lat.step(_report(emitted=(RequestId(1), RequestId(2))), 2.0)
    lat.step(_report(emitted=(RequestId(1),), finished=(RequestId(1),)), 3.5)
    lat.step(_report(emitted=(RequestId(2),), finished=(RequestId(2),)), 4.0)
    assert lat.ttft_ms() == pytest.approx([500.0, 1000.0])
    # request 1: 4 tokens, 2 s after its first; request 2 emitted 1 token only: no gap to measure
    assert lat.tpot_ms({RequestId(1): [7, 7, 7, 7], RequestId(2): [7]}) == pytest.approx([2000.0 / 3])


def _report(*, emitted: tuple[RequestId, ...], finished: tuple[RequestId, ...] = ()) -> StepReport:
    return StepReport(kind=StepKind.DECODE, requests=0, prefill_tokens=0, tokens=0, finished=finished, aborted=(), emitted=emitted,
                      seconds=0.0)


def test_the_mutable_baseline_stops_where_the_compiled_engine_does() -> None:
    # a workload line's stop token id reaches the baseline too, so both sides generate the same tokens
    target, draft = tiny_models()
    cfg = ServeConfig(k=2, lossless_sample=0)
    prompt = bytes(REVIEW_PROMPTS[0])
    free = [Request(rid=RequestId(0), prompt=prompt, max_new_tokens=REVIEW_NEW)]
    compiled = make_engine(target, draft, cfg, None, cache=True, k=2)
    serve(compiled, free, max_running=cfg.max_running)
    stop = compiled.outputs[RequestId(0)][1]
    stopped = [attrs.evolve(free[0], sampling=attrs.evolve(free[0].sampling, stop_token_ids=[stop]))]
    compiled = make_engine(target, draft, cfg, None, cache=True, k=2)
    serve(compiled, stopped, max_running=cfg.max_running)
    for fixed in (False, True):
        mutable = make_mutable(target, draft, cfg, k=2, fixed=fixed)
        serve_mutable(mutable, stopped, max_running=cfg.max_running)
        assert mutable.outputs[RequestId(0)] == compiled.outputs[RequestId(0)]
        assert mutable.outputs[RequestId(0)][-1] == stop and len(mutable.outputs[RequestId(0)]) < REVIEW_NEW


def test_each_draft_kind_is_a_row_of_its_own_with_its_accepted_length() -> None:
    runs = [_run(e, k, 100.0 * (1 + k), 0) for k in (0, 2) for e in ENGINES]  # the separate draft ("model") at k = 2
    runs += [attrs.evolve(_run("compiled", 2, 450.0, rep), draft="mtp", proposed=20, accepted=15 + rep, iterations=10) for rep in range(3)]
    rows = {(r.k, r.engine, r.draft): r for r in summarise(runs)}
    assert set(rows) == {(0, e, "none") for e in ENGINES} | {(2, e, "model") for e in ENGINES} | {(2, "compiled", "mtp")}
    head = rows[(2, "compiled", "mtp")]
    assert head.vs_k0 == pytest.approx(4.5)  # over the compiled engine's k = 0 row, which runs no draft
    assert head.vs_mutable_fixed is None  # no baseline serves a head
    assert head.acceptance == pytest.approx(48 / 60) and head.accepted_length == pytest.approx((48 + 30) / 30)
    assert head.to_json()["draft"] == "mtp" and rows[(0, "compiled", "none")].to_json()["draft"] == "none"
    assert rows[(2, "compiled", "model")].accepted_length is None  # (those runs recorded no iteration)


def test_builtin_cases_serve_each_draft_kind_at_each_k_above_0() -> None:
    cases = builtin_cases(requests=2, max_new_tokens=2, ks=(0, 1, 3), arrivals=("bursts",), drafts=("model", "mtp"))
    assert [(c.k, c.draft, c.engines) for c in cases] == [
        (0, "none", ENGINES), (1, "model", ENGINES), (1, "mtp", ENGINES), (3, "model", ENGINES), (3, "mtp", ENGINES),
    ]


@pytest.fixture(scope="module")
def hf_target_and_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Hugging Face Granite-4.0-H directory (its own BPE tokenizer) and an untrained draft
    head file for it: ``bench serve --model DIR --draft HEAD`` reads them as an operator's would."""
    import torch

    from backend.hybrid.head import HeadConfig, init_head_weights, save_head
    from backend.tools.hf_random import save_hf_model, save_tokenizer
    from compiler.offline.models import load_served

    root = tmp_path_factory.mktemp("hf_bench")
    directory = root / "granite"
    directory.mkdir()
    save_hf_model("granitemoehybrid", directory, vocab_size=320)
    save_tokenizer(directory, vocab_size=320)
    served = load_served(str(directory), role="target", dtype=torch.float32, bundled="target")
    config = HeadConfig.for_target(served.model.config, ("mamba",))
    save_head(root / "head.safetensors", config, init_head_weights(config, 0))
    return directory, root / "head.safetensors"


def test_bench_serve_a_hugging_face_target_with_its_head(hf_target_and_head: tuple[Path, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in prompts on the checkpoint's tokenizer, k = 0 and the head at k = 2, the compiled
    engine only (the baselines speak bytes); the title names the models."""
    directory, head = hf_target_and_head
    rows, out = _rows(["--model", str(directory), "--draft", str(head), "--requests", "3", "--max-new-tokens", "3", "--repeats", "1",
                       "--arrivals", "bursts"], tmp_path, capsys)
    assert [(r["k"], r["engine"], r["draft"]) for r in rows] == [(0, "compiled", "none"), (2, "compiled", "mtp")]
    asked = sum(r.max_new_tokens for r in builtin_cases(requests=3, max_new_tokens=3, ks=(0,), arrivals=("bursts",))[0].requests)
    assert rows[0]["tokens"] == rows[1]["tokens"] == asked and rows[1]["accepted_length"] is not None  # no end-of-sequence id: all of them
    assert f"target {directory} (Granite-4.0-H), mtp = draft head {head}" in " ".join(out.split())


def test_bench_cases_on_a_tokenizer_are_served_by_the_compiled_engine_only(hf_target_and_head: tuple[Path, Path]) -> None:
    import torch

    from compiler.offline.models import load_served
    from compiler.tools.bench_serve import Tokens

    served = load_served(str(hf_target_and_head[0]), role="target", dtype=torch.float32, bundled="target")
    tokens = Tokens(served.tokenizer, served.model.config.vocab)
    for cases in (builtin_cases(requests=3, max_new_tokens=2, ks=(0, 2), arrivals=("bursts",), drafts=("mtp",), tokens=tokens),
                  sweep_cases([2], ks=(0, 2), drafts=("mtp",), tokens=tokens)):
        assert [c.engines for c in cases] == [("compiled",), ("compiled",)]
        for c in cases:  # the prompts' own text, as the checkpoint's tokenizer encodes it
            assert all(r.ids == tuple(served.tokenizer.encode(r.prompt.decode())) for r in c.requests)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--model", "{dir}"], "--model {dir} at k = 2: give --draft (a head file from batchc train-draft, or a draft model with its vocabulary)"),
        (["--model", "{dir}", "--draft", "model"], "bundled draft: its vocabulary is not the one of target {dir} (Granite-4.0-H)"),
        (["--model", "{dir}", "--draft", "mtp"], "--draft mtp is the bundled target's trained head; for target {dir} (Granite-4.0-H) give --draft HEAD_FILE"),
        (["--draft", "{head}"], "draft {head}: head d_model 64 does not match the target's d_model 96 (bundled target)"),
        (["--draft", "mtp", "backend/hybrid/weights/mtp.safetensors"],
         "--draft backend/hybrid/weights/mtp.safetensors: a second draft of kind mtp (after bundled draft head)"),
        (["--k", "0", "--draft", "mtp"], "--draft mtp with --k 0 only: k = 0 runs no draft"),
        (["--model", "{dir}", "--draft", "{head}", "--tp", "2"], "--draft {head} with --tp: a draft head under tensor parallelism is not built yet"),
        (["--draft", ""], "argument --draft: expected a path, got ''"),
    ],
)
def test_bench_serve_refuses_mismatched_models_in_one_line(argv: list[str], said: str, hf_target_and_head: tuple[Path, Path],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    directory, head = hf_target_and_head
    try:
        code = main(["bench", "serve", *(a.format(dir=directory, head=head) for a in argv), "--requests", "2", "--max-new-tokens", "2"])
    except SystemExit as exc:  # (argparse's own refusals exit from the parser)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said.format(dir=directory, head=head) in err, err


def test_bench_serve_runs_the_head_on_every_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--draft mtp``: the bundled head on the compiled engine and on both baselines (which run it
    as upstream does), every engine generating the same greedy tokens; the pre-fix baseline's
    stale replays on the head's pool are what ``batchc ab --draft mtp`` counts."""
    rows, _ = _rows(["--k", "0", "2", "--draft", "mtp", "--requests", "3", "--max-new-tokens", "4", "--repeats", "1", "--arrivals", "bursts"],
                    tmp_path, capsys)
    assert [(r["k"], r["engine"], r["draft"]) for r in rows] == [(0, e, "none") for e in ENGINES] + [(2, e, "mtp") for e in ENGINES]
    assert len({r["tokens"] for r in rows}) == 1
    fixed = next(r for r in rows if r["k"] == 2 and r["engine"] == "mutable-fixed")
    compiled = next(r for r in rows if r["k"] == 2 and r["engine"] == "compiled")
    assert compiled["tokens_per_s_vs_mutable_fixed"] == pytest.approx(compiled["tokens_per_s"] / fixed["tokens_per_s"])  # type: ignore[operator]
    assert compiled["accepted"] == fixed["accepted"]  # the fixed baseline proposes what the compiled engine does


# -- --replay: the engines' own host work, with the models' forwards replayed from a recording ----


@cache
def _bundled_models() -> tuple[HybridModel, HybridModel, HeadModel]:
    """The bundled target, its separate draft and its trained head (``--draft mtp``)."""
    target = load_served(None, role="target", dtype=torch.float32, bundled="target").model
    return target, default_draft(), load_head(bundled_path(HEAD_FILE), target)


_FORWARDS = ("extend", "decode", "mixed", "verify", "propose", "propose_keeping_states", "commit")


def _no_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model entry point (the target's, a separate draft's and a head's) fails if it runs."""

    def ran(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model forward ran during the replay")

    for name in _FORWARDS:
        monkeypatch.setattr(HybridModel, name, ran)
    for name in ("extend", "propose"):
        monkeypatch.setattr(HeadModel, name, ran)
    # (an engine takes a failing forward for a fault, retries it and aborts its requests: the test
    # compares the outputs, which an abort would cut short)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("k", "kind"), [(0, "none"), (2, "model"), (2, "mtp")])
def test_a_replayed_run_serves_the_recorded_tokens_and_runs_no_forward(engine: str, k: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine with every draft kind: served again with the tape of its first run, it asks the
    models for the same forwards in the same order and serves the same tokens in the same steps,
    while every model entry point would fail if it ran."""
    target, draft = tiny_models() if kind != "mtp" else _bundled_models()[:2]
    head = _bundled_models()[2] if kind == "mtp" else None
    case = builtin_cases(requests=3, max_new_tokens=5, ks=(k,), arrivals=("bursts",), drafts=("mtp",) if kind == "mtp" else ("model",))[0]
    t, d, h = TimedModel(target), TimedModel(draft), TimedHead(head) if head is not None else None
    tape = Tape()
    with recording((t, d, h), tape):
        run = measure(case, engine, t, d, head=h)
    assert tape.calls and run.tokens > 0 and (run.proposed > 0) == (k > 0)
    # the tape keeps no verify states (every window position's Mamba state of every iteration): only
    # the replayed commits would read them
    kept = [x for _, out in tape.calls for x in (out if isinstance(out, tuple) else (getattr(out, "states", None),))]
    assert all(x is NO_STATES for x in kept if isinstance(x, VerifyStates))
    assert any(x is NO_STATES for x in kept) == (k > 0)  # (every verify's, and a separate draft's proposal's)
    _no_forwards(monkeypatch)
    with replaying((t, d, h), tape):
        again = measure(case, engine, t, d, head=h)
    tape.check_done()
    assert again.outputs == run.outputs and again.steps == run.steps and again.accepted == run.accepted
    assert t.tape is None and d.tape is None and (h is None or h.tape is None)  # each model's own tape is back


def test_measure_with_replay_reports_the_replayed_host_time_and_refuses_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_serve, "REPLAY_MIN_SECONDS", 0.0)
    target, draft = tiny_models()
    case = builtin_cases(requests=3, max_new_tokens=5, ks=(2,), arrivals=("bursts",))[0]
    t, d = TimedModel(target), TimedModel(draft)
    run = measure(case, "compiled", t, d, replay=True)
    plain = measure(case, "compiled", t, d)
    assert run.replayed_host_ms is not None and run.replayed_host_ms > 0 and plain.replayed_host_ms is None
    assert run.replays == REPLAY_MIN_TIMES and plain.replays == 0
    assert run.outputs == plain.outputs and run.tokens == plain.tokens  # the recorded run is a run like any other
    with pytest.raises(ValueError, match="a run with overlap cannot be replayed"):
        measure(case, "compiled", t, d, overlap=True, replay=True)


def test_a_replay_that_diverges_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay is refused where it stops following the recording: a forward of other rows, or of
    another entry point, or one more or fewer; and ``measure`` compares what the replay served."""
    target, draft = tiny_models()
    t, d = TimedModel(target), TimedModel(draft)
    cases = {n: builtin_cases(requests=n, max_new_tokens=5, ks=(0,), arrivals=("bursts",))[0] for n in (2, 3)}
    tapes = {n: Tape() for n in cases}
    for n, case in cases.items():
        with recording((t, d), tapes[n]):
            measure(case, "compiled", t, d)
    with replaying((t, d), tapes[2]):  # (the engine takes the divergence for a failed forward: it retries, then aborts)
        measure(cases[3], "compiled", t, d)
    with pytest.raises(ReplayDiverged, match=r"forward 1 \(extend\) takes cu_seqlens \[4\], .*slots \[3\]; the recorded run's took cu_seqlens \[3\], .*slots \[2\]$"):
        tapes[2].check_done()
    tape = Tape()
    tape.record(("decode", ()), None)
    with replaying((t,), tape):
        with pytest.raises(ReplayDiverged, match="forward 1 calls extend, the recorded run's called decode"):
            tape.next(("extend", ()))
        tape.next(("decode", ()))
        with pytest.raises(ReplayDiverged, match=r"forward 2 \(decode\) was never recorded: the recorded run made 1"):
            tape.next(("decode", ()))
    with pytest.raises(ReplayDiverged, match="forward 1 calls extend"):  # the first divergence, whatever came after it
        tape.check_done()
    with replaying((t,), tape):
        pass
    with pytest.raises(ReplayDiverged, match=r"the replayed run made 0 forwards, the recorded run 1"):
        tape.check_done()
    # the same forwards in the same order, other logits: ``measure`` compares what the replay served
    real_next = Tape.next

    def other_logits(self: Tape, call: tuple[str, object]) -> object:
        out = real_next(self, call)  # type: ignore[arg-type]  # (the call as the tape got it)
        if call[0] == "decode":
            assert isinstance(out, ForwardOut)
            return ForwardOut(out.logits.roll(1, dims=-1), out.hidden, out.all_hidden)
        return out

    monkeypatch.setattr(Tape, "next", other_logits)
    with pytest.raises(ReplayDiverged, match=r"compiled served other tokens or steps with its forwards replayed"):
        measure(cases[3], "compiled", t, d, replay=True)


def test_a_row_reports_the_replayed_host_time_only_when_every_run_has_one() -> None:
    runs = [attrs.evolve(_run("compiled", 0, 100.0, rep), replayed_host_ms=ms) for rep, ms in enumerate((0.3, 0.5, 0.4))]
    row = summarise(runs)[0]
    assert row.replayed_host_ms == pytest.approx(0.4) and row.to_json()["host_ms_per_step_replayed"] == pytest.approx(0.4)
    assert [r["host_ms_per_step_replayed"] for r in row.to_json()["runs"]] == [0.3, 0.5, 0.4]  # type: ignore[attr-defined]  # JSON lists
    partly = summarise([*runs, attrs.evolve(_run("compiled", 0, 100.0, 3), replayed_host_ms=None)])[0]
    assert partly.replayed_host_ms is None and partly.to_json()["host_ms_per_step_replayed"] is None


def test_bench_serve_replay_adds_the_replayed_host_time_to_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_serve, "REPLAY_MIN_SECONDS", 0.0)  # (the least number of replays each: their bound has its own test)
    rows, out = _rows(["--requests", "2", "--max-new-tokens", "3", "--repeats", "1", "--arrivals", "bursts", "--replay"], tmp_path, capsys)
    assert len(rows) == 2 * len(ENGINES)
    for row in rows:
        assert row["host_ms_per_step_replayed"] is not None and row["host_ms_per_step_replayed"] > 0  # type: ignore[operator]
    assert "host rep" in out and "replayed from a recording" in " ".join(out.split())
    plain, out = _rows(["--requests", "2", "--max-new-tokens", "3", "--repeats", "1", "--arrivals", "bursts", "--k", "0"], tmp_path, capsys)
    assert all(r["host_ms_per_step_replayed"] is None for r in plain) and "host rep" not in out


def test_bench_serve_replay_with_tp_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert run_cli(["bench", "serve", "--tp", "2", "--replay"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "batchc: error: --tp 2 with --replay: the tensor-parallel bench's forwards run in every rank, not replayed"
    ]


@pytest.mark.parametrize(("wall_s", "replays", "least"), [(0.1, 5, 0.2), (0.3, REPLAY_MIN_TIMES, 0.2), (0.001, 8, 0.1)])
def test_the_replayed_host_time_is_the_least_of_replays_that_take_long_enough(wall_s: float, replays: int, least: float,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A run is replayed at least ``REPLAY_MIN_TIMES`` times and until the replays took
    ``REPLAY_MIN_SECONDS`` (at most ``REPLAY_MAX_TIMES``, here 8); the least host time per step is kept."""
    assert bench_serve.REPLAY_MIN_SECONDS == 0.5 and REPLAY_MIN_TIMES == 3 and REPLAY_MAX_TIMES >= 8
    monkeypatch.setattr(bench_serve, "REPLAY_MAX_TIMES", 8)
    real = bench_serve._serve_once
    hosts = iter([0.5, 0.2, 0.4, 0.3, 0.6, 0.1, 0.1, 0.1])

    def timed_replays(case: BenchCase, engine: str, target: TimedModel, *args: object, **kwargs: object) -> ServeRun:
        run = real(case, engine, target, *args, **kwargs)  # type: ignore[arg-type]  # (measure's own arguments)
        if target.tape is None or not target.tape.replaying:
            return run
        return attrs.evolve(run, wall_s=wall_s, model_s=wall_s - next(hosts) * run.steps / 1e3)  # (host ms = (wall - model) / steps)

    monkeypatch.setattr(bench_serve, "_serve_once", timed_replays)
    target, draft = tiny_models()
    case = builtin_cases(requests=2, max_new_tokens=3, ks=(0,), arrivals=("bursts",))[0]
    run = measure(case, "compiled", TimedModel(target), TimedModel(draft), replay=True)
    assert run.replays == replays and run.replayed_host_ms == pytest.approx(least)
