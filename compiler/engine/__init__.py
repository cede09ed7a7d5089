"""The serving engine (``Engine``) and what it reports; see ``compiler.engine.engine``.

The names below load on first use (PEP 562), so that importing a torch-free submodule such as
``compiler.engine.config`` (``ServeConfig``, which ``batchc serve``'s HTTP process reads) does not
load the engine and torch with it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from compiler.engine.api import ServingEngine
    from compiler.engine.config import ServeConfig
    from compiler.engine.engine import Engine
    from compiler.engine.policy import ALTERNATE, DEFAULT_POLICY, PrefillFirst, QueueState, SchedulePolicy, prefill_first
    from compiler.engine.report import PrefixState, SpecStats, StepKind, StepReport
    from compiler.engine.requests import RequestState
    from compiler.engine.runner import StepFailed

_WHERE = {
    "ServingEngine": "api", "ServeConfig": "config", "Engine": "engine", "ALTERNATE": "policy", "DEFAULT_POLICY": "policy",
    "PrefillFirst": "policy", "QueueState": "policy", "SchedulePolicy": "policy", "prefill_first": "policy", "PrefixState": "report",
    "SpecStats": "report", "StepKind": "report", "StepReport": "report", "RequestState": "requests", "StepFailed": "runner",
}

__all__ = [
    "ALTERNATE", "DEFAULT_POLICY", "Engine", "PrefillFirst", "PrefixState", "QueueState", "RequestState", "SchedulePolicy", "ServeConfig", "ServingEngine",
    "SpecStats", "StepFailed", "StepKind", "StepReport", "prefill_first",
]


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'compiler.engine' has no attribute {name!r}")
    value = vars(importlib.import_module(f"compiler.engine.{where}"))[name]
    globals()[name] = value  # (looked up once)
    return value
