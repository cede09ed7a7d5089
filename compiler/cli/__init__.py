"""The ``batchc`` command line.

- ``batchc run``: the main job: a workload (built-in, or a JSONL file) served on the bundled trained
  target and draft with the prefix cache, chunked prefill, continuous batching and speculative
  decoding; a progress bar, a summary table (``--json`` too), sample completions and the lossless
  check; ``--compare-mutable`` adds the pre-fix mutable baseline on the same workload.
- ``batchc ab``: the stale-init bug side by side: speculative decoding through the compiled
  pipeline and through the mutable baseline (pre-fix, fixed, and with a ledger) on the same models.
- ``batchc dump``: the IR after every pass of the built-in scenario.
- ``batchc bench pipeline``: decode-step host cost against the mutable baseline.
- ``batchc bench iteration``: one speculative iteration's model phases in target decodes.
- ``batchc bench kernels``: the state-pool kernels (Triton on a GPU; on a CPU the torch paths, and
  the batched ones against the per-row references they replaced).

Bad input the user can cause (option values and their bounds, an empty path, ``--draft`` with
``--k 0``, ``BATCHC_VERIFY`` and ``BATCHC_DUMP_DIR``, workload files, checkpoint files, the ``--json``
path) prints one line on stderr and exits with status 2 before anything runs. ``--json`` claims its
path before the run: a temporary file created next to it (never through a link, device or FIFO at
the path) is filled and renamed onto it when the run ends. ``batchc run`` exits with status 1, saying why in one
line on stderr, when a forward failed and aborted requests, a ticket was never consumed, or the
lossless check failed.

``batchc run``, ``batchc ab`` and every ``batchc bench`` group set torch's intra-op threads (``--threads``, default
``ServeConfig.threads``) before any work.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console

from compiler.cli.args import UsageError, parser
from compiler.cli.run import cmd_run
from compiler.cli.tools import cmd_ab, cmd_bench, cmd_dump
from compiler.manager import settings_from_env
from ir.errors import BatchcError

__all__ = ["UsageError", "main", "parser"]


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: wide enough that the tables do not wrap
        console = Console(width=140)
    args = parser().parse_args(argv)  # a bad command line: one line on stderr, SystemExit(2)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # (batchc run --tp starts its other ranks with it)
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
    except BatchcError as exc:
        print(f"batchc: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command!r}")


