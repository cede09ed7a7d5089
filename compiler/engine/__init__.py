"""The serving engine (``Engine``) and what it reports; see ``compiler.engine.engine``."""

from compiler.engine.api import ServingEngine
from compiler.engine.engine import Engine
from compiler.engine.report import PrefixState, SpecStats, StepKind, StepReport
from compiler.engine.requests import RequestState
from compiler.engine.runner import StepFailed

__all__ = ["PrefixState", "Engine", "RequestState", "ServingEngine", "SpecStats", "StepFailed", "StepKind", "StepReport"]
