"""The ``batchc`` console script's entry point: signals are handled from the first instruction.

Starting a command takes seconds (importing torch, loading the models; the command line itself
imports neither). A SIGINT or SIGTERM in that window would otherwise end the process in Python's
default way (a ``KeyboardInterrupt`` traceback, or a silent exit 143). Nothing has been started or written yet then (no child, no claimed path), so the
early handler says so in one line and exits at once with 130 or 143; ``compiler.cli.main`` installs
the real handlers (``backend.children.on_signals``) before it starts anything. This module imports
only the standard library, so that it is loaded before the heavy imports begin. When the command
has returned, this module's handler stays until the process is gone: it runs the exit hooks and
leaves with ``os._exit``, as Python's own exit would put the default handlers back for the second
or more it spends tearing torch down (a signal then ended the process silently, as if killed).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from types import FrameType

_phase = ["while starting; nothing started or written"]


def _outside_the_command(signum: int, frame: FrameType | None) -> None:
    print(f"batchc: interrupted by {signal.Signals(signum).name} {_phase[0]}", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # nothing to unwind: no child, no output path claimed (or all of it done)


def main() -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _outside_the_command)
    from compiler.cli import main as cli_main  # (the heavy import, under the early handler)

    try:
        code = cli_main()
    except SystemExit as exc:  # argparse: a bad command line (2) or --help (0), already said
        if not (exc.code is None or isinstance(exc.code, int)):
            raise
        code = exc.code or 0
    finally:
        # (cli_main's own handlers are gone again: a signal now only cuts the interpreter's exit short)
        _phase[0] = "while exiting, after the command ended"
    # Python's own exit puts the default handlers back before it tears the modules down (a second or
    # more with torch loaded, four with --tp 2): a signal then would end the process silently, with
    # no line. The command is done: run the exit hooks under this module's handler, then leave.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)
