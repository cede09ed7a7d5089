"""Deterministic text form of IR nodes, for golden tests, dumps and error excerpts; ``ir.parse``
reads it back.

Rules: one header line per node, one line per request, nested nodes indented by two spaces. Request
ids, slots, KV locations and serials print as names: ``r0``, ``s1``, ``k0``, ``#1``. By default they
are renumbered in order of first appearance in the text (request ids and KV locations from 0, slots
and serials from 1, the smallest valid ones), so a dump does not depend on allocator state, process
history or addresses; ``dump(node, exact=True)`` prints the values themselves instead, and
``ir.parse.parse(dump(node, exact=True)) == node``. Runs of consecutive KV locations print as
``k3..k7`` (``-`` for none); token ids are data and print as they are, every one of them. Pool names
print bare when they are plain words (``pool=target``), else as a JSON string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias, assert_never

import numpy as np

from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.columns import I64
from ir.init import InitIntent, InitTicket, MambaInit, MambaSnapshot, SnapshotTicket
from ir.nodes import Batch, Plan
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.request import AdmittedRequest, Clear, Continue, CopyFrom
from ir.spec import (
    AcceptResult,
    CommitBatch,
    CommitPlan,
    DraftBatch,
    DraftCommitBatch,
    DraftCommitPlan,
    DraftExtendBatch,
    DraftExtendPlan,
    DraftPlan,
    VerifyBatch,
    VerifyPlan,
)

Printable: TypeAlias = Batch | Plan | MambaInit | MambaSnapshot | InitTicket | SnapshotTicket | AdmittedRequest | AcceptResult
"""Every node ``dump`` prints (and ``ir.parse.parse`` reads)."""

_FIRST = {"r": 0, "k": 0, "s": 1, "#": 1}
_PLAIN_POOL = re.compile(r"[A-Za-z0-9_.:-]+")


class _Names:
    def __init__(self, exact: bool) -> None:
        self._exact = exact
        self._maps: dict[str, dict[int, int]] = {}

    def __call__(self, kind: str, value: int | np.integer[Any]) -> str:
        if self._exact:
            return f"{kind}{int(value)}"
        m = self._maps.setdefault(kind, {})
        return f"{kind}{m.setdefault(int(value), len(m) + _FIRST[kind])}"

    def kv(self, locs: I64) -> str:
        nums = [int(self("k", v)[1:]) for v in locs.tolist()]
        if not nums:
            return "-"
        runs: list[str] = []
        start = 0
        for i in range(1, len(nums) + 1):
            if i == len(nums) or nums[i] != nums[i - 1] + 1:
                a, b = nums[start], nums[i - 1]
                runs.append(f"k{a}" if a == b else f"k{a}..k{b}")
                start = i
        return ",".join(runs)


def _tokens(ids: I64) -> str:
    return "[" + " ".join(str(t) for t in ids.tolist()) + "]"


def _pool(pool: str) -> str:
    return pool if _PLAIN_POOL.fullmatch(pool) else json.dumps(pool)


def _init(init: MambaInit, names: _Names) -> str:
    clears = " ".join(names("s", s) for s in init.clear_slots)
    cows = " ".join(f"{names('s', a)}->{names('s', b)}" for a, b in zip(init.cow_src, init.cow_dst, strict=True))
    return f"{names('#', init.serial)} clear[{clears}] cow[{cows}]"


def _snapshot(snap: MambaSnapshot, names: _Names) -> str:
    pairs = " ".join(f"{names('s', a)}->{names('s', b)}" for a, b in zip(snap.src, snap.dst, strict=True))
    return f"{names('#', snap.serial)} [{pairs}]"


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
    names: _Names, rids: I64, slots: I64, seq_lens: I64, ids: I64, accept: I64 | None, kv: I64, k: int, indent: str, *, single: bool
) -> list[str]:
    """Rows of a windowed node; ``single``: one token per row (a draft feeds its pending token)."""
    lines = []
    w = k + 1
    for i in range(rids.shape[0]):
        toks = f"token={int(ids[i])}" if single else f"tokens={_tokens(ids[i * w : (i + 1) * w])}"
        acc = f" accept={int(accept[i])}" if accept is not None else ""
        lines.append(
            f"{indent}{names('r', rids[i])} {names('s', slots[i])} seq={int(seq_lens[i])}{acc} {toks} "
            f"kv={names.kv(kv[i * w : (i + 1) * w])}"
        )
    return lines


def _request(r: AdmittedRequest, names: _Names) -> str:
    ids = f"{names('r', r.rid)} {names('s', r.slot)}"
    match r.intent:
        case Clear():
            intent = "intent=clear"
        case CopyFrom(src=src, prefix_len=prefix):
            intent = f"intent=cow src={names('s', src)} prefix={prefix}"
        case Continue(prefix_len=prefix):
            intent = f"intent=continue prefix={prefix}"
        case _:
            assert_never(r.intent)
    more = " more" if r.more_chunks else ""
    snap = f" snapshot_to={names('s', r.snapshot_to)}" if r.snapshot_to is not None else ""
    return (
        f"AdmittedRequest {ids} {intent}{more}{snap} "
        f"tokens={_tokens(r.input_ids)} kv={names.kv(r.kv_locs)}"
    )


def _head(node: Batch | Plan, indent: str) -> str:
    return f"{indent}{type(node).__name__} requests={node.num_requests}"


def _dump(node: Printable, names: _Names, indent: str) -> list[str]:
    inner = indent + "  "
    match node:
        case MambaInit():
            return [f"{indent}MambaInit {_init(node, names)}"]
        case MambaSnapshot():
            return [f"{indent}MambaSnapshot {_snapshot(node, names)}"]
        case InitTicket():
            return [f"{indent}InitTicket {_init(node.init, names)} pool={_pool(node.pool)}"]
        case SnapshotTicket():
            return [f"{indent}SnapshotTicket {_snapshot(node.snapshot, names)} pool={_pool(node.pool)}"]
        case AdmittedRequest():
            return [f"{indent}{_request(node, names)}"]
        case AcceptResult():
            rows = [f"{inner}accepted={a} bonus={b}" for a, b in zip(node.accepted.tolist(), node.bonus.tolist(), strict=True)]
            return [f"{indent}AcceptResult requests={node.num_requests}", *rows]
        case ExtendBatch():
            lines = [f"{_head(node, indent)} tokens={node.num_tokens}"]
            lines.append(f"{inner}init {_init(node.init, names)}" if node.init is not None else f"{inner}init none")
            if node.snapshot is not None:
                lines.append(f"{inner}snapshot {_snapshot(node.snapshot, names)}")
            return lines + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, node.more_chunks.tolist(),
                node.input_ids, node.kv_locs, node.intents, inner,
            )
        case ExtendPlan():
            sample = f" sample={names('#', node.sample_id)}" if node.sample_id is not None else ""
            lines = [f"{_head(node, indent)} tokens={node.input_ids.shape[0]}{sample}"]
            lines += [f"{inner}ticket {_init(t.init, names)} pool={_pool(t.pool)}" for t in node.tickets] or [f"{inner}tickets none"]
            lines += [f"{inner}snapshot ticket {_snapshot(t.snapshot, names)} pool={_pool(t.pool)}" for t in node.snapshots]
            return lines + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, node.more_chunks.tolist(),
                node.input_ids, node.kv_locs, None, inner,
            )
        case DecodeBatch() | DecodePlan():
            head = _head(node, indent)
            if isinstance(node, DecodePlan):
                head += f" sample={names('#', node.sample_id)}" if node.sample_id is not None else ""
                head += f" inputs={names('#', node.inputs_from)}" if node.inputs_from is not None else ""
            return [head] + _decode_rows(names, node.rids, node.slots, node.seq_lens, node.input_ids, node.kv_locs, inner)
        case MixedBatch() | MixedPlan():
            return [_head(node, indent)] + _dump(node.extend, names, inner) + _dump(node.decode, names, inner)
        case IdleBatch() | IdlePlan():
            return [_head(node, indent)]
        case DraftBatch():
            return [f"{_head(node, indent)} k={node.k} draft={names('#', node.draft_id)}"] + _window_rows(
                names, node.rids, node.slots, node.seq_lens, node.input_ids, None, node.kv_locs, node.k, inner, single=True
            )
        case VerifyBatch():
            head = f"{_head(node, indent)} k={node.k} verify={names('#', node.verify_id)} draft={names('#', node.draft_id)}"
            return [head] + _window_rows(
                names, node.rids, node.slots, node.seq_lens, node.input_ids, None, node.kv_locs, node.k, inner, single=False
            )
        case CommitBatch():
            lines = [f"{_head(node, indent)} k={node.k} verify={names('#', node.verify_id)} draft={names('#', node.draft_id)}"]
            lines += _window_rows(names, node.rids, node.slots, node.seq_lens, node.input_ids, node.accept_pos, node.kv_locs, node.k, inner, single=False)
            return lines + [f"{inner}released kv={names.kv(node.released_kv)}"]
        case DraftCommitBatch():
            return [f"{_head(node, indent)} k={node.k} draft={names('#', node.draft_id)}"] + _window_rows(
                names, node.rids, node.slots, node.seq_lens, node.input_ids, node.accept_pos, node.kv_locs, node.k, inner, single=False
            )
        case DraftExtendBatch():
            n = node.num_requests
            return [f"{_head(node, indent)} tokens={node.input_ids.shape[0]}"] + _extend_rows(
                names, node.rids, node.slots, node.prefix_lens, node.extend_lens, [False] * n,
                node.input_ids, node.kv_locs, None, inner,
            )
        case DraftPlan() | VerifyPlan() | CommitPlan() | DraftCommitPlan() | DraftExtendPlan():
            return [_head(node, indent)] + _dump(node.batch, names, inner)
        case _:
            assert_never(node)


def dump(node: Printable, *, exact: bool = False) -> str:
    """The deterministic text form of ``node`` (ends with a newline); ids renumbered unless ``exact``."""
    return "\n".join(_dump(node, _Names(exact), "")) + "\n"


def dump_all(nodes: Iterable[Printable], *, exact: bool = False) -> str:
    """Several nodes one after another, renumbered together (a request id or slot keeps one name
    across them); ``ir.parse.parse_all`` reads them back."""
    names = _Names(exact)
    return "".join("\n".join(_dump(node, names, "")) + "\n" for node in nodes)
