"""The suite's template (``tests/forkserver.py``): a child forked from it is the program a fresh
interpreter would have run, as its caller sees it (arguments, environment, working directory, standard
streams, passed descriptors, exit statuses, signals), it dies with the process that asked for it,
and a child the template must not fork starts the usual way.

Run as ``python -m tests.test_forkserver MODE ...`` this file is the child program itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver

ROOT = Path(__file__).resolve().parent.parent
PROBE = [sys.executable, "-m", "tests.test_forkserver"]


def _both(*args: str, env: dict[str, str] | None = None, **kwargs: object) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The probe run forked and run fresh, with the same arguments."""
    runs = []
    for runner in (forkserver.run, subprocess.run):
        runs.append(runner([*PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, **kwargs))
    return runs[0], runs[1]


def test_a_forked_child_sees_what_a_fresh_interpreter_sees() -> None:
    env = dict(os.environ, PROBE_VALUE="héllo wörld", PYTHONPATH=f"/nonexistent{os.pathsep}{ROOT}")
    forked, fresh = _both("describe", "a b", "--x=1", input="from stdin\n", env=env)
    assert forked.returncode == fresh.returncode == 0, (forked.stderr, fresh.stderr)
    a, b = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert a.pop("parent") != os.getpid() and b.pop("parent") == os.getpid()  # (the first one was forked)
    assert a.pop("path")[:3] == b.pop("path")[:3] == [str(ROOT), "/nonexistent", str(ROOT)]
    assert a == b
    assert a["argv"][1:] == ["describe", "a b", "--x=1"] and a["stdin"] == "from stdin\n" and a["value"] == "héllo wörld"
    assert a["argv"][0].endswith("test_forkserver.py") and a["cwd"] == str(ROOT) and a["pytest"] == b["pytest"]
    assert forked.stderr == fresh.stderr == "to stderr\n"


@pytest.mark.parametrize(("mode", "status"), [("exit", 3), ("raise", 1), ("kill", -signal.SIGKILL), ("interrupt", -signal.SIGINT),
                                              ("atexit", 0)])
def test_exit_statuses_and_last_words_are_a_fresh_interpreters(mode: str, status: int) -> None:
    forked, fresh = _both(mode)
    assert forked.returncode == fresh.returncode == status
    assert forked.stdout == fresh.stdout
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    if mode == "raise":
        assert forked.stderr.splitlines()[-1] == "ValueError: probe raised"
    if mode == "atexit":
        assert forked.stdout == "thread done\nat exit\n"


def test_a_program_given_with_dash_c_runs_as_python_runs_it() -> None:
    code = ("import json, os, sys\n"
            "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'name': __name__, 'cwd': os.getcwd(), 'parent': os.getppid(),\n"
            "                  'main': sys.modules['__main__'].__dict__ is globals()}))\n"
            "raise SystemExit(int(sys.argv[2]))\n")
    forked = forkserver.run([sys.executable, "-c", code, "a b", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    fresh = subprocess.run([sys.executable, "-c", code, "a b", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert forked.returncode == fresh.returncode == 4, (forked.stderr, fresh.stderr)
    a, b = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert a.pop("parent") != os.getpid() and b.pop("parent") == os.getpid()  # (the first one was forked)
    assert a == b == {"argv": ["-c", "a b", "4"], "path0": "", "name": "__main__", "cwd": str(ROOT), "main": True}
    raised = [runner([sys.executable, "-c", "import sys; print('out'); raise ValueError('probe raised')"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60) for runner in (forkserver.run, subprocess.run)]
    assert [(r.returncode, r.stdout, r.stderr.splitlines()[-1]) for r in raised] == [(1, "out\n", "ValueError: probe raised")] * 2


@pytest.mark.parametrize("real_children", [False, True])
def test_the_processes_a_forked_child_starts_are_forked_unless_it_asks_for_real_children(real_children: bool) -> None:
    """A forked child's ``backend.children.spawn`` forks from the template too (the grandchild is the
    template's child), or, with ``real_children`` (the tests of how batchc's children live and die),
    starts a fresh interpreter that is the child's own child, as in a fresh ``batchc``."""
    proc = forkserver.run([*PROBE, "spawn"], cwd=ROOT, capture_output=True, text=True, timeout=120, real_children=real_children)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["me"] != os.getpid() and seen["my_parent"] != os.getpid()  # the child under test was forked either way
    assert (seen["grandchild_parent"] == seen["me"]) is real_children
    assert seen["grandchild_parent"] == (seen["me"] if real_children else seen["my_parent"])  # its own child, or the template's


def test_a_missing_module_is_reported_as_python_reports_it() -> None:
    forked = forkserver.run([sys.executable, "-m", "tests.no_such_module"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    fresh = subprocess.run([sys.executable, "-m", "tests.no_such_module"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (1, f"{sys.executable}: No module named tests.no_such_module\n")


def test_passed_descriptors_and_signals_reach_the_child() -> None:
    r, w = os.pipe()
    try:
        proc = forkserver.Popen([*PROBE, "write-fd", str(w)], cwd=ROOT, pass_fds=(w,), stdout=subprocess.PIPE, text=True)
        os.close(w)
        with os.fdopen(r, "rb") as reader:
            assert reader.readline() == b"through the fd\n"
        assert proc.poll() is None
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGTERM and out == ""
    finally:
        for fd in (r, w):
            try:
                os.close(fd)
            except OSError:
                pass


def test_a_child_dies_with_the_process_that_asked_for_it() -> None:
    # an asker that starts a forked child and leaves at once, without waiting for it
    code = (
        "import os, sys; from tests import forkserver\n"
        "p = forkserver.Popen([sys.executable, '-m', 'tests.test_forkserver', 'sleep'], stdout=__import__('subprocess').DEVNULL)\n"
        "print(p.pid, os.getppid() != os.getpid(), flush=True); os._exit(0)\n"
    )
    asker = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert asker.returncode == 0, asker.stderr
    pid = int(asker.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not Path(f"/proc/{pid}").exists(), f"the forked child {pid} outlived the process that asked for it"


def test_import_time_settings_are_a_fresh_interpreters() -> None:
    """A child asking for an import-time setting other than the template's (torch's C++ log level, as
    tensor-parallel workers do) is forked from a second template that imported with it, shared by
    every child asking the same; one no template can give (a thread count: torch then imports with a
    thread pool, and a process with threads is not forked) starts fresh. Either way the child sees
    what a fresh interpreter would."""
    plain = json.loads(forkserver.run([*PROBE, "threads"], cwd=ROOT, capture_output=True, text=True, timeout=120).stdout)
    quiet = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
    seen = [json.loads(forkserver.run([*PROBE, "threads"], cwd=ROOT, env=quiet, capture_output=True, text=True, timeout=120).stdout)
            for _ in range(2)]
    assert seen[0]["parent"] == seen[1]["parent"] and seen[0]["parent"] not in (os.getpid(), plain["parent"])
    assert seen[0]["log_level"] == "ERROR" and plain["log_level"] is None
    threads = dict(os.environ, OMP_NUM_THREADS="2")
    forked = forkserver.run([*PROBE, "threads"], cwd=ROOT, env=threads, capture_output=True, text=True, timeout=120)
    fresh = subprocess.run([*PROBE, "threads"], cwd=ROOT, env=threads, capture_output=True, text=True, timeout=120)
    a, b = json.loads(forked.stdout), json.loads(fresh.stdout)
    assert a["threads"] == b["threads"] == 2 and a["parent"] == b["parent"] == os.getpid()


def test_a_child_elsewhere_starts_fresh() -> None:
    proc = forkserver.run([*PROBE, "describe"], cwd=ROOT / "tests", env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parent"] == os.getpid()


def _probe(mode: str, args: list[str]) -> None:
    import atexit
    import threading

    if mode == "describe":
        print(json.dumps({"argv": sys.argv, "parent": os.getppid(), "stdin": sys.stdin.read(), "value": os.environ.get("PROBE_VALUE"),
                          "path": sys.path, "cwd": os.getcwd(), "name": __name__,
                          "pytest": pytest.__file__}))
        print("to stderr", file=sys.stderr)
    elif mode == "threads":
        import torch

        print(json.dumps({"threads": torch.get_num_threads(), "parent": os.getppid(), "log_level": os.environ.get("TORCH_CPP_LOG_LEVEL")}))
    elif mode == "exit":
        print("leaving")
        raise SystemExit(3)
    elif mode == "raise":
        raise ValueError("probe raised")
    elif mode == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "interrupt":
        raise KeyboardInterrupt
    elif mode == "atexit":
        atexit.register(lambda: print("at exit"))
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
    elif mode == "write-fd":
        os.write(int(args[0]), b"through the fd\n")
        time.sleep(60)
    elif mode == "sleep":
        time.sleep(60)
    elif mode == "spawn":
        from backend import children

        child = children.spawn([sys.executable, "-m", "tests.test_forkserver", "describe"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        out, _ = child.communicate(timeout=60)
        print(json.dumps({"me": os.getpid(), "my_parent": os.getppid(), "grandchild_parent": json.loads(out)["parent"]}))


if __name__ == "__main__":
    _probe(sys.argv[1], sys.argv[2:])
