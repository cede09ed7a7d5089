"""Every public entry point of the serving stack checks its arguments: a bad value raises a typed
``BatchcError`` whose message names the argument and the value, before anything changes (no slot,
KV location, ticket or prefix-cache state is taken).

Covered here: the ``Engine`` constructor, ``abort``, ``make_prefix``, ``release_prefix``
(forged, foreign, released and still-needed prefix states), ``MambaStatePool``, ``Executor``, the
``PrefixCache`` methods, ``load_workload`` and ``load_checkpoint``. typeguard is on in the suite, so
calls with deliberately wrong types run under ``suppress_type_checks`` (production runs without it:
the library's own checks must hold).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from typeguard import suppress_type_checks

from backend.allocator import SlotAllocator
from backend.executor import Executor
from backend.hybrid.checkpoint import TARGET_FILE, CheckpointError, bundled_path, load_checkpoint
from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from backend.ledger import Ledger
from backend.pool import MAX_POOL_BYTES, MambaLayerSpec, MambaStatePool, PoolLayout
from compiler.engine import Engine, PrefixState
from compiler.engine import admission as sd
from compiler.offline import WorkloadError, load_workload
from compiler.prefix_cache import CacheEntry, PrefixCache, PrefixCacheError
from compiler.workload import MAX_K as CLI_MAX_K
from ir.errors import BatchcError, EngineStoppedError, IRValidationError, PreconditionError, SlotError
from ir.ids import TARGET_POOL, MambaSlot, RequestId
from tests.helpers import tiny_models

PREFIX = list(b"You are terse.\n")
MAX_LEN = 64


def _driver(**kw: Any) -> Engine:
    """A speculative driver (k = 2) with a prefix cache, a prefix, a running request started
    from it and a fresh one."""
    target, draft = tiny_models()
    options: dict[str, Any] = {"k": 2, "capacity": 6, "kv_capacity": 256, "max_len": MAX_LEN, "chunk_size": 16,
                               "prefix_cache": PrefixCache(capacity=3, block=8), **kw}
    return Engine(target, draft, **options)


def _world() -> tuple[Engine, PrefixState]:
    drv = _driver()
    cp = drv.make_prefix(PREFIX)
    drv.admit(RequestId(1), PREFIX + list(b"print(1)"), max_new_tokens=6, prefix=cp)
    drv.admit(RequestId(2), list(b"def f(x):"), max_new_tokens=6)
    assert drv.step().kind.value == "extend"
    assert drv.step().kind.value == "spec"
    return drv, cp


def _state(drv: Engine) -> tuple[list[torch.Tensor], tuple[object, ...]]:
    """(pool buffers, everything else) that a refused call must leave as it was."""
    assert drv.draft is not None and drv.cache is not None
    c = drv.cache
    return [drv.target.pool.buffer.clone(), drv.draft.pool.buffer.clone()], (
        drv.slots.num_free, drv.slots.live(), drv.kv.num_free, drv.kv.live(), drv.ledger.outstanding(), drv.ledger.num_consumed,
        drv.kv_refs.held(), drv.prefixes.held(), drv.live, drv.live_slots(), tuple(drv.requests.queued),
        {r: list(o) for r, o in drv.outputs.items()}, drv.stopped_by,
        tuple(attrs.asdict(e) for e in c.entries()), c.observed(), c.reserved, c.planned(), attrs.asdict(c.stats),
    )


def _assert_unchanged(drv: Engine, before: tuple[list[torch.Tensor], tuple[object, ...]]) -> None:
    after = _state(drv)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)), "pool bytes changed"
    assert before[1] == after[1], "driver, allocators, ledger or prefix cache changed"


def _refused(error: type[BaseException], match: str, call: Callable[[], object]) -> BaseException:
    with suppress_type_checks(), pytest.raises(error, match=match) as info:
        call()
    assert type(info.value) is error, f"expected exactly {error.__name__}, got {type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, BatchcError)
    return info.value


# -- 1. the Engine constructor ----------------------------------------------------------------


def _ctor_cases() -> list[tuple[str, dict[str, Any], str]]:
    target, draft = tiny_models()
    return [
        ("k-bool", {"k": True}, r"k must be an int, not bool \(got True\)"),
        ("k-float", {"k": 1.5}, r"k must be an int, not float \(got 1\.5\)"),
        ("k-huge", {"k": 2**63}, r"k must fit in int64 \(got 9223372036854775808\)"),
        ("k-negative", {"k": -1}, r"k must be in \[0, 32\], got -1"),
        ("k-too-large", {"k": 33}, r"k must be in \[0, 32\], got 33"),
        ("k-str", {"k": "2"}, r"k must be an int, not str \(got '2'\)"),
        ("k-none", {"k": None}, r"k must be an int, not NoneType \(got None\)"),
        ("max-len-bool", {"max_len": True}, r"max_len must be an int, not bool \(got True\)"),
        ("max-len-negative", {"max_len": -5}, r"max_len must be in \[1, 1048576\], got -5"),
        ("max-len-float", {"max_len": 1.5}, r"max_len must be an int, not float \(got 1\.5\)"),
        ("max-len-huge", {"max_len": 2**63}, r"max_len must fit in int64 \(got 9223372036854775808\)"),
        ("max-len-over-bound", {"max_len": 2**20 + 1}, r"max_len must be in \[1, 1048576\], got 1048577"),
        ("max-len-no-room", {"max_len": 4}, r"max_len 4 leaves no room .* k \+ 1 = 3"),
        ("capacity-zero", {"capacity": 0}, r"capacity must be in \[1, 1048576\], got 0"),
        ("capacity-bool", {"capacity": True}, r"capacity must be an int, not bool \(got True\)"),
        ("capacity-over-bound", {"capacity": 2**20 + 1}, r"capacity must be in \[1, 1048576\], got 1048577"),
        ("table-over-bound", {"capacity": 2**20, "max_len": 2**20}, r"\(capacity \+ 1\) \* max_len = \d+ token-table entries"),
        ("kv-capacity-zero", {"kv_capacity": 0}, r"kv_capacity must be in \[1, 2147483648\], got 0"),
        ("kv-capacity-over-bound", {"kv_capacity": 2**31 + 1}, r"kv_capacity must be in \[1, 2147483648\], got 2147483649"),
        ("kv-capacity-str", {"kv_capacity": "5"}, r"kv_capacity must be an int, not str \(got '5'\)"),
        ("chunk-size-float", {"chunk_size": 1.5}, r"chunk_size must be an int, not float \(got 1\.5\)"),
        ("chunk-size-zero", {"chunk_size": 0}, r"chunk_size must be >= 1, got 0"),
        ("token-budget-str", {"token_budget": "x"}, r"token_budget must be an int, not str \(got 'x'\)"),
        ("token-budget-zero", {"token_budget": 0}, r"token_budget must be >= 1, got 0"),
        ("retries-bool", {"retries": True}, r"retries must be an int, not bool \(got True\)"),
        ("retries-negative", {"retries": -1}, r"retries must be in \[0, 100\], got -1"),
        ("retries-over-bound", {"retries": 101}, r"retries must be in \[0, 100\], got 101"),
        ("mixed-str", {"mixed": "no"}, r"mixed must be a bool, not str \(got 'no'\)"),
        ("mixed-int", {"mixed": 1}, r"mixed must be a bool, not int \(got 1\)"),
        ("mixed-none", {"mixed": None}, r"mixed must be a bool, not NoneType \(got None\)"),
        ("prefix-cache-str", {"prefix_cache": "x"}, r"prefix_cache must be a PrefixCache or None, not str \(got 'x'\)"),
        ("pm-str", {"pm": "x"}, r"pm must be a PassManager or None, not str \(got 'x'\)"),
        ("draft-missing", {"draft": None}, r"speculative decoding \(k = 2\) needs a draft model, got draft=None"),
        ("draft-str", {"draft": "x"}, r"draft must be a ServedModel or None, not str \(got 'x'\)"),
        ("target-none", {"target": None}, r"target must be a ServedModel, not NoneType \(got None\)"),
        ("target-str", {"target": "model"}, r"target must be a ServedModel, not str \(got 'model'\)"),
        ("draft-vocab-mismatch", {"draft": HybridModel.from_seed(attrs.evolve(tiny(), vocab=128), seed=0)},
         r"draft vocabulary 128 differs from the target's 256"),
    ]


CTOR_CASES = _ctor_cases()


@pytest.mark.parametrize(("kw", "match"), [c[1:] for c in CTOR_CASES], ids=[c[0] for c in CTOR_CASES])
def test_spec_driver_constructor_refuses_before_allocating(kw: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = tiny_models()
    pools: list[object] = []
    real = HybridModel.new_pool

    def recording(self: HybridModel, *args: Any, **kwargs: Any) -> MambaStatePool:
        pools.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HybridModel, "new_pool", recording)
    args: dict[str, Any] = {"target": target, "draft": draft, "k": 2, "capacity": 6, "kv_capacity": 256, "max_len": MAX_LEN, **kw}
    _refused(PreconditionError, r"^Engine: " + match, lambda: Engine(**args))
    assert pools == [], "a pool was allocated before the refusal"


def test_spec_driver_constructor_takes_numpy_ints_as_python_ints() -> None:
    target, _ = tiny_models()
    with suppress_type_checks():
        drv = Engine(target, None, k=np.int64(0), capacity=np.int32(4), kv_capacity=np.uint16(128), max_len=np.int64(32),  # type: ignore[arg-type]
                         chunk_size=np.int8(8), token_budget=np.int64(16), retries=np.int64(1))  # type: ignore[arg-type]
    for value in (drv.k, drv.max_len, drv.chunk_size, drv.token_budget, drv.retries, drv.slots.capacity):
        assert type(value) is int
    drv.admit(RequestId(1), list(b"abc"), max_new_tokens=2)
    drv.run_until_done()
    assert len(drv.outputs[RequestId(1)]) == 2


def test_engine_k_bound_is_the_command_line_one() -> None:
    assert sd.MAX_K == CLI_MAX_K


# -- 2. abort ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rid", "match"),
    [
        (True, r"abort: rid must be an int, not bool \(got True\)"),
        (1.0, r"abort: rid must be an int, not float \(got 1\.0\)"),
        (np.float64(1.0), r"abort: rid must be an int, not float64 \(got np\.float64\(1\.0\)\)|abort: rid must be an int, not float64 \(got 1\.0\)"),
        ("1", r"abort: rid must be an int, not str \(got '1'\)"),
        (None, r"abort: rid must be an int, not NoneType \(got None\)"),
        (2**64, r"abort: rid must fit in int64 \(got 18446744073709551616\)"),
    ],
    ids=["bool", "float", "np-float64", "str", "none", "huge"],
)
def test_abort_checks_the_request_id(rid: object, match: str) -> None:
    drv, _ = _world()
    before = _state(drv)
    _refused(PreconditionError, match, lambda: drv.abort(rid))  # type: ignore[arg-type]
    _assert_unchanged(drv, before)
    assert RequestId(1) in drv.live_slots()
    with suppress_type_checks():
        drv.abort(np.int64(1))  # type: ignore[arg-type]  # numpy integers are ids
    assert RequestId(1) in drv.outputs and drv.stats.aborts == 1


@pytest.mark.parametrize("fork", [2, 7, 9], ids=["a live request", "its own id", "a finished request"])
def test_admit_refuses_a_fork_id_already_in_use_and_changes_nothing(fork: int) -> None:
    # a fork id names one completion of a request: another live request's, the request's own or a finished
    # request's (its output is still there to read) would mix two completions' tokens under one id
    from ir.sampling import SamplingParams

    drv, _ = _world()
    drv.admit(RequestId(9), list(b"x = 1"), max_new_tokens=1)
    while RequestId(9) not in drv.outputs:
        drv.step()
    before = _state(drv)
    _refused(PreconditionError, rf"request 7: fork id {fork} is already in use",
             lambda: drv.admit(RequestId(7), list(b"y = 2"), max_new_tokens=2, sampling=SamplingParams(n=2, temperature=1.0, seed=3),
                               forks=[RequestId(fork)]))
    _assert_unchanged(drv, before)
    drv.admit(RequestId(7), list(b"y = 2"), max_new_tokens=2, sampling=SamplingParams(n=2, temperature=1.0, seed=3), forks=[RequestId(8)])
    assert {RequestId(7), RequestId(8)} <= set(drv.requests.queued)


# -- 3. make_prefix ------------------------------------------------------------------------------


def test_make_prefix_longer_than_max_len_takes_nothing() -> None:
    drv, _ = _world()
    before = _state(drv)
    _refused(PreconditionError, r"make_prefix: tokens: a prefix of 100 tokens leaves no room under max_len 64",
             lambda: drv.make_prefix([65] * 100))
    _assert_unchanged(drv, before)
    drv.ledger.assert_drained()


def test_make_prefix_at_the_length_bound() -> None:
    drv, _ = _world()
    longest = MAX_LEN - drv.k - 3  # one more prompt token, one new token, k + 1 positions
    before = _state(drv)
    _refused(PreconditionError, rf"a prefix of {longest + 1} tokens leaves no room", lambda: drv.make_prefix([65] * (longest + 1)))
    _assert_unchanged(drv, before)
    cp = drv.make_prefix([65] * longest)
    drv.admit(RequestId(5), [65] * (longest + 1), max_new_tokens=1, prefix=cp)  # a request can extend it
    drv.run_until_done()
    drv.release_prefix(cp)
    drv.ledger.assert_drained()


def test_make_prefix_without_room_takes_nothing() -> None:
    target, draft = tiny_models()
    drv = Engine(target, draft, k=2, capacity=2, kv_capacity=20, max_len=MAX_LEN, prefix_cache=PrefixCache(capacity=1, block=8))
    drv.make_prefix(PREFIX)  # 15 of 20 KV locations, one of two slots
    before = _state(drv)
    _refused(PreconditionError, r"make_prefix: no room for a 15-token prefix \(1 free slots, 5 free KV locations\)",
             lambda: drv.make_prefix(PREFIX))
    _assert_unchanged(drv, before)


def test_make_prefix_bad_tokens_take_nothing() -> None:
    drv, _ = _world()
    before = _state(drv)
    for bad in (None, "abc", [1.5], [True], [300]):
        with suppress_type_checks(), pytest.raises(IRValidationError, match=r"prefix\.prompt"):
            drv.make_prefix(bad)  # type: ignore[arg-type]
    _assert_unchanged(drv, before)


# -- 4. release_prefix ---------------------------------------------------------------------------


def test_release_prefix_refuses_none_and_non_prefix_states() -> None:
    drv, cp = _world()
    before = _state(drv)
    _refused(PreconditionError, r"release_prefix: cp must be a PrefixState \(from make_prefix\), not NoneType \(got None\)",
             lambda: drv.release_prefix(None))  # type: ignore[arg-type]
    _refused(PreconditionError, r"release_prefix: cp must be a PrefixState .*not MambaSlot|not int \(got \d+\)",
             lambda: drv.release_prefix(cp.slot))  # type: ignore[arg-type]
    _refused(PreconditionError, r"release_prefix: cp\.slot must be an int, not bool \(got True\)",
             lambda: drv.release_prefix(attrs.evolve(cp, slot=True)))  # type: ignore[arg-type]
    _assert_unchanged(drv, before)


def test_forged_prefix_over_a_live_request_slot_is_refused() -> None:
    drv, _ = _world()
    slot = drv.live_slots()[RequestId(2)]
    forged = PrefixState(slot=slot, tokens=(), kv_locs=())
    before = _state(drv)
    _refused(PreconditionError, rf"release_prefix: cp PrefixState\(slot={slot}, tokens=\(\), kv_locs=\(\)\) is not a prefix this engine holds",
             lambda: drv.release_prefix(forged))
    _assert_unchanged(drv, before)
    drv.run_until_done()  # request 2 kept its slot and finishes
    assert len(drv.outputs[RequestId(2)]) == 6


def test_prefix_with_kv_locations_it_does_not_hold_is_refused() -> None:
    drv, cp = _world()
    for forged in (attrs.evolve(cp, kv_locs=tuple(range(200, 215))), attrs.evolve(cp, kv_locs=cp.kv_locs[:-1] + (cp.kv_locs[-1] + 1,)),
                   attrs.evolve(cp, tokens=cp.tokens[:-1])):
        before = _state(drv)
        _refused(PreconditionError, r"release_prefix: cp .* is not a prefix this engine holds", lambda: drv.release_prefix(forged))
        _assert_unchanged(drv, before)
    assert min(drv.kv_refs.held().values()) >= 1  # no reference count went to 0 or below


def test_release_waits_for_requests_still_to_copy_the_prefix() -> None:
    drv, cp = _world()
    drv.admit(RequestId(7), PREFIX + list(b"x = 1"), max_new_tokens=2, prefix=cp)  # its COW has not run
    before = _state(drv)
    _refused(PreconditionError, rf"release_prefix: prefix in slot {cp.slot} is still to be copied by request\(s\) \[7\]",
             lambda: drv.release_prefix(cp))
    _assert_unchanged(drv, before)
    drv.run_until_done()
    assert len(drv.outputs[RequestId(7)]) == 2
    drv.release_prefix(cp)  # its copies have run: released now
    assert drv.cache is not None and drv.slots.num_live == len(drv.cache.entries())
    drv.drop_cache()
    assert drv.slots.num_live == 0 and drv.kv.num_live == 0
    drv.ledger.assert_drained()


def test_released_prefix_cannot_be_used_or_released_again() -> None:
    drv, cp = _world()
    drv.run_until_done()
    drv.release_prefix(cp)
    before = _state(drv)
    _refused(SlotError, rf"release_prefix: double free of slot {cp.slot}", lambda: drv.release_prefix(cp))
    _refused(PreconditionError, rf"admit: request 9: prefix slot {cp.slot} was released",
             lambda: drv.admit(RequestId(9), PREFIX + [1, 2], max_new_tokens=2, prefix=cp))
    _assert_unchanged(drv, before)
    # its slot handed out again to a new prefix with other tokens: the old record is still refused
    other = drv.make_prefix(list(b"Other prefix here"))
    assert other.slot == cp.slot
    before = _state(drv)
    _refused(PreconditionError, r"release_prefix: cp .* is not a prefix this engine holds", lambda: drv.release_prefix(cp))
    _refused(PreconditionError, r"admit: request 9: (prompt does not extend|prefix .* is not a prefix this engine holds)",
             lambda: drv.admit(RequestId(9), PREFIX + [1, 2], max_new_tokens=2, prefix=cp))
    _assert_unchanged(drv, before)
    drv.release_prefix(other)


def test_prefix_of_another_driver_is_refused() -> None:
    drv, cp = _world()
    other, other_cp = _world()
    drv.run_until_done()
    other.run_until_done()
    foreign = attrs.evolve(other_cp, kv_locs=tuple(x + 1 for x in other_cp.kv_locs))
    before = _state(drv)
    _refused(PreconditionError, r"is not a prefix this engine holds", lambda: drv.release_prefix(foreign))
    _assert_unchanged(drv, before)


def test_admit_refuses_a_forged_record_of_a_live_prefix() -> None:
    """Same slot and held KV locations, other tokens: not the record make_prefix returned."""
    drv, cp = _world()
    forged = attrs.evolve(cp, tokens=(0,) * len(cp.tokens))
    before = _state(drv)
    _refused(PreconditionError, r"admit: request 9: prefix .* is not a prefix this engine holds",
             lambda: drv.admit(RequestId(9), [0] * len(cp.tokens) + [1], max_new_tokens=2, prefix=forged))
    _assert_unchanged(drv, before)


def test_prefix_refused_after_the_engine_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    drv, cp = _world()

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(drv.pipeline.pm, "run", failing)
    with pytest.raises(OSError):
        drv.step()
    monkeypatch.undo()
    before = _state(drv)
    for call in (lambda: drv.make_prefix(PREFIX), lambda: drv.release_prefix(cp)):
        _refused(EngineStoppedError, r"engine stopped: an earlier step raised OSError", call)
    _assert_unchanged(drv, before)


def test_a_failing_prefix_prefill_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    drv, _ = _world()
    drv.run_until_done()

    def failing(plan: Any) -> Any:
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(drv.target, "execute", failing)
    with pytest.raises(RuntimeError, match="kernel fault"):
        drv.make_prefix(list(b"abc"))
    monkeypatch.undo()
    _refused(EngineStoppedError, r"engine stopped: an earlier step raised RuntimeError\('kernel fault'\)",
             lambda: drv.admit(RequestId(9), list(b"abc"), max_new_tokens=1))


# -- 5. MambaStatePool -------------------------------------------------------------------------------


LAYOUT = PoolLayout(layers=[MambaLayerSpec(conv_dim=8, kernel_width=4, nheads=2, head_dim=4, d_state=4)])


@pytest.mark.parametrize(
    ("args", "field", "match"),
    [
        ((TARGET_POOL, LAYOUT, True), "capacity", r"must be an int, not bool \(got True\)"),
        ((TARGET_POOL, LAYOUT, 2.0), "capacity", r"must be an int, not float \(got 2\.0\)"),
        ((TARGET_POOL, LAYOUT, "3"), "capacity", r"must be an int, not str \(got '3'\)"),
        ((TARGET_POOL, LAYOUT, None), "capacity", r"must be an int, not NoneType \(got None\)"),
        ((TARGET_POOL, LAYOUT, 2**63), "capacity", r"must fit in int64 \(got 9223372036854775808\)"),
        ((TARGET_POOL, LAYOUT, 0), "capacity", r"must be in \[1, 1048576\] \(got 0\)"),
        ((TARGET_POOL, LAYOUT, -3), "capacity", r"must be in \[1, 1048576\] \(got -3\)"),
        ((TARGET_POOL, LAYOUT, 2**20 + 1), "capacity", r"must be in \[1, 1048576\] \(got 1048577\)"),
        ((None, LAYOUT, 2), "pool_id", r"must be a pool name \(a non-empty str\), not NoneType \(got None\)"),
        (("", LAYOUT, 2), "pool_id", r"must be a non-empty pool name \(got ''\)"),
        ((3, LAYOUT, 2), "pool_id", r"must be a pool name .*not int \(got 3\)"),
        ((TARGET_POOL, None, 2), "layout", r"must be a PoolLayout, not NoneType \(got None\)"),
    ],
    ids=["cap-bool", "cap-float", "cap-str", "cap-none", "cap-huge", "cap-zero", "cap-negative", "cap-over-bound",
         "id-none", "id-empty", "id-int", "layout-none"],
)
def test_state_pool_checks_its_arguments(args: tuple[object, ...], field: str, match: str) -> None:
    err = _refused(IRValidationError, rf"^MambaStatePool\.{field}: {match}", lambda: MambaStatePool(*args))  # type: ignore[arg-type]
    assert isinstance(err, IRValidationError) and err.field == field


def test_state_pool_bytes_bound() -> None:
    big = PoolLayout(layers=[MambaLayerSpec(conv_dim=1 << 16, kernel_width=4, nheads=1 << 10, head_dim=1 << 8, d_state=1 << 8)] * 4)
    capacity = MAX_POOL_BYTES // big.row_bytes  # (capacity + 1) rows: one too many
    _refused(IRValidationError, rf"MambaStatePool\.capacity: {capacity + 1} rows of {big.row_bytes} bytes exceed the pool bound",
             lambda: MambaStatePool(TARGET_POOL, big, capacity))


def test_state_pool_takes_numpy_capacity() -> None:
    with suppress_type_checks():
        pool = MambaStatePool(TARGET_POOL, LAYOUT, np.int32(3))  # type: ignore[arg-type]
    assert type(pool.capacity) is int and pool.num_slots == 4 and pool.buffer.shape[0] == 4


# -- 6. Executor -------------------------------------------------------------------------------------


class _NoForward:
    def propose(self) -> None:
        pass


@pytest.mark.parametrize(
    ("build", "field", "match"),
    [
        (lambda pool, ledger: Executor(None, ledger), "pool", r"must be a MambaStatePool, not NoneType \(got None\)"),  # type: ignore[arg-type]
        (lambda pool, ledger: Executor(pool, None), "ledger", r"must be a Ledger, not NoneType \(got None\)"),  # type: ignore[arg-type]
        (lambda pool, ledger: Executor(pool, ledger, _NoForward()), "model", r"must be a ModelHook or None, not _NoForward"),  # type: ignore[arg-type]
        (lambda pool, ledger: Executor(pool, ledger, slots="x"), "slots", r"must be a SlotAllocator or None, not str \(got 'x'\)"),  # type: ignore[arg-type]
        (lambda pool, ledger: Executor(pool, ledger, transactional=1), "transactional", r"must be a bool, not int \(got 1\)"),  # type: ignore[arg-type]
        (lambda pool, ledger: Executor(pool, ledger, watch="no"), "watch", r"must be a bool or None, not str \(got 'no'\)"),  # type: ignore[arg-type]
    ],
    ids=["pool-none", "ledger-none", "model-without-forward", "slots-str", "transactional-int", "watch-str"],
)
def test_executor_checks_its_arguments(build: Callable[[MambaStatePool, Ledger], Executor], field: str, match: str) -> None:
    pool, ledger = MambaStatePool(TARGET_POOL, LAYOUT, 2), Ledger()
    before = pool.buffer.clone()
    err = _refused(IRValidationError, rf"^Executor\.{field}: {match}", lambda: build(pool, ledger))
    assert isinstance(err, IRValidationError) and err.field == field
    assert torch.equal(pool.buffer, before) and ledger.outstanding() == ()


def test_executor_accepts_its_documented_arguments() -> None:
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 2)
    ex = Executor(pool, Ledger(), None, slots=SlotAllocator(2), transactional=True, watch=None)
    assert ex.transactional and ex.slots is not None


# -- 7. PrefixCache ----------------------------------------------------------------------------------


def _cache_state(c: PrefixCache) -> tuple[object, ...]:
    return (tuple(attrs.asdict(e) for e in c.entries()), c.observed(), c.reserved, c.planned(), attrs.asdict(c.stats))


def _cache_with_entry() -> tuple[PrefixCache, CacheEntry]:
    c = PrefixCache(capacity=2, block=4)
    entry = CacheEntry(slot=MambaSlot(1), tokens=(1, 2, 3, 4), kv_locs=(1, 2, 3, 4))
    assert c.reserve_room()
    c.insert(entry)
    c.observe([1, 2, 3, 4, 5, 6, 7, 8, 9])
    return c, entry


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c, e: c.observe(["a", "b", "c", "d", "e"]), r"observe\(tokens\): every token id must be an int, not str \(got 'a'\)"),
        (lambda c, e: c.observe([1.5] * 9), r"observe\(tokens\): every token id must be an int, not float \(got 1\.5\)"),
        (lambda c, e: c.observe([True] * 9), r"observe\(tokens\): every token id must be an int, not bool \(got True\)"),
        (lambda c, e: c.observe(None), r"observe\(tokens\): must be a sequence of token ids, not NoneType \(got None\)"),
        (lambda c, e: c.observe("abcdefgh"), r"observe\(tokens\): must be a sequence of token ids, not str \(got 'abcdefgh'\)"),
        (lambda c, e: c.observe([-1] * 9), r"observe\(tokens\): token ids must be >= 0 \(got -1\)"),
        (lambda c, e: c.observe([2**64] * 9), r"observe\(tokens\): every token id must fit in int64 \(got 18446744073709551616\)"),
        (lambda c, e: c.observe(np.ones((3, 3), dtype=np.int64)), r"observe\(tokens\): must be a 1-D integer array, got dtype int64 and shape \(3, 3\)"),
        (lambda c, e: c.observe(np.ones(9)), r"observe\(tokens\): must be a 1-D integer array, got dtype float64"),
        (lambda c, e: c.lookup(None), r"lookup\(tokens\): must be a sequence of token ids, not NoneType \(got None\)"),
        (lambda c, e: c.lookup([1, 2, 3, 4, "x"]), r"lookup\(tokens\): every token id must be an int, not str \(got 'x'\)"),
        (lambda c, e: c.plan_snapshot([1] * 9, True), r"plan_snapshot\(after\): must be an int, not bool \(got True\)"),
        (lambda c, e: c.plan_snapshot([1] * 9, -1), r"plan_snapshot\(after\): must be >= 0 \(got -1\)"),
        (lambda c, e: c.cancel_plan(None), r"cancel_plan\(tokens\): must be a sequence of token ids, not NoneType"),
        (lambda c, e: c.insert(None), r"insert\(entry\): must be a CacheEntry, not NoneType \(got None\)"),
        (lambda c, e: c.insert(CacheEntry(slot=True, tokens=(5, 6, 7, 8), kv_locs=(5, 6, 7, 8))), r"insert\(entry\): slot must be an int, not bool \(got True\)"),  # type: ignore[arg-type]
        (lambda c, e: c.insert(CacheEntry(slot=MambaSlot(2), tokens=[5, 6, 7, 8], kv_locs=(5, 6, 7, 8))), r"insert\(entry\): tokens must be a tuple of ints, not list"),  # type: ignore[arg-type]
        (lambda c, e: c.insert(CacheEntry(slot=MambaSlot(2), tokens=(5, 6, 7, 8.0), kv_locs=(5, 6, 7, 8))), r"insert\(entry\): every tokens entry must be an int, not float \(got 8\.0\)"),  # type: ignore[arg-type]
        (lambda c, e: c.insert(CacheEntry(slot=MambaSlot(2), tokens=(5, 6, 7), kv_locs=(5, 6, 7))), r"insert\(entry\): a prefix of 3 tokens does not end at a block boundary \(block 4\)"),
        (lambda c, e: c.insert(CacheEntry(slot=MambaSlot(2), tokens=(5, 6, 7, 8), kv_locs=(5, 6))), r"insert\(entry\): 2 KV locations for 4 tokens"),
        (lambda c, e: c.insert(CacheEntry(slot=MambaSlot(2), tokens=(5, 6, 7, 8), kv_locs=(5, 6, 7, 8), pins=1)), r"insert\(entry\): a new entry must not be pinned \(got pins=1\)"),
        (lambda c, e: c.pin(None), r"pin\(entry\): must be a CacheEntry, not NoneType \(got None\)"),
        (lambda c, e: c.pin(attrs.evolve(e)), r"pin\(entry\): the entry of slot 1 \(4 tokens\) is not in this cache"),
        (lambda c, e: c.unpin(CacheEntry(slot=MambaSlot(3), tokens=(9, 9, 9, 9), kv_locs=(9, 9, 9, 9), pins=1)), r"unpin\(entry\): the entry of slot 3 \(4 tokens\) is not in this cache"),
    ],
    ids=["observe-str-tokens", "observe-floats", "observe-bools", "observe-none", "observe-str", "observe-negative", "observe-huge",
         "observe-2d", "observe-float-array", "lookup-none", "lookup-str-token", "plan-after-bool", "plan-after-negative",
         "cancel-none", "insert-none", "insert-bool-slot", "insert-list-tokens", "insert-float-token", "insert-off-block",
         "insert-kv-length", "insert-pinned", "pin-none", "pin-foreign-entry", "unpin-foreign-entry"],
)
def test_prefix_cache_checks_before_changing_anything(call: Callable[[PrefixCache, CacheEntry], object], match: str) -> None:
    c, entry = _cache_with_entry()
    assert c.reserve_room()  # an insert would consume this reservation
    before = _cache_state(c)
    _refused(PrefixCacheError, match, lambda: call(c, entry))
    assert _cache_state(c) == before
    assert entry.pins == 0


def test_prefix_cache_takes_numpy_tokens() -> None:
    c = PrefixCache(capacity=2, block=4)
    with suppress_type_checks():  # the annotations say Sequence[int]; 1-D integer arrays are taken too
        c.observe(np.arange(9, dtype=np.int32))  # type: ignore[arg-type]
        c.observe(list(range(9)))
        assert c.plan_snapshot(np.arange(9), np.int64(0)) == 8  # type: ignore[arg-type]
    assert all(type(t) is int for key in c.observed() for t in key)


# -- 8. load_workload and load_checkpoint -------------------------------------------------------------


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "workload.jsonl"
    path.write_text('{"prompt": "hello", "max_new_tokens": 2}\n', encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"path": None}, r"path must be a str or a path, not NoneType \(got None\)"),
        ({"path": 123}, r"path must be a str or a path, not int \(got 123\)"),
        ({"max_len": "x"}, r"max_len must be an int, not str \(got 'x'\)"),
        ({"max_len": True}, r"max_len must be an int, not bool \(got True\)"),
        ({"max_len": 0}, r"max_len must be in \[1, 1048576\], got 0"),
        ({"reserve": None}, r"reserve must be an int, not NoneType \(got None\)"),
        ({"reserve": -1}, r"reserve must be in \[0, 1048576\], got -1"),
        ({"reserve": 63}, r"reserve 63 leaves no room under max_len 64"),
        ({"vocab": None}, r"vocab must be an int, not NoneType \(got None\)"),
        ({"vocab": 2**70}, r"vocab must fit in int64 \(got 1180591620717411303424\)"),
        ({"vocab": 2**40}, r"vocab must be in \[1, 262144\], got 1099511627776"),
        ({"vocab": 0}, r"vocab must be in \[1, 262144\], got 0"),
        ({"default_max_new_tokens": 1.5}, r"default_max_new_tokens must be an int, not float \(got 1\.5\)"),
        ({"default_max_new_tokens": 0}, r"default_max_new_tokens must be in \[1, 1048576\], got 0"),
    ],
    ids=["path-none", "path-int", "max-len-str", "max-len-bool", "max-len-zero", "reserve-none", "reserve-negative",
         "reserve-no-room", "vocab-none", "vocab-huge", "vocab-over-bound", "vocab-zero", "default-new-float", "default-new-zero"],
)
def test_load_workload_checks_its_arguments_first(workload: Path, kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"path": workload, "max_len": 64, **kw}
    err = _refused(WorkloadError, r"^load_workload: " + match, lambda: load_workload(args.pop("path"), **args))
    assert "workload.jsonl" not in str(err)  # the argument is blamed, not a line of the file


def test_load_workload_takes_numpy_ints(workload: Path) -> None:
    with suppress_type_checks():
        loaded = load_workload(str(workload), max_len=np.int64(64), reserve=np.int32(3), vocab=np.int64(256))  # type: ignore[arg-type]
    assert [r.prompt for r in loaded] == [b"hello"]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"device": "tpu"}, r"device must be 'cpu' or an available CUDA device, got 'tpu'"),
        ({"device": "meta"}, r"device must be 'cpu' or an available CUDA device, got 'meta'"),
        ({"device": 3}, r"device must be a str or a torch\.device, not int \(got 3\)"),
        ({"device": None}, r"device must be a str or a torch\.device, not NoneType \(got None\)"),
        ({"dtype": torch.int64}, r"dtype must be torch\.float32, torch\.float16 or torch\.bfloat16, got torch\.int64"),
        ({"dtype": "float"}, r"dtype must be torch\.float32, torch\.float16 or torch\.bfloat16, got 'float'"),
        ({"dtype": None}, r"dtype must be .* got None"),
        ({"path": None}, r"path must be a str or a path, not NoneType"),
    ],
    ids=["device-tpu", "device-meta", "device-int", "device-none", "dtype-int64", "dtype-str", "dtype-none", "path-none"],
)
def test_load_checkpoint_checks_device_and_dtype(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"path": bundled_path(TARGET_FILE), **kw}
    _refused(CheckpointError, match, lambda: load_checkpoint(args.pop("path"), **args))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this process has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=str)
def test_load_checkpoint_refuses_cuda_without_a_gpu(device: object) -> None:
    _refused(CheckpointError, rf"{re.escape(str(bundled_path(TARGET_FILE)))}: device .*CUDA is not available in this process",
             lambda: load_checkpoint(bundled_path(TARGET_FILE), device=device))  # type: ignore[arg-type]


def test_load_checkpoint_still_loads() -> None:
    model = load_checkpoint(bundled_path(TARGET_FILE), device=torch.device("cpu"), dtype=torch.bfloat16)
    assert model.config.vocab == 256


# -- third hostile round: layer specs, layouts, devices, typed entry points, lengths --------------


_SPEC = {"conv_dim": 4, "kernel_width": 4, "nheads": 2, "head_dim": 2, "d_state": 2}


@pytest.mark.parametrize("field", ["conv_dim", "kernel_width", "nheads", "head_dim", "d_state"])
@pytest.mark.parametrize("value", [True, 3.0, None, "4", 0, 2**70], ids=["bool", "float", "None", "str", "zero", "huge"])
def test_layer_spec_dimensions_are_checked(field: str, value: object) -> None:
    err = _refused(IRValidationError, rf"^MambaLayerSpec\.{field}: ", lambda: MambaLayerSpec(**{**_SPEC, field: value}))
    assert repr(value)[:20] in str(err)


@pytest.mark.parametrize("dtype", ["float32", torch.int64, None])
def test_layer_spec_dtypes_are_checked(dtype: object) -> None:
    _refused(IRValidationError, r"^MambaLayerSpec\.conv_dtype: must be torch.float32", lambda: MambaLayerSpec(**_SPEC, conv_dtype=dtype))


def test_layer_spec_keeps_numpy_dimensions_as_ints() -> None:
    spec = MambaLayerSpec(**{**_SPEC, "nheads": np.int32(3)})
    assert type(spec.nheads) is int and spec.nheads == 3


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layers": []}, r"^PoolLayout\.layers: a pool layout needs at least one Mamba layer"),
        ({"layers": None}, r"^PoolLayout\.layers: must be a sequence of MambaLayerSpec"),
        ({"layers": "ab"}, r"^PoolLayout\.layers: must be a sequence of MambaLayerSpec"),
        ({"layers": [None]}, r"^PoolLayout\.layers\[0\]: must be a MambaLayerSpec, not NoneType"),
        ({"layers": [{"conv_dim": 4}]}, r"^PoolLayout\.layers\[0\]: must be a MambaLayerSpec, not dict"),
        ({"align": 24}, r"^PoolLayout\.align: must be a power of two in \[16, 4096\] \(got 24\)"),
        ({"align": True}, r"^PoolLayout\.align: .*bool"),
        ({"align": 256.0}, r"^PoolLayout\.align: .*float"),
        ({"align": None}, r"^PoolLayout\.align: "),
        ({"align": "256"}, r"^PoolLayout\.align: "),
    ],
    ids=["empty", "None", "str", "None-layer", "dict-layer", "align-24", "align-bool", "align-float", "align-None", "align-str"],
)
def test_pool_layout_arguments_are_checked(kw: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"layers": [MambaLayerSpec(**_SPEC)], **kw}
    _refused(IRValidationError, match, lambda: PoolLayout(**args))


def _pool() -> MambaStatePool:
    return MambaStatePool(TARGET_POOL, PoolLayout(layers=[MambaLayerSpec(**_SPEC)]), 4)


@pytest.mark.parametrize("device", ["quantum", "cuda:7", 3], ids=["unknown", "cuda-absent", "int"])
def test_pool_device_is_checked_before_allocation(device: object) -> None:
    _refused(IRValidationError, r"^MambaStatePool\.device: device", lambda: MambaStatePool(TARGET_POOL, _pool().layout, 4, device=device))


@pytest.mark.parametrize("layer", [1, -1, "0", None, True], ids=["past-end", "negative", "str", "None", "bool"])
def test_pool_layer_index_is_checked(layer: object) -> None:
    pool = _pool()
    for view in (pool.conv_state, pool.ssm_state):
        _refused(IRValidationError, r"^MambaStatePool\.layer: ", lambda: view(layer))  # type: ignore[arg-type]  # deliberately wrong


@pytest.mark.parametrize("entry", ["run_prefill", "run_decode", "run_draft", "run_verify", "run_commit", "run_draft_commit", "run_draft_extend"])
def test_executor_typed_entry_points_refuse_other_values(entry: str) -> None:
    pool = _pool()
    ex = Executor(pool, Ledger())
    before = pool.buffer.clone()
    with suppress_type_checks():
        call = {"run_prefill": ex.run_prefill, "run_decode": ex.run_decode, "run_draft": ex.run_draft,
                "run_verify": ex.run_verify, "run_commit": ex.run_commit, "run_draft_commit": ex.run_draft_commit,
                "run_draft_extend": ex.run_draft_extend}[entry]
    from ir.errors import PlanExecutionError

    _refused(PlanExecutionError, rf"^Executor\.{entry}: expected .*, got a NoneType", lambda: call(None))  # type: ignore[arg-type]
    assert torch.equal(pool.buffer, before)


def test_executor_refuses_a_slot_allocator_of_another_capacity() -> None:
    _refused(IRValidationError, r"^Executor\.slots: the slot allocator's capacity 100 differs from the pool's 4",
             lambda: Executor(_pool(), Ledger(), slots=SlotAllocator(100)))


def test_ledger_cancel_needs_a_reason() -> None:
    from ir.init import MambaInit, Ticket, mint_serial

    ledger = Ledger()
    ticket = Ticket(pool=TARGET_POOL, op=MambaInit(serial=mint_serial(), clear_slots=(1,)))
    ledger.register([ticket])
    for reason in (None, "", 3):
        _refused(PreconditionError, r"^Ledger\.cancel: reason must be a non-empty str", lambda: ledger.cancel(ticket, reason))  # type: ignore[arg-type]
    assert ledger.outstanding() == (ticket,) and ledger.cancelled() == {}


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (CacheEntry(slot=MambaSlot(0), tokens=(1, 2, 3, 4), kv_locs=(1, 2, 3, 4)), r"slot must be a cache slot >= 1 .* got 0"),
        (CacheEntry(slot=MambaSlot(-5), tokens=(1, 2, 3, 4), kv_locs=(1, 2, 3, 4)), r"slot must be a cache slot >= 1 .* got -5"),
        (CacheEntry(slot=MambaSlot(1), tokens=(-1, -1, -1, -1), kv_locs=(1, 2, 3, 4)), r"every tokens entry must be >= 0 \(got -1\)"),
        (CacheEntry(slot=MambaSlot(1), tokens=(1, 2, 3, 4), kv_locs=(1, -2, 3, 4)), r"every kv_locs entry must be >= 0 \(got -2\)"),
    ],
    ids=["slot-0", "slot-negative", "negative-token", "negative-kv"],
)
def test_prefix_cache_insert_refuses_impossible_entries(entry: CacheEntry, match: str) -> None:
    cache = PrefixCache(capacity=2, block=4)
    assert cache.reserve_room()
    _refused(PrefixCacheError, r"^insert\(entry\): " + match, lambda: cache.insert(entry))
    assert cache.entries() == () and cache.reserved == 1  # the reservation is still held


@pytest.mark.parametrize("max_steps", [True, "x", None, 1.5, -1], ids=["bool", "str", "None", "float", "negative"])
def test_run_until_done_checks_max_steps(max_steps: object) -> None:
    drv, _ = _world()
    before = _state(drv)
    _refused(PreconditionError, r"^run_until_done: max_steps must be an int >= 0", lambda: drv.run_until_done(max_steps))  # type: ignore[arg-type]
    _assert_unchanged(drv, before)


@pytest.mark.parametrize("huge", [range(10**10), np.broadcast_to(np.int64(1), (2**36,))], ids=["range", "broadcast"])
def test_a_huge_prompt_is_refused_by_its_length_unread(huge: Any) -> None:
    drv, _ = _world()
    before = _state(drv)
    _refused(IRValidationError, rf"^request 9\.prompt: is longer than {sd.MAX_LEN} tokens \(got '<{len(huge)} tokens>'\)",
             lambda: drv.admit(RequestId(9), huge, max_new_tokens=1))
    _refused(IRValidationError, rf"^prefix\.prompt: is longer than {sd.MAX_LEN} tokens", lambda: drv.make_prefix(huge))
    _assert_unchanged(drv, before)


def test_a_prompt_without_a_length_is_refused() -> None:
    drv, _ = _world()
    _refused(IRValidationError, r"^request 9\.prompt: must be a sequence of int token ids, not generator",
             lambda: drv.admit(RequestId(9), (t for t in [1, 2, 3]), max_new_tokens=1))  # type: ignore[arg-type]
