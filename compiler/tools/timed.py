"""Model time of a serving run: ``TimedModel`` adds the wall time of every forward to a running
total, so a run's host time (wall minus model time) can be told apart from the model's work. The
benchmarks and ``batchc run`` measure every engine, compiled and mutable, through it.

Sampler time: within ``timing_sampler()``, every call an in-process executor (``backend.executor``)
makes to the sampler (``backend.plan_sampling``'s ``sample_logits`` after a prefill or decode,
``verify_tokens`` after a verify) adds its wall time to the clock it yields. Those calls are made
by the executor after the forward, outside ``TimedModel``'s timer, so model and sampler time never
overlap. Executors in other processes (``--overlap``) are not timed. On leaving, the executor's
own functions are back in place, whatever happened.

Replay: a ``Tape`` given to the timed models of a run (``recording``) keeps what every forward
returned, in call order; a second run of the same case with the same tape (``replaying``) gets each
forward's output back from it instead of computing it, so what that run spends is the engine's own
host work with the models' caches never evicted (``batchc bench serve --replay``). The verify
states a forward returns go to the tape as ``NO_STATES`` (the commits that read them are replayed
too; a run whose host code read them would diverge, and ``Tape.check_done`` with the output
comparison of the caller says so). A replayed forward of another entry point than recorded, or of
inputs of other shapes, raises ``ReplayDiverged`` (an engine may take it for a failed forward and
abort its requests; ``Tape.check_done`` raises it again)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from backend.hybrid.head import HeadModel
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.pool import MambaStatePool

Call = tuple[str, tuple[tuple[str, object], ...]]
"""A forward as a tape knows it: the entry point's name and the shape (a tensor's) or value (an int's)
of each keyword argument, by name."""


NO_STATES = VerifyStates(conv=(), ssm=())
"""What a tape keeps of a forward's verify states (``Tape``): they are only ever handed back to the
model's commit, which a replay does not run either."""


class ReplayDiverged(RuntimeError):
    """A replayed run asked the models for something else than the recorded run did."""


class Tape:
    """What the timed models of one run returned, forward by forward (module docstring): filled while
    ``recording``, read back in the same order while ``replaying``."""

    def __init__(self) -> None:
        self.calls: list[tuple[Call, object]] = []
        self.replaying = False
        self.at = 0
        self.diverged: ReplayDiverged | None = None
        """The first divergence ``next`` found (an engine may take it for a failed forward, retry and
        abort its requests; ``check_done`` raises it all the same)."""

    def record(self, call: Call, out: object) -> None:
        self.calls.append((call, _slim(out)))

    def next(self, call: Call) -> object:
        """The output recorded for the next forward, which must be ``call`` (the same entry point,
        with inputs of the same shapes)."""
        n, (name, shapes) = self.at + 1, call
        if self.at >= len(self.calls):
            raise self._diverged(f"forward {n} ({name}) was never recorded: the recorded run made {len(self.calls)}")
        recorded, out = self.calls[self.at]
        if recorded[0] != name:
            raise self._diverged(f"forward {n} calls {name}, the recorded run's called {recorded[0]}")
        if recorded[1] != shapes:
            raise self._diverged(f"forward {n} ({name}) takes {_words(shapes)}; the recorded run's took {_words(recorded[1])}")
        self.at += 1
        return out

    def _diverged(self, why: str) -> ReplayDiverged:
        exc = ReplayDiverged(why)
        if self.diverged is None:
            self.diverged = exc
        return exc

    def check_done(self) -> None:
        """The replay never diverged and replayed every recorded forward (else ``ReplayDiverged``)."""
        if self.diverged is not None:
            raise self.diverged
        if self.at != len(self.calls):
            raise ReplayDiverged(f"the replayed run made {self.at} forwards, the recorded run {len(self.calls)}")


def _call(name: str, kwargs: dict[str, Any]) -> Call:
    return name, tuple(
        (key, tuple(v.shape) if isinstance(v, torch.Tensor) else v) for key, v in sorted(kwargs.items()) if isinstance(v, (torch.Tensor, int))
    )


def _words(shapes: tuple[tuple[str, object], ...]) -> str:
    return ", ".join(f"{key} {list(v) if isinstance(v, tuple) else v}" for key, v in shapes)


def _slim(out: object) -> object:
    """``out`` with its verify states replaced by ``NO_STATES`` (module docstring)."""
    if isinstance(out, VerifyOut):
        return VerifyOut(out.logits, out.hidden, NO_STATES)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], VerifyStates):
        return (out[0], NO_STATES)
    return out


class _Taped:
    """The clock and the tape the timed models share (``TimedModel``, ``TimedHead``)."""

    seconds: float
    tape: Tape | None

    def _timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, the model's entry point ``name``, timed (and taped)."""
        tape = self.tape
        t0 = time.perf_counter()
        try:
            if tape is not None and tape.replaying:
                return tape.next(_call(name, kwargs))
            out = fn(*args, **kwargs)
            if tape is not None:
                tape.record(_call(name, kwargs), out)
            return out
        finally:
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (torch leaves it unannotated) a CUDA forward is queued, not done: wait for it
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - t0


class TimedModel(_Taped, HybridModel):
    """A ``HybridModel`` (the same config and weights; a tensor-parallel shard stays one) that adds the wall time of each forward
    (extend, decode, mixed, verify, both proposals, commit) to ``seconds``, and records them on or replays them from ``tape``."""

    def __init__(self, model: HybridModel) -> None:
        super().__init__(model.config, model.weights, collective=model.collective, norm_split=model.norm_split, origin=model.origin)
        self.seconds = 0.0
        self.tape = None

    def extend(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        out: ForwardOut = self._timed("extend", super().extend, pool, kv, table, **kw)
        return out

    def decode(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: torch.Tensor) -> ForwardOut:
        out: ForwardOut = self._timed("decode", super().decode, pool, kv, table, **kw)
        return out

    def mixed(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        out: ForwardOut = self._timed("mixed", super().mixed, pool, kv, table, **kw)
        return out

    def verify(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: torch.Tensor) -> VerifyOut:
        out: VerifyOut = self._timed("verify", super().verify, pool, kv, table, **kw)
        return out

    def propose(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> torch.Tensor:
        out: torch.Tensor = self._timed("propose", super().propose, pool, kv, table, **kw)
        return out

    def propose_keeping_states(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> tuple[torch.Tensor, VerifyStates]:
        out: tuple[torch.Tensor, VerifyStates] = self._timed("propose_keeping_states", super().propose_keeping_states, pool, kv, table, **kw)
        return out

    def commit(self, pool: MambaStatePool, states: VerifyStates, **kw: torch.Tensor) -> None:
        self._timed("commit", super().commit, pool, states, **kw)


@contextlib.contextmanager
def recording(models: Sequence[TimedModel | TimedHead | None], tape: Tape) -> Iterator[Tape]:
    """Within the block, every forward of ``models`` is recorded on ``tape``; each model's own tape
    is back on leaving."""
    with _taped(models, tape):
        yield tape


@contextlib.contextmanager
def replaying(models: Sequence[TimedModel | TimedHead | None], tape: Tape) -> Iterator[Tape]:
    """Within the block, every forward of ``models`` returns the next output of ``tape`` (recorded
    by ``recording``), from its first, computing nothing; ``check_done`` after the block says
    whether every one was used."""
    tape.at, tape.replaying, tape.diverged = 0, True, None
    try:
        with _taped(models, tape):
            yield tape
    finally:
        tape.replaying = False


@contextlib.contextmanager
def _taped(models: Sequence[TimedModel | TimedHead | None], tape: Tape) -> Iterator[None]:
    present = [m for m in models if m is not None]
    before = [m.tape for m in present]
    for m in present:
        m.tape = tape
    try:
        yield
    finally:
        for m, old in zip(present, before, strict=True):
            m.tape = old


def timed(model: HybridModel) -> TimedModel:
    """``model`` itself when it is already timed, else a ``TimedModel`` of it."""
    return model if isinstance(model, TimedModel) else TimedModel(model)


class TimedHead(_Taped, HeadModel):
    """A draft head (the same config and weights, bound to the same target) that adds the wall time
    of each of its forwards (extend, which is also its commit, and propose) to ``seconds``, and
    records them on or replays them from ``tape``."""

    def __init__(self, head: HeadModel) -> None:
        super().__init__(head.config, head.weights, head.target)
        self.seconds = 0.0
        self.tape = None

    def extend(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> ForwardOut:  # tensors and the captures
        out: ForwardOut = self._timed("extend", super().extend, pool, kv, table, **kw)
        return out

    def propose(self, pool: MambaStatePool, kv: KVCache, table: TokenTable, **kw: Any) -> torch.Tensor:
        out: torch.Tensor = self._timed("propose", super().propose, pool, kv, table, **kw)
        return out


def timed_draft(model: HybridModel | HeadModel) -> TimedModel | TimedHead:
    """A timed copy of a draft of either kind (a separate model or a head), or the draft itself if
    it is timed already."""
    if isinstance(model, (TimedModel, TimedHead)):
        return model
    return TimedHead(model) if isinstance(model, HeadModel) else TimedModel(model)


SAMPLER_CALLS = ("sample_logits", "verify_tokens")
"""The sampler functions ``backend.executor`` calls by these names, as ``backend.plan_sampling`` defines them."""


@attrs.define
class SamplerClock:
    """Wall seconds spent in the sampler calls of in-process executors (``timing_sampler``)."""

    seconds: float = 0.0


def _timed_call(fn: Callable[..., Any], clock: SamplerClock) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # (torch leaves it unannotated) the sampler's kernels are queued, not done
                torch.cuda.synchronize()
            clock.seconds += time.perf_counter() - t0

    return call


@contextlib.contextmanager
def timing_sampler() -> Iterator[SamplerClock]:
    """A clock of the sampler calls in-process executors make while the block runs (module
    docstring). Refused (``RuntimeError``) inside another one, or if the executor no longer calls
    ``backend.plan_sampling``'s functions under these names (the clock would read 0)."""
    import backend.executor as executor
    import backend.plan_sampling as plan_sampling

    # (module namespaces, read and swapped by name: the executor's module-level names of the sampler)
    calls, names = vars(plan_sampling), vars(executor)
    originals = {name: calls[name] for name in SAMPLER_CALLS}
    for name, fn in originals.items():
        if names.get(name) is not fn:
            raise RuntimeError(f"backend.executor.{name} is not backend.plan_sampling.{name} (already timed, or no longer called so)")
    clock = SamplerClock()
    try:
        for name, fn in originals.items():
            names[name] = _timed_call(fn, clock)
        yield clock
    finally:
        for name, fn in originals.items():
            names[name] = fn
