"""Linear-use markers the plugin (ir.mypy_linear) cannot honour: it must say so on each line."""

from __future__ import annotations

from ir.linear import consumes, consumes_on
from ir.plan import ExtendPlan


@consumes  # type: ignore[linear-mark]  # a module-level function: mypy's cache would drop the mark
def run(plan: ExtendPlan) -> None: ...


class Runner:
    @consumes_on("pool")  # type: ignore[linear-mark]  # no parameter of that name
    def run(self, ex: object, plan: ExtendPlan) -> None: ...
