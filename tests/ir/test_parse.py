"""``ir.parse`` reads back what ``ir.printer.dump`` writes.

- Property: for valid nodes of every kind the printer prints (hypothesis strategies below),
  ``parse(dump(node, exact=True)) == node``, and a renumbered dump parses to a node whose dump is
  that same text.
- Every IR node in the inputs and outputs of the per-pass goldens (``tests/golden/passes/``) and
  in the scenario goldens (``tests/golden/``) parses, and the parsed node prints (``exact``: the
  numbers as written) to the very text it was read from.
- The module docstring's example runs; bad text raises ``ParseError`` naming the line and the word.
"""

from __future__ import annotations

import doctest
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ir.parse
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch, MixedBatch
from ir.ids import MambaSlot, PoolId, RequestId, TicketSerial
from ir.init import InitIntent, InitTicket, MambaInit, MambaSnapshot, SnapshotTicket
from ir.parse import ParseError, parse, parse_all
from ir.plan import DecodePlan, ExtendPlan, IdlePlan, MixedPlan
from ir.printer import dump, dump_all
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
from tests.helpers import GOLDEN

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies --------------------------------------------------------------------------------------

serials = st.integers(1, 2**62)
rid_values = st.integers(-(2**40), 2**40)
tokens = st.integers(0, 2**31)
lengths = st.integers(1, 6)


def _unique(elements: st.SearchStrategy[int], n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(elements, min_size=n, max_size=n, unique=True)


@st.composite
def mamba_inits(draw: Any) -> MambaInit:
    a, b = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if a + b == 0:
        a = 1
    slots = draw(_unique(st.integers(1, 10_000), a + 2 * b))
    return MambaInit(serial=TicketSerial(draw(serials)), clear_slots=slots[:a], cow_src=slots[a : a + b], cow_dst=slots[a + b :])


@st.composite
def mamba_snapshots(draw: Any) -> MambaSnapshot:
    n = draw(st.integers(1, 3))
    slots = draw(_unique(st.integers(1, 10_000), 2 * n))
    return MambaSnapshot(serial=TicketSerial(draw(serials)), src=slots[:n], dst=slots[n:])


pools = st.sampled_from(["target", "draft", "a pool", 'q"uote', "ümlaut"])


@st.composite
def extend_columns(draw: Any, *, min_rows: int = 1) -> dict[str, Any]:
    n = draw(st.integers(min_rows, 4))
    ext = draw(st.lists(lengths, min_size=n, max_size=n))
    total = sum(ext)
    return {
        "rids": draw(_unique(rid_values, n)),
        "slots": draw(_unique(st.integers(1, 10_000), n)),
        "prefix_lens": draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n)),
        "extend_lens": ext,
        "input_ids": draw(st.lists(tokens, min_size=total, max_size=total)),
        "kv_locs": draw(_unique(st.integers(0, 100_000), total)),
        "more_chunks": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
    }


@st.composite
def extend_batches(draw: Any) -> ExtendBatch:
    cols = draw(extend_columns())
    n = len(cols["rids"])
    return ExtendBatch(
        **cols,
        intents=tuple(draw(st.lists(st.sampled_from(list(InitIntent)), min_size=n, max_size=n))),
        init=draw(st.none() | mamba_inits()),
        snapshot=draw(st.none() | mamba_snapshots()),
    )


@st.composite
def extend_plans(draw: Any) -> ExtendPlan:
    cols = draw(extend_columns())
    names = draw(st.lists(pools, unique=True, max_size=2))
    init = draw(mamba_inits())
    snap = draw(mamba_snapshots())
    snap_pools = draw(st.lists(pools, unique=True, max_size=2))
    return ExtendPlan(
        **cols,
        tickets=tuple(InitTicket(pool=PoolId(p), init=init) for p in names),
        snapshots=tuple(SnapshotTicket(pool=PoolId(p), snapshot=snap) for p in snap_pools),
    )


@st.composite
def decode_columns(draw: Any) -> dict[str, Any]:
    n = draw(st.integers(0, 4))
    return {
        "rids": draw(_unique(rid_values, n)),
        "slots": draw(_unique(st.integers(1, 10_000), n)),
        "seq_lens": draw(st.lists(st.integers(1, 2**31 - 1), min_size=n, max_size=n)),
        "input_ids": draw(st.lists(tokens, min_size=n, max_size=n)),
        "kv_locs": draw(_unique(st.integers(0, 100_000), n)),
    }


@st.composite
def windows(draw: Any, *, single: bool) -> dict[str, Any]:
    k, n = draw(st.integers(1, 4)), draw(st.integers(0, 3))
    w = n * (k + 1)
    return {
        "k": k,
        "rids": draw(_unique(rid_values, n)),
        "slots": draw(_unique(st.integers(1, 10_000), n)),
        "seq_lens": draw(st.lists(st.integers(1, 100_000), min_size=n, max_size=n)),
        "input_ids": draw(st.lists(tokens, min_size=n if single else w, max_size=n if single else w)),
        "kv_locs": draw(_unique(st.integers(0, 100_000), w)),
    }


@st.composite
def commit_batches(draw: Any) -> CommitBatch:
    cols = draw(windows(single=False))
    n, k = len(cols["rids"]), cols["k"]
    accept = draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    released = draw(_unique(st.integers(0, 100_000), n * k - sum(accept)))
    return CommitBatch(**cols, verify_id=TicketSerial(draw(serials)), accept_pos=accept, released_kv=released)


@st.composite
def draft_commit_batches(draw: Any) -> DraftCommitBatch:
    cols = draw(windows(single=False))
    n, k = len(cols["rids"]), cols["k"]
    accept = draw(st.lists(st.integers(0, k), min_size=n, max_size=n))
    return DraftCommitBatch(**cols, draft_id=TicketSerial(draw(serials)), accept_pos=accept)


@st.composite
def draft_extend_batches(draw: Any) -> DraftExtendBatch:
    cols = draw(extend_columns())
    del cols["more_chunks"]
    return DraftExtendBatch(**cols)


@st.composite
def admitted(draw: Any) -> AdmittedRequest:
    slot = draw(st.integers(1, 10_000))
    n = draw(lengths)
    intent = draw(
        st.just(Clear())
        | st.builds(Continue, prefix_len=st.integers(1, 5000))
        | st.builds(CopyFrom, src=st.integers(1, 10_000).filter(lambda s: s != slot).map(MambaSlot), prefix_len=st.integers(1, 5000))
    )
    snap = draw(st.none() | st.integers(1, 10_000).filter(lambda s: s != slot).map(MambaSlot))
    return AdmittedRequest(
        rid=RequestId(draw(rid_values)), slot=MambaSlot(slot), input_ids=draw(st.lists(tokens, min_size=n, max_size=n)),
        kv_locs=draw(_unique(st.integers(0, 100_000), n)), intent=intent, more_chunks=draw(st.booleans()), snapshot_to=snap,
    )


@st.composite
def accept_results(draw: Any) -> AcceptResult:
    n = draw(st.integers(0, 4))
    return AcceptResult(accepted=draw(st.lists(st.integers(0, 64), min_size=n, max_size=n)), bonus=draw(st.lists(tokens, min_size=n, max_size=n)))


decode_batches = decode_columns().map(lambda c: DecodeBatch(**c))
decode_plans = decode_columns().map(lambda c: DecodePlan(**c))
draft_batches = st.builds(lambda c, d: DraftBatch(**c, draft_id=TicketSerial(d)), windows(single=True), serials)
verify_batches = st.builds(lambda c, v: VerifyBatch(**c, verify_id=TicketSerial(v)), windows(single=False), serials)

NODES: dict[str, st.SearchStrategy[Any]] = {
    "ExtendBatch": extend_batches(),
    "DecodeBatch": decode_batches,
    "MixedBatch": st.builds(lambda e, d: MixedBatch(extend=e, decode=d), extend_batches(), decode_batches),
    "IdleBatch": st.just(IdleBatch()),
    "ExtendPlan": extend_plans(),
    "DecodePlan": decode_plans,
    "MixedPlan": st.builds(lambda e, d: MixedPlan(extend=e, decode=d), extend_plans(), decode_plans),
    "IdlePlan": st.just(IdlePlan()),
    "DraftBatch": draft_batches,
    "VerifyBatch": verify_batches,
    "CommitBatch": commit_batches(),
    "DraftCommitBatch": draft_commit_batches(),
    "DraftExtendBatch": draft_extend_batches(),
    "DraftPlan": draft_batches.map(lambda b: DraftPlan(batch=b)),
    "VerifyPlan": verify_batches.map(lambda b: VerifyPlan(batch=b)),
    "CommitPlan": commit_batches().map(lambda b: CommitPlan(batch=b)),
    "DraftCommitPlan": draft_commit_batches().map(lambda b: DraftCommitPlan(batch=b)),
    "DraftExtendPlan": draft_extend_batches().map(lambda b: DraftExtendPlan(batch=b)),
    "MambaInit": mamba_inits(),
    "MambaSnapshot": mamba_snapshots(),
    "InitTicket": st.builds(lambda p, i: InitTicket(pool=PoolId(p), init=i), pools, mamba_inits()),
    "SnapshotTicket": st.builds(lambda p, s: SnapshotTicket(pool=PoolId(p), snapshot=s), pools, mamba_snapshots()),
    "AdmittedRequest": admitted(),
    "AcceptResult": accept_results(),
}


def test_every_kind_the_parser_reads_has_a_strategy() -> None:
    assert set(NODES) == set(ir.parse._KINDS)


@pytest.mark.parametrize("kind", sorted(NODES))
def test_exact_dump_round_trips(kind: str) -> None:
    @FAST
    @given(NODES[kind])
    def check(node: Any) -> None:
        assert type(node).__name__ == kind
        text = dump(node, exact=True)
        assert parse(text) == node, text
        canonical = dump(node)
        assert dump(parse(canonical)) == canonical

    check()


# -- goldens -----------------------------------------------------------------------------------------

_CONTEXTS = re.compile(r"^(DecodeContext|SpecContext|LowerContext|tokens|rids) ")
"""Pass arguments that are not IR nodes (``passes``' contexts, token and rid lists): the golden shows
them in its own form, which ``ir.parse`` does not read."""


def _values(section: str) -> list[str]:
    """The top-level values of a golden section, each with the lines indented under it."""
    values: list[str] = []
    for line in section.splitlines(keepends=True):
        if line.startswith(" ") and values:
            values[-1] += line
        else:
            values.append(line)
    return values


def _golden_nodes() -> list[tuple[str, str]]:
    out = []
    for path in sorted(GOLDEN.rglob("*.txt")):
        for block in re.split(r"^-- .* --\n", path.read_text(), flags=re.M):
            for section in re.split(r"^== (?:input|output) ==\n", block, flags=re.M):
                for value in _values(section):
                    if not _CONTEXTS.match(value):
                        out.append((f"{path.relative_to(GOLDEN)}", value))
    return out


def test_golden_inputs_and_outputs_parse_back() -> None:
    nodes = _golden_nodes()
    assert len(nodes) > 50
    passes_inputs = [v for p, v in nodes if p.startswith("passes/")]
    assert passes_inputs
    for path, text in nodes:
        try:
            node = parse(text)
        except ParseError as e:
            raise AssertionError(f"{path}: {e}\n{text}") from e
        assert dump(node, exact=True) == text, path


# -- the format's documentation and its errors -------------------------------------------------------


def test_module_docstring_example_runs() -> None:
    result = doctest.testmod(ir.parse, raise_on_error=False, verbose=False)
    assert result.attempted >= 2 and result.failed == 0


def test_dump_all_round_trips() -> None:
    requests = [
        AdmittedRequest(rid=RequestId(10), slot=MambaSlot(3), input_ids=[5], kv_locs=[20], intent=Clear()),
        AdmittedRequest(rid=RequestId(11), slot=MambaSlot(4), input_ids=[6], kv_locs=[21], intent=CopyFrom(src=MambaSlot(3), prefix_len=2)),
    ]
    assert parse_all(dump_all(requests, exact=True)) == requests
    assert dump_all(requests).splitlines()[1].startswith("AdmittedRequest r1 s2 intent=cow src=s1 ")


def test_hand_written_text_parses() -> None:
    text = """
ExtendBatch requests=2 tokens=3
  init #1 clear[s1] cow[s3->s2]
  r0 s1 prefix=0 extend=2 init=clear tokens=[5 6] kv=k0..k1
  r1 s2 prefix=4 extend=1 init=cow more tokens=[7] kv=k2
"""
    batch = parse(text)
    assert isinstance(batch, ExtendBatch)
    assert batch.slots.tolist() == [1, 2] and batch.more_chunks.tolist() == [False, True]
    assert batch.init == MambaInit(serial=TicketSerial(1), clear_slots=(1,), cow_src=(3,), cow_dst=(2,))
    assert parse_all(dump(batch, exact=True) + dump(IdleBatch())) == [batch, IdleBatch()]


@pytest.mark.parametrize(
    ("text", "line", "token", "message"),
    [
        ("DecodeBatch requests=1\n  r0 s1 seq=x token=1 kv=k0\n", 2, "seq=x", "expected an integer"),
        ("DecodeBatch requests=2\n  r0 s1 seq=3 token=1 kv=k0\n", 1, "requests=2", "1 rows follow"),
        ("Batch requests=0\n", 1, "Batch", "unknown node kind"),
        ("DecodeBatch requests=1\n  r0 x1 seq=3 token=1 kv=k0\n", 2, "x1", "expected a s<int> name"),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1 kv=k0 extra\n", 2, "extra", "unexpected word"),
        ("DecodeBatch requests=1\n  r0 s0 seq=3 token=1 kv=k0\n", 1, "DecodeBatch", "DecodeBatch.slots: every value must be >= 1"),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1 kv=k5..k2\n", 2, "k5..k2", "must not descend"),
        ("IdleBatch requests=0\nIdleBatch requests=0\n", 2, "IdleBatch", "end of the text"),
        ("ExtendBatch requests=1 tokens=1\n  r0 s1 prefix=0 extend=1 init=clear tokens=[1] kv=k0\n", 2, "r0", "init"),
        ("", 1, "<end of text>", "expected a node"),
    ],
)
def test_parse_errors_name_line_and_token(text: str, line: int, token: str, message: str) -> None:
    with pytest.raises(ParseError) as info:
        parse(text)
    assert (info.value.line, info.value.token) == (line, token), str(info.value)
    assert message in str(info.value)
    assert str(info.value).startswith(f"line {line}: ")


def test_exact_dump_keeps_real_values() -> None:
    b = DecodeBatch(rids=[-3, 40], slots=[7, 9], seq_lens=[2, 5], input_ids=[1, 2], kv_locs=np.array([10, 11]))
    assert dump(b, exact=True) == "DecodeBatch requests=2\n  r-3 s7 seq=2 token=1 kv=k10\n  r40 s9 seq=5 token=2 kv=k11\n"
    assert dump(b) == "DecodeBatch requests=2\n  r0 s1 seq=2 token=1 kv=k0\n  r1 s2 seq=5 token=2 kv=k1\n"
