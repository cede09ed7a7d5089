"""The in-place mutation detector (on at BATCHC_VERIFY=2, which the suite uses): writes to the pool
from outside the executor, and model hooks writing their staged inputs, are reported by name."""

from __future__ import annotations

import pytest
import torch

from backend.executor import Executor
from backend.ledger import Ledger
from backend.pool import MambaStatePool
from backend.staging import StagedDecode, StagedExtend
from compiler.manager import PassManager
from compiler.steps import Pipeline
from ir.errors import MutationError
from ir.ids import TARGET_POOL
from passes import DecodeContext, LowerContext
from tests.core import LAYOUT, fresh


class _Hook:
    def __init__(self, scribble: str | None = None) -> None:
        self.scribble = scribble

    def forward(self, plan: object, extend: StagedExtend | None, decode: StagedDecode | None, pool: MambaStatePool) -> torch.Tensor | None:
        if self.scribble == "input_ids" and extend is not None:
            extend.input_ids.add_(1)
        if self.scribble == "packed" and decode is not None:
            decode.packed.zero_()
        return None


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
