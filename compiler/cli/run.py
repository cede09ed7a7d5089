"""``batchc run``: the main job, rendered (tables, samples, the lossless check) from its
``ServeSummary``; exit status 1 when the run failed."""

from __future__ import annotations

import argparse
import json
import sys

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiler.cli.args import UsageError, shown_path
from compiler.cli.output import OutputFile, check_output


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    from backend.hybrid.checkpoint import default_draft, default_target, load_checkpoint
    from compiler.serve import LONGEST_BUILTIN_PROMPT, ServeConfig, builtin_workload, check_serving, load_workload, run

    cfg = ServeConfig(
        k=args.k, max_running=args.max_running, chunk_size=args.chunk_size, token_budget=args.token_budget,
        cache_entries=args.cache_entries, lossless_sample=args.lossless_sample, overlap=args.overlap,
    )
    # every check before anything runs: options, output path, models, memory, workload
    if args.draft is not None and args.k == 0:
        raise UsageError(f"--draft {shown_path(args.draft)} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    if args.json is not None:
        check_output("--json", args.json)
    if args.workload is None and args.max_new_tokens > cfg.builtin_max_new_tokens:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens} is over {cfg.builtin_max_new_tokens}: the context limit {cfg.max_len} minus "
            f"the longest built-in prompt ({LONGEST_BUILTIN_PROMPT} bytes) minus k + 1 = {cfg.reserve}"
        )
    target = load_checkpoint(args.model) if args.model is not None else default_target()
    draft = None if args.k == 0 else (load_checkpoint(args.draft) if args.draft is not None else default_draft())
    names = (f"target {args.model}" if args.model is not None else "bundled target",
             f"draft {args.draft}" if args.draft is not None else "bundled draft")
    check_serving(target.config, draft.config if draft is not None else None, cfg, compare_mutable=args.compare_mutable, names=names)
    if args.workload is not None:
        workload = load_workload(args.workload, max_len=cfg.max_len, reserve=cfg.reserve, vocab=target.config.vocab)
    else:
        workload = builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed, arrivals=args.arrivals)
    from compiler.tools.timed import TimedModel

    # the models' forwards are timed (host time per step = wall minus model time, per step)
    timed_target = TimedModel(target)
    timed_draft = TimedModel(draft) if draft is not None else None
    comparing = args.compare_mutable and draft is not None and cfg.k > 0
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as progress:
            task = progress.add_task("serving", total=len(workload))
            if comparing:
                from compiler.tools.compare_mutable import warm_up

                progress.update(task, description="warming up every engine")
                warm_up(workload, target, draft, cfg)  # so that no measured run of the comparison pays first-call costs
                progress.update(task, description="serving")
            summary = run(
                workload, timed_target, timed_draft, cfg, on_finish=lambda n: progress.update(task, completed=n),
                compare_mutable=args.compare_mutable,
                model_clock=lambda: timed_target.seconds + (timed_draft.seconds if timed_draft is not None else 0.0),
            )
            if comparing:
                from compiler.tools.compare_mutable import run_mutable

                assert draft is not None
                progress.update(task, description="mutable baseline")
                summary = attrs.evolve(summary, mutable_baseline=run_mutable(workload, target, draft, cfg, fixed=False),
                                       mutable_baseline_fixed=run_mutable(workload, target, draft, cfg, fixed=True))
        title = f"batchc run: {len(workload)} requests, k={args.k}, {'bundled' if args.model is None else args.model} target"
        table = Table(title=title)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.to_json().items():
            if key in ("samples", "pass_us_per_step", "mutable_baseline", "mutable_baseline_fixed", "lossless_ok",
                       "tokens_per_s_vs_mutable_fixed") or value is None:
                continue
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        console.print(table)
        passes = Table(title="host time per pass")
        passes.add_column("pass")
        passes.add_column("calls", justify="right")
        passes.add_column("us/call", justify="right")
        for name, (calls, us) in summary.pass_us_per_step.items():
            passes.add_row(name, str(calls), f"{us:.1f}")
        console.print(passes)
        mutable, fixed = summary.mutable_baseline, summary.mutable_baseline_fixed
        if mutable is not None and fixed is not None:
            ab = Table(title="compiled pipeline vs. mutable baseline, same workload and models, every engine warmed up first")
            for h in ("run", "acceptance", "mean accepted len", "replays", "stale init ops run", "steps", "tokens/s",
                      "host ms/step"):
                ab.add_column(h, justify="right")
            ab.add_row("compiled", f"{summary.acceptance_rate:.3f}", f"{summary.mean_accepted_length:.2f}",
                       str(summary.replays_blocked), "0", str(summary.steps), f"{summary.tokens_per_s:.1f}",
                       f"{summary.host_ms_per_step:.2f}" if summary.host_ms_per_step is not None else "-")
            for name, m in (("mutable, pre-fix", mutable), ("mutable + upstream fix", fixed)):
                ab.add_row(name, f"{m.acceptance_rate:.3f}", f"{m.mean_accepted_length:.2f}",
                           str(m.replays), str(m.stale_ops_run), str(m.steps), f"{m.tokens_per_s:.1f}", f"{m.host_ms_per_step:.2f}")
            console.print(ab)
            console.print(
                f"tokens/s, compiled / mutable + upstream fix: {summary.tokens_per_s_vs_mutable_fixed:.2f}x. host ms/step = "
                "(wall - time inside model forwards) / steps, the host time the forwards do not hide.",
                highlight=False,
            )
        for sample in summary.samples:
            console.print(f"r{sample.rid}: ...{sample.prompt!r} -> {sample.completion!r}", highlight=False)
        output.write(json.dumps(summary.to_json(), indent=2))
    failures = []
    if summary.aborted_requests:
        failures.append(f"{summary.aborted_requests} requests aborted by {summary.failed_forwards} failed forwards, "
                        f"first: {summary.first_failure}")
    if summary.outstanding_tickets:
        failures.append(f"{summary.outstanding_tickets} tickets never consumed")
    if summary.lossless_ok is False:
        failures.append(f"lossless check {summary.lossless_check}")
    if failures:
        print(f"batchc: run failed: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


