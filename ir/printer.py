"""Deterministic text form of batches and plans, for golden tests, dumps and error excerpts.

Rules: one header line per node, one line per request; request ids, slots, KV locations and ticket
serials are renumbered in order of first appearance in the text (``r0``, ``s0``, ``k0``, ``#0``), so a
dump does not depend on allocator state, process history or addresses; runs of consecutive KV
locations print as ``k3..k7``; token ids are data and print as they are (the first 8, then a count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, assert_never

import numpy as np

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import I64
from ir.init import InitIntent, InitTicket, MambaInit, MambaSnapshot
from ir.nodes import Batch, Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.spec import (
    CommitBatch,
    CommitPlan,
    DraftBatch,
    DraftExtendBatch,
    DraftExtendPlan,
    DraftPlan,
    VerifyBatch,
    VerifyPlan,
)

_MAX_TOKENS = 8


class _Names:
    def __init__(self) -> None:
        self._maps: dict[str, dict[int, int]] = {}

    def __call__(self, kind: str, value: int | np.integer[Any]) -> str:
        m = self._maps.setdefault(kind, {})
        return f"{kind}{m.setdefault(int(value), len(m))}"

    def kv(self, locs: I64) -> str:
        names = [int(self("k", v)[1:]) for v in locs]
        if not names:
            return "-"
        runs: list[str] = []
        start = 0
        for i in range(1, len(names) + 1):
            if i == len(names) or names[i] != names[i - 1] + 1:
                a, b = names[start], names[i - 1]
                runs.append(f"k{a}" if a == b else f"k{a}..k{b}")
                start = i
        return ",".join(runs)


def _tokens(ids: Sequence[int] | I64) -> str:
    shown = " ".join(str(int(t)) for t in ids[:_MAX_TOKENS])
    more = len(ids) - _MAX_TOKENS
    return f"[{shown}{f' +{more}' if more > 0 else ''}]"


def _init(init: MambaInit, names: _Names) -> str:
    clears = " ".join(names("s", s) for s in init.clear_slots)
    cows = " ".join(f"{names('s', a)}->{names('s', b)}" for a, b in zip(init.cow_src, init.cow_dst, strict=True))
    return f"{names('#', init.serial)} clear[{clears}] cow[{cows}]"


def _snapshot(snap: MambaSnapshot, names: _Names) -> str:
    pairs = " ".join(f"{names('s', a)}->{names('s', b)}" for a, b in zip(snap.src, snap.dst, strict=True))
    return f"{names('#', snap.serial)} [{pairs}]"


def _ticket(t: InitTicket, names: _Names) -> str:
    return f"ticket {_init(t.init, names)} pool={t.pool}"


def _extend_rows(
    names: _Names,
    rids: I64,
    slots: I64,
    prefix_lens: I64,
    extend_lens: I64,
    more: Sequence[bool],
    input_ids: I64,
    kv_locs: I64,
    intents: Sequence[InitIntent] | None,
    indent: str,
) -> list[str]:
    lines = []
    offsets = np.concatenate(([0], np.cumsum(extend_lens)))
    for i in range(rids.shape[0]):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        intent = f" init={intents[i].value}" if intents is not None else ""
        chunk = " more" if more[i] else ""
        lines.append(
            f"{indent}{names('r', rids[i])} {names('s', slots[i])} prefix={int(prefix_lens[i])} "
            f"extend={int(extend_lens[i])}{intent}{chunk} tokens={_tokens(input_ids[lo:hi])} kv={names.kv(kv_locs[lo:hi])}"
        )
    return lines


def _decode_rows(names: _Names, rids: I64, slots: I64, seq_lens: I64, input_ids: I64, kv_locs: I64, indent: str) -> list[str]:
    return [
        f"{indent}{names('r', rids[i])} {names('s', slots[i])} seq={int(seq_lens[i])} token={int(input_ids[i])} "
        f"kv={names.kv(kv_locs[i : i + 1])}"
        for i in range(rids.shape[0])
    ]


def _window_rows(
    names: _Names, rids: I64, slots: I64, seq_lens: I64, ids: I64, accept: I64 | None, kv: I64, k: int, indent: str
) -> list[str]:
    lines = []
    w = k + 1
    single = ids.shape[0] == rids.shape[0]  # a draft batch feeds one pending token per row
    for i in range(rids.shape[0]):
        toks = f"token={int(ids[i])}" if single else f"tokens={_tokens(ids[i * w : (i + 1) * w])}"
        acc = f" accept={int(accept[i])}" if accept is not None else ""
        lines.append(
            f"{indent}{names('r', rids[i])} {names('s', slots[i])} seq={int(seq_lens[i])}{acc} {toks} "
            f"kv={names.kv(kv[i * w : (i + 1) * w])}"
        )
    return lines


def _dump(node: Batch | Plan, names: _Names, indent: str) -> list[str]:
    head = f"{indent}{type(node).__name__} requests={node.num_requests}"
    inner = indent + "  "
    match node:
        case ExtendBatch():
            lines = [f"{head} tokens={node.num_tokens}"]
            lines.append(f"{inner}init {_init(node.init, names)}" if node.init is not None else f"{inner}init none")
            if node.snapshot is not None:
                lines.append(f"{inner}snapshot {_snapshot(node.snapshot, names)}")
            return lines + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, node.more_chunks.tolist(),
                node.input_ids, node.kv_locs, node.intents, inner,
            )
        case ExtendPlan():
            lines = [f"{head} tokens={node.input_ids.shape[0]}"]
            lines += [f"{inner}{_ticket(t, names)}" for t in node.tickets] or [f"{inner}tickets none"]
            lines += [f"{inner}snapshot ticket {_snapshot(t.snapshot, names)} pool={t.pool}" for t in node.snapshots]
            return lines + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, node.more_chunks.tolist(),
                node.input_ids, node.kv_locs, None, inner,
            )
        case DecodeBatch() | DecodePlan():
            return [head] + _decode_rows(names, node.rids, node.slots, node.seq_lens, node.input_ids, node.kv_locs, inner)
        case MixedBatch() | MixedPlan():
            return [head] + _dump(node.extend, names, inner) + _dump(node.decode, names, inner)
        case IdleBatch() | IdlePlan():
            return [head]
        case DraftBatch():
            return [f"{head} k={node.k}"] + _window_rows(names, node.rids, node.slots, node.seq_lens, node.input_ids, None, node.kv_locs, node.k, inner)
        case VerifyBatch():
            return [f"{head} k={node.k} verify={names('#', node.verify_id)}"] + _window_rows(
                names, node.rids, node.slots, node.seq_lens, node.input_ids, None, node.kv_locs, node.k, inner
            )
        case CommitBatch():
            lines = [f"{head} k={node.k} verify={names('#', node.verify_id)}"]
            lines += _window_rows(names, node.rids, node.slots, node.seq_lens, node.input_ids, node.accept_pos, node.kv_locs, node.k, inner)
            return lines + [f"{inner}released kv={names.kv(node.released_kv)}"]
        case DraftExtendBatch():
            n = node.num_requests
            return [f"{head} tokens={node.input_ids.shape[0]}"] + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, [False] * n,
                node.input_ids, node.kv_locs, None, inner,
            )
        case DraftPlan() | VerifyPlan() | CommitPlan() | DraftExtendPlan():
            return [head] + _dump(node.batch, names, inner)
        case _:
            assert_never(node)


def dump(node: Batch | Plan) -> str:
    """The deterministic text form of ``node`` (ends with a newline)."""
    return "\n".join(_dump(node, _Names(), "")) + "\n"
