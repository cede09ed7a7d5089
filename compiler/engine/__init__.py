"""The serving engine (``Engine``) and what it reports; see ``compiler.engine.engine``."""

from compiler.engine.api import ServingEngine
from compiler.engine.engine import Engine
from compiler.engine.report import Checkpoint, SpecStats, StepKind, StepReport
from compiler.engine.requests import RequestState
from compiler.engine.runner import StepFailed

__all__ = ["Checkpoint", "Engine", "RequestState", "ServingEngine", "SpecStats", "StepFailed", "StepKind", "StepReport"]
