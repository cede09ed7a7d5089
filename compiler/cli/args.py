"""The ``batchc`` command line's parser: commands, options, their bounds and defaults. A bad command
line prints one line on stderr and exits with status 2."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

import attrs

from compiler.engine.config import MAX_PREFILL_STREAK, ServeConfig
from compiler.offline.budget import DEFAULT_MEMORY_FRACTION
from compiler.offline.dp import ROUTINGS
from compiler.workload import (
    ARRIVALS,
    BENCH_SERVE_NEW_TOKENS,
    BENCH_SERVE_REPEATS,
    BENCH_SERVE_REQUESTS,
    BURST_EVERY,
    BURST_SIZE,
    DEFAULT_CONTEXT,
    MAX_CONTEXT,
    MAX_K,
    MAX_REQUESTS,
    MAX_RUNNING,
    MAX_SEED,
    MAX_THREADS,
    MAX_WORKLOAD_BYTES,
    SWEEP_NEW_TOKENS,
    SWEEP_RUNNING,
)
from ir.errors import BatchcError

_SERVE = ServeConfig()
"""``batchc run``'s defaults."""

MAX_BENCH_BATCH = 1 << 16
"""Largest ``bench pipeline`` batch size (a batch's columns and plan are built in memory)."""
MAX_ITERATION_ROWS = 256
"""Most rows ``bench iteration`` times (each row holds a prompt in both models' caches)."""
MAX_ITERATION_K = 8
"""Largest ``k`` of ``bench iteration``."""
MAX_ITERATION_CONTEXT = 2048
"""Longest context ``bench iteration`` prefills per row before timing (``--context``)."""
ITERATION_CONTEXT = 40
"""``bench iteration``'s default ``--context`` (``compiler.tools.bench_iteration.PROMPT_LEN``, which
imports torch: this module does not)."""
MAX_REPEATS = 1000
MAX_SWEEP_PROMPT = 1 << 16
"""Longest ``bench serve --sweep --prompt-len`` (the engines' contexts are sized for it)."""
MAX_BENCH_VOCAB = 1 << 18
"""Largest vocabulary ``bench sampler`` times (its logits are [rows, vocab] float32 in memory)."""
DECODE_DTYPES = ("float32",)
"""``bench decode --dtype``'s choices: ``compiler.tools.bench_decode.DTYPES`` (which imports torch: this module
does not), the dtypes the model path runs on a CPU today."""
WEIGHT_DTYPE_CHOICES = ("float32", "float16", "bfloat16")
"""``--weight-dtype``'s choices (``compiler.tools.bench_decode.WEIGHT_DTYPES``): the storage of a float32
model's matrices, compute staying float32."""
MAX_DECODE_BATCH = 256
"""Most rows of a ``bench decode`` case."""
MAX_DECODE_PROMPT = 8192
"""Longest ``bench decode --prompt-len`` and most ``--new-tokens``."""
MAX_TP = 64
"""Most tensor-parallel ranks ``batchc run --tp`` takes."""
MAX_TP_TIMEOUT = 3600
MAX_DP = 64
"""Most data-parallel replicas ``batchc run --dp`` takes."""
AB_CONTEXT = 512
"""Context length of ``batchc ab``'s engines (``Engine``'s default ``max_len``)."""
MAX_TOP_K = 1 << 18
"""Largest ``--top-k``: the models' largest vocabulary (``backend.hybrid.config.MAX_VOCAB``); a
larger k keeps every token, as -1 does."""
MAX_TRAIN_STEPS = 1_000_000
"""Most ``train-draft`` steps."""
MAX_TRAIN_SEQUENCES = 1 << 16
"""Most ``train-draft`` rollouts (each holds its tokens' hidden states in memory)."""
MAX_HEAD_LAYERS = 8
"""Most layers of a head ``train-draft`` builds."""
MODEL_IMPLS = ("batchc", "transformers")
"""``batchc run --model-impl``'s choices: whose code runs the target's forward."""
MAX_AB_RUNNING = 14
"""Most live requests of ``batchc ab``: its engines' 16 slots (``Engine``'s default capacity) less
the two shared system prefixes' states."""


class UsageError(BatchcError):
    """A bad command line that argparse cannot see (an output path, a bound that depends on k)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line prints one line (no usage block) before exiting with status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2)


def _shown(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def shown_path(text: str) -> str:
    return _shown(text, 1000)


def _parse_int(text: str, want: str) -> int:
    try:
        return int(text)
    except ValueError:
        if text.strip().lstrip("+-").isdigit():  # over the interpreter's int-string digit limit
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}: more than {sys.get_int_max_str_digits()} digits") from None
        raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}") from None


def _shown_int(value: int) -> str:
    """``value`` as the user may read it back: a long one cut, with its length."""
    text = str(value)
    digits = len(text.lstrip("-"))
    return text if digits <= 24 else f"{text[:13]}... ({digits} digits)"


@attrs.frozen
class IntIn:
    """An argparse type: an integer in ``[lo, hi]``. Every integer option has one (a test walks the
    parsers), so no value past its bound reaches torch, numpy or an allocator; argparse prefixes its
    refusal with the option's name."""

    lo: int
    hi: int

    def __call__(self, text: str) -> int:
        below = {0: "a non-negative integer", 1: "a positive integer"}.get(self.lo, f"an integer >= {self.lo}")
        value = _parse_int(text, below)
        if value < self.lo:
            raise argparse.ArgumentTypeError(f"expected {below}, got {_shown_int(value)}")
        if value > self.hi:
            raise argparse.ArgumentTypeError(f"expected at most {self.hi}, got {_shown_int(value)}")
        return value


def _int_in(lo: int, hi: int) -> IntIn:
    return IntIn(lo, hi)


@attrs.frozen
class FloatIn:
    """An argparse type: a finite number in ``[lo, hi)`` (NaN and infinities refused);
    ``lo_open`` leaves ``lo`` out, ``hi_closed`` takes ``hi`` in."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_closed: bool = False

    def __call__(self, text: str) -> float:
        want = f"a finite number in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{']' if self.hi_closed else ')'}"
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}") from None
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value <= self.hi if self.hi_closed else value < self.hi
        if not (math.isfinite(value) and above and below):
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text) if len(text) > 24 else text}")
        return value


@attrs.frozen
class Text:
    """An argparse type: a non-empty word of at most ``limit`` printable ASCII characters, no
    spaces (a host name or address, an API key, a model's name in the API)."""

    limit: int

    def refusal(self, text: str) -> str | None:
        if not text or len(text) > self.limit or not (text.isascii() and text.isprintable()) or any(c.isspace() for c in text):
            return f"expected 1 to {self.limit} printable ASCII characters without spaces, got {_shown(text)}"
        return None

    def __call__(self, text: str) -> str:
        refusal = self.refusal(text)
        if refusal is not None:
            raise argparse.ArgumentTypeError(refusal)
        return text


def _device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` naming a device this machine has (``cpu``
    without importing torch: ``batchc serve``'s HTTP process does not load it)."""
    if text == "cpu":
        return text
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"unknown device {_shown(text)} (expected cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"device {_shown(text)}: no CUDA device on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"device {_shown(text)}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def _path_arg(text: str) -> str:
    """An argparse type for path options: an empty string is not a path (and not "not given")."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return text


@attrs.frozen
class LayerPattern(Text):
    """An argparse type: a draft head's layer pattern, 1 to ``MAX_HEAD_LAYERS`` of ``mamba`` and
    ``attn`` separated by commas, no spaces (``mamba``, ``mamba,attn``)."""

    def refusal(self, text: str) -> str | None:
        refused = super().refusal(text)
        if refused is not None:
            return refused
        kinds = text.split(",")
        bad = next((k for k in kinds if k not in ("mamba", "attn")), None)
        if bad is not None:
            return f"expected layer kinds mamba or attn separated by commas, got {_shown(text)} (the kind {_shown(bad)})"
        if len(kinds) > MAX_HEAD_LAYERS:
            return f"expected at most {MAX_HEAD_LAYERS} layers, got {len(kinds)} in {_shown(text)}"
        return None


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=_int_in(1, MAX_THREADS), default=_SERVE.threads,
        help=f"torch intra-op threads, set before any work, at most {MAX_THREADS} (default {_SERVE.threads}: measured on "
        "a 2-core CPU shared with other processes, two threads made runs many times slower whenever another "
        "process held a core, their idle workers spinning for it, and gained little when the CPU was quiet; "
        "figures in the docs, measurements/index.md, 'Threads')",
    )


TEMPERATURES = FloatIn(0.0, math.inf)
"""The values ``--temperature`` takes (``batchc run``, ``batchc serve``, ``batchc bench serve``)."""
TOP_PS = FloatIn(0.0, 1.0, lo_open=True, hi_closed=True)
"""The values ``--top-p`` takes: (0, 1]."""


def add_sampling_defaults(p: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-p``, ``--top-k`` and ``--min-p``: the sampling defaults of
    ``batchc run`` and ``batchc serve`` (read back by ``sampling_defaults``)."""
    p.add_argument("--temperature", type=TEMPERATURES, default=None,
                   help="sampling temperature of the requests that do not set theirs (workload lines, the built-in workload, request "
                   "bodies), as each of --top-p, --top-k and --min-p is of its own field; 0 is greedy (default 0: a request samples "
                   "only when it or this option sets a temperature > 0, and top_p, top_k and min_p act only then)")
    p.add_argument("--top-p", type=TOP_PS, default=None,
                   help="nucleus sampling: top_p in (0, 1] for requests that do not set theirs (default 1: off)")
    p.add_argument("--top-k", type=_int_in(-1, MAX_TOP_K), default=None,
                   help=f"top_k, -1 to {MAX_TOP_K}, for requests that do not set theirs (-1 or 0: off; default off)")
    p.add_argument("--min-p", type=FloatIn(0.0, 1.0, hi_closed=True), default=None,
                   help="min_p in [0, 1] for requests that do not set theirs (default 0: off)")


def sampling_defaults(args: argparse.Namespace) -> dict[str, object]:
    """The sampling defaults ``add_sampling_defaults``' options give (those given only), checked by
    ``SamplingParams``' rules (``UsageError`` naming the option); a request's own fields override
    them (``compiler.offline.load.sampling_params``)."""
    from compiler.offline.load import CLI_DEFAULTS, sampling_params
    from ir.errors import IRValidationError

    given = vars(args)  # (argparse's namespace: its options by name)
    defaults = {name: given[name] for name in CLI_DEFAULTS if given.get(name) is not None}
    try:
        sampling_params({}, defaults, max_new_tokens=1)
    except IRValidationError as exc:
        said = str(exc).removeprefix(f"{exc.node}.{exc.field}: ")
        raise UsageError(f"argument --{exc.field.replace('_', '-')}: {said}") from None
    return defaults


MEMORY_FRACTIONS = FloatIn(0.0, 1.0, lo_open=True, hi_closed=True)
"""The values ``--memory-fraction`` takes: (0, 1]."""
_SIZED = "lowered to fit the memory budget when not given (--memory-fraction)"


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """``--memory-fraction`` and ``--device`` of ``batchc run`` and ``batchc serve``."""
    p.add_argument("--memory-fraction", type=MEMORY_FRACTIONS, default=DEFAULT_MEMORY_FRACTION,
                   help="share of the memory available on the device when the run starts (on the CPU the kernel's MemAvailable, "
                   "within a cgroup's limit; on a CUDA device its free memory) that the run may use, in (0, 1], as vLLM's "
                   "--gpu-memory-utilization: the models' weights and every engine's estimated memory must fit it, and "
                   "--max-running, --token-budget and --cache-entries not given are lowered until they do (default "
                   f"{DEFAULT_MEMORY_FRACTION:g}: available, not total, because the machine is shared and has other processes' "
                   "memory in it; a tenth left for what the estimate leaves out, the allocator's slack and the others' growth)")
    p.add_argument("--device", type=_device, default="cpu",
                   help="where the engine serves and whose memory sizes it: cpu, cuda or cuda:N, a device this machine has "
                   "(default cpu; on cuda the Triton kernels are compiled for the device)")


def add_device_option(p: argparse.ArgumentParser, what: str) -> None:
    """``--device`` of ``batchc ab``, ``bench serve`` and ``bench iteration``: the values of
    ``batchc run``'s (``add_memory_options``), checked by the same type."""
    p.add_argument("--device", type=_device, default="cpu",
                   help=f"cpu, cuda or cuda:N, a device this machine has: where {what} (default cpu)")


def parser() -> argparse.ArgumentParser:
    """The command line; option defaults of ``batchc run`` are ``ServeConfig``'s."""
    p = _Parser(
        prog="batchc",
        description="Typed batch compiler for hybrid Mamba/attention serving: frozen IR, one-shot state-init "
        "ops as linear resources, a ledger-enforced backend.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="serve a workload (default: the built-in one on the bundled trained models)",
        description=f"Serve a workload. Bounds: --k in [0, {MAX_K}]; --requests and --lossless-sample at most "
        f"{MAX_REQUESTS}; --max-new-tokens (built-in workload) at most the context length (--max-len) minus its longest "
        f"prompt minus k + 1; --seed 0 to {MAX_SEED}; a workload file is a regular file of at most {MAX_WORKLOAD_BYTES >> 20} MiB; the "
        f"estimated memory of the run (the models' weights, state pools, KV caches, working memory, the Mamba chunk scan; "
        f"grows with --max-running, --cache-entries, --k, --chunk-size, --token-budget, --max-len and the models' sizes) at "
        f"most the memory budget, --memory-fraction of the memory available when the run starts (--max-running, "
        f"--token-budget and --cache-entries not given are lowered to fit it); --draft only with k > 0; an empty PATH is refused.",
    )
    run.add_argument("--model", metavar="PATH", type=_path_arg,
                     help="target: a batchc checkpoint (.safetensors) or a Hugging Face checkpoint directory of Bamba, "
                     "Granite-4.0-H or Nemotron-H (config.json, safetensors weights, tokenizer.json; served on its tokens) "
                     "(default: the bundled byte-level model)")
    run.add_argument("--model-impl", choices=MODEL_IMPLS, default="batchc",
                     help="the target's forward: batchc, batchc's own model code (default); transformers, transformers' own modeling "
                     "code and cache objects, scheduled by batchc's IR with every state op through its ledger (needs --model DIR, "
                     "a Hugging Face checkpoint directory, and transformers installed; serves at k = 0 in this process: no --draft, "
                     "--k, --tp, --dp, --overlap, --compare-mutable, nor requests with penalties)")
    run.add_argument("--draft", metavar="PATH", type=_path_arg,
                     help="draft, the same kinds as --model, with the target's vocabulary (default: the bundled one for the "
                     "bundled target; none for a Hugging Face target); refused with --k 0, which runs no draft")
    run.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                     help="compute dtype of the models (weights are converted on load; default float32)")
    run.add_argument("--weight-dtype", choices=WEIGHT_DTYPE_CHOICES, default="float32",
                     help="store the target's matrices in this dtype, compute, states and logits staying float32 (float16, bfloat16: "
                     "half the bytes a decode step reads; needs --dtype float32 and --k 0, on the CPU in this process; default float32)")
    run.add_argument("--outputs", metavar="PATH", type=_path_arg,
                     help="write one JSON line per request to PATH: rid, index, prompt, prompt_ids, output_ids, text (ending before "
                     "a stop string that ended it), finish_reason (stop: an end-of-sequence id, a stop string or a stop token id; "
                     "length: max_new_tokens) "
                     "(a new or regular file, replaced when the run ends; '-' for stdout)")
    run.add_argument("--workload", metavar="PATH", type=_path_arg,
                     help=f"JSONL workload file, a regular file of at most {MAX_WORKLOAD_BYTES >> 20} MiB: one object a line with prompt, "
                     "optionally arrival (a scheduler step) and any sampling field under its name (temperature, top_p, top_k, min_p, "
                     "seed, presence_penalty, frequency_penalty, repetition_penalty, stop, stop_token_ids, ignore_eos, min_tokens, "
                     "max_new_tokens, logprobs, n) (default: the built-in workload)")
    run.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=64, help=f"built-in workload size, at most {MAX_REQUESTS} (default 64)")
    run.add_argument("--max-new-tokens", type=_int_in(1, MAX_CONTEXT), default=32,
                     help="built-in workload: max tokens per request, at most --max-len - longest built-in prompt - (k + 1) (default 32)")
    run.add_argument("--max-len", type=_int_in(3, MAX_CONTEXT), default=None,
                     help=f"context length in tokens: prompt, new tokens and the k + 1 positions of a step, at most {MAX_CONTEXT} "
                     "and at most a Hugging Face model's max_position_embeddings (default: that of a Hugging Face --model, or of "
                     f"its --draft if smaller; {DEFAULT_CONTEXT} for batchc models; bounded by the memory estimate); a workload "
                     "request that does not fit is refused on its own (finish_reason refused in --outputs) and the others are served")
    run.add_argument("--k", type=_int_in(0, MAX_K), default=None,
                     help=f"draft tokens per speculative iteration, 0 to {MAX_K}; 0 turns it off (default {_SERVE.k} on "
                     "batchc checkpoints; on a Hugging Face --model, 0 without --draft and 2 with one)")
    run.add_argument("--max-running", type=_int_in(1, MAX_RUNNING), default=None,
                     help=f"requests live at once (default {_SERVE.max_running}, {_SIZED})")
    run.add_argument("--chunk-size", type=_int_in(1, MAX_CONTEXT), default=_SERVE.chunk_size, help=f"prefill chunk size in tokens (default {_SERVE.chunk_size})")
    run.add_argument("--token-budget", type=_int_in(1, MAX_CONTEXT), default=None,
                     help=f"prefill tokens per step (default {_SERVE.token_budget}, {_SIZED})")
    run.add_argument("--prefill-streak", type=_int_in(0, MAX_PREFILL_STREAK), default=_SERVE.prefill_streak,
                     help="with a draft: prefill steps in a row while requests run, before one speculative step; 0: no bound "
                     f"(prefill whatever is queued first), 1: alternate (default {_SERVE.prefill_streak}, measured)")
    run.add_argument("--cache-entries", type=_int_in(1, MAX_RUNNING), default=None,
                     help=f"prefix-cache entries (default {_SERVE.cache_entries}, {_SIZED})")
    add_memory_options(run)
    run.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0,
                     help=f"the run's seed, 0 to {MAX_SEED} (default 0): the built-in workload's, and the one a sampled request "
                     "(temperature > 0) without a seed of its own derives its seed from, with its request id")
    add_sampling_defaults(run)
    run.add_argument("--arrivals", choices=ARRIVALS, default="bursts",
                     help=f"built-in workload: {BURST_SIZE} requests every {BURST_EVERY} steps, or one at a time 0-2 steps apart (default bursts)")
    run.add_argument("--lossless-sample", type=_int_in(0, MAX_REQUESTS), default=_SERVE.lossless_sample,
                     help=f"requests re-run with plain greedy to check losslessness (default {_SERVE.lossless_sample})")
    run.add_argument("--compare-mutable", action="store_true", help="also run the workload through the pre-fix mutable baseline")
    run.add_argument("--overlap", action="store_true",
                     help="run each model's executor in its own process, fed packed plans, so the target's and the draft's "
                     "prefills and commits run at the same time as each other and as host work (default off: on a 2-core CPU "
                     "it is not faster yet; docs/guides/overlap.md)")
    run.add_argument("--json", metavar="PATH", type=_path_arg,
                     help="also write the summary as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                     "replaced when the run ends ('-' for stdout)")
    run.add_argument("--tp", type=_int_in(1, MAX_TP), default=None,
                     help=f"tensor-parallel ranks, at most {MAX_TP}: this process is rank 0 and starts the others on this "
                     "machine; under torchrun, each process is one rank and --tp, if given, must equal WORLD_SIZE "
                     "(default 1, or WORLD_SIZE under torchrun); it must divide the models' heads (docs/guides/parallelism.md)")
    run.add_argument("--dp", type=_int_in(1, MAX_DP), default=1,
                     help=f"data-parallel replicas of the engine, at most {MAX_DP}: each in its own process with its own models, "
                     "prefix cache and ledger, fed by a prefix-aware router (default 1; docs/guides/parallelism.md)")
    run.add_argument("--dp-routing", choices=ROUTINGS, default=None,
                     help="with --dp: a request goes to the replica holding its first prefix-cache block (prefix, the default) "
                     "or the requests are dealt out in turn (round-robin, for comparison)")
    run.add_argument("--tp-timeout", type=_int_in(1, MAX_TP_TIMEOUT), default=None,
                     help=f"with --tp: seconds a rank waits on the others in any step before the group fails, at most {MAX_TP_TIMEOUT} "
                     "(default 60; a rank that dies is noticed at once; the ranks wait up to 600 s for each other to start)")
    _add_threads(run)

    ab = sub.add_parser("ab", help="the stale-init bug side by side: compiled pipeline vs. mutable baseline")
    ab.add_argument("--k", type=_int_in(1, MAX_K), default=2, help=f"draft tokens per iteration, at most {MAX_K} (default 2)")
    ab.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=12, help=f"requests, at most {MAX_REQUESTS} (default 12)")
    ab.add_argument("--max-new-tokens", type=_int_in(1, AB_CONTEXT), default=24,
                    help=f"tokens per request, at most the context {AB_CONTEXT} minus the longest prompt minus k + 1, and all the "
                    "running requests' contexts within the engines' KV cache (default 24)")
    ab.add_argument("--max-running", type=_int_in(1, MAX_AB_RUNNING), default=4,
                    help=f"requests live at once, at most {MAX_AB_RUNNING} (default 4)")
    ab.add_argument("--draft", choices=("model", "mtp"), default="model",
                    help="model: a tiny target and a noisy copy of it as the separate draft (default); mtp: the upstream setting, "
                    "the bundled target and its trained draft head, whose own pool the pre-fix baseline replays stale init ops on")
    ab.add_argument("--draft-noise", type=FloatIn(0.0, 10.0), default=None,
                    help="relative weight noise of the draft, a finite number in [0, 10) (default 0.05)")
    ab.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0, help=f"weights and workload seed, 0 to {MAX_SEED} (default 0)")
    ab.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the figures as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                    "replaced when the run ends ('-' for stdout)")
    add_device_option(ab, "every run's models and pools live, the compiled engine's and the baselines'")
    _add_threads(ab)

    td = sub.add_parser(
        "train-draft", help="train an MTP/EAGLE draft head for a target on its own greedy continuations (self-distillation)",
        description="Train a draft head (backend.hybrid.head) for --target on the target's own greedy continuations of the "
        "stdlib-source corpus (nothing downloaded), with a progress bar, a resumable checkpoint (--out FILE and FILE.resume, "
        "written every --checkpoint-every steps, atomically) and the held-out acceptance of chained proposals at k = 1..4 "
        "(stored in the checkpoint's metadata). SIGINT keeps the last checkpoint written; --resume continues it exactly.",
    )
    td.add_argument("--target", metavar="PATH", type=_path_arg,
                    help="the target: a batchc checkpoint (.safetensors) or a Hugging Face checkpoint directory (config.json, "
                    "safetensors weights, tokenizer.json; the corpus is tokenised with its tokenizer) (default: the bundled byte-level model)")
    td.add_argument("--out", metavar="FILE", type=_path_arg, default=None,
                    help="the head checkpoint to write, a new or regular file (FILE.resume is written beside it); required")
    td.add_argument("--steps", type=_int_in(1, MAX_TRAIN_STEPS), default=None,
                    help=f"training steps, at most {MAX_TRAIN_STEPS} (default: the bundled head's)")
    td.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0, help=f"data and weights seed, 0 to {MAX_SEED} (default 0)")
    td.add_argument("--layers", metavar="PATTERN", type=LayerPattern(8 * MAX_HEAD_LAYERS), default=None,
                    help=f"the head's layers: mamba and attn separated by commas, at most {MAX_HEAD_LAYERS} (default: the bundled head's)")
    td.add_argument("--sequences", type=_int_in(1, MAX_TRAIN_SEQUENCES), default=None,
                    help="training rollouts of the target (default: the bundled head's)")
    td.add_argument("--seq-len", type=_int_in(1, MAX_CONTEXT), default=None,
                    help="tokens per rollout: 64 of corpus prompt, the rest the target's greedy continuation; more than 68 (default 256)")
    td.add_argument("--held-out", type=_int_in(1, MAX_TRAIN_SEQUENCES), default=None,
                    help="held-out rollouts the acceptance is measured on (default 64)")
    td.add_argument("--hidden-dropout", metavar="P", type=FloatIn(0.0, 1.0), default=None,
                    help="the fraction of training positions whose target hidden input is zeroed, so that the head learns to "
                    "carry the context in its own Mamba state, a finite number in [0, 1) (default: the bundled head's)")
    td.add_argument("--checkpoint-every", type=_int_in(1, MAX_TRAIN_STEPS), default=None,
                    help="steps between checkpoints (default 50)")
    td.add_argument("--eval-every", type=_int_in(0, MAX_TRAIN_STEPS), default=0,
                    help="also measure held-out acceptance every this many steps (default 0: at the end only)")
    td.add_argument("--resume", action="store_true",
                    help="continue from FILE.resume (the same target, seed and settings), to the same result as an uninterrupted run")
    td.add_argument("--minutes", type=FloatIn(0.0, 10080.0, lo_open=True), default=None,
                    help="a cap on the run's time: past it, training stops with the head written at the step reached and exit status 1")
    _add_threads(td)

    dump = sub.add_parser("dump", help="print the IR after every pass of the built-in scenario")
    dump.add_argument("--verify", type=_int_in(0, 2), default=2, help="verify level while dumping, 0, 1 or 2 (default 2)")
    dump.add_argument("--spec", action="store_true", help="the speculative-decoding scenario (tiny hybrid model, k=2)")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="group", required=True, metavar="GROUP")
    bp = bsub.add_parser("pipeline", help="decode-step host cost: compiled pipeline vs. mutable baseline")
    bp.add_argument("--sizes", type=_int_in(1, MAX_BENCH_BATCH), nargs="+", default=[1, 64, 256, 1024],
                    help=f"batch sizes, each at most {MAX_BENCH_BATCH}")
    bp.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=7, help=f"interleaved repeats per size, at most {MAX_REPEATS} (default 7)")
    _add_threads(bp)
    bs = bsub.add_parser(
        "serve", help="serving workload at k=0 and k=2: compiled pipeline vs. the mutable baseline, pre-fix and fixed",
        description="Serve a workload at k = 0 and k = 2 through the compiled engine and the mutable baseline "
        "(pre-fix and with the upstream fix), every engine warmed up first, runs interleaved across engines; "
        "report the median of the repeats per (arrivals, k, engine, running batch, sampling), their range, acceptance at k = 2, "
        "the share of the compiled engine's sampler, and every request's time to first token and time per output token. With "
        "--temperature > 0, every workload is also served with each request sampled, on the compiled engine only.",
    )
    bs.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=None,
                    help=f"built-in workload size, at most {MAX_REQUESTS} (default {BENCH_SERVE_REQUESTS}; not with --sweep)")
    bs.add_argument("--max-new-tokens", type=_int_in(1, MAX_CONTEXT), default=None,
                    help=f"built-in workload: max tokens per request (default {BENCH_SERVE_NEW_TOKENS}); with --sweep: the new tokens "
                    f"every request asks for (default {SWEEP_NEW_TOKENS}: a long sweep measures the steady decode and speculative steps)")
    bs.add_argument("--arrivals", choices=ARRIVALS, nargs="+", default=None,
                    help=f"built-in workload: the arrival patterns measured, each with every engine and k (default: {' '.join(ARRIVALS)}; "
                    "not with --sweep)")
    for option, lo, hi, what, default in (
        ("--chunk-size", 1, MAX_CONTEXT, "prefill chunk size in tokens", _SERVE.chunk_size),
        ("--token-budget", 1, MAX_CONTEXT, "prefill tokens per step", _SERVE.token_budget),
        ("--prefill-streak", 0, MAX_PREFILL_STREAK, "prefill steps in a row while requests run (0: no bound, 1: alternate)",
         _SERVE.prefill_streak),
        ("--cache-entries", 1, MAX_RUNNING, "prefix-cache entries", _SERVE.cache_entries),
    ):
        bs.add_argument(option, type=_int_in(lo, hi), default=None,
                        help=f"the compiled engine's {what}, as batchc run's (default {default}; not with --sweep)")
    bs.add_argument("--memory-fraction", type=MEMORY_FRACTIONS, default=DEFAULT_MEMORY_FRACTION,
                    help=f"share of the memory available when the bench starts that every engine it builds must fit, as batchc "
                    f"run's (default {DEFAULT_MEMORY_FRACTION:g}; the bench's sizes are never lowered: a case over it is refused)")
    bs.add_argument("--temperature", type=TEMPERATURES, default=None,
                    help="also measure every workload with each request sampled at this temperature, on the compiled engine "
                    "only (the baselines decode greedily), interleaved with the greedy runs; each request's seed derives from "
                    "seed 0 and its id, as batchc run's (default 0: greedy only)")
    bs.add_argument("--top-p", type=TOP_PS, default=None,
                    help="with --temperature > 0: the sampled requests' top_p in (0, 1] (default 1: off)")
    bs.add_argument("--k", dest="ks", metavar="K", type=_int_in(0, MAX_K), nargs="+", default=None,
                    help=f"the k measured, each with every engine (default: 0 2; at most {MAX_K})")
    bs.add_argument("--model", metavar="PATH", type=_path_arg,
                    help="the target, as batchc run's --model: a batchc checkpoint or a Hugging Face checkpoint directory, whose "
                    "tokenizer then encodes the built-in prompts and which the compiled engine alone serves (the baselines speak "
                    "bytes) (default: the bundled byte-level model)")
    bs.add_argument("--draft", dest="drafts", metavar="DRAFT", type=_path_arg, nargs="+", default=None,
                    help="the drafts measured at k > 0, at most one of each kind: model, the bundled separate draft (every "
                    "engine); mtp, the bundled target's trained draft head (every engine: the baselines get the same head); "
                    "or a PATH, a draft head file (batchc train-draft; kind mtp) or a draft model with the target's "
                    "vocabulary (kind model) (default: model, for the bundled target)")
    bs.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=BENCH_SERVE_REPEATS,
                    help=f"interleaved repeats of every (k, engine) run, at most {MAX_REPEATS} (default {BENCH_SERVE_REPEATS})")
    bs.add_argument("--sweep", metavar="B", type=_int_in(1, MAX_REQUESTS), nargs="*", default=None,
                    help="instead of the built-in workload, sweep the running batch: B requests arriving together at step 0, "
                    f"{SWEEP_NEW_TOKENS} new tokens each (--max-new-tokens), for each B (default B: {' '.join(map(str, SWEEP_RUNNING))}; "
                    "each bounded by the memory estimate)")
    bs.add_argument("--prompt-len", metavar="N", type=_int_in(1, MAX_SWEEP_PROMPT), default=None,
                    help=f"with --sweep: every prompt exactly N bytes (more bundled snippets appended, the last one cut; on the "
                    f"byte-level model N tokens, at most {MAX_SWEEP_PROMPT}) instead of one snippet: the steady state at a long "
                    "context, where attention is most of a decode")
    bs.add_argument("--overlap", action="store_true",
                    help="also measure the compiled engine with each executor in its own process (rows with overlap true)")
    bs.add_argument("--replay", action="store_true",
                    help="also serve every in-process run again, at least 3 times and for at least 0.5 s, with its model "
                    "forwards replayed from a recording of them (column 'host rep': the least host time per step of the "
                    "replays, the engine's own work without the forwards that evict its caches); every replay must serve "
                    "the same tokens (the overlap rows are not replayed; holds every run's logits in memory while it runs)")
    bs.add_argument("--tp", type=_int_in(1, MAX_TP), default=None,
                    help="instead of the baselines: the compiled engine on one process against a tensor-parallel group of "
                    "this many ranks (started by the command, or torchrun's), side by side, with the plan broadcast's cost")
    bs.add_argument("--tp-timeout", type=_int_in(1, MAX_TP_TIMEOUT), default=600,
                    help=f"with --tp: seconds a rank waits on the others before the group fails, at most {MAX_TP_TIMEOUT} (default 600: "
                    "the workers wait while rank 0 measures a run on one process)")
    bs.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the rows as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                    "replaced when the bench ends ('-' for stdout)")
    add_device_option(bs, "every engine's models, pools and sampler live, and whose memory --memory-fraction reads; not with --tp or "
                      "--overlap")
    _add_threads(bs)
    bk = bsub.add_parser("kernels", help="state-pool kernels (init ops, selective_state_update; on a CPU, torch paths vs per-row references)")
    bk.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    _add_threads(bk)
    bi = bsub.add_parser(
        "iteration", help="one speculative iteration's model phases in target decodes (bundled target and draft)",
        description="Time each model phase of a speculative iteration (verify, commit, the draft's proposal and commit; "
        "the bundled draft head's proposal and commit; and the draft-extend iteration it replaced) on the bundled models and divide by one target decode of the same rows: "
        "speculation pays when an iteration costs fewer decodes than the tokens it emits per row.",
    )
    bi.add_argument("--rows", type=_int_in(1, MAX_ITERATION_ROWS), default=8, help=f"running requests, at most {MAX_ITERATION_ROWS} (default 8)")
    bi.add_argument("--k", type=_int_in(1, MAX_ITERATION_K), default=2, help=f"draft tokens per row, at most {MAX_ITERATION_K} (default 2)")
    bi.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=7, help=f"interleaved repeats, the minimum is kept, at most {MAX_REPEATS} (default 7)")
    bi.add_argument("--context", type=_int_in(1, MAX_ITERATION_CONTEXT), default=ITERATION_CONTEXT,
                    help=f"tokens already in each row's context before the phases are timed, at most {MAX_ITERATION_CONTEXT} "
                    f"(default {ITERATION_CONTEXT}; the default bench serve workload's requests hold a few hundred)")
    bi.add_argument("--model", metavar="PATH", type=_path_arg,
                    help="the target, as batchc run's --model (default: the bundled byte-level model); with it, --draft is needed")
    bi.add_argument("--draft", metavar="PATH", type=_path_arg,
                    help="time this draft only: a draft head file (batchc train-draft) or a draft model with the target's vocabulary; "
                    "mtp: the bundled head (default: the bundled separate draft and the bundled head, for the bundled target)")
    bi.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the phases and the iteration per draft kind as JSON to PATH ('-' for stdout)")
    add_device_option(bi, "the models and their pools live; on cuda each phase is timed until the device has finished it")
    _add_threads(bi)
    bsm = bsub.add_parser(
        "sampler", help="the sampler's time per call against the bundled target's decode step",
        description="Time the sampler (distribution + sample_rows) per call for greedy, temperature 1, temperature 1 with "
        "top_p 0.9, top_k 50 and penalties, at the bundled model's vocabulary and at --vocab, next to the bundled target's "
        "decode step at the same rows: medians of interleaved repeats after a warm-up, with their range, and the "
        "sampler's share of the decode step.",
    )
    bsm.add_argument("--rows", type=_int_in(1, MAX_ITERATION_ROWS), nargs="+", default=[8, 128],
                     help=f"running rows, each at most {MAX_ITERATION_ROWS} (default 8 128)")
    bsm.add_argument("--vocab", type=_int_in(2, MAX_BENCH_VOCAB), nargs="*", default=[131_072],
                     help=f"vocabularies besides the bundled model's, each at most {MAX_BENCH_VOCAB} (default 131072; none: only the model's)")
    bsm.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=5, help=f"interleaved repeats, at most {MAX_REPEATS} (default 5)")
    bsm.add_argument("--json", metavar="PATH", type=_path_arg,
                     help="also write the figures as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                     "replaced when the bench ends ('-' for stdout)")
    _add_threads(bsm)
    bd = bsub.add_parser(
        "decode", help="prompt tokens/s and decode ms per step at k = 0, beside the weight-read bound, with a per-part split of a step",
        description="Serve --batch requests of --prompt-len random tokens and --new-tokens greedy tokens each through the compiled "
        "engine at k = 0 (as batchc run --k 0), for every dtype, thread count and batch: prompt tokens/s, decode ms per step "
        "(model, sampler, host), the copy bandwidth measured here and the step's bound at it (the weights' bytes, and with the "
        "rows' Mamba states and KV), and a split of a decode step into the model's parts (layers by kind, the state pool's "
        "gathers and scatters, the KV cache, the LM head, norms, embedding), the sampler and the host, timed by the parts' "
        "clock through the same steps. Warm-up first, then --repeats interleaved rounds; medians with their range "
        "(docs/guides/cpu-decode.md, with the same comparison against llama.cpp).",
    )
    bd.add_argument("--model", metavar="PATH", type=_path_arg,
                    help="the model, as batchc run's --model: a batchc checkpoint or a Hugging Face checkpoint directory "
                    "(default: the bundled byte-level model)")
    bd.add_argument("--dtype", dest="dtypes", choices=DECODE_DTYPES, nargs="+", default=list(DECODE_DTYPES),
                    help=f"compute dtypes measured, each a case of its own (default: {' '.join(DECODE_DTYPES)}: the dtypes the model "
                    "path runs on a CPU today)")
    bd.add_argument("--weight-dtype", dest="weight_dtypes", choices=WEIGHT_DTYPE_CHOICES, nargs="+", default=["float32"],
                    help="storage dtypes of the float32 model's matrices measured, each a case of its own, compute, states and logits "
                    "staying float32; a 16-bit one also reports its greedy agreement and logit difference against float32 "
                    "(default float32; docs/guides/cpu-decode.md)")
    bd.add_argument("--batch", dest="batches", metavar="B", type=_int_in(1, MAX_DECODE_BATCH), nargs="+", default=[1, 8],
                    help=f"running requests of each case, each at most {MAX_DECODE_BATCH} (default 1 8)")
    bd.add_argument("--threads", dest="thread_counts", metavar="T", type=_int_in(1, MAX_THREADS), nargs="+", default=[1, 2],
                    help=f"torch intra-op threads of each case, each at most {MAX_THREADS} (default 1 2)")
    bd.set_defaults(threads=_SERVE.threads)  # (the command line sets these before the bench, which sets each case's)
    bd.add_argument("--prompt-len", type=_int_in(1, MAX_DECODE_PROMPT), default=160,
                    help=f"prompt tokens of every request, at most {MAX_DECODE_PROMPT} (default 160)")
    bd.add_argument("--new-tokens", type=_int_in(2, MAX_DECODE_PROMPT), default=32,
                    help=f"tokens every request generates, 2 to {MAX_DECODE_PROMPT}: one from the prefill, the rest from decode steps (default 32)")
    bd.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=3,
                    help=f"interleaved timed rounds of every case, at most {MAX_REPEATS} (default 3)")
    bd.add_argument("--min-seconds", type=_int_in(0, 3600), default=1,
                    help="a round serves its workload again until its decode steps have run this many seconds (default 1; 0: once)")
    bd.add_argument("--copy-mib", type=_int_in(1, 1 << 16), default=256,
                    help="MiB of the copy that measures the bandwidth, far more than the CPU's caches hold (default 256)")
    bd.add_argument("--no-split", dest="split", action="store_false",
                    help="time the rounds without the parts' clock (no per-part split)")
    bd.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the figures, the split and their provenance as JSON to PATH, a new or regular file (not a link, "
                    "device or FIFO), replaced when the bench ends ('-' for stdout)")
    bo = bsub.add_parser(
        "online", help="batchc serve under Poisson arrivals: throughput, TTFT, TPOT and ITL percentiles",
        description="Start batchc serve (or use --url) and send the built-in workload's prompts as greedy streaming completions "
        "with Poisson arrivals at each --rates value (requests/s); report request throughput, output tokens/s, and time to first "
        "token, time per output token and inter-token latency at p50/p90/p99.",
    )
    bo.add_argument("--rates", type=FloatIn(0.001, 1e6), nargs="+", default=[1.0, 2.0, 4.0, 8.0],
                    help="arrival rates in requests/s, one run each (default 1 2 4 8)")
    bo.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=32, help=f"requests per rate, at most {MAX_REQUESTS} (default 32)")
    bo.add_argument("--max-new-tokens", type=_int_in(1, MAX_CONTEXT), default=32, help="largest max_tokens of a request (default 32)")
    bo.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0, help="workload and arrivals seed (default 0)")
    bo.add_argument("--url", type=Text(2048), default=None, help="an running batchc serve to measure (default: start one with the options below)")
    bo.add_argument("--k", type=_int_in(0, MAX_K), default=None, help="the started server's --k")
    bo.add_argument("--max-running", type=_int_in(1, MAX_RUNNING), default=_SERVE.max_running, help="the started server's --max-running")
    bo.add_argument("--max-len", type=_int_in(3, MAX_CONTEXT), default=DEFAULT_CONTEXT, help=f"the started server's --max-len (default {DEFAULT_CONTEXT})")
    bo.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the rows as JSON to PATH, a new or regular file, replaced when the bench ends ('-' for stdout)")
    _add_threads(bo)

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server on the engine (completions, chat, streaming, metrics)",
        description="Serve the model over HTTP with the OpenAI API (POST /v1/completions, /v1/chat/completions; GET /v1/models, "
        "/health, /metrics). The engine runs in its own process. SIGTERM or SIGINT drains: new requests get 503, requests in "
        "flight finish within --drain-timeout or are aborted, and the server exits 0 (docs/guides/online-server.md).",
    )
    sv.add_argument("--model", metavar="PATH", type=_path_arg, help="target, as batchc run's --model (default: the bundled byte-level model)")
    sv.add_argument("--draft", metavar="PATH", type=_path_arg, help="draft, as batchc run's --draft")
    sv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="compute dtype of the models (default float32)")
    sv.add_argument("--k", type=_int_in(0, MAX_K), default=None, help="draft tokens per speculative iteration, as batchc run's --k")
    sv.add_argument("--max-running", type=_int_in(1, MAX_RUNNING), default=None,
                    help=f"requests live in the engine at once (default {_SERVE.max_running}, {_SIZED})")
    sv.add_argument("--max-len", type=_int_in(3, MAX_CONTEXT), default=None, help="context length in tokens, as batchc run's --max-len")
    sv.add_argument("--chunk-size", type=_int_in(1, MAX_CONTEXT), default=_SERVE.chunk_size, help=f"prefill chunk size in tokens (default {_SERVE.chunk_size})")
    sv.add_argument("--token-budget", type=_int_in(1, MAX_CONTEXT), default=None,
                    help=f"prefill tokens per step (default {_SERVE.token_budget}, {_SIZED})")
    sv.add_argument("--cache-entries", type=_int_in(1, MAX_RUNNING), default=None,
                    help=f"prefix-cache entries (default {_SERVE.cache_entries}, {_SIZED})")
    add_memory_options(sv)
    sv.add_argument("--overlap", action="store_true", help="run each model's executor in its own process, as batchc run's --overlap")
    sv.add_argument("--tp", type=_int_in(1, MAX_TP), default=1,
                    help=f"tensor-parallel ranks, at most {MAX_TP}: the engine process is rank 0 and starts the others on this machine "
                    "(default 1); it must divide the models' heads (docs/guides/parallelism.md)")
    sv.add_argument("--tp-timeout", type=_int_in(1, MAX_TP_TIMEOUT), default=None,
                    help=f"with --tp: seconds a rank waits on the others in any step before the group fails, at most {MAX_TP_TIMEOUT} (default 60)")
    sv.add_argument("--dp", type=_int_in(1, MAX_DP), default=1,
                    help=f"data-parallel replicas of the engine, at most {MAX_DP}: each its own engine process with its own models, prefix "
                    "cache and ledger; a request goes to the replica with the fewest in flight (default 1; --max-running is per replica)")
    sv.add_argument("--seed", type=_int_in(0, MAX_SEED), default=0,
                    help=f"the engine's seed, 0 to {MAX_SEED} (default 0): a sampled request (temperature > 0) without a seed of its own "
                    "derives its seed from it and its request id, the request's number in the order the server accepted them (0 "
                    "first), as batchc run --seed does with a workload line's number; under concurrent clients that order is a race, so "
                    "a request that must be reproducible sets its own seed")
    add_sampling_defaults(sv)
    sv.add_argument("--host", type=Text(253), default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_int_in(0, 65535), default=8000, help="port to bind, 0 for any free one (the line printed at start names it; default 8000)")
    sv.add_argument("--api-key", metavar="KEY", type=Text(1024), default=None,
                    help="require Authorization: Bearer KEY on every route but /health (default: the BATCHC_API_KEY environment variable, if set)")
    sv.add_argument("--served-model-name", metavar="NAME", type=Text(256), default=None, help="the model's id in the API (default: --model, or batchc-bundled)")
    sv.add_argument("--max-waiting", type=_int_in(0, MAX_RUNNING), default=64,
                    help="requests in flight beyond --max-running before new ones are answered 503 with Retry-After (default 64)")
    sv.add_argument("--drain-timeout", type=FloatIn(0.0, 86400.0), default=30.0,
                    help="seconds requests in flight may run on after SIGTERM or SIGINT before they are aborted (default 30)")
    sv.add_argument("--request-timeout", type=FloatIn(0.001, 86400.0), default=600.0,
                    help="seconds a request may take before it is aborted (504, or an error event on a stream; default 600)")
    _add_threads(sv)
    return p


