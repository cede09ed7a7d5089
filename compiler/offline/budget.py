"""The memory a run may use, taken from the machine (``memory_budget``): a fraction
(``batchc run --memory-fraction``, as vLLM sizes its cache from ``--gpu-memory-utilization``) of the
memory available on the run's device when it starts.

On the CPU, "available" is the kernel's own estimate of what can be allocated without swapping,
``MemAvailable`` in ``/proc/meminfo`` (free memory plus the page cache it can drop), capped by the
memory left under this process's cgroup limit when there is one (a container's ``/proc/meminfo``
shows the host's memory); where ``/proc/meminfo`` is missing, the free pages ``os.sysconf`` counts. On
a CUDA device it is the free memory ``torch.cuda.mem_get_info`` reports. Available, not total: the
machine is shared with other processes, which hold what they hold, and a run that counted on the
total would be killed for memory, not refused.

The module imports no torch (``batchc serve``'s HTTP process reads the budget once for every engine
process it starts); a CUDA device's memory imports it when asked.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Final

import attrs

from compiler.workload import ServeError

__all__ = [
    "DEFAULT_MEMORY_FRACTION", "SIZED_OPTIONS", "MemoryBudget", "available_memory", "gib", "memory_budget", "parse_available", "resident_memory",
]

SIZED_OPTIONS: Final = ("max_running", "token_budget", "cache_entries")
"""The ``ServeConfig`` fields ``compiler.offline.memory.fit_serving`` may lower to fit the budget when
the user did not give them, in the order it raises them back (the running rows first: they are the
run's throughput)."""

DEFAULT_MEMORY_FRACTION: Final = 0.9
"""``--memory-fraction``'s default: the run may use 0.9 of the memory available when it starts. The
tenth left over is for what the estimate does not count (the allocator's fragmentation and cached
free blocks, the interpreter's own growth, a tokenizer's tables) and for the other processes of the
machine, which may grow while the run lasts; the memory estimate is an upper bound of what a run
holds (``compiler.offline.memory_estimate``), not an exact figure."""

_CGROUP_FILES: Final = (
    # (limit, usage, stat, the stat's line of reclaimable page cache): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "inactive_file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes", "/sys/fs/cgroup/memory/memory.stat",
     "total_inactive_file"),
)


def gib(n: int | float) -> str:
    """``n`` bytes for a message: ``4.5 GiB`` from 1 GiB up, ``37 MiB`` below it."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


@attrs.frozen(kw_only=True)
class MemoryBudget:
    """The memory a run may use: ``fraction`` of the ``available`` bytes of ``device`` (``"cpu"`` or
    ``"cuda:N"``). Checked on construction (``ServeError``)."""

    device: str
    available: int
    """Bytes available to the run when it started (``available_memory``), with what the run already
    held then (``memory_budget``'s ``held``)."""
    fraction: float = DEFAULT_MEMORY_FRACTION
    """The share of ``available`` the run may use, in (0, 1] (``--memory-fraction``)."""
    shares: int = 1
    """Processes that split the budget equally, each with its own models (``--dp N``'s replicas):
    ``bytes`` is one's share."""

    def __attrs_post_init__(self) -> None:
        if type(self.device) is not str or not (self.device == "cpu" or self.device.startswith("cuda:")):  # noqa: E721
            raise ServeError(f"device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if type(self.available) is not int or self.available < 0:  # noqa: E721 - a bool or a float is not a byte count
            raise ServeError(f"available memory must be an int >= 0 bytes, got {self.available!r}")
        if type(self.fraction) is not float or not (math.isfinite(self.fraction) and 0 < self.fraction <= 1):  # noqa: E721
            raise ServeError(f"--memory-fraction must be a number in (0, 1], got {self.fraction!r}")
        if type(self.shares) is not int or self.shares < 1:  # noqa: E721
            raise ServeError(f"a budget is shared by an int >= 1 of processes, got {self.shares!r}")

    @property
    def bytes(self) -> int:
        """The bytes the run (one of ``shares`` processes) may use: ``fraction`` of ``available``,
        its share of it."""
        return int(self.available * self.fraction) // self.shares

    def share(self, n: int) -> MemoryBudget:
        """This budget split equally between ``n`` processes, each with its own models."""
        return attrs.evolve(self, shares=n)

    def describe(self) -> str:
        """The budget in words: ``19.9 GiB (--memory-fraction 0.9 of the 22.1 GiB available on cpu)``;
        a share says so (``5.0 GiB, one of 4 replicas' shares of ...``)."""
        whose = f", one of {self.shares} replicas' shares of " if self.shares > 1 else " ("
        return (f"{gib(self.bytes)}{whose}--memory-fraction {self.fraction:g} of the {gib(self.available)} available on "
                f"{self.device}{')' if self.shares == 1 else ''}")


def parse_available(meminfo: str | None, cgroup: tuple[str, str, str, str] | None = None) -> int | None:
    """Bytes available from the text of ``/proc/meminfo`` (its ``MemAvailable``, or ``MemFree`` on
    kernels before 3.14), capped by what ``cgroup`` leaves: the texts of a cgroup's limit, usage and
    stat files and the name of the stat's reclaimable page-cache line (the limit minus the usage
    less that cache; a limit of ``max`` or past the machine's memory is no cap). ``None`` when
    ``meminfo`` says nothing of it."""
    available = None
    if meminfo is not None:
        fields = {}
        for line in meminfo.splitlines():
            name, _, rest = line.partition(":")
            words = rest.split()
            if words and words[0].isdigit():
                fields[name.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
        available = fields.get("MemAvailable", fields.get("MemFree"))
    if cgroup is not None and available is not None:
        limit_text, usage_text, stat_text, cache_line = cgroup
        limit, usage = limit_text.strip(), usage_text.strip()
        if limit.isdigit() and usage.isdigit():
            cache = 0
            for line in stat_text.splitlines():
                words = line.split()
                if len(words) == 2 and words[0] == cache_line and words[1].isdigit():
                    cache = int(words[1])
            left = int(limit) - max(0, int(usage) - cache)
            available = max(0, min(available, left))
    return available


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:  # (absent, or not readable here)
        return None


def _cpu_available() -> int:
    cgroup = None
    for limit, usage, stat, cache_line in _CGROUP_FILES:
        texts = (_read(limit), _read(usage), _read(stat))
        if texts[0] is not None and texts[1] is not None:
            cgroup = (texts[0], texts[1], texts[2] or "", cache_line)
            break
    available = parse_available(_read("/proc/meminfo"), cgroup)
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            raise ServeError("cannot tell the memory this machine has available (no /proc/meminfo, no sysconf)") from None
    return available


def _cuda_index(device: str) -> int:
    """The CUDA device ``device`` names (``cuda``: the current one), checked against the machine."""
    import torch

    if not torch.cuda.is_available():
        raise ServeError(f"--device {device}: no CUDA device on this machine")
    _, _, index = device.partition(":")
    n = torch.cuda.device_count()
    i = int(index) if index.isdigit() else torch.cuda.current_device() if not index else -1
    if not 0 <= i < n:
        raise ServeError(f"--device {device}: this machine has {n} CUDA device{'s' if n != 1 else ''} (cuda:0 to cuda:{n - 1})")
    return i


def available_memory(device: str = "cpu") -> int:
    """Bytes available now on ``device``: ``"cpu"`` (this machine, see the module) or ``"cuda"`` /
    ``"cuda:N"`` (that device's free memory). ``ServeError`` naming the device when it is not one of
    these or this machine has no such device."""
    if device == "cpu":
        return _cpu_available()
    if type(device) is not str or not (device == "cuda" or device.startswith("cuda:")):  # noqa: E721
        raise ServeError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    import torch

    free, _ = torch.cuda.mem_get_info(_cuda_index(device))
    return int(free)


def resident_memory() -> int:
    """Bytes of this process's memory resident now (``/proc/self/statm``; 0 where there is none):
    read when the budget is and again once the models are loaded, the difference is what loading
    them holds, which can be more than their tensors' bytes (a memory-mapped checkpoint keeps the
    pages it touched mapped beside the tensors converted out of it)."""
    text = _read("/proc/self/statm")
    words = text.split() if text is not None else []
    if len(words) < 2 or not words[1].isdigit():
        return 0
    return int(words[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_budget(device: str = "cpu", fraction: float = DEFAULT_MEMORY_FRACTION, *, held: int = 0) -> MemoryBudget:
    """The budget of a run on ``device`` that starts now: ``fraction`` of the memory available
    (``available_memory``) plus ``held``, the bytes the run already holds (models loaded before the
    reading: their memory is the run's, not another process's). ``ServeError`` in one line for a
    fraction outside (0, 1] or a device this machine does not have."""
    if type(fraction) not in (int, float) or not (math.isfinite(fraction) and 0 < fraction <= 1):  # (a bool is not a fraction)
        raise ServeError(f"--memory-fraction must be a number in (0, 1], got {fraction!r}")
    if type(held) is not int or held < 0:  # noqa: E721
        raise ServeError(f"held must be an int >= 0 bytes, got {held!r}")
    available = available_memory(device)
    name = device if device == "cpu" else f"cuda:{_cuda_index(device)}"
    return MemoryBudget(device=name, available=available + held, fraction=float(fraction))
