"""The default ``backend.boundary.Transport``: every pool's ``Executor`` in this process.

Each forward runs within ``submit``, on the caller's thread; there is nothing to start, settle or
stop. The serving hooks are kept here, so that ``share_prefix`` reaches every model's token table.

``InProcess(pipelined=True)`` (``PIPELINED_IN_PROCESS``) marks the backends ``concurrent``, so the
engine runs its k = 0 steps pipelined in this process as it does over executor processes
(``compiler.engine.forwards.Forwards.run_pipelined``): step N + 1 is built and submitted before
step N is read back, its input tokens named by N's sample (``DecodePlan.inputs_from``) and resolved
by the executor from the tokens N left per slot, and N's tokens, finished requests and prefix-cache
entries are landed after. Each plan still runs within ``submit`` (nothing here is asynchronous), so
the order of the engine's operations and every ledger and exactly-once check are those of the
pipelined engine; on a CUDA device ``submit`` does not yet return before the device has finished.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from backend.allocator import SlotAllocator
from backend.boundary import InProcessGroup
from backend.counts import token_counts
from backend.executor import Executor
from backend.hidden_store import HiddenStore
from backend.ledger import Ledger
from backend.model import HeadHook, ReadsTargetHidden, ServedModel, ServingModelHook
from ir.ids import PoolId

__all__ = ["IN_PROCESS", "PIPELINED_IN_PROCESS", "InProcess", "LocalBackends"]


class LocalBackends(InProcessGroup):
    """``backend.boundary.Backends`` in this process."""

    def __init__(self, executors: list[Executor[Any]], hooks: list[ServingModelHook[Any] | HeadHook], *, pipelined: bool = False) -> None:
        super().__init__(executors)
        self._hooks = hooks
        self._pipelined = pipelined

    @property
    def concurrent(self) -> bool:
        """True for ``InProcess(pipelined=True)``'s backends (the engine then pipelines its k = 0
        steps; see the module), else False."""
        return self._pipelined

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Every served model's token table: slot ``dst``'s first ``length`` KV locations become ``src``'s."""
        for hook in self._hooks:
            hook.share_prefix(src, dst, length)

    def cancel_outstanding(self, reason: str) -> None:
        """Nothing to cancel: in process, the engine's ledger is the only one."""
        pass  # (the engine's ledger is the only one)

    def close(self) -> None:
        """Nothing to stop; returns None (no group of ranks to report on)."""
        pass


class InProcess:
    """Every pool's executor in this process (``LocalBackends``); ``pipelined``: the engine builds
    each k = 0 step before reading the previous one back (the module)."""

    def __init__(self, *, pipelined: bool = False) -> None:
        self.pipelined = pipelined

    def __repr__(self) -> str:
        return "InProcess(pipelined=True)" if self.pipelined else "InProcess()"

    def refusal(self, models: Mapping[PoolId, ServedModel[Any]], *, retries: int) -> str | None:
        """Never refuses: every model can be served in this process."""
        return None

    def open(
        self, models: Mapping[PoolId, ServedModel[Any]], *, ledger: Ledger, slots: SlotAllocator, capacity: int, kv_capacity: int,
        max_len: int, retries: int, penalties: bool = False,
    ) -> LocalBackends:
        """One ``Executor`` per pool of ``models``, each with a fresh pool and serving hook, sharing the
        engine's ``ledger`` and slot allocator (transactional when ``retries > 0``; token counts on the
        target's when ``penalties``; one hidden-state store when a draft head is served)."""
        executors: list[Executor[Any]] = []
        hooks: list[ServingModelHook[Any] | HeadHook] = []
        # a draft head reads the target's hidden states: both executors share one store
        heads = any(isinstance(m, ReadsTargetHidden) and m.reads_target_hidden() for m in models.values())
        hidden = HiddenStore() if heads else None
        for pool, model in models.items():
            hook = model.serving_hook(capacity=capacity, kv_capacity=kv_capacity, max_len=max_len)
            hooks.append(hook)
            # with retries, each forward is one transactional unit that can simply run again
            state = model.new_pool(capacity, pool_id=pool)
            executors.append(Executor(
                state, ledger, hook, slots=slots, transactional=retries > 0, counts=token_counts(state, model.vocab) if penalties else None,
                hidden=hidden,
            ))
        return LocalBackends(executors, hooks, pipelined=self.pipelined)


IN_PROCESS: Final = InProcess()
"""The engine's default transport."""
PIPELINED_IN_PROCESS: Final = InProcess(pipelined=True)
"""In this process, with the engine's k = 0 steps pipelined (the module)."""
