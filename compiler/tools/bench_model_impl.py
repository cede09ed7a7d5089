"""Tokens/s of ``batchc run --model-impl transformers`` (transformers' modeling code and cache,
``backend.hf.transformers_backend``) beside batchc's own model code, on the same Hugging Face
checkpoint and the same workload::

    python -m compiler.tools.bench_model_impl [--model DIR | --family F] [--requests 16] [--max-new-tokens 32] [--rounds 3]

Without ``--model`` a tiny random checkpoint of ``--family`` (default ``granitemoehybrid``) is built
in a temporary directory (``backend.tools.hf_random``, vocabulary 320, with its tokenizer). The workload is ``batchc run``'s
built-in one on the checkpoint's tokenizer, served as ``batchc run`` serves it at k = 0 (the
prefix cache, chunked prefill, continuous batching; ``ServeConfig``'s defaults), all greedy. Each
engine serves it once to warm up, then ``rounds`` times, the two engines alternating (batchc first
on even rounds, transformers first on odd ones), so that drift on a shared machine touches both
alike; a row is the median tokens/s of its rounds with their range. Every run's outputs must equal
batchc's first run's, token for token, and every ledger must be drained (else ``AssertionError``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison (see the module) and print one line per implementation."""
    import torch

    from backend.hf import load_hf
    from backend.hf.transformers_backend import TransformersModel
    from compiler.engine.config import ServeConfig
    from compiler.offline.load import builtin_workload, tokenize_workload
    from compiler.offline.run import make_engine, serve
    from compiler.offline.tokenizer import HFTokenizer

    p = argparse.ArgumentParser(prog="python -m compiler.tools.bench_model_impl", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a Hugging Face checkpoint directory (default: a tiny random one of --family)")
    p.add_argument("--family", choices=("bamba", "granitemoehybrid", "nemotron_h"), default="granitemoehybrid")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.model
        if directory is None:
            from backend.tools.hf_random import save_hf_model, save_tokenizer

            directory = Path(tmp)
            save_hf_model(args.family, directory, seed=7, vocab_size=320)
            save_tokenizer(directory)
        loaded = load_hf(directory)
        impl = TransformersModel.from_pretrained(directory)
        tokenizer = HFTokenizer(directory / "tokenizer.json")
    cfg = ServeConfig(k=0)
    workload = tokenize_workload(builtin_workload(num_requests=args.requests, max_new_tokens=args.max_new_tokens), tokenizer,
                                 vocab=loaded.model.config.vocab)
    rates: dict[str, list[float]] = {"batchc": [], "transformers": []}
    reference: dict[int, list[int]] | None = None

    def once(name: str) -> float:
        nonlocal reference
        with make_engine(loaded.model, None, cfg, None, cache=True, k=0, transformers=impl if name == "transformers" else None) as engine:
            t0 = time.perf_counter()
            wall, _ = serve(engine, workload, max_running=cfg.max_running, eos=loaded.hf.eos_ids, tokenizer=tokenizer)
            assert time.perf_counter() - t0 >= wall
            engine.drop_cache()
            engine.ledger.assert_drained()
            outputs = {int(rid): list(out) for rid, out in engine.outputs.items()}
        if reference is None:
            reference = outputs
        assert outputs == reference, f"{name}: outputs differ from batchc's"
        return sum(len(out) for out in outputs.values()) / wall

    for name in rates:
        once(name)  # warm-up (first-call costs)
    for r in range(args.rounds):
        order = list(rates) if r % 2 == 0 else list(reversed(rates))
        for name in order:
            rates[name].append(once(name))
    tokens = sum(len(out) for out in (reference or {}).values())
    prompt = sum(len(r.token_ids) for r in workload)
    print(f"{loaded.family} {directory if args.model is not None else '(tiny random)'}: {len(workload)} requests, {prompt} prompt tokens, "
          f"{tokens} generated tokens per run, {args.rounds} rounds, {args.threads} thread(s); outputs equal token for token")
    for name, values in rates.items():
        print(f"  {name:<13} {statistics.median(values):8.1f} tokens/s (range {min(values):.1f} - {max(values):.1f})")
    ratio = statistics.median(rates["transformers"]) / statistics.median(rates["batchc"])
    print(f"  transformers / batchc: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
