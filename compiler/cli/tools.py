"""``batchc dump``, ``batchc ab`` and ``batchc bench``: the development commands. Each imports its
tool from ``compiler.tools`` (or ``backend.tools``) when it runs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from compiler.cli.args import UsageError
from compiler.cli.output import OutputFile, check_output
from compiler.manager import PassManager

if TYPE_CHECKING:  # the tools are imported by the commands that run them
    from backend.hybrid.head import HeadModel
    from backend.hybrid.model import HybridModel
    from compiler.offline.models import Served, ServedHead
    from compiler.tools.ab import AbReport
    from compiler.tools.bench_serve import Sampling


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
    drafting = f"draft noise {noise}" if result.draft == "model" else "the bundled target and its draft head (--draft mtp)"
    table = Table(title=f"speculative decoding, k={args.k}, {args.requests} requests (fresh + cached-prefix COW), {drafting}")
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
    from compiler.tools.ab import DRAFT_NOISE, ab_models, ab_problem, run_ab
    from compiler.workload import ServeError

    if args.draft == "mtp" and args.draft_noise is not None:
        raise UsageError(f"--draft-noise {args.draft_noise} with --draft mtp: the draft head is a trained model, not a noisy copy")
    noise = DRAFT_NOISE if args.draft_noise is None else args.draft_noise  # finite, in [0, 10): argparse checked it
    problem = ab_problem(k=args.k, requests=args.requests, max_new_tokens=args.max_new_tokens, max_running=args.max_running, seed=args.seed)
    if problem is not None:
        raise UsageError(problem)
    if args.json is not None:
        check_output("--json", args.json)
    try:  # (placed before the output is claimed: a device they cannot go to starts nothing)
        models = ab_models(draft_kind=args.draft, draft_noise=noise, seed=args.seed, device=args.device)
    except ServeError as exc:
        raise UsageError(str(exc)) from None
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with console.status("running plain greedy, compiled, mutable baseline (pre-fix and fixed), and the guarded baseline"):
            result = run_ab(
                k=args.k, requests=args.requests, max_new_tokens=args.max_new_tokens, max_running=args.max_running,
                draft_noise=noise, seed=args.seed, draft_kind=args.draft, models=models,
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
        return _bench_serve(args, console)
    if args.group == "iteration":
        return _bench_iteration(args, console)
    if args.group == "sampler":
        return _bench_sampler(args, console)
    if args.group == "decode":
        return _bench_decode(args, console)
    if args.group == "online":
        from compiler.cli.serve import bench_online

        return bench_online(args, console)
    from backend.tools.bench_kernels import run as run_kernel_bench

    print(run_kernel_bench(device=args.device))
    return 0


def _bench_iteration(args: argparse.Namespace, console: Console) -> int:
    import torch

    from backend.hybrid.checkpoint import HEAD_FILE, bundled_path, default_draft
    from backend.hybrid.head import load_head
    from compiler.offline.models import Served, check_same_vocabulary, load_draft, load_served
    from compiler.tools.bench_iteration import run_iteration_bench

    if args.model is not None and args.draft is None:
        raise UsageError(f"--model {args.model}: give --draft (a head file from batchc train-draft, or a draft model with its vocabulary); "
                         "the bundled drafts draft for the bundled target")
    if args.json is not None:
        check_output("--json", args.json)
    served = load_served(args.model, role="target", dtype=torch.float32, bundled="target")
    target = served.model
    draft: HybridModel | None
    head: HeadModel | None
    if args.draft is None:  # the bundled target's two drafts
        draft, head = default_draft(), load_head(bundled_path(HEAD_FILE), target)
    else:
        drafted = load_draft(args.draft, target=served, dtype=torch.float32)
        if isinstance(drafted, Served):
            check_same_vocabulary(served, drafted)
        draft, head = (drafted.model, None) if isinstance(drafted, Served) else (None, drafted.head)
    target, draft, head = _placed(target, draft, head, args.device)
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run
        with console.status("timing the phases of a speculative iteration"):
            report = run_iteration_bench(target, draft, rows=args.rows, k=args.k, repeats=args.repeats, head=head, context=args.context)
        table = Table(title=f"one speculative iteration, {report.rows} rows, k={report.k}, {report.context} tokens of context: "
                      f"min of {report.repeats} interleaved repeats"
                      + ("" if args.model is None else f"; {served.name}"))
        for h in ("phase", "ms", "target decodes"):
            table.add_column(h, justify="right")
        for p in report.phases:
            table.add_row(p.phase, f"{p.seconds * 1e3:.2f}", f"{p.decodes:.2f}")
        console.print(table)
        per = dict(report.iterations)
        said = []
        if "model" in per:
            said.append(f"iteration with the separate draft (verify + commit + propose + draft commit): {per['model']:.2f} target decodes")
        if "mtp" in per:
            said.append(f"with the draft head (verify + commit + head propose + head commit): {per['mtp']:.2f}")
        if report.replaced_iteration_decodes is not None:
            said.append(f"the draft-extend iteration the engine replaced (verify + commit + propose k + draft extend): "
                        f"{report.replaced_iteration_decodes:.2f}")
        console.print("; ".join(said) + ". Speculation pays when an iteration costs fewer decodes than the tokens it emits per row.",
                      highlight=False)
        output.write(json.dumps(report.to_json(), indent=2))
    return 0


def _bench_sampler(args: argparse.Namespace, console: Console) -> int:
    from backend.hybrid.checkpoint import default_target
    from compiler.tools.bench_sampler import run_sampler_bench

    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run
        with console.status("timing the sampler and the bundled target's decode step"):
            report = run_sampler_bench(default_target(), rows=args.rows, vocabs=args.vocab, repeats=args.repeats)
        table = Table(title=f"sampler per call (distribution + sample_rows) vs the bundled target's decode step: "
                      f"median of {report.repeats} interleaved repeats [min, max]")
        for h in ("rows", "vocab", "case", "ms", "range ms", "share of decode"):
            table.add_column(h, justify="right")
        for n, t in report.decode.items():
            table.add_row(str(n), str(report.model_vocab), "decode step", f"{t.median_s * 1e3:.3f}",
                          f"{t.min_s * 1e3:.3f}-{t.max_s * 1e3:.3f}", "")
            for r in report.rows:
                if r.rows == n:
                    table.add_row("", str(r.vocab), r.case, f"{r.time.median_s * 1e3:.3f}",
                                  f"{r.time.min_s * 1e3:.3f}-{r.time.max_s * 1e3:.3f}", f"{r.share:.1%}")
        console.print(table)
        output.write(json.dumps(report.to_json(), indent=2))
    return 0


def _bench_decode(args: argparse.Namespace, console: Console) -> int:
    from compiler.offline.models import load_served
    from compiler.tools.bench_decode import AGREEMENT_PROMPTS, DTYPES, SPLIT_PARTS, WEIGHT_DTYPES, case_label, run_decode_bench

    if args.json is not None:
        check_output("--json", args.json)
    dtypes = list(dict.fromkeys(args.dtypes))
    weight_dtypes = list(dict.fromkeys(args.weight_dtypes))
    if any(w != "float32" for w in weight_dtypes) and dtypes != ["float32"]:
        raise UsageError(f"--weight-dtype {' '.join(weight_dtypes)}: 16-bit weights are stored beside float32 compute: give --dtype float32 only")
    served = {d: load_served(args.model, role="model", dtype=DTYPES[d], bundled="target") for d in dtypes}
    name = next(iter(served.values())).name
    models, references = {}, {}
    for d, s in served.items():
        for w in weight_dtypes:
            label = case_label(d, w)
            models[label] = s.model.with_weight_dtype(WEIGHT_DTYPES[w])
            if label != d:
                references[label] = s.model
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run
        with console.status("warming up") as status:
            report = run_decode_bench(
                models, name=name, batches=list(dict.fromkeys(args.batches)), references=references,
                threads=list(dict.fromkeys(args.thread_counts)), prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                repeats=args.repeats, min_seconds=float(args.min_seconds), split=args.split, copy_bytes=args.copy_mib << 20,
                progress=status.update,
            )
        table = Table(title=f"{name}: {report.prompt_len}-token prompts, {report.new_tokens} new tokens, k = 0; "
                      f"median of {report.repeats} interleaved rounds [min-max]")
        for h in ("dtype", "threads", "batch", "prompt tok/s", "decode ms/step", "model", "sampler", "host", "copy GB/s",
                  "weight bound ms", "x bound", "+state bound ms"):
            table.add_column(h, justify="right")
        for r in report.results:
            d = r.decode_ms_per_step
            table.add_row(r.case.dtype, str(r.case.threads), str(r.case.batch), f"{r.prompt_tokens_per_s.median:.1f}",
                          f"{d.median:.2f} [{d.min:.2f}-{d.max:.2f}]", f"{r.model_ms_per_step:.2f}", f"{r.sampler_ms_per_step:.3f}",
                          f"{r.host_ms_per_step:.2f}", f"{r.copy_gb_per_s:.1f}", f"{r.weight_bound_ms:.2f}",
                          f"{d.median / r.weight_bound_ms:.2f}", f"{r.traffic_bound_ms:.2f}")
        console.print(table)
        split = [r for r in report.results if r.split is not None]
        if split:
            parts = Table(title="split of a decode step, ms per step (mean over the timed rounds' decode steps)")
            parts.add_column("part")
            for r in split:
                parts.add_column(f"{r.case.dtype} t{r.case.threads} b{r.case.batch}", justify="right")
            for part in SPLIT_PARTS:
                parts.add_row(part, *(f"{r.split[part]:.3f}" for r in split if r.split is not None))
            parts.add_row("decode step (mean)", *(f"{r.split_step_ms:.3f}" for r in split if r.split_step_ms is not None))
            parts.add_row("of which the clock, estimated", *(f"{r.clock_ms_per_step:.3f}" for r in split if r.clock_ms_per_step is not None))
            console.print(parts)
        if report.agreement:
            agree = Table(title=f"16-bit weights against float32: {AGREEMENT_PROMPTS} prompts of {report.prompt_len} tokens, "
                          f"{report.new_tokens} greedy tokens each")
            for h in ("dtype", "greedy match", "first divergence", "top-1 fed float32's tokens", "max |logit diff|",
                      "mean |logit diff|", "logit std", "product"):
                agree.add_column(h, justify="right")
            for label, a in report.agreement.items():
                agree.add_row(label, f"{a.greedy_match:.1%}", " ".join("-" if i is None else str(i) for i in a.first_divergence),
                              f"{a.forced_top1:.1%}", f"{a.logit_max_abs_diff:.4f}", f"{a.logit_mean_abs_diff:.5f}", f"{a.logit_std:.3f}", a.kernel)
            console.print(agree)
        if not all(r.tokens_stable for r in report.results):
            console.print("some case's rounds produced different tokens (tokens_stable false in --json)", highlight=False)
        output.write(json.dumps(report.to_json(), indent=2))
    return 0


def _bench_serve(args: argparse.Namespace, console: Console) -> int:
    import torch

    from backend.hybrid.checkpoint import default_draft
    from compiler.engine import prefill_first
    from compiler.offline import ServeConfig, WorkloadError, check_serving
    from compiler.offline.budget import memory_budget, resident_memory
    from compiler.offline.load import tokenized_overflow
    from compiler.offline.memory import weight_bytes
    from compiler.offline.models import Served, ServedHead, draft_config, load_served
    from compiler.tools.bench_serve import ENGINES, KS, Tokens, builtin_cases, run_serve_bench, sweep_cases
    from compiler.workload import (
        ARRIVALS,
        BENCH_SERVE_NEW_TOKENS,
        BENCH_SERVE_REQUESTS,
        MAX_CONTEXT,
        SNIPPETS,
        SWEEP_NEW_TOKENS,
        SWEEP_RUNNING,
        SYSTEM_PREFIXES,
    )

    sweep = args.sweep is not None
    given = {"chunk_size": args.chunk_size, "token_budget": args.token_budget, "prefill_streak": args.prefill_streak,
             "cache_entries": args.cache_entries}
    scheduling: dict[str, int] = {name: value for name, value in given.items() if value is not None}
    base = ServeConfig()
    compiled_cfg = ServeConfig(
        chunk_size=scheduling.get("chunk_size", base.chunk_size), token_budget=scheduling.get("token_budget", base.token_budget),
        prefill_streak=scheduling.get("prefill_streak", base.prefill_streak), cache_entries=scheduling.get("cache_entries", base.cache_entries),
    )
    if args.prompt_len is not None and not sweep:
        raise UsageError(f"--prompt-len {args.prompt_len} without --sweep: the built-in workload's prompts are its own")
    for option, value in (("--requests", args.requests), ("--arrivals", " ".join(args.arrivals) if args.arrivals else None),
                          *((f"--{name.replace('_', '-')}", v) for name, v in scheduling.items())):
        if sweep and value is not None:  # refused, not ignored: the sweep sizes its own workload
            raise UsageError(f"{option} {value} with --sweep: the sweep sizes its own workload and engines (B requests of {SWEEP_NEW_TOKENS} new "
                             "tokens each unless --max-new-tokens says otherwise, a prefill budget of B chunks)")
    sampled = _bench_sampling(args)
    requests = BENCH_SERVE_REQUESTS if args.requests is None else args.requests
    new_tokens = (SWEEP_NEW_TOKENS if sweep else BENCH_SERVE_NEW_TOKENS) if args.max_new_tokens is None else args.max_new_tokens
    bound = ServeConfig(k=2).builtin_max_new_tokens  # the bench serves at k = 0 and k = 2
    if not sweep and new_tokens > bound:
        raise UsageError(f"--max-new-tokens {new_tokens} is over {bound}: the longest built-in prompt plus k + 1 = 3 must fit 512")
    if args.json is not None:
        check_output("--json", args.json)
    sizes = tuple(dict.fromkeys(args.sweep or SWEEP_RUNNING)) if sweep else ()
    arrivals = tuple(dict.fromkeys(args.arrivals or ARRIVALS))
    ks = tuple(dict.fromkeys(args.ks)) if args.ks else KS
    if args.device != "cpu":  # every engine in this process, its models moved there once
        for option, on in (("--tp", args.tp is not None), ("--overlap", args.overlap)):
            if on:
                raise UsageError(f"--device {args.device} with {option}: on a CUDA device the bench serves in this process only so far")
    budget = memory_budget(args.device, args.memory_fraction)  # (before the models are loaded: the estimate counts them)
    resident = resident_memory()
    served = load_served(args.model, role="target", dtype=torch.float32, bundled="target")
    if args.drafts is None and served.name != "bundled target" and max(ks) > 0:
        raise UsageError(f"--model {args.model} at k = {max(ks)}: give --draft (a head file from batchc train-draft, or a draft "
                         "model with its vocabulary); the bundled drafts draft for the bundled target")
    if args.drafts is not None and max(ks) == 0:
        raise UsageError(f"--draft {' '.join(args.drafts)} with --k 0 only: k = 0 runs no draft")
    drafted = _bench_drafts(args.drafts or ["model"], served) if max(ks) > 0 else {}
    drafts = tuple(drafted)
    if not sweep and max(ks) > 2:
        bound = ServeConfig(k=max(ks)).builtin_max_new_tokens
        if new_tokens > bound:
            raise UsageError(f"--max-new-tokens {new_tokens} is over {bound} at k = {max(ks)}: the longest built-in prompt plus k + 1 must fit 512")
    tokens = Tokens(served.tokenizer, served.model.config.vocab) if served.hf else None
    try:
        longest = args.prompt_len if args.prompt_len is not None else max(len(p) for p in SYSTEM_PREFIXES) + max(map(len, SNIPPETS))
        if sweep and (need := longest + new_tokens + max(ks) + 1) > MAX_CONTEXT:
            raise UsageError(f"--max-new-tokens {new_tokens} with --sweep: the longest sweep prompt plus {new_tokens} new tokens and k + 1 "
                             f"needs {need} positions, over the context bound {MAX_CONTEXT}")
        cases = sweep_cases(sizes, sampled=sampled, ks=ks, drafts=drafts, tokens=tokens, new_tokens=new_tokens,
                            prompt_len=args.prompt_len) if sweep else builtin_cases(
            requests=requests, max_new_tokens=new_tokens, arrivals=arrivals, cfg=compiled_cfg, sampled=sampled, ks=ks, drafts=drafts,
            tokens=tokens,
        )
    except WorkloadError as exc:
        raise UsageError(f"--model {args.model}: {exc}") from None
    for case in cases:
        overflow = tokenized_overflow(case.requests, max_len=case.cfg.max_len, reserve=case.cfg.reserve)
        if overflow is not None:
            raise UsageError(overflow)
    target = served.model
    separate = drafted.get("model")
    # the baselines' k = 0 runs hold a draft too: the bundled one beside the bundled byte-level target
    draft = separate.model if isinstance(separate, Served) else None if served.hf else default_draft()
    helper = drafted.get("mtp")
    head = helper.head if isinstance(helper, ServedHead) else None
    names = {"none": "draft", **{kind: d.name for kind, d in drafted.items()}}
    # every engine of every case within the memory budget, the models' weights counted (they were loaded after the
    # budget was read), before anything is allocated; the bench's sizes are its cases', never lowered
    weights = max(weight_bytes([target, draft, head]), resident_memory() - resident)  # (the models as loaded)
    for case in cases:
        drafting = head if case.draft == "mtp" else draft
        check_serving(target.config, draft_config(drafting) if drafting is not None and case.k else None, case.cfg,
                      compare_mutable=case.baselines, names=(served.name, names[case.draft]),
                      vocab=tokens.tokenizer.vocab_size if tokens is not None else None, budget=budget, weights=weights)
    from compiler.offline import distributed

    rank, world, launched = distributed.placement(args.tp)
    if args.device != "cpu":
        if world > 1:
            raise UsageError(f"--device {args.device} under a launcher of {world} ranks: on a CUDA device the bench serves in this process only so far")
        target, draft, head = _placed(target, draft, head, args.device)
    if world > 1 or args.tp is not None:
        if head is not None:
            raise UsageError(f"--draft {_head_given(args.drafts)} with --tp: a draft head under tensor parallelism is not built yet")
        if args.model is not None:
            raise UsageError(f"--model {args.model} with --tp: the tensor-parallel bench serves the bundled models")
        assert draft is not None  # (the bundled target's: a separate draft, or the bundled one)
        if args.overlap:
            raise UsageError(f"--tp {world} with --overlap: the tensor-parallel bench measures the group against one process")
        if args.replay:
            raise UsageError(f"--tp {world} with --replay: the tensor-parallel bench's forwards run in every rank, not replayed")
        if sampled is not None:
            raise UsageError(f"--temperature {sampled.temperature:g} with --tp {world}: the tensor-parallel bench measures greedy decoding only")
        distributed.check_splits(world, [("bundled target", target.config), ("bundled draft", draft.config)])
        if rank > 0:
            return distributed.work(rank, world, launched, args.argv, args.tp_timeout, target, draft)
        if world == 1:
            raise UsageError("--tp 1: the tensor-parallel bench compares one process with a group of 2 or more ranks")
        return _bench_tp(args, console, cases, target, draft, world, launched, sweep)
    t0 = time.perf_counter()
    with OutputFile("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with console.status("warming up every engine") as status:
            def progress(done: int, total: int, run: object) -> None:
                status.update(f"run {done + 1 if done < total else total}/{total} (interleaved: {', '.join(ENGINES)}"
                              f"{', compiled sampled' if sampled is not None else ''}, then again)")

            rows = run_serve_bench(target, draft, cases, repeats=args.repeats, overlap=args.overlap, on_run=progress, head=head,
                                   replay=args.replay)
        what = (f"sweep, running = B requests arriving together, {new_tokens} new tokens each"
                + (f", prompts of {args.prompt_len} bytes" if args.prompt_len is not None else "") if sweep
                else f"{len(cases[0].requests)} requests of the built-in workload")
        c = cases[0].cfg
        how = ("" if sweep else f"; compiled: chunks of {c.chunk_size}, {c.token_budget} prefill tokens a step, "
               f"{prefill_first(c.prefill_streak).describe()}, {c.cache_entries} cache entries")
        models = "bundled target and draft" if served.name == "bundled target" and set(names.values()) <= _BUNDLED_DRAFTS else (
            f"{served.name}" + "".join(f", {kind} = {name}" for kind, name in names.items() if kind != "none"))
        table = Table(title=f"bench serve: {what}, {models}{how}",
                      caption=f"median of {args.repeats} interleaved repeats per (arrivals, k, engine, running, sampling), with their range",
                      box=box.SIMPLE_HEAD, padding=0)  # (one space between columns: its 19, 20 with vs greedy, fit the 160 characters of a pipe)
        for h in ("arrivals" if not sweep else "running", "k", "engine", "draft", "sampling", "tokens", "steps", "tok/s", "range", "vs fixed",
                  "paired", "vs k=0", *(("vs greedy",) if sampled is not None else ()), "accept", "acc len", "it/dec", "sampler", "host ms",
                  *(("host rep",) if args.replay else ()), "TTFT", "TPOT"):
            table.add_column(h, justify="right")
        order = sorted(rows, key=lambda r: (r.max_running, r.sampling.sampled, r.k, ENGINES.index(r.engine), r.overlap)) if sweep else rows
        for r in order:
            table.add_row(
                r.arrivals if not sweep else str(r.max_running), str(r.k), r.engine + (" +overlap" if r.overlap else ""), r.draft, r.sampling.label,
                str(r.tokens), str(r.steps), f"{r.tokens_per_s:.0f}", f"{r.tokens_per_s_min:.0f}-{r.tokens_per_s_max:.0f}",
                _times(r.vs_mutable_fixed), _paired(r.paired_fixed), _times(r.vs_k0), *((_times(r.vs_greedy),) if sampled is not None else ()),
                _ms(r.acceptance, 3), _ms(r.accepted_length, 2), _ms(r.iteration_decodes, 2), _percent(r.sampler_share), f"{r.host_ms_per_step:.2f}",
                *((_ms(r.replayed_host_ms, 2),) if args.replay else ()), _ms(r.latency("ttft", 0.5), 1),
                _ms(r.latency("tpot", 0.5), 1),
            )
        console.print(table)
        console.print(
            "tok/s: median tokens per second, range: its lowest and highest repeat. host ms = (wall - time inside model "
            "forwards) / steps (with overlap: minus the time an executor process ran a plan)"
            + ("; host rep: the same with the run's forwards replayed from a recording, the least of at least 3 replays "
               "(the engine's own work, its caches kept warm)" if args.replay else "")
            + ". TTFT: ms from a request's "
            "arrival step to its first token; TPOT: ms per output token after the first; both the median over every "
            "request of every repeat (p90 in --json). 'vs fixed' and 'vs k=0': the row's "
            "tokens/s over the fixed baseline's (same arrivals, k and running limit) and over its own engine's at k=0, "
            "measured in this run (ratios of the medians); paired: the lowest and highest of the per-repeat ratios to the "
            "fixed baseline's run of the same repeat (repeats interleave the engines, so a ratio within a repeat cancels the "
            "machine's drift: a 'vs fixed' whose paired range straddles 1.00 is within this machine's noise)"
            + (f"; 'vs greedy': a sampled row's ({sampled.label}: temperature {sampled.temperature:g}, top_p {sampled.top_p:g}, "
               "each request's seed derived from seed 0 and its id; the compiled engine only, the baselines decode greedily) "
               "over the compiled greedy row's" if sampled is not None else "")
            + ". accept: accepted draft tokens / proposed at k > 0; acc len: tokens a row emits per speculative iteration "
            "(accepted + the bonus); it/dec: the median wall time of a speculative step (one iteration, host time included) over "
            "the same engine's median decode step at k = 0: speculation pays when acc len is above it. draft: model = a separate draft model, mtp = a draft head (the baselines get the same one). sampler: the time in the executor's sampler calls over "
            "the time inside model forwards, median of the repeats (the compiled engine in one process only; the sampler alone "
            "against a decode step at 8 and 128 rows: batchc bench sampler). mutable = the pre-fix baseline (replays stale init "
            f"ops); neither baseline has a prefix cache. {time.perf_counter() - t0:.0f} s in all.",
            highlight=False,
        )
        output.write(json.dumps([r.to_json() for r in rows], indent=2))
    return 0


def _placed(target: HybridModel, draft: HybridModel | None, head: HeadModel | None, device: str) -> tuple[HybridModel, HybridModel | None, HeadModel | None]:
    """The target, draft and head on ``device``, each moved once (the head bound again to the moved
    target); a model that cannot go there is a ``UsageError`` in one line."""
    from backend.hybrid.head import HeadModel
    from backend.hybrid.model import HybridModel
    from compiler.offline.models import on_device
    from compiler.workload import ServeError

    try:
        target, placed = on_device(target, draft, device)
        _, bound = on_device(target, head, device)
    except ServeError as exc:
        raise UsageError(str(exc)) from None
    assert (placed is None or isinstance(placed, HybridModel)) and (bound is None or isinstance(bound, HeadModel))  # (as given)
    return target, placed, bound


def _head_given(drafts: list[str] | None) -> str:
    """The ``--draft`` value that named the head (``mtp`` or a head file; the first not ``model``)."""
    return next((d for d in drafts or () if d != "model"), "mtp")


_BUNDLED_DRAFTS = frozenset({"draft", "bundled draft", "bundled draft head"})
"""Draft names that leave a ``bench serve`` title at "bundled target and draft"."""


def _bench_drafts(given: list[str], served: Served) -> dict[str, Served | ServedHead]:
    """``bench serve --draft``'s drafts by kind (``"model"``, ``"mtp"``), in the order given: ``model``
    is the bundled separate draft, ``mtp`` the bundled head, anything else a path to a head or a
    draft model (``compiler.offline.models.load_draft``), each checked against the target."""
    import attrs
    import torch

    from compiler.offline.models import Served, check_same_vocabulary, draft_kind, load_draft

    out: dict[str, Served | ServedHead] = {}
    for d in dict.fromkeys(given):
        drafted = load_draft(None if d == "model" else d, target=served, dtype=torch.float32)
        if isinstance(drafted, Served):
            if d == "model":
                drafted = attrs.evolve(drafted, name="bundled draft")
            check_same_vocabulary(served, drafted)
        elif d == "mtp":
            drafted = attrs.evolve(drafted, name="bundled draft head")
        kind = draft_kind(drafted)
        if kind in out:
            raise UsageError(f"--draft {d}: a second draft of kind {kind} (after {out[kind].name}); rows are named by kind, so give one of each")
        out[kind] = drafted
    return out


def _bench_tp(args: argparse.Namespace, console: Console, cases: list[Any], target: Any, draft: Any, world: int, launched: bool,
              sweep: bool) -> int:
    import torch

    from backend import children
    from backend.hybrid.model import HybridModel
    from backend.tp.group import RankFailed
    from compiler.offline import distributed
    from compiler.tools.bench_tp import run_tp_bench

    t0 = time.perf_counter()
    with OutputFile("--json", args.json) as output:
        leader: distributed.TPLeader | None = None
        try:
            leader = distributed.TPLeader(distributed.start(0, world, launched, args.argv, args.tp_timeout))
            shards = distributed.shards(leader.group, target, draft)
            assert isinstance(shards[1], HybridModel)  # (a separate draft: the tensor-parallel bench refuses a head)
            with console.status("warming up") as status:
                def progress(done: int, total: int) -> None:
                    status.update(f"run {done + 1}/{total} (interleaved: tp=1, tp={world}, then again)")

                rows, alone_us, mean_bytes, problems = run_tp_bench(leader, (target, draft), (shards[0], shards[1]), cases,
                                                                    repeats=args.repeats, on_run=progress)
        except RankFailed as exc:
            children.raise_if_interrupted()  # (a rank this process's interruption killed)
            print(f"batchc: bench failed: {exc}", file=sys.stderr)
            return 1
        finally:
            if leader is not None:
                leader.shutdown()
        what = (f"sweep, running = B requests arriving together, {cases[0].requests[0].max_new_tokens} new tokens each" if sweep
                else f"{len(cases[0].requests)} requests of the built-in workload")
        table = Table(title=f"bench serve --tp {world}: {what}, bundled target and draft, compiled engine",
                      caption=f"median of {args.repeats} interleaved repeats per (k, tp, running); {torch.get_num_threads()} torch "
                      f"thread(s) per rank")
        for h in ("k", "tp", "running", "tokens", "steps", "tokens/s", "/ tp=1", "message ms/step", "agree ms/step", "plan bytes"):
            table.add_column(h, justify="right")
        for r in sorted(rows, key=lambda r: (r.running, r.k, r.tp)) if sweep else rows:
            table.add_row(str(r.k), str(r.tp), str(r.running), str(r.tokens), str(r.steps), f"{r.tokens_per_s:.1f}", _times(r.vs_tp1),
                          _ms(r.message_ms_per_step), _ms(r.agree_ms_per_step), f"{r.mean_plan_bytes:.0f}" if r.mean_plan_bytes else "-")
        console.print(table)
        console.print(
            f"The broadcast alone: {alone_us:.0f} us per plan message of the mean size ({mean_bytes:.0f} bytes) to idle workers. "
            "message ms/step: rank 0's time in the broadcasts of a step's messages; agree ms/step: in the two agreements per plan "
            "(they include waiting for the slowest rank's forward). On this CPU the ranks share the cores: tensor parallelism is "
            f"a correctness harness here, not a speed-up. {time.perf_counter() - t0:.0f} s in all.",
            highlight=False,
        )
        output.write(json.dumps({"rows": [r.to_json() for r in rows], "broadcast_us": alone_us, "mean_plan_bytes": mean_bytes,
                                 "problems": problems}, indent=2))
    if problems:
        print(f"batchc: bench failed: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _bench_sampling(args: argparse.Namespace) -> Sampling | None:
    """``bench serve``'s sampled settings (``compiler.tools.bench_serve.Sampling``), or ``None`` when
    it measures greedy decoding only (no ``--temperature``, or 0); ``--top-p`` needs a temperature > 0."""
    from compiler.offline.load import sampling_params
    from compiler.tools.bench_serve import Sampling
    from ir.errors import IRValidationError

    temperature = 0.0 if args.temperature is None else args.temperature
    if temperature == 0:
        if args.top_p is not None:
            raise UsageError(f"--top-p {args.top_p:g} without --temperature > 0: the bench samples only at a temperature above 0")
        return None
    top_p = 1.0 if args.top_p is None else args.top_p
    try:  # the rules batchc run's --temperature and --top-p are held to
        sampling_params({}, {"temperature": temperature, "top_p": top_p}, max_new_tokens=1)
    except IRValidationError as exc:
        raise UsageError(f"argument --{exc.field.replace('_', '-')}: {str(exc).removeprefix(f'{exc.node}.{exc.field}: ')}") from None
    return Sampling(temperature=temperature, top_p=top_p)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _paired(spread: tuple[float, float, float] | None) -> str:
    """The lowest and highest of a row's per-repeat ratios (``ServeRow.paired_fixed``)."""
    return "-" if spread is None else f"{spread[1]:.2f}-{spread[2]:.2f}"
