"""``ir.wire``: plans as packed, versioned messages.

- Property: every plan kind packs and unpacks to an equal plan and the same step; the columns of the
  unpacked plan are IR-owned (read-only) and the message is not aliased.
- A message cut short, padded, with another magic or version, for another step, or with a broken
  header is refused with ``WireError`` naming what is wrong; a column edited so that a node breaks
  its invariants is refused by that node's constructor (``IRValidationError``). Random corruption
  never raises anything but these two.
- ``pack`` refuses what is not a plan and a step that is not a non-negative int.
"""

from __future__ import annotations

import json
import struct
from typing import Any, get_args

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typeguard import suppress_type_checks

from ir.errors import IRValidationError
from ir.ids import DRAFT_POOL, TARGET_POOL
from ir.nodes import Plan
from ir.wire import MAGIC, WIRE_VERSION, WireError, pack, unpack
from passes.lower import LowerContext, lower
from passes.prepare_for_decode import DecodeContext, prepare_for_decode
from tests.helpers import NODE_STRATEGIES, cow, decode_batch, extend_plan, fresh

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
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["f8", 0, 2]}}}, r"bad column descriptor \['f8', 0, 2\]"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 8000, 2]}}}, r"column \[i8, 8000, 2\] lies outside"),
        (lambda h: {**h, "f": {**h["f"], "slots": {"c": ["i8", 4, 2]}}}, r"column \[i8, 4, 2\] lies outside"),
        (lambda h: {**h, "f": {**h["f"], "slots": [1, 2]}}, r"bad value"),
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


def test_a_column_edited_into_an_invalid_plan_is_refused_by_the_constructor() -> None:
    running = decode_batch([1, 2], [3, 4], [5, 9], [50, 90])
    plan = lower(prepare_for_decode(running, DecodeContext(next_tokens=[7, 8], kv_locs=[51, 91])), LowerContext())
    message = bytearray(pack(1, plan))
    _, _, _, _, head_len, _ = PREFIX.unpack_from(message)
    header = json.loads(message[PREFIX.size : PREFIX.size + head_len])
    offset = header["f"]["slots"]["c"][1]
    struct.pack_into("<q", message, PREFIX.size + head_len + offset, 0)  # slot 0 is the padding row
    with pytest.raises(IRValidationError, match=r"DecodePlan\.slots"):
        unpack(message)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_corruption_raises_only_wire_or_validation_errors(data: st.DataObject) -> None:
    message = bytearray(_prefill_message())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(message) - 1))
        message[i] = data.draw(st.integers(0, 255))
    try:
        got = unpack(message)
    except (WireError, IRValidationError):
        return
    assert type(got.plan).__name__ in PLAN_KINDS  # a flip that still decodes yields a valid plan


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
