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

import ir.parse
from compiler.testing.strategies import NODE_STRATEGIES
from ir.batch import DecodeBatch, ExtendBatch, IdleBatch
from ir.ids import MambaSlot, RequestId, TicketSerial
from ir.init import MambaInit
from ir.parse import ParseError, parse, parse_all
from ir.printer import PRINTABLE, dump, dump_all
from ir.request import AdmittedRequest, Clear, CopyFrom
from tests.helpers import GOLDEN

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])



def test_every_kind_the_parser_reads_has_a_strategy() -> None:
    assert set(NODE_STRATEGIES) == set(PRINTABLE)


@pytest.mark.slow  # the full run's: the fast tier keeps the golden dumps' round trip below
@pytest.mark.parametrize("kind", sorted(NODE_STRATEGIES))
def test_exact_dump_round_trips(kind: str) -> None:
    @FAST
    @given(NODE_STRATEGIES[kind])
    def check(node: Any) -> None:
        assert type(node).__name__ == kind
        text = dump(node, exact=True)
        assert parse(text) == node, text
        canonical = dump(node)
        assert dump(parse(canonical)) == canonical

    check()


# -- goldens -----------------------------------------------------------------------------------------

_CONTEXTS = re.compile(r"^(DecodeContext|SpecContext|LowerContext|Proposals|HiddenStates|Verified|tokens|rids|keep_hidden) ")
"""Pass arguments that are not batches or plans (``passes``' contexts, a draft executor's
``Proposals``, a target's ``HiddenStates`` or ``Verified`` tokens, token and rid lists, a keyword argument): the golden
shows them in its own form, which ``ir.parse`` does not read."""


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
        ("AdmittedRequest r1 s2 intent=clear tokens=[5 6] kv=k0..k1 extra\n", 1, "extra", "unexpected word"),
        ("MambaInit #1 clear[s1] cow[s3->s2] extra\n", 1, "extra", "unexpected word"),
        ("DecodeBatch requests=1\n  r0 s0 seq=3 token=1 kv=k0\n", 1, "DecodeBatch", "DecodeBatch.slots: every value must be >= 1"),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1 kv=k5..k2\n", 2, "k5..k2", "must not descend"),
        ("IdleBatch requests=0\nIdleBatch requests=0\n", 2, "IdleBatch", "end of the text"),
        ("ExtendBatch requests=1 tokens=1\n  r0 s1 prefix=0 extend=1 init=clear tokens=[1] kv=k0\n", 2, "r0", "init"),
        ("", 1, "<end of text>", "expected a node"),
        ("DecodeBatch requests=1\n  r0 s1 seq=3 token=1 kv=k0..k1\n", 2, "kv=k0..k1", "a row has one KV location in kv="),
        ("ExtendBatch requests=1 tokens=2\n  init none\n  r0 s1 prefix=4 extend=2 init=continue tokens=[1] kv=k0..k1\n", 3, "tokens=[1]",
         "extend=2 needs 2 values in tokens=, got 1"),
        ("VerifyBatch requests=1 k=2 verify=#1 draft=#2\n  r0 s1 seq=3 tokens=[1 2 3] kv=k0..k1\n", 2, "kv=k0..k1", "k=2 needs 3 values in kv=, got 2"),
        ("AdmittedRequest r1 s2 intent=copy tokens=[5] kv=k0\n", 1, "intent=copy", "expected intent=clear, intent=cow or intent=continue"),
        ("IdleBatch requests=1\n", 1, "requests=1", "requests=1 but its parts hold 0"),
        ("Ticket op=init #1 clear[s1] cow[] pool=\"x\" extra\n", 1, "extra", "unexpected word"),
        ("CommitBatch requests=0 k=1 verify=#1 draft=#2\n  kept kv=-\n", 2, "kept", "expected released kv=..."),
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
