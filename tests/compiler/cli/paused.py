"""``batchc`` paused at a chosen point, for the tests that kill it there: ``python -m
tests.compiler.cli.paused POINT MARKER BATCHC-ARGS...`` runs ``compiler.cli.main(BATCHC-ARGS)``; on
reaching ``POINT`` it writes ``MARKER`` (its pid) and sleeps, so the test kills it exactly there. The
product code is unchanged: the points are wrappers around its functions.

- ``start``: the first child process was just started (it is starting up);
- ``mid``: the engine's third step is about to run (``--tp``, ``--overlap``: every child serves),
  or, with ``--dp``, every replica has run for a second of CPU time (they serve);
- ``signal-NAME`` (``signal-SIGKILL``, ``signal-SIGSTOP``): at the engine's third step this
  program sends that signal to every child it started (and waits for a killed one to be gone), and
  goes on without a pause; the marker says when;
- ``shutdown``: rank 0 is about to shut its group down (``TPLeader.shutdown``, after the report
  and its files), the engine to close its executor processes (``Engine.close``), or, with
  ``--dp``, the router to stop the other replica after the first one failed (this program kills
  it once both serve).

``SIGUSR1`` writes every thread's stack to stderr (``faulthandler``): a test whose kill was not acted
on shows where the program was.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

PAUSE_S = 60.0


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    point, marker, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from backend import children
    from compiler.cli import main as batchc
    from compiler.engine import Engine

    def pause() -> None:
        if not marker.exists():  # (once: the unwinding after the kill passes other points)
            marker.write_text(str(os.getpid()))
            time.sleep(PAUSE_S)

    def wrap(owner: Any, name: str, before: Any) -> None:
        real = getattr(owner, name)

        def wrapped(*a: Any, **kw: Any) -> Any:
            before()
            return real(*a, **kw)

        setattr(owner, name, wrapped)

    spawned: list[Any] = []
    real_spawn = children.spawn

    def spawn(*a: Any, **kw: Any) -> Any:
        proc = real_spawn(*a, **kw)
        spawned.append(proc)
        if point == "start":
            pause()
        elif point in ("mid", "shutdown") and "--dp" in args and len(spawned) == int(args[args.index("--dp") + 1]):
            def serving() -> None:
                while not all(_cpu_s(p.pid) > 1.0 for p in spawned):
                    time.sleep(0.02)
                if point == "mid":
                    marker.write_text(str(os.getpid()))  # (the router goes on reading; the test kills it now)
                else:
                    os.kill(spawned[0].pid, signal.SIGKILL)  # a failed replica: the router stops the others

            threading.Thread(target=serving, daemon=True).start()
        return proc

    children.spawn = spawn  # (the wrapper; modules call children.spawn through the module, so they get it)
    if point == "mid" and "--dp" not in args or point.startswith("signal-"):
        steps = [0]

        def third() -> None:
            steps[0] += 1
            if steps[0] != 3:
                return
            if point == "mid":
                pause()
                return
            sig = signal.Signals[point.removeprefix("signal-")]
            for p in spawned:
                os.kill(p.pid, sig)
                if sig == signal.SIGKILL:
                    p.wait()
            marker.write_text(str(os.getpid()))

        wrap(Engine, "step", third)
    if point == "shutdown":
        from backend.tp.serve import TPLeader

        if "--tp" in args:
            wrap(TPLeader, "shutdown", pause)
        else:
            wrap(Engine, "close", pause)
        wrap(children, "kill", lambda: pause() if any(p.poll() is None for p in spawned) else None)
    return batchc(args)


if __name__ == "__main__":
    sys.exit(main())
