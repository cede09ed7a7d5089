"""``scripts/gpu-check``: one prepared check of batchc on a device, written to one JSON file.

Run from the repository root (``scripts/gpu-check --device cuda --out FILE``, or ``python -m
compiler.tools.gpu_check``). It first checks, with the standard library only, that what batchc and
the kernel tests import is there, and says in one line what is missing (``--wheels DIR`` installs
wheels brought along, ``pip install --no-deps --no-index``; ``--install`` also installs the checkout
with ``pip install --no-deps --no-build-isolation -e .``; neither is needed to run from the
checkout). Then it runs its sections in turn, each under its own time limit; a section that fails
or runs out of time is recorded as such (its error in one line) and the next one runs. The JSON
file is rewritten after every section, so a run cut short keeps what it measured.

Sections (``--device cuda``: the sizes below; ``--device cpu``: the same code at CI sizes, about a
minute, labelled as a CPU run whose figures say nothing about a GPU):

- ``kernel_tests``: pytest over ``tests/backend/kernels`` (on a CUDA machine the kernels compile for
  the device; on the CPU, Triton's interpreter runs one test file);
- ``kernels``: the device's copy bandwidth (``dst.copy_(src)`` of a large buffer), then each kernel's
  achieved bandwidth and its share of that copy bandwidth, beside a torch implementation of the same
  op on the same device: the init ops (clear, copy-on-write, snapshot) on a state pool of the
  Granite-4.0-H-350M shape at 8, 64 and 256 rows, the selective state update and the conv step at
  batch 1, 32 and 256;
- ``engine``: the Granite-4.0-H-350M shape with random weights (``backend.hf.config`` of
  ``backend.tools.hf_random``'s preset: no transformers needed) and a random draft head, its final
  norm zeroed so that every argmax is token 0 and the head's acceptance is 1.0 by construction (the
  arithmetic is unchanged): ``compiler.tools.bench_serve``'s sweep at batch 1 and 32, k = 0 and the
  ks tried, the compiled engine and the fixed baseline side by side (tokens/s, TTFT, TPOT, host
  ms per step, acceptance, iteration cost in decodes), and the best k per batch;
- ``iteration``: ``compiler.tools.bench_iteration`` with the head: each phase of a speculative
  iteration in decode equivalents;
- ``host_time``: k = 0 decode steps at batch 1 and 32 on the compiled engine: wall time per step,
  the device-busy time (the union of the device's kernel intervals in a ``torch.profiler`` trace, on
  a CUDA device; on the CPU the time inside the model's forwards, the host's own), the exposed host
  time (wall minus busy) per step and its share of a step, and the host readbacks per step
  (``backend.readback.HostReadbacks``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

__all__ = ["NEEDED", "SCHEMA", "main", "missing_modules"]

SCHEMA: Final = "batchc.gpu-check/1"
"""The ``schema`` field of the JSON file."""

NEEDED: Final = ("torch", "triton", "numpy", "attrs", "rich", "safetensors", "tokenizers", "typing_extensions", "pytest", "hypothesis", "xdist")
"""Modules the check imports (batchc's runtime ones it reaches, and the kernel tests' runner, whose
conftest declares a pytest-xdist hook)."""

ROOT: Final = Path(__file__).resolve().parents[2]


def missing_modules(names: Sequence[str] = NEEDED) -> list[str]:
    """Those of ``names`` that do not import here (found by ``importlib.util.find_spec``)."""
    return [n for n in names if importlib.util.find_spec(n) is None]


class SectionTimeout(Exception):
    """A section ran past its time limit."""


@contextmanager
def _limit(seconds: float) -> Iterator[None]:
    """Raise ``SectionTimeout`` in the block after ``seconds`` (SIGALRM; the main thread only)."""
    def fire(signum: int, frame: object) -> None:
        raise SectionTimeout(f"over its limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(device: str, ci: bool, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the figures were measured."""
    import torch

    dev = torch.device(device)
    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        triton_version = str(importlib.import_module("triton").__version__)
    status = _git("status", "--porcelain", "--untracked-files=no")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    from compiler.tools.docs_tables import machine

    now = datetime.datetime.now(datetime.UTC)
    return {
        # (the keys every docs/measurements file has, compiler.tools.docs_tables; wall_s and the load after: at the end)
        **machine(), "date_utc": now.strftime("%Y-%m-%d %H:%M UTC"), "uncommitted_changes": bool(status),
        "load_average_before": round(os.getloadavg()[0], 2), "load_average_after": None, "wall_s": None,
        "commit": _git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None, "device": str(dev), "device_name": name,
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["scripts/gpu-check", *argv]), "size": "ci" if ci else "full",
        "label": ("CPU run at CI sizes: checks that the script works end to end; its figures say nothing about a GPU" if dev.type == "cpu"
                  else f"{name}, full sizes" if not ci else f"{name}, CI sizes"),
    }


# ---- kernel tests ---------------------------------------------------------------------------


def section_kernel_tests(device: str, ci: bool, limit: float) -> dict[str, Any]:
    """pytest over the kernel tests in a child process (``-o addopts=``: no typeguard, one process)."""
    import torch

    on_cuda = torch.device(device).type == "cuda"
    paths = ["tests/backend/kernels"] if on_cuda and not ci else ["tests/backend/kernels/test_kernel_dispatch.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-n", "0", *paths]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if on_cuda:
        env.pop("TRITON_INTERPRET", None)  # (compiled on the device, never interpreted)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise SectionTimeout(f"pytest ran past {limit:.0f} s") from None
    tail = (done.stdout + done.stderr).strip().splitlines()
    summary = next((line for line in reversed(tail) if " in " in line and ("passed" in line or "failed" in line or "error" in line)), "")
    counts = {word: int(n) for n, word in (part.strip().split(" ")[:2] for part in summary.split(" in ")[0].split(",") if part.strip()[:1].isdigit())}
    failures = [line for line in tail if line.startswith(("FAILED", "ERROR"))][:20]
    return {"command": shlex.join(cmd[1:]), "compiled": on_cuda, "mode": "compiled for the device" if on_cuda else "Triton interpreter on the CPU",
            "returncode": done.returncode, "summary": summary, "counts": counts, "failures": failures,
            "seconds": time.perf_counter() - t0, "passed": done.returncode == 0}


# ---- kernels --------------------------------------------------------------------------------


def _timer(device: Any) -> Callable[[Callable[[], object]], float]:
    from backend.tools.bench_kernels import _time_ms

    return lambda fn: _time_ms(fn, device)


def section_kernels(device: str, ci: bool) -> dict[str, Any]:
    """Copy bandwidth, then each kernel against it and beside a torch implementation."""
    import torch

    from backend.kernels import torch_paths
    from backend.kernels.conv import causal_conv1d_update
    from backend.kernels.dispatch import use_triton
    from backend.kernels.init_rows import copy_rows, init_rows
    from backend.kernels.ssm import selective_state_update
    from backend.pool import MambaStatePool
    from ir.ids import PoolId

    dev = torch.device(device)
    time_ms = _timer(dev)
    config = _model_config(ci)
    layout = config.pool_layout()
    row = layout.row_bytes
    copy_bytes = (64 << 20) if ci else (2 << 30)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))
    copy_bw = 2 * copy_bytes / (copy_ms * 1e-3)
    rows_out: list[dict[str, Any]] = []

    def add(name: str, size: str, nbytes: int, kernel: Callable[[], object], reference: Callable[[], object], path: str) -> None:
        k_ms, r_ms = time_ms(kernel), time_ms(reference)
        k_bw, r_bw = nbytes / (k_ms * 1e-3), nbytes / (r_ms * 1e-3)
        rows_out.append({"kernel": name, "size": size, "path": path, "bytes": nbytes, "ms": k_ms, "gb_s": k_bw / 1e9,
                         "share_of_copy": k_bw / copy_bw, "torch_ms": r_ms, "torch_gb_s": r_bw / 1e9, "torch_share_of_copy": r_bw / copy_bw})

    def idx(lo: int, n: int) -> torch.Tensor:
        return torch.arange(lo, lo + n, dtype=torch.int64, device=dev)

    empty = idx(0, 0)
    for n in (8, 16) if ci else (8, 64, 256):
        pool = MambaStatePool(PoolId("check"), layout, 2 * n, device=dev)
        buf = pool.buffer
        path = "triton" if use_triton(buf) else "torch"
        a, b = idx(1, n), idx(n + 1, n)
        words = buf.view(torch.int64) if buf.shape[1] % 8 == 0 else buf
        add("init clear", f"{n} rows", n * row, lambda: init_rows(buf, a, empty, empty), lambda: words.index_fill_(0, a, 0), path)
        add("init cow", f"{n} rows", 2 * n * row, lambda: init_rows(buf, empty, a, b), lambda: words.index_copy_(0, b, words.index_select(0, a)), path)
        source = MambaStatePool(PoolId("capture"), layout, n, device=dev).buffer
        sw = source.view(torch.int64) if source.shape[1] % 8 == 0 else source
        s_idx = idx(1, n)
        add("init snapshot", f"{n} rows", 2 * n * row, lambda: copy_rows(buf, source, s_idx, b),
            lambda: words.index_copy_(0, b, sw.index_select(0, s_idx)), path)
    spec = layout.layers[0]
    H, P, N, G = config.nheads, config.head_dim, config.d_state, config.ngroups
    act = torch.float32
    for batch in (1, 4) if ci else (1, 32, 256):
        pool = MambaStatePool(PoolId("ssu"), type(layout)(layers=(spec,)), batch, device=dev)
        state, conv = pool.ssm_state(0), pool.conv_state(0)
        gen = torch.Generator(device="cpu").manual_seed(batch)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(device=dev, dtype=act)

        x, z, dt, B, C = rnd(batch, H, P), rnd(batch, H, P), rnd(batch, H), rnd(batch, G, N), rnd(batch, G, N)
        A, D, dt_bias = -rnd(H).abs() - 0.1, rnd(H), rnd(H)
        slots = idx(1, batch)
        path = "triton" if use_triton(x) else "torch"
        io = (3 * x.numel() + dt.numel() + B.numel() + C.numel()) * act.itemsize
        add("selective_state_update", f"batch {batch}", batch * 2 * spec.ssm_bytes + io,
            lambda: selective_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, slot_idx=slots, check_slots=False),
            lambda: torch_paths.selective_state_update(state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True, slot_idx=slots), path)
        xc = rnd(batch, config.conv_dim)
        w, bias = rnd(config.conv_dim, config.conv_width), rnd(config.conv_dim)
        add("conv step", f"batch {batch}", batch * 2 * spec.conv_bytes + 2 * xc.numel() * act.itemsize,
            lambda: causal_conv1d_update(xc, conv, w, bias, silu=True, slot_idx=slots, check_slots=False),
            lambda: torch_paths.causal_conv1d_update(xc, conv, w, bias, silu=True, slot_idx=slots), path)
    return {"copy": {"bytes": copy_bytes, "ms": copy_ms, "gb_s": copy_bw / 1e9, "what": "dst.copy_(src): bytes read + written over the time"},
            "state_row_bytes": row, "shape": _shape_note(config), "rows": rows_out,
            "note": "share_of_copy: achieved bandwidth (bytes read + written by the op over its median time) over the copy's; "
                    "torch_*: the same op written with torch indexing on the same device"}


# ---- the 350M shape, its head ---------------------------------------------------------------


def _model_config(ci: bool) -> Any:
    """Granite-4.0-H-350M's shape (``hf_random``'s preset read by batchc's own config parser), or at
    CI sizes the bundled draft's layers with a few heads."""
    import attrs

    from backend.hf.config import parse_config
    from backend.hybrid.presets import trained_draft
    from backend.tools.hf_random import PRESETS

    if ci:
        return attrs.evolve(trained_draft(), layers=("mamba", "attn", "mamba"), vocab=512)
    family, changes = PRESETS["granite-4.0-h-350m"]
    return parse_config(Path("granite-4.0-h-350m"), {"model_type": family, "num_local_experts": 0, **changes}).config


def _shape_note(c: Any) -> str:
    return (f"{c.n_mamba} Mamba layers of {len(c.layers)}, d_model {c.d_model}, nheads {c.nheads}, head_dim {c.head_dim}, d_state {c.d_state}, "
            f"ngroups {c.ngroups}, conv_dim {c.conv_dim}, vocab {c.vocab}")


def _models(device: str, ci: bool) -> tuple[Any, Any, Any]:
    """The target (final norm zeroed: every argmax is token 0), a small separate draft the
    baselines hold at k = 0, and a random draft head bound to the target; on ``device``."""
    import attrs
    import torch

    from backend.hybrid.head import HeadConfig, HeadModel
    from backend.hybrid.model import HybridModel
    from backend.hybrid.presets import trained_draft

    config = _model_config(ci)
    target = HybridModel.from_seed(config, 0)
    weights = dict(target.weights)
    weights["final_norm"] = torch.zeros_like(weights["final_norm"])
    target = HybridModel(config, weights).to(device)
    draft = HybridModel.from_seed(attrs.evolve(trained_draft(), vocab=config.vocab), 1).to(device)
    head_cfg = HeadConfig(d_model=config.d_model, vocab=config.vocab, layers=("mamba",), nheads=config.nheads, head_dim=config.head_dim,
                          d_state=config.d_state, ngroups=config.ngroups, attn_heads=2, attn_head_dim=32, mlp_hidden=2 * config.d_model)
    head = HeadModel.from_seed(head_cfg, target, 2)
    return target, draft, head


def section_engine(device: str, ci: bool) -> dict[str, Any]:
    """``bench serve``'s sweep on the compiled engine and the fixed baseline, with the head."""
    from compiler.tools.bench_serve import run_serve_bench, sweep_cases

    target, draft, head = _models(device, ci)
    sizes, ks = ((1, 4), (0, 2)) if ci else ((1, 32), (0, 2, 4))
    cases = sweep_cases(sizes, ks=ks, new_tokens=8 if ci else 64, drafts=("mtp",))
    rows = run_serve_bench(target, draft, cases, repeats=1 if ci else 3, engines=("compiled", "mutable-fixed"), head=head)
    out = [r.to_json() for r in rows]
    for r in out:
        r.pop("runs", None)
    best: dict[str, Any] = {}
    for b in sizes:
        for engine in ("compiled", "mutable-fixed"):
            mine = [r for r in out if r["max_running"] == b and r["engine"] == engine]
            k0 = next((r for r in mine if r["k"] == 0), None)
            top = max(mine, key=lambda r: float(str(r["tokens_per_s"])), default=None)
            if k0 is not None and top is not None:
                best[f"{engine} batch {b}"] = {"k": top["k"], "tokens_per_s": top["tokens_per_s"], "k0_tokens_per_s": k0["tokens_per_s"],
                                               "vs_k0": float(str(top["tokens_per_s"])) / float(str(k0["tokens_per_s"])) if k0["tokens_per_s"] else None}
    return {"shape": _shape_note(target.config), "head": "1 Mamba layer, random weights; the target's final norm zeroed: acceptance 1.0",
            "rows": out, "best_k": best,
            "note": "rows: compiler.tools.bench_serve ServeRow.to_json (median of the repeats); vs_mutable_fixed is compiled/fixed baseline"}


def section_iteration(device: str, ci: bool) -> dict[str, Any]:
    """The phases of one speculative iteration with the head, in decode equivalents."""
    from compiler.tools.bench_iteration import run_iteration_bench

    target, _, head = _models(device, ci)
    out: dict[str, Any] = {}
    for rows in (1, 4) if ci else (1, 32):
        report = run_iteration_bench(target, None, rows=rows, k=2, repeats=2 if ci else 5, head=head, context=16 if ci else 128)
        out[f"rows {rows}"] = report.to_json()
    return out


def _busy_seconds(fn: Callable[[], object], device: Any) -> tuple[float, float]:
    """``(wall, device busy)`` seconds of ``fn()``: on a CUDA device the union of its kernel intervals
    in a ``torch.profiler`` trace; elsewhere ``busy`` is ``nan`` (measured by the caller)."""
    import torch

    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, float("nan")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if str(e.device_type).endswith("CUDA"))
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return wall, busy * 1e-6  # (microseconds)


def section_host_time(device: str, ci: bool) -> dict[str, Any]:
    """Decode steps at k = 0: wall, device busy, exposed host time, readbacks per step."""
    import torch

    from backend.readback import HostReadbacks
    from compiler.engine import Engine
    from compiler.tools.timed import timed
    from ir.ids import RequestId

    dev = torch.device(device)
    target, _, _ = _models(device, ci)
    clock = timed(target) if dev.type == "cpu" else None  # (on the CPU the device-busy time is the forwards' own)
    model = clock if clock is not None else target
    out: dict[str, Any] = {}
    steps = 4 if ci else 32
    for batch in (1, 4) if ci else (1, 32):
        engine = Engine(model, None, k=0, capacity=batch + 2, kv_capacity=batch * 256, max_len=256)
        for i in range(batch):
            engine.admit(RequestId(i), list(range(10, 42)), max_new_tokens=steps + 8)
        for _ in range(64):  # (prefill every request first)
            if all(r.state.name == "RUNNING" for r in engine.requests):
                break
            engine.step()
        engine.step()  # (one decode step unmeasured)
        with HostReadbacks(device_only=dev.type != "cpu") as seen:
            engine.step()
        before = clock.seconds if clock is not None else 0.0
        wall, busy = _busy_seconds(lambda: [engine.step() for _ in range(steps)], dev)
        if dev.type == "cpu":
            busy = (clock.seconds if clock is not None else 0.0) - before
        engine.close()
        out[f"batch {batch}"] = {
            "steps": steps, "wall_ms_per_step": wall / steps * 1e3, "busy_ms_per_step": busy / steps * 1e3,
            "exposed_host_ms_per_step": (wall - busy) / steps * 1e3, "exposed_share": (wall - busy) / wall if wall > 0 else None,
            "readbacks_per_step": seen.count, "readback_sites": dict(seen.sites),
            "busy_is": ("the union of the device's kernel intervals (torch.profiler)" if dev.type == "cuda"
                        else "the time inside the model's forwards on the host (no device: the CPU runs both)"),
        }
    return out


SECTIONS: Final = ("kernel_tests", "kernels", "engine", "iteration", "host_time")
LIMITS: Final = {"kernel_tests": 150.0, "kernels": 60.0, "engine": 150.0, "iteration": 40.0, "host_time": 40.0}
"""Seconds per section on a GPU (7 minutes in all, start-up aside); at CI sizes each has 60 s."""


def _run_section(name: str, device: str, ci: bool, limit: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        with _limit(limit + 5 if name == "kernel_tests" else limit):
            if name == "kernel_tests":
                data = section_kernel_tests(device, ci, limit)
            else:
                data = {"kernels": section_kernels, "engine": section_engine, "iteration": section_iteration,
                        "host_time": section_host_time}[name](device, ci)
        status = "ok" if data.get("passed", True) else "failed"
        return {"status": status, "seconds": time.perf_counter() - t0, "limit_s": limit, "error": None, "data": data}
    except SectionTimeout as exc:
        return {"status": "timeout", "seconds": time.perf_counter() - t0, "limit_s": limit, "error": str(exc), "data": None}
    except Exception as exc:  # (recorded, and the next section runs: the check keeps going)
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {"status": "failed", "seconds": time.perf_counter() - t0, "limit_s": limit,
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({Path(where.filename).name}:{where.lineno})",
                "data": None}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n")
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` (strict JSON)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description="batchc's prepared check on a device: one JSON file")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: CI sizes, about a minute)")
    p.add_argument("--out", default=None, help="the JSON file to write (default gpu-check-<device>.json in the current directory)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="run these sections only")
    p.add_argument("--ci", action="store_true", help="CI sizes on any device (implied by --device cpu)")
    p.add_argument("--wheels", default=None, help="a folder of wheels to install first (pip install --no-deps --no-index)")
    p.add_argument("--install", action="store_true", help="also pip install --no-deps --no-build-isolation -e . (needs hatchling)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The check; exit 0 when every section ran ok, 1 when one failed or timed out, 2 on bad input
    or missing modules."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(args_list)
    pip = [sys.executable, "-m", "pip", "install", "--no-deps"]
    if args.wheels is not None:
        wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
        if not wheels:
            print(f"gpu-check: --wheels {args.wheels}: no .whl files there", file=sys.stderr)
            return 2
        subprocess.run([*pip, "--no-index", *wheels], check=False)
    if args.install:
        subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=False)
    missing = missing_modules([n for n in NEEDED if not (n == "triton" and args.device == "cpu")])
    if missing:
        print(f"gpu-check: missing modules: {', '.join(missing)} (bring their wheels and pass --wheels DIR)", file=sys.stderr)
        return 2
    import torch

    try:
        dev = torch.device(args.device)
    except RuntimeError:
        print(f"gpu-check: --device {args.device}: expected cpu, cuda or cuda:N", file=sys.stderr)
        return 2
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        print(f"gpu-check: --device {args.device}: no such device here (CUDA available: {torch.cuda.is_available()})", file=sys.stderr)
        return 2
    ci = args.ci or dev.type == "cpu"
    out = Path(args.out) if args.out is not None else Path(f"gpu-check-{str(dev).replace(':', '')}.json")
    started = time.perf_counter()
    doc: dict[str, Any] = {"schema": SCHEMA, "provenance": provenance(str(dev), ci, args_list), "sections": {}}
    _write(out, doc)
    ok = True
    for name in args.only or SECTIONS:
        limit = 60.0 if ci else LIMITS[name]
        print(f"gpu-check: {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        result = _run_section(name, str(dev), ci, limit)
        doc["sections"][name] = _finite(result)
        _write(out, doc)
        ok = ok and result["status"] == "ok"
        print(f"gpu-check: {name}: {result['status']} in {result['seconds']:.1f} s" + (f" ({result['error']})" if result["error"] else ""),
              file=sys.stderr, flush=True)
    doc["provenance"]["load_average_after"] = round(os.getloadavg()[0], 2)
    doc["provenance"]["wall_s"] = round(time.perf_counter() - started, 1)
    _write(out, doc)
    print(f"gpu-check: wrote {out}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
