"""Every process batchc starts (tensor-parallel ranks, data-parallel replicas, overlap executor
processes) starts here, dies with the process that started it, and is spoken of in one vocabulary.

Invariants:

- ``spawn`` is the only way batchc starts a child. On Linux the child gets a parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) between fork and exec, and then checks that its parent is
  still the process that spawned it: a parent that died before the ``prctl`` would otherwise go
  unnoticed. So a child dies within milliseconds of its parent, whatever killed the parent (SIGKILL
  included) and whenever (start-up, mid-run, shutdown): no child relies on polling a pipe. The kernel
  ties that signal to the *thread* that forked, so children are forked by the main thread, or, when
  ``spawn`` is called on another thread (which may end before the process), by one spawner thread
  that lives as long as the process. Each level does the same: a child that starts processes of its
  own (a replica's or a rank's executor processes) starts them through ``spawn`` too.
- Each child leads its own process group: the terminal's Ctrl-C reaches the batchc process alone
  (it speaks for the run, in one line), and ``kill`` / ``kill_all`` signal a child together with any
  process of its group.
- ``on_signals`` turns SIGINT and SIGTERM into ``Interrupted`` in the main thread, after killing every
  live child at once (so nothing the unwinding waits for is still running); ``interrupted`` tells
  anyone unwinding that the run was interrupted, so a failure the kills caused is not reported as
  the run's own.
- ``ended`` is the one wording of how a process ended ("killed by signal 9", "exited with status 3"),
  and ``no_answer`` of a timeout ("did not answer within 600 s"), in every mode.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import IO, Final

log = logging.getLogger("batchc.children")

_PR_SET_PDEATHSIG: Final = 1
_LINUX: Final = sys.platform.startswith("linux")


def _load_prctl() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # ctypes' function-pointer base has no public name
    if not _LINUX:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()
"""Resolved here, once: the child between fork and exec only calls it (no lookup, no allocation)."""

_live: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()
_lock = threading.RLock()
"""Guards ``_live`` and the spawner's start. Re-entrant: the signal handler (``kill_all``) runs on the
main thread between any two of its bytecodes, also inside a ``with _lock`` of ``spawn``."""


def _die_with(parent: int) -> None:
    """Runs in the child between fork and exec (the parent-death signal survives exec)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl: nothing would ever signal us
        os._exit(1)


def spawn(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: int | IO[bytes] | None = None,
    stdout: int | IO[bytes] | None = None, stderr: int | IO[bytes] | None = None, pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``args`` as a child that dies with this process, leading its own process group."""
    parent = os.getpid()

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(args), env=None if env is None else dict(env), stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=tuple(pass_fds),
            process_group=0, preexec_fn=lambda: _die_with(parent),
        )

    # the parent-death signal fires when the forking thread ends, not the process
    if threading.current_thread() is not threading.main_thread():
        proc = _on_spawner(start)
        with _lock:
            _live.add(proc)
        return proc
    with deferred():  # a signal (handled on this thread) waits until the child is recorded: kill_all finds it
        proc = start()
        with _lock:
            _live.add(proc)
    return proc


def spawn_module(module: str) -> tuple[subprocess.Popen[bytes], multiprocessing.connection.Connection]:
    """``python -m module FD`` as a child that dies with this process, and this side of a socket pair
    whose other end is the child's ``FD``: a fresh interpreter (not fork: the caller's threads and
    locks stay behind; not the multiprocessing start methods: they re-import the caller's
    ``__main__``), on this process's ``sys.path``, its stdin closed."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = spawn([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, multiprocessing.connection.Connection(ours.detach())


_requests: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[bytes]], queue.SimpleQueue[object]]] = queue.SimpleQueue()
_spawner: threading.Thread | None = None


def _spawner_loop() -> None:
    while True:
        start, reply = _requests.get()
        try:
            reply.put(start())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            reply.put(exc)


def _on_spawner(start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """Run ``start`` on the spawner thread (a daemon that ends with the process), started once."""
    global _spawner
    with _lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawner_loop, name="batchc-spawner", daemon=True)
            _spawner.start()
    reply: queue.SimpleQueue[object] = queue.SimpleQueue()
    _requests.put((start, reply))
    out = reply.get()
    if isinstance(out, BaseException):
        raise out
    assert isinstance(out, subprocess.Popen)
    return out


def kill(proc: subprocess.Popen[bytes], *, wait_s: float = 10.0) -> None:
    """SIGKILL ``proc`` and its process group, and reap it."""
    if proc.poll() is None:  # (not reaped: its pid, hence its group's id, is still ours)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass


def kill_all() -> None:
    """SIGKILL every live child this process spawned (and their groups), without waiting."""
    with _lock:
        procs = list(_live)
    for proc in procs:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def ended(returncode: int) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def no_answer(seconds: float) -> str:
    """The one wording of a timeout: "did not answer within 600 s"."""
    return f"did not answer within {seconds:g} s"


# -- signals ---------------------------------------------------------------------------------------


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived (``on_signals``); a BaseException, so no ``except Exception`` that
    turns failures into aborted requests swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []
_deferring = [0]
_deferred: list[int] = []


def interrupted() -> int | None:
    """The signal that interrupted this process under ``on_signals``, if one did."""
    return _received[0] if _received else None


def raise_if_interrupted() -> None:
    """Raise ``Interrupted`` again when a signal arrived: a failure seen while unwinding from it
    (a child it killed, say) is not the run's own."""
    if _received:
        raise Interrupted(_received[0])


def _handler(signum: int, frame: FrameType | None) -> None:
    if _deferring[0]:
        _deferred.append(signum)
        return
    if _received:
        if len(_received) >= 2:  # a third signal: the unwinding hangs, leave now
            os._exit(128 + _received[0])
        _received.append(signum)
        return
    _received.append(signum)
    kill_all()
    raise Interrupted(signum)


@contextmanager
def deferred() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM (under ``on_signals``) wait until it ends: for a few
    steps that must not be cut in two (linking a finished file into place). (Blocking the signals
    would not do: the kernel hands them to another thread, and the interpreter runs the handler on
    the main thread at once.)"""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
        if not _deferring[0] and _deferred:
            signum = _deferred.pop(0)
            _deferred.clear()
            _handler(signum, None)


@contextmanager
def on_signals() -> Iterator[None]:
    """Within the block (main thread only; elsewhere a no-op): SIGINT and SIGTERM kill every child
    and raise ``Interrupted`` (see the module); a second one while unwinding is noted, a third
    leaves at once (exit status 128 + the first signal). The previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _deferred.clear()
    old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _received.clear()  # (read ``interrupted`` inside the block: a later caller starts afresh)
        _deferred.clear()


__all__ = [
    "Interrupted", "deferred", "ended", "interrupted", "kill", "kill_all", "no_answer", "on_signals", "raise_if_interrupted", "spawn",
    "spawn_module",
]
