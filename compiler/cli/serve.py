"""``batchc serve``: the command line's side of the online server (``compiler.online.server``):
options to ``ServerOptions``, the API key from ``--api-key`` or ``BATCHC_API_KEY``. Bad options the
parser cannot see are refused in one line (``UsageError``, exit 2) before anything starts."""

from __future__ import annotations

import argparse
import os

from compiler.cli.args import Text, UsageError, shown_path

API_KEY_ENV = "BATCHC_API_KEY"


def cmd_serve(args: argparse.Namespace) -> int:
    from compiler.online.messages import Launch
    from compiler.online.server import ServerOptions, serve

    if args.draft is not None and args.k == 0:
        raise UsageError(f"--draft {shown_path(args.draft)} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and Text(1024).refusal(key) is not None:
        raise UsageError(f"{API_KEY_ENV}: {Text(1024).refusal(key)}")
    launch = Launch(model=args.model, draft=args.draft, k=args.k, dtype=args.dtype, max_running=args.max_running, max_len=args.max_len,
                    overlap=args.overlap, threads=args.threads, chunk_size=args.chunk_size, token_budget=args.token_budget,
                    cache_entries=args.cache_entries)
    return serve(ServerOptions(launch=launch, host=args.host, port=args.port, api_key=key, model_name=args.served_model_name,
                               max_waiting=args.max_waiting, drain_timeout=args.drain_timeout, request_timeout=args.request_timeout))
