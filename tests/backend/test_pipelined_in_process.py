"""The pipelined k = 0 step in this process (``backend.local.PIPELINED_IN_PROCESS``): the engine builds
and submits step N + 1 before reading step N back, as over executor processes, and serves token for
token what the plain engine serves, greedy and sampled, on the state-sensitive model (whose tokens
change when a Mamba state is wrong, stale or applied twice), with every ticket consumed once and one
readback per step."""

from __future__ import annotations

import contextlib

import pytest

from backend.local import PIPELINED_IN_PROCESS
from backend.readback import HostReadbacks
from compiler.engine import Engine
from compiler.testing.models import state_sensitive
from ir.ids import RequestId
from ir.sampling import SamplingParams
from tests.helpers import tiny_model

PROMPTS = [list(b"hello %d, a prompt" % i) for i in range(3)]
SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1), SamplingParams(temperature=0.0),
           SamplingParams(temperature=1.0, presence_penalty=0.5, seed=5)]


def _serve(pipelined: bool, sampled: bool) -> tuple[dict[RequestId, list[int]], list[tuple[str, bool, int]]]:
    engine = Engine(state_sensitive(tiny_model()), None, k=0, capacity=2, kv_capacity=512, max_len=48, chunk_size=8,
                    transport=PIPELINED_IN_PROCESS if pipelined else None, penalties=sampled)
    assert engine.forwards.pipelined is pipelined
    for i, prompt in enumerate(PROMPTS):  # (three requests over two slots: one waits, then joins a mixed step)
        engine.admit(RequestId(i), prompt, max_new_tokens=(3, 6, 3)[i], sampling=SAMPLED[i % 3] if sampled else None)
    steps = []
    while engine.live:
        with HostReadbacks() if pipelined else contextlib.nullcontext(HostReadbacks()) as seen:  # (the counter costs: one run)
            report = engine.step()
        steps.append((report.kind.value, engine.forwards.in_flight is not None, seen.count))
    engine.sync()
    assert engine.forwards.in_flight is None
    engine.ledger.assert_drained()
    return engine.outputs, steps


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_pipelined_engine_in_process_serves_the_plain_engines_tokens(monkeypatch: pytest.MonkeyPatch, sampled: bool) -> None:
    monkeypatch.setenv("BATCHC_VERIFY", "0")  # (as a served engine: the pool hash of level 2 is a readback by design)
    plain, _ = _serve(False, sampled)
    piped, steps = _serve(True, sampled)
    assert piped == plain
    # each step left its forward in flight (built before the one before it was read back)...
    forwards = [s for s in steps if s[0] in ("extend", "decode", "mixed")]
    assert {"decode", "mixed"} <= {k for k, _, _ in forwards} and all(flying for _, flying, _ in forwards), steps
    # ... and read back one forward: the tokens, once
    assert all(n <= 1 for _, _, n in steps), steps
