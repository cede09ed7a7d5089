"""Where a forward's time goes: named parts of the model's code, timed only while a ``PartClock`` runs.

The model code marks its parts with the constants below (``with MAMBA: ...``): the embedding, the
norms and residual adds between layers, each kind of layer (Mamba mixer, attention mixer, MLP), the
Mamba state pool's gathers and scatters inside the torch kernels, the KV cache's writes and reads,
the LM head, and the entry point's own code (``FORWARD``: argument checks, token-table writes, index
preparation). ``batchc bench decode`` reads them to split a decode step (``compiler.tools.bench_decode``).

No clock runs unless one is started (``timing_parts``): entering and leaving a part then reads one
module-level name and returns, a fraction of a microsecond, which is why the marks stay in the
serving code. While a clock runs:

- a part's time is its own (exclusive): the wall time from entering to leaving it, less the time of
  the parts entered inside it. The parts of one forward, ``FORWARD`` outermost, therefore add up to
  the forward's wall time, up to the clock's own reads (a few hundred nanoseconds per part, which
  fall to the part around them);
- on a CUDA device (``PartClock(synchronize=torch.cuda.synchronize)``) every part boundary waits for
  the device, so a part's time is its kernels' and not the launch's; that changes what it measures
  (no overlap between parts), which is why the clock is a profiling mode and not always on.

On a CPU, torch runs every op in the calling thread before returning (its intra-op threads join
before the op returns), so the wall time between two boundaries is the work of the ops between them.

One clock runs at a time per process (``timing_parts`` refuses a second); the clock is not thread
safe: parts entered from another thread while it runs would interleave on its stack (serving calls
the model from one thread).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Final, ParamSpec, TypeVar

__all__ = [
    "ATTENTION", "EMBED", "FORWARD", "KV", "LM_HEAD", "MAMBA", "MLP", "NORMS", "PARTS", "STATE", "Part", "PartClock", "running_clock",
    "timing_parts",
]


class PartClock:
    """Exclusive wall seconds and entries per part name, accumulated while it runs (``timing_parts``).

    ``synchronize``: called at every part boundary before the clock is read (``torch.cuda.synchronize``
    on a CUDA device; ``None`` on a CPU, where ops finish before they return)."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        """Exclusive seconds per part name (entered at least once)."""
        self.calls: dict[str, int] = {}
        """Times each part was entered."""
        self.synchronize = synchronize
        self._stack: list[list[float]] = []  # per open part: [start, seconds of the parts inside it]

    def reset(self) -> None:
        """Forget every part's time and count (between two measured steps); parts still open are
        kept open and report their time from now on."""
        self.seconds.clear()
        self.calls.clear()
        now = self._now()
        for frame in self._stack:
            frame[0], frame[1] = now, 0.0

    def total(self) -> float:
        """Seconds of every part together."""
        return sum(self.seconds.values())

    def _now(self) -> float:
        if self.synchronize is not None:
            self.synchronize()
        return time.perf_counter()

    def enter(self) -> None:
        """A part begins (``Part.__enter__`` calls it)."""
        self._stack.append([self._now(), 0.0])

    def leave(self, name: str) -> None:
        """The part ``name`` that began last ends (``Part.__exit__`` calls it); a leave without an
        enter (the clock started inside a part) is ignored."""
        if not self._stack:
            return
        start, inner = self._stack.pop()
        spent = self._now() - start
        self.seconds[name] = self.seconds.get(name, 0.0) + spent - inner
        self.calls[name] = self.calls.get(name, 0) + 1
        if self._stack:
            self._stack[-1][1] += spent


_running: PartClock | None = None
_P = ParamSpec("_P")
_R = TypeVar("_R")


def running_clock() -> PartClock | None:
    """The clock that runs now, or ``None`` (the serving default)."""
    return _running


class Part:
    """A named part of the model's code: ``with PART: ...`` times the block on the running clock, if
    any (module docstring), and ``@PART`` on a function times each of its calls. Parts are module
    constants, shared by every model and thread."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        given: object = name  # typed str; checked because callers need not be typed
        if not isinstance(given, str) or not given:
            raise ValueError(f"a part's name must be a non-empty str, got {name!r}")
        self.name: Final = name

    def __enter__(self) -> None:
        clock = _running
        if clock is not None:
            clock.enter()

    def __exit__(self, *exc: object) -> None:
        clock = _running
        if clock is not None:
            clock.leave(self.name)

    def __call__(self, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        """``fn``, every call of it inside this part (a decorator)."""

        @functools.wraps(fn)
        def within(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self:
                return fn(*args, **kwargs)

        return within

    def __repr__(self) -> str:
        return f"Part({self.name!r})"


FORWARD: Final = Part("forward, other")
"""A forward entry point's own code, outside the parts below: argument checks, token-table writes,
index preparation (the outermost part of a forward)."""
EMBED: Final = Part("embedding")
"""The token embedding lookup (and its scale)."""
NORMS: Final = Part("norms and residuals")
"""The layer stack's own code: every layer's RMSNorms and residual adds."""
MAMBA: Final = Part("mamba mixer")
"""A Mamba layer's mixer: in_proj, the causal conv, the selective scan, the gated norm, out_proj
(without the state pool's gathers and scatters, ``STATE``)."""
STATE: Final = Part("state pool gathers and scatters")
"""The torch kernels' copies of the Mamba state between the pool and their working tensors."""
ATTENTION: Final = Part("attention mixer")
"""An attention layer's mixer: q/k/v projections, rotary, the attention itself, o_proj (without the
KV cache's writes and reads, ``KV``)."""
KV: Final = Part("kv cache writes and reads")
"""The KV cache's writes of new keys and values and the gathers of a row's context through the token table."""
MLP: Final = Part("mlp")
"""An MLP (a layer's after its mixer, or an MLP-only layer's)."""
LM_HEAD: Final = Part("lm head")
"""The final norm, the LM head's projection and the logit scale."""

PARTS: Final = (FORWARD, EMBED, NORMS, MAMBA, STATE, ATTENTION, KV, MLP, LM_HEAD)
"""Every part the model code marks, outermost first."""


@contextlib.contextmanager
def timing_parts(clock: PartClock | None = None) -> Iterator[PartClock]:
    """Run ``clock`` (a fresh one by default) while the block runs: every part entered meanwhile adds
    its exclusive time to it. Refused (``RuntimeError``) while another clock runs."""
    global _running
    if _running is not None:
        raise RuntimeError("a part clock already runs (timing_parts does not nest)")
    clock = PartClock() if clock is None else clock
    _running = clock
    try:
        yield clock
    finally:
        _running = None
