"""SIGINT and SIGTERM end every command the same way: one stderr line saying what was interrupted
and what was (not) written, exit status 130 or 143, no traceback, no process left; an output path
already there stays as it was, and no temporary file is left next to it, even on SIGKILL (the
claim is an unnamed file, linked into place only at the end)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from backend import children
from compiler.cli import output
from compiler.cli.output import OutputFile
from tests.compiler.cli.test_lifetimes import OLD, RUN, alive, descendants, kill_left, paused, wait_for

pytestmark = pytest.mark.real_processes  # how children live and die: batchc starts its children as it does, never from the suite's template


def _claimed(tmp_path: Path, *, outputs: bool) -> tuple[list[str], list[Path]]:
    paths = [tmp_path / "summary.json"] + ([tmp_path / "out.jsonl"] if outputs else [])
    for p in paths:
        p.write_text(OLD)
    args = ["--json", str(paths[0])] + (["--outputs", str(paths[1])] if outputs else [])
    return args, paths


def _ended(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    """The stderr of ``proc`` once it ended after ``sig``; a failure with its stderr if it is still
    running a minute later (``paused.py`` writes every thread's stack on SIGUSR1 first)."""
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        proc.kill()
        pytest.fail(f"batchc did not end within 60 s of {sig.name}; its stderr (and stacks):\n{proc.communicate()[1][-6000:]}")


def _interrupt(tmp_path: Path, args: list[str], sig: signal.Signals) -> tuple[int, str, set[int]]:
    """Run ``batchc ARGS`` to its third engine step, send ``sig``; its status, stderr and the
    processes it had started."""
    marker = tmp_path / "marker"
    proc = paused("mid", marker, args)
    seen: set[int] = set()
    try:
        wait_for(marker, proc)
        seen = descendants(proc.pid)
        os.kill(proc.pid, sig)
        err = _ended(proc, sig)
        deadline = time.monotonic() + 2.0
        while any(alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc.returncode, err, {p for p in seen if alive(p)}
    finally:
        kill_left(seen, proc)


CASES = [
    ("run", RUN, True, signal.SIGINT),
    ("run", [*RUN, "--dp", "2"], True, signal.SIGINT),
    # (--tp 2 and --overlap under SIGTERM: tests/compiler/cli/test_lifetimes.py)
    ("ab", ["ab", "--requests", "4", "--max-new-tokens", "8"], False, signal.SIGINT),
    ("bench serve", ["bench", "serve", "--requests", "4", "--max-new-tokens", "8", "--repeats", "1"], False, signal.SIGTERM),
]


@pytest.mark.parametrize(("what", "args", "outputs", "sig"), CASES, ids=[" ".join(a[:1] + a[-2:]) + f" {s.name}" for _, a, _, s in CASES])
def test_a_signal_ends_the_command_in_one_line(what: str, args: list[str], outputs: bool, sig: signal.Signals, tmp_path: Path) -> None:
    claim, paths = _claimed(tmp_path, outputs=outputs)
    code, err, left = _interrupt(tmp_path, [*args, *claim], sig)
    said = ", ".join(f"{opt} {str(p)!r} not written" for opt, p in zip(("--json", "--outputs"), paths, strict=False))
    assert err.splitlines() == [f"batchc: {what} interrupted by {sig.name}; {said}"], err
    assert code == 128 + sig and "Traceback" not in err
    assert not left, f"processes {left} outlived batchc"
    assert [p.read_text() for p in paths] == [OLD] * len(paths)  # left as they were
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["marker", *(p.name for p in paths)])  # no temporary file


def test_sigkill_leaves_the_outputs_as_they_were_and_no_temporary_file(tmp_path: Path) -> None:
    claim, paths = _claimed(tmp_path, outputs=True)
    code, _, left = _interrupt(tmp_path, [*RUN, *claim], signal.SIGKILL)
    assert code == -signal.SIGKILL and not left
    assert [p.read_text() for p in paths] == [OLD, OLD]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker", "out.jsonl", "summary.json"]


# -- the claim itself, in process --------------------------------------------------------------


def test_a_claimed_path_has_no_name_until_it_is_written(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    target.write_text(OLD)
    target.chmod(0o640)
    with OutputFile("--json", str(target)) as out:
        assert sorted(os.listdir(tmp_path)) == ["run.json"]  # an unnamed file: nothing for SIGKILL to leave behind
        assert target.read_text() == OLD
        out.write("new")
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o640 and out.written
    fresh = tmp_path / "fresh.json"
    with OutputFile("--json", str(fresh)) as out:
        assert not fresh.exists()
        out.write("{}")
    assert fresh.read_text() == "{}\n" and sorted(os.listdir(tmp_path)) == ["fresh.json", "run.json"]


def test_without_unnamed_files_the_named_claim_goes_on_an_interruption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(OutputFile, "_unnamed", lambda self, parent: None)  # a filesystem without O_TMPFILE
    target = tmp_path / "run.json"
    target.write_text(OLD)
    with pytest.raises(children.Interrupted):
        with OutputFile("--json", str(target)):
            assert len(os.listdir(tmp_path)) == 2  # .run.json.<hex>.tmp
            raise children.Interrupted(signal.SIGTERM)
    assert os.listdir(tmp_path) == ["run.json"] and target.read_text() == OLD
    with OutputFile("--json", str(target)) as out:
        out.write("new")
    assert os.listdir(tmp_path) == ["run.json"] and target.read_text() == "new\n"


def test_a_signal_while_the_file_is_put_in_place_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(children, "kill_all", lambda: None)  # (this test process's other children are not this test's)
    target = tmp_path / "run.json"
    target.write_text(OLD)
    output.claimed.clear()
    with children.on_signals():
        with pytest.raises(children.Interrupted):
            with OutputFile("--json", str(target)) as out:
                real = out._put_in_place

                def put(fd: int) -> None:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives between the two steps of the placement
                    real(fd)

                out._put_in_place = put  # type: ignore[method-assign]  # the test's wrapper
                out.write("new")
        assert children.interrupted() == signal.SIGTERM
    assert target.read_text() == "new\n" and output.claimed == [out] and out.written
    assert os.listdir(tmp_path) == ["run.json"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_while_the_command_line_is_still_importing_ends_it_in_one_line(sig: signal.Signals, tmp_path: Path) -> None:
    """The console script's entry (``compiler.launch``) handles signals before importing the command
    line: a Ctrl-C then is one line and 130, not a ``KeyboardInterrupt`` traceback."""
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    out.write_text(OLD)
    # The command line imports in a fraction of a second (torch and the models load later, under the
    # command's own handlers): a finder makes its import slow, so that the signal lands inside it.
    # The finder says so on a pipe when it is in (on a loaded machine the interpreter's own start can
    # take longer than any fixed wait).
    inside_r, inside_w = os.pipe()
    entry = ("import importlib.abc, os, sys, time\n"
             "class Slow(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name == 'compiler.cli':\n"
             f"            os.write({inside_w}, b'in'); time.sleep(60)\n"
             "        return None\n"
             "sys.meta_path.insert(0, Slow())\n"
             "from compiler.launch import main; sys.argv[0] = 'batchc'; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", entry, "run", "--json", str(out)], stderr=subprocess.PIPE, text=True, pass_fds=(inside_w,))
    os.close(inside_w)
    try:
        with os.fdopen(inside_r, "rb") as inside:
            assert inside.read(2) == b"in"  # the entry is in, importing the command line
        os.kill(proc.pid, sig)
        err = _ended(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    assert err == f"batchc: interrupted by {sig.name} while starting; nothing started or written\n"
    assert out.read_text() == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_while_the_process_exits_after_the_command_is_never_a_silent_death(sig: signal.Signals) -> None:
    """After the command returned, Python's own exit put the default handlers back and then spent a
    second or more tearing torch down: a signal then ended the process as killed by it, with no
    line (status -15 where the command had succeeded). Here the signal arrives while the modules
    are torn down (an object that a module's teardown frees sends it): the process exits with the
    command's status, or with 128 + the signal and one line."""
    import subprocess
    import sys

    entry = (
        "import os, signal, sys\n"
        "import compiler.cli, compiler.launch\n"
        "class Late:\n"
        f"    def __del__(self): os.kill(os.getpid(), {int(sig)})\n"
        "compiler.cli.late = Late()\n"
        "compiler.cli.main = lambda: 0\n"
        "sys.exit(compiler.launch.main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", entry], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert (proc.returncode, proc.stderr) in ((0, ""), (128 + sig, f"batchc: interrupted by {sig.name} while exiting, after the command ended\n")), proc
