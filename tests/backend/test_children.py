"""``backend.children``: a child dies with its parent (the parent-death signal, and the check that
closes the race with a parent that died first), whichever thread asked for it; a child leads its
own process group, which ``kill`` signals whole; the one wording of how a process ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from backend import children

pytestmark = pytest.mark.real_processes  # how children live and die: batchc's own process starts, never the suite's template

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _gone(pid: int, within_s: float) -> float | None:
    """Seconds until ``pid`` is gone (a zombie counts), or None if it outlives ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    return time.monotonic() - t0
        except OSError:
            return time.monotonic() - t0
        time.sleep(0.005)
    return None


def test_a_child_dies_with_its_parent_even_by_sigkill() -> None:
    # a parent that spawns a grandchild through spawn and prints its pid, then waits to be killed
    code = "import sys, time; from backend import children; p = children.spawn(sys.argv[1:]); print(p.pid, flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code, *SLEEP], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert os.getpgid(child) == child  # it leads its own process group
        parent.kill()
        parent.wait()
        took = _gone(child, 2.0)
        assert took is not None, "the child outlived its parent by 2 s"
    finally:
        if child and _gone(child, 0.0) is None:
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        parent.wait()


def test_a_child_asked_for_on_a_short_lived_thread_outlives_the_thread() -> None:
    # the parent-death signal follows the thread that forked: a thread's child would die with it
    got: list[subprocess.Popen[bytes]] = []
    t = threading.Thread(target=lambda: got.append(children.spawn(SLEEP)))
    t.start()
    t.join()
    [proc] = got
    try:
        assert _gone(proc.pid, 0.3) is None, "the child died with the thread that asked for it"
    finally:
        children.kill(proc)
    assert proc.returncode == -signal.SIGKILL


def test_kill_signals_the_whole_process_group() -> None:
    code = "import subprocess, sys, time; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); time.sleep(60)"
    proc = children.spawn([sys.executable, "-c", code, *SLEEP], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())  # (in its parent's group: plain Popen)
    children.kill(proc)
    assert proc.returncode == -signal.SIGKILL
    assert _gone(grandchild, 2.0) is not None


def test_a_signal_while_spawn_holds_the_lock_still_interrupts() -> None:
    # the handler kills every child under the same lock spawn holds while it records one: a signal
    # arriving there must interrupt, not wait forever for a lock its own thread holds
    code = (
        "import os, signal; from backend import children\n"
        "with children.on_signals():\n"
        "    try:\n"
        "        with children._lock:\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "            for _ in range(1000): pass\n"
        "    except children.Interrupted as exc:\n"
        "        print('interrupted by', exc.signum, flush=True)\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the handler waited for the lock its own thread held")
    assert done.stdout == f"interrupted by {int(signal.SIGINT)}\n", done.stderr


def test_a_signal_while_spawn_starts_a_child_waits_until_the_child_can_be_killed() -> None:
    # the signal lands between the child's start and its record (the Popen below sends it): the
    # handler runs once the child is recorded, so its kill_all kills the child too
    code = (
        "import os, signal, subprocess, sys, time; from backend import children\n"
        "real = subprocess.Popen\n"
        "def popen(*a, **kw):\n"
        "    proc = real(*a, **kw)\n"
        "    print(proc.pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    for _ in range(1000): pass\n"
        "    return proc\n"
        "children.subprocess.Popen = popen\n"
        "with children.on_signals():\n"
        "    try:\n"
        "        children.spawn([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "        print('spawn returned', flush=True)\n"
        "    except children.Interrupted:\n"
        "        print('interrupted', flush=True)\n"
        "time.sleep(30)\n"  # (still alive: only kill_all can have ended the child)
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline() == "interrupted\n"
        assert _gone(child, 5.0) is not None, "the child started as the signal arrived outlived the interruption"
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):  # (reaped already when its Popen was freed)
                os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
