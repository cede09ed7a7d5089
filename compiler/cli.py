"""The ``batchc`` command line.

- ``batchc run``: the main job. Today: the built-in workload (the ``dump`` scenario's requests plus
  a generated batch of byte prompts with shared prefixes, fresh slots and chunked prompts) through
  the typed pipeline and the ledger-enforced executor, with a progress bar and a summary table.
  The trained model, prefix cache and speculative decoding arrive with later releases.
- ``batchc ab``: the stale-init bug side by side: speculative decoding through the compiled
  pipeline and through the mutable baseline (pre-fix, fixed, and with a ledger) on the same models.
- ``batchc dump``: the IR after every pass of the built-in scenario.
- ``batchc bench pipeline``: decode-step host cost against the mutable baseline.
- ``batchc bench kernels``: the state-pool kernels (Triton on a GPU, torch references on a CPU).

Errors the user can cause (bad option values) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiler.manager import PassManager
from ir.errors import BatchcError


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchc",
        description="Typed batch compiler for hybrid Mamba/attention serving: frozen IR, one-shot state-init "
        "ops as linear resources, a ledger-enforced backend.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the built-in workload end to end and print a summary")
    run.add_argument("--requests", type=_positive, default=64, help="generated requests (default 64)")
    run.add_argument("--max-new-tokens", type=_positive, default=16, help="tokens to generate per request (default 16)")
    run.add_argument("--chunk-size", type=_positive, default=32, help="prefill chunk size in tokens (default 32)")
    run.add_argument("--max-running", type=_positive, default=16, help="requests admitted at once (default 16)")
    run.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    run.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH ('-' for stdout)")

    ab = sub.add_parser("ab", help="the stale-init bug side by side: compiled pipeline vs. mutable baseline")
    ab.add_argument("--k", type=_positive, default=2, help="draft tokens per iteration (default 2)")
    ab.add_argument("--requests", type=_positive, default=12, help="requests (default 12)")
    ab.add_argument("--max-new-tokens", type=_positive, default=24, help="tokens per request (default 24)")
    ab.add_argument("--max-running", type=_positive, default=4, help="requests live at once (default 4)")
    ab.add_argument("--draft-noise", type=float, default=None, help="relative weight noise of the draft (default 0.05)")
    ab.add_argument("--seed", type=int, default=0, help="weights and workload seed (default 0)")
    ab.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH ('-' for stdout)")

    dump = sub.add_parser("dump", help="print the IR after every pass of the built-in scenario")
    dump.add_argument("--verify", type=int, choices=(0, 1, 2), default=2, help="verify level while dumping (default 2)")
    dump.add_argument("--spec", action="store_true", help="the speculative-decoding scenario (tiny hybrid model, k=2)")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="group", required=True, metavar="GROUP")
    bp = bsub.add_parser("pipeline", help="decode-step host cost: compiled pipeline vs. mutable baseline")
    bp.add_argument("--sizes", type=_positive, nargs="+", default=[1, 64, 256, 1024], help="batch sizes")
    bp.add_argument("--repeats", type=_positive, default=7, help="interleaved repeats per size (default 7)")
    bk = bsub.add_parser("kernels", help="state-pool kernels (init ops, selective_state_update)")
    bk.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    return p


def _cmd_dump(args: argparse.Namespace, console: Console) -> int:
    from compiler.scenario import build_driver, run_scenario, run_spec_scenario

    pm = PassManager(verify_level=args.verify, record=True)
    if args.spec:
        run_spec_scenario(pm)
    else:
        driver, checkpoint = build_driver(pm)
        run_scenario(driver, checkpoint)
        driver.ledger.assert_drained()
    assert pm.trace is not None
    for i, (name, text) in enumerate(pm.trace, 1):
        console.print(f"[bold]== {i:03d} {name} ==[/bold]", highlight=False)
        console.out(text.rstrip("\n"), highlight=False)
    return 0


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from compiler.workload import builtin_workload, run_workload

    workload = builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed)
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("serving", total=len(workload))
        summary = run_workload(
            workload,
            chunk_size=args.chunk_size,
            max_running=args.max_running,
            on_finish=lambda n: progress.update(task, completed=n),
        )
    table = Table(title="batchc run: built-in workload (non-speculative path, no-op model)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key not in ("samples", "pass_us_per_step"):
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    passes = Table(title="host time per pass (us per call)")
    passes.add_column("pass")
    passes.add_column("calls", justify="right")
    passes.add_column("us/call", justify="right")
    pass_times = summary["pass_us_per_step"]
    assert isinstance(pass_times, dict)
    for name, (calls, us) in pass_times.items():
        passes.add_row(name, str(calls), f"{us:.1f}")
    console.print(passes)
    samples = summary["samples"]
    assert isinstance(samples, list)
    for rid, prompt, out in samples:
        console.print(f"r{rid}: prompt {prompt!r} -> tokens {out}", highlight=False)
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if summary["outstanding_tickets"] == 0 else 1


def _cmd_ab(args: argparse.Namespace, console: Console) -> int:
    from compiler.ab import DRAFT_NOISE, run_ab

    noise = DRAFT_NOISE if args.draft_noise is None else args.draft_noise
    if not 0.0 <= noise < 10.0:
        raise BatchcError(f"--draft-noise must be in [0, 10), got {noise}")
    with console.status("running plain greedy, compiled, mutable baseline (pre-fix and fixed), and the guarded baseline"):
        result = run_ab(
            k=args.k, requests=args.requests, max_new_tokens=args.max_new_tokens, max_running=args.max_running,
            draft_noise=noise, seed=args.seed,
        )
    runs = result["runs"]
    assert isinstance(runs, dict)
    table = Table(title=f"speculative decoding, k={args.k}, {args.requests} requests (fresh + cached-prefix COW), draft noise {noise}")
    table.add_column("run")
    for h in ("acceptance", "mean accepted len", "init ops target", "init ops draft", "replays", "output == greedy", "wall s"):
        table.add_column(h, justify="right")
    for name, r in runs.items():
        table.add_row(
            name, f"{r['acceptance_rate']:.3f}", f"{r['mean_accepted_length']:.2f}", str(r["init_ops_target"]),
            str(r["init_ops_draft"]), str(r["replays"]), str(r["equals_greedy"]), f"{r['wall_s']:.2f}",
        )
    console.print(table)
    console.print(f"mutable baseline (pre-fix) with a ledger on its runners: {result['ledger_on_baseline']}", highlight=False)
    if args.json:
        text = json.dumps(result, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    compiled = runs["compiled"]
    return 0 if compiled["equals_greedy"] and compiled["replays"] == 0 and compiled["outstanding_tickets"] == 0 else 1


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    if args.group == "pipeline":
        from compiler.bench import PIPELINE_HEADERS, format_pipeline, run_pipeline_bench

        t0 = time.perf_counter()
        rows = run_pipeline_bench(sizes=args.sizes, repeats=args.repeats)
        table = Table(title="decode step host cost: prepare_for_decode + lower + staging (median of interleaved repeats)")
        for h in PIPELINE_HEADERS:
            table.add_column(h, justify="right")
        for r in format_pipeline(rows):
            table.add_row(*r)
        console.print(table)
        console.print(
            f"ratio = compiled / mutable baseline (< 1 means the compiled pipeline is cheaper); "
            f"'compiled' runs with BATCHC_VERIFY=0, '+verify' with level 1. {time.perf_counter() - t0:.1f} s total."
        )
        return 0
    from backend.bench_kernels import run as run_kernel_bench

    print(run_kernel_bench(device=args.device))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: wide enough that the tables do not wrap
        console = Console(width=140)
    args = _parser().parse_args(argv)
    try:
        match args.command:
            case "run":
                return _cmd_run(args, console)
            case "dump":
                return _cmd_dump(args, console)
            case "ab":
                return _cmd_ab(args, console)
            case "bench":
                return _cmd_bench(args, console)
    except BatchcError as exc:
        print(f"batchc: error: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
