"""``batchc run``: the main job, rendered (tables, samples, the lossless check) from its
``ServeSummary``; exit status 1 when the run failed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import TYPE_CHECKING

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiler.cli.args import UsageError, sampling_defaults, shown_path
from compiler.cli.output import OutputFile, check_output

if TYPE_CHECKING:
    from backend.hf.transformers_backend import TransformersModel
    from backend.hybrid.model import HybridModel
    from backend.tp.serve import TPLeader
    from compiler.engine.config import ServeConfig
    from compiler.offline.budget import MemoryBudget
    from compiler.offline.models import DraftModel, Served
    from compiler.offline.tokenizer import Tokenizer
    from compiler.workload import Request


def _same_file(a: str, b: str) -> bool:
    """Whether two output paths name one file ('-' is stdout, which both may share)."""
    if a == "-" or b == "-":
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def _context(given: int | None, k: int, models: list[Served]) -> int:
    """The run's context length: ``--max-len``, at most every Hugging Face model's
    ``max_position_embeddings`` (positions past those the model was made for are refused, not
    served); by default the smallest of those, or ``DEFAULT_CONTEXT`` for batchc models."""
    from compiler.workload import DEFAULT_CONTEXT, MAX_CONTEXT

    limits = [(m.name, m.max_positions) for m in models if m.max_positions is not None]
    for name, limit in limits:
        if given is not None and given > limit:
            raise UsageError(f"--max-len {given} is over the max_position_embeddings {limit} of {name}")
    if given is not None:
        length = given
    else:
        length = min(min(limit for _, limit in limits), MAX_CONTEXT) if limits else DEFAULT_CONTEXT
    if length < k + 3:
        what = f"--max-len {length}" if given is not None else f"the context length {length} (max_position_embeddings)"
        raise UsageError(f"{what} leaves no room for a prompt token and a new token next to the k + 1 = {k + 1} positions of a step")
    return length


def _sizes_line(cfg: ServeConfig, given: dict[str, int], estimate: int, budget: str) -> str:
    """The run's sizes and memory in one line: each sized option, whether it was given, is the
    default or was lowered to fit the budget, and the estimate against the budget."""
    from compiler.engine.config import ServeConfig
    from compiler.offline.budget import SIZED_OPTIONS, gib

    default = attrs.asdict(ServeConfig())
    chosen = attrs.asdict(cfg)
    said = []
    for name in SIZED_OPTIONS:
        how = "given" if name in given else "default" if chosen[name] == default[name] else f"lowered from {default[name]} to fit"
        said.append(f"{name.replace('_', '-')} {chosen[name]} ({how})")
    return f"sizes: {', '.join(said)}; memory: about {gib(estimate)} of a budget of {budget}"


def _refusals(workload: list[Request]) -> str | None:
    """What the requests refused on their own come to (``Request.refused``), or ``None``."""
    refused = [r.refused for r in workload if r.refused is not None]
    if not refused:
        return None
    others = "nothing was served" if len(refused) == len(workload) else "the others were served"
    return f"{len(refused)} of {len(workload)} request{'s' if len(workload) > 1 else ''} refused ({others}), first: {refused[0]}"


def _baseline_refusal(workload: list[Request]) -> str | None:
    """Why ``--compare-mutable`` cannot serve ``workload`` (the mutable baseline decodes greedily
    and ends requests at stop ids only), or ``None``."""
    from ir.sampling import GREEDY

    greedy = attrs.asdict(GREEDY, recurse=False)
    for r in workload:
        p = r.sampling
        odd = [(name, value) for name, value in (("temperature", p.temperature), ("stop", p.stop), ("min_tokens", p.min_tokens),
                                                 ("ignore_eos", p.ignore_eos), ("logprobs", p.logprobs), ("n", p.n))
               if value != greedy[name]]
        if odd:
            return (f"--compare-mutable: request {r.rid} sets {odd[0][0]} {odd[0][1]!r}; the mutable baseline serves greedy requests "
                    "that end at max_new_tokens or a stop token id only")
    return None


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    import torch

    from backend import children
    from backend.remote import ExecutorGone
    from backend.tp.group import RankFailed
    from compiler.offline import LONGEST_BUILTIN_PROMPT, ServeConfig, builtin_workload, distributed, load_workload
    from compiler.offline.budget import SIZED_OPTIONS, memory_budget, resident_memory
    from compiler.offline.load import tokenize_workload, tokenized_overflow
    from compiler.offline.memory import fit_serving, memory_estimate, weight_bytes
    from compiler.offline.models import Served, check_same_vocabulary, draft_config, load_draft, load_served, on_device
    from compiler.workload import ServeError

    # every check before anything runs: options, output paths, models, memory, workload
    if args.draft is not None and args.k == 0:
        raise UsageError(f"--draft {shown_path(args.draft)} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    for option, path in (("--json", args.json), ("--outputs", args.outputs)):
        if path is not None:
            check_output(option, path)
    if args.json is not None and args.outputs is not None and _same_file(args.json, args.outputs):
        raise UsageError(f"--json {shown_path(args.json)} and --outputs {shown_path(args.outputs)} name the same file")
    defaults = sampling_defaults(args)
    transformers_impl = args.model_impl == "transformers"
    if transformers_impl:
        _check_transformers_impl(args)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    budget = memory_budget(args.device, args.memory_fraction)  # (read before the models are loaded: their memory is counted)
    resident = resident_memory()
    target = load_served(args.model, role="target", dtype=dtype, bundled="target")
    k = args.k if args.k is not None else (0 if target.hf and args.draft is None else ServeConfig().k)
    if target.hf and k > 0 and args.draft is None:
        raise UsageError(f"--k {k} with a Hugging Face --model needs --draft DIR (a smaller model with the same vocabulary)")
    if target.hf and args.compare_mutable:
        raise UsageError("--compare-mutable serves the bundled byte-level models only (the baseline has no tokenizer)")
    if args.weight_dtype != "float32":  # 16-bit matrices beside float32 compute, in this process (HybridModel.with_weight_dtype)
        for option, on in (("--dtype " + args.dtype, args.dtype != "float32"), (f"--k {k}", k > 0), ("--tp", args.tp is not None and args.tp > 1),
                           ("--dp", args.dp > 1), ("--overlap", args.overlap), ("--model-impl transformers", transformers_impl),
                           ("--compare-mutable", args.compare_mutable), (f"--device {args.device}", args.device != "cpu")):
            if on:
                raise UsageError(f"--weight-dtype {args.weight_dtype} with {option}: 16-bit weights serve beside float32 compute at k = 0, "
                                 "on the CPU, in this process only so far")
        from backend.kernels.lowp import LOWP_DTYPES

        target = attrs.evolve(target, model=target.model.with_weight_dtype(LOWP_DTYPES[args.weight_dtype]))
    drafted = None if k == 0 else load_draft(args.draft, target=target, dtype=dtype)
    if isinstance(drafted, Served):
        check_same_vocabulary(target, drafted)
        draft: DraftModel | None = drafted.model
    else:
        draft = drafted.head if drafted is not None else None
        if drafted is not None and args.compare_mutable:
            raise UsageError(f"--draft {shown_path(args.draft)} (a draft head) with --compare-mutable: not built yet "
                             "(batchc bench serve --draft mtp compares the head on the mutable baselines)")
    sizes = {name: given for name in SIZED_OPTIONS if (given := vars(args)[name]) is not None}  # (the namespace's options by name)
    cfg = ServeConfig(
        seed=args.seed, k=k, chunk_size=args.chunk_size, lossless_sample=args.lossless_sample, overlap=args.overlap,
        prefill_streak=args.prefill_streak, max_len=_context(args.max_len, k, [target] + ([drafted] if isinstance(drafted, Served) else [])),
        **sizes,
    )
    if args.workload is None and args.max_new_tokens > cfg.builtin_max_new_tokens:
        if cfg.builtin_max_new_tokens < 1:
            raise UsageError(
                f"the context length {cfg.max_len} (--max-len) has no room for the built-in workload: its longest prompt "
                f"({LONGEST_BUILTIN_PROMPT} bytes) + 1 new token + k + 1 = {cfg.reserve} need {LONGEST_BUILTIN_PROMPT + 1 + cfg.reserve}; "
                "give a longer --max-len or a --workload FILE"
            )
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens} is over {cfg.builtin_max_new_tokens}: the context limit {cfg.max_len} minus "
            f"the longest built-in prompt ({LONGEST_BUILTIN_PROMPT} bytes) minus k + 1 = {cfg.reserve}"
        )
    rank, world, launched = distributed.placement(args.tp)
    if transformers_impl and world > 1:
        raise UsageError(f"--model-impl transformers in a group of {world} ranks: it serves in one process")
    if world == 1 and args.tp_timeout is not None:
        raise UsageError(f"--tp-timeout {args.tp_timeout} without --tp: a run on one process has no group to time out")
    if args.dp == 1 and args.dp_routing is not None:
        raise UsageError(f"--dp-routing {args.dp_routing} without --dp: one engine needs no router")
    tp_timeout = args.tp_timeout if args.tp_timeout is not None else distributed.TP_TIMEOUT_S
    if world > 1:
        for option, on in (("--overlap", args.overlap), ("--compare-mutable", args.compare_mutable)):
            if on:
                raise UsageError(f"--tp {world} with {option}: a tensor-parallel run serves on the group only")
        distributed.check_splits(world, [(target.name, target.model.config)] + ([(drafted.name, drafted.model.config)] if isinstance(drafted, Served) else []))
    if args.dp > 1:
        for option, on in (("--tp", world > 1), ("--overlap", args.overlap), ("--compare-mutable", args.compare_mutable)):
            if on:
                raise UsageError(f"--dp {args.dp} with {option}: each replica is one plain engine process")
    if rank > 0:  # a worker rank: serve rank 0's plans on this rank's shards, print nothing
        return distributed.work(rank, world, launched, args.argv, tp_timeout, target.model, draft)
    tokenizer = target.tokenizer if target.hf else None
    vocab = target.model.config.vocab
    if args.workload is not None:
        workload = load_workload(args.workload, max_len=cfg.max_len, reserve=cfg.reserve, vocab=vocab, tokenizer=tokenizer,
                                 defaults=defaults)
    else:
        workload = builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed, arrivals=args.arrivals,
                                    defaults=defaults)
        if tokenizer is not None:
            workload = tokenize_workload(workload, tokenizer, vocab=vocab)
            overflow = tokenized_overflow(workload, max_len=cfg.max_len, reserve=cfg.reserve)
            if overflow is not None:
                raise UsageError(overflow)
    if args.compare_mutable:
        refusal = _baseline_refusal(workload)
        if refusal is not None:
            raise UsageError(refusal)
    if any(r.refused is None and r.sampling.penalised for r in workload):
        cfg = attrs.evolve(cfg, penalties=True)  # (the target keeps per-slot token counts, which the estimate counts)
    # the memory: the models as loaded (their tensors, or what loading them added to this process when that is more;
    # transformers' model holds a copy of the target's; --dp's router keeps its models while each replica loads its own)
    # and every engine, within the budget, the sizes not given lowered to fit it
    loaded = max(weight_bytes([target.model, draft]), resident_memory() - resident)
    if args.dp > 1:
        budget = attrs.evolve(budget, available=max(0, budget.available - loaded)).share(args.dp)
    weights = loaded * (2 if transformers_impl else 1)
    draft_shape = draft_config(draft) if draft is not None else None
    cfg = fit_serving(target.model.config, draft_shape, cfg, sized=[n for n in SIZED_OPTIONS if n not in sizes], compare_mutable=args.compare_mutable,
                      names=(target.name, drafted.name if drafted is not None else "draft"),
                      vocab=tokenizer.vocab_size if tokenizer is not None else None, budget=budget, weights=weights)
    if args.device != "cpu":  # the engine serves on the device: one process, its models moved there once
        for option, on in (("--tp", world > 1), ("--dp", args.dp > 1), ("--overlap", args.overlap),
                           ("--model-impl transformers", transformers_impl), ("--compare-mutable", args.compare_mutable)):
            if on:
                raise UsageError(f"--device {args.device} with {option}: on a CUDA device the engine serves in this process only so far")
        try:
            placed_target, draft = on_device(target.model, draft, args.device)
        except ServeError as exc:
            raise UsageError(str(exc)) from None
        target = attrs.evolve(target, model=placed_target)
    estimate = sum(memory_estimate(target.model.config, draft_shape, cfg, compare_mutable=args.compare_mutable, weights=weights).values())
    said = _sizes_line(cfg, sizes, estimate, budget.describe())  # (printed once the output files are claimed)
    impl = None
    if transformers_impl:
        penalised = next((r for r in workload if r.refused is None and r.sampling.penalised), None)
        if penalised is not None:
            raise UsageError(f"--model-impl transformers: request {penalised.rid} sets a penalty; the transformers backend keeps no token counts")
        from backend.hf.transformers_backend import TransformersModel

        impl = TransformersModel.from_pretrained(args.model, dtype=dtype)
    if args.dp > 1:
        return _serve_replicas(args, console, workload, target, cfg, tokenizer, args.dp_routing or "prefix", budget, said)
    target_model = target.model
    leader: TPLeader | None = None
    try:
        if world > 1:  # every check passed: start the group (rank 0 of batchc run --tp starts the other ranks here)
            leader = distributed.TPLeader(distributed.start(0, world, launched, args.argv, tp_timeout))
            target_model, draft = distributed.shards(leader.group, target_model, draft)
        return _serve_and_report(args, console, workload, target, target_model, draft, cfg, k, tokenizer, leader, impl, budget, said)
    except (RankFailed, ExecutorGone) as exc:  # a rank, or an executor process before the engine could serve
        children.raise_if_interrupted()  # (killed by this process's own interruption: not the run's failure)
        print(f"batchc: run failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if leader is not None:
            leader.shutdown()


def _check_transformers_impl(args: argparse.Namespace) -> None:
    """``--model-impl transformers``'s refusals, before anything is loaded: it needs a Hugging Face
    checkpoint directory and transformers, and serves at k = 0 on one engine in this process."""
    if args.model is None or not os.path.isdir(args.model):
        what = "the bundled model has no transformers code" if args.model is None else f"{shown_path(args.model)} is not a directory"
        raise UsageError(f"--model-impl transformers needs --model DIR, a Hugging Face checkpoint directory ({what})")
    for option, on in (("--draft", args.draft is not None), ("--k", bool(args.k)), ("--tp", args.tp not in (None, 1)), ("--dp", args.dp > 1),
                       ("--overlap", args.overlap), ("--compare-mutable", args.compare_mutable)):
        if on:
            raise UsageError(f"--model-impl transformers with {option}: it serves one engine in this process at k = 0 (no speculative decoding)")
    if importlib.util.find_spec("transformers") is None:  # (found, not imported: loading it is the model's job)
        raise UsageError("--model-impl transformers needs transformers installed (pip install 'batchc[transformers]')")


def _serve_replicas(
    args: argparse.Namespace, console: Console, workload: list[Request], target: Served, cfg: ServeConfig, tokenizer: Tokenizer | None,
    routing: str, budget: MemoryBudget, sizes: str = "",
) -> int:
    """``--dp N``: route the workload, serve each part on its own replica process, report."""
    from backend import children
    from compiler.offline.dp import ReplicaFailed, merged, route, timed_serve
    from compiler.offline.models import output_lines

    served = [r for r in workload if r.refused is None]
    parts = [p for p in route(served, args.dp, block=cfg.cache_block, routing=routing) if p] or [[]]
    with OutputFile("--json", args.json) as output, OutputFile("--outputs", args.outputs) as outputs_file:
        if sizes:
            console.print(sizes, highlight=False, soft_wrap=True)
        with console.status(f"{len(parts)} replicas serving") as status:
            try:
                results, wall = timed_serve(parts, model=args.model, draft=args.draft if cfg.k else None, dtype=args.dtype, cfg=cfg, budget=budget,
                                            threads=args.threads, on_done=lambda n: status.update(f"{n}/{len(parts)} replicas done"))
            except ReplicaFailed as exc:
                children.raise_if_interrupted()  # (a replica this process's interruption killed)
                print(f"batchc: run failed: {exc}", file=sys.stderr)
                return 1
        total = merged(results, wall)
        total["requests"], total["refused_requests"] = len(workload), len(workload) - len(served)  # the replicas saw the served ones
        table = Table(title=f"batchc run --dp {args.dp}: {len(workload)} requests, k={cfg.k}, {target.name}, {routing} routing")
        for h in ("replica", "requests", "tokens", "steps", "wall s", "tokens/s", "prefix hit tokens", "tickets outstanding", "lossless"):
            table.add_column(h, justify="right")
        for r in results:
            s = r.summary
            table.add_row(str(r.index), str(s["requests"]), str(s["generated_tokens"]), str(s["steps"]), f"{s['wall_s']:.2f}",
                          f"{s['tokens_per_s']:.1f}", str(s["prefix_cache_hit_tokens"]), str(s["outstanding_tickets"]),
                          str(s.get("lossless_check", "-")))
        console.print(table)
        console.print(
            f"{total['generated_tokens']} tokens in {total['slowest_replica_wall_s']:.2f} s (the slowest replica's serving time): "
            f"{total['tokens_per_s']:.1f} tokens/s; {wall:.1f} s with the replicas' start-up.", highlight=False,
        )
        output.write(json.dumps(total, indent=2))
        if args.outputs is not None:
            outputs = {rid: out for r in results for rid, out in r.outputs.items()}
            aborted = {rid for r in results for rid in r.aborted}
            errored = {rid for r in results for rid in r.errored}
            logprobs = {rid: lp for r in results for rid, lp in r.logprobs.items()}
            lines = output_lines(workload, outputs, aborted, target.tokenizer, target.eos, errored, logprobs)
            outputs_file.write("\n".join(json.dumps(line, ensure_ascii=False) for line in lines))
    failures = []
    if total["aborted_requests"]:
        failures.append(f"{total['aborted_requests']} requests aborted by failed forwards")
    if total["errored_requests"]:
        from compiler.engine.nonfinite import ERROR_MESSAGE

        n, first = total["errored_requests"], min(rid for r in results for rid in r.errored)  # worded as one engine's
        failures.append(f"{n} request{'s' if n != 1 else ''} ended in error (first: request {first}): {ERROR_MESSAGE}")
    if total["outstanding_tickets"]:
        failures.append(f"{total['outstanding_tickets']} tickets never consumed")
    if total.get("lossless_ok") is False:
        failures.append("a replica's lossless check failed")
    return _exit_status(failures, _refusals(workload))


def _exit_status(failures: list[str], refusals: str | None) -> int:
    """1 and one line when the run failed (requests refused said there too); else 2 and one line
    when requests were refused on their own, as bad input is (the others were served and written);
    else 0."""
    if failures:
        print(f"batchc: run failed: {'; '.join(failures + ([refusals] if refusals else []))}", file=sys.stderr)
        return 1
    if refusals is not None:
        print(f"batchc: error: {refusals}", file=sys.stderr)
        return 2
    return 0


def _serve_and_report(
    args: argparse.Namespace, console: Console, workload: list[Request], target: Served, target_model: HybridModel,
    draft: DraftModel | None, cfg: ServeConfig, k: int, tokenizer: Tokenizer | None, leader: TPLeader | None,
    impl: TransformersModel | None = None, budget: MemoryBudget | None = None, sizes: str = "",
) -> int:
    from backend.hybrid.model import HybridModel
    from compiler.engine.nonfinite import ERROR_MESSAGE
    from compiler.offline.models import output_lines
    from compiler.offline.run import run
    from compiler.tools.timed import TimedModel, timed_draft

    # the models' forwards are timed (host time per step = wall minus model time, per step)
    timed_target = TimedModel(target_model)
    timed_drafts = timed_draft(draft) if draft is not None else None
    comparing = args.compare_mutable and isinstance(draft, HybridModel) and cfg.k > 0
    # both claimed (and refused) here, before the run; written at its end
    with OutputFile("--json", args.json) as output, OutputFile("--outputs", args.outputs) as outputs_file:
        if sizes:
            console.print(sizes, highlight=False, soft_wrap=True)
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as progress:
            task = progress.add_task("serving", total=sum(r.refused is None for r in workload))
            if comparing:
                from compiler.tools.compare_mutable import warm_up

                progress.update(task, description="warming up every engine")
                assert isinstance(draft, HybridModel)
                warm_up(workload, target_model, draft, cfg)  # so that no measured run of the comparison pays first-call costs
                progress.update(task, description="serving")
            summary = run(
                workload, timed_target, timed_drafts, cfg, on_finish=lambda n: progress.update(task, completed=n),
                compare_mutable=args.compare_mutable,
                model_clock=(lambda: timed_target.seconds + (timed_drafts.seconds if timed_drafts is not None else 0.0)) if impl is None
                else (lambda: impl.seconds),
                tokenizer=tokenizer, eos=target.eos, tp=leader, transformers=impl, budget=budget,
            )
            if comparing:
                from compiler.tools.compare_mutable import run_mutable

                assert isinstance(draft, HybridModel)
                progress.update(task, description="mutable baseline")
                summary = attrs.evolve(summary, mutable_baseline=run_mutable(workload, target_model, draft, cfg, fixed=False),
                                       mutable_baseline_fixed=run_mutable(workload, target_model, draft, cfg, fixed=True))
        title = f"batchc run: {len(workload)} requests, k={k}, {target.name}" + (", transformers' modeling code" if impl is not None else "")
        table = Table(title=title)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.to_json().items():
            if key in ("samples", "pass_us_per_step", "mutable_baseline", "mutable_baseline_fixed", "lossless_ok",
                       "tokens_per_s_vs_mutable_fixed", "tp_ledgers") or value is None:
                continue
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        if summary.tp_ledgers is not None:
            ranks = summary.tp_ledgers["ranks"]
            assert isinstance(ranks, list)
            table.add_row("tp_ledgers", f"{len(ranks)} ranks, {'equal' if summary.tp_ledgers['equal'] else 'DIFFERENT'}, "
                          f"{'drained' if summary.tp_ledgers['drained'] else 'NOT drained'}")
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
        if args.outputs is not None:
            lines = output_lines(
                workload, summary.outputs, set(summary.aborted), target.tokenizer, target.eos, set(summary.errored), summary.logprobs
            )
            outputs_file.write("\n".join(json.dumps(line, ensure_ascii=False) for line in lines))
    failures = []
    if summary.aborted_requests:
        failures.append(f"{summary.aborted_requests} requests aborted by {summary.failed_forwards} failed forwards, "
                        f"first: {summary.first_failure}")
    if summary.errored_requests:
        first = min(summary.errored)
        n = summary.errored_requests
        failures.append(f"{n} request{'s' if n != 1 else ''} ended in error (first: request {first}): {ERROR_MESSAGE}")
    if summary.outstanding_tickets:
        failures.append(f"{summary.outstanding_tickets} tickets never consumed")
    if summary.lossless_ok is False:
        failures.append(f"lossless check {summary.lossless_check}")
    if summary.tp_ledgers is not None and not (summary.tp_ledgers["equal"] and summary.tp_ledgers["drained"]):
        failures.append("the tensor-parallel ranks' ledgers differ or are not drained")
    if summary.tp_lossless_ledgers_ok is False:
        failures.append("the tensor-parallel ranks' ledgers differ or are not drained after the lossless check")
    return _exit_status(failures, _refusals(workload))


