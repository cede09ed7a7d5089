"""Prefix-cache snapshots inside a chunk (``MambaSnapshot.at``): the forward captures the Mamba state
at the snapshot point and the snapshot op copies that capture into the cache slot, so the chunk is
not cut there.

End to end through the executor and the model hook, on the bundled hybrid model (attention and
Mamba layers) and on the random Hugging Face checkpoints (Bamba, GraniteMoeHybrid, Nemotron-H): the
cache slot holds the state of a forward that stopped at the snapshot point (to 1e-5: not bit for
bit, see ``tests/backend/kernels/test_kernel_capture.py``), a request that starts from it by COW
continues as the uncut prompt does, and the snapshotting request's own state is that of a forward
without the snapshot. Then the IR: the field's checks, text and wire forms, and the passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from backend.executor import Executor
from backend.hf import load_hf
from backend.hybrid import HybridModel
from backend.hybrid.checkpoint import default_target
from backend.hybrid.hook import HybridHook
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.errors import IRValidationError, IRVerificationError, PlanExecutionError
from ir.ids import TARGET_POOL, MambaSlot, RequestId
from ir.init import MambaSnapshot, mint_serial
from ir.parse import parse
from ir.plan import ExtendPlan
from ir.printer import dump
from ir.request import AdmittedRequest, Clear, CopyFrom
from ir.results import Sampled
from ir.verify import verify
from ir.wire import pack, unpack
from passes import LowerContext, filter_batch, prepare_for_extend
from tests.backend.hf.builders import FAMILY_NAMES, save_hf_model
from tests.helpers import LAYOUT, fresh

PROMPT = [5, 17, 33, 8, 60, 3, 44, 29, 12, 7, 71, 25, 38, 19, 4, 55, 63, 30, 9, 21, 48, 66, 2, 13]
OTHER = [11, 80, 6, 42, 27, 3, 66, 14, 39, 1]  # token ids below the random checkpoints' vocabulary (96)
CACHE = 7  # the cache slot
TOL = 1e-5


def _request(rid: int, slot: int, tokens: list[int], kv: int, *, snapshot_at: int | None = None, more: bool = False) -> AdmittedRequest:
    return AdmittedRequest(
        rid=RequestId(rid), slot=MambaSlot(slot), input_ids=tokens, kv_locs=list(range(kv, kv + len(tokens))), intent=Clear(),
        snapshot_to=MambaSlot(CACHE) if snapshot_at is not None else None, snapshot_at=snapshot_at, more_chunks=more,
    )


class _World:
    """One model behind an executor, with its hook's KV cache and token table."""

    def __init__(self, model: HybridModel) -> None:
        self.ledger = Ledger()
        self.pool: MambaStatePool = model.new_pool(8)
        self.hook: HybridHook = model.serving_hook(capacity=8, kv_capacity=256, max_len=64)
        self.executor = Executor(self.pool, self.ledger, self.hook)
        self.pipe = Pipeline(self.ledger, LowerContext(), PassManager(verify_level=2))

    def prefill(self, requests: list[AdmittedRequest]) -> list[int]:
        """The forward's greedy tokens, one per request."""
        _, plan = self.pipe.prefill(requests)
        out = self.executor.execute(plan)
        assert isinstance(out, Sampled)
        return [int(t) for t in out.tokens.tolist()]

    def row(self, slot: int) -> torch.Tensor:
        return self.pool.buffer[slot].view(torch.float32)


def _models() -> list[Any]:
    return ["bundled", *FAMILY_NAMES]


@pytest.fixture(scope="module", params=_models())
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HybridModel:
    name = str(request.param)
    if name == "bundled":
        return default_target()
    d: Path = tmp_path_factory.mktemp(name)
    save_hf_model(name, d, seed=3)
    loaded: HybridModel = load_hf(d).model
    return loaded


@pytest.mark.parametrize("at", [1, 9, 16, 23])
def test_the_cache_slot_holds_the_state_of_a_forward_that_stopped_there(model: HybridModel, at: int) -> None:
    cut = _World(model)
    cut.prefill([_request(1, 1, PROMPT, 1, snapshot_at=at), _request(2, 2, OTHER, 100)])
    stopped = _World(model)
    stopped.prefill([_request(1, 1, PROMPT[:at], 1, more=True), _request(2, 2, OTHER, 100)])
    torch.testing.assert_close(cut.row(CACHE), stopped.row(1), atol=TOL, rtol=TOL)
    whole = _World(model)
    whole.prefill([_request(1, 1, PROMPT, 1), _request(2, 2, OTHER, 100)])
    torch.testing.assert_close(cut.row(1), whole.row(1), atol=TOL, rtol=TOL)  # the request's own state
    torch.testing.assert_close(cut.row(2), whole.row(2), atol=TOL, rtol=TOL)
    cut.ledger.assert_drained()


def test_a_request_continued_from_an_inner_snapshot_equals_the_uncut_prompt(model: HybridModel) -> None:
    """A COW from the cache slot plus the token table's prefix (the engine's prefix sharing): the
    next request's greedy tokens and its state are those of one uncut prefill."""
    at = 11
    w = _World(model)
    w.prefill([_request(1, 1, PROMPT, 1, snapshot_at=at)])
    w.hook.share_prefix(1, CACHE, at)  # the cache entry's KV: the request's first `at` locations
    w.hook.share_prefix(CACHE, 3, at)
    cow = AdmittedRequest(
        rid=RequestId(3), slot=MambaSlot(3), input_ids=PROMPT[at:], kv_locs=list(range(60, 60 + len(PROMPT) - at)),
        intent=CopyFrom(src=MambaSlot(CACHE), prefix_len=at),
    )
    continued = w.prefill([cow])
    ref = _World(model)
    uncut = ref.prefill([_request(1, 1, PROMPT, 1)])
    assert continued == uncut
    torch.testing.assert_close(w.row(3), ref.row(1), atol=TOL, rtol=TOL)


def test_a_hook_that_captures_nothing_cannot_take_an_inner_snapshot() -> None:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    pipe = Pipeline(ledger, LowerContext(), PassManager(verify_level=2))
    _, plan = pipe.prefill([_request(1, 1, [3, 4, 5], 1, snapshot_at=2)])
    before = pool.copy_buffer()
    with pytest.raises(PlanExecutionError, match=r"snapshot #\d+ is taken inside a chunk, and the model hook NoOpModel captures no"):
        Executor(pool, ledger).execute(plan)
    assert torch.equal(pool.buffer, before)
    assert len(ledger.outstanding()) == 2  # the init and the snapshot ticket, both still to consume
    # at the chunk's end the snapshot copies the row the forward left, whatever the hook
    _, plan = pipe.prefill([_request(2, 2, [3, 4, 5], 10, snapshot_at=3)])
    assert plan.snapshots[0].op.at == ()
    Executor(pool, ledger).execute(plan)


# -- the IR --------------------------------------------------------------------------------------


def test_prepare_records_the_positions_only_when_one_is_inside_its_chunk() -> None:
    at_end = prepare_for_extend([_request(1, 1, [3, 4, 5], 1, snapshot_at=3), fresh(2, 2, [6], 10)])
    assert at_end.snapshot is not None and at_end.snapshot.at == ()
    inner = prepare_for_extend([_request(1, 1, [3, 4, 5], 1, snapshot_at=2), fresh(2, 2, [6], 10)])
    assert inner.snapshot is not None and inner.snapshot.at == (2,)
    assert "  snapshot #2 [s1->s3] at[2]\n" in dump(inner)
    assert parse(dump(inner, exact=True)) == inner


def test_filter_keeps_the_positions_with_their_snapshots() -> None:
    a = AdmittedRequest(
        rid=RequestId(1), slot=MambaSlot(1), input_ids=[3, 4, 5], kv_locs=[1, 2, 3], intent=Clear(), snapshot_to=MambaSlot(6), snapshot_at=2,
    )
    b = AdmittedRequest(
        rid=RequestId(2), slot=MambaSlot(2), input_ids=[6, 7], kv_locs=[4, 5], intent=Clear(), snapshot_to=MambaSlot(7),
    )
    batch = prepare_for_extend([a, b])
    assert batch.snapshot is not None and batch.snapshot.at == (2, 2)
    kept = filter_batch(batch, [RequestId(1)]).snapshot
    assert kept is not None and kept.src == (2,) and kept.dst == (7,) and kept.at == (2,)
    kept = filter_batch(batch, [RequestId(2)]).snapshot
    assert kept is not None and kept.src == (1,) and kept.at == (2,)


def test_a_position_past_its_chunk_is_a_verification_error() -> None:
    batch = prepare_for_extend([_request(1, 1, [3, 4, 5], 1, snapshot_at=2)])
    assert batch.snapshot is not None
    bad = MambaSnapshot(serial=batch.snapshot.serial, src=batch.snapshot.src, dst=batch.snapshot.dst, at=(4,))
    with pytest.raises(IRVerificationError, match=r"snapshot\.at\[0\].*extend_len 3"):
        verify(attrs.evolve(batch, snapshot=bad))


@pytest.mark.parametrize(("at", "message"), [((0,), "at least one token"), ((2, 3), "length must be 0"), ((True,), "at")])
def test_a_snapshot_refuses_bad_positions(at: tuple[Any, ...], message: str) -> None:
    with pytest.raises(IRValidationError, match=message):
        MambaSnapshot(serial=mint_serial(), src=(1,), dst=(2,), at=at)


@pytest.mark.parametrize(("at", "more"), [(0, False), (4, False)])
def test_a_request_refuses_a_position_outside_its_chunk(at: int, more: bool) -> None:
    with pytest.raises(IRValidationError, match="snapshot_at"):
        _request(1, 1, [3, 4, 5], 1, snapshot_at=at, more=more)
    with pytest.raises(IRValidationError, match="snapshot_at"):
        AdmittedRequest(rid=RequestId(1), slot=MambaSlot(1), input_ids=[3], kv_locs=[1], intent=Clear(), snapshot_at=1)


def test_the_wire_carries_the_positions() -> None:
    ledger = Ledger()
    pipe = Pipeline(ledger, LowerContext(), PassManager(verify_level=2))
    _, plan = pipe.prefill([_request(1, 1, [3, 4, 5], 1, snapshot_at=2)])
    msg = unpack(pack(7, plan))
    assert msg.plan == plan
    assert isinstance(msg.plan, ExtendPlan) and msg.plan.snapshots[0].op.at == (2,)
    assert np.array_equal(msg.plan.slots, [1])
