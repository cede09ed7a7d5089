"""``backend.parts``: a part's time is its own (the parts inside it taken out), the parts of a forward
cover it, and no clock runs unless one is started."""

from __future__ import annotations

import time

import pytest
import torch

from backend import parts
from backend.kernels import lowp
from backend.parts import MAMBA, MLP, PARTS, Part, PartClock, running_clock, timing_parts
from tests.helpers import tiny_models


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_part_keeps_its_own_time_and_gives_the_inner_parts_theirs() -> None:
    outer, inner = Part("outer"), Part("inner")
    with timing_parts() as clock:
        with outer:
            _busy(0.02)
            with inner:
                _busy(0.03)
            with inner:
                _busy(0.01)
    assert clock.calls == {"outer": 1, "inner": 2}
    # busy-waits last at least their time; a preempted one longer, so only the lower bounds and the sum are exact
    assert clock.seconds["inner"] >= 0.04 and clock.seconds["outer"] >= 0.02
    assert clock.seconds["outer"] < 0.02 + clock.seconds["inner"]  # the inner time is not counted twice
    assert clock.total() == pytest.approx(clock.seconds["outer"] + clock.seconds["inner"])


def test_without_a_clock_parts_do_nothing_and_clocks_do_not_nest() -> None:
    assert running_clock() is None
    with MAMBA:
        pass
    with timing_parts() as clock:
        assert running_clock() is clock
        with pytest.raises(RuntimeError, match="already runs"):
            with timing_parts():
                pass
    assert running_clock() is None and clock.seconds == {}
    with pytest.raises(ValueError, match="non-empty str"):
        Part("")


def test_reset_forgets_what_was_counted_and_keeps_open_parts_open() -> None:
    clock = PartClock()
    with timing_parts(clock):
        with MLP:
            _busy(0.01)
            clock.reset()
        assert clock.calls == {"mlp": 1} and clock.seconds["mlp"] < 0.01


@pytest.mark.parametrize("fused", ["0", "1"])
def test_the_parts_of_a_decode_cover_its_forward(fused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHC_FUSED_DECODE", fused)  # the torch path, and the fused step where the C kernel runs
    target, _ = tiny_models()
    pool, kv, table = target.new_pool(2), target.new_kv_cache(16), target.new_token_table(2, 8)
    slots = torch.tensor([1, 2])
    ids, positions, locs = torch.tensor([3, 4]), torch.tensor([0, 0]), torch.tensor([1, 2])
    with torch.inference_mode(), timing_parts() as clock:
        t0 = time.perf_counter()
        target.decode(pool, kv, table, slots=slots, input_ids=ids, positions=positions, kv_locs=locs)
        wall = time.perf_counter() - t0
    # every part of a decode ran (the fused step advances the states in place: no gathers or scatters),
    # and together they are the forward's wall time but the clock's last reads
    in_place = fused == "1" and lowp.fused_decode_enabled()
    assert set(clock.seconds) == {p.name for p in PARTS} - ({parts.STATE.name} if in_place else set())
    assert clock.calls[parts.FORWARD.name] == 1 and clock.calls[MAMBA.name] == target.config.n_mamba
    assert 0 < clock.total() <= wall and wall - clock.total() < 1e-3
