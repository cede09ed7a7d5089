"""The state-store contract (``backend.state_store``): an engine's own state tensors get the same
guarantees under ``StateOps.applying`` as batchc's pool under its executor. Every test runs on two
stores: batchc's ``MambaStatePool`` and a ``DictStore`` of named tensors, as an engine would keep
its per-layer states; a third, without save/restore, shows what a failure leaves in a plain store.
The stores' contents are compared, not only the ledger's books."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import pytest
import torch
from typeguard import suppress_type_checks

from backend.ledger import Ledger
from backend.pool import MambaStatePool
from backend.state_store import Applied, DictStore, RestorableStore, StateOps, StateStore
from compiler.steps import Pipeline
from compiler.testing.fakes import small_pool
from ir.errors import PlanExecutionError, ResourceReplayError, TicketMismatchError, UnknownTicketError
from ir.ids import TARGET_POOL, MambaSlot, PoolId, RequestId
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from passes import DecodeContext, lower, prepare_for_extend
from passes.lower import LowerContext

CAPACITY = 8


def _pool() -> MambaStatePool:
    return small_pool(str(TARGET_POOL), CAPACITY)


def _dict_store() -> DictStore:
    return DictStore(str(TARGET_POOL), {"conv": torch.zeros(CAPACITY + 1, 3, 2), "ssm": torch.zeros(CAPACITY + 1, 4, dtype=torch.float64)})


def _contents(store: StateStore) -> list[torch.Tensor]:
    if isinstance(store, MambaStatePool):
        return [store.buffer.clone()]
    assert isinstance(store, DictStore)
    return [t.clone() for t in store.tensors.values()]


def _fill(store: StateStore) -> None:
    """Row ``r`` of every tensor holds ``r + 1`` (so a clear, a copy and an untouched row all show)."""
    tensors = [store.buffer] if isinstance(store, MambaStatePool) else list(store.tensors.values())  # type: ignore[attr-defined]  # a DictStore
    for t in tensors:
        for r in range(CAPACITY + 1):
            t[r] = r + 1


def _row(store: StateStore, r: int) -> list[torch.Tensor]:
    return [t[r] for t in _contents(store)]


STORES: list[Callable[[], StateStore]] = [_pool, _dict_store]


@pytest.fixture(params=STORES, ids=["MambaStatePool", "DictStore"])
def store(request: pytest.FixtureRequest) -> StateStore:
    s: StateStore = request.param()
    _fill(s)
    return s


def _requests() -> list[AdmittedRequest]:
    """Slot 1 fresh (a clear), slot 2 from the cached prefix in slot 6, snapshotted into slot 7."""
    return [
        AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[4, 5], kv_locs=[10, 11], intent=Clear()),
        AdmittedRequest(rid=RequestId(2), slot=MambaSlot(2), input_ids=[6], kv_locs=[20], intent=CopyFrom(src=MambaSlot(6), prefix_len=3),
                        snapshot_to=MambaSlot(7)),
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_init_before_the_block_snapshot_after_and_the_ledger_drained(store: StateStore) -> None:
    ledger = Ledger()
    ops = StateOps(ledger)
    _, plan = Pipeline(ledger).prefill(_requests())
    before = _contents(store)
    with ops.applying(plan, store) as applied:
        assert applied == Applied(rows=(1, 2), cleared=(1,), copied=((6, 2),), snapshots=((2, 7),))
        assert all(not t.any() for t in _row(store, 1))  # cleared
        assert _same(_row(store, 2), _row(store, 6))  # the cached prefix's state
        assert _same(_row(store, 7), [t[7] for t in before])  # the snapshot waits for the forward
        for t in ([store.buffer] if isinstance(store, MambaStatePool) else list(store.tensors.values())):  # type: ignore[attr-defined]  # a DictStore
            t[2] += 1  # the engine's forward advances its rows
    assert _same(_row(store, 7), _row(store, 2))  # the state the forward left
    assert _same(_row(store, 6), [t[6] for t in before]) and _same(_row(store, 3), [t[3] for t in before])
    ledger.assert_drained()


def test_a_replayed_plan_is_refused_before_the_store_is_touched(store: StateStore) -> None:
    ledger = Ledger()
    ops = StateOps(ledger)
    _, plan = Pipeline(ledger).prefill(_requests())
    with ops.applying(plan, store):
        pass
    after = _contents(store)
    with pytest.raises(ResourceReplayError, match=r"already consumed"):
        with ops.applying(plan, store):  # type: ignore[linear-reuse]  # the replay is the test
            pytest.fail("the block of a replayed plan ran")
    assert _same(after, _contents(store))


def test_a_forged_plan_is_refused_before_the_store_is_touched(store: StateStore) -> None:
    ledger = Ledger()
    plan = lower(prepare_for_extend(_requests(), None), LowerContext())  # lowered, never registered
    before = _contents(store)
    with pytest.raises(UnknownTicketError, match=r"never registered|not registered|unknown"):
        with StateOps(ledger).applying(plan, store):
            pytest.fail("the block of a forged plan ran")
    assert _same(before, _contents(store))


def test_a_plan_lowered_for_another_pool_is_refused(store: StateStore) -> None:
    ledger = Ledger()
    _, plan = Pipeline(ledger, LowerContext(pools=(PoolId("draft"),))).prefill(_requests())
    before = _contents(store)
    with pytest.raises(PlanExecutionError, match=r"lowered for pool\(s\) 'draft', not for this store's pool 'target'"):
        with StateOps(ledger).applying(plan, store):
            pytest.fail("ran")
    assert _same(before, _contents(store))
    ledger.cancel_all(plan.all_tickets(), "test over")


def test_a_decode_over_a_row_whose_init_has_not_run_is_refused(store: StateStore) -> None:
    """A dropped op: the prefill's plan never ran, and a decode over its rows would read stale state."""
    ledger = Ledger()
    pipe = Pipeline(ledger)
    batch, plan = pipe.prefill(_requests())
    _, decode = pipe.decode(batch, DecodeContext(next_tokens=[1, 2], kv_locs=[12, 21]))
    before = _contents(store)
    with pytest.raises(TicketMismatchError, match=r"does not carry ticket .* which must run on that row first"):
        with StateOps(ledger).applying(decode, store):
            pytest.fail("ran")
    assert _same(before, _contents(store))
    ledger.cancel_all(plan.all_tickets(), "test over")


def test_a_failed_forward_restores_the_rows_and_the_plan_runs_again(store: StateStore) -> None:
    assert isinstance(store, RestorableStore)
    ledger = Ledger()
    ops = StateOps(ledger)
    _, plan = Pipeline(ledger).prefill(_requests())
    before = _contents(store)
    with pytest.raises(RuntimeError, match="the forward failed"):
        with ops.applying(plan, store):
            raise RuntimeError("the forward failed")
    assert _same(before, _contents(store))  # every row the plan could write is back
    assert {t.serial for t in ledger.outstanding()} == {t.serial for t in plan.all_tickets()}
    with ops.applying(plan, store):  # the failed attempt consumed nothing: running it again is the contract
        pass
    ledger.assert_drained()


class PlainStore:
    """A store without save/restore: a dict store's rows, through the two required methods only."""

    def __init__(self) -> None:
        self.inner = _dict_store()
        _fill(self.inner)

    @property
    def pool_id(self) -> PoolId:
        return self.inner.pool_id

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def clear_rows(self, slots: Sequence[int]) -> None:
        self.inner.clear_rows(slots)

    def copy_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.inner.copy_rows(src, dst)


def test_a_plain_store_keeps_the_inits_result_after_a_failure_and_a_retry_is_exact() -> None:
    store = PlainStore()
    assert isinstance(store, StateStore)
    assert not isinstance(store, RestorableStore)
    ledger = Ledger()
    ops = StateOps(ledger)
    _, plan = Pipeline(ledger).prefill(_requests())
    before = _contents(store.inner)
    with pytest.raises(RuntimeError):
        with ops.applying(plan, store):
            raise RuntimeError("the forward failed")
    after_init = _contents(store.inner)
    assert all(not t.any() for t in _row(store.inner, 1)) and _same(_row(store.inner, 2), _row(store.inner, 6))
    assert _same(_row(store.inner, 7), [t[7] for t in before])  # no snapshot taken
    assert {t.serial for t in ledger.outstanding()} == {t.serial for t in plan.all_tickets()}
    with ops.applying(plan, store):  # running it again is the contract
        pass
    again = _contents(store.inner)
    assert _same([t[:7] for t in after_init], [t[:7] for t in again])  # the init applied again: the same rows
    assert _same(_row(store.inner, 7), _row(store.inner, 2))  # and now the snapshot
    ledger.assert_drained()


def test_a_plan_stripped_of_its_clear_is_refused(store: StateStore) -> None:
    """A plan stripped of its init ticket: refused by the ledger while the ticket is registered (the
    row's op must run first), and by the fresh-row check when it never was (the row starts at token
    0 from whatever the slot held)."""
    ledger = Ledger()
    _, plan = Pipeline(ledger).prefill(_requests()[:1])
    before = _contents(store)
    with pytest.raises(TicketMismatchError, match=r"does not carry ticket .* which must run on that row first"):
        with StateOps(ledger).applying(attrs.evolve(plan, tickets=()), store):
            pytest.fail("ran")
    never_registered = lower(prepare_for_extend(_requests()[:1], None), LowerContext())
    with pytest.raises(PlanExecutionError, match=r"^ExtendPlan: slot 1 starts at token 0 but the plan's init does not clear it \(init: none for this pool\)$"):
        with StateOps(Ledger()).applying(attrs.evolve(never_registered, tickets=()), store):
            pytest.fail("ran")
    assert _same(before, _contents(store))
    ledger.cancel_all(plan.all_tickets(), "test over")


def test_a_snapshot_inside_a_chunk_is_refused_before_anything_is_claimed(store: StateStore) -> None:
    ledger = Ledger()
    inner = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[4, 5, 6], kv_locs=[10, 11, 12], intent=Clear(),
                            snapshot_to=MambaSlot(7), snapshot_at=2)
    _, plan = Pipeline(ledger).prefill([inner])
    with pytest.raises(PlanExecutionError, match=r"snapshot #\d+ is taken inside a chunk \(at \[2\]\)"):
        with StateOps(ledger).applying(plan, store):
            pytest.fail("ran")
    assert {t.serial for t in ledger.outstanding()} == {t.serial for t in plan.all_tickets()}
    ledger.cancel_all(plan.all_tickets(), "test over")


def test_continuations_and_decodes_run_without_tickets(store: StateStore) -> None:
    ledger = Ledger()
    ops = StateOps(ledger)
    pipe = Pipeline(ledger)
    first = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(3), input_ids=[4], kv_locs=[10], intent=Clear(), more_chunks=True)
    _, plan = pipe.prefill([first])
    with ops.applying(plan, store):
        pass
    cont = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(3), input_ids=[5], kv_locs=[11], intent=Continue(prefix_len=1))
    batch, plan2 = pipe.prefill([cont])
    assert plan2.tickets == ()
    with ops.applying(plan2, store) as applied:
        assert applied == Applied(rows=(3,), cleared=(), copied=(), snapshots=())
    _, decode = pipe.decode(batch, DecodeContext(next_tokens=[1], kv_locs=[12]))
    with ops.applying(decode, store) as applied:
        assert applied.rows == (3,)
    ledger.assert_drained()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DictStore("", {"a": torch.zeros(3)}), r"^DictStore: pool_id must be a non-empty str, got ''$"),
        (lambda: DictStore("p", {}), r"^DictStore: tensors must be a non-empty mapping of names to tensors, got \{\}$"),
        (lambda: DictStore("p", {"a": 3}), r"^DictStore: tensors\['a'\] must be a tensor with a slot dimension, got 3$"),  # type: ignore[dict-item]  # the wrong type is the test
        (lambda: DictStore("p", {"a": torch.zeros(3), "b": torch.zeros(4)}), r"first dimension must be the same \(slots \+ 1 >= 2\), got \[3, 4\]$"),
        (lambda: DictStore("p", {"a": torch.zeros(1)}), r"got \[1\]$"),
        (lambda: StateOps("ledger"), r"^StateOps: ledger must be a backend\.ledger\.Ledger, got 'ledger'$"),  # type: ignore[arg-type]  # the wrong type is the test
    ],
    ids=["empty-pool", "no-tensors", "not-a-tensor", "ragged", "no-row", "not-a-ledger"],
)
def test_bad_arguments_are_refused_in_one_line(build: Callable[[], object], message: str) -> None:
    with suppress_type_checks(), pytest.raises((TypeError, ValueError), match=message):
        build()


def test_a_store_that_is_not_one_is_refused() -> None:
    ledger = Ledger()
    _, plan = Pipeline(ledger).prefill(_requests())
    with suppress_type_checks(), pytest.raises(PlanExecutionError, match=r"^StateOps\.applying: store must implement backend\.state_store\.StateStore"):
        with StateOps(ledger).applying(plan, object()):  # type: ignore[arg-type]  # the wrong type is the test
            pass
    ledger.cancel_all(plan.all_tickets(), "test over")


class _BadCapacity(PlainStore):
    def __init__(self, capacity: object) -> None:
        super().__init__()
        self._bad = capacity

    @property
    def capacity(self) -> int:
        return self._bad  # type: ignore[return-value]  # the bad capacity is the test


@pytest.mark.parametrize("capacity", [True, 8.5, "8", None, 0], ids=["bool", "float", "str", "none", "zero"])
def test_a_store_whose_capacity_is_not_an_int_is_refused_in_one_line(capacity: object) -> None:
    ledger = Ledger()
    _, plan = Pipeline(ledger).prefill(_requests())
    store = _BadCapacity(capacity)
    before = _contents(store.inner)
    with pytest.raises(PlanExecutionError, match=r"^StateOps\.applying: the store's capacity must be an int >= 1, got "):
        with StateOps(ledger).applying(plan, store):
            pytest.fail("ran")
    assert _same(before, _contents(store.inner))
    ledger.cancel_all(plan.all_tickets(), "test over")
