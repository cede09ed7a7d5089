"""``batchc dump``, ``batchc ab`` and ``batchc bench``: the development commands. Each imports its
tool from ``compiler.tools`` (or ``backend.tools``) when it runs."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from compiler.cli.args import UsageError
from compiler.cli.output import OutputFile
from compiler.manager import PassManager
from ir.errors import BatchcError

if TYPE_CHECKING:  # the tools are imported by the commands that run them
    from compiler.tools.ab import AbReport


def cmd_dump(args: argparse.Namespace, console: Console) -> int:
    from compiler.tools.scenario import run_scenario, run_spec_scenario

    pm = PassManager(verify_level=args.verify, record=True)
    if args.spec:
        run_spec_scenario(pm)
    else:
        run_scenario(pm)
    assert pm.trace is not None
    for i, (name, text) in enumerate(pm.trace, 1):
        console.print(f"[bold]== {i:03d} {name} ==[/bold]", highlight=False)
        console.out(text.rstrip("\n"), highlight=False)
    return 0


def _print_ab(args: argparse.Namespace, noise: float, result: AbReport, console: Console) -> None:
    table = Table(title=f"speculative decoding, k={args.k}, {args.requests} requests (fresh + cached-prefix COW), draft noise {noise}")
    table.add_column("run")
    for h in ("acceptance", "mean accepted len", "init ops target", "init ops draft", "replays", "output == greedy", "wall s"):
        table.add_column(h, justify="right")
    for name, r in result.runs.items():
        table.add_row(
            name, f"{r.acceptance_rate:.3f}", f"{r.mean_accepted_length:.2f}", str(r.init_ops_target),
            str(r.init_ops_draft), str(r.replays), str(r.equals_greedy), f"{r.wall_s:.2f}",
        )
    console.print(table)
    console.print(f"mutable baseline (pre-fix) with a ledger on its runners: {result.ledger_on_baseline}", highlight=False)


def cmd_ab(args: argparse.Namespace, console: Console) -> int:
    from compiler.tools.ab import DRAFT_NOISE, run_ab

    noise = DRAFT_NOISE if args.draft_noise is None else args.draft_noise
    if not 0.0 <= noise < 10.0:
        raise BatchcError(f"--draft-noise must be in [0, 10), got {noise}")
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with console.status("running plain greedy, compiled, mutable baseline (pre-fix and fixed), and the guarded baseline"):
            result = run_ab(
                k=args.k, requests=args.requests, max_new_tokens=args.max_new_tokens, max_running=args.max_running,
                draft_noise=noise, seed=args.seed,
            )
        _print_ab(args, noise, result, console)
        output.write(json.dumps(result.to_json(), indent=2))
    compiled = result.compiled
    return 0 if compiled.equals_greedy and compiled.replays == 0 and compiled.outstanding_tickets == 0 else 1


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    if args.group == "pipeline":
        from compiler.tools.bench_pipeline import PIPELINE_HEADERS, format_pipeline, run_pipeline_bench

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
        from compiler.serve import ServeConfig, builtin_workload
        from compiler.tools.bench_serve import run_serve_bench

        bound = ServeConfig(k=2).builtin_max_new_tokens  # the bench serves at k = 0 and k = 2
        if args.max_new_tokens > bound:
            raise UsageError(f"--max-new-tokens {args.max_new_tokens} is over {bound}: the longest built-in prompt plus k + 1 = 3 must fit 512")
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
    from backend.tools.bench_kernels import run as run_kernel_bench

    print(run_kernel_bench(device=args.device))
    return 0


