"""``batchc serve``: the command line's side of the online server (``compiler.online.server``):
options to ``ServerOptions`` (the sampling defaults as ``batchc run``'s: ``compiler.cli.args.sampling_defaults``),
the API key from ``--api-key`` or ``BATCHC_API_KEY``; ``--tp`` and ``--dp`` refused together and with
``--overlap``, as ``batchc run`` refuses them. Bad options the
parser cannot see are refused in one line (``UsageError``, exit 2) before anything starts. And
``batchc bench online`` (``compiler.tools.bench_online``): its table and ``--json``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from compiler.cli.args import Text, UsageError, sampling_defaults, shown_path
from compiler.cli.output import OutputFile, check_output

API_KEY_ENV = "BATCHC_API_KEY"


def cmd_serve(args: argparse.Namespace) -> int:
    import attrs

    from compiler.engine.config import ServeConfig
    from compiler.offline.budget import SIZED_OPTIONS, available_memory
    from compiler.online.messages import Launch
    from compiler.online.server import ServerOptions, serve

    if args.draft is not None and args.k == 0:
        raise UsageError(f"--draft {shown_path(args.draft)} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    if args.tp == 1 and args.tp_timeout is not None:
        raise UsageError(f"--tp-timeout {args.tp_timeout} without --tp: an engine on one process has no group to time out")
    if args.tp > 1 and args.overlap:
        raise UsageError(f"--tp {args.tp} with --overlap: a tensor-parallel engine serves on the group only")
    if args.dp > 1:
        for option, on in (("--tp", args.tp > 1), ("--overlap", args.overlap)):
            if on:
                raise UsageError(f"--dp {args.dp} with {option}: each replica is one plain engine process")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and Text(1024).refusal(key) is not None:
        raise UsageError(f"{API_KEY_ENV}: {Text(1024).refusal(key)}")
    defaults = sampling_defaults(args)
    given = vars(args)  # (argparse's namespace: its options by name)
    sized = tuple(name for name in SIZED_OPTIONS if given[name] is None)  # the defaults, lowered to fit the memory budget if need be
    sizes = {name: given[name] if given[name] is not None else attrs.asdict(ServeConfig())[name] for name in SIZED_OPTIONS}
    # the memory available, read once before any engine process loads its models (each of --dp's replicas gets its share)
    available = available_memory() if args.device == "cpu" else None
    launch = Launch(model=args.model, draft=args.draft, k=args.k, dtype=args.dtype, max_len=args.max_len,
                    overlap=args.overlap, threads=args.threads, chunk_size=args.chunk_size, seed=args.seed, tp=args.tp,
                    sized=sized, device=args.device, memory_fraction=args.memory_fraction, memory_available=available, replicas=args.dp,
                    **sizes, **({"tp_timeout": args.tp_timeout} if args.tp_timeout is not None else {}))
    return serve(ServerOptions(launch=launch, host=args.host, port=args.port, api_key=key, model_name=args.served_model_name,
                               max_waiting=args.max_waiting, drain_timeout=args.drain_timeout, request_timeout=args.request_timeout,
                               defaults=defaults, dp=args.dp))


def bench_online(args: argparse.Namespace, console: Console) -> int:
    from backend import children
    from compiler.tools.bench_online import RESERVE, bench_prompts, run_online_bench, served_model, start_server

    if args.json is not None:
        check_output("--json", args.json)
    prompts = bench_prompts(requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed)
    need = max(len(p.encode()) + n for p, n in prompts) + RESERVE
    if need > args.max_len:
        raise UsageError(f"--max-len {args.max_len}: the longest request needs {need} positions (prompt, new tokens and {RESERVE} free); "
                         "give a longer --max-len or fewer --max-new-tokens")
    proc = None
    with OutputFile("--json", args.json) as output:
        try:
            if args.url is None:
                serve_args = ["--max-len", str(args.max_len), "--max-running", str(args.max_running), "--max-waiting", str(args.requests),
                              "--threads", str(args.threads)] + (["--k", str(args.k)] if args.k is not None else [])
                with console.status("starting batchc serve"):
                    proc, url = start_server(serve_args)
            else:
                url = args.url.rstrip("/")
            model = served_model(url)
            with console.status(f"sending {args.requests} requests at each of {len(args.rates)} rates"):
                rows = run_online_bench(url=url, model=model, rates=args.rates, prompts=prompts, seed=args.seed)
        except RuntimeError as exc:
            children.raise_if_interrupted()
            print(f"batchc: bench online failed: {exc}", file=sys.stderr)
            return 1
        finally:
            if proc is not None:
                children.kill(proc)
        table = Table(title=f"batchc bench online: {args.requests} streaming requests per rate, Poisson arrivals, {url}")
        for h in ("rate req/s", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p90/p99 ms"):
            table.add_column(h, justify="right")

        def q(d: dict[str, float | None]) -> str:
            return "/".join("-" if v is None else f"{v:.0f}" for v in d.values())

        for r in rows:
            table.add_row(f"{r['rate']:g}", f"{r['request_throughput']:.2f}", f"{r['output_tokens_per_s']:.1f}", q(r["ttft_ms"]),
                          q(r["tpot_ms"]), q(r["itl_ms"]))
        console.print(table)
        output.write(json.dumps({"url": url, "requests": args.requests, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                                 "k": args.k, "max_running": args.max_running, "rows": rows}, indent=2))
    return 0
