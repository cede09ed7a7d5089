"""IR columns are immutable for real: no caller, copy or unpickled clone can change them.

- Input memory the IR does not own is copied: a read-only ``np.frombuffer(bytearray)`` and a
  read-only view of ``tensor.numpy()`` both still change with their owner, so a node built from
  them must not.
- Columns cannot be flipped back to writeable (``flags.writeable = True`` raises), also after
  ``pickle`` and ``copy.deepcopy`` (numpy alone unpickles arrays as writeable).
- Sharing stays free: a plan's columns are its batch's (identity), and nodes built from another
  node's columns, from ``freeze``/``frozen_i64`` or from the allocators take them without a copy.
- Every pass's output columns are IR-owned (``ir.columns.is_owned``).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from backend.allocator import KVAllocator, SlotAllocator
from backend.ledger import Ledger
from compiler.manager import PassError, PassManager
from compiler.steps import Pipeline
from ir.batch import DecodeBatch, ExtendBatch, MixedBatch
from ir.columns import freeze, frozen_i64, is_owned
from ir.errors import IRVerificationError
from ir.ids import DRAFT_POOL, TARGET_POOL, MambaSlot, RequestId
from ir.init import InitIntent
from ir.plan import DecodePlan, ExtendPlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.spec import AcceptResult, CommitBatch, DraftBatch, DraftExtendBatch, VerifyBatch
from ir.verify import verify
from passes.accept import accept
from passes.commit import commit
from passes.filter_batch import filter_batch
from passes.lower import LowerContext, lower
from passes.merge_batch import merge_batch
from passes.mix_with_running import mix_with_running
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from passes.prepare_for_draft import SpecContext, prepare_for_draft
from passes.prepare_for_draft_extend import prepare_for_draft_extend
from passes.prepare_for_extend import prepare_for_extend
from passes.prepare_for_verify import prepare_for_verify
from tests.helpers import cont, cow, decode_batch, fresh, proposed, request, verified

LCTX = LowerContext(pools=(TARGET_POOL, DRAFT_POOL))


def columns(node: object, path: str = "") -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
    """Every array held by ``node`` and the attrs nodes inside it (tickets, parts, wrapped batches)."""
    if not attrs.has(type(node)):
        return
    for a in attrs.fields(type(node)):
        value = getattr(node, a.name)
        where = f"{path}{type(node).__name__}.{a.name}"
        if isinstance(value, np.ndarray):
            yield where, value
        elif attrs.has(type(value)):
            yield from columns(value, where + ".")


def assert_immutable(node: object) -> None:
    found = list(columns(node))
    assert found, f"{type(node).__name__} holds no columns"
    for where, col in found:
        assert not col.flags.writeable, where
        assert is_owned(col), f"{where} is not IR-owned memory"
        with pytest.raises(ValueError):
            col.flags.writeable = True
        with pytest.raises(ValueError, match="read-only"):
            col[...] = 0


# -- a corpus of nodes: every node type with columns ----------------------------------------------


def _extend() -> ExtendBatch:
    return prepare_for_extend(
        [
            fresh(10, 1, [5, 6, 7], 100),
            cow(11, 2, src=9, prefix=4, tokens=[8, 9], kv_start=200),
            cont(12, 3, prefix=6, tokens=[1, 2, 3, 4], kv_start=300, more=True),
        ]
    )


def _running() -> DecodeBatch:
    return decode_batch([1, 2], [4, 5], [7, 9], [70, 71])


def _spec_chain() -> tuple[DraftBatch, VerifyBatch, AcceptResult, CommitBatch, DraftExtendBatch]:
    d = prepare_for_draft(_running(), SpecContext(k=2, next_tokens=[3, 4], kv_locs=list(range(80, 86))))
    v = prepare_for_verify(d, proposed(d, [11, 12, 21, 22]))
    r = accept(v, verified(v, frozen_i64([11, 0, 0, 21, 22, 23])))
    c = commit(v, r)
    return d, v, r, c, prepare_for_draft_extend(c)


def corpus() -> list[object]:
    b = _extend()
    running = _running()
    decoded = prepare_for_decode(b, DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4]))
    mixed = mix_with_running(b, running)
    d, v, r, c, de = _spec_chain()
    return [
        request(1, 2, [5, 6], 10),
        b,
        running,
        decoded,
        mixed,
        lower(b, LCTX),
        lower(running, LCTX),
        lower(mixed, LCTX),
        DecodeContext(next_tokens=[1], kv_locs=[2]),
        SpecContext(k=1, next_tokens=[1], kv_locs=[2, 3]),
        d, v, r, c, de,
        lower(d, LCTX), lower(v, LCTX), lower(c, LCTX), lower(de, LCTX),
        merge_batch(running, b),
        filter_batch(b, [RequestId(10)]),
    ]


CORPUS_IDS = [
    "request", "extend", "decode", "prepare_for_decode", "mixed", "extend-plan", "decode-plan", "mixed-plan",
    "decode-context", "spec-context", "draft", "verify", "accept", "commit", "draft-extend",
    "draft-plan", "verify-plan", "commit-plan", "draft-extend-plan", "merge_batch", "filter_batch",
]


@pytest.mark.parametrize("index", range(len(CORPUS_IDS)), ids=CORPUS_IDS)
def test_every_column_is_ir_owned_and_cannot_be_made_writeable(index: int) -> None:
    assert_immutable(corpus()[index])


@pytest.mark.parametrize("index", range(len(CORPUS_IDS)), ids=CORPUS_IDS)
@pytest.mark.parametrize("clone", ["pickle", "deepcopy"])
def test_pickled_and_deep_copied_columns_stay_immutable(index: int, clone: str) -> None:
    node = corpus()[index]
    out = pickle.loads(pickle.dumps(node)) if clone == "pickle" else copy.deepcopy(node)
    assert type(out) is type(node)
    assert out == node
    assert_immutable(out)
    for (where, a), (_, b) in zip(columns(node), columns(out), strict=True):
        assert not np.shares_memory(a, b), f"{where}: a {clone} clone shares the original's memory"


def test_shallow_copy_shares_the_immutable_columns() -> None:
    b = _extend()
    c = copy.copy(b)
    assert c == b and c.rids is b.rids and c.input_ids is b.input_ids


def test_pickle_keeps_the_init_serial_and_the_checks() -> None:
    """A clone is the same forward (the ledger's replay check relies on it) and is checked again."""
    b = _extend()
    plan = lower(b, LCTX)
    clone = pickle.loads(pickle.dumps(plan))
    assert [t.serial for t in clone.tickets] == [t.serial for t in plan.tickets]
    verify(clone)


def test_numpy_alone_would_unpickle_writeable_arrays() -> None:
    """The reason nodes define ``__reduce__``: a bare column does not survive a round trip read-only."""
    col = _extend().rids
    assert pickle.loads(pickle.dumps(col)).flags.writeable
    assert copy.deepcopy(col).flags.writeable


# -- caller-owned memory is copied ------------------------------------------------------------------


def _read_only_view_of_bytearray(values: list[int]) -> tuple[bytearray, np.ndarray[Any, Any]]:
    buf = bytearray(np.asarray(values, dtype=np.int64).tobytes())
    arr = np.frombuffer(buf, dtype=np.int64)
    arr.flags.writeable = False  # read-only, and its base chain has no writeable array: only the bytearray
    return buf, arr


def test_frombuffer_bytearray_input_is_copied() -> None:
    buf, arr = _read_only_view_of_bytearray([5, 6])
    r = AdmittedRequest(rid=RequestId(1), slot=MambaSlot(2), input_ids=arr, kv_locs=[10, 11], intent=Clear())
    buf[:8] = (99).to_bytes(8, "little")
    assert arr.tolist() == [99, 6]  # the caller's array did change ...
    assert r.input_ids.tolist() == [5, 6]  # ... the node did not
    assert not np.shares_memory(r.input_ids, arr)


def test_frombuffer_bytearray_bool_column_is_copied() -> None:
    buf = bytearray(b"\x00")
    flags = np.frombuffer(buf, dtype=np.bool_)
    flags.flags.writeable = False
    b = ExtendBatch(
        rids=[1], slots=[2], prefix_lens=[3], extend_lens=[1], more_chunks=flags, intents=(InitIntent.CONTINUE,),
        input_ids=[5], kv_locs=[10], init=None,
    )
    buf[0] = 1
    assert b.more_chunks.tolist() == [False]
    assert_immutable(b)


@pytest.mark.parametrize("how", ["numpy-view", "tensor"])
def test_torch_tensor_input_is_copied(how: str) -> None:
    t = torch.tensor([20, 21], dtype=torch.int64)
    if how == "numpy-view":
        given: Any = t.numpy()
        given.flags.writeable = False  # a read-only view whose memory the tensor still owns
    else:
        given = t
    d = DecodeBatch(rids=[1, 2], slots=[1, 2], seq_lens=[4, 4], input_ids=[7, 7], kv_locs=given)
    t[0] = 99
    assert d.kv_locs.tolist() == [20, 21]
    assert_immutable(d)


def test_read_only_view_of_a_writeable_array_is_copied() -> None:
    owner = np.array([1, 2, 3], dtype=np.int64)
    view = owner[:]
    view.flags.writeable = False
    d = DecodeContext(next_tokens=view, kv_locs=[4, 5, 6])
    owner[0] = 99
    assert d.next_tokens.tolist() == [1, 2, 3]


def test_a_plain_read_only_array_is_copied() -> None:
    """``flags.writeable = False`` on an array owning its memory can be undone: not IR-owned."""
    arr = np.array([1, 2], dtype=np.int64)
    arr.flags.writeable = False
    d = DecodeContext(next_tokens=arr, kv_locs=[4, 5])
    arr.flags.writeable = True
    arr[0] = 99
    assert d.next_tokens.tolist() == [1, 2]


# -- sharing without copies, where the code relies on it -------------------------------------------


def test_plans_share_their_batch_columns() -> None:
    b = _extend()
    p = lower(b, LCTX)
    assert isinstance(p, ExtendPlan)
    for name in ("rids", "slots", "prefix_lens", "extend_lens", "more_chunks", "input_ids", "kv_locs"):
        assert getattr(p, name) is getattr(b, name), name
    running = _running()
    dp = lower(running, LCTX)
    assert isinstance(dp, DecodePlan)
    assert dp.rids is running.rids and dp.kv_locs is running.kv_locs
    mixed = mix_with_running(b, running)
    mp = lower(mixed, LCTX)
    assert isinstance(mixed, MixedBatch) and isinstance(mp, MixedPlan)
    assert mp.extend.input_ids is b.input_ids and mp.decode.seq_lens is running.seq_lens


def test_passes_pass_columns_through_without_copies() -> None:
    running = _running()
    ctx = DecodeContext(next_tokens=[1, 2], kv_locs=[3, 4])
    d = prepare_for_decode(running, ctx)
    assert d.rids is running.rids and d.slots is running.slots
    assert d.input_ids is ctx.next_tokens and d.kv_locs is ctx.kv_locs
    draft, v, r, c, _ = _spec_chain()
    assert v.rids is draft.rids and v.kv_locs is draft.kv_locs
    assert c.accept_pos is r.accepted and c.input_ids is v.input_ids


def test_ir_owned_arrays_cross_constructors_uncopied() -> None:
    b = _running()
    again = DecodeBatch(rids=b.rids, slots=b.slots, seq_lens=b.seq_lens, input_ids=b.input_ids, kv_locs=b.kv_locs)
    assert again.rids is b.rids and again.kv_locs is b.kv_locs
    assert attrs.evolve(b, seq_lens=b.seq_lens).slots is b.slots
    view = b.kv_locs[1:]  # a view of an IR-owned column is IR-owned too
    assert DecodeContext(next_tokens=b.input_ids[1:], kv_locs=view).kv_locs is view
    kv = KVAllocator(8).alloc_many(2)
    toks = frozen_i64([5, 6])
    ctx = DecodeContext(next_tokens=toks, kv_locs=kv)
    assert ctx.kv_locs is kv and ctx.next_tokens is toks
    assert frozen_i64(toks) is toks


def test_freeze_and_frozen_i64_make_unflippable_copies() -> None:
    fresh_arr = np.arange(4, dtype=np.int64)
    for out in (freeze(fresh_arr), frozen_i64(fresh_arr), frozen_i64([1, 2, 3]), SlotAllocator(4).alloc_many(2)):
        assert is_owned(out) and not np.shares_memory(out, fresh_arr)
        with pytest.raises(ValueError):
            out.flags.writeable = True


# -- level-1 verification: a COW never reads a row the same forward writes --------------------------


def _cow_from_live_slot() -> ExtendBatch:
    # request 1 continues in slot 1; request 2 copies slot 1 as its "checkpoint" in the same forward
    return prepare_for_extend(
        [
            request(1, 1, [5], 10, intent=Continue(prefix_len=3)),
            request(2, 2, [6, 7], 11, intent=CopyFrom(src=MambaSlot(1), prefix_len=3)),
        ]
    )


def test_plan_verification_refuses_a_cow_from_a_live_slot() -> None:
    """``BATCHC_VERIFY=1`` verifies only the lowered plan of each step: the check must be there."""
    plan = lower(_cow_from_live_slot(), LCTX)
    with pytest.raises(IRVerificationError, match=r"ExtendPlan\.tickets\[0\]\.op\.cow_src\[0\]: cow src 1 is the live slot"):
        verify(plan)


def test_mixed_verification_refuses_a_cow_from_a_decode_row() -> None:
    extend = prepare_for_extend([request(7, 2, [6, 7], 11, intent=CopyFrom(src=MambaSlot(4), prefix_len=3))])
    mixed = mix_with_running(extend, _running())  # the running request in slot 4 decodes in this forward
    with pytest.raises(IRVerificationError, match=r"MixedBatch\.extend\.init\.cow_src\[0\]: COW src 4 .*decode part"):
        verify(mixed)
    with pytest.raises(IRVerificationError, match=r"MixedPlan\.extend\.tickets\[0\]\.op\.cow_src\[0\]: cow src 4 .*decode part"):
        verify(lower(mixed, LCTX))


def test_default_pipeline_refuses_a_cow_from_a_live_slot() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, LCTX, PassManager(verify_level=1))
    with pytest.raises(PassError, match="cow src 1 is the live slot") as info:
        pipe.prefill(
            [
                request(1, 1, [5], 10, intent=Continue(prefix_len=3)),
                request(2, 2, [6, 7], 11, intent=CopyFrom(src=MambaSlot(1), prefix_len=3)),
            ]
        )
    assert isinstance(info.value.error, IRVerificationError)
    assert ledger.outstanding() == ()
