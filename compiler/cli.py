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

Bad input the user can cause (option values and their bounds, an empty path, ``--draft`` with
``--k 0``, ``BATCHC_VERIFY`` and ``BATCHC_DUMP_DIR``, workload files, checkpoints, the ``--json``
path) prints one line on stderr and exits with status 2 before anything runs. ``--json`` claims its
path before the run: a temporary file created next to it (never through a link, device or FIFO at
the path) is filled and renamed onto it when the run ends. ``batchc run`` exits with status 1, saying why in one
line on stderr, when a forward failed and aborted requests, a ticket was never consumed, or the
lossless check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from compiler.manager import PassManager, settings_from_env
from compiler.workload import ARRIVALS, BURST_EVERY, BURST_SIZE, MAX_K, MAX_REQUESTS, MAX_SERVE_BYTES, MAX_WORKLOAD_BYTES
from ir.errors import BatchcError

MAX_BENCH_BATCH = 1 << 16
"""Largest ``bench pipeline`` batch size (a batch's columns and plan are built in memory)."""
MAX_REPEATS = 1000


class UsageError(BatchcError):
    """A bad command line that argparse cannot see (an output path, a bound that depends on k)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line prints one line (no usage block) before exiting with status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {' '.join(message.split())}", file=sys.stderr)
        raise SystemExit(2)


def _shown(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _path(text: str) -> str:
    return _shown(text, 1000)


def _parse_int(text: str, want: str) -> int:
    try:
        return int(text)
    except ValueError:
        if text.strip().lstrip("+-").isdigit():  # over the interpreter's int-string digit limit
            raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}: more than {sys.get_int_max_str_digits()} digits") from None
        raise argparse.ArgumentTypeError(f"expected {want}, got {_shown(text)}") from None


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""
    below = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")

    def parse(text: str) -> int:
        value = _parse_int(text, below)
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {below}, got {value}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"expected at most {hi}, got {value}")
        return value

    return parse


_positive = _int_in(1)


def _int(text: str) -> int:
    return _parse_int(text, "an integer")


def _device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` naming a device this machine has."""
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


def _check_output(option: str, path: str) -> None:
    """Refuse an output path that cannot be written, before anything runs ('-' is stdout): the
    path, if it exists, must be a writable regular file (not a symbolic link, even a dangling
    one, a device, a FIFO, a socket or a directory) in an existing directory."""
    from backend.hybrid.checkpoint import file_kind

    if path == "-":
        return
    head, name = os.path.split(path)
    parent = head or "."
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise UsageError(f"{option} {_path(path)}: no such directory {_path(parent)}") from None
    except OSError as exc:
        raise UsageError(f"{option} {_path(path)}: cannot use it ({exc.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{option} {_path(path)}: is a directory")
    if name in ("", ".", ".."):
        raise UsageError(f"{option} {_path(path)}: names a directory, not a file")
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{option} {_path(path)}: is a symbolic link (links are not followed; '-' is stdout)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{option} {_path(path)}: {file_kind(st.st_mode)}, not a regular file ('-' is stdout)")
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {_path(path)}: no such directory {_path(parent)}")
    if not os.access(parent, os.W_OK | os.X_OK) or (st is not None and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {_path(path)}: not writable")


class _Output:
    """An output path ('-' is stdout) claimed before the run: ``open`` checks the path and creates a
    temporary file next to it (``O_EXCL | O_NOFOLLOW``, so nothing already there is written
    through), refusing the path in one line if either fails; ``write`` fills it at the end and
    renames it onto the path; ``close`` removes it if it was never written. Use it as a context
    manager around the run."""

    def __init__(self, option: str, path: str | None) -> None:
        self.option, self.path = option, path
        self._fd: int | None = None
        self._tmp: str | None = None

    def open(self) -> None:
        if self.path is None or self.path == "-":
            return
        _check_output(self.option, self.path)
        head, name = os.path.split(self.path)
        parent = head or "."
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for _ in range(8):
            tmp = os.path.join(parent, f".{name[:64]}.{secrets.token_hex(6)}.tmp")
            try:
                fd = os.open(tmp, flags, 0o666)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(f"{self.option} {_path(self.path)}: cannot create a file in {_path(parent)} ({exc.strerror})") from None
        else:
            raise UsageError(f"{self.option} {_path(self.path)}: cannot create a file in {_path(parent)}")
        self._fd, self._tmp = fd, tmp
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{self.option} {_path(self.path)}: cannot create a regular file in {_path(parent)}")
            try:
                os.fchmod(fd, stat.S_IMODE(os.lstat(self.path).st_mode))  # replacing a file keeps its permissions
            except FileNotFoundError:
                pass
        except OSError as exc:
            self.close()
            raise UsageError(f"{self.option} {_path(self.path)}: cannot use it ({exc.strerror})") from None
        except BaseException:
            self.close()
            raise

    def write(self, text: str) -> None:
        if self.path is None:
            return
        if self.path == "-":
            print(text)
            return
        assert self._fd is not None and self._tmp is not None, "write before open"
        data = memoryview((text + "\n").encode("utf-8"))
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, self.path)
            self._tmp = None
        except OSError as exc:
            raise UsageError(f"{self.option} {_path(self.path)}: cannot write it ({exc.strerror})") from None
        finally:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None

    def __enter__(self) -> _Output:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="batchc",
        description="Typed batch compiler for hybrid Mamba/attention serving: frozen IR, one-shot state-init "
        "ops as linear resources, a ledger-enforced backend.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="serve a workload (default: the built-in one on the bundled trained models)",
        description=f"Serve a workload. Bounds: --k in [0, {MAX_K}]; --requests and --lossless-sample at most "
        f"{MAX_REQUESTS}; --max-new-tokens (built-in workload) at most the context limit 512 minus its longest "
        f"prompt minus k + 1; a workload file is a regular file of at most {MAX_WORKLOAD_BYTES >> 20} MiB; the "
        f"estimated memory of the run (state pools, KV caches, working memory, the Mamba chunk scan; grows with "
        f"--max-running, --cache-entries, --k, --chunk-size, --token-budget and the models' sizes) at most "
        f"{MAX_SERVE_BYTES >> 30} GiB; --draft only with k > 0; an empty PATH is refused.",
    )
    run.add_argument("--model", metavar="PATH", type=_path_arg, help="target checkpoint (.safetensors; default: the bundled one)")
    run.add_argument("--draft", metavar="PATH", type=_path_arg,
                     help="draft checkpoint (default: the bundled one); refused with --k 0, which runs no draft")
    run.add_argument("--workload", metavar="PATH", type=_path_arg,
                     help=f"JSONL workload file, a regular file of at most {MAX_WORKLOAD_BYTES >> 20} MiB (default: the built-in workload)")
    run.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=64, help=f"built-in workload size, at most {MAX_REQUESTS} (default 64)")
    run.add_argument("--max-new-tokens", type=_positive, default=32,
                     help="built-in workload: max tokens per request, at most 512 - longest built-in prompt - (k + 1) (default 32)")
    run.add_argument("--k", type=_int_in(0, MAX_K), default=2, help=f"draft tokens per speculative iteration, 0 to {MAX_K}; 0 turns it off (default 2)")
    run.add_argument("--max-running", type=_positive, default=8, help="requests live at once (default 8; bounded by the memory estimate)")
    run.add_argument("--chunk-size", type=_positive, default=64, help="prefill chunk size in tokens (default 64)")
    run.add_argument("--token-budget", type=_positive, default=256, help="prefill tokens per step (default 256)")
    run.add_argument("--cache-entries", type=_positive, default=8, help="prefix-cache checkpoints (default 8; bounded by the memory estimate)")
    run.add_argument("--seed", type=_int, default=0, help="built-in workload seed (default 0)")
    run.add_argument("--arrivals", choices=ARRIVALS, default="bursts",
                     help=f"built-in workload: {BURST_SIZE} requests every {BURST_EVERY} steps, or one at a time 0-2 steps apart (default bursts)")
    run.add_argument("--lossless-sample", type=_int_in(0, MAX_REQUESTS), default=4,
                     help="requests re-run with plain greedy to check losslessness (default 4)")
    run.add_argument("--compare-mutable", action="store_true", help="also run the workload through the pre-fix mutable baseline")
    run.add_argument("--json", metavar="PATH", type=_path_arg,
                     help="also write the summary as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                     "replaced when the run ends ('-' for stdout)")

    ab = sub.add_parser("ab", help="the stale-init bug side by side: compiled pipeline vs. mutable baseline")
    ab.add_argument("--k", type=_int_in(1, MAX_K), default=2, help=f"draft tokens per iteration, at most {MAX_K} (default 2)")
    ab.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=12, help=f"requests, at most {MAX_REQUESTS} (default 12)")
    ab.add_argument("--max-new-tokens", type=_positive, default=24, help="tokens per request (default 24)")
    ab.add_argument("--max-running", type=_positive, default=4, help="requests live at once (default 4)")
    ab.add_argument("--draft-noise", type=float, default=None, help="relative weight noise of the draft (default 0.05)")
    ab.add_argument("--seed", type=_int, default=0, help="weights and workload seed (default 0)")
    ab.add_argument("--json", metavar="PATH", type=_path_arg,
                    help="also write the figures as JSON to PATH, a new or regular file (not a link, device or FIFO), "
                    "replaced when the run ends ('-' for stdout)")

    dump = sub.add_parser("dump", help="print the IR after every pass of the built-in scenario")
    dump.add_argument("--verify", type=int, choices=(0, 1, 2), default=2, help="verify level while dumping (default 2)")
    dump.add_argument("--spec", action="store_true", help="the speculative-decoding scenario (tiny hybrid model, k=2)")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="group", required=True, metavar="GROUP")
    bp = bsub.add_parser("pipeline", help="decode-step host cost: compiled pipeline vs. mutable baseline")
    bp.add_argument("--sizes", type=_int_in(1, MAX_BENCH_BATCH), nargs="+", default=[1, 64, 256, 1024],
                    help=f"batch sizes, each at most {MAX_BENCH_BATCH}")
    bp.add_argument("--repeats", type=_int_in(1, MAX_REPEATS), default=7, help=f"interleaved repeats per size, at most {MAX_REPEATS} (default 7)")
    bs = bsub.add_parser("serve", help="serving workload at k=0 and k=2: compiled pipeline vs. mutable baseline")
    bs.add_argument("--requests", type=_int_in(1, MAX_REQUESTS), default=24, help=f"built-in workload size, at most {MAX_REQUESTS} (default 24)")
    bs.add_argument("--max-new-tokens", type=_positive, default=24, help="max tokens per request (default 24)")
    bk = bsub.add_parser("kernels", help="state-pool kernels (init ops, selective_state_update)")
    bk.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    return p


def _cmd_dump(args: argparse.Namespace, console: Console) -> int:
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


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from backend.hybrid.checkpoint import default_draft, default_target, load_checkpoint
    from compiler.serve import LONGEST_BUILTIN_PROMPT, ServeConfig, builtin_workload, check_serving, load_workload, run

    cfg = ServeConfig(
        k=args.k, max_running=args.max_running, chunk_size=args.chunk_size, token_budget=args.token_budget,
        cache_entries=args.cache_entries, lossless_sample=args.lossless_sample,
    )
    # every check before anything runs: options, output path, models, memory, workload
    if args.draft is not None and args.k == 0:
        raise UsageError(f"--draft {_path(args.draft)} with --k 0: k = 0 turns speculative decoding off and runs no draft")
    if args.json is not None:
        _check_output("--json", args.json)
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
    with _Output("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=True,
        ) as progress:
            task = progress.add_task("serving", total=len(workload))
            summary = run(workload, target, draft, cfg, on_finish=lambda n: progress.update(task, completed=n),
                          compare_mutable=args.compare_mutable)
            if args.compare_mutable and draft is not None and cfg.k:
                from compiler.tools.compare_mutable import run_mutable

                progress.update(task, description="mutable baseline")
                summary = attrs.evolve(summary, mutable_baseline=run_mutable(workload, target, draft, cfg, fixed=False),
                                       mutable_baseline_fixed=run_mutable(workload, target, draft, cfg, fixed=True))
        title = f"batchc run: {len(workload)} requests, k={args.k}, {'bundled' if args.model is None else args.model} target"
        table = Table(title=title)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in summary.to_json().items():
            if key in ("samples", "pass_us_per_step", "mutable_baseline", "mutable_baseline_fixed", "lossless_ok") or value is None:
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
            ab = Table(title="compiled pipeline vs. mutable baseline, same workload and models")
            for h in ("run", "acceptance", "mean accepted len", "replays", "stale init ops run", "tokens/s"):
                ab.add_column(h, justify="right")
            ab.add_row("compiled", f"{summary.acceptance_rate:.3f}", f"{summary.mean_accepted_length:.2f}",
                       str(summary.replays_blocked), "0", f"{summary.tokens_per_s:.1f}")
            for name, m in (("mutable, pre-fix", mutable), ("mutable + upstream fix", fixed)):
                ab.add_row(name, f"{m.acceptance_rate:.3f}", f"{m.mean_accepted_length:.2f}",
                           str(m.replays), str(m.stale_ops_run), f"{m.tokens_per_s:.1f}")
            console.print(ab)
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


def _print_ab(args: argparse.Namespace, noise: float, result: dict[str, object], console: Console) -> None:
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


def _cmd_ab(args: argparse.Namespace, console: Console) -> int:
    from compiler.tools.ab import DRAFT_NOISE, run_ab

    noise = DRAFT_NOISE if args.draft_noise is None else args.draft_noise
    if not 0.0 <= noise < 10.0:
        raise BatchcError(f"--draft-noise must be in [0, 10), got {noise}")
    with _Output("--json", args.json) as output:  # claimed (and refused) here, before the run; written at its end
        with console.status("running plain greedy, compiled, mutable baseline (pre-fix and fixed), and the guarded baseline"):
            result = run_ab(
                k=args.k, requests=args.requests, max_new_tokens=args.max_new_tokens, max_running=args.max_running,
                draft_noise=noise, seed=args.seed,
            )
        _print_ab(args, noise, result, console)
        output.write(json.dumps(result, indent=2))
    runs = result["runs"]
    assert isinstance(runs, dict)
    compiled = runs["compiled"]
    return 0 if compiled["equals_greedy"] and compiled["replays"] == 0 and compiled["outstanding_tickets"] == 0 else 1


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
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
    from backend.bench_kernels import run as run_kernel_bench

    print(run_kernel_bench(device=args.device))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:  # pipes and CI logs: wide enough that the tables do not wrap
        console = Console(width=140)
    args = _parser().parse_args(argv)  # a bad command line: one line on stderr, SystemExit(2)
    try:
        settings_from_env()  # BATCHC_VERIFY, BATCHC_DUMP_DIR: refused here, before anything runs
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
