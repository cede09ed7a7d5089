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
- On a CPU (or ``small=True``): the same measurements at toy sizes through the torch reference
  paths, labelled as such; absolute figures there say nothing about a GPU.

Bytes moved: a clear writes one row, a COW reads and writes one; the SSM update reads and writes
its state per row plus its inputs and outputs (x, z, y, dt, B, C; the per-head parameters are
negligible).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Final

import attrs
import torch

from backend import reference
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
            return reference.selective_state_update_reference(
                state, x, dt, A, B, C, D, z=z, dt_bias=dt_bias, dt_softplus=True, slot_idx=slot_idx
            )

        ms = _time_ms(step, device)
        path = "triton" if on_gpu else "torch"
        rows.append(BenchRow(name="selective_state_update", path=path, size=f"batch {batch}", nbytes=nbytes, ms=ms))
    return rows


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


def run(*, device: str | None = None, small: bool | None = None) -> str:
    """Run the benchmark and return the report text."""
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
            "CPU run: torch reference paths at toy sizes. Absolute GPU figures (bandwidth vs HBM peak, "
            "targets: init_rows >= 85% of peak and >= 2x layer-major, selective_state_update >= 70%) need a GPU."
        )
    elif peak is None:
        lines.append("peak HBM bandwidth of this device is unknown: add it to PEAK_BANDWIDTH for % of peak.")
    lines.append(f"({time.perf_counter() - t0:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
