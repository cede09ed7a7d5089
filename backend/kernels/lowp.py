"""Half-precision weights, float32 activations: ``x @ W.T`` with ``W`` stored as float16 or bfloat16.

A decode step of a small model on a CPU reads every weight once and does little arithmetic on it, so
its time is the bytes of its weights over the memory bandwidth (``batchc bench decode`` measures
both). Weights stored in 16 bits halve those bytes; activations, states, norms and logits stay
float32. What that needs is a matrix product that reads the 16-bit weights at memory speed and
widens them in registers. torch's own CPU kernels do not, on a processor without native bf16/fp16
arithmetic (AVX-512 BF16, AMX, AVX512-FP16): measured with torch 2.13 on an AVX2 EPYC at one thread,
``F.linear`` of one row in float16 or bfloat16 takes as long as in float32 (it widens in scalar
code, about 10 GB/s of weights), a float16 ``x @ W`` on ``[in, out]`` storage is 10-25x slower, and
converting the weight to float32 for each product writes four bytes for every two it saves; a
``torch.compile`` fused widen-and-reduce was no faster than float32 either (docs/guides/cpu-decode.md).

So this module carries a small C kernel (AVX2, FMA and F16C: ``_mm256_cvtph_ps`` widens eight
float16s, a 16-bit shift eight bfloat16s) that streams each weight row once per tile of batch rows,
widening in registers and accumulating in float32: a dot product of ``[rows, in]`` float32 with
``[out, in]`` row-major 16-bit storage. It is compiled on first use with the system's C compiler
(``cc``, ``-O3 -mavx2 -mfma -mf16c -fopenmp``) into a cache directory (``BATCHC_CACHE_DIR``, else
``$XDG_CACHE_HOME/batchc``, else ``~/.cache/batchc``; keyed by a hash of the source and flags) and
loaded with ``ctypes``; nothing is downloaded. It splits the output columns over
``torch.get_num_threads()`` OpenMP threads.

Where the kernel cannot run (a CPU without AVX2/FMA/F16C, no C compiler, a tensor off the CPU) and
for products of more than ``KERNEL_MAX_ROWS`` rows (a prefill, where the matrix library's float32
product wins and widening the weight once is cheap beside it), ``lowp_linear`` widens the weight to
float32 and multiplies with torch: the same arithmetic up to the order of the sums. ``kernel_status``
says which it is.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["F32_KERNEL_ROWS", "KERNEL_MAX_ROWS", "LOWP_DTYPES", "f32_kernel_enabled", "f32_linear", "kernel_status", "lowp_linear"]

LOWP_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""The 16-bit weight storage dtypes, by name."""
KERNEL_MAX_ROWS = 16
"""Most rows of ``x`` that go through the C kernel; more go through a widened float32 product."""
F32_KERNEL_ROWS = range(2, KERNEL_MAX_ROWS + 1)
"""The row counts of ``x`` that ``f32_linear`` sends through the C kernel (the rule, with its figures,
is in ``f32_linear``'s docstring); other row counts go through torch's ``x @ w.T``."""

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

/* eight 16-bit weights widened to float32: float16 by F16C, bfloat16 by a 16-bit shift */
static inline __attribute__((always_inline)) __m256 wload(const uint16_t *p, int bf) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) float wscalar(uint16_t v, int bf) {
    if (bf) { union { uint32_t u; float f; } c; c.u = (uint32_t)v << 16; return c.f; }
    return _cvtsh_ss(v);
}

static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* out[b, n0 .. n0+RR) for the BB rows at x: RR weight rows streamed once, each widened vector used BB
   times; one function per (BB, RR, dtype), so the accumulators are fixed-size arrays held in registers */
#define TILE(BB, RR, BF)                                                                                       \
static void tile_##BB##_##RR##_##BF(const float *x, int64_t ldx, const uint16_t *w, int64_t K, float *out,   \
                                    int64_t ldo, int64_t n0) {                                                 \
    __m256 acc[BB][RR];                                                                                        \
    for (int b = 0; b < BB; b++) for (int r = 0; r < RR; r++) acc[b][r] = _mm256_setzero_ps();                 \
    const uint16_t *wr = w + n0 * K;                                                                           \
    int64_t k = 0;                                                                                             \
    for (; k + 8 <= K; k += 8) {                                                                               \
        __m256 wv[RR];                                                                                         \
        for (int r = 0; r < RR; r++) wv[r] = wload(wr + r * K + k, BF);                                        \
        for (int b = 0; b < BB; b++) {                                                                         \
            __m256 xv = _mm256_loadu_ps(x + b * ldx + k);                                                      \
            for (int r = 0; r < RR; r++) acc[b][r] = _mm256_fmadd_ps(xv, wv[r], acc[b][r]);                    \
        }                                                                                                      \
    }                                                                                                          \
    for (int b = 0; b < BB; b++) {                                                                             \
        for (int r = 0; r < RR; r++) {                                                                         \
            float s = hsum(acc[b][r]);                                                                         \
            for (int64_t kk = k; kk < K; kk++) s += x[b * ldx + kk] * wscalar(wr[r * K + kk], BF);             \
            out[b * ldo + n0 + r] = s;                                                                         \
        }                                                                                                      \
    }                                                                                                          \
}
#define TILES(BF) TILE(8, 1, BF) TILE(4, 2, BF) TILE(4, 1, BF) TILE(2, 4, BF) TILE(2, 1, BF) TILE(1, 8, BF) TILE(1, 1, BF) \
static void columns_##BF(const float *x, int64_t ldx, int64_t B, const uint16_t *w, int64_t K, float *out,    \
                         int64_t ldo, int64_t n0, int64_t n1) {                                                \
    for (int64_t b = 0; b < B;) {                                                                              \
        int64_t left = B - b, n = n0;                                                                          \
        const float *xb = x + b * ldx;                                                                         \
        float *ob = out + b * ldo;                                                                             \
        if (left >= 8) {                                                                                       \
            for (; n < n1; n++) tile_8_1_##BF(xb, ldx, w, K, ob, ldo, n);                                      \
            b += 8;                                                                                            \
        } else if (left >= 4) {                                                                                \
            for (; n + 2 <= n1; n += 2) tile_4_2_##BF(xb, ldx, w, K, ob, ldo, n);                              \
            for (; n < n1; n++) tile_4_1_##BF(xb, ldx, w, K, ob, ldo, n);                                      \
            b += 4;                                                                                            \
        } else if (left >= 2) {                                                                                \
            for (; n + 4 <= n1; n += 4) tile_2_4_##BF(xb, ldx, w, K, ob, ldo, n);                              \
            for (; n < n1; n++) tile_2_1_##BF(xb, ldx, w, K, ob, ldo, n);                                      \
            b += 2;                                                                                            \
        } else {                                                                                               \
            for (; n + 8 <= n1; n += 8) tile_1_8_##BF(xb, ldx, w, K, ob, ldo, n);                              \
            for (; n < n1; n++) tile_1_1_##BF(xb, ldx, w, K, ob, ldo, n);                                      \
            b += 1;                                                                                            \
        }                                                                                                      \
    }                                                                                                          \
}
TILES(0)
TILES(1)

/* out[B, N] (row stride ldo) = x[B, K] (row stride ldx) @ w[N, K]^T, w row-major 16-bit */
void batchc_lowp_linear(const float *x, int64_t ldx, int64_t B, const uint16_t *w, int64_t N, int64_t K,
                        float *out, int64_t ldo, int bf, int threads) {
    const int64_t block = 64;
    int64_t blocks = (N + block - 1) / block;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t n0 = i * block, n1 = n0 + block < N ? n0 + block : N;
        if (bf) columns_1(x, ldx, B, w, K, out, ldo, n0, n1);
        else columns_0(x, ldx, B, w, K, out, ldo, n0, n1);
    }
}

/* ---- float32 weights, [in, out] row-major: an axpy-form product ----
   out[b, n .. n+8NV) for R rows, k in [k0,k1): acc = first ? 0 : out; acc = fma(x[b,k], W[k, n..], acc) */
#define FT(R, NV)                                                                                              \
static void ft_##R##_##NV(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t k0, int64_t k1,  \
                          float *out, int64_t ldo, int64_t n, int first) {                                    \
    __m256 acc[R][NV];                                                                                         \
    _Pragma("GCC unroll 8") for (int b = 0; b < R; b++) _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) \
        acc[b][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + b * ldo + n + 8 * v);                 \
    const float *wk = w + k0 * ldw + n;                                                                        \
    for (int64_t k = k0; k < k1; k++, wk += ldw) {                                                             \
        __m256 wv[NV];                                                                                         \
        _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) wv[v] = _mm256_loadu_ps(wk + 8 * v);                                      \
        _Pragma("GCC unroll 8") for (int b = 0; b < R; b++) {                                                \
            __m256 xb = _mm256_broadcast_ss(x + b * ldx + k);                                                  \
            _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) acc[b][v] = _mm256_fmadd_ps(xb, wv[v], acc[b][v]);                    \
        }                                                                                                      \
    }                                                                                                          \
    _Pragma("GCC unroll 8") for (int b = 0; b < R; b++) _Pragma("GCC unroll 8") for (int v = 0; v < NV; v++) _mm256_storeu_ps(out + b * ldo + n + 8 * v, acc[b][v]); \
}
#define FTS(NV) FT(1,NV) FT(2,NV) FT(3,NV) FT(4,NV) FT(5,NV) FT(6,NV) FT(7,NV) FT(8,NV)
FTS(1) FTS(2) FTS(3)
typedef void (*ftfn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t, int);
static const ftfn FTAB[4][9] = {
    {0},
    {0, ft_1_1, ft_2_1, ft_3_1, ft_4_1, ft_5_1, ft_6_1, ft_7_1, ft_8_1},
    {0, ft_1_2, ft_2_2, ft_3_2, ft_4_2, ft_5_2, ft_6_2, ft_7_2, ft_8_2},
    {0, ft_1_3, ft_2_3, ft_3_3, ft_4_3, ft_5_3, ft_6_3, ft_7_3, ft_8_3},
};

/* the last m < 8 columns at n, one row at a time, masked: the same fma sequence as the tiles */
static void ft_tail(const float *x, int64_t ldx, int64_t B, const float *w, int64_t ldw, int64_t k0, int64_t k1,
                    float *out, int64_t ldo, int64_t n, int64_t m, int first) {
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t b = 0; b < B; b++) {
        __m256 acc = first ? _mm256_setzero_ps() : _mm256_maskload_ps(out + b * ldo + n, mask);
        const float *wk = w + k0 * ldw + n;
        for (int64_t k = k0; k < k1; k++, wk += ldw)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(x + b * ldx + k), _mm256_maskload_ps(wk, mask), acc);
        _mm256_maskstore_ps(out + b * ldo + n, mask, acc);
    }
}

static void fcols(const float *x, int64_t ldx, int64_t B, const float *w, int64_t ldw, int64_t K, float *out,
                  int64_t ldo, int64_t n0, int64_t n1, int rmax, int nv, int64_t kb) {
    int64_t cols = 8 * nv;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        int64_t k1 = k0 + kb < K ? k0 + kb : K;
        int first = k0 == 0;
        int64_t n = n0;
        for (; n + cols <= n1; n += cols)
            for (int64_t b = 0; b < B; b += rmax) {
                int64_t r = B - b < rmax ? B - b : rmax;
                FTAB[nv][r](x + b * ldx, ldx, w, ldw, k0, k1, out + b * ldo, ldo, n, first);
            }
        for (; n + 8 <= n1; n += 8)
            for (int64_t b = 0; b < B; b += 8) {
                int64_t r = B - b < 8 ? B - b : 8;
                FTAB[1][r](x + b * ldx, ldx, w, ldw, k0, k1, out + b * ldo, ldo, n, first);
            }
        if (n < n1) ft_tail(x, ldx, B, w, ldw, k0, k1, out, ldo, n, n1 - n, first);
    }
}

/* out[B, N] (row stride ldo) = x[B, K] (row stride ldx) @ w[K, N] (row stride ldw), float32. Every
   output element is the same chain of fmas over k = 0 .. K-1 whatever B, the tile or the thread count,
   so a row's result does not depend on the rows beside it. Tiles: 4 rows x 24 columns, 8 k at a time,
   for B <= 8; 6 rows x 16 columns, 16 k at a time, above. Columns are split in blocks whose
   accumulators (B x block floats) stay in L2; inside a block, each k-step streams kb weight rows. */
void batchc_f32_linear(const float *x, int64_t ldx, int64_t B, const float *w, int64_t ldw, int64_t N, int64_t K,
                       float *out, int64_t ldo, int threads) {
    int rmax = B <= 8 ? 4 : 6, nv = B <= 8 ? 3 : 2;
    int64_t kb = B <= 8 ? 8 : 16, cols = 8 * nv;
    int64_t block = (65536 / (B > 0 ? B : 1) + cols - 1) / cols * cols;
    int64_t per = (N + threads - 1) / threads;
    if (threads > 1 && per < block) block = (per + cols - 1) / cols * cols;
    int64_t blocks = (N + block - 1) / block;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t n0 = i * block, n1 = n0 + block < N ? n0 + block : N;
        fcols(x, ldx, B, w, ldw, K, out, ldo, n0, n1, rmax, nv, kb);
    }
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None


def _cpu_has_kernel_isa() -> str | None:
    """``None`` when this CPU has AVX2, FMA and F16C (``/proc/cpuinfo``), else why not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo ({exc.strerror})"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def _cache_dir() -> Path:
    env = os.environ.get("BATCHC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "batchc"


def _build() -> ctypes.CDLL:
    """The kernel's shared library, compiled into the cache directory unless it is there already."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    d = _cache_dir() / "kernels"
    lib = d / f"lowp-{key}.so"
    if not lib.exists():
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src = Path(tmp) / "lowp.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / "lowp.so"
            done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise OSError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
            os.replace(out, lib)  # atomic: a concurrent build of the same key writes the same bytes
    handle = ctypes.CDLL(str(lib))
    fn = handle.batchc_lowp_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = None
    f32 = handle.batchc_f32_linear
    f32.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
    f32.restype = None
    return handle


def _load() -> ctypes.CDLL | None:
    global _lib, _status
    if _status is None:
        with _lock:
            if _status is None:
                why = _cpu_has_kernel_isa()
                if why is None:
                    try:
                        _lib = _build()
                    except (OSError, subprocess.SubprocessError) as exc:
                        why = f"the kernel did not build: {exc}"
                _status = "c-avx2-f16c" if why is None else f"torch (widen to float32): {why}"
    return _lib


def kernel_status() -> str:
    """Which path ``lowp_linear`` takes for a decode step's few rows on the CPU: ``"c-avx2-f16c"``
    (the kernel of this module), or ``"torch (widen to float32): WHY"`` (building it on first call)."""
    _load()
    assert _status is not None
    return _status


def lowp_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in float32 for float32 ``x`` of shape ``[..., in]`` and a float16 or bfloat16 ``w``
    of shape ``[out, in]``: ``[..., out]`` float32 (the module docstring says which path runs)."""
    if x.dtype != torch.float32 or w.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"lowp_linear takes float32 x and float16/bfloat16 w, got {x.dtype} and {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"lowp_linear: x {tuple(x.shape)} does not multiply w.T of w {tuple(w.shape)}")
    n, k = w.shape
    rows = x.numel() // k if k else 0
    if rows == 0 or rows > KERNEL_MAX_ROWS or x.device.type != "cpu" or w.device.type != "cpu" or _load() is None:
        return x @ w.float().T
    assert _lib is not None
    w = w.contiguous()
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((rows, n), dtype=torch.float32)
    _lib.batchc_lowp_linear(x2.data_ptr(), x2.stride(0), rows, w.data_ptr(), n, k, out.data_ptr(), n,
                            int(w.dtype == torch.bfloat16), torch.get_num_threads())
    return out.reshape(*x.shape[:-1], n)


def f32_kernel_enabled() -> bool:
    """Whether ``f32_linear`` may use the C kernel: not when the environment variable
    ``BATCHC_F32_KERNEL`` is ``0`` (a debugging and benchmarking switch, read on each call), nor
    where the kernel cannot run (``kernel_status``)."""
    return os.environ.get("BATCHC_F32_KERNEL", "1") != "0" and _load() is not None


def f32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for float32 ``x [..., in]`` and float32 ``w [out, in]`` stored as
    ``backend.hybrid.weights.matmul_layout`` stores it (``w.T`` a contiguous ``[in, out]`` matrix).

    Rule: ``x`` of 2 to 16 rows (``F32_KERNEL_ROWS``) on the CPU, without autograd, goes through this
    module's C kernel, an axpy-form product that streams ``w.T`` a few rows at a time, its output
    tiles (4 rows x 24 columns up to 8 rows, 6 x 16 above) held in registers; everything else (one
    row, a prefill's many rows, other dtypes, devices or layouts, ``BATCHC_F32_KERNEL=0``) is
    torch's ``x @ w.T`` (MKL). Measured at one thread on the 2-core AVX2 EPYC of issue 47, weights
    cycled through copies larger than the L3 cache, medians of interleaved runs, MKL's time over the
    kernel's for the Granite-4.0-H-350M shapes (``in -> out``) at 2 / 4 / 8 / 16 rows: in_proj
    768->3376 1.55 / 2.41 / 1.75 / 1.35; MLP up or gate 768->2048 1.44 / 2.38 / 1.58 / 1.06;
    MLP down 2048->768 1.45 / 1.91 / 1.27 / 1.12; out_proj 1536->768 1.75 / 1.81 / 1.40 / 1.31;
    q or o 768->768 1.41 / 1.76 / 1.32 / 1.28; k or v 768->256 1.17 / 0.95 / 0.87 / 0.99; the LM head
    768->100352 1.91 / 2.62 / 1.69 / 0.89 (before the column blocks that keep 16 rows' accumulators
    in L2). At one row the kernel was 0.91-1.13x MKL, so one row stays with MKL. MKL at 2-16 rows
    reads the weights at 4-15 GB/s where one row reads them at 14-21 GB/s; the kernel keeps the
    weight stream near the one-row rate.

    The kernel computes each output element as one chain of fused multiply-adds over ``in`` in
    order, whatever the number of rows, the tiles or the threads: bit for bit the same row of output
    for a row of ``x`` whatever rows it is batched with, within 2 to 16 rows; not bit for bit MKL's
    (another order of the sums), and a one-row product (MKL) may differ from the same row's in a
    batch in the last bits."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if (rows not in F32_KERNEL_ROWS or x.dtype != torch.float32 or w.dtype != torch.float32 or w.dim() != 2
            or x.shape[-1] != w.shape[1] or x.device.type != "cpu" or w.device.type != "cpu"
            or not w.T.is_contiguous() or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            or not f32_kernel_enabled()):
        return x @ w.T
    assert _lib is not None
    n, k = w.shape
    x2 = x.reshape(rows, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((rows, n), dtype=torch.float32)
    _lib.batchc_f32_linear(x2.data_ptr(), x2.stride(0), rows, w.data_ptr(), n, n, k, out.data_ptr(), n, torch.get_num_threads())
    return out.reshape(*x.shape[:-1], n)
