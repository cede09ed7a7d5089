"""Every process ``batchc`` starts dies with it: ``--tp 2``'s worker rank, ``--dp 2``'s replicas and
``--overlap``'s executor process, when ``batchc`` is killed (SIGTERM or SIGKILL) at start-up (a child
just started), mid-run (every child serving) or during shutdown (rank 0 shutting its group down, the
engine closing its executors, the router stopping a replica after another failed). The figure: the
time from the signal to the last child gone, at most 2 s (it bounds the time from ``batchc``'s death,
which comes after the signal). ``tests/compiler/cli/paused.py`` stops ``batchc`` at each point. Each run
also claims ``--json`` and ``--outputs`` over files already there: after SIGTERM ``batchc`` says in one
line what was interrupted and what was (not) written, exits 143, and after either signal the files
hold what they held (or, once written, the run's output) and no temporary file is left beside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

pytestmark = pytest.mark.real_processes  # how children live and die: batchc's children start as batchc starts them, never from the suite's template

ROOT = Path(__file__).resolve().parents[3]
RUN = ["run", "--k", "0", "--requests", "16", "--max-new-tokens", "16", "--lossless-sample", "0"]
SHORT_RUN = ["run", "--k", "0", "--requests", "4", "--max-new-tokens", "8", "--lossless-sample", "0"]
"""``--tp`` and ``--overlap`` reach each kill point on this workload too (at least three engine steps; at
``shutdown`` the whole run has been served, so a shorter run costs less). ``--dp``'s points wait for
every replica to have served for a second of CPU time: they take ``RUN``."""
MODES = {"tp": ["--tp", "2"], "dp": ["--dp", "2"], "overlap": ["--overlap"]}
BOUND_S = 2.0
OLD = "what was there before\n"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children of each of its threads, recursively)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                if k not in found:
                    found.add(k)
                    todo.append(k)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, exited and not yet reaped, is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def paused(point: str, marker: Path, args: list[str]) -> subprocess.Popen[str]:
    """``batchc ARGS`` stopped at ``point`` (``tests/compiler/cli/paused.py``): forked from the suite's
    template, its own children fresh interpreters started as batchc starts them (``real_children``)."""
    return forkserver.Popen([sys.executable, "-m", "tests.compiler.cli.paused", point, str(marker), *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, real_children=True)


def wait_for(marker: Path, proc: subprocess.Popen[str], limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"batchc ended (status {proc.returncode}) before the kill point: {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.02)


def kill_left(pids: set[int], proc: subprocess.Popen[str]) -> None:
    """Whatever the outcome, nothing is left behind."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


# each mode under both signals, each point under both (9 runs rather than 18: the signal decides how
# a child learns of the death, the mode only where it was started)
CASES = [
    ("tp", "start", signal.SIGTERM), ("tp", "mid", signal.SIGKILL), ("tp", "shutdown", signal.SIGTERM),
    ("dp", "start", signal.SIGKILL), ("dp", "mid", signal.SIGTERM), ("dp", "shutdown", signal.SIGKILL),
    ("overlap", "start", signal.SIGKILL), ("overlap", "mid", signal.SIGTERM), ("overlap", "shutdown", signal.SIGKILL),
]


@pytest.mark.parametrize(("mode", "point", "sig"), CASES, ids=[f"{m}-{p}-{s.name}" for m, p, s in CASES])
def test_every_child_dies_with_batchc(mode: str, point: str, sig: signal.Signals, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    paths = {"--json": tmp_path / "run.json", "--outputs": tmp_path / "out.jsonl"}
    for path in paths.values():
        path.write_text(OLD)
    proc = paused(point, marker, [*(RUN if mode == "dp" else SHORT_RUN), *MODES[mode], *(a for option, path in paths.items() for a in (option, str(path)))])
    seen: set[int] = set()
    try:
        wait_for(marker, proc)
        seen = descendants(proc.pid)
        assert seen, "no child at the kill point"
        t0 = time.monotonic()
        os.kill(proc.pid, sig)
        while any(alive(p) for p in seen) and time.monotonic() - t0 < 10 * BOUND_S:
            time.sleep(0.005)
        took = time.monotonic() - t0
        left = sorted(p for p in seen if alive(p))
        print(f"\nbatchc {mode} killed by {sig.name} at {point}: {len(seen)} children, the last gone {took:.3f} s after the signal")
        assert not left and took <= BOUND_S, f"children {left or seen} outlived batchc by {took:.1f} s"
        _, err = proc.communicate(timeout=30)
        written = mode == "tp" and point == "shutdown"  # (rank 0 shuts its group down after the report)
        assert all((path.read_text() != OLD) == written for path in paths.values())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "out.jsonl", "run.json"]  # no temporary file
        if sig is signal.SIGKILL:
            assert proc.returncode == -sig
        else:
            said = ", ".join(f"{option} {str(path)!r} {'written' if written else 'not written'}" for option, path in paths.items())
            if mode == "tp" and point == "start":  # (the group starts before the run claims its files)
                said = "nothing written"
            assert proc.returncode == 143 and err.splitlines() == [f"batchc: run interrupted by SIGTERM; {said}"], err
    finally:
        kill_left(seen | descendants(proc.pid), proc)
