"""The serving engine (``Engine``) and what it reports; see ``compiler.engine.engine``."""

from compiler.engine.api import ServingEngine
from compiler.engine.config import ServeConfig
from compiler.engine.engine import Engine
from compiler.engine.policy import ALTERNATE, DEFAULT_POLICY, PrefillFirst, QueueState, SchedulePolicy, prefill_first
from compiler.engine.report import PrefixState, SpecStats, StepKind, StepReport
from compiler.engine.requests import RequestState
from compiler.engine.runner import StepFailed

__all__ = [
    "ALTERNATE", "DEFAULT_POLICY", "Engine", "PrefillFirst", "PrefixState", "QueueState", "RequestState", "SchedulePolicy", "ServeConfig", "ServingEngine",
    "SpecStats", "StepFailed", "StepKind", "StepReport", "prefill_first",
]
