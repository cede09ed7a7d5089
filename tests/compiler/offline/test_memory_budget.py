"""The memory budget of a run, taken from the machine: what the machine has
available (``/proc/meminfo``, a cgroup's limit), the budget's fraction and shares, the models'
weights counted once, ``fit_serving``'s sizes (the defaults when they fit, else the largest that fit,
the values the user gave never changed, one-line refusals naming what to lower), and the estimate
checked against what a real ``batchc run`` adds to its resident memory."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from typeguard import suppress_type_checks

from backend.hybrid.checkpoint import default_draft, default_target, save_checkpoint
from backend.hybrid.config import HybridConfig
from backend.hybrid.weights import init_weights
from compiler.engine.config import ServeConfig
from compiler.offline.budget import SIZED_OPTIONS, MemoryBudget, available_memory, gib, memory_budget, parse_available
from compiler.offline.memory import RUNTIME_BYTES, fit_serving, memory_estimate, weight_bytes
from compiler.workload import ServeError
from tests.helpers import REPO

MIB = 1 << 20


# ---- what the machine has --------------------------------------------------------------------------


def test_available_memory_is_memavailable_in_bytes() -> None:
    meminfo = "MemTotal:       24683784 kB\nMemFree:        20233676 kB\nMemAvailable:   23721500 kB\nBuffers: 1 kB\n"
    assert parse_available(meminfo) == 23721500 * 1024
    # a kernel before 3.14 has no MemAvailable: its free memory
    assert parse_available("MemTotal: 2048 kB\nMemFree: 1024 kB\n") == 1024 * 1024
    assert parse_available(None) is None
    assert parse_available("nothing useful\n") is None


def test_a_cgroup_limit_caps_what_is_available() -> None:
    meminfo = "MemAvailable: 1048576 kB\n"  # 1 GiB on the host
    limit, usage = str(512 * MIB), str(400 * MIB)
    # 400 MiB used under a 512 MiB limit, of which 100 MiB is page cache the kernel can drop: 212 MiB left
    assert parse_available(meminfo, (limit, usage, f"anon 1\ninactive_file {100 * MIB}\n", "inactive_file")) == 212 * MIB
    # no reclaimable cache line: 112 MiB left
    assert parse_available(meminfo, (limit, usage, "", "inactive_file")) == 112 * MIB
    # no limit (cgroup v2's "max"), or one past the host's memory: the host's figure
    assert parse_available(meminfo, ("max\n", usage, "", "inactive_file")) == 1 << 30
    assert parse_available(meminfo, (str(1 << 40), usage, "", "inactive_file")) == 1 << 30
    # usage over the limit: nothing left, not a negative budget
    assert parse_available(meminfo, (limit, str(600 * MIB), "", "inactive_file")) == 0


def test_this_machine_has_some_memory_available_and_no_more_than_it_has() -> None:
    mem_total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    assert 0 < available_memory() <= mem_total


# ---- the budget ---------------------------------------------------------------------------------------


def test_the_budget_is_the_fraction_of_what_is_available_and_says_so() -> None:
    budget = MemoryBudget(device="cpu", available=10 << 30, fraction=0.9)
    assert budget.bytes == int((10 << 30) * 0.9)
    assert budget.describe() == "9.0 GiB (--memory-fraction 0.9 of the 10.0 GiB available on cpu)"
    shared = budget.share(4)
    assert shared.bytes == int((10 << 30) * 0.9) // 4
    assert shared.describe() == "2.2 GiB, one of 4 replicas' shares of --memory-fraction 0.9 of the 10.0 GiB available on cpu"
    assert MemoryBudget(device="cpu", available=100 * MIB, fraction=0.5).describe().startswith("50 MiB (")


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, math.nan, math.inf, True, "0.5"], ids=repr)
def test_a_fraction_outside_0_1_is_refused_in_one_line(fraction: object) -> None:
    with pytest.raises(ServeError, match=r"^--memory-fraction must be a number in \(0, 1\], got ") as info, suppress_type_checks():
        memory_budget("cpu", fraction)  # type: ignore[arg-type]  # a str on purpose: refused at run time, not only by mypy
    assert "\n" not in str(info.value)


def test_the_budget_of_a_run_counts_what_it_already_holds() -> None:
    plain, holding = memory_budget("cpu", 1.0), memory_budget("cpu", 1.0, held=1 << 30)
    # (read a moment apart: the machine's other processes move the figure a little)
    assert abs(holding.available - (1 << 30) - plain.available) < 256 * MIB
    assert plain.device == "cpu" and plain.fraction == 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_budget_without_cuda_is_refused() -> None:
    with pytest.raises(ServeError, match=r"^--device cuda: no CUDA device on this machine$"):
        memory_budget("cuda")
    with pytest.raises(ServeError, match=r"^--device 'tpu': expected cpu, cuda or cuda:N$"):
        memory_budget("tpu")


def test_a_cuda_budget_is_the_devices_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # a machine with two CUDA devices, of which cuda:1 has 6 GiB free
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: ((3 + 3 * i) << 30, 80 << 30))
    budget = memory_budget("cuda:1", 0.5)
    assert (budget.device, budget.available, budget.bytes) == ("cuda:1", 6 << 30, 3 << 30)
    assert memory_budget("cuda").device == "cuda:0"
    with pytest.raises(ServeError, match=r"^--device cuda:2: this machine has 2 CUDA devices \(cuda:0 to cuda:1\)$"):
        memory_budget("cuda:2")


# ---- the weights ---------------------------------------------------------------------------------------


@attrs.frozen
class _Model:
    weights: dict[str, torch.Tensor]


def test_weights_are_counted_once_per_storage() -> None:
    embed = torch.zeros(100, 8)
    tied = _Model({"embed": embed, "lm_head": embed})  # one storage under two names
    assert weight_bytes([tied]) == 100 * 8 * 4
    head = _Model({"embed": embed, "fc": torch.zeros(8, 8, dtype=torch.bfloat16)})  # a head sharing its target's embedding
    assert weight_bytes([tied, head, None]) == 100 * 8 * 4 + 8 * 8 * 2
    target = default_target()
    assert weight_bytes([target]) == sum(t.numel() * t.element_size() for t in target.weights.values())


# ---- the sizes that fit ------------------------------------------------------------------------------------


def _bundled() -> tuple[HybridConfig, HybridConfig, int]:
    target, draft = default_target(), default_draft()
    return target.config, draft.config, weight_bytes([target, draft])


def _total(target: HybridConfig, draft: HybridConfig | None, cfg: ServeConfig, weights: int) -> int:
    return sum(memory_estimate(target, draft, cfg, weights=weights).values())


def _budget(nbytes: int) -> MemoryBudget:
    return MemoryBudget(device="cpu", available=nbytes, fraction=1.0)


def test_defaults_that_fit_are_kept_exactly() -> None:
    target, draft, weights = _bundled()
    cfg = ServeConfig()
    assert fit_serving(target, draft, cfg, sized=SIZED_OPTIONS, budget=_budget(_total(target, draft, cfg, weights)), weights=weights) is cfg


@pytest.mark.parametrize("share", [0.1, 0.35, 0.6, 0.9])
def test_defaults_that_do_not_fit_are_lowered_to_the_largest_that_fit(share: float) -> None:
    target, draft, weights = _bundled()
    cfg = ServeConfig()
    lowest = attrs.evolve(cfg, max_running=1, token_budget=1, cache_entries=1)
    low, high = _total(target, draft, lowest, weights), _total(target, draft, cfg, weights)
    budget = _budget(low + int(share * (high - low)))
    got = fit_serving(target, draft, cfg, sized=SIZED_OPTIONS, budget=budget, weights=weights)
    assert _total(target, draft, got, weights) <= budget.bytes
    chosen, defaults = attrs.asdict(got), attrs.asdict(cfg)
    assert {n: v for n, v in chosen.items() if n not in SIZED_OPTIONS} == {n: v for n, v in defaults.items() if n not in SIZED_OPTIONS}
    assert all(1 <= chosen[n] <= defaults[n] for n in SIZED_OPTIONS) and got != cfg
    for name in SIZED_OPTIONS:  # none of them can go one higher: the largest that fit
        if chosen[name] < defaults[name]:
            assert _total(target, draft, attrs.evolve(got, **{name: chosen[name] + 1}), weights) > budget.bytes, name
    # the same inputs, the same sizes
    assert fit_serving(target, draft, cfg, sized=SIZED_OPTIONS, budget=budget, weights=weights) == got


def test_values_the_user_gave_are_never_changed() -> None:
    target, draft, weights = _bundled()
    cfg = attrs.evolve(ServeConfig(), max_running=6)
    budget = _budget(_total(target, draft, cfg, weights) - 1)  # one byte short
    got = fit_serving(target, draft, cfg, sized=("token_budget", "cache_entries"), budget=budget, weights=weights)
    assert got.max_running == 6 and (got.token_budget, got.cache_entries) != (cfg.token_budget, cfg.cache_entries)
    # all given: refused, naming them and the budget
    with pytest.raises(ServeError) as info:
        fit_serving(target, draft, cfg, budget=budget, weights=weights)
    said = str(info.value)
    assert said.startswith("the run would need about ") and "\n" not in said
    assert said.endswith(f", over the budget of {budget.describe()}; lower --max-running (6), --cache-entries (16), --k (2), "
                         "--chunk-size (512), --token-budget (2048), --max-len (512), use a smaller model")


def test_a_run_that_fits_nowhere_is_refused_naming_what_to_lower() -> None:
    target, draft, weights = _bundled()
    cfg = attrs.evolve(ServeConfig(), max_running=4)
    lowest = attrs.evolve(cfg, token_budget=1, cache_entries=1)
    budget = MemoryBudget(device="cpu", available=_total(target, draft, lowest, weights) - 1, fraction=1.0)
    with pytest.raises(ServeError) as info:
        fit_serving(target, draft, cfg, sized=("token_budget", "cache_entries"), budget=budget, weights=weights)
    said = str(info.value)
    assert " even with --token-budget 1, --cache-entries 1, over the budget of " in said
    assert said.endswith("; lower --max-running (4), --k (2), --chunk-size (512), --max-len (512), use a smaller model")
    # the models' weights alone: a smaller model, or more of the machine
    small = MemoryBudget(device="cpu", available=2 * weights + RUNTIME_BYTES, fraction=0.5)
    with pytest.raises(ServeError) as info:
        fit_serving(target, draft, cfg, sized=SIZED_OPTIONS, budget=small, weights=weights)
    assert str(info.value) == (f"the models alone need about {gib(weights)} as loaded (and the runtime 128 MiB), over the budget of "
                               f"{small.describe()}; raise --memory-fraction or use a smaller model")
    # (all of the machine already: nothing to raise)
    with pytest.raises(ServeError, match=r"; use a smaller model or fewer --dp replicas$"):
        fit_serving(target, draft, cfg, sized=SIZED_OPTIONS, budget=_budget(4 * weights).share(64), weights=weights)
    with pytest.raises(ServeError, match=r"^sized: 'k' is not one of "):
        fit_serving(target, draft, cfg, sized=("k",), budget=budget, weights=weights)


# ---- the estimate against a real run ---------------------------------------------------------------------------

_CHILD = """
import json, os, resource, sys
import compiler.offline.budget as budget
import compiler.offline.memory as memory

def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def file_backed():  # resident pages mapped from files: shared libraries' code, the checkpoint
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))

seen = {}
read_budget, fit = budget.memory_budget, memory.fit_serving

def reading(*args, **kw):  # the run's budget is read before its models are loaded: the growth starts here
    seen["before"], seen["files_before"] = resident(), file_backed()
    return read_budget(*args, **kw)

def fitting(target, draft, cfg, **kw):  # the estimate of the sizes the run serves with (the command's, not the library's check)
    got = fit(target, draft, cfg, **kw)
    if "parts" not in seen:
        seen["parts"] = memory.memory_estimate(target, draft, got, compare_mutable=kw.get("compare_mutable", False), weights=kw["weights"])
    return got

budget.memory_budget, memory.fit_serving = reading, fitting
from compiler.cli import main
seen["code"] = main(sys.argv[1:])
seen["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
seen["files_after"] = file_backed()
print(json.dumps(seen), file=sys.stderr)
"""


def test_the_estimate_bounds_what_a_run_really_holds(tmp_path: Path) -> None:
    """``batchc run`` on a small checkpoint whose state pools, attention and widest layer make up a
    few hundred MiB (8 MiB of weights, 32 Mamba heads of 64 x 128 state, 16 requests of the built-in
    workload at the default sizes), in a process of its own, from its budget's reading to its end:

    - what it allocates at its peak is at most the estimate: the peak resident memory's growth less
      the growth of its file-backed pages (torch's code paged in at first call, the memory-mapped
      checkpoint: page cache the kernel can reclaim, counted as available when the budget is read).
      The file-backed growth is not steady (90-130 MiB measured here, more or less of a library's
      code mapped at each first call depending on what the page cache holds);
    - the estimate is at most 1.8 times the whole growth, file pages included (measured 1.2-1.4 here,
      torch 2.13 on a CPU): an estimate that far above what the run holds has lost touch with it (a
      part counted twice).

    Measured on two cores (torch 2.13): alone, or beside other test files under load, the run
    allocates 295-320 MiB against an estimate of 552-558; inside the whole suite's run 380-410 MiB,
    and twice more than the estimate: a whole growth of 578 MiB (not broken down) and 787 MiB
    allocated, for a reason not found yet (not the garbage collector:
    the same with it off; not CPU contention: the same on a quarter of a core; not the suite's
    environment variables: the same run with them). The failure message carries the figures."""
    config = HybridConfig(d_model=128, layers=("mamba", "attn", "mamba"), nheads=32, head_dim=64, d_state=128, attn_heads=4,
                          attn_head_dim=32, mlp_hidden=256)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, config, init_weights(config, 0))
    argv = ["run", "--model", str(path), "--k", "0", "--requests", "16", "--max-new-tokens", "4", "--lossless-sample", "1"]
    done = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = json.loads(done.stderr.strip().splitlines()[-1])
    assert seen["code"] == 0, done.stderr[-2000:]
    estimate, grown = sum(seen["parts"].values()), seen["peak"] - seen["before"]
    # (the file-backed pages mapped by the end include those at the peak: a run maps, it does not unmap)
    allocated = grown - (seen["files_after"] - seen["files_before"])
    assert seen["parts"]["forward working memory"] > 128 * MIB and seen["parts"]["target"] > 32 * MIB  # not the runtime part alone
    figures = {"estimate MiB": estimate / MIB, "grown MiB": grown / MIB, "allocated MiB": allocated / MIB, "parts": seen["parts"],
               "before MiB": seen["before"] / MIB, "peak MiB": seen["peak"] / MIB, "run's last lines": done.stdout.splitlines()[-3:]}
    assert 0 < allocated <= estimate <= 1.8 * grown, figures
    assert "sizes: max-running 8 (default), token-budget 2048 (default), cache-entries 16 (default)" in done.stdout
