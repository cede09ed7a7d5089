"""What each pass promises, checked against an expectation computed here, independently of the pass.

Each pass's output node is compared in full (every column, its order, the one-shot ops and their
serials, the sampling rows) with one built from plain Python lists of the input's rows, on small
seeded batches that include the edge cases: no rows, one row, request ids in no sorted order,
chunked prefill rows, COW and snapshot ops, rows with and without sampling parameters, the largest
window and sequence lengths. Each refusal is triggered at its bound, and the error is matched in
full (the pass, the bad value, both values where two disagree); the value just inside the bound is
accepted. The pass registry's declaration checks are here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import pytest
from typeguard import suppress_type_checks

from ir import spec
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import INT64_MAX, MAX_SEQ_LEN, SMALL_COLUMN, build_unchecked
from ir.errors import IRValidationError, PreconditionError
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.hidden import HiddenSource, HiddenStates
from ir.ids import TARGET_POOL, HiddenId, MambaSlot, PoolId, RequestId, SampleId, VerifyId
from ir.init import InitIntent, MambaInit, MambaSnapshot, Ticket
from ir.mint import mint_hidden_id, mint_verify_id
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.results import NON_FINITE, Verified
from ir.sampling import GREEDY, SamplingParams, SamplingRows
from ir.spec import MAX_SPEC_K, CommitBatch, DraftBatch, DraftCommitBatch, DraftExtendBatch, VerifyBatch
from passes import (
    DecodeContext,
    LowerContext,
    SpecContext,
    accept,
    commit,
    filter_batch,
    lower,
    merge_batch,
    mix_with_running,
    prepare_for_decode,
    prepare_for_draft,
    prepare_for_draft_commit,
    prepare_for_draft_extend,
    prepare_for_extend,
    prepare_for_head_commit,
    prepare_for_head_extend,
    prepare_for_verify,
    withdraw,
)
from passes.registry import PASSES, REGISTRY, Pass, PassSpec, declare_pass, spec_of


def proposed(draft: DraftBatch, tokens: Sequence[int]) -> spec.Proposals:
    """``tokens`` as the ``Proposals`` of ``draft`` (what its draft step would return)."""
    return spec.Proposals(k=draft.k, draft_id=draft.draft_id, tokens=tokens)


def verified(verify: VerifyBatch, tokens: Sequence[int]) -> Verified:
    """``tokens`` as the ``Verified`` result of ``verify`` (``k + 1`` per row, row-major)."""
    return Verified(k=verify.k, verify_id=verify.verify_id, rids=verify.rids, tokens=tokens)


SEEDS = range(6)

# -- builders (plain rows in, nodes out) --------------------------------------------------------------


def _sampling(rng: random.Random, n: int) -> SamplingRows:
    """``n`` greedy rows told apart by ``top_k`` (row ``i``: ``i + 1``), each with its own bans
    (0 to 3 packed ids), so a row that moves or goes missing shows."""
    bans = [(rng.randint(0, 50), [rng.randint(0, 99) for _ in range(rng.randint(0, 3))]) for _ in range(n)]
    return SamplingRows.of([SamplingParams(temperature=0.0, top_k=i + 1) for i in range(n)], bans=bans)


Row = tuple[int, int, tuple[int, ...]]


def _srows(s: SamplingRows | None) -> list[Row] | None:
    """Each sampling row as ``(top_k, ban_until, banned ids)``."""
    if s is None:
        return None
    lens = s.banned_lens.tolist()
    starts = np.concatenate(([0], np.cumsum(lens))).tolist()
    return [(int(s.top_k[i]), int(s.ban_until[i]), tuple(s.banned[starts[i] : starts[i] + lens[i]].tolist())) for i in range(len(lens))]


GREEDY_ROW: Row = (GREEDY.top_k, 0, ())


def _joined(a: list[Row] | None, na: int, b: list[Row] | None, nb: int) -> list[Row] | None:
    """The sampling rows of ``na`` rows then ``nb`` rows (a ``None`` side: greedy rows)."""
    if a is None and b is None:
        return None
    return (a if a is not None else [GREEDY_ROW] * na) + (b if b is not None else [GREEDY_ROW] * nb)


def _requests(rng: random.Random, n: int, *, chunked: bool = True, snap: bool = True) -> list[AdmittedRequest]:
    """``n`` admitted requests of every intent, rids in no sorted order, distinct slots and KV
    locations, some chunked (``chunked``), some snapshotted (``snap``), some inside their chunk."""
    rids = rng.sample(range(1, 500), n)
    slots = rng.sample(range(1, 200), n)
    lens = [rng.randint(1, 4) for _ in range(n)]
    kv = rng.sample(range(0, 5000), sum(lens))
    out: list[AdmittedRequest] = []
    at = 0
    for i in range(n):
        kind = rng.randrange(3)
        intent = Clear() if kind == 0 else CopyFrom(src=MambaSlot(300 + i), prefix_len=rng.randint(1, 9)) if kind == 1 else Continue(prefix_len=rng.randint(1, 9))
        to = MambaSlot(600 + i) if snap and rng.random() < 0.4 else None
        out.append(AdmittedRequest(
            rid=RequestId(rids[i]), slot=MambaSlot(slots[i]), intent=intent, more_chunks=chunked and rng.random() < 0.3,
            snapshot_to=to, snapshot_at=rng.randint(1, lens[i]) if to is not None and rng.random() < 0.5 else None,
            input_ids=[rng.randint(0, 999) for _ in range(lens[i])], kv_locs=kv[at : at + lens[i]],
        ))
        at += lens[i]
    return out


def _expected_extend(reqs: Sequence[AdmittedRequest], sampling: SamplingRows | None, init_serial: int | None, snap_serial: int | None,
                     *, snap_at: bool | None = None) -> ExtendBatch:
    """The prefill of ``reqs`` as the docstring of ``prepare_for_extend`` says, under the given
    serials; ``snap_at``: whether the snapshot lists its ``at`` (default: when one is inside its chunk)."""
    clears = [r.slot for r in reqs if isinstance(r.intent, Clear)]
    cows = [(r.intent.src, r.slot) for r in reqs if isinstance(r.intent, CopyFrom)]
    snapped = [r for r in reqs if r.snapshot_to is not None]
    if snap_at is None:
        snap_at = any(r.snapshot_len != len(r.input_ids) for r in snapped)
    init = None
    if clears or cows:
        assert init_serial is not None
        init = MambaInit(serial=init_serial, clear_slots=clears, cow_src=[s for s, _ in cows], cow_dst=[d for _, d in cows])
    snapshot = None
    if snapped:
        assert snap_serial is not None
        snapshot = MambaSnapshot(serial=snap_serial, src=[r.slot for r in snapped], dst=[r.snapshot_to for r in snapped if r.snapshot_to],
                                 at=[r.snapshot_len for r in snapped] if snap_at else ())
    kinds = {Clear: InitIntent.CLEAR, CopyFrom: InitIntent.COW, Continue: InitIntent.CONTINUE}
    return ExtendBatch(
        rids=[r.rid for r in reqs], slots=[r.slot for r in reqs], prefix_lens=[r.intent.prefix_len for r in reqs],
        extend_lens=[len(r.input_ids) for r in reqs], more_chunks=np.array([r.more_chunks for r in reqs], dtype=np.bool_),
        intents=tuple(kinds[type(r.intent)] for r in reqs),
        input_ids=[t for r in reqs for t in r.input_ids.tolist()], kv_locs=[x for r in reqs for x in r.kv_locs.tolist()],
        init=init, snapshot=snapshot, sampling=sampling,
    )


def _running(rng: random.Random, n: int, *, sampled: bool = True, taken: Sequence[int] = (), seq_max: int = 60) -> DecodeBatch:
    """``n`` running rows (rids 500.., slots 200.., KV 6000..: apart from ``_requests``'s), not sorted."""
    rids = rng.sample(range(500, 900), n)
    slots = rng.sample(range(200, 300), n)
    return DecodeBatch(
        rids=rids, slots=slots, seq_lens=[rng.randint(1, seq_max) for _ in range(n)], input_ids=[rng.randint(0, 99) for _ in range(n)],
        kv_locs=rng.sample([x for x in range(6000, 7000) if x not in taken], n), sampling=_sampling(rng, n) if sampled else None,
    )


def _decode_rows(b: DecodeBatch) -> list[tuple[int, int, int, int, int]]:
    return list(zip(b.rids.tolist(), b.slots.tolist(), b.seq_lens.tolist(), b.input_ids.tolist(), b.kv_locs.tolist(), strict=True))


@attrs.frozen
class Iteration:
    """One speculative iteration built with the passes, and its plain inputs."""

    running: DecodeBatch
    pending: list[int]
    window_kv: list[int]
    drafts: list[list[int]]
    targets: list[list[int]]
    draft: DraftBatch
    verify: VerifyBatch


def _iteration(rng: random.Random, n: int, k: int, *, sampled: bool = True) -> Iteration:
    running = _running(rng, n, sampled=sampled)
    pending = [rng.randint(0, 5) for _ in range(n)]
    window_kv = rng.sample(range(10_000, 20_000), n * (k + 1))
    draft = prepare_for_draft(running, SpecContext(k=k, next_tokens=pending, kv_locs=window_kv, rids=running.rids))
    drafts = [[rng.randint(0, 3) for _ in range(k)] for _ in range(n)]
    verify = prepare_for_verify(draft, proposed(draft, [t for row in drafts for t in row]))
    targets = []
    for row in drafts:  # agree on a random prefix, then anything (a NON_FINITE now and then)
        agree = rng.randint(0, k)
        targets.append(row[:agree] + [rng.choice([0, 1, 2, 3, NON_FINITE]) for _ in range(k + 1 - agree)])
    return Iteration(running, pending, window_kv, drafts, targets, draft, verify)


def _accepted(it: Iteration) -> tuple[list[int], list[int]]:
    """Greedy acceptance by its definition: the longest prefix of drafts equal to the predictions."""
    acc, bonus = [], []
    for d, t in zip(it.drafts, it.targets, strict=True):
        m = 0
        while m < len(d) and d[m] == t[m]:
            m += 1
        acc.append(m)
        bonus.append(t[m])
    return acc, bonus


def _commit(it: Iteration) -> CommitBatch:
    v = it.verify
    return commit(v, accept(v, verified(v, [t for row in it.targets for t in row])))


# -- prepare_for_extend --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [1, 2, 7])
def test_prepare_for_extend_is_the_requests_in_order_with_their_ops(seed: int, n: int) -> None:
    rng = random.Random(seed * 31 + n)
    reqs = _requests(rng, n)
    sampling = _sampling(rng, n) if seed % 2 else None
    out = prepare_for_extend(reqs, sampling) if sampling is not None else prepare_for_extend(tuple(reqs))
    init_serial = out.init.serial if out.init is not None else None
    snap_serial = out.snapshot.serial if out.snapshot is not None else None
    assert out == _expected_extend(reqs, sampling, init_serial, snap_serial)
    if out.init is not None and out.snapshot is not None:
        assert out.init.serial != out.snapshot.serial  # two ops, two identities


def test_prepare_for_extend_snapshot_lists_at_exactly_when_one_is_inside_its_chunk() -> None:
    def req(rid: int, slot: int, n: int, at: int | None) -> AdmittedRequest:
        return AdmittedRequest(rid=RequestId(rid), slot=MambaSlot(slot), intent=Clear(), snapshot_to=MambaSlot(slot + 50),
                               snapshot_at=at, input_ids=[1] * n, kv_locs=range(rid * 10, rid * 10 + n))

    at_end = prepare_for_extend([req(1, 1, 3, 3), req(2, 2, 2, None)]).snapshot
    assert at_end is not None and at_end.at == () and at_end.src == (1, 2) and at_end.dst == (51, 52)
    inside = prepare_for_extend([req(1, 1, 3, None), req(2, 2, 2, 1)]).snapshot
    assert inside is not None and inside.at == (3, 1)
    one = prepare_for_extend([req(3, 3, 1, 1)]).snapshot  # a one-token chunk snapshotted after its token: at its end
    assert one is not None and one.at == () and one.src == (3,) and one.dst == (53,)


def test_prepare_for_extend_mints_fresh_serials_every_call() -> None:
    reqs = _requests(random.Random(5), 4, snap=True)
    reqs = [attrs.evolve(reqs[0], intent=Clear(), snapshot_to=MambaSlot(777), snapshot_at=None), *reqs[1:]]
    a, b = prepare_for_extend(reqs), prepare_for_extend(reqs)
    assert a.init is not None and b.init is not None and a.snapshot is not None and b.snapshot is not None
    serials = {a.init.serial, b.init.serial, a.snapshot.serial, b.snapshot.serial}
    assert len(serials) == 4
    assert attrs.evolve(a, init=b.init, snapshot=b.snapshot) == b  # the rest is the same batch


def test_prepare_for_extend_of_continuations_only_has_no_init() -> None:
    reqs = [AdmittedRequest(rid=RequestId(9), slot=MambaSlot(4), intent=Continue(prefix_len=5), input_ids=[3], kv_locs=[8])]
    assert prepare_for_extend(reqs).init is None


class _Reqs(Sequence[AdmittedRequest]):
    """A caller's own sequence type (neither a list nor a tuple)."""

    def __init__(self, items: list[AdmittedRequest]) -> None:
        self._items = items

    def __getitem__(self, i: Any) -> Any:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)


def test_prepare_for_extend_takes_any_sequence_and_refuses_everything_else() -> None:
    reqs = _requests(random.Random(2), 3)
    assert prepare_for_extend(_Reqs(reqs)).rid_list() == [r.rid for r in reqs]

    class Tagged(AdmittedRequest):  # a caller's own record type (final for mypy only)
        pass

    tagged = [Tagged(**{f.name: getattr(r, f.name) for f in attrs.fields(AdmittedRequest)}) for r in reqs]
    for given in (tagged, [tagged[0], reqs[1], tagged[2]]):
        out = prepare_for_extend(given)
        assert out == _expected_extend(reqs, None, out.init.serial if out.init else None, out.snapshot.serial if out.snapshot else None)
    with suppress_type_checks():
        for bad, got in (("abc", r"str \('abc'\)"), (b"ab", r"bytes \(b'ab'\)"), (None, r"NoneType \(None\)"), (iter(reqs), "list_iterator"),
                         ({1: 2}, r"dict \(\{1: 2\}\)")):
            with pytest.raises(PreconditionError, match=rf"^prepare_for_extend: requests must be a sequence of AdmittedRequest, got {got}"):
                prepare_for_extend(bad)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_extend: requests\[0\] must be an AdmittedRequest, got int \(3\)$"):
            prepare_for_extend([3, reqs[0]])  # type: ignore[list-item]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_extend: requests\[2\] must be an AdmittedRequest, got NoneType \(None\)$"):
            prepare_for_extend((reqs[0], reqs[1], None))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_extend: sampling must be SamplingRows \(one row per request\) or None, got list"):
            prepare_for_extend(reqs, [GREEDY] * 3)  # type: ignore[arg-type]  # the refusal under test
    with pytest.raises(PreconditionError, match=r"^prepare_for_extend: no admitted requests"):
        prepare_for_extend(())


# -- filter_batch ---------------------------------------------------------------------------------------


def _drop_forms(ids: list[int]) -> Iterator[object]:
    yield ids
    yield tuple(ids)
    yield set(ids)
    yield np.array(ids, dtype=np.int64)
    yield np.array(ids, dtype=np.int32)
    yield (i for i in ids)
    yield [np.int64(i) for i in ids]


@pytest.mark.parametrize("seed", SEEDS)
def test_filter_batch_of_a_prefill_is_the_prefill_of_the_remaining_requests(seed: int) -> None:
    rng = random.Random(100 + seed)
    n = rng.randint(1, 8)
    reqs = _requests(rng, n)
    sampling = _sampling(rng, n) if seed % 2 else None
    batch = prepare_for_extend(reqs, sampling)
    drop = rng.sample([int(r.rid) for r in reqs], rng.randint(1, n)) + [9999, 0]  # (ids not in the batch are ignored)
    rng.shuffle(drop)
    kept = [r for r in reqs if r.rid not in drop]
    idx = [i for i, r in enumerate(reqs) if r.rid not in drop]
    expected_sampling = None if sampling is None else sampling.take(np.array(idx, dtype=np.int64))
    remaining_init = any(isinstance(r.intent, (Clear, CopyFrom)) for r in kept)
    remaining_snap = any(r.snapshot_to is not None for r in kept)
    expected = _expected_extend(
        kept, expected_sampling,
        batch.init.serial if remaining_init and batch.init else None, batch.snapshot.serial if remaining_snap and batch.snapshot else None,
        snap_at=bool(batch.snapshot and batch.snapshot.at),
    )
    for form in _drop_forms(drop):
        out = filter_batch(batch, form)  # type: ignore[arg-type]  # every iterable of ints
        assert out == expected
        assert _srows(out.sampling) == (None if sampling is None else [_srows(sampling)[i] for i in idx])  # type: ignore[index]


def test_filter_batch_keeps_the_serials_and_the_ops_of_the_remaining_rows_only() -> None:
    reqs = [
        AdmittedRequest(rid=RequestId(5), slot=MambaSlot(1), intent=Clear(), input_ids=[1, 2], kv_locs=[10, 11], snapshot_to=MambaSlot(51), snapshot_at=1),
        AdmittedRequest(rid=RequestId(3), slot=MambaSlot(2), intent=CopyFrom(src=MambaSlot(40), prefix_len=4), input_ids=[3], kv_locs=[12],
                        snapshot_to=MambaSlot(52)),
        AdmittedRequest(rid=RequestId(4), slot=MambaSlot(3), intent=Clear(), input_ids=[4], kv_locs=[13]),
        AdmittedRequest(rid=RequestId(1), slot=MambaSlot(6), intent=CopyFrom(src=MambaSlot(41), prefix_len=2), input_ids=[5, 6, 7], kv_locs=[14, 15, 16]),
    ]
    batch = prepare_for_extend(reqs)
    assert batch.init is not None and batch.snapshot is not None and batch.snapshot.at == (1, 1)
    s, t = batch.init.serial, batch.snapshot.serial
    out = filter_batch(batch, [5, 1])
    assert out.init == MambaInit(serial=s, clear_slots=[3], cow_src=[40], cow_dst=[2])
    assert out.snapshot == MambaSnapshot(serial=t, src=[2], dst=[52], at=[1])  # its at stays listed (aligned with the pairs)
    assert out.input_ids.tolist() == [3, 4] and out.kv_locs.tolist() == [12, 13] and out.rid_list() == [3, 4]
    only_clear = filter_batch(batch, [3, 1])
    assert only_clear.init == MambaInit(serial=s, clear_slots=[1, 3]) and only_clear.snapshot == MambaSnapshot(serial=t, src=[1], dst=[51], at=[1])
    only_cow = filter_batch(batch, [5, 4])
    assert only_cow.init == MambaInit(serial=s, cow_src=[40, 41], cow_dst=[2, 6])
    assert only_cow.snapshot == MambaSnapshot(serial=t, src=[2], dst=[52], at=[1])
    no_ops = filter_batch(prepare_for_extend([*reqs[2:], attrs.evolve(reqs[1], intent=Continue(prefix_len=3), snapshot_to=None)]), [4, 1])
    assert no_ops.init is None and no_ops.snapshot is None and no_ops.rid_list() == [3]
    plain = prepare_for_extend([attrs.evolve(r, snapshot_to=None, snapshot_at=None) for r in reqs[1:]] + [attrs.evolve(reqs[0], snapshot_at=None)])
    assert plain.snapshot is not None and plain.snapshot.at == ()
    assert filter_batch(plain, [3]).snapshot == MambaSnapshot(serial=plain.snapshot.serial, src=[1], dst=[51])
    assert filter_batch(plain, [5]).snapshot is None


@pytest.mark.parametrize("seed", SEEDS)
def test_filter_batch_of_a_decode_batch_keeps_the_remaining_rows_in_order(seed: int) -> None:
    rng = random.Random(200 + seed)
    n = rng.randint(1, 9)
    batch = _running(rng, n, sampled=bool(seed % 2))
    rows = _decode_rows(batch)
    drop = rng.sample(batch.rid_list(), rng.randint(1, n)) + [1, 2]
    keep = [i for i, r in enumerate(rows) if r[0] not in drop]
    for form in _drop_forms(drop):
        out = filter_batch(batch, form)  # type: ignore[arg-type]  # every iterable of ints
        assert isinstance(out, DecodeBatch) and _decode_rows(out) == [rows[i] for i in keep]
        srows = _srows(batch.sampling)
        assert _srows(out.sampling) == (None if srows is None else [srows[i] for i in keep])


@pytest.mark.parametrize("total", [2 * SMALL_COLUMN - 1, 2 * SMALL_COLUMN, 2 * SMALL_COLUMN + 1, 3 * SMALL_COLUMN])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_filter_batch_drops_the_same_rows_whatever_the_sizes(total: int, share: float) -> None:
    # row count + drop count on both sides of the small-column bound (a Python set, np.isin past it)
    rng = random.Random(total)
    n = int(total * share) if share < 1 else total - 1
    m = total - n
    batch = DecodeBatch(rids=rng.sample(range(10**6), n), slots=range(1, n + 1), seq_lens=[3] * n, input_ids=[1] * n, kv_locs=range(n))
    rids = batch.rid_list()
    drop = rng.sample(rids, min(n, m // 2)) + [10**6 + i for i in range(m - min(n, m // 2))]
    rng.shuffle(drop)
    out = filter_batch(batch, drop)
    assert out.rid_list() == [r for r in rids if r not in set(drop)]
    if not set(drop) & set(rids):
        assert out is batch


def test_filter_batch_returns_the_batch_itself_when_nothing_is_dropped() -> None:
    rng = random.Random(3)
    for batch in (_running(rng, 4), prepare_for_extend(_requests(rng, 3)), DecodeBatch.empty()):
        for drop in ([], (), np.array([], dtype=np.int64), np.array([], dtype=np.uint64), [10**9], iter([10**9, -5])):
            assert filter_batch(batch, drop) is batch  # type: ignore[arg-type]  # an iterable of ints


def test_filter_batch_can_drop_every_row() -> None:
    rng = random.Random(4)
    batch = prepare_for_extend(_requests(rng, 3), _sampling(rng, 3))
    out = filter_batch(batch, batch.rid_list())
    assert out.num_requests == 0 and out.init is None and out.snapshot is None and out.input_ids.shape == (0,)
    assert out.sampling is not None and out.sampling.num_requests == 0
    dec = _running(rng, 2)
    assert filter_batch(dec, dec.rid_list()) == DecodeBatch(rids=[], slots=[], seq_lens=[], input_ids=[], kv_locs=[], sampling=dec.sampling.take(np.zeros(0, dtype=np.int64)))  # type: ignore[union-attr]


def test_filter_batch_takes_unsigned_ids_up_to_int64_max_and_refuses_past_it() -> None:
    batch = DecodeBatch(rids=[INT64_MAX, 5], slots=[1, 2], seq_lens=[1, 1], input_ids=[0, 0], kv_locs=[0, 1])
    assert filter_batch(batch, np.array([INT64_MAX], dtype=np.uint64)).rid_list() == [5]
    assert filter_batch(batch, [INT64_MAX]).rid_list() == [5]
    with pytest.raises(PreconditionError, match=rf"^filter_batch: drop: every entry must fit in int64 \(got {INT64_MAX + 1}\)$"):
        filter_batch(batch, np.array([5, INT64_MAX + 1], dtype=np.uint64))
    with pytest.raises(PreconditionError, match=r"^filter_batch: drop: every entry .*\(got 9223372036854775808\)$"):
        filter_batch(batch, [5, INT64_MAX + 1])


@pytest.mark.parametrize(("drop", "match"), [
    (np.array([[1]], dtype=np.int64), r"got an ndarray of dtype int64 and shape \(1, 1\)"),
    (np.array(3, dtype=np.int64), r"got an ndarray of dtype int64 and shape \(\)"),
    (np.array([1.0]), r"got an ndarray of dtype float64 and shape \(1,\)"),
    (np.array([True]), r"got an ndarray of dtype bool and shape \(1,\)"),
    ("5", r"got str \('5'\)"),
    (b"5", r"got bytes"),
    (bytearray(b"5"), r"got bytearray"),
    (5, r"got int \(5\)"),
    (None, r"got NoneType \(None\)"),
])
def test_filter_batch_and_withdraw_refuse_a_drop_that_is_not_ids(drop: object, match: str) -> None:
    batch = prepare_for_extend(_requests(random.Random(1), 2))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=rf"^filter_batch: drop must be an iterable of request ids \(ints\), {match}"):
            filter_batch(batch, drop)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=rf"^withdraw: drop must be an iterable of request ids \(ints\), {match}"):
            withdraw(batch, drop)  # type: ignore[arg-type]  # the refusal under test


def test_filter_batch_refuses_entries_that_are_not_ints() -> None:
    batch = _running(random.Random(1), 2)
    with suppress_type_checks():
        for bad, shown in ((True, "True"), (2.0, "2.0"), ("3", "'3'"), (None, "None"), (np.float64(1.5), r".*1\.5.*")):
            with pytest.raises(PreconditionError, match=rf"^filter_batch: drop: every entry .*\(got {shown}\)$"):
                filter_batch(batch, [batch.rid_list()[0], bad])  # type: ignore[list-item]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^filter_batch: batch must be an ExtendBatch or a DecodeBatch, got IdleBatch"):
            filter_batch(IdleBatch(), [1])  # type: ignore[type-var]  # the refusal under test


# -- withdraw ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_withdraw_is_the_filtered_prefill_under_fresh_serials(seed: int) -> None:
    rng = random.Random(300 + seed)
    n = rng.randint(1, 8)
    reqs = _requests(rng, n)
    batch = prepare_for_extend(reqs, _sampling(rng, n))
    drop = rng.sample(batch.rid_list(), rng.randint(0, n))
    out = withdraw(batch, drop)
    filtered = filter_batch(batch, drop)
    assert attrs.evolve(out, init=filtered.init, snapshot=filtered.snapshot) == filtered
    for mine, theirs in ((out.init, filtered.init), (out.snapshot, filtered.snapshot)):
        assert (mine is None) == (theirs is None)
        if mine is not None and theirs is not None:
            assert mine.serial != theirs.serial and attrs.evolve(mine, serial=theirs.serial) == theirs
    if out.init is not None and out.snapshot is not None:
        assert out.init.serial != out.snapshot.serial


def test_withdraw_of_nothing_still_mints_new_serials() -> None:
    reqs = _requests(random.Random(8), 3)
    reqs[0] = attrs.evolve(reqs[0], intent=Clear(), snapshot_to=MambaSlot(999), snapshot_at=None)
    batch = prepare_for_extend(reqs)
    out = withdraw(batch, [])
    assert out.init is not None and batch.init is not None and out.init.serial != batch.init.serial
    assert out.snapshot is not None and batch.snapshot is not None and out.snapshot.serial != batch.snapshot.serial
    assert attrs.evolve(out, init=batch.init, snapshot=batch.snapshot) == batch


def test_withdraw_refuses_an_id_twice_or_not_in_the_prefill() -> None:
    reqs = [AdmittedRequest(rid=RequestId(r), slot=MambaSlot(s), intent=Clear(), input_ids=[1], kv_locs=[s]) for r, s in ((7, 1), (3, 2), (5, 3))]
    batch = prepare_for_extend(reqs)
    with pytest.raises(PreconditionError, match=r"^withdraw: drop names request 3 twice$"):
        withdraw(batch, [3, 5, 3])
    with pytest.raises(PreconditionError, match=r"^withdraw: drop: request 4 is not in this prefill \(its requests: \[3, 5, 7\]\)$"):
        withdraw(batch, [3, 4])
    many = prepare_for_extend([AdmittedRequest(rid=RequestId(100 - i), slot=MambaSlot(i + 1), intent=Clear(), input_ids=[1], kv_locs=[i]) for i in range(20)])
    shown = ", ".join(str(r) for r in range(81, 97))
    with pytest.raises(PreconditionError, match=rf"^withdraw: drop: request 1 is not in this prefill \(its requests: \[{shown}\]\)$"):
        withdraw(many, [1])
    with suppress_type_checks(), pytest.raises(PreconditionError, match=r"^withdraw: batch must be an ExtendBatch, got DecodeBatch"):
        withdraw(DecodeBatch.empty(), [])  # type: ignore[arg-type]  # the refusal under test
    assert withdraw(batch, [7, 3, 5]).num_requests == 0


# -- prepare_for_decode and merge_batch -------------------------------------------------------------------


def _finished(reqs: Sequence[AdmittedRequest]) -> list[tuple[int, int, int, int, int]]:
    """The decode-form rows of the requests whose prompt is complete: ``(rid, slot, seq_len, last token, last KV)``."""
    return [(int(r.rid), int(r.slot), r.intent.prefix_len + len(r.input_ids), int(r.input_ids[-1]), int(r.kv_locs[-1]))
            for r in reqs if not r.more_chunks]


def _advanced(rows: Sequence[tuple[int, int, int, int, int]], tokens: Sequence[int], kv: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
    return [(r, s, n + 1, t, x) for (r, s, n, _, _), t, x in zip(rows, tokens, kv, strict=True)]


def _ctx_for(rng: random.Random, rows: Sequence[tuple[int, int, int, int, int]], *, bound: bool) -> tuple[DecodeContext, list[int], list[int]]:
    tokens = [rng.randint(0, 50) for _ in rows]
    kv = rng.sample(range(30_000, 40_000), len(rows))
    return DecodeContext(next_tokens=tokens, kv_locs=kv, rids=[r[0] for r in rows] if bound else None), tokens, kv


@pytest.mark.parametrize("seed", SEEDS)
def test_prepare_for_decode_advances_the_finished_prefill_rows_then_the_running_ones(seed: int) -> None:
    rng = random.Random(400 + seed)
    n = rng.randint(1, 6)
    reqs = _requests(rng, n)
    if seed == 0:
        reqs = [attrs.evolve(r, more_chunks=True) for r in reqs]  # every row chunked: nothing decodes yet
    e_sampling = _sampling(rng, n) if seed % 2 else None
    extend = prepare_for_extend(reqs, e_sampling)
    running = _running(rng, rng.randint(0, 4), sampled=seed % 3 != 0)
    finished_idx = [i for i, r in enumerate(reqs) if not r.more_chunks]
    e_srows = None if e_sampling is None else [_srows(e_sampling)[i] for i in finished_idx]  # type: ignore[index]
    for batch, rows, srows in (
        (extend, _finished(reqs), e_srows),
        (running, _decode_rows(running), _srows(running.sampling)),
        (mix_with_running(extend, running), _finished(reqs) + _decode_rows(running),
         _joined(e_srows, len(finished_idx), _srows(running.sampling), running.num_requests)),
    ):
        for bound in (True, False):
            ctx, tokens, kv = _ctx_for(rng, rows, bound=bound)
            out = prepare_for_decode(batch, ctx)
            assert isinstance(out, DecodeBatch)
            assert _decode_rows(out) == _advanced(rows, tokens, kv)
            assert _srows(out.sampling) == srows


def test_prepare_for_decode_grows_a_sequence_up_to_max_seq_len_only() -> None:
    ctx = DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4], rids=[8, 9])
    edge = DecodeBatch(rids=[8, 9], slots=[1, 2], seq_lens=[3, MAX_SEQ_LEN - 1], input_ids=[0, 0], kv_locs=[0, 1])
    assert prepare_for_decode(edge, ctx).seq_lens.tolist() == [4, MAX_SEQ_LEN]
    full = attrs.evolve(edge, seq_lens=[MAX_SEQ_LEN, 3])
    with pytest.raises(PreconditionError, match=rf"^prepare_for_decode: a sequence of {MAX_SEQ_LEN} tokens cannot grow: MAX_SEQ_LEN is {MAX_SEQ_LEN}$"):
        prepare_for_decode(full, ctx)
    # a prefill that fills the sequence: its first decode step has no room either
    last = AdmittedRequest(rid=RequestId(8), slot=MambaSlot(1), intent=Continue(prefix_len=MAX_SEQ_LEN - 1), input_ids=[5], kv_locs=[9])
    with pytest.raises(PreconditionError, match=rf"a sequence of {MAX_SEQ_LEN} tokens cannot grow"):
        prepare_for_decode(prepare_for_extend([last]), DecodeContext(next_tokens=[1], kv_locs=[2]))
    room = attrs.evolve(last, intent=Continue(prefix_len=MAX_SEQ_LEN - 2))
    assert prepare_for_decode(prepare_for_extend([room]), DecodeContext(next_tokens=[1], kv_locs=[2])).seq_lens.tolist() == [MAX_SEQ_LEN]


def test_prepare_for_decode_of_no_rows_and_its_refusals() -> None:
    empty = prepare_for_decode(DecodeBatch.empty(), DecodeContext(next_tokens=[], kv_locs=[], rids=[]))
    assert empty == DecodeBatch.empty()
    chunked = prepare_for_extend([AdmittedRequest(rid=RequestId(4), slot=MambaSlot(1), intent=Clear(), more_chunks=True, input_ids=[1], kv_locs=[1])])
    assert prepare_for_decode(chunked, DecodeContext(next_tokens=[], kv_locs=[])).num_requests == 0
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: ctx\.next_tokens has 1 entries for 0 decoding requests$"):
        prepare_for_decode(chunked, DecodeContext(next_tokens=[3], kv_locs=[3]))
    one = DecodeBatch(rids=[7], slots=[1], seq_lens=[1], input_ids=[0], kv_locs=[0])
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: the context's next tokens are for 1 row \[8\], the batch has 1 row \[7\]|"
                                                r"^prepare_for_decode: the context's next tokens are for rows \[8\], the batch's are \[7\] \(row 0: request 8, the batch's 7\)"):
        prepare_for_decode(one, DecodeContext(next_tokens=[3], kv_locs=[3], rids=[8]))
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: the context's next tokens are for 2 rows \[7, 8\], the batch has 1 row \[7\]: "):
        prepare_for_decode(one, DecodeContext(next_tokens=[3, 4], kv_locs=[3, 4], rids=[7, 8]))
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: the context's next tokens are for 0 rows \[\], the batch has 1 row \[7\]: "):
        prepare_for_decode(one, DecodeContext(next_tokens=[], kv_locs=[], rids=[]))
    unchecked = build_unchecked(DecodeContext, next_tokens=np.array([3], dtype=np.int64), kv_locs=np.array([3, 4], dtype=np.int64), rids=None)
    with pytest.raises(PreconditionError, match=r"^prepare_for_decode: ctx\.kv_locs has 2 entries for 1 decoding requests$"):
        prepare_for_decode(one, unchecked)
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_decode: ctx must be a DecodeContext, got NoneType"):
            prepare_for_decode(one, None)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_decode: batch must be an ExtendBatch, a MixedBatch or a DecodeBatch, got IdleBatch"):
            prepare_for_decode(IdleBatch(), DecodeContext(next_tokens=[], kv_locs=[]))  # type: ignore[arg-type]  # the refusal under test


def test_a_bound_context_names_the_first_row_that_differs_and_cuts_long_lists_at_eight() -> None:
    n = 10
    batch = DecodeBatch(rids=range(1, n + 1), slots=range(1, n + 1), seq_lens=[2] * n, input_ids=[0] * n, kv_locs=range(n))
    rids = list(range(1, n + 1))
    rids[9] = 42
    ctx = DecodeContext(next_tokens=[1] * n, kv_locs=range(50, 60), rids=rids)
    with pytest.raises(PreconditionError, match=(
        r"^prepare_for_decode: the context's next tokens are for rows \[1, 2, 3, 4, 5, 6, 7, 8\], the batch's are \[1, 2, 3, 4, 5, 6, 7, 8\] "
        r"\(row 9: request 42, the batch's 10\): each row is fed its own request's next tokens$"
    )):
        prepare_for_decode(batch, ctx)
    more = DecodeContext(next_tokens=[1] * 11, kv_locs=range(50, 61), rids=range(1, 12))
    with pytest.raises(PreconditionError, match=r"for 11 rows \[1, 2, 3, 4, 5, 6, 7, 8\], the batch has 10 rows \[1, 2, 3, 4, 5, 6, 7, 8\]: "):
        prepare_for_decode(batch, more)
    with pytest.raises(IRValidationError, match=r"DecodeContext\.rids"):
        DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4], rids=[1])  # one request id per row


def test_a_context_is_equal_to_another_exactly_when_its_columns_and_rows_are() -> None:
    def dec(rids: Sequence[int] | None, tokens: Sequence[int] = (1, 2)) -> DecodeContext:
        return DecodeContext(next_tokens=tokens, kv_locs=[3, 4], rids=rids)

    def spec_ctx(rids: Sequence[int] | None) -> SpecContext:
        return SpecContext(k=1, next_tokens=[1, 2], kv_locs=range(4), rids=rids)

    for make in (dec, spec_ctx):
        assert make(None) == make(None) and make([5, 6]) == make(np.array([5, 6], dtype=np.int32))
        assert make([5, 6]) != make([6, 5]) and make([5, 6]) != make(None) and make(None) != make([5, 6])
        assert make([5, 6]).rids.tolist() == [5, 6] and make(None).rids is None  # type: ignore[union-attr]
    assert dec(None) != dec(None, (1, 3))


@pytest.mark.parametrize("seed", SEEDS)
def test_merge_batch_appends_the_finished_prefill_rows_in_their_last_forward_state(seed: int) -> None:
    rng = random.Random(500 + seed)
    n = rng.randint(1, 6)
    reqs = _requests(rng, n)
    e_sampling = _sampling(rng, n) if seed % 2 else None
    extend = prepare_for_extend(reqs, e_sampling)
    running = _running(rng, rng.randint(0, 4), sampled=seed % 3 != 0)
    out = merge_batch(running, extend)
    finished_idx = [i for i, r in enumerate(reqs) if not r.more_chunks]
    if not finished_idx:
        assert out is running
        return
    assert isinstance(out, DecodeBatch)
    assert _decode_rows(out) == _decode_rows(running) + _finished(reqs)
    e_srows = None if e_sampling is None else [_srows(e_sampling)[i] for i in finished_idx]  # type: ignore[index]
    assert _srows(out.sampling) == _joined(_srows(running.sampling), running.num_requests, e_srows, len(finished_idx))


def test_merge_batch_of_a_chunked_prefill_with_sampling_keeps_the_finished_rows_parameters() -> None:
    reqs = [
        AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), intent=Clear(), more_chunks=True, input_ids=[1], kv_locs=[1]),
        AdmittedRequest(rid=RequestId(2), slot=MambaSlot(2), intent=Clear(), input_ids=[2, 3], kv_locs=[2, 3]),
    ]
    sampling = SamplingRows.of([SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.0, top_k=9)], bans=[(3, [4]), (6, [7, 8])])
    out = merge_batch(DecodeBatch.empty(), prepare_for_extend(reqs, sampling))
    assert _decode_rows(out) == [(2, 2, 2, 3, 3)]
    assert _srows(out.sampling) == [(9, 6, (7, 8))]
    dec = prepare_for_decode(prepare_for_extend(reqs, sampling), DecodeContext(next_tokens=[5], kv_locs=[6], rids=[2]))
    assert _srows(dec.sampling) == [(9, 6, (7, 8))]


def test_merge_batch_of_decode_rows_and_its_refusals() -> None:
    rng = random.Random(9)
    running = _running(rng, 3)
    other = DecodeBatch(rids=[1, 2], slots=[11, 12], seq_lens=[5, 6], input_ids=[7, 8], kv_locs=[1, 2])
    out = merge_batch(running, other)
    assert _decode_rows(out) == _decode_rows(running) + _decode_rows(other)
    assert _srows(out.sampling) == _srows(running.sampling) + [GREEDY_ROW] * 2  # type: ignore[operator]
    assert merge_batch(DecodeBatch.empty(), other) == other
    assert merge_batch(running, DecodeBatch.empty()) is running
    assert merge_batch(other, attrs.evolve(other, rids=[3, 4], slots=[13, 14])).sampling is None  # both greedy: no rows
    rid, slot = running.rid_list()[1], int(running.slots[2])
    with pytest.raises(PreconditionError, match=rf"^merge_batch: request id {rid} is in both the running and the prefilled batch$"):
        merge_batch(running, attrs.evolve(other, rids=[1, rid]))
    with pytest.raises(PreconditionError, match=rf"^merge_batch: slot {slot} is in both the running and the prefilled batch$"):
        merge_batch(running, attrs.evolve(other, slots=[slot, 12]))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^merge_batch: running must be a DecodeBatch, got ExtendBatch"):
            merge_batch(prepare_for_extend(_requests(rng, 1)), other)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=(
            r"^merge_batch: prefilled must be an ExtendBatch, a DraftCommitBatch, a CommitBatch, a DraftExtendBatch or a DecodeBatch, got IdleBatch"
        )):
            merge_batch(running, IdleBatch())  # type: ignore[arg-type]  # the refusal under test


def test_mix_with_running_keeps_both_parts_and_refuses_anything_shared() -> None:
    rng = random.Random(10)
    extend = prepare_for_extend(_requests(rng, 3))
    running = _running(rng, 2)
    mixed = mix_with_running(extend, running)
    assert isinstance(mixed, MixedBatch) and mixed.extend is extend and mixed.decode is running
    assert mix_with_running(extend, DecodeBatch.empty()).decode.num_requests == 0
    kv = int(extend.kv_locs[-1])
    with pytest.raises(PreconditionError, match=rf"^mix_with_running: KV location {kv} is in both the extend and the running part$"):
        mix_with_running(extend, attrs.evolve(running, kv_locs=[int(running.kv_locs[0]), kv]))
    rid = extend.rid_list()[2]
    with pytest.raises(PreconditionError, match=rf"^mix_with_running: request id {rid} is in both the extend and the running part$"):
        mix_with_running(extend, attrs.evolve(running, rids=[rid, int(running.rids[1])]))
    slot = int(extend.slots[0])
    with pytest.raises(PreconditionError, match=rf"^mix_with_running: slot {slot} is in both the extend and the running part$"):
        mix_with_running(extend, attrs.evolve(running, slots=[int(running.slots[0]), slot]))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^mix_with_running: extend must be an ExtendBatch, got DecodeBatch"):
            mix_with_running(running, running)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^mix_with_running: running must be a DecodeBatch, got ExtendBatch"):
            mix_with_running(extend, extend)  # type: ignore[arg-type]  # the refusal under test


# -- the speculative iteration -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [0, 1, 5])
@pytest.mark.parametrize("k", [1, 3])
def test_a_speculative_iteration_pass_by_pass(seed: int, n: int, k: int) -> None:
    rng = random.Random(seed * 1000 + n * 10 + k)
    it = _iteration(rng, n, k, sampled=bool(seed % 2))
    run, d, v = it.running, it.draft, it.verify
    # prepare_for_draft: each pending token at the next position, the window's KV, a fresh draft id
    assert d == DraftBatch(k=k, draft_id=d.draft_id, rids=run.rids, slots=run.slots, seq_lens=run.seq_lens + 1, input_ids=it.pending,
                           kv_locs=it.window_kv, sampling=run.sampling)
    # prepare_for_verify: [pending, d1..dk] per row, the same window, a fresh verify id, the draft's id
    window = [t for p, row in zip(it.pending, it.drafts, strict=True) for t in [p, *row]]
    assert v == VerifyBatch(k=k, verify_id=v.verify_id, draft_id=d.draft_id, rids=run.rids, slots=run.slots, seq_lens=run.seq_lens + 1,
                            input_ids=window, kv_locs=it.window_kv, sampling=run.sampling)
    # accept: the longest agreeing prefix and the prediction after it, named by the verify and its rows
    acc, bonus = _accepted(it)
    result = accept(v, verified(v, [t for row in it.targets for t in row]))
    assert result == spec.AcceptResult(verify_id=v.verify_id, rids=run.rids, accepted=acc, bonus=bonus)
    # commit: position accepted[i] of the verify, the KV of the positions after it released in row order
    c = commit(v, result)
    w = k + 1
    released = [it.window_kv[i * w + j] for i in range(n) for j in range(acc[i] + 1, w)]
    assert c == CommitBatch(k=k, verify_id=v.verify_id, draft_id=d.draft_id, rids=run.rids, slots=run.slots, seq_lens=run.seq_lens + 1,
                            accept_pos=acc, input_ids=window, kv_locs=it.window_kv, released_kv=released, sampling=run.sampling)
    # the draft's commit: the same rows and window, the draft's id
    dc = prepare_for_draft_commit(c, d)
    assert dc == DraftCommitBatch(k=k, draft_id=d.draft_id, rids=run.rids, slots=run.slots, seq_lens=run.seq_lens + 1, accept_pos=acc,
                                  input_ids=window, kv_locs=it.window_kv, sampling=run.sampling)
    # the draft's catch-up extend: [pending, d1..dm] at positions seq_len.., with their KV
    de = prepare_for_draft_extend(c)
    kept = [(window[i * w + j], it.window_kv[i * w + j]) for i in range(n) for j in range(acc[i] + 1)]
    assert de == DraftExtendBatch(rids=run.rids, slots=run.slots, prefix_lens=run.seq_lens, extend_lens=[a + 1 for a in acc],
                                  input_ids=[t for t, _ in kept], kv_locs=[x for _, x in kept], sampling=run.sampling)
    # each end of the iteration merges to the same running rows: seq_len + accepted, the last committed token and KV
    rows = [(r, s, n0 + 1 + a, window[i * w + a], it.window_kv[i * w + a])
            for i, (r, s, n0, a) in enumerate(zip(run.rid_list(), run.slots.tolist(), run.seq_lens.tolist(), acc, strict=True))]
    for end in (c, dc, de):
        merged = merge_batch(DecodeBatch.empty(), end)
        if n == 0:
            assert merged.num_requests == 0
            continue
        assert _decode_rows(merged) == rows and _srows(merged.sampling) == _srows(run.sampling)
        assert merge_batch(DecodeBatch(rids=[999], slots=[999], seq_lens=[1], input_ids=[0], kv_locs=[1]), end).rid_list() == [999, *run.rid_list()]


def test_each_draft_and_verify_gets_a_fresh_id() -> None:
    it = _iteration(random.Random(1), 2, 2)
    ctx = SpecContext(k=2, next_tokens=it.pending, kv_locs=it.window_kv)
    d2 = prepare_for_draft(it.running, ctx)
    assert d2.draft_id != it.draft.draft_id and attrs.evolve(d2, draft_id=it.draft.draft_id) == it.draft
    v2 = prepare_for_verify(it.draft, proposed(it.draft, [t for row in it.drafts for t in row]))
    assert v2.verify_id != it.verify.verify_id and attrs.evolve(v2, verify_id=it.verify.verify_id) == it.verify


@pytest.mark.parametrize("n", [SMALL_COLUMN - 1, SMALL_COLUMN, SMALL_COLUMN + 1])
def test_accept_is_greedy_acceptance_on_both_sides_of_the_small_path(n: int) -> None:
    rng = random.Random(n)
    it = _iteration(rng, n, 3, sampled=False)
    acc, bonus = _accepted(it)
    result = accept(it.verify, verified(it.verify, [t for row in it.targets for t in row]))
    assert result.accepted.tolist() == acc and result.bonus.tolist() == bonus
    assert set(acc) == {0, 1, 2, 3}  # every acceptance length is exercised


def test_accept_stops_at_a_non_finite_prediction_and_accepts_a_whole_window() -> None:
    it = _iteration(random.Random(2), 3, 2, sampled=False)
    d = it.drafts
    targets = [[*d[0], 5], [d[1][0], NON_FINITE, 4], [NON_FINITE, NON_FINITE, NON_FINITE]]
    r = accept(it.verify, verified(it.verify, [t for row in targets for t in row]))
    assert r.accepted.tolist() == [2, 1, 0] and r.bonus.tolist() == [5, NON_FINITE, NON_FINITE]


def test_accept_refusals_name_both_values() -> None:
    it = _iteration(random.Random(3), 3, 2)
    v = it.verify
    tokens = [1] * 9
    unchecked = build_unchecked(Verified, k=2, verify_id=v.verify_id, rids=v.rids, tokens=np.ones(8, dtype=np.int64), hidden=None)
    with pytest.raises(PreconditionError, match=r"^accept: expected 9 target tokens, got shape \(8,\)$"):
        accept(v, unchecked)
    rids = v.rid_list()
    with pytest.raises(PreconditionError, match=rf"^accept: the target tokens of verify #{v.verify_id} are for 1 row \[{rids[0]}\], the verify has 3 rows "):
        accept(v, Verified(k=2, verify_id=v.verify_id, rids=rids[:1], tokens=[1] * 3))
    with pytest.raises(PreconditionError, match=rf"^accept: the target tokens of verify #{v.verify_id} have a window of k=3, verify #{v.verify_id} has k=2$"):
        accept(v, Verified(k=3, verify_id=v.verify_id, rids=rids, tokens=[1] * 12))
    other = mint_verify_id()
    with pytest.raises(PreconditionError, match=rf"^accept: the target tokens of verify #{other} cannot judge verify #{v.verify_id}: "):
        accept(v, Verified(k=2, verify_id=other, rids=rids, tokens=tokens))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^accept: batch must be a VerifyBatch, got DraftBatch"):
            accept(it.draft, verified(v, tokens))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^accept: verified must be the Verified result of the batch's verify, got list"):
            accept(v, tokens)  # type: ignore[arg-type]  # the refusal under test


def test_commit_takes_accepted_up_to_k_and_names_the_excess() -> None:
    it = _iteration(random.Random(4), 3, 2)
    v = it.verify
    ok = spec.AcceptResult(verify_id=v.verify_id, rids=v.rids, accepted=[2, 0, 2], bonus=[1, 1, 1])
    c = commit(v, ok)
    assert c.accept_pos.tolist() == [2, 0, 2] and c.released_kv.tolist() == it.window_kv[4:6]
    over = spec.AcceptResult(verify_id=v.verify_id, rids=v.rids, accepted=[0, 3, 1], bonus=[1, 1, 1])
    with pytest.raises(PreconditionError, match=r"^commit: accepted 3 > k=2$"):
        commit(v, over)
    other = mint_verify_id()
    with pytest.raises(PreconditionError, match=(
        rf"^commit: the accept result of verify #{other} cannot commit verify #{v.verify_id}: a commit applies the result of the verify it judged$"
    )):
        commit(v, attrs.evolve(ok, verify_id=other))
    rids = v.rid_list()
    with pytest.raises(PreconditionError, match=(
        rf"^commit: the accept result of verify #{v.verify_id} judged rows {_list([rids[1], rids[0], rids[2]])}, the verify's are {_list(rids)} "
        rf"\(row 0: request {rids[1]}, the verify's {rids[0]}\): a commit applies each row's result to that row$"
    )):
        commit(v, attrs.evolve(ok, rids=[rids[1], rids[0], rids[2]]))
    empty = _iteration(random.Random(4), 0, 2)
    assert commit(empty.verify, spec.AcceptResult(verify_id=empty.verify.verify_id, rids=[], accepted=[], bonus=[])).num_requests == 0
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^commit: batch must be a VerifyBatch, got CommitBatch"):
            commit(c, ok)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^commit: result must be an AcceptResult, got Verified"):
            commit(v, verified(v, [1] * 9))  # type: ignore[arg-type]  # the refusal under test


def test_prepare_for_draft_bounds() -> None:
    run = DecodeBatch(rids=[4, 2], slots=[1, 2], seq_lens=[1, 1], input_ids=[0, 0], kv_locs=[0, 1])
    for k in (1, 4):
        ctx = SpecContext(k=k, next_tokens=[3, 4], kv_locs=range(100, 100 + 2 * (k + 1)))
        edge = attrs.evolve(run, seq_lens=[MAX_SEQ_LEN - k - 2, 1])
        assert prepare_for_draft(edge, ctx).seq_lens.tolist() == [MAX_SEQ_LEN - k - 1, 2]
        past = attrs.evolve(run, seq_lens=[1, MAX_SEQ_LEN - k - 1])
        with pytest.raises(PreconditionError, match=(
            rf"^prepare_for_draft: a sequence of {MAX_SEQ_LEN - k - 1} tokens has no room for k \+ 1 = {k + 1} more under MAX_SEQ_LEN$"
        )):
            prepare_for_draft(past, ctx)
    with pytest.raises(PreconditionError, match=r"^prepare_for_draft: ctx has 3 pending tokens for 2 rows$"):
        prepare_for_draft(run, SpecContext(k=1, next_tokens=[1, 2, 3], kv_locs=range(6)))
    with pytest.raises(PreconditionError, match=r"^prepare_for_draft: the context's next tokens are for rows \[2, 4\], the batch's are \[4, 2\] "
                                                r"\(row 0: request 2, the batch's 4\): each row is fed its own request's next tokens$"):
        prepare_for_draft(run, SpecContext(k=1, next_tokens=[1, 2], kv_locs=range(4), rids=[2, 4]))
    with pytest.raises(IRValidationError, match=r"SpecContext\.rids"):
        SpecContext(k=1, next_tokens=[1, 2], kv_locs=range(4), rids=[2])
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_draft: batch must be a DecodeBatch, got NoneType"):
            prepare_for_draft(None, SpecContext(k=1, next_tokens=[1], kv_locs=range(2)))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_draft: ctx must be a SpecContext, got DecodeContext"):
            prepare_for_draft(run, DecodeContext(next_tokens=[1, 2], kv_locs=[1, 2]))  # type: ignore[arg-type]  # the refusal under test


@pytest.mark.parametrize(("k", "match"), [
    (0, r"speculative steps must be >= 1 \(got 0\)"),
    (-1, r"speculative steps must be >= 1 \(got -1\)"),
    (MAX_SPEC_K + 1, rf"speculative steps must be at most MAX_SPEC_K \({MAX_SPEC_K}\) \(got {MAX_SPEC_K + 1}\)"),
    (True, r"must be an int, not bool \(got True\)"),
    (2.0, r"must be an int, not float \(got 2\.0\)"),
])
def test_a_spec_context_takes_a_window_of_1_to_max_spec_k_drafts(k: object, match: str) -> None:
    with suppress_type_checks(), pytest.raises(IRValidationError, match=rf"^SpecContext\.k: {match}$"):
        SpecContext(k=k, next_tokens=[1], kv_locs=[1, 2])  # type: ignore[arg-type]  # the refusal under test


def test_a_draft_of_the_largest_window() -> None:
    k = MAX_SPEC_K
    run = DecodeBatch(rids=[3], slots=[1], seq_lens=[MAX_SEQ_LEN - k - 2], input_ids=[0], kv_locs=[0])
    d = prepare_for_draft(run, SpecContext(k=k, next_tokens=[5], kv_locs=range(1, k + 2), rids=[3]))
    assert d.k == k and d.seq_lens.tolist() == [MAX_SEQ_LEN - k - 1] and d.kv_locs.tolist() == list(range(1, k + 2))
    v = prepare_for_verify(d, proposed(d, list(range(k))))
    assert v.input_ids.tolist() == [5, *range(k)]
    result = accept(v, verified(v, [*range(k), 9]))
    assert result.accepted.tolist() == [k] and result.bonus.tolist() == [9]
    c = commit(v, result)
    assert c.released_kv.tolist() == [] and prepare_for_draft_extend(c).extend_lens.tolist() == [k + 1]
    assert _decode_rows(merge_batch(DecodeBatch.empty(), c)) == [(3, 1, MAX_SEQ_LEN - 1, k - 1, k + 1)]


def test_prepare_for_verify_refusals() -> None:
    it = _iteration(random.Random(6), 2, 2)
    d = it.draft
    other = prepare_for_draft(it.running, SpecContext(k=2, next_tokens=it.pending, kv_locs=it.window_kv))  # same rows, another draft
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_verify: the proposals of draft #{other.draft_id} cannot be verified against draft #{d.draft_id}: "
        r"a verify checks the proposals of the draft it follows$"
    )):
        prepare_for_verify(d, proposed(other, [1] * 4))
    with pytest.raises(PreconditionError, match=rf"^prepare_for_verify: the proposals of draft #{d.draft_id} hold 4 tokens with k=1; the draft has 2 rows x k=2$"):
        prepare_for_verify(d, spec.Proposals(k=1, draft_id=d.draft_id, tokens=[1] * 4))
    with pytest.raises(PreconditionError, match=rf"^prepare_for_verify: the proposals of draft #{d.draft_id} hold 6 tokens with k=2; the draft has 2 rows x k=2$"):
        prepare_for_verify(d, spec.Proposals(k=2, draft_id=d.draft_id, tokens=[1] * 6))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_verify: batch must be a DraftBatch, got VerifyBatch"):
            prepare_for_verify(it.verify, proposed(d, [1] * 4))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_verify: proposals must be the Proposals the draft step returned, got ndarray"):
            prepare_for_verify(d, np.ones(4, dtype=np.int64))  # type: ignore[arg-type]  # the refusal under test


@pytest.mark.parametrize("column", ["rids", "slots", "seq_lens", "kv_locs"])
def test_a_draft_commit_refuses_a_draft_that_differs_in_any_column(column: str) -> None:
    it = _iteration(random.Random(7), 9, 1)  # 9 rows: the message shows the first eight of each
    c = _commit(it)
    d = it.draft
    mine = getattr(c, column).tolist()
    theirs = list(mine)
    theirs[-1] = theirs[-1] + 100_000
    other = attrs.evolve(d, **{column: theirs})
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_draft_commit: the commit's {column} {_list(mine[:8])} are not those of draft #{d.draft_id} \({_list(theirs[:8])}\): "
        r"a draft commit pairs a commit with the draft of its own iteration$"
    )):
        prepare_for_draft_commit(c, other)


def _list(values: Sequence[int]) -> str:
    return r"\[" + ", ".join(str(v) for v in values) + r"\]"


def test_a_draft_commit_refuses_another_draft_or_window_and_arguments_of_other_types() -> None:
    it = _iteration(random.Random(8), 2, 2)
    c, d = _commit(it), it.draft
    other = _iteration(random.Random(8), 2, 2).draft
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_draft_commit: the commit of verify #{c.verify_id} checked the proposals of draft #{d.draft_id}, not those of draft #{other.draft_id}: "
    )):
        prepare_for_draft_commit(c, other)
    k1 = attrs.evolve(d, k=1, kv_locs=it.window_kv[:4])
    with pytest.raises(PreconditionError, match=rf"^prepare_for_draft_commit: the commit has k=2, the draft #{d.draft_id} k=1$"):
        prepare_for_draft_commit(c, k1)
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_draft_commit: batch must be a CommitBatch, got VerifyBatch"):
            prepare_for_draft_commit(it.verify, d)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_draft_commit: draft must be a DraftBatch, got VerifyBatch"):
            prepare_for_draft_commit(c, it.verify)  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_draft_extend: batch must be a CommitBatch, got ExtendBatch"):
            prepare_for_draft_extend(prepare_for_extend(_requests(random.Random(1), 1)))  # type: ignore[arg-type]  # the refusal under test


# -- the draft head's passes ----------------------------------------------------------------------------------


def _verify_hidden(c: CommitBatch, *, verify_id: int | None = None, rids: Sequence[int] | None = None, starts: Sequence[int] | None = None,
                   lens: Sequence[int] | None = None) -> HiddenStates:
    """The handle the verify of ``c`` hands back (each field replaceable)."""
    return HiddenStates(
        hidden_id=mint_hidden_id(), source=HiddenSource.VERIFY, verify_id=VerifyId(verify_id if verify_id is not None else c.verify_id),
        rids=c.rids if rids is None else rids, starts=c.seq_lens - 1 if starts is None else starts,
        lens=[c.k + 1] * c.num_requests if lens is None else lens,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_head_commit_is_the_committed_window_with_the_verifys_states(seed: int) -> None:
    rng = random.Random(700 + seed)
    n, k = rng.randint(1, 5), rng.randint(1, 4)
    it = _iteration(rng, n, k)
    c = _commit(it)
    hidden = _verify_hidden(c)
    acc = c.accept_pos.tolist()
    w = k + 1
    window = it.verify.input_ids.tolist()
    kept = [(window[i * w + j], it.window_kv[i * w + j]) for i in range(n) for j in range(acc[i] + 1)]
    out = prepare_for_head_commit(c, hidden)
    assert out == HeadCommitBatch(k=k, hidden_id=hidden.hidden_id, rids=c.rids, slots=c.slots, prefix_lens=c.seq_lens - 1, accept_pos=acc,
                                  extend_lens=[a + 1 for a in acc], input_ids=[t for t, _ in kept], kv_locs=[x for _, x in kept])
    assert lower(out, CTX) == HeadCommitPlan(batch=out)


def test_a_head_commit_refuses_states_it_does_not_follow() -> None:
    it = _iteration(random.Random(9), 10, 2)  # 10 rows: each list is cut at eight
    c = _commit(it)
    rids, starts = c.rid_list(), (c.seq_lens - 1).tolist()
    who = f"the commit of verify #{c.verify_id}"
    other = _verify_hidden(c, verify_id=mint_verify_id())  # another verify over the same rows and positions
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_head_commit: hidden #{other.hidden_id} of verify #{other.verify_id} \(rows .*\) cannot feed the head commit of verify #{c.verify_id}: "
        r"a head commit reads the hidden states of the verify its commit was computed from$"
    )):
        prepare_for_head_commit(c, other)
    extend = HiddenStates(hidden_id=mint_hidden_id(), source=HiddenSource.EXTEND, rids=c.rids, starts=c.seq_lens - 1, lens=[3] * 10)
    with pytest.raises(PreconditionError, match=rf"^prepare_for_head_commit: hidden #{extend.hidden_id} of an extend .* cannot feed the head commit of verify"):
        prepare_for_head_commit(c, extend)
    swapped = [*rids[:9], rids[9] + 1000]
    for field, name, theirs, mine in (("rids", "rows", swapped, rids), ("starts", "first positions", [*starts[:9], starts[9] + 1], starts),
                                      ("lens", "lengths", [3] * 9 + [2], [3] * 10)):
        bad = _verify_hidden(c, **{field: theirs})
        with pytest.raises(PreconditionError, match=(
            rf"^prepare_for_head_commit: hidden #{bad.hidden_id} of verify #{c.verify_id} \(rows {_list(theirs[:8] if field == 'rids' else rids[:8])}, "
            rf"positions .*\) kept {name} {_list(theirs[:8])}, {who} reads {name} {_list(mine[:8])}: "
            r"a head phase reads the hidden states of the target forward it follows$"
        )):
            prepare_for_head_commit(c, bad)
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_head_commit: batch must be a CommitBatch, got VerifyBatch"):
            prepare_for_head_commit(it.verify, _verify_hidden(c))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_head_commit: hidden must be the HiddenStates the verify's result handed back, got int"):
            prepare_for_head_commit(c, 5)  # type: ignore[arg-type]  # the refusal under test


def test_a_head_commit_refuses_states_of_one_row_too_many_or_too_few() -> None:
    it = _iteration(random.Random(10), 3, 2)
    c = _commit(it)
    rids, starts = c.rid_list(), (c.seq_lens - 1).tolist()
    for n in (2, 4):
        rows = (rids + [4242])[:n]
        bad = HiddenStates(hidden_id=mint_hidden_id(), source=HiddenSource.VERIFY, verify_id=c.verify_id, rids=rows,
                           starts=(starts + [1])[:n], lens=[3] * n)
        with pytest.raises(PreconditionError, match=rf"kept rows {_list(rows)}, the commit of verify #{c.verify_id} reads rows {_list(rids)}"):
            prepare_for_head_commit(c, bad)


HEAD = PoolId("head")
CTX = LowerContext(pools=(TARGET_POOL, PoolId("draft")), head_pools=(HEAD, PoolId("head2")))


def _extend_hidden(b: ExtendBatch, **fields: object) -> HiddenStates:
    base: dict[str, object] = dict(hidden_id=mint_hidden_id(), source=HiddenSource.EXTEND, rids=b.rids, starts=b.prefix_lens, lens=b.extend_lens)
    return HiddenStates(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_head_extend_is_the_prefill_with_its_own_ops_and_the_states_it_follows(seed: int) -> None:
    rng = random.Random(800 + seed)
    batch = prepare_for_extend(_requests(rng, rng.randint(1, 6)), None)
    hidden = _extend_hidden(batch)
    out = prepare_for_head_extend(batch, hidden)
    assert out == HeadExtendBatch(hidden_id=hidden.hidden_id, rids=batch.rids, slots=batch.slots, prefix_lens=batch.prefix_lens,
                                  extend_lens=batch.extend_lens, intents=batch.intents, input_ids=batch.input_ids, kv_locs=batch.kv_locs,
                                  init=batch.init, snapshot=batch.snapshot)
    plan = lower(out, CTX)
    assert plan.tickets == (tuple(Ticket(pool=p, op=batch.init) for p in CTX.head_pools) if batch.init is not None else ())
    assert plan.snapshots == (tuple(Ticket(pool=p, op=batch.snapshot) for p in CTX.head_pools) if batch.snapshot is not None else ())
    assert (plan.hidden_id, plan.rids, plan.input_ids, plan.kv_locs) == (out.hidden_id, out.rids, out.input_ids, out.kv_locs)
    assert plan.prefix_lens is out.prefix_lens and plan.extend_lens is out.extend_lens and plan.slots is out.slots


def test_a_head_extend_refuses_states_it_does_not_follow() -> None:
    reqs = [AdmittedRequest(rid=RequestId(20 - i), slot=MambaSlot(i + 1), intent=Continue(prefix_len=i + 1), input_ids=[1, 2], kv_locs=[2 * i, 2 * i + 1])
            for i in range(9)]
    batch = prepare_for_extend(reqs)
    rids = batch.rid_list()
    bad = _extend_hidden(batch, rids=[*rids[:8], 99])
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_head_extend: hidden #{bad.hidden_id} of an extend \(rows {_list(rids[:8])}, positions 1\.\.2, 2\.\.3, 3\.\.4, 4\.\.5, 5\.\.6, 6\.\.7, 7\.\.8, 8\.\.9\) "
        rf"kept rows {_list(rids[:8])}, the extend reads rows {_list(rids[:8])}: a head phase reads the hidden states of the target forward it follows$"
    )):
        prepare_for_head_extend(batch, bad)
    it = _iteration(random.Random(1), 1, 1)
    vh = _verify_hidden(_commit(it))
    with pytest.raises(PreconditionError, match=(
        rf"^prepare_for_head_extend: hidden #{vh.hidden_id} of verify #{vh.verify_id} .* cannot feed a head extend: "
        r"it reads the states of the prefill chunk it follows \(a verify's feed prepare_for_head_commit\)$"
    )):
        prepare_for_head_extend(batch, vh)
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^prepare_for_head_extend: batch must be an ExtendBatch \(a prefill's\), got DecodeBatch"):
            prepare_for_head_extend(DecodeBatch.empty(), _extend_hidden(batch))  # type: ignore[arg-type]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^prepare_for_head_extend: hidden must be the HiddenStates the prefill's result handed back, got NoneType"):
            prepare_for_head_extend(batch, None)  # type: ignore[arg-type]  # the refusal under test


# -- lower ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_lower_gives_each_pool_a_ticket_of_the_prefills_ops_and_shares_the_columns(seed: int) -> None:
    rng = random.Random(900 + seed)
    batch = prepare_for_extend(_requests(rng, rng.randint(1, 6)))
    pools = [(TARGET_POOL,), (PoolId("a"), PoolId("b"), PoolId("c"))][seed % 2]
    ctx = LowerContext(pools=pools)
    plan = lower(batch, ctx)
    assert plan == ExtendPlan(rids=batch.rids, slots=batch.slots, prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
                              more_chunks=batch.more_chunks, input_ids=batch.input_ids, kv_locs=batch.kv_locs,
                              tickets=tuple(Ticket(pool=p, op=batch.init) for p in pools) if batch.init is not None else (),
                              snapshots=tuple(Ticket(pool=p, op=batch.snapshot) for p in pools) if batch.snapshot is not None else ())
    for name in ("rids", "slots", "prefix_lens", "extend_lens", "input_ids", "kv_locs"):
        assert getattr(plan, name) is getattr(batch, name)
    assert lower(batch, ctx) == plan  # the same tickets again: the ledger refuses the second


def test_lower_of_every_batch_type() -> None:
    rng = random.Random(11)
    extend = prepare_for_extend(_requests(rng, 3), _sampling(rng, 3))
    running = _running(rng, 2)
    it = _iteration(rng, 2, 2)
    c = _commit(it)
    sid, sid2, hid = SampleId(5), SampleId(6), HiddenId(7)
    ext = lower(extend, CTX, sample_id=sid, keep_hidden=hid)
    assert isinstance(ext, ExtendPlan) and ext.sample_id == sid and ext.keep_hidden == hid and ext.sampling is extend.sampling
    assert ext.tickets == (tuple(Ticket(pool=p, op=extend.init) for p in CTX.pools) if extend.init is not None else ())
    assert ext.snapshots == (tuple(Ticket(pool=p, op=extend.snapshot) for p in CTX.pools) if extend.snapshot is not None else ())
    dec = lower(running, CTX, sample_id=sid)
    assert dec == DecodePlan(rids=running.rids, slots=running.slots, seq_lens=running.seq_lens, input_ids=running.input_ids,
                             kv_locs=running.kv_locs, sample_id=sid, sampling=running.sampling)
    placeholders = attrs.evolve(running, input_ids=[0, 0])
    piped = lower(placeholders, CTX, sample_id=sid2, inputs_from=sid)
    assert piped.sample_id == sid2 and piped.inputs_from == sid
    mixed = lower(mix_with_running(extend, placeholders), CTX, sample_id=sid2, inputs_from=sid, keep_hidden=hid)
    assert isinstance(mixed, MixedPlan)
    assert mixed.extend == lower(extend, CTX, sample_id=sid2, keep_hidden=hid) and mixed.decode == piped
    assert lower(IdleBatch(), CTX) == IdlePlan()
    assert lower(it.draft, CTX) == spec.DraftPlan(batch=it.draft)
    assert lower(it.verify, CTX, keep_hidden=hid) == spec.VerifyPlan(batch=it.verify, keep_hidden=hid)
    assert lower(it.verify, CTX) == spec.VerifyPlan(batch=it.verify)
    assert lower(c, CTX) == spec.CommitPlan(batch=c)
    assert lower(prepare_for_draft_commit(c, it.draft), CTX) == spec.DraftCommitPlan(batch=prepare_for_draft_commit(c, it.draft))
    assert lower(prepare_for_draft_extend(c), CTX) == spec.DraftExtendPlan(batch=prepare_for_draft_extend(c))
    head = prepare_for_head_extend(extend, _extend_hidden(extend))
    assert isinstance(lower(head, CTX), HeadExtendPlan)
    with pytest.raises(PreconditionError, match=(
        r"^lower: a HeadExtendBatch needs the head's pools in LowerContext\.head_pools \(none given; pools \['target'\]\): "
        r"without them the head pool would never run the prefill's init ops$"
    )):
        lower(head, LowerContext())


def test_lower_checks_the_ids_it_is_given_and_refuses_them_where_a_plan_has_none() -> None:
    rng = random.Random(12)
    extend = prepare_for_extend(_requests(rng, 2))
    running = _running(rng, 2)
    it = _iteration(rng, 1, 1)
    with pytest.raises(IRValidationError, match=r"ExtendPlan\.keep_hidden: must be a positive hidden id"):
        lower(extend, CTX, keep_hidden=HiddenId(0))
    with pytest.raises(IRValidationError, match=r"ExtendPlan\.sample_id: must be a positive sample id"):
        lower(extend, CTX, sample_id=SampleId(0))
    with pytest.raises(IRValidationError, match=r"DecodePlan\.inputs_from: must be a positive sample id"):
        lower(attrs.evolve(running, input_ids=[0, 0]), CTX, inputs_from=SampleId(0))
    with pytest.raises(IRValidationError, match=r"DecodePlan\.input_ids: must be placeholders"):
        lower(running, CTX, inputs_from=SampleId(3))
    with pytest.raises(IRValidationError, match=r"DecodePlan\.sample_id: must be a positive sample id"):
        lower(running, CTX, sample_id=SampleId(-1))
    with suppress_type_checks():
        with pytest.raises(PreconditionError, match=r"^lower: inputs_from must be None for a ExtendBatch \(only decode rows read a sample\), got int \(3\)$"):
            lower(extend, CTX, inputs_from=SampleId(3))  # type: ignore[call-overload]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^lower: sample_id must be None for a VerifyBatch \(only a forward keeps a sample\), got int \(3\)$"):
            lower(it.verify, CTX, sample_id=SampleId(3))  # type: ignore[call-overload]  # the refusal under test
        with pytest.raises(PreconditionError, match=(
            r"^lower: keep_hidden must be None for a DecodeBatch \(only a prefill or a verify keeps hidden states for a head\), got int \(4\)$"
        )):
            lower(running, CTX, keep_hidden=HiddenId(4))  # type: ignore[call-overload]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^lower: keep_hidden must be None for a DraftBatch"):
            lower(it.draft, CTX, keep_hidden=HiddenId(4))  # type: ignore[call-overload]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^lower: ctx must be a LowerContext, got tuple"):
            lower(extend, (TARGET_POOL,))  # type: ignore[call-overload]  # the refusal under test
        with pytest.raises(PreconditionError, match=r"^lower: batch must be a batch \(ir\.nodes\.Batch\), got ExtendPlan"):
            lower(lower(extend, CTX), CTX)  # type: ignore[call-overload]  # the refusal under test


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(pools=()), r"^LowerContext\.pools: at least one pool must be registered"),
    (dict(pools=[]), r"^LowerContext\.pools: at least one pool must be registered"),
    (dict(pools="target"), r"^LowerContext\.pools: must be a tuple of pool names"),
    (dict(pools=None), r"^LowerContext\.pools: must be a tuple of pool names"),
    (dict(pools=("a", "")), r"^LowerContext\.pools: every entry must be a pool name \(a non-empty str\), not an empty str"),
    (dict(pools=("a", None)), r"^LowerContext\.pools: every entry must be a pool name \(a non-empty str\), not NoneType"),
    (dict(pools=("a", "b", "a")), r"^LowerContext\.pools: pool names must be distinct"),
    (dict(head_pools="head"), r"^LowerContext\.head_pools: must be a tuple of pool names"),
    (dict(head_pools=("h", "h")), r"^LowerContext\.head_pools: pool names must be distinct"),
    (dict(head_pools=("h", 3)), r"^LowerContext\.head_pools: every entry must be a pool name \(a non-empty str\), not int"),
    (dict(pools=("t", "h"), head_pools=("x", "h")), r"^LowerContext\.head_pools: a head pool must not be in pools \['t', 'h'\] "
                                                    r"\(it would run the prefill's ops twice\)"),
])
def test_a_lower_context_refuses_pools_that_would_lose_or_double_an_op(kwargs: dict[str, object], match: str) -> None:
    with suppress_type_checks(), pytest.raises(IRValidationError, match=match):
        LowerContext(**kwargs)  # type: ignore[arg-type]  # the refusal under test


def test_a_lower_context_takes_any_collection_of_distinct_names() -> None:
    assert LowerContext().pools == (TARGET_POOL,) and LowerContext().head_pools == ()
    assert LowerContext(pools=["a", "b"], head_pools=("c",)).pools == ("a", "b")  # type: ignore[arg-type]
    assert set(LowerContext(pools=frozenset({"a", "b"}), head_pools={"c", "d"}).head_pools) == {"c", "d"}  # type: ignore[arg-type]
    assert LowerContext(pools=("a",), head_pools=("b",)).head_pools == ("b",)


# -- the pass registry ----------------------------------------------------------------------------------------


def _mine(batch: DecodeBatch, n: int = 1) -> DecodeBatch:
    """A pass of one's own (a plain function)."""
    return batch


def test_every_built_in_pass_is_registered_once_and_spec_of_finds_it() -> None:
    names = [p.name for p in PASSES]
    assert len(set(names)) == len(names) == len(REGISTRY)
    for p in PASSES:
        assert spec_of(p.fn) is p and p.name == p.fn.__name__
        assert p.ends_step == (p.name == "lower")


def test_declare_pass_returns_a_pass_that_calls_the_function() -> None:
    declared = declare_pass(_mine)
    assert isinstance(declared, Pass) and declared.spec == PassSpec(fn=_mine, name="_mine", ends_step=False)
    b = DecodeBatch.empty()
    assert declared(b, n=2) is b and spec_of(declared) is declared.spec
    assert declared.__name__ == "_mine" and declared.__wrapped__ is _mine and declared.__doc__ == _mine.__doc__
    assert repr(declared) == f"<pass '_mine' ({__name__}._mine)>"
    named = declare_pass(name="mine_too", ends_step=True)(_mine)
    assert named.spec == PassSpec(fn=_mine, name="mine_too", ends_step=True)
    assert declare_pass(_mine, name="third").spec.name == "third"
    with pytest.raises(AttributeError, match=r"^pass '_mine' is immutable \(cannot set 'spec'\)$"):
        declared.spec = named.spec  # type: ignore[misc]  # the refusal under test
    with pytest.raises(AttributeError, match=r"cannot set '_spec'"):
        declared._spec = named.spec


class _Callable:
    """A callable object without a ``__name__``."""

    def __call__(self, batch: DecodeBatch) -> DecodeBatch:
        return batch


class _Unhashable(_Callable):
    __hash__ = None  # type: ignore[assignment]


def test_declare_pass_refuses_what_cannot_be_a_pass_of_ones_own() -> None:
    declared = declare_pass(_mine)
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: declare_pass(declared), r"^declare_pass: <pass '_mine' .*> is declared already \(a pass is declared once\)$"),
        (lambda: declare_pass(42), r"^declare_pass: a pass must be a function, got 42$"),  # type: ignore[call-overload]
        (lambda: declare_pass(lower), r"^declare_pass: 'lower' is one of batchc's own passes, declared already$"),
        (lambda: declare_pass(filter_batch, name="mine"), r"^declare_pass: 'filter_batch' is one of batchc's own passes, declared already$"),
        (lambda: declare_pass(lambda b: b), r"^declare_pass: .*<lambda>.* has no identifier for a name; declare it with name=\.\.\.$"),
        (lambda: declare_pass(_Callable()), r"^declare_pass: .*_Callable.* has no identifier for a name; declare it with name=\.\.\.$"),
        (lambda: declare_pass(_mine, name="not a name"), r"^declare_pass: name must be a Python identifier \(it names dump files\), got 'not a name'$"),
        (lambda: declare_pass(_mine, name=3), r"^declare_pass: name must be a Python identifier \(it names dump files\), got 3$"),  # type: ignore[call-overload]
        (lambda: declare_pass(_mine, name="lower"), r"^declare_pass: name 'lower' is a built-in pass's; give yours another name$"),
        (lambda: declare_pass(name="merge_batch"), r"^declare_pass: name 'merge_batch' is a built-in pass's; give yours another name$"),
        (lambda: declare_pass(name="a b"), r"^declare_pass: name must be a Python identifier"),
        (lambda: declare_pass(_mine, ends_step=1), r"^declare_pass: ends_step must be a bool, got 1$"),  # type: ignore[call-overload]
        (lambda: declare_pass(ends_step="yes"), r"^declare_pass: ends_step must be a bool, got 'yes'$"),  # type: ignore[call-overload]
        (lambda: Pass(_mine, PassSpec(fn=_Callable(), name="x")), r"^Pass: spec must be a PassSpec of the function itself, got "),
        (lambda: Pass(_mine, "x"), r"^Pass: spec must be a PassSpec of the function itself, got 'x'$"),  # type: ignore[arg-type]
        (lambda: Pass(_mine, PassSpec(fn=_mine, name="accept")), r"^declare_pass: name 'accept' is a built-in pass's"),
        (lambda: Pass(_mine, PassSpec(fn=_mine, name="ok", ends_step=None)), r"^declare_pass: ends_step must be a bool, got None$"),  # type: ignore[arg-type]
    ]
    with suppress_type_checks():
        for call, match in cases:
            with pytest.raises(PreconditionError, match=match):
                call()
    assert declare_pass(_Callable(), name="callable_ok").spec.name == "callable_ok"
    assert declare_pass(_Unhashable(), name="unhashable_ok").spec.name == "unhashable_ok"
    obj = _Callable()
    assert repr(declare_pass(obj, name="obj")) == f"<pass 'obj' ({obj!r})>"  # no qualified name: the object itself


def test_spec_of_refuses_what_is_not_a_declared_pass() -> None:
    with suppress_type_checks():
        for bad, shown in ((_mine, "<function _mine"), (_Unhashable(), "_Unhashable"), (None, "None"), ("lower", "'lower'")):
            with pytest.raises(PreconditionError, match=rf"^PassManager\.run: .*{shown}.* is not a declared pass \(batchc's own, or one made with passes\.registry\.declare_pass\)$"):
                spec_of(bad)
