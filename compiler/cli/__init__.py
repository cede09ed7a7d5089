"""The ``batchc`` command line.

- ``batchc run``: the main job: a workload (built-in, or a JSONL file) served on the bundled trained
  target and draft with the prefix cache, chunked prefill, continuous batching and speculative
  decoding; a progress bar, a summary table (``--json`` too), sample completions and the lossless
  check; ``--compare-mutable`` adds the pre-fix mutable baseline on the same workload.
- ``batchc ab``: the stale-init bug side by side: speculative decoding through the compiled
  pipeline and through the mutable baseline (pre-fix, fixed, and with a ledger) on the same models.
- ``batchc serve``: an OpenAI-compatible HTTP server on the engine (``compiler.online``).
- ``batchc train-draft``: train an MTP/EAGLE draft head for a target on its own greedy
  continuations (``compiler.cli.train``, ``backend.tools.train_head``).
- ``batchc dump``: the IR after every pass of the built-in scenario.
- ``batchc bench pipeline``: decode-step host cost against the mutable baseline.
- ``batchc bench iteration``: one speculative iteration's model phases in target decodes.
- ``batchc bench kernels``: the state-pool kernels (Triton on a GPU; on a CPU the torch paths, and
  the batched ones against the per-row references they replaced).

Bad input the user can cause (option values and their bounds, an empty path, ``--draft`` with
``--k 0``, ``BATCHC_VERIFY`` and ``BATCHC_DUMP_DIR``, workload files, checkpoint files, the ``--json``
path) prints one line on stderr and exits with status 2 before anything runs. ``--json`` claims its
path before the run: a temporary file in its directory (unnamed where the filesystem allows; never
written through a link, device or FIFO at the path) is filled and put in place when the run ends. ``batchc run`` exits with status 1, saying why in one
line on stderr, when a forward failed and aborted requests, a request ended in error (the logits for
its next token were not finite), a ticket was never consumed, or the lossless check failed; with status 2, after serving the others and writing every output, when
workload requests were refused on their own (they do not fit the context, ``--max-len``): one line
names how many and the first one's file, line and sizes.

``batchc run``, ``batchc ab`` and every ``batchc bench`` group set torch's intra-op threads (``--threads``, default
``ServeConfig.threads``) before any work.

SIGINT (Ctrl-C) and SIGTERM end every command the same way: every process the command started is
killed at once (they die with it anyway: ``backend.children``), one line on stderr says what was
interrupted and which output paths were written or left as they were, and the exit status is 130
(SIGINT) or 143 (SIGTERM), never a traceback. An output path is written whole or not at all, and no
temporary file is left next to it (``compiler.cli.output``).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from rich.console import Console

from backend import children
from compiler.cli import output
from compiler.cli.args import UsageError, parser, shown_path
from compiler.cli.run import cmd_run
from compiler.cli.serve import cmd_serve
from compiler.cli.tools import cmd_ab, cmd_bench, cmd_dump
from compiler.cli.train import cmd_train_draft, interrupted_note
from compiler.manager import settings_from_env
from ir.errors import BatchcError

__all__ = ["UsageError", "main", "parser"]


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: wide enough that the tables do not wrap
        console = Console(width=160)
    args = parser().parse_args(argv)  # a bad command line: one line on stderr, SystemExit(2)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # (batchc run --tp starts its other ranks with it)
    output.claimed.clear()
    with children.on_signals():
        try:
            code = _command(args, console)
        except children.Interrupted:
            pass
        except BaseException:
            if children.interrupted() is None:
                raise
        # (a failure while unwinding from a signal, or a signal some code swallowed, is still that signal)
        signum = children.interrupted()
        if signum is None:
            return code
        print(_interrupted_line(args, signum), file=sys.stderr, flush=True)
        return 128 + signum


def _interrupted_line(args: argparse.Namespace, signum: int) -> str:
    """One line: the command, the signal, and what became of each output path it claimed."""
    what = args.command + (f" {args.group}" if args.command == "bench" else "")
    name = signal.Signals(signum).name
    if args.command == "train-draft":
        return f"batchc: {what} interrupted by {name}; {interrupted_note() or 'no checkpoint written yet'}"
    paths = [(o.option, "to stdout" if o.path == "-" else shown_path(o.path or ""), o.written) for o in output.claimed]
    if not paths:
        return f"batchc: {what} interrupted by {name}; nothing written"
    said = ", ".join(f"{opt} {where} {'written' if done else 'not written'}" for opt, where, done in paths)
    return f"batchc: {what} interrupted by {name}; {said}"


def _command(args: argparse.Namespace, console: Console) -> int:
    try:
        settings_from_env()  # BATCHC_VERIFY, BATCHC_DUMP_DIR: refused here, before anything runs
        if args.command in ("run", "bench", "ab"):  # every bench group takes --threads too
            import torch

            torch.set_num_threads(args.threads)
        match args.command:
            case "run":
                return cmd_run(args, console)
            case "dump":
                return cmd_dump(args, console)
            case "ab":
                return cmd_ab(args, console)
            case "bench":
                return cmd_bench(args, console)
            case "serve":
                return cmd_serve(args)
            case "train-draft":
                return cmd_train_draft(args, console)
    except BatchcError as exc:
        children.raise_if_interrupted()  # (refused while unwinding from a signal: the signal speaks)
        print(f"batchc: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command!r}")


