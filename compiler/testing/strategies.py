"""Hypothesis strategies for batchc's IR: a valid node of every kind, and valid sequences of scheduler steps.

Every strategy here draws nodes that are valid by construction: they pass their constructors' local
checks and the whole-node verifier (``ir.verify.verify`` for batches and plans), and they round-trip
through the text form (``ir.printer.dump`` / ``ir.parse.parse``) and the wire form (``ir.wire``).
Valid means what the passes produce, not merely what the checks accept: a prefill's ``MambaInit``
clears exactly its ``CLEAR`` rows and copies into exactly its ``COW`` rows, from cache slots that no
row of the forward runs in; a ``CLEAR`` row starts at prefix 0; a lowered plan carries one ticket
per pool (at least one pool) for each op it has, init and snapshot alike; a commit releases exactly
the KV locations of its rejected positions; the two parts of a mixed node share no request, slot or
KV location. Batch sizes are drawn first and shrink towards ``min_rows``, so a failing example
shrinks to a small batch.

- One function per node kind, each returning a ``SearchStrategy`` of that class: ``extend_batches()``,
  ``decode_batches()``, ``mixed_batches()``, ``idle_batches()``, their plans (``extend_plans()`` ...),
  the speculative phases (``draft_batches()``, ``verify_batches()``, ``commit_batches()``,
  ``draft_commit_batches()``, ``draft_extend_batches()`` and their plans), a draft head's
  (``head_extend_batches()`` ...), the one-shot ops (``mamba_inits()``, ``mamba_snapshots()``,
  ``tickets()``), ``admitted_requests()``, ``accept_results()`` and ``sampling_rows(rows)``.
- ``NODE_STRATEGIES``: the default strategy of every kind the printer prints, by class name;
  ``strategy_for(cls)`` looks one up by class.
- ``step_sequences()``: scheduler-like sequences of steps (``Prefill``, ``Mixed``, ``Decode``,
  ``Finish``, ``Speculate``) over a small slot space: new requests that start fresh or copy a cached
  prefix (COW from a slot an earlier prefill snapshotted into), chunked prefills continued in later
  steps, decodes, speculative iterations, finished requests leaving the running batch.
  ``compiler.testing.runner.run_steps`` runs one through a ``compiler.steps.Pipeline``.

Arguments are checked when a strategy is built, not when it is drawn from: an impossible shape
(``min_rows > max_rows``, a negative size, a pool name that is not a ``str``, a smallest batch of
more than ``MAX_MIN_BATCH`` values) raises ``ValueError`` or ``TypeError`` at once, one line naming
the function, the argument and the value. Every size the checks accept is drawn under hypothesis's
default health checks: request ids, slots and KV locations are distinct by construction (nothing is
filtered), and a batch's sampling rows repeat at most eight distinct ones, so a batch of
``MAX_ROWS`` rows fits the few kilobytes hypothesis draws one example from.

This module imports hypothesis, numpy, attrs and ``ir`` only (never torch), so pass-level tests
that use it do not load torch.
"""

from __future__ import annotations

import bisect
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar, assert_never, cast, get_origin

import attrs
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from ir import spec
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import MAX_SEQ_LEN
from ir.errors import short_repr
from ir.head import HeadCommitBatch, HeadCommitPlan, HeadExtendBatch, HeadExtendPlan
from ir.ids import DraftId, HiddenId, MambaSlot, PoolId, RequestId, SampleId, TicketSerial, VerifyId
from ir.init import OP_TYPES, InitIntent, MambaInit, MambaSnapshot, Op, Ticket
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.printer import PRINTABLE
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.sampling import SamplingRows

__all__ = [
    "MAX_EXTEND",
    "MAX_MIN_BATCH",
    "MAX_MIN_STEPS",
    "MAX_ROWS",
    "SEQUENCE_VALUES",
    "NODE_STRATEGIES",
    "POOL_NAMES",
    "ROW_VALUES",
    "SPEC_ROW_VALUES",
    "Decode",
    "Finish",
    "Mixed",
    "Prefill",
    "Speculate",
    "Step",
    "StepSequence",
    "accept_results",
    "admitted_requests",
    "commit_batches",
    "commit_plans",
    "decode_batches",
    "decode_plans",
    "draft_batches",
    "draft_commit_batches",
    "draft_commit_plans",
    "draft_extend_batches",
    "draft_extend_plans",
    "draft_plans",
    "extend_batches",
    "extend_plans",
    "head_commit_batches",
    "head_commit_plans",
    "head_extend_batches",
    "head_extend_plans",
    "idle_batches",
    "idle_plans",
    "mamba_inits",
    "mamba_snapshots",
    "mixed_batches",
    "mixed_plans",
    "sampling_rows",
    "step_sequences",
    "strategy_for",
    "tickets",
    "verify_batches",
    "verify_plans",
]

N = TypeVar("N")

if TYPE_CHECKING:
    _Draw: TypeAlias = st.DrawFn
else:  # a run-time checker (typeguard) cannot check hypothesis's DrawFn protocol (its ``__signature__``): any callable
    _Draw = Callable[..., Any]

POOL_NAMES: Final[tuple[str, ...]] = ("target", "draft", "a pool", 'q"uote', "ümlaut")
"""The pool names a plan's tickets are drawn from by default: plain ones and ones the text form must quote."""

MAX_ROWS: Final = 256
"""The largest ``max_rows`` any strategy takes (a batch of more rows is no better a test, only slower)."""
MAX_EXTEND: Final = 64
"""The largest ``max_extend`` (tokens of one prefill row)."""
MAX_MIN_BATCH: Final = 1024
"""The largest smallest batch a strategy may be asked for, in values drawn: ``min_rows * (max_extend
+ ROW_VALUES)`` for a prefill's rows (a token and a KV location per position, and the row's own
fields) or ``min_rows * (max_k + SPEC_ROW_VALUES)`` for a speculative phase's. Hypothesis draws an
example from a budget of a few kilobytes; a larger forced batch would not fit it (measured: twice
these sizes fail its health checks, these pass), and the strategy refuses it when it is built
rather than failing every draw."""
ROW_VALUES: Final = 4
"""A prefill row's own share of ``MAX_MIN_BATCH`` besides its tokens."""
SPEC_ROW_VALUES: Final = 6
"""A speculative row's own share of ``MAX_MIN_BATCH`` besides its ``k`` drafts."""
SEQUENCE_VALUES: Final = 3072
"""About the most values one ``step_sequences`` example draws: a step is drawn only while its largest
form fits what the steps before it left (a sequence ends early once none does)."""
MAX_MIN_STEPS: Final = 100
"""The largest ``min_steps`` of ``step_sequences`` (a sequence forced to twice as many steps failed
hypothesis's health checks)."""

_SLOT_MAX = 10_000
_KV_MAX = 1_000_000
_PREFIX_MAX = 5_000
_SERIALS = st.integers(1, 2**62)
_RID_MIN, _RID_MAX = -(2**40), 2**40
_RIDS = st.integers(_RID_MIN, _RID_MAX)
_TOKENS = st.integers(0, 2**31)
_SLOTS = st.integers(1, _SLOT_MAX)
_INTENTS = st.sampled_from(list(InitIntent))  # (CLEAR first: an intent shrinks to a clear)


# -- argument checks (at call time) ----------------------------------------------------------------


def _int_arg(fn: str, name: str, value: object, minimum: int, maximum: int) -> int:
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an int, got {short_repr(value)} ({type(value).__name__})")
    v = int(value)
    if not minimum <= v <= maximum:
        raise ValueError(f"{fn}: {name} must be in [{minimum}, {maximum}], got {v}")
    return v


def _rows_arg(fn: str, min_rows: object, max_rows: object, floor: int) -> tuple[int, int]:
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    lo = _int_arg(fn, "min_rows", min_rows, floor, MAX_ROWS)
    hi = _int_arg(fn, "max_rows", max_rows, floor, MAX_ROWS)
    if lo > hi:
        raise ValueError(f"{fn}: min_rows={lo} > max_rows={hi}")
    return lo, hi


def _extend_args(fn: str, min_rows: object, max_rows: object, max_extend: object, floor: int) -> tuple[int, int, int]:
    """Rows and ``max_extend`` of a prefill-shaped strategy, within ``MAX_MIN_BATCH``."""
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    lo, hi = _rows_arg(fn, min_rows, max_rows, floor)
    most = _int_arg(fn, "max_extend", max_extend, 1, MAX_EXTEND)
    if lo * (most + ROW_VALUES) > MAX_MIN_BATCH:
        raise ValueError(f"{fn}: min_rows={lo} rows of up to max_extend={most} tokens may not fit one hypothesis example "
                         f"(min_rows * (max_extend + {ROW_VALUES}) must be at most {MAX_MIN_BATCH}; lower either)")
    return lo, hi, most


def _bool_arg(fn: str, name: str, value: object) -> bool:
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {short_repr(value)} ({type(value).__name__})")
    return value


def _pools_arg(fn: str, pools: object) -> tuple[str, ...]:
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    if isinstance(pools, (str, bytes)) or not isinstance(pools, Sequence):
        raise TypeError(f"{fn}: pools must be a sequence of pool names (str), got {short_repr(pools)} ({type(pools).__name__})")
    names = tuple(pools)
    if not names:
        raise ValueError(f"{fn}: pools must name at least one pool, got {short_repr(pools)}")
    for i, p in enumerate(names):
        if not isinstance(p, str):
            raise TypeError(f"{fn}: pools[{i}] must be a pool name (str), got {short_repr(p)} ({type(p).__name__})")
        if not p:
            raise ValueError(f"{fn}: pools[{i}] must be a non-empty pool name, got ''")
    seen: set[str] = set()
    for p in names:
        if p in seen:
            raise ValueError(f"{fn}: pools must be distinct, got {p!r} twice")
        seen.add(p)
    return names


# -- drawing helpers -----------------------------------------------------------------------------


def _n(elements: st.SearchStrategy[N], n: int) -> st.SearchStrategy[list[N]]:
    return st.lists(elements, min_size=n, max_size=n)


@attrs.define
class _Taken:
    """Request ids, slots and KV locations already used in the forward being drawn (its parts share none)."""

    rids: set[int] = attrs.Factory(set)
    slots: set[int] = attrs.Factory(set)
    kv: set[int] = attrs.Factory(set)


_GAP_MAX = 1 << 16


def _fresh(draw: _Draw, lo: int, hi: int, n: int, taken: set[int]) -> list[int]:
    """``n`` distinct values in ``[lo, hi]`` not in ``taken``, which then holds them too: distinct by
    construction, nothing filtered or redrawn (hypothesis favours a few values, so independent draws
    collide often, and a batch of many rows would be rejected more often than drawn). A first value,
    gaps of at least 1 to the next ones, counted over the values not taken, then maybe a shuffle
    (from one drawn seed: any order, for a few bytes of hypothesis's budget). Shrinks to consecutive
    values in order, from the value nearest 0."""
    if n == 0:
        return []
    blocked = sorted(v for v in taken if lo <= v <= hi)
    free = hi - lo + 1 - len(blocked)
    if free < n:  # (the callers' ranges are far wider than the most values a strategy asks for)
        raise ValueError(f"only {free} values in [{lo}, {hi}] are left for {n}")
    seed = draw(st.none() | st.integers(0, 2**32 - 1)) if n > 1 else None  # (first: the gaps' count varies as a batch shrinks)
    gap = max(1, min(_GAP_MAX, (free - 1) // max(1, n - 1)))
    first = draw(st.integers(lo, lo + free - 1 - (n - 1) * gap))
    gaps = draw(st.lists(st.integers(1, gap), min_size=n - 1, max_size=n - 1)) if n > 1 else []
    values = [first]
    for g in gaps:
        values.append(values[-1] + g)
    out = []
    j = 0  # blocked values at or below the value being placed (values ascend, so one pass over blocked)
    for v in values:  # v - lo: how many values not taken come before it
        while j < len(blocked) and blocked[j] <= v + j:
            j += 1
        out.append(v + j)
    if seed is not None:
        order = np.random.default_rng(seed).permutation(n)
        out = [out[i] for i in order]
    taken.update(out)
    return out


def _serials(draw: _Draw, n: int) -> list[TicketSerial]:
    """``n`` distinct serials (a forward's init and snapshot are two ops, each its own serial)."""
    return [TicketSerial(s) for s in draw(st.lists(_SERIALS, min_size=n, max_size=n, unique=True))]


def _sampling(draw: _Draw, n: int) -> SamplingRows | None:
    return draw(st.none() | sampling_rows(n))


_SAMPLING_KINDS = 8
"""At most this many distinct rows of sampling parameters in one batch; a larger batch repeats them."""
_SAMPLING_COLUMNS = (
    "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "index", "logprobs",
    "ban_until",
)


@st.composite
def _sampling_row(draw: _Draw) -> dict[str, Any]:
    """One row's parameters, by ``SamplingRows`` column (``banned``: its banned tokens)."""

    def floats(lo: float, hi: float) -> float:
        return draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False))

    return {
        "temperature": floats(0.0, 4.0), "top_k": draw(st.integers(-1, 100)), "top_p": floats(0.01, 1.0), "min_p": floats(0.0, 1.0),
        "presence_penalty": floats(-2.0, 2.0), "frequency_penalty": floats(-2.0, 2.0), "repetition_penalty": floats(0.1, 4.0),
        "seed": draw(st.integers(0, 2**63 - 1)), "index": draw(st.integers(0, 15)), "logprobs": draw(st.integers(-1, 20)),
        "ban_until": draw(st.integers(0, 5000)), "banned": draw(st.lists(st.integers(0, 2**31), max_size=3)),
    }


@st.composite
def _sampling_rows(draw: _Draw, n: int) -> SamplingRows:
    """Up to ``_SAMPLING_KINDS`` distinct rows, each drawn whole; each of ``n`` rows is one of them
    (row ``i`` is kind ``i`` up to that many rows). A row costs hypothesis's budget a few dozen bytes,
    so drawing every row of a large batch afresh would overrun it; a kind index costs one."""
    kinds = draw(_n(_sampling_row(), min(n, _SAMPLING_KINDS)))
    picks = list(range(n)) if n <= _SAMPLING_KINDS else draw(_n(st.integers(0, _SAMPLING_KINDS - 1), n))
    rows = [kinds[i] for i in picks]
    columns = {name: [r[name] for r in rows] for name in _SAMPLING_COLUMNS}
    return SamplingRows(**columns, banned_lens=[len(r["banned"]) for r in rows], banned=[t for r in rows for t in r["banned"]])


def sampling_rows(rows: int) -> st.SearchStrategy[SamplingRows]:
    """``rows`` rows of sampling parameters, each within ``SamplingRows``' ranges (sampled and greedy
    rows, logprobs, min-token bans)."""
    return _sampling_rows(_int_arg("sampling_rows", "rows", rows, 0, MAX_ROWS))


@attrs.frozen
class _Chunk:
    """One prefill forward's extend rows and their one-shot ops, valid as a whole."""

    rids: list[int]
    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    more_chunks: list[bool]
    input_ids: list[int]
    kv_locs: list[int]
    intents: tuple[InitIntent, ...]
    init: MambaInit | None
    snapshot: MambaSnapshot | None

    def columns(self) -> dict[str, Any]:
        """The columns every extend-shaped node has."""
        return {
            "rids": self.rids, "slots": self.slots, "prefix_lens": self.prefix_lens, "extend_lens": self.extend_lens,
            "input_ids": self.input_ids, "kv_locs": self.kv_locs,
        }


@attrs.frozen
class _Row:
    """One row of a batch, drawn as a whole: a list of rows shrinks by dropping rows. The row
    strategies draw ``rid``, ``slot`` and each of ``kv`` as gaps (``_gaps``) from the value before
    (the previous row's, the previous location's); ``_draw_rows`` turns them into values."""

    rid: int
    slot: int
    kv: tuple[int, ...]
    tokens: tuple[int, ...]
    intent: InitIntent = InitIntent.CLEAR
    prefix: int = 0
    more: bool = False
    seq: int = 1
    accept: int = 0


_RID_GAP, _SLOT_GAP, _KV_GAP = 1 << 20, 8, 16
"""The largest gap between consecutive request ids, slots and KV locations of a batch: as many as
``MAX_ROWS`` rows (``MAX_EXTEND`` or ``k + 1 <= 65`` locations each) at these gaps span less than each
range, less the values a mixed forward's other part and cache slots take, so ``_placed`` never
comes round to a value twice."""


def _kv(n: int) -> st.SearchStrategy[tuple[int, ...]]:
    """``n`` KV-location gaps (``_draw_rows``)."""
    return st.lists(st.integers(1, _KV_GAP), min_size=n, max_size=n).map(tuple)


def _gaps() -> tuple[st.SearchStrategy[int], st.SearchStrategy[int]]:
    """A row's request-id and slot gaps (``_draw_rows``)."""
    return st.integers(1, _RID_GAP), st.integers(1, _SLOT_GAP)


@st.composite
def _prefill_row(draw: _Draw, max_extend: int) -> _Row:
    n = draw(st.integers(1, max_extend))
    intent = draw(_INTENTS)
    return _Row(
        rid=draw(_gaps()[0]), slot=draw(_gaps()[1]), tokens=tuple(draw(_n(_TOKENS, n))), kv=draw(_kv(n)), intent=intent,
        prefix=0 if intent is InitIntent.CLEAR else draw(st.integers(1, _PREFIX_MAX)), more=draw(st.booleans()),
    )


@st.composite
def _decode_row(draw: _Draw) -> _Row:
    rid, slot = _gaps()
    return _Row(rid=draw(rid), slot=draw(slot), seq=draw(st.integers(1, MAX_SEQ_LEN)), tokens=(draw(_TOKENS),), kv=draw(_kv(1)))


@st.composite
def _window_row(draw: _Draw, k: int, single: bool) -> _Row:
    return _Row(
        rid=draw(_gaps()[0]), slot=draw(_gaps()[1]), seq=draw(st.integers(1, 100_000)), tokens=tuple(draw(_n(_TOKENS, 1 if single else k + 1))),
        kv=draw(_kv(k + 1)), accept=draw(st.integers(0, k)),
    )


@st.composite
def _head_commit_row(draw: _Draw, k: int) -> _Row:
    accept = draw(st.integers(0, k))
    return _Row(
        rid=draw(_gaps()[0]), slot=draw(_gaps()[1]), prefix=draw(st.integers(0, 100_000)), accept=accept,
        tokens=tuple(draw(_n(_TOKENS, accept + 1))), kv=draw(_kv(accept + 1)),
    )


def _draw_rows(draw: _Draw, row: st.SearchStrategy[_Row], lo: int, hi: int, taken: _Taken) -> list[_Row]:
    """``lo`` to ``hi`` rows whose request ids, slots and KV locations are distinct and not in
    ``taken`` (which then holds them too), distinct by construction: nothing is filtered or redrawn
    (hypothesis favours a few values, so independently drawn ids collide often, and a batch of many
    rows would be rejected more often than drawn). Each kind of value starts at a value drawn from
    its whole range before the rows, and goes on by the gaps the rows drew, counted over the values
    not taken and wrapping past the range's end (``_placed``); then, maybe, the values are shuffled
    among the rows (one drawn seed). A row's choices are all its own, so dropping a row while
    shrinking leaves the others' valid. Shrinks to consecutive values in order, from 0 (or 1)."""
    starts = [draw(st.integers(_RID_MIN, _RID_MAX)), draw(st.integers(1, _SLOT_MAX)), draw(st.integers(0, _KV_MAX))]
    seed = draw(st.none() | st.integers(0, 2**32 - 1))
    rows = draw(st.lists(row, min_size=lo, max_size=hi))
    rids = _placed([r.rid for r in rows], starts[0], _RID_MIN, _RID_MAX, taken.rids)
    slots = _placed([r.slot for r in rows], starts[1], 1, _SLOT_MAX, taken.slots)
    kv = _placed([g for r in rows for g in r.kv], starts[2], 0, _KV_MAX, taken.kv)
    if seed is not None:
        rng = np.random.default_rng(seed)
        rids, slots, kv = ([values[i] for i in rng.permutation(len(values))] for values in (rids, slots, kv))
    locations = iter(kv)
    return [attrs.evolve(r, rid=rid, slot=slot, kv=tuple(next(locations) for _ in r.kv)) for r, rid, slot in zip(rows, rids, slots, strict=True)]


def _free(lo: int, hi: int, taken: set[int]) -> tuple[list[int], int]:
    """The taken values in ``[lo, hi]``, sorted, and how many values there are not taken."""
    blocked = sorted(v for v in taken if lo <= v <= hi)
    return blocked, hi - lo + 1 - len(blocked)


def _placed(gaps: list[int], start: int, lo: int, hi: int, taken: set[int]) -> list[int]:
    """Distinct values of ``[lo, hi]`` not in ``taken`` (which then holds them too), counted over
    the values not taken: the first at ``start`` (the next value not taken from it), each next one
    its gap further on (``gaps[0]`` is not used), wrapping past the range's end to its start. The
    gaps after the first sum to less than the values not taken (``_RID_GAP``...), so none comes
    round twice. ``start`` is drawn as a value of the range: it shrinks to 0 (or the range's least)."""
    blocked, free = _free(lo, hi, taken)
    index, indices = min(start - lo - bisect.bisect_left(blocked, start), free - 1), []
    for n, g in enumerate(gaps):
        index += g if n else 0
        indices.append(index % free)
    out = [0] * len(indices)
    j = 0
    for i in sorted(range(len(indices)), key=indices.__getitem__):  # ascending, so one pass over the taken values
        v = lo + indices[i]
        while j < len(blocked) and blocked[j] <= v + j:
            j += 1
        out[i] = v + j
    taken.update(out)
    return out


def _draw_chunk(draw: _Draw, lo: int, hi: int, max_extend: int, taken: _Taken) -> _Chunk:
    """``lo`` to ``hi`` prefill rows (intents drawn per row) with the ``MambaInit`` they ask for and,
    maybe, a snapshot of some of them into fresh cache slots (inside their chunk or at its end)."""
    rows = _draw_rows(draw, _prefill_row(max_extend), lo, hi, taken)
    n = len(rows)
    slots = [r.slot for r in rows]
    intents = tuple(r.intent for r in rows)
    cows = [r.slot for r in rows if r.intent is InitIntent.COW]
    clears = [r.slot for r in rows if r.intent is InitIntent.CLEAR]
    sources: list[int] = []
    if cows:  # cached-state slots, none a row of this forward; two rows may copy the same one
        cache = _fresh(draw, 1, _SLOT_MAX, draw(st.integers(1, min(2, len(cows)))), taken.slots)
        sources = [draw(st.sampled_from(cache)) for _ in cows]
    init_serial, snap_serial = _serials(draw, 2)
    init = MambaInit(serial=init_serial, clear_slots=clears, cow_src=sources, cow_dst=cows) if clears or cows else None
    snapshot = None
    if n and draw(st.booleans()):
        chosen = sorted(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
        dst = _fresh(draw, 1, _SLOT_MAX, len(chosen), taken.slots)
        at = [draw(st.integers(1, len(rows[j].tokens))) for j in chosen] if draw(st.booleans()) else []
        snapshot = MambaSnapshot(serial=snap_serial, src=[slots[j] for j in chosen], dst=dst, at=at)
    return _Chunk(
        rids=[r.rid for r in rows], slots=slots, prefix_lens=[r.prefix for r in rows], extend_lens=[len(r.tokens) for r in rows],
        more_chunks=[r.more for r in rows], input_ids=[t for r in rows for t in r.tokens], kv_locs=[v for r in rows for v in r.kv],
        intents=intents, init=init, snapshot=snapshot,
    )


def _draw_decode(draw: _Draw, lo: int, hi: int, taken: _Taken) -> dict[str, Any]:
    rows = _draw_rows(draw, _decode_row(), lo, hi, taken)
    return {
        "rids": [r.rid for r in rows],
        "slots": [r.slot for r in rows],
        "seq_lens": [r.seq for r in rows],
        "input_ids": [r.tokens[0] for r in rows],
        "kv_locs": [r.kv[0] for r in rows],
        "sampling": _sampling(draw, len(rows)),
    }


def _draw_window(draw: _Draw, lo: int, hi: int, max_k: int, *, single: bool) -> tuple[dict[str, Any], list[int]]:
    """A speculative phase's rows: ``k`` (in ``[1, max_k]``) and ``k + 1`` KV locations per row; one
    input token per row (``single``: a draft's pending token) or ``k + 1`` (the verified window).
    Also each row's accepted position (``0..k``), for the commits."""
    k = draw(st.integers(1, max_k))
    rows = _draw_rows(draw, _window_row(k, single), lo, hi, _Taken())
    cols = {
        "k": k,
        "rids": [r.rid for r in rows],
        "slots": [r.slot for r in rows],
        "seq_lens": [r.seq for r in rows],
        "input_ids": [t for r in rows for t in r.tokens],
        "kv_locs": [v for r in rows for v in r.kv],
        "sampling": _sampling(draw, len(rows)),
    }
    return cols, [r.accept for r in rows]


def _pools_of(draw: _Draw, pools: tuple[str, ...]) -> list[str]:
    """The pools a plan was lowered for: one or two of ``pools``."""
    return draw(st.lists(st.sampled_from(pools), min_size=1, max_size=min(2, len(pools)), unique=True))


def _tickets_of(chunk: _Chunk, names: list[str]) -> dict[str, Any]:
    """The chunk's ops as tickets, one per pool and op (what ``passes.lower`` gives a plan)."""
    init, snap = chunk.init, chunk.snapshot
    return {
        "tickets": tuple(Ticket(pool=PoolId(p), op=init) for p in names) if init is not None else (),
        "snapshots": tuple(Ticket(pool=PoolId(p), op=snap) for p in names) if snap is not None else (),
    }


# -- the one-shot ops and requests ----------------------------------------------------------------


@st.composite
def _mamba_inits(draw: _Draw) -> MambaInit:
    a, b = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if a + b == 0:
        a = 1
    slots = draw(st.lists(st.integers(1, _SLOT_MAX), min_size=a + 2 * b, max_size=a + 2 * b, unique=True))
    return MambaInit(serial=TicketSerial(draw(_SERIALS)), clear_slots=slots[:a], cow_src=slots[a : a + b], cow_dst=slots[a + b :])


def mamba_inits() -> st.SearchStrategy[MambaInit]:
    """A forward's init ops: up to 3 clears and up to 3 copies (at least one op), every slot distinct."""
    return _mamba_inits()


@st.composite
def _mamba_snapshots(draw: _Draw) -> MambaSnapshot:
    n = draw(st.integers(1, 3))
    slots = draw(st.lists(st.integers(1, _SLOT_MAX), min_size=2 * n, max_size=2 * n, unique=True))
    at = draw(_n(st.integers(1, 64), n)) if draw(st.booleans()) else []
    return MambaSnapshot(serial=TicketSerial(draw(_SERIALS)), src=slots[:n], dst=slots[n:], at=at)


def mamba_snapshots() -> st.SearchStrategy[MambaSnapshot]:
    """A forward's prefix-cache snapshots: 1 to 3, at their chunk's end or inside it (``at``)."""
    return _mamba_snapshots()


def tickets(*, pools: Sequence[str] = POOL_NAMES) -> st.SearchStrategy[Ticket[Op]]:
    """A ticket of any op kind (``ir.init.OP_TYPES``: each kind's strategy) for one of ``pools``."""
    names = _pools_arg("tickets", pools)
    ops = st.deferred(lambda: st.one_of(*(NODE_STRATEGIES[c.__name__] for c in OP_TYPES)))
    return st.builds(lambda p, op: Ticket(pool=PoolId(p), op=op), st.sampled_from(names), ops)


@st.composite
def _admitted(draw: _Draw, max_tokens: int) -> AdmittedRequest:
    slot = draw(_SLOTS)
    n = draw(st.integers(1, max_tokens))

    def other() -> MambaSlot:  # a slot other than the request's own (no filter: nothing rejected)
        s = draw(st.integers(1, _SLOT_MAX - 1))
        return MambaSlot(s + 1 if s >= slot else s)

    kind = draw(st.sampled_from((Clear, Continue, CopyFrom)))
    intent: Clear | Continue | CopyFrom = (
        Clear() if kind is Clear else Continue(prefix_len=draw(st.integers(1, _PREFIX_MAX))) if kind is Continue
        else CopyFrom(src=other(), prefix_len=draw(st.integers(1, _PREFIX_MAX)))
    )
    snap = other() if draw(st.booleans()) else None
    at = draw(st.none() | st.integers(1, n)) if snap is not None else None
    return AdmittedRequest(
        rid=RequestId(draw(_RIDS)), slot=MambaSlot(slot), input_ids=draw(_n(_TOKENS, n)),
        kv_locs=draw(st.lists(st.integers(0, _KV_MAX), min_size=n, max_size=n, unique=True)), intent=intent,
        more_chunks=draw(st.booleans()), snapshot_to=snap, snapshot_at=at,
    )


def admitted_requests(*, max_tokens: int = 6) -> st.SearchStrategy[AdmittedRequest]:
    """One admitted request of 1 to ``max_tokens`` tokens, of any intent, maybe snapshotting its state."""
    return _admitted(_int_arg("admitted_requests", "max_tokens", max_tokens, 1, MAX_EXTEND))


def _rid_of_result_row(row: tuple[int, int, int]) -> int:
    return row[0]


@st.composite
def _accept_results(draw: _Draw, lo: int, hi: int) -> spec.AcceptResult:
    rows = draw(st.lists(st.tuples(_RIDS, st.integers(0, 64), _TOKENS), min_size=lo, max_size=hi, unique_by=_rid_of_result_row))
    return spec.AcceptResult(
        verify_id=VerifyId(draw(_SERIALS)), rids=[r for r, _, _ in rows], accepted=[a for _, a, _ in rows], bonus=[b for _, _, b in rows]
    )


def accept_results(*, min_rows: int = 0, max_rows: int = 4) -> st.SearchStrategy[spec.AcceptResult]:
    """What ``passes.accept`` returns: the verify it judged (``verify_id``) and, per row (distinct
    request ids), the accepted drafts (0 to 64) and the bonus token."""
    return _accept_results(*_rows_arg("accept_results", min_rows, max_rows, 0))


# -- batches and plans of the target ----------------------------------------------------------------


@st.composite
def _extend_batches(draw: _Draw, lo: int, hi: int, max_extend: int) -> ExtendBatch:
    chunk = _draw_chunk(draw, lo, hi, max_extend, _Taken())
    return ExtendBatch(
        **chunk.columns(), more_chunks=chunk.more_chunks, intents=chunk.intents, init=chunk.init, snapshot=chunk.snapshot,
        sampling=_sampling(draw, len(chunk.rids)),
    )


def extend_batches(*, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6) -> st.SearchStrategy[ExtendBatch]:
    """Prefill batches of ``min_rows`` to ``max_rows`` rows of 1 to ``max_extend`` tokens each; every
    intent (clear, COW from a cache slot, continuation), maybe snapshots, maybe sampling rows."""
    lo, hi, most = _extend_args("extend_batches", min_rows, max_rows, max_extend, 1)
    return _extend_batches(lo, hi, most)


@st.composite
def _extend_plans(draw: _Draw, lo: int, hi: int, max_extend: int, pools: tuple[str, ...]) -> ExtendPlan:
    chunk = _draw_chunk(draw, lo, hi, max_extend, _Taken())
    return ExtendPlan(
        **chunk.columns(), more_chunks=chunk.more_chunks, **_tickets_of(chunk, _pools_of(draw, pools)),
        sample_id=draw(st.none() | _SERIALS.map(SampleId)), sampling=_sampling(draw, len(chunk.rids)),
        keep_hidden=draw(st.none() | _SERIALS.map(HiddenId)),
    )


def extend_plans(
    *, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6, pools: Sequence[str] = POOL_NAMES
) -> st.SearchStrategy[ExtendPlan]:
    """Lowered prefills (as ``extend_batches``): their ops as tickets for one or two of ``pools``,
    maybe a sample id, maybe keeping hidden states for a draft head."""
    lo, hi, most = _extend_args("extend_plans", min_rows, max_rows, max_extend, 1)
    return _extend_plans(lo, hi, most, _pools_arg("extend_plans", pools))


@st.composite
def _decode_batches(draw: _Draw, lo: int, hi: int) -> DecodeBatch:
    return DecodeBatch(**_draw_decode(draw, lo, hi, _Taken()))


def decode_batches(*, min_rows: int = 0, max_rows: int = 4) -> st.SearchStrategy[DecodeBatch]:
    """Running batches of ``min_rows`` to ``max_rows`` rows (the empty batch included by default)."""
    return _decode_batches(*_rows_arg("decode_batches", min_rows, max_rows, 0))


def _pipelined(draw: _Draw, cols: dict[str, Any], sample: SampleId | None) -> DecodePlan:
    """A decode plan keeping its tokens under ``sample``, maybe taking its inputs from an earlier
    sample (its input tokens then placeholders, all 0)."""
    inputs = draw(st.none() | _SERIALS.map(SampleId))
    assume(inputs is None or inputs != sample)
    if inputs is not None:
        cols = {**cols, "input_ids": [0] * len(cols["input_ids"])}
    return DecodePlan(**cols, sample_id=sample, inputs_from=inputs)


@st.composite
def _decode_plans(draw: _Draw, lo: int, hi: int) -> DecodePlan:
    cols = _draw_decode(draw, lo, hi, _Taken())
    return _pipelined(draw, cols, draw(st.none() | _SERIALS.map(SampleId)))


def decode_plans(*, min_rows: int = 0, max_rows: int = 4) -> st.SearchStrategy[DecodePlan]:
    """Lowered decodes, some keeping their tokens under a sample id, some pipelined (their inputs
    named by an earlier sample)."""
    return _decode_plans(*_rows_arg("decode_plans", min_rows, max_rows, 0))


@st.composite
def _mixed_batches(draw: _Draw, hi: int, max_extend: int) -> MixedBatch:
    taken = _Taken()
    chunk = _draw_chunk(draw, 1, hi, max_extend, taken)
    extend = ExtendBatch(
        **chunk.columns(), more_chunks=chunk.more_chunks, intents=chunk.intents, init=chunk.init, snapshot=chunk.snapshot,
        sampling=_sampling(draw, len(chunk.rids)),
    )
    return MixedBatch(extend=extend, decode=DecodeBatch(**_draw_decode(draw, 0, hi, taken)))


def mixed_batches(*, max_rows: int = 4, max_extend: int = 6) -> st.SearchStrategy[MixedBatch]:
    """Chunked-prefill forwards: an extend part of 1 to ``max_rows`` rows and a decode part of 0 to
    ``max_rows``, sharing no request, slot or KV location; no COW reads a decode row's slot."""
    hi = _int_arg("mixed_batches", "max_rows", max_rows, 1, MAX_ROWS)
    return _mixed_batches(hi, _int_arg("mixed_batches", "max_extend", max_extend, 1, MAX_EXTEND))


@st.composite
def _mixed_plans(draw: _Draw, hi: int, max_extend: int, pools: tuple[str, ...]) -> MixedPlan:
    taken = _Taken()
    chunk = _draw_chunk(draw, 1, hi, max_extend, taken)
    sample = draw(st.none() | _SERIALS.map(SampleId))  # one forward, one sample: both parts keep their tokens under it
    extend = ExtendPlan(
        **chunk.columns(), more_chunks=chunk.more_chunks, **_tickets_of(chunk, _pools_of(draw, pools)), sample_id=sample,
        sampling=_sampling(draw, len(chunk.rids)), keep_hidden=draw(st.none() | _SERIALS.map(HiddenId)),
    )
    decode = _pipelined(draw, _draw_decode(draw, 0, hi, taken), sample)
    return MixedPlan(extend=extend, decode=decode)


def mixed_plans(*, max_rows: int = 4, max_extend: int = 6, pools: Sequence[str] = POOL_NAMES) -> st.SearchStrategy[MixedPlan]:
    """Lowered mixed forwards (as ``mixed_batches``): one sample id for both parts (or none), the
    decode part maybe pipelined."""
    hi = _int_arg("mixed_plans", "max_rows", max_rows, 1, MAX_ROWS)
    return _mixed_plans(hi, _int_arg("mixed_plans", "max_extend", max_extend, 1, MAX_EXTEND), _pools_arg("mixed_plans", pools))


def idle_batches() -> st.SearchStrategy[IdleBatch]:
    """The idle batch (it has no fields)."""
    return st.just(IdleBatch())


def idle_plans() -> st.SearchStrategy[IdlePlan]:
    """The idle plan (it has no fields)."""
    return st.just(IdlePlan())


# -- speculative decoding -------------------------------------------------------------------------------


def _spec_args(fn: str, min_rows: int, max_rows: int, max_k: int) -> tuple[int, int, int]:
    """Rows and ``max_k`` of a speculative phase's strategy, within ``MAX_MIN_BATCH``."""
    __tracebackhide__ = True  # (pytest shows the caller's line and the message, not this check)
    lo, hi = _rows_arg(fn, min_rows, max_rows, 0)
    k = _int_arg(fn, "max_k", max_k, 1, spec.MAX_SPEC_K)
    if lo * (k + SPEC_ROW_VALUES) > MAX_MIN_BATCH:
        raise ValueError(f"{fn}: min_rows={lo} rows of up to max_k={k} drafts may not fit one hypothesis example "
                         f"(min_rows * (max_k + {SPEC_ROW_VALUES}) must be at most {MAX_MIN_BATCH}; lower either)")
    return lo, hi, k


@st.composite
def _draft_batches(draw: _Draw, lo: int, hi: int, max_k: int) -> spec.DraftBatch:
    cols, _ = _draw_window(draw, lo, hi, max_k, single=True)
    return spec.DraftBatch(**cols, draft_id=DraftId(draw(_SERIALS)))


def draft_batches(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.DraftBatch]:
    """Draft proposals: ``k`` in ``[1, max_k]``, one pending token and ``k + 1`` KV locations per row."""
    return _draft_batches(*_spec_args("draft_batches", min_rows, max_rows, max_k))


@st.composite
def _verify_batches(draw: _Draw, lo: int, hi: int, max_k: int) -> spec.VerifyBatch:
    cols, _ = _draw_window(draw, lo, hi, max_k, single=False)
    return spec.VerifyBatch(**cols, verify_id=VerifyId(draw(_SERIALS)), draft_id=DraftId(draw(_SERIALS)))


def verify_batches(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.VerifyBatch]:
    """Verifies: ``k + 1`` window tokens and KV locations per row."""
    return _verify_batches(*_spec_args("verify_batches", min_rows, max_rows, max_k))


@st.composite
def _commit_batches(draw: _Draw, lo: int, hi: int, max_k: int) -> spec.CommitBatch:
    cols, accept = _draw_window(draw, lo, hi, max_k, single=False)
    n, k, kv = len(cols["rids"]), cols["k"], cols["kv_locs"]
    released = [kv[i * (k + 1) + j] for i in range(n) for j in range(accept[i] + 1, k + 1)]  # the rejected positions, in row order
    return spec.CommitBatch(**cols, verify_id=VerifyId(draw(_SERIALS)), draft_id=DraftId(draw(_SERIALS)), accept_pos=accept, released_kv=released)


def commit_batches(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.CommitBatch]:
    """Target commits: per row an accepted position in ``[0, k]``; the released KV locations are
    exactly those of the window positions after it (what ``passes.commit`` computes)."""
    return _commit_batches(*_spec_args("commit_batches", min_rows, max_rows, max_k))


@st.composite
def _draft_commit_batches(draw: _Draw, lo: int, hi: int, max_k: int) -> spec.DraftCommitBatch:
    cols, accept = _draw_window(draw, lo, hi, max_k, single=False)
    return spec.DraftCommitBatch(**cols, draft_id=DraftId(draw(_SERIALS)), accept_pos=accept)


def draft_commit_batches(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.DraftCommitBatch]:
    """Draft commits: per row an accepted position in ``[0, k]`` of the verified window."""
    return _draft_commit_batches(*_spec_args("draft_commit_batches", min_rows, max_rows, max_k))


@st.composite
def _draft_extend_batches(draw: _Draw, lo: int, hi: int, max_extend: int) -> spec.DraftExtendBatch:
    chunk = _draw_chunk(draw, lo, hi, max_extend, _Taken())
    return spec.DraftExtendBatch(**chunk.columns(), sampling=_sampling(draw, len(chunk.rids)))


def draft_extend_batches(*, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6) -> st.SearchStrategy[spec.DraftExtendBatch]:
    """Draft catch-up forwards: extend-shaped rows without init ops."""
    lo, hi, most = _extend_args("draft_extend_batches", min_rows, max_rows, max_extend, 0)
    return _draft_extend_batches(lo, hi, most)


def draft_plans(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.DraftPlan]:
    """``draft_batches`` lowered (a speculative plan wraps its batch)."""
    return _draft_batches(*_spec_args("draft_plans", min_rows, max_rows, max_k)).map(lambda b: spec.DraftPlan(batch=b))


def verify_plans(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.VerifyPlan]:
    """``verify_batches`` lowered, some keeping the target's hidden states for a draft head."""
    batches = _verify_batches(*_spec_args("verify_plans", min_rows, max_rows, max_k))
    return st.builds(lambda b, h: spec.VerifyPlan(batch=b, keep_hidden=h), batches, st.none() | _SERIALS.map(HiddenId))


def commit_plans(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.CommitPlan]:
    """``commit_batches`` lowered."""
    return _commit_batches(*_spec_args("commit_plans", min_rows, max_rows, max_k)).map(lambda b: spec.CommitPlan(batch=b))


def draft_commit_plans(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[spec.DraftCommitPlan]:
    """``draft_commit_batches`` lowered."""
    batches = _draft_commit_batches(*_spec_args("draft_commit_plans", min_rows, max_rows, max_k))
    return batches.map(lambda b: spec.DraftCommitPlan(batch=b))


def draft_extend_plans(*, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6) -> st.SearchStrategy[spec.DraftExtendPlan]:
    """``draft_extend_batches`` lowered."""
    lo, hi, most = _extend_args("draft_extend_plans", min_rows, max_rows, max_extend, 0)
    batches = _draft_extend_batches(lo, hi, most)
    return batches.map(lambda b: spec.DraftExtendPlan(batch=b))


# -- a draft head's phases --------------------------------------------------------------------------------


@st.composite
def _head_extend_batches(draw: _Draw, lo: int, hi: int, max_extend: int) -> HeadExtendBatch:
    chunk = _draw_chunk(draw, lo, hi, max_extend, _Taken())
    return HeadExtendBatch(
        **chunk.columns(), hidden_id=HiddenId(draw(_SERIALS)), intents=chunk.intents, init=chunk.init, snapshot=chunk.snapshot,
    )


def head_extend_batches(*, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6) -> st.SearchStrategy[HeadExtendBatch]:
    """A draft head's extend over a prefill chunk (as ``extend_batches``, with the hidden states' id)."""
    lo, hi, most = _extend_args("head_extend_batches", min_rows, max_rows, max_extend, 1)
    return _head_extend_batches(lo, hi, most)


@st.composite
def _head_extend_plans(draw: _Draw, lo: int, hi: int, max_extend: int, pools: tuple[str, ...]) -> HeadExtendPlan:
    chunk = _draw_chunk(draw, lo, hi, max_extend, _Taken())
    return HeadExtendPlan(**chunk.columns(), hidden_id=HiddenId(draw(_SERIALS)), **_tickets_of(chunk, _pools_of(draw, pools)))


def head_extend_plans(
    *, min_rows: int = 1, max_rows: int = 4, max_extend: int = 6, pools: Sequence[str] = POOL_NAMES
) -> st.SearchStrategy[HeadExtendPlan]:
    """``head_extend_batches`` lowered: the prefill's ops as tickets for one or two head pools of ``pools``."""
    lo, hi, max_ext = _extend_args("head_extend_plans", min_rows, max_rows, max_extend, 1)
    return _head_extend_plans(lo, hi, max_ext, _pools_arg("head_extend_plans", pools))


@st.composite
def _head_commit_batches(draw: _Draw, lo: int, hi: int, max_k: int) -> HeadCommitBatch:
    k = draw(st.integers(1, max_k))
    rows = _draw_rows(draw, _head_commit_row(k), lo, hi, _Taken())
    return HeadCommitBatch(
        k=k, hidden_id=HiddenId(draw(_SERIALS)), rids=[r.rid for r in rows], slots=[r.slot for r in rows],
        prefix_lens=[r.prefix for r in rows], accept_pos=[r.accept for r in rows], extend_lens=[r.accept + 1 for r in rows],
        input_ids=[t for r in rows for t in r.tokens], kv_locs=[v for r in rows for v in r.kv],
    )


def head_commit_batches(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[HeadCommitBatch]:
    """A draft head's catch-up over each row's committed window tokens (``accept_pos + 1`` of them)."""
    return _head_commit_batches(*_spec_args("head_commit_batches", min_rows, max_rows, max_k))


def head_commit_plans(*, min_rows: int = 0, max_rows: int = 3, max_k: int = 4) -> st.SearchStrategy[HeadCommitPlan]:
    """``head_commit_batches`` lowered."""
    return _head_commit_batches(*_spec_args("head_commit_plans", min_rows, max_rows, max_k)).map(lambda b: HeadCommitPlan(batch=b))


# -- every kind, by name ------------------------------------------------------------------------------------


def _node_strategies() -> dict[str, st.SearchStrategy[Any]]:
    return {
        "ExtendBatch": extend_batches(),
        "DecodeBatch": decode_batches(),
        "MixedBatch": mixed_batches(),
        "IdleBatch": idle_batches(),
        "ExtendPlan": extend_plans(),
        "DecodePlan": decode_plans(),
        "MixedPlan": mixed_plans(),
        "IdlePlan": idle_plans(),
        "DraftBatch": draft_batches(),
        "VerifyBatch": verify_batches(),
        "CommitBatch": commit_batches(),
        "DraftCommitBatch": draft_commit_batches(),
        "DraftExtendBatch": draft_extend_batches(),
        "DraftPlan": draft_plans(),
        "VerifyPlan": verify_plans(),
        "CommitPlan": commit_plans(),
        "DraftCommitPlan": draft_commit_plans(),
        "DraftExtendPlan": draft_extend_plans(),
        "HeadExtendBatch": head_extend_batches(),
        "HeadExtendPlan": head_extend_plans(),
        "HeadCommitBatch": head_commit_batches(),
        "HeadCommitPlan": head_commit_plans(),
        "MambaInit": mamba_inits(),
        "MambaSnapshot": mamba_snapshots(),
        "Ticket": tickets(),
        "AdmittedRequest": admitted_requests(),
        "AcceptResult": accept_results(),
        "SamplingRows": st.integers(0, 4).flatmap(sampling_rows),
    }


NODE_STRATEGIES: Final[Mapping[str, st.SearchStrategy[Any]]] = types.MappingProxyType(_node_strategies())
"""The default strategy of every node kind ``ir.printer`` prints (``ir.printer.PRINTABLE``), by class
name (read-only)."""


def strategy_for(node_type: type[N]) -> st.SearchStrategy[N]:
    """The default strategy of the IR node class ``node_type`` (``Ticket[MambaInit]`` means ``Ticket``).
    ``TypeError`` for what is not a class, ``LookupError`` for a class that has none; one line, naming it."""
    cls: object = get_origin(node_type) or node_type
    if not isinstance(cls, type):
        raise TypeError(f"strategy_for: node_type must be an IR node class, got {short_repr(node_type)} ({type(node_type).__name__})")
    name = cls.__name__
    if PRINTABLE.get(name) is not cls or name not in NODE_STRATEGIES:
        raise LookupError(f"strategy_for: no strategy for {cls.__module__}.{cls.__qualname__} (NODE_STRATEGIES covers the node kinds of ir.printer.PRINTABLE)")
    return cast("st.SearchStrategy[N]", NODE_STRATEGIES[name])


# -- sequences of scheduler steps -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Prefill:
    """One prefill forward (``Pipeline.prefill``) of ``requests``: the next chunks of requests
    mid-prefill (``Continue``), then new requests (``Clear``, or ``CopyFrom`` a cached prefix). Those
    whose prompt is complete join the running batch (``Pipeline.merge``)."""

    requests: tuple[AdmittedRequest, ...]


@attrs.frozen(kw_only=True)
class Mixed:
    """Prefill chunks and the running batch's next decode in one forward (``Pipeline.mixed``): as
    ``Prefill``, with the decode's ``next_tokens`` and ``kv_locs`` (one per running row)."""

    requests: tuple[AdmittedRequest, ...]
    next_tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Decode:
    """The running batch's next decode (``Pipeline.decode``): one token and one KV location per row."""

    next_tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Finish:
    """Requests of the running batch finish (``Pipeline.filter_decode``): their slots are free again."""

    rids: tuple[RequestId, ...]


@attrs.frozen(kw_only=True)
class Speculate:
    """One speculative iteration over the running batch: draft, verify, commit, then the draft's
    commit (or, with ``draft_extend``, its catch-up forward), the rows rejoining the running batch.
    ``next_tokens``: each row's pending token; ``kv_locs``: ``k + 1`` per row. Without a backend the
    runner takes the draft's ``proposals`` (``k`` per row) and the target's ``target_tokens``
    (``k + 1`` per row) from here; with one, from what it returns."""

    k: int
    next_tokens: tuple[int, ...]
    kv_locs: tuple[int, ...]
    proposals: tuple[int, ...]
    target_tokens: tuple[int, ...]
    draft_extend: bool


Step: TypeAlias = Prefill | Mixed | Decode | Finish | Speculate
"""One step of a ``StepSequence``."""


@attrs.frozen(kw_only=True)
class StepSequence:
    """Scheduler steps valid in this order, from an empty running batch: every slot a request or a
    cache entry uses is in ``[1, capacity]``, every token in ``[0, vocab)``, KV locations are never
    reused."""

    steps: tuple[Step, ...]
    capacity: int
    vocab: int

    def __iter__(self) -> Iterator[Step]:
        """The steps, in order."""
        return iter(self.steps)

    def __len__(self) -> int:
        """The number of steps."""
        return len(self.steps)

    def describe(self) -> str:
        """One line per step (what a failing example's report shows)."""
        lines = []
        for i, s in enumerate(self.steps):
            match s:
                case Prefill(requests=reqs) | Mixed(requests=reqs):
                    parts = [
                        f"r{int(r.rid)}@s{int(r.slot)} {type(r.intent).__name__.lower()}"
                        + (f" src=s{int(r.intent.src)}" if isinstance(r.intent, CopyFrom) else "")
                        + f" +{r.input_ids.shape[0]}" + (" more" if r.more_chunks else "")
                        + (f" snapshot->s{int(r.snapshot_to)}" if r.snapshot_to is not None else "")
                        for r in reqs
                    ]
                    decode = f" + decode of {len(s.next_tokens)}" if isinstance(s, Mixed) else ""
                    lines.append(f"{i}: {type(s).__name__.lower()} [{', '.join(parts)}]{decode}")
                case Decode():
                    lines.append(f"{i}: decode {len(s.next_tokens)} rows")
                case Finish():
                    lines.append(f"{i}: finish {[int(r) for r in s.rids]}")
                case Speculate():
                    how = "draft extend" if s.draft_extend else "draft commit"
                    lines.append(f"{i}: speculate k={s.k} over {len(s.next_tokens)} rows ({how})")
        return "\n".join(lines)


@attrs.define
class _Scheduler:
    """The state a sequence is drawn against: what the runner's pipeline will hold after each step."""

    capacity: int
    free: list[int]
    cache_max: int
    running: list[tuple[int, int]] = attrs.Factory(list)
    """(rid, slot) of the running batch, in its row order."""
    chunking: dict[int, tuple[int, int]] = attrs.Factory(dict)
    """rid -> (slot, tokens prefilled) of the requests mid-prefill."""
    cache: dict[int, int] = attrs.Factory(dict)
    """cache slot -> the prefix length of the state snapshotted into it."""
    next_rid: int = 0
    next_kv: int = 0

    def kv(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next_kv, self.next_kv + n))
        self.next_kv += n
        return out

    def take(self, slot: int) -> None:
        self.free.remove(slot)

    def give(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()


@attrs.frozen
class _SequenceArgs:
    min_steps: int
    max_steps: int
    capacity: int
    vocab: int
    max_chunk: int
    max_batch: int
    max_k: int
    chunked: bool
    prefix_cache: bool
    speculative: bool

    @property
    def cache_max(self) -> int:
        """Prefix-cache entries at most: a quarter of the slots, so that requests always find one."""
        return self.capacity // 4

    @property
    def token_cost(self) -> int:
        """What one token costs of ``SEQUENCE_VALUES``: more for a wide vocabulary (hypothesis spends
        about a byte per 8 bits of a value's range)."""
        return 1 + (self.vocab - 1).bit_length() // 8

    @property
    def prefill_cost(self) -> int:
        """The most a prefill step draws: ``max_batch`` requests of ``max_chunk`` tokens."""
        return self.max_batch * (self.max_chunk * self.token_cost + ROW_VALUES)

    def speculate_cost(self, n: int) -> int:
        """The most a speculative step over ``n`` running requests draws (``2 * max_k + 2`` tokens a row)."""
        return n * ((2 * self.max_k + 2) * self.token_cost + SPEC_ROW_VALUES)

    @property
    def running_max(self) -> int:
        """Requests running or mid-prefill at most: as many as one step's ``MAX_MIN_BATCH`` holds
        (a decode step, or a speculative one with its drafts and target tokens)."""
        row = self.speculate_cost(1) if self.speculative else self.token_cost + SPEC_ROW_VALUES
        return max(1, MAX_MIN_BATCH // row)


def _draw_requests(draw: _Draw, sim: _Scheduler, args: _SequenceArgs) -> tuple[AdmittedRequest, ...]:
    """One forward's prefill requests: some continued chunks, then new requests; at least one."""
    tokens = st.integers(0, args.vocab - 1)
    cont: list[int] = []
    if sim.chunking:  # (at least one when no new request fits)
        least = 0 if sim.free and len(sim.running) + len(sim.chunking) < args.running_max else 1
        cont = draw(st.lists(st.sampled_from(sorted(sim.chunking)), min_size=least, max_size=min(len(sim.chunking), args.max_batch), unique=True))
    room = max(0, min(args.max_batch - len(cont), len(sim.free), args.running_max - len(sim.running) - len(sim.chunking)))
    new = draw(st.integers(0 if cont else 1, room))
    chosen: list[tuple[int, int, int, bool]] = []  # rid, slot, prefix before, new request
    requests: list[AdmittedRequest] = []
    cached: dict[int, int] = {}  # cache entries this forward writes (read by later forwards only)
    for rid in cont:
        slot, done = sim.chunking[rid]
        chosen.append((rid, slot, done, False))
    for _ in range(new):
        slot = draw(st.sampled_from(sim.free))
        sim.take(slot)
        chosen.append((sim.next_rid, slot, 0, True))
        sim.next_rid += 1
    for rid, slot, done, fresh in chosen:
        n = draw(st.integers(1, args.max_chunk))
        intent: Clear | CopyFrom | Continue
        if not fresh:
            intent = Continue(prefix_len=done)
        elif args.prefix_cache and sim.cache and draw(st.booleans()):
            src = draw(st.sampled_from(sorted(sim.cache)))
            intent = CopyFrom(src=MambaSlot(src), prefix_len=sim.cache[src])
        else:
            intent = Clear()
        more = args.chunked and draw(st.booleans())
        snapshot_to = None
        if args.prefix_cache and len(sim.cache) + len(cached) < args.cache_max and len(sim.free) >= 2 and draw(st.booleans()):
            snapshot_to = draw(st.sampled_from(sim.free))
            sim.take(snapshot_to)
            cached[snapshot_to] = intent.prefix_len + n
        requests.append(AdmittedRequest(
            rid=RequestId(rid), slot=MambaSlot(slot), input_ids=draw(_n(tokens, n)), kv_locs=sim.kv(n), intent=intent,
            more_chunks=more, snapshot_to=None if snapshot_to is None else MambaSlot(snapshot_to),
        ))
        if more:
            sim.chunking[rid] = (slot, intent.prefix_len + n)
        else:
            sim.chunking.pop(rid, None)
            sim.running.append((rid, slot))
    sim.cache.update(cached)
    return tuple(requests)


def _drawn(step: Step, per_token: int) -> int:
    """About what drawing ``step`` cost of ``SEQUENCE_VALUES``: its tokens, and a few values a row."""
    match step:
        case Prefill(requests=requests):
            return sum(len(r.input_ids) * per_token + ROW_VALUES for r in requests)
        case Mixed(requests=requests, next_tokens=tokens):
            return sum(len(r.input_ids) * per_token + ROW_VALUES for r in requests) + len(tokens) * (per_token + 1)
        case Decode(next_tokens=tokens):
            return len(tokens) * (per_token + 1)
        case Finish(rids=rids):
            return len(rids) + 1
        case Speculate(next_tokens=tokens, proposals=proposals, target_tokens=target):
            return (len(tokens) + len(proposals) + len(target)) * per_token + len(tokens) * SPEC_ROW_VALUES
        case _:
            assert_never(step)


@st.composite
def _step_sequences(draw: _Draw, args: _SequenceArgs) -> StepSequence:
    sim = _Scheduler(capacity=args.capacity, free=list(range(1, args.capacity + 1)), cache_max=args.cache_max)
    tokens = st.integers(0, args.vocab - 1)
    steps: list[Step] = []
    left = SEQUENCE_VALUES  # (what the steps may still draw: a step is chosen only if its largest form fits)
    per_token = args.token_cost
    for _ in range(draw(st.integers(args.min_steps, args.max_steps))):
        n = len(sim.running)
        decode_cost = n * (per_token + 1)
        can_prefill = (bool(sim.chunking) or (bool(sim.free) and n + len(sim.chunking) < args.running_max)) and args.prefill_cost <= left
        kinds = [k for k, ok in (
            ("prefill", can_prefill), ("decode", bool(sim.running) and decode_cost <= left), ("finish", bool(sim.running) and n <= left),
            ("mixed", can_prefill and bool(sim.running) and args.prefill_cost + decode_cost <= left),
            ("speculate", args.speculative and bool(sim.running) and args.speculate_cost(n) <= left),
        ) if ok]
        if not kinds:
            break
        before = len(steps)
        match draw(st.sampled_from(kinds)):
            case "prefill":
                steps.append(Prefill(requests=_draw_requests(draw, sim, args)))
            case "mixed":
                next_tokens, kv = tuple(draw(_n(tokens, n))), sim.kv(n)
                steps.append(Mixed(requests=_draw_requests(draw, sim, args), next_tokens=next_tokens, kv_locs=kv))
            case "decode":
                steps.append(Decode(next_tokens=tuple(draw(_n(tokens, n))), kv_locs=sim.kv(n)))
            case "finish":
                done = draw(st.lists(st.sampled_from([r for r, _ in sim.running]), min_size=1, max_size=n, unique=True))
                for slot in [s for r, s in sim.running if r in done]:
                    sim.give(slot)
                sim.running = [(r, s) for r, s in sim.running if r not in done]
                steps.append(Finish(rids=tuple(RequestId(r) for r in done)))
            case _:
                k = draw(st.integers(1, args.max_k))
                steps.append(Speculate(
                    k=k, next_tokens=tuple(draw(_n(tokens, n))), kv_locs=sim.kv(n * (k + 1)),
                    proposals=tuple(draw(_n(tokens, n * k))), target_tokens=tuple(draw(_n(tokens, n * (k + 1)))),
                    draft_extend=draw(st.booleans()),
                ))
        left -= _drawn(steps[before], per_token) if len(steps) > before else 0
    return StepSequence(steps=tuple(steps), capacity=args.capacity, vocab=args.vocab)


def step_sequences(
    *,
    min_steps: int = 1,
    max_steps: int = 8,
    capacity: int = 8,
    vocab: int = 16,
    max_chunk: int = 6,
    max_batch: int = 4,
    max_k: int = 3,
    chunked: bool = True,
    prefix_cache: bool = True,
    speculative: bool = True,
) -> st.SearchStrategy[StepSequence]:
    """Valid scheduler-like sequences of ``min_steps`` to ``max_steps`` steps (fewer only if no step
    can follow, or if the next would draw past ``SEQUENCE_VALUES``), each a ``Prefill``, ``Mixed``,
    ``Decode``, ``Finish`` or ``Speculate``.

    ``capacity``: Mamba slots ``1..capacity`` shared by live requests and prefix-cache entries
    (a quarter of them at most); ``vocab``: token ids are below it; ``max_chunk``: tokens per prefill
    chunk; ``max_batch``: requests per prefill forward; ``max_k``: draft tokens per speculative
    iteration. ``chunked``: prompts may continue in later chunks; ``prefix_cache``: prefills may
    snapshot a request's state into a free slot and later requests start as a copy of it (COW);
    ``speculative``: speculative iterations are drawn. Steps shrink towards plain prefills.

    Every sequence fits one hypothesis example: as many requests run at once as one step of
    ``MAX_MIN_BATCH`` holds (a speculative step's drafts and target tokens counted), a step is drawn
    only while it fits what the ones before it left of ``SEQUENCE_VALUES``, a prefill's largest form
    must fit ``MAX_MIN_BATCH`` (a token of a vocabulary wider than 8 bits counting more) and
    ``min_steps`` is at most ``MAX_MIN_STEPS`` (``ValueError`` otherwise)."""
    fn = "step_sequences"
    lo = _int_arg(fn, "min_steps", min_steps, 0, MAX_MIN_STEPS)
    hi = _int_arg(fn, "max_steps", max_steps, 0, 1000)
    if lo > hi:
        raise ValueError(f"{fn}: min_steps={lo} > max_steps={hi}")
    batch, chunk = _int_arg(fn, "max_batch", max_batch, 1, MAX_ROWS), _int_arg(fn, "max_chunk", max_chunk, 1, MAX_EXTEND)
    cap = _int_arg(fn, "capacity", capacity, 2, _SLOT_MAX)
    args = _SequenceArgs(
        min_steps=lo, max_steps=hi, capacity=cap, vocab=_int_arg(fn, "vocab", vocab, 1, 2**31),
        max_chunk=chunk, max_batch=batch,
        max_k=_int_arg(fn, "max_k", max_k, 1, spec.MAX_SPEC_K), chunked=_bool_arg(fn, "chunked", chunked),
        prefix_cache=_bool_arg(fn, "prefix_cache", prefix_cache), speculative=_bool_arg(fn, "speculative", speculative),
    )
    if args.prefill_cost > MAX_MIN_BATCH:
        raise ValueError(f"{fn}: a prefill of max_batch={batch} requests of up to max_chunk={chunk} tokens below vocab={args.vocab} may not "
                         f"fit one hypothesis example (max_batch * (max_chunk * {args.token_cost} + {ROW_VALUES}) must be at most "
                         f"{MAX_MIN_BATCH}, a token of this vocabulary counting {args.token_cost}; lower max_batch or max_chunk)")
    return _step_sequences(args)
