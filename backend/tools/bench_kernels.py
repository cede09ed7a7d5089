"""Benchmark of the state-pool kernels: fused init rows against the layer-major baseline, and the
decode ``selective_state_update``, in achieved bandwidth against the device's HBM peak.

``run(device=..., small=...) -> str`` is the entry point (``batchc bench kernels`` prints it;
``python -m backend.tools.bench_kernels`` too).

- On a GPU (default sizes): a pool shaped like a real hybrid model (48 Mamba layers, nheads 128,
  head_dim 64, d_state 128, ngroups 8, conv width 4, fp32 SSM state, bf16 conv state: ~204 MB per
  slot), 64 COW + 64 clear rows (fewer if the device memory cannot hold them; the table says how
  many), timed with ``triton.testing.do_bench`` (median, L2 flushed between runs). The layer-major
  baseline runs on its own ``[L, slots, ...]`` tensors after the slot-major pool is freed, so only
  one pool is resident at a time. ``selective_state_update`` runs at batch 1, 64 and 256 over one
  layer of a slot-major pool with bf16 activations; slot validation is skipped in the timed call
  (``check_slots=False``), as the executor validates once per forward.
- On a CPU (or ``small=True``): the same measurements at toy sizes through the torch paths (the
  per-row reference for init rows, ``backend.kernels.torch_paths`` for the SSM update), labelled as
  such; absolute figures there say nothing about a GPU.
- On a CPU also: the torch path of each decode/verify/commit kernel against the per-row reference
  it replaced, at 8 and 32 rows, and one decode and one verify (T=3) of the bundled target at 8
  rows with either in the wrappers; one thread, the two timed in turn within each repeat after a
  warm-up, medians.

Bytes moved: a clear writes one row, a COW reads and writes one; the SSM update reads and writes
its state per row plus its inputs and outputs (x, z, y, dt, B, C; the per-head parameters are
negligible).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Final
from unittest import mock

import attrs
import torch

from backend import reference
from backend.kernels import commit as commit_module
from backend.kernels import conv as conv_module
from backend.kernels import ssm as ssm_module
from backend.kernels import torch_paths
from backend.kernels.dispatch import CPU_KERNELS_ENV, use_triton
from backend.kernels.init_rows import init_rows
from backend.kernels.ssm import selective_state_update
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from ir.ids import PoolId

# Peak HBM bandwidth in bytes/s, matched by substring against torch.cuda.get_device_name();
# first match wins, so more specific names come first ("GH200" before "H200").
PEAK_BANDWIDTH: Final[tuple[tuple[str, float], ...]] = (
    ("GH200", 4.0e12),
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 3.35e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("RTX 4090", 1.008e12),
)


@attrs.frozen(kw_only=True)
class BenchShape:
    layers: int
    nheads: int
    head_dim: int
    d_state: int
    ngroups: int
    width: int
    n_ops: int  # COW rows, and as many clear rows
    batches: tuple[int, ...]

    @property
    def conv_dim(self) -> int:
        return self.nheads * self.head_dim + 2 * self.ngroups * self.d_state

    def spec(self) -> MambaLayerSpec:
        return MambaLayerSpec(
            conv_dim=self.conv_dim,
            kernel_width=self.width,
            nheads=self.nheads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            conv_dtype=torch.bfloat16,
            ssm_dtype=torch.float32,
        )


REAL: Final = BenchShape(layers=48, nheads=128, head_dim=64, d_state=128, ngroups=8, width=4, n_ops=64, batches=(1, 64, 256))
SMALL: Final = BenchShape(layers=4, nheads=8, head_dim=16, d_state=16, ngroups=2, width=4, n_ops=4, batches=(1, 8, 32))


@attrs.frozen(kw_only=True)
class BenchRow:
    name: str
    path: str  # "triton" or "torch"
    size: str
    nbytes: int
    ms: float


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    """``(bytes/s or None, label)`` for ``device``."""
    if device.type != "cuda":
        return None, "CPU: no HBM peak"
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BANDWIDTH:
        if key in name:
            return peak, f"{name}, peak HBM {peak / 1e12:.2f} TB/s (table entry {key!r})"
    return None, f"{name}, peak HBM unknown (not in the table)"


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _memory_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return int(pages * page_size * 0.5)


def _bench_init(shape: BenchShape, device: torch.device, on_gpu: bool) -> tuple[list[BenchRow], str]:
    layout = PoolLayout(layers=(shape.spec(),) * shape.layers)
    row_bytes = layout.row_bytes
    # Resident at once: the pool (3n + 1 rows) or the layer-major copy plus its gather temporary (4n + 1).
    fit = _memory_budget(device) // row_bytes
    n = max(1, min(shape.n_ops, (fit - 1) // 4))
    capacity = 3 * n
    clear = torch.arange(1, n + 1, device=device)
    src = torch.arange(n + 1, 2 * n + 1, device=device)
    dst = torch.arange(2 * n + 1, 3 * n + 1, device=device)
    note = (
        f"pool: {shape.layers} Mamba layers, nheads {shape.nheads}, head_dim {shape.head_dim}, d_state {shape.d_state}, "
        f"ngroups {shape.ngroups}, conv_dim {shape.conv_dim}, width {shape.width}; SSM fp32, conv bf16; "
        f"row {row_bytes / 2**20:.1f} MiB, capacity {capacity}; {n} COW + {n} clear rows"
    )
    nbytes = 3 * n * row_bytes  # n row writes (clear) + n reads and n writes (COW)

    def fused() -> float:  # the pool lives only while it is timed
        buf = MambaStatePool(PoolId("bench"), layout, capacity, device=device).buffer
        run = init_rows if on_gpu else reference.init_rows_reference
        ms = _time_ms(lambda: run(buf, clear, src, dst), device)
        assert torch.equal(buf[int(dst[0])], buf[int(src[0])])
        return ms

    fused_ms, path = fused(), "triton" if on_gpu else "torch"
    if device.type == "cuda":
        torch.cuda.empty_cache()

    spec = shape.spec()
    slots = capacity + 1
    def layer_major() -> float:  # the state tensors live only while they are timed
        states = [
            torch.zeros((shape.layers, slots, *spec.conv_shape), dtype=spec.conv_dtype, device=device),
            torch.zeros((shape.layers, slots, *spec.ssm_shape), dtype=spec.ssm_dtype, device=device),
        ]
        return _time_ms(lambda: reference.init_rows_layer_major(states, clear, src, dst), device)

    baseline_ms = layer_major()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    size = f"{n} cow + {n} clear"
    return [
        BenchRow(name="init_rows (slot-major, 1 launch)", path=path, size=size, nbytes=nbytes, ms=fused_ms),
        BenchRow(name="init layer-major (2 ops / tensor)", path="torch", size=size, nbytes=nbytes, ms=baseline_ms),
    ], note


def _bench_ssu(shape: BenchShape, device: torch.device, on_gpu: bool) -> list[BenchRow]:
    spec = shape.spec()
    act = torch.bfloat16
    H, P, N, G = shape.nheads, shape.head_dim, shape.d_state, shape.ngroups
    pool = MambaStatePool(PoolId("bench-ssm"), PoolLayout(layers=(spec,)), max(shape.batches), device=device)
    state = pool.ssm_state(0)
    A = -torch.rand(H, device=device) - 0.1
    D, dt_bias = torch.randn(H, device=device), torch.randn(H, device=device)
    rows = []
    for batch in shape.batches:
        x = torch.randn(batch, H, P, device=device, dtype=act)
        z = torch.randn(batch, H, P, device=device, dtype=act)
        dt = torch.randn(batch, H, device=device, dtype=act)
        B = torch.randn(batch, G, N, device=device, dtype=act)
        C = torch.randn(batch, G, N, device=device, dtype=act)
        slot_idx = torch.randperm(pool.capacity, device=device)[:batch] + 1
        io = (3 * x.numel() + dt.numel() + B.numel() + C.numel()) * act.itemsize
        nbytes = batch * 2 * spec.ssm_bytes + io

        def step() -> torch.Tensor:
            if on_gpu:
                return selective_state_update(
                    state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, slot_idx=slot_idx, check_slots=False
                )
            return torch_paths.selective_state_update(
                state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True, slot_idx=slot_idx
            )

        ms = _time_ms(step, device)
        path = "triton" if on_gpu else "torch"
        rows.append(BenchRow(name="selective_state_update", path=path, size=f"batch {batch}", nbytes=nbytes, ms=ms))
    return rows


TORCH_PATH_ROWS: Final = (8, 32)
MODEL_ROWS: Final = (8,)
VERIFY_T: Final = 3


@attrs.frozen(kw_only=True)
class PathRow:
    """One torch-path measurement: the per-row reference against the batched path."""

    name: str
    rows: int
    reference_ms: float
    batched_ms: float


def _interleaved_ms(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median milliseconds of each of ``fns``: all run twice to warm up, then in turn ``repeats`` times."""
    for fn in [*fns, *fns]:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples, strict=True):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(times) for times in samples]


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _bench_torch_paths(shape: BenchShape, repeats: int) -> list[PathRow]:
    """Each decode/verify/commit kernel: per-row reference vs ``torch_paths``, float32 states."""
    spec = attrs.evolve(shape.spec(), conv_dtype=torch.float32)
    H, P, N, G, dim, width = shape.nheads, shape.head_dim, shape.d_state, shape.ngroups, shape.conv_dim, shape.width
    gen = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen)

    A, D, dt_bias = -torch.rand(H, generator=gen) - 0.1, randn(H), randn(H)
    weight, bias = randn(dim, width), randn(dim)
    rows_out = []
    for rows in TORCH_PATH_ROWS:
        pool = MambaStatePool(PoolId("bench-torch-path"), PoolLayout(layers=(spec,)), rows)
        pool.buffer.zero_()
        conv, ssm = pool.conv_state(0), pool.ssm_state(0)
        slots = torch.randperm(rows, generator=gen) + 1
        accept = torch.randint(0, VERIFY_T, (rows,), generator=gen)  # serving commits every row (CommitBatch: accept_pos >= 0)

        def ssm_in(*lead: int) -> tuple[torch.Tensor, ...]:
            return randn(*lead, H, P), randn(*lead, H) * 0.5, randn(*lead, G, N), randn(*lead, G, N), randn(*lead, H, P)

        x1, dt1, B1, C1, z1 = ssm_in(rows)
        xT, dtT, BT, CT, zT = ssm_in(rows, VERIFY_T)
        cx1, cxT = randn(rows, dim), randn(rows, VERIFY_T, dim)
        ssm_states = randn(rows, VERIFY_T, *spec.ssm_shape)
        cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            (
                "selective_state_update",
                lambda: reference.selective_state_update_reference(ssm, x1, dt1, A, B1, C1, D, z=z1, dt_bias=dt_bias, dt_softplus=True, slot_idx=slots),
                lambda: torch_paths.selective_state_update(ssm, x1, dt1, A, B1, C1, D, z=z1, dt_bias=dt_bias, dt_softplus=True, slot_idx=slots),
            ),
            (
                f"selective_state_verify (T={VERIFY_T})",
                lambda: reference.selective_state_verify_reference(ssm, xT, dtT, A, BT, CT, D, z=zT, dt_bias=dt_bias, dt_softplus=True, slot_idx=slots),
                lambda: torch_paths.selective_state_verify(ssm, xT, dtT, A, BT, CT, D, z=zT, dt_bias=dt_bias, dt_softplus=True, slot_idx=slots),
            ),
            (
                "causal_conv1d_update",
                lambda: reference.causal_conv1d_update_reference(cx1, conv, weight, bias, silu=True, slot_idx=slots),
                lambda: torch_paths.causal_conv1d_update(cx1, conv, weight, bias, silu=True, slot_idx=slots),
            ),
            (
                f"causal_conv1d_verify (T={VERIFY_T})",
                lambda: reference.causal_conv1d_verify_reference(cxT, conv, weight, bias, silu=True, slot_idx=slots),
                lambda: torch_paths.causal_conv1d_verify(cxT, conv, weight, bias, silu=True, slot_idx=slots),
            ),
            (
                "commit_accepted (SSM state)",
                lambda: reference.commit_reference(ssm, ssm_states, accept, slots),
                lambda: torch_paths.commit_accepted(ssm, ssm_states, accept, slots),
            ),
        ]
        for name, ref_fn, batched_fn in cases:
            ref_ms, batched_ms = _interleaved_ms([ref_fn, batched_fn], repeats)
            rows_out.append(PathRow(name=name, rows=rows, reference_ms=ref_ms, batched_ms=batched_ms))
    return rows_out


@contextlib.contextmanager
def _reference_paths() -> Iterator[None]:
    """The wrappers' torch path swapped for the per-row references (what it was before batching)."""
    per_row = types.SimpleNamespace(
        selective_state_update=reference.selective_state_update_reference,
        selective_state_verify=reference.selective_state_verify_reference,
        causal_conv1d_update=reference.causal_conv1d_update_reference,
        causal_conv1d_verify=reference.causal_conv1d_verify_reference,
        commit_accepted=reference.commit_reference,
    )
    with contextlib.ExitStack() as stack:
        for module in (ssm_module, conv_module, commit_module):
            stack.enter_context(mock.patch.object(module, "torch_paths", per_row))
        yield


def _bench_model(repeats: int) -> list[PathRow]:
    """One decode and one verify of the bundled target over prefilled rows, either path in the wrappers."""
    from backend.hybrid.checkpoint import default_target

    model = default_target()
    prompt = 16
    out = []
    for rows in MODEL_ROWS:
        pool, kv, table = model.new_pool(rows), model.new_kv_cache(rows * (prompt + VERIFY_T) + 1), model.new_token_table(rows + 1, 64)
        slots = torch.arange(1, rows + 1)
        tokens = torch.randint(0, model.config.vocab, (rows, prompt + VERIFY_T), generator=torch.Generator().manual_seed(0))
        locs = torch.arange(1, rows * (prompt + VERIFY_T) + 1).view(rows, prompt + VERIFY_T)
        model.extend(
            pool, kv, table, slots=slots, cu_seqlens=torch.arange(0, rows * prompt + 1, prompt),
            prefix_lens=torch.zeros(rows, dtype=torch.int64), input_ids=tokens[:, :prompt].reshape(-1),
            positions=torch.arange(prompt).repeat(rows), kv_locs=locs[:, :prompt].reshape(-1),
        )
        positions = torch.arange(prompt, prompt + VERIFY_T).expand(rows, VERIFY_T).contiguous()

        def decode() -> object:
            return model.decode(
                pool, kv, table, slots=slots, input_ids=tokens[:, prompt], positions=positions[:, 0], kv_locs=locs[:, prompt]
            )

        def verify() -> object:
            return model.verify(
                pool, kv, table, slots=slots, input_ids=tokens[:, prompt:], positions=positions,
                kv_locs=locs[:, prompt:].contiguous(),
            )

        for name, fn in (("bundled target decode", decode), (f"bundled target verify (T={VERIFY_T})", verify)):

            def per_row(fn: Callable[[], object] = fn) -> object:
                with _reference_paths():
                    return fn()

            ref_ms, batched_ms = _interleaved_ms([per_row, fn], repeats)
            out.append(PathRow(name=name, rows=rows, reference_ms=ref_ms, batched_ms=batched_ms))
    return out


def format_path_rows(rows: list[PathRow]) -> list[str]:
    header = f"{'torch path':<40}{'rows':>6}{'per-row ms':>13}{'batched ms':>13}{'batched/per-row':>18}"
    lines = [header, "-" * len(header)]
    for r in rows:
        ratio = r.batched_ms / r.reference_ms if r.reference_ms > 0 else float("nan")
        lines.append(f"{r.name:<40}{r.rows:>6}{r.reference_ms:>13.3f}{r.batched_ms:>13.3f}{ratio:>18.2f}")
    return lines


def format_rows(rows: list[BenchRow], peak: float | None) -> list[str]:
    header = f"{'kernel':<36}{'path':<8}{'size':<20}{'MB moved':>10}{'time ms':>11}{'GB/s':>10}{'% peak':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        gbps = r.nbytes / (r.ms * 1e-3) / 1e9 if r.ms > 0 else float("inf")
        pct = f"{100 * gbps * 1e9 / peak:.1f}" if peak else "n/a"
        lines.append(
            f"{r.name:<36}{r.path:<8}{r.size:<20}{r.nbytes / 1e6:>10.1f}{r.ms:>11.3f}{gbps:>10.1f}{pct:>9}"
        )
    return lines


def run(*, device: str | None = None, small: bool | None = None, repeats: int = 15) -> str:
    """Run the benchmark and return the report text; ``repeats`` is the number of interleaved runs of
    each torch-path measurement (CPU only)."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = dev.type == "cuda"
    shape = SMALL if (small if small is not None else not on_gpu) else REAL
    peak, peak_label = peak_bandwidth(dev)
    t0 = time.perf_counter()
    init_rows_, note = _bench_init(shape, dev, on_gpu)
    ssu_rows = _bench_ssu(shape, dev, on_gpu)
    fused, baseline = init_rows_
    lines = [f"batchc kernel bench on {dev}: {peak_label}", note, ""]
    lines += format_rows([fused, baseline, *ssu_rows], peak)
    lines.append("")
    lines.append(
        f"init: layer-major baseline / fused slot-major = {baseline.ms / fused.ms:.2f}x "
        f"(same bytes counted for both; the baseline also gathers COW sources into a temporary)"
    )
    if not on_gpu:
        lines.append(
            "CPU run: torch paths at toy sizes. Absolute GPU figures (bandwidth vs HBM peak, "
            "targets: init_rows >= 85% of peak and >= 2x layer-major, selective_state_update >= 70%) need a GPU."
        )
        # the model runs through the wrappers, which take Triton's interpreter when asked to on a CPU
        wrappers_on_torch = not use_triton(torch.empty(0, device=dev))
        with _single_thread():
            path_rows = _bench_torch_paths(shape, repeats) + (_bench_model(repeats) if wrappers_on_torch else [])
        lines.append("")
        lines += format_path_rows(path_rows)
        lines.append(
            f"per-row: the references in backend.reference (the wrappers' CPU path before torch_paths); batched: "
            f"backend.kernels.torch_paths. One thread, medians of {repeats} interleaved runs after a warm-up; "
            f"float32 states; the target rows run the whole forward with either path in the wrappers."
        )
        if not wrappers_on_torch:
            lines.append(f"bundled target rows skipped: {CPU_KERNELS_ENV}=1 sends the wrappers to Triton's interpreter.")
    elif peak is None:
        lines.append("peak HBM bandwidth of this device is unknown: add it to PEAK_BANDWIDTH for % of peak.")
    lines.append(f"({time.perf_counter() - t0:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
