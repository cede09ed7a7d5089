"""A ``batchc serve`` process for the tests: started on a free loopback port (``--port 0``; the
line it prints names the port), its stderr read by a thread (the last line is its summary), killed
with whatever it started if a test leaves it running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests import forkserver
from tests.compiler.cli.test_lifetimes import alive, descendants

ROOT = Path(__file__).resolve().parents[3]
LISTENING = re.compile(r"engine process(?:es)? ([\d, ]+)\) listening on (http://127\.0\.0\.1:\d+)")


class ServerProc:
    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, start_s: float = 120.0, real_children: bool = False) -> None:
        """Started from the suite's template (``tests/forkserver.py``); ``real_children`` for a test
        that reads the process tree (``children``: the processes the server itself started, then
        fresh interpreters and its own children, as in a fresh ``batchc serve``)."""
        self.proc = forkserver.Popen([sys.executable, "-m", "compiler.cli", "serve", "--port", "0", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **(env or {})),
                                     real_children=real_children)
        self.lines: list[str] = []
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.start_s = start_s
        self.started = time.monotonic()
        self.engine_pid = -1
        self.engine_pids: list[int] = []
        self.url = ""
        self.children: set[int] = set()

    def ready(self) -> ServerProc:
        """Wait for the line that says it listens (started processes start together, then each is waited for)."""
        deadline = self.started + self.start_s
        start_s = self.start_s
        with self._seen:
            while not any(LISTENING.search(line) for line in self.lines):
                if self.proc.poll() is not None and not self._reading:
                    raise AssertionError(f"batchc serve exited with status {self.proc.returncode}: {self.lines[-5:]}")
                assert time.monotonic() < deadline, f"batchc serve did not start within {start_s} s: {self.lines[-5:]}"
                self._seen.wait(0.1)
        match = next(m for m in map(LISTENING.search, self.lines) if m)
        self.engine_pids = [int(p) for p in match.group(1).split(", ")]
        self.engine_pid = self.engine_pids[0]
        self.url = match.group(2)
        self.children = descendants(self.proc.pid)
        return self

    _reading = True

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._seen:
                self.lines.append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self._reading = False
            self._seen.notify_all()

    def wait(self, timeout_s: float = 60.0) -> int:
        code = self.proc.wait(timeout=timeout_s)
        with self._seen:
            while self._reading:
                self._seen.wait(0.1)
        return code

    def stop(self) -> None:
        """Kill it and whatever it started, if still there."""
        left = descendants(self.proc.pid) | self.children
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        for pid in left:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
