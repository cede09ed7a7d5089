"""The built-in scenarios of ``batchc dump`` (and of the golden IR dumps): small, fixed workloads on
the seeded tiny hybrid model (float32, deterministic on the CPU) served by the ``Engine``.

``run_scenario`` takes every pass of the non-speculative path (k = 0) with byte prompts:

- request 0 (fresh: a clear) shares its first 16 tokens with request 1; a prefix seen twice is
  worth caching, so request 0's first chunk ends at that block boundary and leaves a snapshot of the
  state there in the engine's prefix cache;
- request 1 hits that entry: its slot starts as a COW of the cached prefix state;
- request 2, long, is prefilled in chunks, in MIXED forwards with the running decodes of 0 and 1;
- request 3 is aborted after its prefill;
- then the running decodes, and an idle step.

The token budget (one 16-token chunk per step) is what starts request 1 a step after request 0, once
the cache holds the shared prefix. Nothing here touches a pool: every state comes from the
executors' own init ops, forwards and snapshots.
"""

from __future__ import annotations

from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from compiler.engine import Engine, RequestState, StepReport
from compiler.manager import PassManager
from compiler.prefix_cache import PrefixCache
from ir.ids import RequestId

CACHE_BLOCK = 16
PROMPTS: dict[int, bytes] = {
    0: b"import os\nimport sys\n",
    1: b"import os\nimport re\n",  # the same first 16 bytes, "import os\nimport"
    2: b"class Scheduler:\n    def step(self):\n        return self.batch",
    3: b"print('aborted')",
}


def _tiny_target() -> HybridModel:
    return HybridModel.from_seed(tiny(), seed=0)


def run_scenario(pm: PassManager, *, max_new_tokens: int = 4) -> tuple[Engine, list[StepReport]]:
    """Serve the non-speculative scenario through ``pm``; returns the engine, its prefix cache
    emptied (so every slot and KV location is back), and the report of every step."""
    cache = PrefixCache(capacity=2, block=CACHE_BLOCK)
    engine = Engine(
        _tiny_target(), None, k=0, capacity=8, kv_capacity=256, max_len=80, chunk_size=16, token_budget=16,
        prefix_cache=cache, pm=pm,
    )
    reports: list[StepReport] = []
    engine.admit(RequestId(0), list(PROMPTS[0]), max_new_tokens=max_new_tokens)
    engine.admit(RequestId(1), list(PROMPTS[1]), max_new_tokens=max_new_tokens)
    reports.append(engine.step())  # EXTEND: request 0's first chunk (clear), snapshot of its prefix
    reports.append(engine.step())  # EXTEND: request 0's last chunk, request 1 (COW from the cache)
    engine.admit(RequestId(2), list(PROMPTS[2]), max_new_tokens=max_new_tokens)
    engine.admit(RequestId(3), list(PROMPTS[3]), max_new_tokens=max_new_tokens)
    while engine.live:  # MIXED chunks of 2 and 3 with the running decodes, then decodes
        reports.append(engine.step())
        if RequestId(3) in engine.requests and engine.requests[RequestId(3)].state is RequestState.RUNNING:
            engine.abort(RequestId(3))  # its prefill is done: it has emitted its first token
    reports.append(engine.step())  # IDLE
    engine.drop_cache()
    engine.ledger.assert_drained()
    return engine, reports


SPEC_PREFIX = b"import os\n"
SPEC_PROMPTS = (b"def add(a, b):", b"import os\nprint(os.sep)")


def run_spec_scenario(pm: PassManager, *, k: int = 2, max_new_tokens: int = 6) -> None:
    """Speculative decoding on the seeded tiny hybrid model (draft = target + 5% weight noise): a
    prefix prefill, then a fresh and a cached-prefix request through draft, verify, accept,
    commit and draft commit until both finish."""
    from backend.hybrid.weights import perturb
    from compiler.tools.ab import DRAFT_NOISE

    target = _tiny_target()
    draft = HybridModel(target.config, perturb(target.weights, DRAFT_NOISE, seed=1))
    engine = Engine(target, draft, k=k, capacity=4, kv_capacity=256, max_len=64, pm=pm)
    cp = engine.make_prefix(list(SPEC_PREFIX))
    for rid, prompt in enumerate(SPEC_PROMPTS):
        engine.admit(RequestId(rid), list(prompt), max_new_tokens=max_new_tokens, prefix=cp if prompt.startswith(SPEC_PREFIX) else None)
    engine.run_until_done()
    engine.release_prefix(cp)
    engine.ledger.assert_drained()
