"""A ticket-carrying value stored where it outlives the step (the upstream bug's shape: deferred init
ops kept on a long-lived object): the plugin (ir.mypy_linear) must reject each line."""

from __future__ import annotations

from dataclasses import dataclass

import attrs

from ir.init import InitTicket
from ir.plan import ExtendPlan

PENDING: list[ExtendPlan] = []


class Batch:
    def __init__(self, plan: ExtendPlan) -> None:
        self.deferred = plan  # type: ignore[linear-escape]  # stashed on self

    def defer(self, plan: ExtendPlan, table: dict[int, ExtendPlan]) -> None:
        PENDING.append(plan)  # type: ignore[linear-escape]  # a module-level list
        table[0] = plan  # type: ignore[linear-escape]  # the caller's container
        self.deferred = plan  # type: ignore[linear-escape]  # stashed again


def keep_on(batch: Batch, plan: ExtendPlan) -> None:
    batch.deferred = plan  # type: ignore[linear-escape]  # on another long-lived object


@dataclass
class Step:
    plan: ExtendPlan  # type: ignore[linear-escape]  # a dataclass field of a class that is not @linear


@attrs.frozen
class Deferred:
    tickets: tuple[InitTicket, ...]  # type: ignore[linear-escape]  # nor an attrs field
