"""The ``batchc`` command line.

- ``batchc run``: the main job: a workload (built-in, or a JSONL file) served on the bundled trained
  target and draft with the prefix cache, chunked prefill, continuous batching and speculative
  decoding; a progress bar, a summary table (``--json`` too), sample completions and the lossless
  check; ``--compare-mutable`` adds the pre-fix mutable baseline on the same workload.
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
from compiler.workload import ARRIVALS, BURST_EVERY, BURST_SIZE
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

    run = sub.add_parser("run", help="serve a workload (default: the built-in one on the bundled trained models)")
    run.add_argument("--model", metavar="PATH", help="target checkpoint (.safetensors; default: the bundled one)")
    run.add_argument("--draft", metavar="PATH", help="draft checkpoint (default: the bundled one)")
    run.add_argument("--workload", metavar="PATH", help="JSONL workload file (default: the built-in workload)")
    run.add_argument("--requests", type=_positive, default=64, help="built-in workload size (default 64)")
    run.add_argument("--max-new-tokens", type=_positive, default=32, help="built-in workload: max tokens per request (default 32)")
    run.add_argument("--k", type=int, default=2, help="draft tokens per speculative iteration; 0 turns it off (default 2)")
    run.add_argument("--max-running", type=_positive, default=8, help="requests live at once (default 8)")
    run.add_argument("--chunk-size", type=_positive, default=64, help="prefill chunk size in tokens (default 64)")
    run.add_argument("--token-budget", type=_positive, default=256, help="prefill tokens per step (default 256)")
    run.add_argument("--cache-entries", type=_positive, default=8, help="prefix-cache checkpoints (default 8)")
    run.add_argument("--seed", type=int, default=0, help="built-in workload seed (default 0)")
    run.add_argument("--arrivals", choices=ARRIVALS, default="bursts",
                     help=f"built-in workload: {BURST_SIZE} requests every {BURST_EVERY} steps, or one at a time 0-2 steps apart (default bursts)")
    run.add_argument("--lossless-sample", type=int, default=4, help="requests re-run with plain greedy to check losslessness (default 4)")
    run.add_argument("--compare-mutable", action="store_true", help="also run the workload through the pre-fix mutable baseline")
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
    bs = bsub.add_parser("serve", help="serving workload at k=0 and k=2: compiled pipeline vs. mutable baseline")
    bs.add_argument("--requests", type=_positive, default=24, help="built-in workload size (default 24)")
    bs.add_argument("--max-new-tokens", type=_positive, default=24, help="max tokens per request (default 24)")
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
    from backend.hybrid.checkpoint import default_draft, default_target, load_checkpoint
    from compiler.serve import ServeConfig, builtin_workload, load_workload, run

    if args.k < 0:
        raise BatchcError(f"--k must be >= 0, got {args.k}")
    cfg = ServeConfig(
        k=args.k, max_running=args.max_running, chunk_size=args.chunk_size, token_budget=args.token_budget,
        cache_entries=args.cache_entries, lossless_sample=max(0, args.lossless_sample),
    )
    target = load_checkpoint(args.model) if args.model else default_target()
    draft = None if args.k == 0 else (load_checkpoint(args.draft) if args.draft else default_draft())
    if args.workload:
        workload = load_workload(args.workload, max_len=cfg.max_len)
    else:
        workload = builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed, arrivals=args.arrivals)
    with Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        task = progress.add_task("serving", total=len(workload))
        summary = run(workload, target, draft, cfg, on_finish=lambda n: progress.update(task, completed=n),
                      compare_mutable=args.compare_mutable)
    title = f"batchc run: {len(workload)} requests, k={args.k}, {'bundled' if not args.model else args.model} target"
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key in ("samples", "pass_us_per_step", "mutable_baseline", "mutable_baseline_fixed", "lossless_ok"):
            continue
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    passes = Table(title="host time per pass")
    passes.add_column("pass")
    passes.add_column("calls", justify="right")
    passes.add_column("us/call", justify="right")
    pass_times = summary["pass_us_per_step"]
    assert isinstance(pass_times, dict)
    for name, (calls, us) in pass_times.items():
        passes.add_row(name, str(calls), f"{us:.1f}")
    console.print(passes)
    mutable, fixed = summary.get("mutable_baseline"), summary.get("mutable_baseline_fixed")
    if isinstance(mutable, dict) and isinstance(fixed, dict):
        ab = Table(title="compiled pipeline vs. mutable baseline, same workload and models")
        for h in ("run", "acceptance", "mean accepted len", "replays", "stale init ops run", "tokens/s"):
            ab.add_column(h, justify="right")
        ab.add_row("compiled", f"{summary['acceptance_rate']:.3f}", f"{summary['mean_accepted_length']:.2f}",
                   str(summary["replays_blocked"]), "0", f"{summary['tokens_per_s']:.1f}")
        for name, m in (("mutable, pre-fix", mutable), ("mutable + upstream fix", fixed)):
            ab.add_row(name, f"{m['acceptance_rate']:.3f}", f"{m['mean_accepted_length']:.2f}",
                       str(m["replays"]), str(m["stale_ops_run"]), f"{m['tokens_per_s']:.1f}")
        console.print(ab)
    samples = summary["samples"]
    assert isinstance(samples, list)
    for s in samples:
        console.print(f"r{s['rid']}: ...{s['prompt']!r} -> {s['completion']!r}", highlight=False)
    if args.json:
        text = json.dumps(summary, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    ok = summary["outstanding_tickets"] == 0 and summary.get("lossless_ok", True)
    return 0 if ok else 1


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
    if args.group == "serve":
        from backend.hybrid.checkpoint import default_draft, default_target
        from compiler.bench_serve import run_serve_bench
        from compiler.serve import builtin_workload

        workload = builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens)
        with console.status("serving the workload four times (k=0 and k=2, compiled and mutable)"):
            srows = run_serve_bench(default_target(), default_draft(), workload)
        table = Table(title=f"bench serve: {len(workload)} requests, bundled target and draft, side by side in one run")
        for h in ("k", "engine", "tokens", "tokens/s", "steps", "model s", "host ms/step"):
            table.add_column(h, justify="right")
        for sr in srows:
            table.add_row(
                str(sr.k), sr.engine, str(sr.tokens), f"{sr.tokens_per_s:.1f}", str(sr.steps), f"{sr.model_s:.2f}",
                f"{sr.host_ms_per_step:.2f}",
            )
        console.print(table)
        console.print("host ms/step = (wall - time inside model forwards) / steps. The baseline has no prefix cache.")
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
