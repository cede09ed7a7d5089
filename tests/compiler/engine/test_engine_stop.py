"""An exception escaping a step that is not a failed forward stops the engine: the exception
propagates once, and every later ``step`` or ``admit`` is refused with ``EngineStoppedError`` naming
it, so an engine whose bookkeeping may be half done never serves on with resources it cannot
account for."""

from __future__ import annotations

from typing import Any

import pytest

from backend.hybrid.config import tiny
from backend.hybrid.model import HybridModel
from compiler.engine import Engine
from ir.errors import EngineStoppedError
from ir.ids import RequestId


def _driver() -> Engine:
    target = HybridModel.from_seed(tiny(), seed=0)
    drv = Engine(target, None, k=0, capacity=4, kv_capacity=128, max_len=32)
    drv.admit(RequestId(1), list(b"abc"), max_new_tokens=3)
    drv.admit(RequestId(2), list(b"de"), max_new_tokens=2)
    return drv


def test_a_step_that_raises_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    drv = _driver()
    assert drv.step().kind.value == "extend"
    real = drv.pipeline.pm.run

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device: the IR dump")

    monkeypatch.setattr(drv.pipeline.pm, "run", failing)
    with pytest.raises(OSError, match="No space left"):
        drv.step()
    monkeypatch.setattr(drv.pipeline.pm, "run", real)  # the cause is gone, the engine stays stopped
    for refused in (drv.step, lambda: drv.admit(RequestId(3), list(b"x"), max_new_tokens=1)):
        with pytest.raises(EngineStoppedError, match=r"engine stopped: an earlier step raised OSError\('No space left"):
            refused()


def test_a_failed_forward_does_not_stop_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that fails is handled (its requests are aborted) and serving goes on."""
    drv = _driver()
    real = drv.target.execute
    calls = {"n": 0}

    def flaky(plan: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("kernel fault")
        return real(plan)

    monkeypatch.setattr(drv.target, "execute", flaky)
    assert drv.step().kind.value == "failed"
    drv.admit(RequestId(3), list(b"xy"), max_new_tokens=2)
    drv.run_until_done()
    assert sorted(drv.outputs) == [1, 2, 3] and drv.outputs[1] == [] and len(drv.outputs[3]) == 2


def test_a_model_hook_calling_back_into_the_engine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``abort`` from inside a forward (a hook calling back) would free a slot the step is still
    using; it is refused with a typed error, which stops the engine instead of corrupting it."""
    from ir.errors import PreconditionError

    drv = _driver()
    real = drv.target.execute

    def reentrant(plan: Any) -> Any:
        drv.abort(RequestId(1))
        return real(plan)

    monkeypatch.setattr(drv.target, "execute", reentrant)
    with pytest.raises(PreconditionError, match=r"engine: called from inside a step \(a model hook\?\)"):
        drv.step()
    assert drv.live == 2 and drv.outputs == {}  # the abort did not happen
    with pytest.raises(EngineStoppedError):
        drv.abort(RequestId(1))
