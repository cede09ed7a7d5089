"""The in-place mutation detector (on at BATCHC_VERIFY=2, which the suite uses): writes to the pool
from outside the executor, and model hooks writing their staged inputs, are reported by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from backend.model import blank_logits
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.errors import MutationError
from ir.ids import TARGET_POOL
from ir.plan import ExtendPlan
from passes import DecodeContext, LowerContext
from tests.helpers import LAYOUT, fresh


class _Hook:
    def __init__(self, scribble: str | None = None) -> None:
        self.scribble = scribble

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor:
        if self.scribble == "input_ids" and extend is not None:
            extend.input_ids.add_(1)
        if self.scribble == "packed" and decode is not None:
            decode.packed.zero_()
        if self.scribble == "quiet" and extend is not None:
            extend.input_ids.data.add_(1)  # like a Triton store: the version counter does not move
        if self.scribble == "column" and isinstance(plan, ExtendPlan):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is read-only
                torch.from_numpy(plan.input_ids)[0] += 1
        return blank_logits(extend, decode)


def _world(hook: _Hook) -> tuple[Executor, MambaStatePool, Pipeline]:
    ledger = Ledger()
    pool = MambaStatePool(TARGET_POOL, LAYOUT, 8)
    return Executor(pool, ledger, hook, watch=True), pool, Pipeline(ledger, LowerContext(), PassManager(verify_level=2))


def test_pool_written_between_plans_is_reported() -> None:
    ex, pool, pipe = _world(_Hook())
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    ex.execute(plan)
    pool.buffer[1].fill_(3)  # someone else's in-place write
    _, dplan = pipe.decode(extend, DecodeContext(next_tokens=[5], kv_locs=[3]))
    with pytest.raises(MutationError, match=r"pool 'target' was written outside the executor since its last plan \(version"):
        ex.execute(dplan)


def test_write_that_does_not_bump_the_version_is_caught_by_the_fingerprint() -> None:
    ex, pool, pipe = _world(_Hook())
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    ex.execute(plan)
    pool.buffer.data[1].fill_(9)  # like a Triton store: the version counter does not move
    _, dplan = pipe.decode(extend, DecodeContext(next_tokens=[5], kv_locs=[3]))
    with pytest.raises(MutationError, match="contents changed, version unchanged"):
        ex.execute(dplan)


def test_declared_write_is_accepted() -> None:
    ex, pool, pipe = _world(_Hook())
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    ex.execute(plan)
    pool.buffer[1].fill_(3)
    ex.adopt_pool_contents()
    _, dplan = pipe.decode(extend, DecodeContext(next_tokens=[5], kv_locs=[3]))
    ex.execute(dplan)


@pytest.mark.parametrize(("field", "kind"), [("input_ids", "StagedExtend.input_ids"), ("packed", "StagedDecode.packed")])
def test_model_hook_writing_its_staged_inputs_is_reported(field: str, kind: str) -> None:
    ex, _, pipe = _world(_Hook(field))
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    _, dplan = pipe.decode(extend, DecodeContext(next_tokens=[5], kv_locs=[3]))
    target = plan if field == "input_ids" else dplan
    if field == "packed":
        Executor(ex.pool, ex.ledger, _Hook()).execute(plan)
    with pytest.raises(MutationError, match=rf"the model hook wrote the staged tensor {kind} in place"):
        ex.execute(target)


@pytest.mark.parametrize("how", ["swap", "plus-minus"])
def test_writes_that_keep_the_bytes_sum_are_caught(how: str) -> None:
    """A row swap, or +d in one row and -d in another, keeps every column sum: the stamp sees them."""
    ex, pool, pipe = _world(_Hook())
    extend, plan = pipe.prefill([fresh(1, 1, [1, 2], 1), fresh(2, 2, [3], 5)])
    ex.execute(plan)
    pool.buffer.data[3].fill_(7)
    ex.adopt_pool_contents()
    rows = pool.buffer.data
    if how == "swap":
        first = rows[3].clone()
        rows[3].copy_(rows[1])
        rows[1].copy_(first)
    else:
        rows[3, 0] += 1
        rows[4, 0] -= 1
    _, dplan = pipe.decode(extend, DecodeContext(next_tokens=[5, 6], kv_locs=[3, 6]))
    with pytest.raises(MutationError, match="contents changed, version unchanged"):
        ex.execute(dplan)


def test_staged_inputs_are_compared_by_content() -> None:
    ex, _, pipe = _world(_Hook("quiet"))
    _, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    with pytest.raises(MutationError, match=r"the model hook wrote the staged tensor StagedExtend.input_ids in place"):
        ex.execute(plan)


def test_plan_columns_are_checked_after_the_hook() -> None:
    ex, _, pipe = _world(_Hook("column"))
    _, plan = pipe.prefill([fresh(1, 1, [1, 2], 1)])
    with pytest.raises(MutationError, match=r"the model hook changed the plan column ExtendPlan.input_ids"):
        ex.execute(plan)
