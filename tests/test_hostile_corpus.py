"""A corpus of hostile inputs across the stack, each refused with a specific error that changes nothing.

Complements ``tests/test_bad_input.py`` (which covers the prefill/decode IR, the ledger and the
allocators) with what it does not: the speculative phases (contexts, passes, nodes, the executor's
verify/commit protocol), prefix-cache snapshots (node, verifier, executor), prefix-cache misuse,
``Engine`` admission and prefix states, JSONL workload files (``compiler.offline.load_workload``,
then admission of what it returns) and checkpoint files (``load_checkpoint``).

Each row names the exact exception type and a message fragment. Two worlds:

- ``core``: ``tests.helpers.make_world`` (a target pool of random bytes, its ledger, slot and KV
  allocators, an executor) with a toy speculative model hook, so verify/commit plans can run;
- ``driver``: a ``Engine`` (tiny seeded target and draft, k = 2, prefix cache) that has made a
  prefix state, admitted two requests and run a prefill and a speculative iteration.

Around the hostile call (after any legitimate ``setup``), the pool bytes (both pools for the
driver), the ledger (outstanding tickets, number consumed, minted and consumed counts per pool),
both allocators (``num_free``, ``live()``) and, where there is one, the executor's pending verify
states, the driver's KV references, requests and outputs, and the prefix cache must be unchanged.

Rows marked ``xfail`` are library bugs found while writing the corpus (strict: the row fails loudly
once the bug is fixed, so the mark can be removed).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import safetensors.torch
import torch
from typeguard import suppress_type_checks

from backend.executor import Executor
from backend.hybrid.checkpoint import CheckpointError, config_to_json, load_checkpoint, save_checkpoint
from backend.hybrid.config import tiny
from backend.hybrid.weights import init_weights
from backend.pool import MambaStatePool
from compiler.engine import Engine, PrefixState
from compiler.offline import WorkloadError, load_workload
from compiler.prefix_cache import CacheEntry, PrefixCache, PrefixCacheError
from ir.errors import (
    IRValidationError,
    IRVerificationError,
    PlanExecutionError,
    PreconditionError,
    ResourceReplayError,
    SlotError,
    TicketMismatchError,
    UnknownTicketError,
)
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId, TicketSerial
from ir.init import InitTicket, MambaInit, MambaSnapshot, Ticket, mint_serial
from ir.mint import mint_draft_id, mint_verify_id
from ir.plan import ExtendPlan
from ir.request import Continue, CopyFrom
from ir.results import Verified
from ir.spec import (
    AcceptResult,
    CommitBatch,
    CommitPlan,
    DraftBatch,
    DraftExtendBatch,
    VerifyBatch,
)
from ir.verify import verify
from passes.accept import accept
from passes.commit import commit
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import ToySpecModel, World, decode_batch, make_world, proposed, request, tiny_models, verified

Ctx = dict[str, Any]


# -- the two worlds ------------------------------------------------------------------------------


def core_world() -> World:
    return make_world(model=ToySpecModel())  # slots 1..3 of 4 live, 64 KV locations


PREFIX = list(b"You are terse.\n")


@attrs.define
class DriverWorld:
    driver: Engine
    prefix: PrefixState
    tmp: Path


def driver_world(tmp: Path) -> DriverWorld:
    target, draft = tiny_models()
    drv = Engine(
        target, draft, k=2, capacity=6, kv_capacity=256, max_len=64, chunk_size=16,
        prefix_cache=PrefixCache(capacity=3, block=8),
    )
    cp = drv.make_prefix(PREFIX)
    drv.admit(RequestId(1), PREFIX + list(b"print(1)"), max_new_tokens=6, prefix=cp)
    drv.admit(RequestId(2), list(b"def f(x):"), max_new_tokens=6)
    assert drv.step().kind.value == "extend"
    assert drv.step().kind.value == "spec"
    return DriverWorld(driver=drv, prefix=cp, tmp=tmp)


def _ledger_state(ledger: Any) -> tuple[object, ...]:
    return (
        ledger.outstanding(),
        ledger.num_consumed,
        *(ledger.minted(p) for p in (TARGET_POOL, DRAFT_POOL)),
        *(ledger.counts(p) for p in (TARGET_POOL, DRAFT_POOL)),
    )


def state_of(world: World | DriverWorld) -> tuple[list[torch.Tensor], tuple[object, ...]]:
    """(pool buffers, everything else) that a refused input must leave as it was."""
    if isinstance(world, World):
        return [world.pool.buffer.clone()], (
            _ledger_state(world.ledger),
            world.slots.num_free, world.slots.live(), world.kv.num_free, world.kv.live(),
            world.executor.kept_states,  # pending verify and draft states
        )
    drv = world.driver
    assert drv.draft is not None
    cache_ = drv.cache
    assert cache_ is not None
    return [drv.target.pool.buffer.clone(), drv.draft.pool.buffer.clone()], (
        _ledger_state(drv.ledger),
        drv.slots.num_free, drv.slots.live(), drv.kv.num_free, drv.kv.live(),
        drv.kv_refs.held(),  # KV reference counts
        drv.live, drv.live_slots(), {r: list(o) for r, o in drv.outputs.items()},
        tuple(attrs.asdict(e) for e in cache_.entries()), cache_.reserved,  # cache bookkeeping
    )


# -- the table -----------------------------------------------------------------------------------


@attrs.frozen
class Case:
    id: str
    act: Callable[[Any, Ctx], object]
    error: type[BaseException]
    match: str
    """Regex searched in the message; ``<name>`` is replaced by ``re.escape(str(ctx[name]))``."""
    world: str = "core"  # "core" or "driver"
    setup: Callable[[Any], Ctx] | None = None
    field: str | None = None
    """For ``IRValidationError``: the field it must blame."""
    xfail: str | None = None


def _build(fn: Callable[[], object]) -> Callable[[Any, Ctx], object]:
    return lambda w, ctx: fn()


# -- speculative phases: nodes, contexts, passes -----------------------------------------------------

RUNNING = decode_batch([1, 2], [1, 2], [4, 6], [20, 21])


def _draft_batch(k: int = 2) -> DraftBatch:
    return prepare_for_draft(RUNNING, SpecContext(k=k, next_tokens=[3, 4], kv_locs=list(range(30, 30 + 2 * (k + 1)))))


def _verify_of(d: DraftBatch, tokens: Any) -> VerifyBatch:
    """A verify of ``tokens`` as if ``d``'s draft executor had proposed them."""
    return prepare_for_verify(d, proposed(d, tokens))


def _verify_batch(k: int = 2) -> VerifyBatch:
    d = _draft_batch(k)
    return prepare_for_verify(d, proposed(d, np.array([5, 6] * 2, dtype=np.int64)[: 2 * k]))


def _result_of(v: VerifyBatch, accepted: list[int], rids: list[int] | None = None) -> AcceptResult:
    """An ``AcceptResult`` naming ``v`` (its rows unless ``rids``)."""
    return AcceptResult(verify_id=v.verify_id, rids=v.rid_list() if rids is None else rids, accepted=accepted, bonus=[9] * len(accepted))


def _commit_batch(accepted: list[int]) -> CommitBatch:
    v = _verify_batch()
    return commit(v, _result_of(v, accepted))


def _commit_of_another_verify() -> CommitBatch:
    """The commit of one verify with the accept result of another verify of the same rows."""
    mine, theirs = _verify_batch(), _verify_batch()
    return commit(mine, accept(theirs, verified(theirs, np.full(6, 5, dtype=np.int64))))


def _commit_of_rows(rids: list[int], accepted: list[int]) -> CommitBatch:
    """The commit of a verify of ``RUNNING``'s rows with a result naming the verify and ``rids``."""
    v = _verify_batch()
    return commit(v, _result_of(v, accepted, rids=rids))


def _accept_of_rows(rids: list[int]) -> AcceptResult:
    """The accept of a verify of ``RUNNING``'s rows with target tokens naming the verify and ``rids``."""
    v = _verify_batch()
    return accept(v, Verified(k=v.k, verify_id=v.verify_id, rids=rids, tokens=[7] * (len(rids) * (v.k + 1))))


def _spec_ctx(**kw: Any) -> Callable[[Any, Ctx], object]:
    fields: dict[str, Any] = dict(k=2, next_tokens=[3, 4], kv_locs=list(range(30, 36)))
    fields.update(kw)
    return _build(lambda: SpecContext(**fields))


SPEC_CASES = [
    Case("spec-ctx-k-zero", _spec_ctx(k=0, kv_locs=[30, 31]), IRValidationError, r"SpecContext\.k: speculative steps must be >= 1", field="k"),
    Case(
        "spec-ctx-window-too-small",
        _spec_ctx(kv_locs=list(range(30, 35))),
        IRValidationError,
        r"SpecContext\.kv_locs: length must equal len\(next_tokens\) \* \(k \+ 1\) \(6\) \(got 5\)",
        field="kv_locs",
    ),
    Case("spec-ctx-negative-pending", _spec_ctx(next_tokens=[3, -1]), IRValidationError, r"SpecContext\.next_tokens.*-1", field="next_tokens"),
    Case(
        "draft-ctx-rows-mismatch",
        _build(lambda: prepare_for_draft(RUNNING, SpecContext(k=2, next_tokens=[3], kv_locs=[30, 31, 32]))),
        PreconditionError,
        r"prepare_for_draft: ctx has 1 pending tokens for 2 rows",
    ),
    Case(
        "verify-wrong-token-count",
        _build(lambda: _verify_of(_draft_batch(), [5, 6])),
        PreconditionError,
        r"prepare_for_verify: the proposals of draft #\d+ hold 2 tokens with k=2; the draft has 2 rows x k=2",
    ),
    Case(
        "verify-negative-token",
        _build(lambda: _verify_of(_draft_batch(), np.array([5, -3, 6, 7], dtype=np.int64))),
        IRValidationError,
        r"Proposals\.tokens: every value must be >= 0 \(got -3\)",
        field="tokens",
    ),
    Case(
        "verify-float-tokens",
        _build(lambda: _verify_of(_draft_batch(), np.array([5, 6, 6, 7.5]))),
        IRValidationError,
        r"Proposals\.tokens: must be a 1-D sequence of ints, got dtype float64",
        field="tokens",
    ),
    Case(
        "verify-proposals-of-another-draft",
        _build(lambda: prepare_for_verify(_draft_batch(), proposed(_draft_batch(), [5, 6, 6, 7]))),
        PreconditionError,
        r"prepare_for_verify: the proposals of draft #(\d+) cannot be verified against draft #(?!\1)\d+",
    ),
    Case(
        "accept-target-tokens-of-another-verify",
        _build(lambda: accept(_verify_batch(), verified(_verify_batch(), np.full(6, 7, dtype=np.int64)))),
        PreconditionError,
        r"accept: the target tokens of verify #(\d+) cannot judge verify #(?!\1)\d+",
    ),
    Case(
        "accept-target-tokens-of-other-rows",
        _build(lambda: _accept_of_rows([2, 1])),
        PreconditionError,
        r"accept: the target tokens of verify #\d+ are for rows \[2, 1\], the verify's are \[1, 2\]",
    ),
    Case(
        "commit-result-rows-mismatch",
        _build(lambda: _commit_of_rows([1], [1])),
        PreconditionError,
        r"commit: the accept result of verify #\d+ judged 1 row \[1\], the verify has 2 rows \[1, 2\]",
    ),
    Case(
        "commit-result-of-another-verify",
        _build(_commit_of_another_verify),
        PreconditionError,
        r"commit: the accept result of verify #(\d+) cannot commit verify #(?!\1)\d+",
    ),
    Case(
        "commit-result-rows-swapped",
        _build(lambda: _commit_of_rows([2, 1], [2, 0])),
        PreconditionError,
        r"commit: the accept result of verify #\d+ judged rows \[2, 1\], the verify's are \[1, 2\] \(row 0: request 2, the verify's 1\)",
    ),
    Case(
        "commit-accepted-past-k",
        _build(lambda: _commit_of_rows([1, 2], [3, 0])),
        PreconditionError,
        r"commit: accepted 3 > k=2",
    ),
    Case(
        "commit-batch-accept-pos-past-k",
        _build(
            lambda: CommitBatch(
                k=2, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], accept_pos=[3],
                input_ids=[3, 5, 6], kv_locs=[30, 31, 32], released_kv=[],
            )
        ),
        IRValidationError,
        r"CommitBatch\.accept_pos: must be <= k \(2\) \(got 3\)",
        field="accept_pos",
    ),
    Case(
        "commit-batch-released-count",
        _build(
            lambda: CommitBatch(
                k=2, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], accept_pos=[0],
                input_ids=[3, 5, 6], kv_locs=[30, 31, 32], released_kv=[32],
            )
        ),
        IRValidationError,
        r"CommitBatch\.released_kv: length must equal the rejected positions \(2\) \(got 1\)",
        field="released_kv",
    ),
    Case(
        "commit-released-outside-window",
        lambda w, ctx: verify(
            CommitBatch(
                k=2, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], accept_pos=[1],
                input_ids=[3, 5, 6], kv_locs=[30, 31, 32], released_kv=[44],
            )
        ),
        IRVerificationError,
        r"CommitBatch\.released_kv: KV location 44 is not in any row's window",
    ),
    Case(
        "verify-batch-k-zero",
        _build(lambda: VerifyBatch(k=0, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1], slots=[1], seq_lens=[5], input_ids=[3], kv_locs=[30])),
        IRValidationError,
        r"VerifyBatch\.k: speculative steps must be >= 1",
        field="k",
    ),
    Case(
        "verify-batch-dup-slots",
        lambda w, ctx: verify(
            VerifyBatch(k=1, verify_id=mint_verify_id(), draft_id=mint_draft_id(), rids=[1, 2], slots=[3, 3], seq_lens=[5, 5], input_ids=[3, 4, 5, 6], kv_locs=[30, 31, 32, 33])
        ),
        IRVerificationError,
        r"VerifyBatch\.slots\[1\]: slot 3 already used at index 0",
    ),
    Case(
        "draft-batch-padding-slot",
        _build(lambda: DraftBatch(k=1, draft_id=mint_draft_id(), rids=[1], slots=[0], seq_lens=[5], input_ids=[3], kv_locs=[30, 31])),
        IRValidationError,
        r"DraftBatch\.slots",
        field="slots",
    ),
    Case(
        "accept-result-negative",
        _build(lambda: AcceptResult(verify_id=mint_verify_id(), rids=[1], accepted=[-1], bonus=[3])),
        IRValidationError,
        r"AcceptResult\.accepted.*-1",
        field="accepted",
    ),
    Case(
        "draft-extend-batch-lengths",
        _build(lambda: DraftExtendBatch(rids=[1], slots=[1], prefix_lens=[4], extend_lens=[3], input_ids=[3, 5], kv_locs=[30, 31])),
        IRValidationError,
        r"DraftExtendBatch\.input_ids: length must equal sum\(extend_lens\) \(3\) \(got 2\)",
        field="input_ids",
    ),
    Case(
        "draft-extend-merged-into-its-own-running-batch",
        _build(lambda: merge_batch(RUNNING, prepare_for_draft_extend(_commit_batch([1, 0])))),
        PreconditionError,
        r"merge_batch: request id 1 is in both",
    ),
]


# -- speculative phases at run time (the executor) -------------------------------------------------------


def _lowered(batch: Any) -> Any:
    return lower(batch, LowerContext())


def _spec_window(slots: list[int]) -> Callable[[World], Ctx]:
    """A draft, a verify and its commit over rows in ``slots`` (lowered, nothing run yet)."""

    def setup(w: World) -> Ctx:
        n = len(slots)
        running = decode_batch(list(range(1, n + 1)), slots, [4] * n, list(range(20, 20 + n)))
        draft = prepare_for_draft(running, SpecContext(k=2, next_tokens=[3] * n, kv_locs=list(range(30, 30 + 3 * n))))
        v = prepare_for_verify(draft, proposed(draft, np.full(2 * n, 7, dtype=np.int64)))
        c = commit(v, _result_of(v, [2] * n))
        return {
            "draft": _lowered(draft), "verify": _lowered(v), "commit": _lowered(c),
            "extend": _lowered(prepare_for_draft_extend(c)), "vid": v.verify_id,
        }

    return setup


def _verified(slots: list[int]) -> Callable[[World], Ctx]:
    def setup(w: World) -> Ctx:
        ctx = _spec_window(slots)(w)
        w.executor.execute(ctx["verify"])
        return ctx

    return setup


def _committed(w: World) -> Ctx:
    ctx = _verified([1, 2])(w)
    w.executor.execute(ctx["commit"])
    return ctx


def _verified_then_freed(w: World) -> Ctx:
    ctx = _verified([1, 3])(w)
    w.slots.free(3)
    return ctx


def _run(key: str) -> Callable[[World, Ctx], object]:
    return lambda w, ctx: w.executor.execute(ctx[key])


def _run_on_draft_executor(key: str) -> Callable[[World, Ctx], object]:
    def act(w: World, ctx: Ctx) -> object:
        draft_pool = MambaStatePool(DRAFT_POOL, w.pool.layout, w.pool.capacity)
        return Executor(draft_pool, w.ledger, ToySpecModel(), slots=w.slots).execute(ctx[key])

    return act


def _run_without_spec_hook(w: World, ctx: Ctx) -> object:
    return Executor(w.pool, w.ledger, None, slots=w.slots).execute(ctx["draft"])


def _snapshot_plan(dst: int) -> Callable[[World], Ctx]:
    """A prefill of a continuation in slot 1 that snapshots into cache slot ``dst`` (lowered, registered)."""

    def setup(w: World) -> Ctx:
        r = attrs.evolve(request(1, 1, [5, 6], 10, intent=Continue(prefix_len=3)), snapshot_to=MambaSlot(dst))
        plan = lower(prepare_for_extend([r]), LowerContext())
        w.ledger.register(plan.snapshots)
        return {"plan": plan, "serial": plan.snapshots[0].serial}

    return setup


def _snapshot_into_freed(w: World) -> Ctx:
    ctx = _snapshot_plan(3)(w)
    w.slots.free(3)
    return ctx


EXECUTOR_CASES = [
    Case("commit-never-verified", _run("commit"), PlanExecutionError, r"no intermediate states of verify #<vid> on pool 'target': never verified here", setup=_spec_window([1, 2])),
    Case("commit-twice", _run("commit"), PlanExecutionError, r"no intermediate states of verify #<vid> .*or already committed", setup=_committed),
    Case("verify-twice", _run("verify"), PlanExecutionError, r"verify #<vid> already ran on pool 'target'", setup=_verified([1, 2])),
    Case(
        "commit-on-a-pool-that-never-verified",
        _run_on_draft_executor("commit"),
        PlanExecutionError,
        r"no intermediate states of verify #<vid> on pool 'draft'",
        setup=_verified([1, 2]),
    ),
    Case("draft-without-spec-hook", _run_without_spec_hook, PlanExecutionError, r"DraftPlan needs a SpecModelHook; NoOpModel has no speculative phases", setup=_spec_window([1, 2])),
    Case("verify-slot-out-of-range", _run("verify"), PlanExecutionError, r"VerifyPlan: slot 7 out of range \[1, 4\] of pool 'target'", setup=_spec_window([1, 7])),
    Case("draft-slot-not-live", _run("draft"), SlotError, r"use after free: DraftPlan uses slot 4", setup=_spec_window([4])),
    Case("commit-after-slot-freed", _run("commit"), SlotError, r"use after free: CommitPlan uses slot 3", setup=_verified_then_freed),
    Case("draft-extend-slot-freed", _run("extend"), SlotError, r"use after free: DraftExtendPlan uses slot 3", setup=_verified_then_freed),
    Case("draft-extend-slot-out-of-range", _run("extend"), PlanExecutionError, r"DraftExtendPlan: slot 9 out of range", setup=_spec_window([9])),
    # -- snapshots ---------------------------------------------------------------------------------
    Case("snapshot-into-freed-cache-slot", _run("plan"), SlotError, r"use after free: snapshot #<serial> uses slot 3", setup=_snapshot_into_freed),
    Case("snapshot-dst-out-of-range", _run("plan"), PlanExecutionError, r"snapshot #<serial>: dst slot 6 out of range \[1, 4\]", setup=_snapshot_plan(6)),
    Case(
        "snapshot-src-equals-dst",
        _build(lambda: MambaSnapshot(serial=mint_serial(), src=(2,), dst=(2,))),
        IRValidationError,
        r"slot 2 is both a snapshot source and a snapshot target",
        field="dst",
    ),
    Case(
        "snapshot-dup-dst",
        _build(lambda: MambaSnapshot(serial=mint_serial(), src=(1, 2), dst=(3, 3))),
        IRValidationError,
        r"MambaSnapshot\.dst: slot 3 appears twice",
        field="dst",
    ),
    Case("snapshot-empty", _build(lambda: MambaSnapshot(serial=mint_serial(), src=(), dst=())), IRValidationError, r"at least one slot", field="dst"),
    Case("snapshot-lengths", _build(lambda: MambaSnapshot(serial=mint_serial(), src=(1, 2), dst=(3,))), IRValidationError, r"length must equal len\(src\) \(2\)", field="dst"),
    Case("snapshot-padding-dst", _build(lambda: MambaSnapshot(serial=mint_serial(), src=(1,), dst=(0,))), IRValidationError, r"padding slot", field="dst"),
    Case(
        "snapshot-to-own-slot",
        _build(lambda: attrs.evolve(request(1, 2, [5, 6], 10), snapshot_to=MambaSlot(2))),
        IRValidationError,
        r"AdmittedRequest\.snapshot_to: must be a cache slot >= 1 other than the request's own",
        field="snapshot_to",
    ),
    Case(
        "two-snapshots-into-one-cache-slot",
        _build(
            lambda: prepare_for_extend(
                [attrs.evolve(request(1, 1, [5], 10), snapshot_to=MambaSlot(4)), attrs.evolve(request(2, 2, [6], 11), snapshot_to=MambaSlot(4))]
            )
        ),
        IRValidationError,
        r"MambaSnapshot\.dst: slot 4 appears twice",
        field="dst",
    ),
    Case(
        "snapshot-into-live-slot-verifier",
        lambda w, ctx: verify(
            prepare_for_extend([attrs.evolve(request(1, 1, [5], 10), snapshot_to=MambaSlot(2)), request(2, 2, [6], 11)])
        ),
        IRVerificationError,
        r"ExtendBatch\.snapshot\.dst\[0\]: cache slot 2 is the live slot of a request",
    ),
]


# -- prefix cache and Engine ------------------------------------------------------------------------


def _cache(w: DriverWorld) -> PrefixCache:
    assert w.driver.cache is not None
    return w.driver.cache


def _with_entry(w: DriverWorld) -> Ctx:
    """Cached prefixes (the driver snapshots the prefixes the two prompts share, the longest of 16 tokens)."""
    drv = w.driver
    drv.run_until_done()
    shared = list(b"# shared header line\n")
    drv.admit(RequestId(3), shared + list(b"a"), max_new_tokens=2)
    drv.admit(RequestId(4), shared + list(b"b"), max_new_tokens=2)
    drv.run_until_done()
    entries = [e for e in _cache(w).entries() if len(e.tokens) == 16]
    assert len(entries) == 1 and entries[0].pins == 0
    return {"entry": entries[0], "entry_slot": entries[0].slot}


def _insert_again(w: DriverWorld, ctx: Ctx) -> object:
    """A second insert of a cached prefix, with a reservation made for it."""
    cache_ = _cache(w)
    assert cache_.reserve_room()
    try:
        e = ctx["entry"]
        cache_.insert(CacheEntry(slot=e.slot, tokens=e.tokens, kv_locs=e.kv_locs))
    finally:
        cache_.release_room()
    return None


def _admit(rid: int, prompt: Any, **kw: Any) -> Callable[[DriverWorld, Ctx], object]:
    options = {"max_new_tokens": 4, **kw}

    def act(w: DriverWorld, ctx: Ctx) -> object:
        with suppress_type_checks():  # production runs without typeguard: the driver's own checks must hold
            w.driver.admit(RequestId(rid), prompt, **options)
        return None

    return act


def _admit_from_prefix(prompt: list[int]) -> Callable[[DriverWorld, Ctx], object]:
    return lambda w, ctx: w.driver.admit(RequestId(9), prompt, max_new_tokens=2, prefix=w.prefix)


def _all_finished(w: DriverWorld) -> Ctx:
    w.driver.run_until_done()
    return {}


def _release_prefix(w: DriverWorld) -> Ctx:
    w.driver.run_until_done()
    w.driver.release_prefix(w.prefix)
    return {"slot": w.prefix.slot}


def _make_prefix(tokens: list[int]) -> Callable[[DriverWorld, Ctx], object]:
    return lambda w, ctx: w.driver.make_prefix(tokens)


DRIVER_CASES = [
    Case("cache-unpin-unpinned", lambda w, ctx: _cache(w).unpin(ctx["entry"]), PrefixCacheError, r"unpin of cache slot <entry_slot>, which is not pinned", world="driver", setup=_with_entry),
    Case(
        "cache-insert-without-reservation",
        lambda w, ctx: _cache(w).insert(CacheEntry(slot=MambaSlot(6), tokens=(1, 2, 3, 4, 5, 6, 7, 8), kv_locs=tuple(range(200, 208)))),
        PrefixCacheError,
        r"release_room without a reservation",
        world="driver",
    ),
    Case("cache-double-insert", _insert_again, PrefixCacheError, r"prefix of 16 tokens is already cached in slot", world="driver", setup=_with_entry),
    Case("cache-release-unreserved-room", lambda w, ctx: _cache(w).release_room(), PrefixCacheError, r"release_room without a reservation", world="driver"),
    Case("admit-too-long-for-max-len", _admit(9, list(range(60))), PreconditionError, r"admit: request 9: prompt 60 \+ 4 new tokens exceed max_len 64", world="driver"),
    Case("admit-spec-window-past-max-len", _admit(9, list(range(58)), max_new_tokens=4), PreconditionError, r"exceed max_len 64", world="driver"),
    Case("admit-duplicate-live-rid", _admit(1, [1, 2, 3]), PreconditionError, r"admit: request id 1 is already in use", world="driver"),
    Case("admit-duplicate-finished-rid", _admit(2, [1, 2, 3]), PreconditionError, r"request id 2 is already in use", world="driver", setup=_all_finished),
    Case("admit-empty-prompt", _admit(9, []), IRValidationError, r"request 9\.prompt: must hold at least one token", world="driver", field="prompt"),
    Case("admit-negative-token", _admit(9, [5, -7, 5]), IRValidationError, r"request 9\.prompt: token ids must be >= 0 \(got -7\)", world="driver", field="prompt"),
    Case("admit-float-tokens", _admit(9, [1.5, 2.5]), IRValidationError, r"request 9\.prompt: must be a 1-D sequence of int token ids", world="driver", field="prompt"),
    Case("admit-bytes-object", _admit(9, "hello"), IRValidationError, r"request 9\.prompt: must be a 1-D sequence of int token ids", world="driver", field="prompt"),
    Case("admit-2d-prompt", _admit(9, [[1, 2], [3, 4]]), IRValidationError, r"request 9\.prompt: must be a 1-D sequence", world="driver", field="prompt"),
    Case("admit-huge-token", _admit(9, [2**70]), IRValidationError, r"request 9\.prompt: must be a 1-D sequence of int token ids", world="driver", field="prompt"),
    Case(
        "admit-token-past-vocab",
        _admit(9, [65, 66, 300]),
        IRValidationError,
        r"request 9\.prompt.*300",
        world="driver",
    ),
    Case("admit-zero-new-tokens", _admit(9, [1, 2], max_new_tokens=0), PreconditionError, r"max_new_tokens must be >= 1, got 0", world="driver"),
    Case("admit-released-prefix", _admit_from_prefix(PREFIX + [1, 2]), PreconditionError, r"request 9: prefix slot <slot> was released", world="driver", setup=_release_prefix),
    Case("admit-not-extending-prefix", _admit_from_prefix(list(b"Something else entirely")), PreconditionError, r"request 9: prompt does not extend the prefix state's 15 tokens", world="driver"),
    Case("admit-equal-to-prefix", _admit_from_prefix(PREFIX), PreconditionError, r"prompt does not extend the prefix state's 15 tokens", world="driver"),
    Case("abort-unknown-request", lambda w, ctx: w.driver.abort(RequestId(77)), PreconditionError, r"abort: request 77 is not live", world="driver"),
    Case("release-prefix-twice", lambda w, ctx: w.driver.release_prefix(w.prefix), SlotError, r"double free of slot <slot>", world="driver", setup=_release_prefix),
    Case(
        "make-prefix-empty",
        _make_prefix([]),
        IRValidationError,
        r"at least one token",
        world="driver",
    ),
    Case(
        "make-prefix-negative-token",
        _make_prefix([5, -1]),
        IRValidationError,
        r"prompt: token ids must be >= 0 \(got -1\)",
        world="driver",
        field="prompt",
    ),
    Case(
        "make-prefix-token-past-vocab",
        _make_prefix([5, 999]),
        IRValidationError,
        r"prompt: token ids must be < the vocabulary size 256 \(got 999\)",
        world="driver",
        field="prompt",
    ),
]


# -- workload files ----------------------------------------------------------------------------------


def _workload(content: str | bytes) -> Callable[[DriverWorld], Ctx]:
    def setup(w: DriverWorld) -> Ctx:
        path = w.tmp / "workload.jsonl"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return {"path": path}

    return setup


def _load_and_admit(w: DriverWorld, ctx: Ctx) -> object:
    """What ``batchc run`` does with a workload: load it, then admit every request."""
    drv = w.driver
    for r in load_workload(ctx["path"], max_len=drv.max_len):
        if r.refused is not None:  # batchc run never admits it: that request alone is refused, with this reason
            raise WorkloadError(r.refused)
        drv.admit(RequestId(100 + int(r.rid)), list(r.prompt), max_new_tokens=r.max_new_tokens, sampling=r.sampling)
    return None


GOOD_LINE = '{"prompt": "ok", "max_new_tokens": 2}\n'


def _wl(id_: str, content: str | bytes, match: str, xfail: str | None = None) -> Case:
    return Case(id_, _load_and_admit, WorkloadError, match, world="driver", setup=_workload(content), xfail=xfail)


WORKLOAD_CASES = [
    _wl("workload-non-utf8", b'{"prompt": "caf\xe9", "max_new_tokens": 2}\n', r"<path>: cannot read workload file \('utf-8' codec can't decode"),
    _wl("workload-arrival-negative", GOOD_LINE + '{"prompt": "x", "arrival": -1}\n', r"<path>:2: 'arrival' must be an integer step in \[0, 1000000\], got -1"),
    _wl("workload-arrival-too-late", '{"prompt": "x", "arrival": 1000000000000000000000000000000}\n', r"<path>:1: 'arrival' must be an integer step in \[0, 1000000\], got 1000000000000000000000000000000"),
    _wl("workload-arrival-string", '{"prompt": "x", "arrival": "3"}\n', r"<path>:1: 'arrival' must be an integer step in \[0, 1000000\], got '3'"),
    _wl("workload-arrival-bool", '{"prompt": "x", "arrival": false}\n', r"<path>:1: 'arrival' .* got False"),
    _wl("workload-bool-max-new-tokens", '{"prompt": "x", "max_new_tokens": true}\n', r"<path>:1: 'max_new_tokens' must be a positive integer, got True"),
    _wl("workload-float-max-new-tokens", '{"prompt": "x", "max_new_tokens": 3.0}\n', r"<path>:1: 'max_new_tokens' must be a positive integer, got 3\.0"),
    _wl("workload-nan-max-new-tokens", '{"prompt": "x", "max_new_tokens": NaN}\n', r"<path>:1: 'max_new_tokens' must be a positive integer, got nan"),
    _wl("workload-huge-max-new-tokens", '{"prompt": "x", "max_new_tokens": 100000000000000000000000000000}\n', r"<path>:1: 'max_new_tokens': must be in \[1, 2147483647\] \(got 100000000000000000000000000000\)"),
    _wl("workload-nested-object-prompt", '{"prompt": {"text": "hi"}, "max_new_tokens": 2}\n', r"<path>:1: 'prompt' must be a non-empty string"),
    _wl("workload-token-list-prompt", '{"prompt": [104, 105], "max_new_tokens": 2}\n', r"<path>:1: 'prompt' must be a non-empty string"),
    _wl("workload-null-line", GOOD_LINE + GOOD_LINE + "null\n", r"<path>:3: expected a JSON object, got NoneType"),
    _wl("workload-empty-stop", '{"prompt": "x", "stop": ["\\n", ""]}\n', r"<path>:1: 'stop': a stop string must not be empty \(got ''\)"),
    _wl("workload-int-stop", '{"prompt": "x", "stop": 10}\n', r"<path>:1: 'stop': must be a str or a list of str, not int \(got 10\)"),
    _wl("workload-utf8-bom", "\ufeff" + GOOD_LINE, r"<path>:1: bad JSON \(Unexpected UTF-8 BOM"),
    _wl("workload-two-objects-one-line", GOOD_LINE.strip() + " " + GOOD_LINE, r"<path>:1: bad JSON \(Extra data"),
    _wl("workload-multibyte-prompt-too-long", json.dumps({"prompt": "é" * 28, "max_new_tokens": 2}) + "\n", r"<path>:1: prompt of 56 bytes \+ 2 new tokens exceeds the context limit 64"),
    _wl(
        "workload-lone-surrogate",
        '{"prompt": "a\\ud800b", "max_new_tokens": 2}\n',
        r"<path>:1: .*prompt",
    ),
]


# -- checkpoint files ----------------------------------------------------------------------------------


def _good_checkpoint(tmp: Path) -> Path:
    path = tmp / "good.safetensors"
    if not path.exists():
        save_checkpoint(path, tiny(), init_weights(tiny(), 3))
    return path


def _good_layout(tmp: Path) -> tuple[dict[str, Any], bytes]:
    """The good checkpoint's safetensors header (as a JSON object) and data section, rebuilt from what
    ``safetensors.safe_open`` reports: the metadata, the names, each tensor's dtype, shape and bytes.
    The hostile files below edit the header and write it back; nothing parses a header by hand."""
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    with safetensors.safe_open(str(_good_checkpoint(tmp)), framework="pt") as f:
        header["__metadata__"] = dict(f.metadata() or {})
        for name in sorted(f.keys()):
            view = f.get_slice(name)
            raw = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
            start = sum(map(len, chunks))
            header[name] = {"dtype": view.get_dtype(), "shape": view.get_shape(), "data_offsets": [start, start + len(raw)]}
            chunks.append(raw)
    return header, b"".join(chunks)


def _file_bytes(header: dict[str, Any], data: bytes) -> bytes:
    """A safetensors file: the header's length (8 bytes, little-endian), the header as JSON padded with
    spaces to a multiple of 8 bytes, then the data."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _ckpt_header(edit: Callable[[dict[str, Any]], object], *, data: bool = True) -> Callable[[DriverWorld], Ctx]:
    """The good checkpoint with ``edit`` applied to its header (and without its data if ``data`` is false)."""

    def setup(w: DriverWorld) -> Ctx:
        header, body = _good_layout(w.tmp)
        edit(header)
        path = w.tmp / "bad.safetensors"
        path.write_bytes(_file_bytes(header, body if data else b""))
        return {"path": path}

    return setup


def _ckpt_bytes(edit: Callable[[bytes], bytes]) -> Callable[[DriverWorld], Ctx]:
    def setup(w: DriverWorld) -> Ctx:
        path = w.tmp / "bad.safetensors"
        path.write_bytes(edit(_good_checkpoint(w.tmp).read_bytes()))
        return {"path": path}

    return setup


def _ckpt_tensors(edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], **config_changes: Any) -> Callable[[DriverWorld], Ctx]:
    def setup(w: DriverWorld) -> Ctx:
        fields = json.loads(config_to_json(tiny()))
        fields.update(config_changes)
        path = w.tmp / "bad.safetensors"
        tensors = edit(init_weights(tiny(), 3))
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(path),
            metadata={"format": "batchc.hybrid/1", "config": json.dumps(fields)},
        )
        return {"path": path}

    return setup


def _config_text(text: str) -> Callable[[DriverWorld], Ctx]:
    def setup(w: DriverWorld) -> Ctx:
        path = w.tmp / "bad.safetensors"
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in init_weights(tiny(), 3).items()}, str(path),
            metadata={"format": "batchc.hybrid/1", "config": text},
        )
        return {"path": path}

    return setup


def _load_and_serve(w: DriverWorld, ctx: Ctx) -> object:
    """Load the checkpoint, then (were it loadable) admit a request on the running driver."""
    model = load_checkpoint(ctx["path"])
    w.driver.admit(RequestId(50), [1, 2, 3], max_new_tokens=2)
    return model


def _ck(id_: str, setup: Callable[[DriverWorld], Ctx], match: str) -> Case:
    return Case(id_, _load_and_serve, CheckpointError, "^<path>: " + match, world="driver", setup=setup)


def _nan_in(name: str, dtype: torch.dtype) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def edit(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v.to(dtype) for k, v in t.items()}
        out[name][0] = float("nan")
        return out

    return edit


def _overflow_fp16(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(t)
    out["embed"] = (t["embed"] * 1e6).to(torch.float16)  # overflows to inf when stored as float16
    return out


def _meta_value_not_string(header: dict[str, Any]) -> None:
    header["__metadata__"]["steps"] = 5


def _offsets_past_end(header: dict[str, Any]) -> None:
    header["embed"]["data_offsets"] = [0, 10**9]


def _empty_format(header: dict[str, Any]) -> None:
    header["__metadata__"]["format"] = ""


def _directory(w: DriverWorld) -> Ctx:
    path = w.tmp / "dir.safetensors"
    path.mkdir()
    return {"path": path}


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda t: {k: v for k, v in t.items() if k != name}


CHECKPOINT_CASES = [
    _ck("checkpoint-truncated-header-length", _ckpt_bytes(lambda d: d[:5]), r"not a safetensors file or corrupt \(.*header too small"),
    _ck("checkpoint-header-length-past-end", _ckpt_bytes(lambda d: struct.pack("<Q", len(d) * 4) + d[8:]), r"not a safetensors file or corrupt \(.*invalid header length"),
    _ck("checkpoint-header-length-2-63", _ckpt_bytes(lambda d: struct.pack("<Q", 2**63) + d[8:]), r"not a safetensors file or corrupt \(.*header too large"),
    _ck("checkpoint-header-length-zero", _ckpt_bytes(lambda d: struct.pack("<Q", 0) + d[8:]), r"not a safetensors file or corrupt"),
    _ck("checkpoint-trailing-garbage", _ckpt_bytes(lambda d: d + b"garbage!"), r"not a safetensors file or corrupt \(.*not fully covered"),
    _ck("checkpoint-header-only", _ckpt_header(lambda h: None, data=False), r"not a safetensors file or corrupt"),
    _ck("checkpoint-metadata-value-not-string", _ckpt_header(_meta_value_not_string), r"not a safetensors file or corrupt"),
    _ck("checkpoint-tensor-offsets-past-end", _ckpt_header(_offsets_past_end), r"not a safetensors file or corrupt"),
    _ck("checkpoint-nan-in-bf16-tensor", _ckpt_tensors(_nan_in("final_norm", torch.bfloat16)), r"tensor 'final_norm' has 1 non-finite values \(of 32\)"),
    _ck("checkpoint-fp16-overflow-to-inf", _ckpt_tensors(_overflow_fp16), r"tensor 'embed' has \d+ non-finite values"),
    _ck("checkpoint-layer-kind-not-a-string", _ckpt_tensors(lambda t: t, layers=["mamba", 1, "mamba"]), r"bad config: field 'layers' must be a list of \['mamba', 'attn', 'mlp'\], got \['mamba', 1, 'mamba'\]"),
    _ck("checkpoint-layers-a-string", _ckpt_tensors(lambda t: t, layers="mamba,attn,mamba"), r"bad config: field 'layers' must be a list"),
    _ck("checkpoint-unknown-layer-kind-case", _ckpt_tensors(lambda t: t, layers=["mamba", "Attn", "mamba"]), r"bad config: field 'layers'.*'Attn'"),
    _ck("checkpoint-no-layers", _ckpt_tensors(lambda t: t, layers=[]), r"bad config: the layer pattern needs at least one mamba layer"),
    _ck("checkpoint-conv-width-5", _ckpt_tensors(lambda t: t, conv_width=5), r"bad config: conv_width must be in \[2, 4\], got 5"),
    _ck("checkpoint-odd-rotary-dim", _ckpt_tensors(lambda t: t, attn_head_dim=15), r"bad config: attn_head_dim must be even"),
    _ck("checkpoint-rms-eps-negative", _ckpt_tensors(lambda t: t, rms_eps=-1e-5), r"bad config: rms_eps must be positive"),
    _ck("checkpoint-float-d-model", _ckpt_tensors(lambda t: t, d_model=32.0), r"bad config: field 'd_model' must be an integer, got 32\.0"),
    _ck("checkpoint-vocab-zero", _ckpt_tensors(lambda t: t, vocab=0), r"bad config: vocab must be positive"),
    _ck("checkpoint-rms-eps-nan", _config_text(config_to_json(tiny()).replace('"rms_eps": 1e-05', '"rms_eps": NaN')), r"bad config: field 'rms_eps' must be a finite number, got nan"),
    _ck("checkpoint-config-null", _config_text("null"), r"bad config metadata: expected a JSON object, got NoneType"),
    _ck("checkpoint-extra-tensor-like-a-layer", _ckpt_tensors(lambda t: {**t, "layers.3.norm": torch.ones(32)}), r"unexpected tensor 'layers\.3\.norm'"),
    _ck("checkpoint-extra-and-missing", _ckpt_tensors(lambda t: {**_drop("embed")(t), "embedding": t["embed"]}), r"missing tensor 'embed'"),
    _ck("checkpoint-scalar-for-vector", _ckpt_tensors(lambda t: {**t, "final_norm": torch.tensor(1.0)}), r"tensor 'final_norm' has shape \(\), expected \(32,\)"),
    _ck("checkpoint-empty-format", _ckpt_header(_empty_format), r"unsupported format '', expected 'batchc\.hybrid/1'"),
    _ck("checkpoint-path-is-a-directory", _directory, r"no such checkpoint file"),
]


# -- the registered ticket is the truth (see tests/backend/test_ledger_truth.py for the same with a model) --


def _prefills(w: World) -> Ctx:
    """Plan A (requests in slots 1 and 2, both cleared) and plan B (slot 3 copies the cached state in slot 4),
    registered and outstanding."""
    a = lower(prepare_for_extend([request(1, 1, [5], 0), request(2, 2, [6], 1)]), LowerContext())
    b = lower(prepare_for_extend([request(3, 3, [7], 8, intent=CopyFrom(src=MambaSlot(4), prefix_len=2))]), LowerContext())
    w.slots.alloc()  # slot 4: the cached state
    w.ledger.register((*a.tickets, *b.tickets))
    return {"a": a, "b": b, "serial": a.tickets[0].serial}


def _forged(init: Callable[[Ctx], MambaInit]) -> Callable[[World, Ctx], object]:
    def act(w: World, ctx: Ctx) -> object:
        return w.executor.execute(attrs.evolve(ctx["a"], tickets=(Ticket(pool=TARGET_POOL, op=init(ctx)),)))

    return act


def _register(ticket: Callable[[Ctx], InitTicket]) -> Callable[[World, Ctx], object]:
    return lambda w, ctx: w.ledger.register([ticket(ctx)])


def _ran_snapshot(w: World) -> Ctx:
    ctx = _snapshot_plan(3)(w)
    w.executor.execute(ctx["plan"])
    return ctx


def _foreign_rows_snapshot(w: World) -> Ctx:
    ctx = _snapshot_plan(3)(w)
    snapshots = ctx["plan"].snapshots
    ctx["plan"] = ExtendPlan(
        rids=[2], slots=[2], prefix_lens=[3], extend_lens=[1], more_chunks=[False], input_ids=[5], kv_locs=[40],
        tickets=(), snapshots=snapshots,
    )
    return ctx


def _swapped_commit(w: World, ctx: Ctx) -> object:
    batch = ctx["commit"].batch
    return w.executor.execute(CommitPlan(batch=attrs.evolve(batch, slots=batch.slots[::-1].copy())))


LEDGER_CASES = [
    Case(
        "forged-ops-under-an-outstanding-serial",
        _forged(lambda ctx: attrs.evolve(ctx["a"].tickets[0].op, clear_slots=(1,))),
        TicketMismatchError,
        r"ticket #<serial> for pool 'target' handed to the executor with other ops: .*registered ops clear \[1, 2\], cow \[\]; these ops clear \[1\], cow \[\]",
        setup=_prefills,
    ),
    Case(
        "forged-mambainit-with-an-outstanding-serial",
        _forged(lambda ctx: MambaInit(serial=ctx["serial"], clear_slots=(2,), cow_src=(4,), cow_dst=(1,))),
        TicketMismatchError,
        r"these ops clear \[2\], cow \[4->1\]",
        setup=_prefills,
    ),
    Case(
        "swapped-tickets",
        lambda w, ctx: w.executor.execute(attrs.evolve(ctx["a"], tickets=ctx["b"].tickets)),
        PlanExecutionError,
        r"init #\d+ writes slot 3, which is not a row of this plan \(rows \[1, 2\]\)",
        setup=_prefills,
    ),
    Case("snapshot-only-replay", _run("plan"), ResourceReplayError, r"replay of snapshot ticket #<serial> for pool 'target': already consumed", setup=_ran_snapshot),
    Case("snapshot-of-a-foreign-row", _run("plan"), PlanExecutionError, r"snapshot #<serial> reads slot 1, which is not a row of this plan \(rows \[2\]\)", setup=_foreign_rows_snapshot),
    Case(
        "commit-into-swapped-slots",
        _swapped_commit,
        PlanExecutionError,
        r"commit of verify #<vid> names slots \[2, 1\] with k=2; the verify ran on slots \[1, 2\] with k=2",
        setup=_verified([1, 2]),
    ),
    Case(
        "register-other-ops-under-an-outstanding-key",
        _register(lambda ctx: Ticket(pool=TARGET_POOL, op=MambaInit(serial=ctx["serial"], clear_slots=(3,)))),
        TicketMismatchError,
        r"ticket #<serial> for pool 'target' registered again with other ops",
        setup=_prefills,
    ),
    Case(
        "register-a-serial-never-minted",
        _register(lambda ctx: Ticket(pool=TARGET_POOL, op=MambaInit(serial=TicketSerial(ctx["serial"] + 10**6), clear_slots=(3,)))),
        UnknownTicketError,
        r"was not minted by this process and no trusted peer sent it",
        setup=_prefills,
    ),
    Case("prefix-cache-bool-capacity", _build(lambda: PrefixCache(capacity=True)), PrefixCacheError, r"PrefixCache\(capacity\): must be an int, not bool \(got True\)"),
    Case("prefix-cache-float-block", _build(lambda: _cache_of(capacity=2, block=8.0)), PrefixCacheError, r"PrefixCache\(block\): must be an int, not float \(got 8\.0\)"),
]


def _cache_of(**kw: Any) -> PrefixCache:
    with suppress_type_checks():  # the library's own check is under test, not typeguard's
        return PrefixCache(**kw)


# -- the test ------------------------------------------------------------------------------------------

CASES = SPEC_CASES + EXECUTOR_CASES + LEDGER_CASES + DRIVER_CASES + WORKLOAD_CASES + CHECKPOINT_CASES


def _pattern(case: Case, ctx: Ctx) -> str:
    pattern = case.match
    for name, value in ctx.items():
        pattern = pattern.replace(f"<{name}>", re.escape(str(value)))
    assert not re.search(r"<[a-z]+>", pattern), f"unfilled placeholder in {case.match!r}"
    return pattern


def test_the_rebuilt_checkpoint_is_the_good_one(tmp_path: Path) -> None:
    """The header edits above start from a faithful copy: unedited, it loads to the same model."""
    path = tmp_path / "rebuilt.safetensors"
    path.write_bytes(_file_bytes(*_good_layout(tmp_path)))
    good, rebuilt = load_checkpoint(_good_checkpoint(tmp_path)), load_checkpoint(path)
    assert rebuilt.config == good.config and rebuilt.weights.keys() == good.weights.keys()
    assert all(torch.equal(rebuilt.weights[k], good.weights[k]) for k in good.weights)


def test_corpus_is_large_and_ids_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 40
    assert {c.world for c in CASES} == {"core", "driver"}
    # every row names a specific error: a catch-all would accept a plain ValueError or TypeError
    assert not [c.id for c in CASES if c.error in (Exception, BaseException)]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Tiny-model ops are microseconds long; a second intra-op thread on a busy 2-core machine makes
    each wait milliseconds for a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PARAMS = [
    pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
    for c in CASES
]


@pytest.mark.parametrize("case", PARAMS)
def test_hostile_input_is_refused_and_changes_nothing(case: Case, tmp_path: Path) -> None:
    world: World | DriverWorld = core_world() if case.world == "core" else driver_world(tmp_path)
    ctx = (case.setup or (lambda w: {}))(world)
    if isinstance(world, DriverWorld):
        ctx.setdefault("slot", world.prefix.slot)
    pools_before, before = state_of(world)
    with pytest.raises(case.error, match=_pattern(case, ctx)) as info:
        case.act(world, ctx)
    assert type(info.value) is case.error, f"expected exactly {case.error.__name__}, got {type(info.value).__name__}: {info.value}"
    if case.field is not None:
        assert isinstance(info.value, IRValidationError)
        assert info.value.field == case.field
    if isinstance(info.value, (WorkloadError, CheckpointError)):
        assert "\n" not in str(info.value), "file errors are one line (the CLI prints them as is)"
    pools_after, after = state_of(world)
    for b, a in zip(pools_before, pools_after, strict=True):
        assert torch.equal(b, a), "pool bytes changed"
    assert before[0] == after[0], "ledger changed"
    assert before[1:] == after[1:], "allocator, driver or cache state changed"
