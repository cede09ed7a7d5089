"""``ir.wire``: plans as packed, versioned messages.

- Property: every plan kind packs and unpacks to an equal plan and the same step; the columns of the
  unpacked plan are IR-owned (read-only) and the message is not aliased.
- A message cut short, padded, with another magic or version, for another step, or with a broken
  header is refused with ``WireError`` naming what is wrong; so is a column edited so that a node
  breaks its invariants (the constructor's refusal, as ``WireError``).
- Canonical decoding: every degree of freedom the layout leaves (reserved field, step range,
  whitespace, key order, escapes, number forms, padding, column placement, bool bytes) is refused.
- Property: a valid message of any plan kind, mutated byte by byte (flips, inserts, deletes,
  truncations, bytes set to interesting values), is refused with ``WireError`` or is exactly the
  encoding of the plan it decodes to; nothing else escapes ``unpack``.
- The depth limit: ``MAX_DEPTH`` nested nodes and tuples pass it, one more is refused.
- ``pack`` refuses what is not a plan and a step that is not a non-negative int.
"""

from __future__ import annotations

import json
import random
import re
import struct
from typing import Any, get_args

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typeguard import suppress_type_checks

from compiler.testing.strategies import NODE_STRATEGIES
from ir.errors import IRValidationError
from ir.ids import DRAFT_POOL, TARGET_POOL
from ir.nodes import Plan
from ir.wire import MAGIC, MAX_DEPTH, WIRE_VERSION, WireError, pack, unpack
from passes.lower import LowerContext, lower
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from tests.helpers import cow, decode_batch, extend_plan, fresh

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAN_KINDS = sorted(t.__name__ for t in get_args(Plan))
PREFIX = struct.Struct("<4sHHQII")


def _prefill_message(step: int = 5) -> bytes:
    _, plan = extend_plan([fresh(1, 1, [5, 6, 7], 10), cow(2, 2, 3, 4, [8, 9], 20)], pools=(TARGET_POOL, DRAFT_POOL))
    return pack(step, plan)


def test_every_plan_kind_has_a_strategy() -> None:
    assert set(PLAN_KINDS) <= set(NODE_STRATEGIES)


@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_round_trip(kind: str) -> None:
    @FAST
    @given(NODE_STRATEGIES[kind], st.integers(0, 2**63 - 1))
    def check(plan: Any, step: int) -> None:
        message = pack(step, plan)
        got = unpack(message, expect_step=step)
        assert got.step == step and got.plan == plan and type(got.plan) is type(plan)
        again = unpack(bytes(message))
        assert again.plan == plan

    check()


def test_unpacked_columns_are_owned_and_read_only() -> None:
    message = bytearray(_prefill_message())
    plan = unpack(message).plan
    assert not plan.rids.flags.writeable  # type: ignore[union-attr]  # an ExtendPlan: it has rids
    before = plan.slots.copy()  # type: ignore[union-attr]
    message[-8:] = bytes(8)  # the message buffer changes afterwards: the plan does not
    assert np.array_equal(plan.slots, before)  # type: ignore[union-attr]


def test_a_message_for_another_step_is_refused() -> None:
    message = _prefill_message(step=7)
    with pytest.raises(WireError, match=r"message for step 7, expected step 8 \(replayed, skipped or out of order\)"):
        unpack(message, expect_step=8)
    assert unpack(message, expect_step=7).step == 7


def test_every_truncation_and_any_padding_is_refused() -> None:
    message = _prefill_message()
    for n in range(len(message)):
        with pytest.raises(WireError):
            unpack(message[:n])
    with pytest.raises(WireError, match="does not match its prefix"):
        unpack(message + b"\0" * 8)


def test_magic_and_version_are_checked() -> None:
    message = bytearray(_prefill_message())
    bad_magic = b"XXXX" + bytes(message[4:])
    with pytest.raises(WireError, match=r"not a plan message \(magic b'XXXX'\)"):
        unpack(bad_magic)
    struct.pack_into("<H", message, 4, WIRE_VERSION + 1)
    with pytest.raises(WireError, match=rf"version {WIRE_VERSION + 1}, this reader reads version {WIRE_VERSION}"):
        unpack(message)


def _with_header(message: bytes, edit: Any) -> bytes:
    """The message with its JSON header replaced by ``edit(header)`` (re-padded, prefix updated)."""
    magic, version, reserved, step, head_len, col_len = PREFIX.unpack_from(message)
    header = json.loads(message[PREFIX.size : PREFIX.size + head_len])
    text = json.dumps(edit(header)).encode()
    text += b" " * (-(PREFIX.size + len(text)) % 8)
    return PREFIX.pack(magic, version, reserved, step, len(text), col_len) + text + message[PREFIX.size + head_len :]


def test_a_broken_header_is_refused_naming_the_problem() -> None:
    message = _prefill_message()
    cases: list[tuple[Any, str]] = [
        (lambda h: {**h, "n": "Pickle"}, r"unknown node kind 'Pickle'"),
        (lambda h: {**h, "f": {k: v for k, v in h["f"].items() if k != "slots"}}, r"ExtendPlan has fields .* the message"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["f4", 0, 2]}}}, r"bad column descriptor \['f4', 0, 2\]"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["f8", 0, 2]}}}, r"ExtendPlan.slots: must be a 1-D sequence of ints, got dtype float64"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 8000, 2]}}}, r"column \[i8, 8000, 2\] lies outside"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 4, 2]}}}, r"column \[i8, 4, 2\] lies outside"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 144, 2]}}}, r"^plan message: ExtendPlan\.slots: column \[i8, 144, 2\] lies outside the message's 152 column bytes$"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", "16", 2]}}}, r"^plan message: ExtendPlan\.slots: bad column descriptor \['i8', '16', 2\]$"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 16, True]}}}, r"^plan message: ExtendPlan\.slots: bad column descriptor \['i8', 16, True\]$"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": [["i8"], 16, 2]}}}, r"^plan message: ExtendPlan\.slots: bad column descriptor"),
        (lambda h: {**h, "f": {**h["f"], "slots": [1, 2]}}, r"^plan message: ExtendPlan\.slots: bad value \[1, 2\]$"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"x": 1}}}, r"^plan message: ExtendPlan\.slots: bad value \{'x': 1\}$"),
        # a long bad value is shown by its first 80 characters (a hostile header does not flood the log)
        (lambda h: {**h, "f": {**h["f"], "slots": [7] * 100}}, r"^plan message: ExtendPlan\.slots: bad value \[" + "7, " * 26 + "7$"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"x": "y" * 100}}}, r"^plan message: ExtendPlan\.slots: bad value \{'x': '" + "y" * 73 + "$"),
        (lambda h: {"t": []}, r"holds a tuple, not a plan"),
    ]
    for edit, match in cases:
        with pytest.raises(WireError, match=match):
            unpack(_with_header(message, edit))
    magic, version, reserved, step, head_len, col_len = PREFIX.unpack_from(message)
    deep = b'{"t":[' * 100_000 + b'{"t":[]}' + b"]}" * 100_000
    deep += b" " * (-(PREFIX.size + len(deep)) % 8)
    with pytest.raises(WireError, match="header nests deeper than any plan"):
        unpack(PREFIX.pack(magic, version, reserved, step, len(deep), col_len) + deep + message[PREFIX.size + head_len :])
    garbage = b"{not json" + b" " * (head_len - 9)
    with pytest.raises(WireError, match="header is not JSON"):
        unpack(message[: PREFIX.size] + garbage + message[PREFIX.size + head_len :])


def test_a_column_edited_into_an_invalid_plan_is_refused_by_the_constructor_as_a_wire_error() -> None:
    running = decode_batch([1, 2], [3, 4], [5, 9], [50, 90])
    plan = lower(prepare_for_decode(running, DecodeContext(next_tokens=[7, 8], kv_locs=[51, 91])), LowerContext())
    message = bytearray(pack(1, plan))
    _, _, _, _, head_len, _ = PREFIX.unpack_from(message)
    header = json.loads(message[PREFIX.size : PREFIX.size + head_len])
    offset = header["f"]["slots"]["c"][1]
    struct.pack_into("<q", message, PREFIX.size + head_len + offset, 0)  # slot 0 is the padding row
    with pytest.raises(WireError, match=r"^plan message: DecodePlan\.slots: every value must be >= 1 \(got 0\)$") as info:
        unpack(message)
    assert isinstance(info.value.__cause__, IRValidationError)  # the constructor's own refusal, kept as the cause


@pytest.mark.parametrize("step", [True, -1, 1.0, "3", None, 2**63])
def test_pack_refuses_a_bad_step(step: object) -> None:
    _, plan = extend_plan([fresh(1, 1, [5], 10)])
    with suppress_type_checks(), pytest.raises(WireError, match=r"^plan message: step "):  # production runs without typeguard
        pack(step, plan)  # type: ignore[arg-type]  # the point: a bad step


def test_pack_refuses_what_is_not_a_plan() -> None:
    batch, _ = extend_plan([fresh(1, 1, [5], 10)])
    with suppress_type_checks():  # production runs without typeguard: the function's own checks must hold
        with pytest.raises(WireError, match="only plans travel, not ExtendBatch"):
            pack(0, batch)  # type: ignore[arg-type]  # the point: a batch is not a plan
        with pytest.raises(WireError, match="a message is bytes, not str"):
            unpack("BCPL")  # type: ignore[arg-type]  # the point: not bytes


def test_the_prefix_is_the_documented_layout() -> None:
    message = _prefill_message(step=9)
    magic, version, reserved, step, head_len, col_len = PREFIX.unpack_from(message)
    assert (magic, version, reserved, step) == (MAGIC, WIRE_VERSION, 0, 9)
    assert len(message) == PREFIX.size + head_len + col_len and (PREFIX.size + head_len) % 8 == 0


# -- refused, not crashed: the regressions ------------------------------------------------------


def _header_text(message: bytes) -> bytes:
    head_len = PREFIX.unpack_from(message)[4]
    return message[PREFIX.size : PREFIX.size + head_len].rstrip(b" ")


def _with_text(message: bytes, text: bytes, *, columns: bytes | None = None) -> bytes:
    """``message`` with its header text replaced verbatim (re-padded, prefix lengths updated)."""
    magic, version, reserved, step, head_len, col_len = PREFIX.unpack_from(message)
    cols = message[PREFIX.size + head_len :] if columns is None else columns
    text += b" " * (-(PREFIX.size + len(text)) % 8)
    return PREFIX.pack(magic, version, reserved, step, len(text), len(cols)) + text + cols


def _with_serial(message: bytes, serial: bytes) -> bytes:
    """``message`` with the first ticket's serial written as ``serial``."""
    return _with_text(message, re.sub(rb'"serial":\d+', b'"serial":' + serial, _header_text(message), count=1))


def test_a_5000_digit_header_integer_is_refused_as_a_wire_error() -> None:
    message = _prefill_message()
    with pytest.raises(WireError, match=r"^plan message: integer of 5000 characters \(1{20}\.\.\.\): the format's integers are int64$"):
        unpack(_with_serial(message, b"1" * 5000))  # was: ValueError (Python's int-string digit limit)
    for digits in (21, 4300, 4301, 100_000):
        with pytest.raises(WireError, match=rf"integer of {digits + 1} characters"):
            unpack(_with_text(message, b"[-" + b"9" * digits + b"]"))
    # 20 characters hold every int64 and more: past int64, the node's constructor refuses it
    with pytest.raises(WireError, match=r"^plan message: MambaInit\.serial"):
        unpack(_with_serial(message, b"9" * 20))


def _bool_offsets(message: bytes) -> list[int]:
    """Absolute offsets of every bool column byte of ``message``."""
    head_len = PREFIX.unpack_from(message)[4]
    base = PREFIX.size + head_len
    out: list[int] = []

    def walk(v: object) -> None:
        if isinstance(v, dict) and "c" in v and v["c"][0] == "b1":
            out.extend(range(base + v["c"][1], base + v["c"][1] + v["c"][2]))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(json.loads(_header_text(message)))
    return out


def test_a_bool_column_byte_other_than_0_or_1_is_refused() -> None:
    message = _prefill_message()
    [first, second] = _bool_offsets(message)  # more_chunks of the two requests, both False
    one = bytearray(message)
    one[first] = 1
    assert unpack(one).plan.more_chunks.tolist() == [True, False]  # type: ignore[union-attr]  # an ExtendPlan
    for byte in range(2, 256):
        bad = bytearray(message)
        bad[second] = byte  # was: accepted, a plan unequal to the one sent with 0x01
        with pytest.raises(WireError, match=rf"^plan message: ExtendPlan\.more_chunks: bool column row 1 is byte {byte:#04x}, not 0 or 1$"):
            unpack(bad)


def test_a_bool_array_holding_other_bytes_packs_as_0_and_1() -> None:
    _, plan = extend_plan([fresh(1, 1, [5], 10), fresh(2, 2, [6], 20)])
    raw = np.frombuffer(bytes([0, 7]), dtype=np.bool_)  # a bool array whose memory holds 0x07 (IR-owned: kept as it is)
    odd = attrs.evolve(plan, more_chunks=raw)
    assert odd.more_chunks.tobytes() == b"\x00\x07"
    got = unpack(pack(0, odd)).plan
    assert got.more_chunks.tobytes() == b"\x00\x01"  # type: ignore[union-attr]  # an ExtendPlan: it has more_chunks


# -- canonical: every degree of freedom of the layout, refused ---------------------------------


def _set_prefix(message: bytes, index: int, value: int) -> bytes:
    fields = list(PREFIX.unpack_from(message))
    fields[index] = value
    return PREFIX.pack(*fields) + message[PREFIX.size :]


def _columns(message: bytes) -> bytes:
    return message[PREFIX.size + PREFIX.unpack_from(message)[4] :]


def _non_canonical(message: bytes) -> list[tuple[str, bytes, str]]:
    text = _header_text(message)
    tree = json.loads(text)
    cols = _columns(message)
    spaced = json.dumps(tree).encode()  # the default separators: ", " and ": "
    reordered = json.dumps({"f": tree["f"], "n": tree["n"]}, separators=(",", ":")).encode()
    assert b'"target"' in text and b'"c":["i8",0,2]' in text and b'"clear_slots":{"t":[1]}' in text and b'"kv_locs":{"c":["i8",112,5]}' in text
    assert len(cols) == 152
    pad = -(PREFIX.size + len(text)) % 8  # (the serials' digits, so the header's length, vary from run to run)
    more = tree["f"]["more_chunks"]["c"][1]  # the 2-byte bool column: 6 bytes of padding follow it
    padded = bytearray(cols)
    padded[more + 2] = 1
    return [
        ("reserved field", _set_prefix(message, 2, 1), r"reserved field is 1, not 0"),
        ("step out of pack's range", _set_prefix(message, 3, 2**63), r"step 9223372036854775808 is over 2\*\*63 - 1"),
        ("whitespace", _with_text(message, spaced),
         r"^plan message: not in canonical form: header at byte 5: the message has b' \"ExtendPlan\", \"', the encoding of its plan b'\"ExtendPlan\",\"f\"'$"),
        ("leading whitespace", _with_text(message, b" " + text), r"not in canonical form: header at byte 0"),
        ("key order", _with_text(message, reordered), r"not in canonical form: header at byte 2"),
        ("duplicate key", _with_text(message, b'{"n":"IdlePlan",' + text[1:]), r"not in canonical form: header at byte 6: the message has b'IdlePlan"),
        ("escaped letter", _with_text(message, text.replace(b'"target"', b'"\\u0074arget"')), r"not in canonical form: header at byte \d+: the message has b'\\\\u0074arget"),
        ("escaped slash", _with_text(message, text.replace(b'"target"', b'"t\\/rget"')), r"not in canonical form: header at byte \d+: the message has b'\\\\/rget"),
        ("raw UTF-8", _with_text(message, text.replace(b'"target"', '"tärget"'.encode())), r"header is not ASCII \(byte \d+ is 0xc3\)"),
        ("minus zero", _with_text(message, text.replace(b'"c":["i8",0,2]', b'"c":["i8",-0,2]', 1)), r"not in canonical form: header at byte 41: the message has b'-0,2]"),
        ("fraction", _with_text(message, text.replace(b'"c":["i8",0,2]', b'"c":["i8",0.0,2]', 1)), r"number '0\.0' is not an integer"),
        ("exponent", _with_text(message, text.replace(b'"c":["i8",0,2]', b'"c":["i8",0e0,2]', 1)), r"number '0e0' is not an integer"),
        ("NaN", _with_text(message, text.replace(b'"c":["i8",0,2]', b'"c":["i8",NaN,2]', 1)), r"number 'NaN' is not an integer"),
        ("true for 1", _with_text(message, text.replace(b'"clear_slots":{"t":[1]}', b'"clear_slots":{"t":[true]}', 1)), r"MambaInit\.clear_slots"),
        ("a tuple for a column", _with_text(message, text.replace(b'"rids":{"c":["i8",0,2]}', b'"rids":{"t":[1,2]}', 1)),
         r"not in canonical form: header at byte 32: the message has b't\":\[1,2\]"),
        ("8 more padding spaces", _with_text(message, text + b" " * 8), rf"header padded with {pad + 8} spaces, not the {pad} that align it"),
        ("tab padding", _with_text(message, text + b"\t"), r"not in canonical form: header at byte \d+: the message has b'\\t'"),
        ("trailing column bytes", _with_text(message, text, columns=cols + bytes(8)), r"not in canonical form: column bytes at byte \d+"),
        ("nonzero column padding", _with_text(message, text, columns=bytes(padded)), rf"not in canonical form: column bytes at byte {more + 2}: the message has b'\\x01"),
        ("aliased column", _with_text(message, text.replace(b'"slots":{"c":["i8",16,2]}', b'"slots":{"c":["i8",0,2]}', 1)),
         r"not in canonical form: header at byte 66: the message has b'0,2\]"),
        ("a gap before a column", _with_text(message, text.replace(b'"kv_locs":{"c":["i8",112,5]}', b'"kv_locs":{"c":["i8",152,5]}', 1),
                                             columns=cols + cols[112:152]), r"not in canonical form: header at byte \d+: the message has b'52,5\]\},.*the encoding of its plan b'12,5"),
    ]


def test_every_non_canonical_encoding_is_refused() -> None:
    message = _prefill_message()
    assert unpack(message).plan is not None
    for what, bad, match in _non_canonical(message):
        assert bad != message, what
        with pytest.raises(WireError, match=match):
            unpack(bad)


# -- property: a mutated message is refused, or it is exactly its plan's encoding -----------------

INTERESTING = sorted({0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF, *b' \t0123456789-+.eE"\\{}[],:tnfu'})


def _refused_or_canonical(message: bytes) -> bool:
    """Exactly the wire's promise: ``unpack`` raises ``WireError`` (anything else fails the test)
    or returns a plan whose encoding is ``message`` itself."""
    try:
        got = unpack(message)
    except WireError:
        return False
    assert pack(got.step, got.plan) == message
    return True


def _relaid(original: bytes, mutated: bytearray, at: int, grew: int) -> bytes:
    """After a byte was inserted (``grew`` 1) or deleted (-1) at ``at``: the prefix's lengths fixed
    so that the edit gets past the length check (the header re-padded to alignment)."""
    magic, version, reserved, step, head_len, col_len = PREFIX.unpack_from(original)
    head_end = PREFIX.size + head_len
    if at < PREFIX.size:
        return bytes(mutated)
    if at < head_end:
        text = bytes(mutated[PREFIX.size : head_end + grew]).rstrip(b" ")
        return _with_text(bytes(mutated), text, columns=bytes(mutated[head_end + grew :]))
    return PREFIX.pack(magic, version, reserved, step, head_len, max(col_len + grew, 0)) + bytes(mutated[PREFIX.size :])


@st.composite
def mutated_messages(draw: st.DrawFn, kind: str) -> bytes:
    message = pack(draw(st.integers(0, 2**63 - 1)), draw(NODE_STRATEGIES[kind]))
    head_end = PREFIX.size + PREFIX.unpack_from(message)[4]
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))  # uniform edits (hypothesis's own draws favour small values)
    out = bytearray(message)
    for _ in range(rnd.randint(1, 3)):
        op = rnd.choice(["flip", "set", "set", "insert", "delete", "truncate"])
        # the header holds most of the degrees of freedom: half the edits go there
        at = rnd.randrange(len(out)) if rnd.random() < 0.5 else rnd.randrange(PREFIX.size, min(head_end, len(out)))
        if op == "flip":
            out[at] ^= 1 << rnd.randrange(8)
        elif op == "set":
            out[at] = rnd.choice(INTERESTING)
        elif op == "truncate":
            return bytes(out[:at])
        else:
            if op == "insert":
                out.insert(at, rnd.choice(INTERESTING))
            else:
                del out[at]
            if rnd.random() < 0.5:  # half of them with the lengths made to fit
                return _relaid(message, out, at, 1 if op == "insert" else -1)
    return bytes(out)


@pytest.mark.slow  # the full run's: the fast tier keeps the round trip and the refusals of each defect
@pytest.mark.parametrize("kind", PLAN_KINDS)
def test_a_mutated_message_is_refused_or_is_the_encoding_of_its_plan(kind: str) -> None:
    @settings(max_examples=50, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutated_messages(kind))
    def check(message: bytes) -> None:
        _refused_or_canonical(message)

    check()


# -- the depth limit ----------------------------------------------------------------------------


def _nested_tuples(n: int) -> bytes:
    return b'{"t":[' * n + b"]}" * n


def test_the_depth_limit_passes_max_depth_nested_tuples_and_refuses_one_more() -> None:
    message = _prefill_message()
    with pytest.raises(WireError, match=r"^plan message: the message holds a tuple, not a plan$"):
        unpack(_with_text(message, _nested_tuples(MAX_DEPTH)))
    with pytest.raises(WireError, match=rf"^plan message: message(\[0\]){{{MAX_DEPTH}}}: header nests deeper than any plan \(over {MAX_DEPTH} nodes"):
        unpack(_with_text(message, b'{"t":[' + _nested_tuples(MAX_DEPTH) + b"]}"))


def test_the_depth_limit_holds_inside_a_plan() -> None:
    message = _prefill_message()
    text = _header_text(message)
    deep = re.sub(rb'"clear_slots":\{"t":\[1\]\}', b'"clear_slots":' + _nested_tuples(MAX_DEPTH), text, count=1)
    assert deep != text
    with pytest.raises(WireError, match=r"^plan message: MambaInit\.clear_slots(\[0\])+: header nests deeper than any plan"):
        unpack(_with_text(message, deep))


# -- the decoder holds for node kinds it was not written for -------------------------------------


@attrs.frozen(kw_only=True)
class _Fragile:
    x: int

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.x, int):
            raise TypeError("a constructor that does not check its own fields")  # (the IR's nodes do: a future one might not)


def test_a_constructor_that_raises_something_else_is_a_refused_message(monkeypatch: pytest.MonkeyPatch) -> None:
    from ir import wire

    monkeypatch.setitem(wire._CLASSES, "_Fragile", _Fragile)
    message = _prefill_message()
    text = _header_text(message).replace(b'"cow_src":{"t":[3]}', b'"cow_src":{"n":"_Fragile","f":{"x":"three"}}', 1)
    with pytest.raises(WireError, match=r"^plan message: _Fragile: TypeError: a constructor that does not check its own fields$"):
        unpack(_with_text(message, text))


def test_pack_refuses_a_column_that_is_not_1d_int64_float64_or_bool() -> None:
    _, plan = extend_plan([fresh(1, 1, [5], 10)])
    for bad in (np.zeros((1, 1), np.int64), np.zeros(1, np.int32)):
        odd = attrs.evolve(plan)
        object.__setattr__(odd, "rids", bad)  # past the constructor, which would convert it
        with pytest.raises(WireError, match=rf"^plan message: a column must be 1-D int64, float64 or bool, got {bad.dtype} of shape"):
            pack(0, odd)


def test_pack_names_a_negative_step_and_a_message_over_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from ir import wire

    _, plan = extend_plan([fresh(1, 1, [5], 10)])
    with pytest.raises(WireError, match=r"^plan message: step must be >= 0 \(got -1\)$"):
        pack(-1, plan)
    size = len(pack(0, plan))
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", size - 1)  # (the real bound, 2 GiB, is too big for a test)
    with pytest.raises(WireError, match=rf"^plan message: a message of {size} bytes is over the bound {size - 1}$"):
        pack(0, plan)
