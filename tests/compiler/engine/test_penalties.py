"""Presence, frequency and repetition penalties end to end: the target's per-slot
token counts (``backend.counts``), started by the same one-shot ops as the slot's Mamba state and
updated by the executor, give the tokens of a straightforward reference loop: the tiny target's
logits recomputed from scratch for each token, transformers' ``RepetitionPenaltyLogitsProcessor``
over prompt and output, OpenAI's presence and frequency penalties over the output, then the argmax
(temperature 0, so the comparison is exact). Checked with chunked prefill, a prefix-cache hit (the
counts copied from the cache slot), speculation at k = 2 (the verify reads ``window_counts``),
executor processes (pipelined decode inputs), a slot reused after another request (its clear), and
``batchc run`` with penalised workload lines (in process, ``--overlap`` and ``--tp 2``)."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from typeguard import suppress_type_checks

from backend import faults
from backend.counts import TokenCounts
from backend.executor import Executor
from backend.hybrid.reference import reference_logits
from backend.ledger import Ledger
from backend.transports import processes
from compiler.engine import Engine
from compiler.engine.config import ServeConfig
from compiler.offline.memory import memory_estimate
from compiler.prefix_cache import PrefixCache
from ir.errors import IRValidationError, PreconditionError
from ir.ids import TARGET_POOL, RequestId
from ir.sampling import SamplingParams
from tests import forkserver
from tests.helpers import engine, run_cli, tiny_models

NEW = 10
REP = SamplingParams(temperature=0.0, repetition_penalty=1.6)
FREQ = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.5)
ALL = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=-0.3)
PLAIN = SamplingParams(temperature=0.0)
SHARED = [1, 2, 3, 149, 5, 6, 7, 8]
"""A prefix of three prompts below: with a cache of block 4, the second one's prefill snapshots it
(a prefix seen twice) and the last one's starts from a copy of it (its counts: the prefix's tokens;
its first token is the prefix's 149 without the repetition penalty, another one with it)."""
CASES = [(SHARED + [1, 2, 3], ALL), ([9, 9, 9, 9, 10, 11], FREQ), (SHARED + [40, 41], REP), ([214, 155, 4, 47], ALL), (SHARED + [99, 7], REP)]


@cache
def reference(prompt: tuple[int, ...], params: SamplingParams, n: int = NEW, retracted_after: int = 0) -> list[int]:
    """``n`` tokens of the tiny target after ``prompt``, penalised as transformers and the OpenAI API
    define it, from the from-scratch reference model. ``retracted_after``: the output tokens before
    it became prompt tokens (a retraction then, ``backend.counts``): frequency and presence count
    the output after them only."""
    from transformers import RepetitionPenaltyLogitsProcessor  # (here: a second to import, in every worker that collects)

    target = tiny_models()[0]
    seq, out = list(prompt), list[int]()
    repetition = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    for _ in range(n):
        logits = reference_logits(target, seq)[-1:].clone()
        if params.repetition_penalty != 1.0:
            logits = repetition(torch.tensor([seq]), logits)
        counted = out[retracted_after:] if len(out) >= retracted_after else out
        counts = torch.bincount(torch.tensor(counted, dtype=torch.int64), minlength=logits.shape[1]).float()
        x = logits[0] - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        token = int(x.argmax())
        seq.append(token)
        out.append(token)
    return out


def _serve(eng: Engine, cases: list[tuple[list[int], SamplingParams]], *, one_by_one: bool = False) -> list[list[int]]:
    for i, (prompt, params) in enumerate(cases):
        eng.admit(RequestId(i), prompt, max_new_tokens=NEW, sampling=params)
        while one_by_one and eng.live:
            eng.step()
    while eng.live:
        eng.step()
    eng.sync()
    return [eng.outputs[RequestId(i)] for i in range(len(cases))]


def test_the_reference_is_changed_by_each_penalty() -> None:
    # (otherwise equality below would not show that the penalties were applied)
    for prompt, params in CASES:
        assert reference(tuple(prompt), params) != reference(tuple(prompt), PLAIN), (prompt, params)


@pytest.mark.parametrize(("k", "options"), [
    (0, {}),
    (0, {"chunk_size": 3}),
    (0, {"prefix_cache": "cache"}),
    (2, {}),
    (2, {"prefix_cache": "cache", "chunk_size": 3}),
])
def test_an_engine_with_penalties_gives_the_reference_tokens(k: int, options: dict[str, Any]) -> None:
    if options.get("prefix_cache"):
        options = {**options, "prefix_cache": PrefixCache(capacity=4, block=4)}
    with engine(k, penalties=True, **options) as eng:
        # one by one with a cache, so that a later prompt finds the earlier one's prefix cached
        got = _serve(eng, CASES, one_by_one="prefix_cache" in options)
        assert got == [reference(tuple(p), s) for p, s in CASES]
        if "prefix_cache" in options:
            assert eng.cache is not None and eng.cache.stats.hit_tokens >= len(SHARED)  # a COW started a slot's counts
        if options.get("chunk_size") and not k:
            assert eng.stats.mixed > 0  # decode rows fed beside a prefill's prompt rows
        if k:
            assert eng.stats.proposed > 0 and 0 < eng.stats.accepted < eng.stats.proposed  # verifies ran and rejected some


def _counts(eng: Engine) -> TokenCounts:
    counts = eng.backends.target.counts  # type: ignore[attr-defined]  # (in process: the Executor itself)
    assert isinstance(counts, TokenCounts)
    return counts


@pytest.mark.parametrize(("point", "after"), [(p, 0) for p in faults.POINTS] + [(faults.FaultPoint.MODEL_FORWARD, 5), (faults.FaultPoint.COMMIT, 2)])
def test_a_retried_step_restores_the_counts_it_changed(point: faults.FaultPoint, after: int) -> None:
    # with retries each forward is one transactional unit: the counts it changed (a clear, a COW, a
    # prompt's tokens, a decode's or a commit's fed tokens) are restored with the pool's rows, so
    # after the run every slot's counts (a freed slot keeps its last request's until it is reused)
    # are those of the run without the fault (served together: each request in a slot of its own)
    def run(armed: bool) -> tuple[list[list[int]], TokenCounts]:
        with engine(2, penalties=True, prefix_cache=PrefixCache(capacity=4, block=4), chunk_size=3, retries=1) as eng:
            if not armed:
                return _serve(eng, CASES), _counts(eng)
            with faults.armed(point, after=after) as fired:
                got = _serve(eng, CASES)
            assert fired == {point: 1} and eng.stats.retries == 1
            return got, _counts(eng)

    (plain, expected), (got, counts) = run(False), run(True)
    assert got == plain == [reference(tuple(p), s) for p, s in CASES]
    assert torch.equal(counts.output_counts, expected.output_counts) and torch.equal(counts.prompt_mask, expected.prompt_mask)
    assert counts.output_counts.sum() > 0


def test_greedy_requests_without_a_penalty_are_unchanged_beside_penalised_ones() -> None:
    cases = [(SHARED, PLAIN), *CASES[:2], ([5, 6, 7], PLAIN)]
    with engine(2, penalties=True) as eng:
        got = _serve(eng, cases)
    assert got == [reference(tuple(p), s) for p, s in cases]


def test_pipelined_executor_processes_give_the_reference_tokens() -> None:
    # k = 0 over processes: every decode names its input by the previous forward's sample, which
    # the executor resolves (and counts) where the counts live; k = 2: verifies and commits there
    target, draft = tiny_models()
    for k in (0, 2):
        with Engine(target, draft if k else None, k=k, penalties=True, transport=processes(1)) as eng:
            assert eng.backends.concurrent
            assert _serve(eng, CASES) == [reference(tuple(p), s) for p, s in CASES], k


def test_a_slot_reused_after_another_request_starts_with_cleared_counts() -> None:
    # one slot: the second request takes the first one's slot; had its counts not been cleared, it
    # would penalise the first request's prompt and output (the same tokens as its own)
    prompt, params = CASES[0]
    with engine(0, penalties=True, capacity=1) as eng:
        first = _serve(eng, [(prompt, params)])
        eng.admit(RequestId(7), prompt, max_new_tokens=NEW, sampling=params)
        eng.step()  # the prefill: the slot's counts are this prompt's tokens and nothing else
        counts = _counts(eng)
        assert counts.prompt_mask[1].nonzero().flatten().tolist() == sorted(set(prompt))
        assert not counts.output_counts[1].any()
        while eng.live:
            eng.step()
        assert first == [eng.outputs[RequestId(7)]] == [reference(tuple(prompt), params)]


def test_a_retracted_request_counts_its_earlier_output_as_prompt() -> None:
    # a retracted request re-prefills its prompt and output so far: the repetition penalty reads both
    # either way (its tokens equal the reference's); frequency and presence stop counting that output
    for prompt, params in (CASES[2], CASES[1]):
        with engine(0, penalties=True) as eng:
            rid = RequestId(0)
            eng.admit(rid, prompt, max_new_tokens=NEW, sampling=params)
            while len(eng.requests[rid].output) < 4:
                eng.step()
            kept = len(eng.requests[rid].output)
            eng.forwards.retract(rid)
            while eng.live:
                eng.step()
            assert eng.stats.retractions == 1
            assert eng.outputs[rid] == reference(tuple(prompt), params, retracted_after=kept if params.frequency_penalty else 0)
    assert reference(tuple(CASES[1][0]), CASES[1][1], retracted_after=4) != reference(tuple(CASES[1][0]), CASES[1][1])


def test_admit_refuses_a_penalised_request_unless_the_engine_keeps_counts() -> None:
    with engine(0) as eng:
        for params in (REP, FREQ, SamplingParams(temperature=0.0, presence_penalty=0.1)):
            with pytest.raises(PreconditionError, match=r"request 3: .* need an engine built with penalties=True"):
                eng.admit(RequestId(3), [1, 2], max_new_tokens=2, sampling=params)
        eng.admit(RequestId(3), [1, 2], max_new_tokens=2, sampling=PLAIN)
        assert eng.backends.target.counts is None  # type: ignore[attr-defined]  # (no memory spent without the option)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_penalties_must_be_a_bool(value: object) -> None:
    target, _ = tiny_models()
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"penalties must be a bool"):
        Engine(target, None, k=0, penalties=value)  # type: ignore[arg-type]  # (the check under test)


def test_counts_must_match_the_pool() -> None:
    target, _ = tiny_models()
    pool = target.new_pool(4, pool_id=TARGET_POOL)
    with pytest.raises(IRValidationError, match=r"the token counts' capacity 3 differs from the pool's 4"):
        Executor(pool, Ledger(), counts=TokenCounts(3, target.vocab))


def test_the_memory_estimate_counts_the_token_counts() -> None:
    target, draft = tiny_models()
    cfg = ServeConfig(max_running=8, cache_entries=16)
    plain = memory_estimate(target.config, draft.config, cfg)
    with_counts = memory_estimate(target.config, draft.config, ServeConfig(max_running=8, cache_entries=16, penalties=True))
    assert "token counts" not in plain
    assert with_counts["token counts"] == TokenCounts.nbytes(8 + 16 + 2, target.vocab) + TokenCounts.nbytes(8 + 2, target.vocab)


ROOT = Path(__file__).resolve().parents[3]


def _lines(tmp: Path) -> Path:
    path = tmp / "w.jsonl"
    rows = [
        {"prompt": "the cat sat on the mat, the cat", "max_new_tokens": 12, "temperature": 0, "repetition_penalty": 1.5},
        {"prompt": "the cat sat on the mat, the cat", "max_new_tokens": 12, "temperature": 0},
        {"prompt": "aaaa bbbb aaaa", "max_new_tokens": 12, "temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_batchc_run_serves_penalised_workload_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    args = ["run", "--workload", str(_lines(tmp_path)), "--outputs", str(out), "--json", str(summary), "--lossless-sample", "3"]
    assert run_cli(args) == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["output_ids"] != lines[1]["output_ids"]  # the same prompt, with and without the penalty
    # at k = 2 the greedy penalised requests equal the target alone at k = 0 (with its counts)
    assert json.loads(summary.read_text())["lossless_check"] == "passed: 3 requests equal plain greedy of the target"
    # (independent runs: started together, they share the machine's cores)
    runs = {extra[0]: (tmp_path / f"o{extra[0]}.jsonl", extra) for extra in (["--overlap"], ["--tp", "2"])}
    procs = {name: forkserver.Popen([sys.executable, "-m", "compiler.cli", *args[:3], "--outputs", str(again), "--lossless-sample", "0", *extra],
                                    cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, (again, extra) in runs.items()}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            assert runs[name][0].read_text() == out.read_text(), name
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_an_engine_with_penalties_ends_chunks_at_snapshot_points() -> None:
    """A snapshot copies the slot's token counts as of the forward's end, so with penalties it must be
    taken there, not inside a chunk; the counts refuse an inner snapshot outright."""
    from backend.counts import TokenCounts
    from backend.state_init import apply_counts_op
    from ir.errors import PlanExecutionError
    from ir.ids import MambaSlot, TicketSerial
    from ir.init import MambaSnapshot
    from tests.helpers import engine

    with engine(0, penalties=True) as with_counts, engine(0) as without:
        assert not with_counts.planner.inner_snapshots and without.planner.inner_snapshots
    counts = TokenCounts(capacity=4, vocab=8)
    snap = MambaSnapshot(serial=TicketSerial(1), src=[MambaSlot(1)], dst=[MambaSlot(2)], at=[3])
    with pytest.raises(PlanExecutionError, match=r"taken inside a chunk \(at \[3\]\)"):
        apply_counts_op(counts, snap)
