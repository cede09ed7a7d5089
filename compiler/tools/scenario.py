"""The built-in scenario of ``batchc dump`` and ``batchc run``: a small, fixed workload that takes
every pass of the non-speculative path.

Requests (byte prompts): a fresh one (clear), one whose prefix state is cached in a checkpoint slot
(COW), a long one prefilled in chunks (clear, then continuations, in MIXED forwards with the
running decodes), and one aborted after its prefill. The checkpoint slot is filled by the scenario
itself, standing in for the prefix cache of a later release.
"""

from __future__ import annotations

import torch

from backend.pool import MambaLayerSpec, PoolLayout
from compiler.driver import Driver
from compiler.manager import PassManager
from ir.ids import MambaSlot, RequestId

LAYOUT = PoolLayout(
    layers=(
        MambaLayerSpec(conv_dim=48, kernel_width=4, nheads=4, head_dim=8, d_state=16),
        MambaLayerSpec(conv_dim=48, kernel_width=4, nheads=4, head_dim=8, d_state=16),
    )
)

PROMPTS: dict[int, bytes] = {
    0: b"def add(a, b):",
    1: b"import os\nimport sys\n",
    2: b"class Scheduler:\n    def step(self):\n        return self.batch",
    3: b"print('aborted')",
}
CACHED_PREFIX = b"import os\n"


def build_driver(pm: PassManager | None = None, chunk_size: int = 16) -> tuple[Driver, MambaSlot]:
    driver = Driver(layout=LAYOUT, capacity=16, kv_capacity=1024, chunk_size=chunk_size, pm=pm)
    checkpoint = driver.slots.alloc()
    # stand-in for a prefix-cache snapshot: a recognisable state in the checkpoint row
    driver.pool.buffer[checkpoint].copy_(torch.arange(driver.pool.layout.row_bytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    return driver, checkpoint


def run_scenario(driver: Driver, checkpoint: MambaSlot, max_new_tokens: int = 4) -> None:
    driver.admit(RequestId(0), list(PROMPTS[0]), max_new_tokens=max_new_tokens)
    driver.admit(
        RequestId(1), list(PROMPTS[1]), max_new_tokens=max_new_tokens, checkpoint=checkpoint, prefix_len=len(CACHED_PREFIX)
    )
    driver.step()  # EXTEND: clear + COW
    driver.admit(RequestId(2), list(PROMPTS[2]), max_new_tokens=max_new_tokens)
    driver.admit(RequestId(3), list(PROMPTS[3]), max_new_tokens=max_new_tokens)
    driver.step()  # MIXED: first chunk of r2 and r3 with the running decodes
    driver.abort(RequestId(3))
    driver.run_until_done()
    driver.step()  # IDLE
    driver.slots.free(checkpoint)


SPEC_PREFIX = b"import os\n"
SPEC_PROMPTS = (b"def add(a, b):", b"import os\nprint(os.sep)")


def run_spec_scenario(pm: PassManager, *, k: int = 2, max_new_tokens: int = 6) -> None:
    """Speculative decoding on the seeded tiny hybrid model (draft = target + 5% weight noise): a
    checkpoint prefill, then a fresh and a cached-prefix request through draft, verify, accept,
    commit and draft extend until both finish."""
    from backend.hybrid.config import tiny
    from backend.hybrid.model import HybridModel
    from backend.hybrid.weights import perturb
    from compiler.engine import Engine
    from compiler.tools.ab import DRAFT_NOISE

    target = HybridModel.from_seed(tiny(), seed=0)
    draft = HybridModel(target.config, perturb(target.weights, DRAFT_NOISE, seed=1))
    driver = Engine(target, draft, k=k, capacity=4, kv_capacity=256, max_len=64, pm=pm)
    cp = driver.make_checkpoint(list(SPEC_PREFIX))
    for rid, prompt in enumerate(SPEC_PROMPTS):
        driver.admit(RequestId(rid), list(prompt), max_new_tokens=max_new_tokens, checkpoint=cp if prompt.startswith(SPEC_PREFIX) else None)
    driver.run_until_done()
    driver.release_checkpoint(cp)
    driver.ledger.assert_drained()
