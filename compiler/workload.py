"""The built-in workload of ``batchc run`` and the loop that serves it through ``Driver``.

Requests are byte prompts built from a small bundled set: some share a system-prompt prefix whose
state sits in a checkpoint slot (COW), the rest start fresh (clear); lengths vary so that long
prompts are prefilled in chunks. Checkpoint slots are seeded by the workload itself until the prefix
cache lands (issue 5). Admission keeps at most ``max_running`` requests live.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import attrs

from compiler.driver import Driver
from compiler.manager import PassManager
from compiler.scenario import LAYOUT
from ir.ids import TARGET_POOL, MambaSlot, RequestId

SYSTEM_PREFIXES: tuple[bytes, ...] = (
    b"You are a careful Python reviewer. Answer briefly.\n",
    b"Translate the following comment into plain English:\n",
)
SNIPPETS: tuple[bytes, ...] = (
    b"def merge(a, b):\n    return sorted(a + b)\n",
    b"for i in range(10):\n    print(i * i)\n",
    b"class Slot:\n    __slots__ = ('index', 'live')\n",
    b"with open(path) as f:\n    data = f.read()\n",
    b"x = [n for n in numbers if n % 2 == 0]\n",
    b"try:\n    run()\nexcept KeyError as exc:\n    log(exc)\n",
    b"async def fetch(url):\n    return await client.get(url)\n",
    b"import itertools\npairs = list(itertools.combinations(items, 2))\n",
)


@attrs.frozen(kw_only=True)
class WorkItem:
    rid: RequestId
    prompt: bytes
    prefix: int  # index into SYSTEM_PREFIXES, or -1 for a fresh request
    max_new_tokens: int


def builtin_workload(*, num_requests: int = 64, max_new_tokens: int = 16, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    items = []
    for i in range(num_requests):
        body = b"".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 4)))
        prefix = rng.choice((-1, 0, 1))
        prompt = (SYSTEM_PREFIXES[prefix] if prefix >= 0 else b"") + body
        items.append(WorkItem(rid=RequestId(i), prompt=prompt, prefix=prefix, max_new_tokens=rng.randint(1, max_new_tokens)))
    return items


def run_workload(
    workload: list[WorkItem],
    *,
    chunk_size: int = 32,
    max_running: int = 16,
    on_finish: Callable[[int], None] | None = None,
    pm: PassManager | None = None,
) -> dict[str, object]:
    pm = pm if pm is not None else PassManager.from_env()
    driver = Driver(layout=LAYOUT, capacity=max_running + len(SYSTEM_PREFIXES), kv_capacity=max_running * 512, chunk_size=chunk_size, pm=pm)
    checkpoints: list[MambaSlot] = []
    for k in range(len(SYSTEM_PREFIXES)):
        slot = driver.slots.alloc()
        driver.pool.buffer[slot].fill_(k + 1)  # stand-in for the state after the prefix
        checkpoints.append(slot)
    queue = list(workload)
    done = 0
    steps: dict[str, int] = {}
    t0 = time.perf_counter()
    while queue or driver.live:
        while queue and driver.live < max_running:
            item = queue.pop(0)
            cp = checkpoints[item.prefix] if item.prefix >= 0 else None
            driver.admit(
                item.rid,
                list(item.prompt),
                max_new_tokens=item.max_new_tokens,
                checkpoint=cp,
                prefix_len=len(SYSTEM_PREFIXES[item.prefix]) if item.prefix >= 0 else 0,
            )
        result = driver.step()
        steps[result.kind] = steps.get(result.kind, 0) + 1
        done += len(result.finished)
        if on_finish is not None and result.finished:
            on_finish(done)
    wall = time.perf_counter() - t0
    driver.slots.free_many(checkpoints)
    counts = driver.ledger.counts(TARGET_POOL)
    generated = sum(len(v) for v in driver.outputs.values())
    total_steps = sum(steps.values())
    return {
        "requests": len(workload),
        "fresh_requests": sum(1 for w in workload if w.prefix < 0),
        "prefix_requests": sum(1 for w in workload if w.prefix >= 0),
        "prompt_tokens": sum(len(w.prompt) for w in workload),
        "generated_tokens": generated,
        "steps": total_steps,
        "steps_by_kind": ", ".join(f"{k}={v}" for k, v in sorted(steps.items())),
        "wall_s": wall,
        "generated_tokens_per_s": generated / wall if wall > 0 else 0.0,
        "init_tickets_consumed": counts.tickets,
        "clears_consumed": counts.clears,
        "cows_consumed": counts.cows,
        "replays_blocked": driver.ledger.replays_blocked,
        "outstanding_tickets": len(driver.ledger.outstanding()),
        "slots_live_after": driver.slots.num_live,
        "kv_live_after": driver.kv.num_live,
        "pass_us_per_step": {k: (t.calls, t.seconds / t.calls * 1e6) for k, t in pm.timings().items()},
        "samples": [(int(w.rid), w.prompt[:40].decode(), driver.outputs[w.rid][:8]) for w in workload[:3]],
    }



