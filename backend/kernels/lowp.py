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

The same library carries the CPU's float32 kernels of a decode step: ``f32_linear`` (products of 2
to 16 rows), ``mamba_decode_step`` (a Mamba layer's conv, scan, gate and gated norm in one call, the
states advanced in place in the pool) and ``add_rms_norm`` (a residual add and the norm after it).
A decode step of a small model at a few rows is otherwise a few thousand torch ops whose dispatch
costs more than their arithmetic (on the Granite-4.0-H-350M shape at one row, about 30 ms of a
115 ms step beside 75 ms of products).
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

from ir.columns import check_int

__all__ = [
    "F32_KERNEL_ROWS", "KERNEL_MAX_ROWS", "LOWP_DTYPES", "add_rms_norm", "f32_kernel_enabled", "f32_linear", "fused_decode_enabled",
    "kernel_status", "lowp_linear", "mamba_decode_step",
]

LOWP_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}
"""The 16-bit weight storage dtypes, by name."""
KERNEL_MAX_ROWS = 16
"""Most rows of ``x`` that go through the C kernel; more go through a widened float32 product."""
F32_KERNEL_ROWS = range(2, KERNEL_MAX_ROWS + 1)
"""The row counts of ``x`` that ``f32_linear`` sends through the C kernel (the rule, with its figures,
is in ``f32_linear``'s docstring); other row counts go through torch's ``x @ w.T``."""

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_LIBS = ("-lm",)
_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
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
/* one row, eight weight rows, with the next eight rows prefetched over this tile's k steps: at short
   rows (K <= 1024) the eight streams of a tile are too short for the hardware prefetcher to ramp up
   (measured on the 350M shape's 768-wide rows: 11-12 GB/s of weights without, 13-14 with; at 2048
   the prefetch costs, so longer rows go without) */
#define TILE_PF(BF)                                                                                            \
static void tile_1_8pf_##BF(const float *x, const uint16_t *w, int64_t K, float *out, int64_t n0) {           \
    __m256 acc[8];                                                                                             \
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();                                                  \
    const uint16_t *wr = w + n0 * K;                                                                           \
    const char *next = (const char *)(wr + 8 * K);                                                             \
    int64_t steps = K / 8, per = steps ? (16 * K + steps - 1) / steps : 0, q = 0;                              \
    int64_t k = 0;                                                                                             \
    for (; k + 8 <= K; k += 8) {                                                                               \
        for (int64_t end = q + per; q < end; q += 64) _mm_prefetch(next + q, _MM_HINT_T0);                     \
        __m256 xv = _mm256_loadu_ps(x + k);                                                                    \
        for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(xv, wload(wr + r * K + k, BF), acc[r]);          \
    }                                                                                                          \
    for (int r = 0; r < 8; r++) {                                                                              \
        float s = hsum(acc[r]);                                                                                \
        for (int64_t kk = k; kk < K; kk++) s += x[kk] * wscalar(wr[r * K + kk], BF);                           \
        out[n0 + r] = s;                                                                                       \
    }                                                                                                          \
}
TILE_PF(0)
TILE_PF(1)
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
            if (K <= 1024) for (; n + 8 <= n1; n += 8) tile_1_8pf_##BF(xb, w, K, ob, n);                       \
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

/* ---- one Mamba2 decode step of a layer, float32, in place in a slot-indexed pool ----
   For each row b whose slot s = slots[b] >= 0, from proj[b] = z | xBC | dt (the in_proj output):
   the conv state of s shifted by xBC and xBC's conv, bias and silu; dt (+ dt_bias, softplus, clamp);
   the SSM state of s advanced by one token (decay exp(dt * A), A = -exp(A_log)) and read out with C;
   y = (y + D x) silu(z); then the gated RMSNorm in `groups` groups, times norm_w: out[b]. A padding
   row (slot -1) leaves the pool alone and gets zeros. scratch: B x conv_dim floats. */
static inline float silu1(float v) { return v / (1.0f + expf(-v)); }

static void ssm_head(const float *xbc, const float *zr, float dtv, float A, float Dh, int has_d, float *st,
                     int64_t ss_p, int P, int N, const float *Bv, const float *Cv, float *yo) {
    float decay = expf(dtv * A);
    __m256 dv = _mm256_set1_ps(decay);
    for (int p = 0; p < P; p++) {
        float xv = xbc[p], dx = dtv * xv;
        __m256 dxv = _mm256_set1_ps(dx), acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float *sp = st + p * ss_p;
        int n = 0;
        for (; n + 16 <= N; n += 16) {
            __m256 s0 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(sp + n), dv), _mm256_mul_ps(dxv, _mm256_loadu_ps(Bv + n)));
            __m256 s1 = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(sp + n + 8), dv), _mm256_mul_ps(dxv, _mm256_loadu_ps(Bv + n + 8)));
            _mm256_storeu_ps(sp + n, s0);
            _mm256_storeu_ps(sp + n + 8, s1);
            acc0 = _mm256_fmadd_ps(s0, _mm256_loadu_ps(Cv + n), acc0);
            acc1 = _mm256_fmadd_ps(s1, _mm256_loadu_ps(Cv + n + 8), acc1);
        }
        float y = hsum(_mm256_add_ps(acc0, acc1));
        for (; n < N; n++) {
            float s = sp[n] * decay + dx * Bv[n];
            sp[n] = s;
            y += s * Cv[n];
        }
        if (has_d) y += Dh * xv;
        if (zr) y *= silu1(zr[p]);
        yo[p] = y;
    }
}

int batchc_mamba_decode(int64_t B, const int64_t *slots, const float *proj, int64_t ldp,
                         float *conv, int64_t cs0, int64_t cs1, int64_t cs2, const float *conv_w, const float *conv_b, int W,
                         float *ssm, int64_t ss0, int64_t ss1, int64_t ss2,
                         const float *A_log, const float *D, const float *dt_bias, int softplus, int clamp, float dt_min,
                         float dt_max, int H, int P, int N, int G, const float *norm_w, int groups, float eps,
                         float *scratch, float *out, int64_t ldo, int threads, int64_t num_slots) {
    int64_t d_inner = (int64_t)H * P, conv_dim = d_inner + 2 * (int64_t)G * N;
    for (int64_t b = 0; b < B; b++) {  /* every slot -1 or in range and named once, before anything is written */
        if (slots[b] < -1 || slots[b] >= num_slots) return 1;
        if (slots[b] >= 0) for (int64_t c = 0; c < b; c++) if (slots[c] == slots[b]) return 2;
    }
    for (int64_t b = 0; b < B; b++) {
        int64_t s = slots[b];
        if (s < 0) continue;
        const float *xin = proj + b * ldp + d_inner;
        float *xo = scratch + b * conv_dim;
        float *cs = conv + s * cs0;
        for (int64_t c = 0; c < conv_dim; c++) {
            float *cc = cs + c * cs1;
            const float *w = conv_w + c * W;
            float acc = 0.0f;
            for (int j = 0; j < W - 1; j++) acc += cc[j * cs2] * w[j];
            acc += xin[c] * w[W - 1];
            for (int j = 0; j < W - 2; j++) cc[j * cs2] = cc[(j + 1) * cs2];
            cc[(W - 2) * cs2] = xin[c];
            if (conv_b) acc += conv_b[c];
            xo[c] = silu1(acc);
        }
    }
    int hpg = H / G;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            int64_t s = slots[b];
            if (s < 0) continue;
            const float *pr = proj + b * ldp, *xo = scratch + b * conv_dim;
            float dtv = pr[d_inner + conv_dim + h];
            if (dt_bias) dtv += dt_bias[h];
            if (softplus) dtv = dtv > 20.0f ? dtv : log1pf(expf(dtv));
            if (clamp) dtv = dtv < dt_min ? dt_min : (dtv > dt_max ? dt_max : dtv);
            int g = h / hpg;
            ssm_head(xo + (int64_t)h * P, pr + (int64_t)h * P, dtv, -expf(A_log[h]), D ? D[h] : 0.0f, D != 0,
                     ssm + s * ss0 + h * ss1, ss2, P, N, xo + d_inner + (int64_t)g * N, xo + d_inner + ((int64_t)G + g) * N,
                     out + b * ldo + (int64_t)h * P);
        }
    }
    int64_t width = d_inner / groups;
    for (int64_t b = 0; b < B; b++) {
        float *o = out + b * ldo;
        if (slots[b] < 0) {
            for (int64_t i = 0; i < d_inner; i++) o[i] = 0.0f;
            continue;
        }
        for (int64_t g = 0; g < groups; g++) {
            float *og = o + g * width;
            float ss = 0.0f;
            for (int64_t i = 0; i < width; i++) ss += og[i] * og[i];
            float scale = 1.0f / sqrtf(ss / (float)width + eps);
            for (int64_t i = 0; i < width; i++) og[i] = og[i] * scale * norm_w[g * width + i];
        }
    }
    return 0;
}

/* out[b] = rms_norm(h[b] (+= add[b] first, in place, when add is given)) * w, over K; rows of stride ld */
void batchc_add_rms_norm(float *h, int64_t ldh, const float *add, int64_t lda, float scale_add, int64_t B, int64_t K,
                         const float *w, float eps, float *out, int64_t ldo) {
    for (int64_t b = 0; b < B; b++) {
        float *hr = h + b * ldh;
        if (add) {
            const float *ar = add + b * lda;
            if (scale_add == 1.0f) for (int64_t i = 0; i < K; i++) hr[i] += ar[i];
            else for (int64_t i = 0; i < K; i++) hr[i] += ar[i] * scale_add;
        }
        float ss = 0.0f;
        for (int64_t i = 0; i < K; i++) ss += hr[i] * hr[i];
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        float *o = out + b * ldo;
        for (int64_t i = 0; i < K; i++) o[i] = hr[i] * r * w[i];
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
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS + _LIBS)).encode()).hexdigest()[:16]
    d = _cache_dir() / "kernels"
    lib = d / f"lowp-{key}.so"
    if not lib.exists():
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src = Path(tmp) / "lowp.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / "lowp.so"
            done = subprocess.run([cc, *_FLAGS, str(src), "-o", str(out), *_LIBS], capture_output=True, text=True, timeout=300)
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
    md = handle.batchc_mamba_decode
    c_int, c_float = ctypes.c_int, ctypes.c_float
    md.argtypes = [i64, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr, c_int, ptr, i64, i64, i64, ptr, ptr, ptr, c_int, c_int,
                   c_float, c_float, c_int, c_int, c_int, c_int, ptr, c_int, c_float, ptr, ptr, i64, c_int, i64]
    md.restype = c_int
    rn = handle.batchc_add_rms_norm
    rn.argtypes = [ptr, i64, ptr, i64, c_float, i64, i64, ptr, c_float, ptr, i64]
    rn.restype = None
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
    torch's ``x @ w.T`` (MKL). Measured at one thread on a 2-core AVX2 EPYC (Zen 3), weights
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


def fused_decode_enabled() -> bool:
    """Whether a float32 decode step on the CPU may run each Mamba layer's conv, scan and gated norm
    as one call of this module's C kernel (``mamba_decode_step``) and the norms between layers through
    ``add_rms_norm``: not when the environment variable ``BATCHC_FUSED_DECODE`` is ``0`` (a debugging
    and benchmarking switch, read on each forward), nor where the kernel cannot run (``kernel_status``)."""
    return os.environ.get("BATCHC_FUSED_DECODE", "1") != "0" and _load() is not None


def _real(name: str, value: object) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is an int or float (a bool is neither here)."""
    if type(value) not in (float, int):
        raise TypeError(f"{name} must be a real number, got {value!r}")


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def mamba_decode_step(
    proj: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    *,
    slots: torch.Tensor,
    ngroups: int,
    dt_softplus: bool,
    dt_clamp: tuple[float, float] | None,
    norm_groups: int,
    eps: float,
) -> torch.Tensor | None:
    """One Mamba2 decode step of a layer for every row of ``proj [rows, d_inner + conv_dim + nheads]``
    (the layer's ``in_proj`` output: ``z | xBC | dt``), in one call of this module's C kernel, or
    ``None`` where it cannot run (a tensor not float32, off the CPU or not laid out for it, a state of
    another dtype, autograd on, ``fused_decode_enabled`` false): the caller then runs its torch path.

    What it computes, per row whose ``slots`` entry is a slot (int64, ``-1`` for a padding row, no slot
    twice): the slot's conv state shifted by ``xBC`` and ``xBC``'s causal conv
    (``conv_weight [conv_dim, width]``, the bias, silu); ``dt`` plus ``dt_bias``, softplus'd when
    ``dt_softplus`` and clamped to ``dt_clamp``; the slot's SSM state ``[nheads, head_dim, d_state]``
    advanced in place by one token (decay ``exp(dt * -exp(A_log))``, input ``dt x B``) and read out
    with ``C``, plus ``D x``, gated by ``silu(z)``; then the gated RMSNorm over ``norm_groups`` groups,
    times ``norm_weight``: ``[rows, d_inner]``, ready for ``out_proj``. A padding row leaves the pool
    untouched and gets zeros. The arithmetic is ``backend.reference``'s, in float32, with the C
    library's ``expf``/``log1pf`` and its own order of sums: equal to the torch path to float32
    rounding, not bit for bit (tested against it); each row's result is its own, whatever rows are
    beside it.

    Shapes that do not fit one another (``proj``'s width, ``conv_weight``, ``conv_state``, the
    per-head and per-channel vectors, ``ngroups``, ``norm_groups``) and ``slots`` that are not ``-1``
    or distinct slots of the pool raise ``ValueError`` naming the tensor, before the pool is written;
    ``ngroups``/``norm_groups`` that are not ints (a bool, float or str) and ``eps`` or a clamp bound
    that is not a real number raise ``IRValidationError``/``TypeError`` naming the argument."""
    if (proj.dim() != 2 or proj.stride(1) != 1 or proj.dtype != torch.float32 or proj.device.type != "cpu"
            or not all(_f32(t) for t in (conv_weight, conv_bias, A_log, D, dt_bias, norm_weight))
            or ssm_state.dtype != torch.float32 or ssm_state.device.type != "cpu" or ssm_state.dim() != 4 or ssm_state.stride(3) != 1
            or conv_state.dtype != torch.float32 or conv_state.device.type != "cpu" or slots.dtype != torch.int64
            or slots.device.type != "cpu" or not slots.is_contiguous() or torch.is_grad_enabled() and proj.requires_grad
            or not fused_decode_enabled()):
        return None
    ngroups = check_int("mamba_decode_step", "ngroups", ngroups)
    norm_groups = check_int("mamba_decode_step", "norm_groups", norm_groups)
    for name, value in (("eps", eps), *(() if dt_clamp is None else (("dt_clamp", dt_clamp[0]), ("dt_clamp", dt_clamp[1])))):
        _real(name, value)
    rows = proj.shape[0]
    nheads, head_dim, d_state = ssm_state.shape[1:]
    d_inner = nheads * head_dim
    if not (ngroups > 0 and nheads % ngroups == 0):
        raise ValueError(f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    conv_dim = d_inner + 2 * ngroups * d_state
    width = conv_weight.shape[1] if conv_weight.dim() == 2 else 0
    if not (conv_weight.dim() == 2 and conv_weight.shape[0] == conv_dim and 2 <= width <= 4):
        raise ValueError(f"conv_weight must be [{conv_dim}, width] with width in [2, 4], got {tuple(conv_weight.shape)}")
    if not (conv_state.dim() == 3 and conv_state.shape[1] == conv_dim and conv_state.shape[2] == width - 1
            and conv_state.shape[0] == ssm_state.shape[0]):
        raise ValueError(f"conv_state must be [{ssm_state.shape[0]}, {conv_dim}, {width - 1}], got {tuple(conv_state.shape)}")
    if proj.shape[1] != d_inner + conv_dim + nheads:
        raise ValueError(f"proj must be [rows, {d_inner + conv_dim + nheads}], got {tuple(proj.shape)}")
    for name, t, n in (("A_log", A_log, nheads), ("D", D, nheads), ("dt_bias", dt_bias, nheads),
                       ("conv_bias", conv_bias, conv_dim), ("norm_weight", norm_weight, d_inner), ("slots", slots, rows)):
        if t is not None and (t.dim() != 1 or t.shape[0] != n):
            raise ValueError(f"{name} must be [{n}], got {list(t.shape)}")
    if not (norm_groups > 0 and d_inner % norm_groups == 0):
        raise ValueError(f"norm_groups {norm_groups} does not divide the {d_inner} channels")
    assert _lib is not None
    out = torch.empty((rows, d_inner), dtype=torch.float32)
    scratch = torch.empty((rows, conv_dim), dtype=torch.float32)
    lo, hi = dt_clamp if dt_clamp is not None else (0.0, 0.0)
    bad = _lib.batchc_mamba_decode(
        rows, slots.data_ptr(), proj.data_ptr(), proj.stride(0),
        conv_state.data_ptr(), *conv_state.stride(), conv_weight.data_ptr(), conv_bias.data_ptr() if conv_bias is not None else None, width,
        ssm_state.data_ptr(), *ssm_state.stride()[:3],
        A_log.data_ptr(), D.data_ptr() if D is not None else None, dt_bias.data_ptr() if dt_bias is not None else None,
        int(dt_softplus), int(dt_clamp is not None), lo, hi, nheads, head_dim, d_state, ngroups,
        norm_weight.data_ptr(), norm_groups, eps, scratch.data_ptr(), out.data_ptr(), d_inner, torch.get_num_threads(), ssm_state.shape[0],
    )
    if bad:
        raise ValueError(f"slots must be -1 or distinct slots in [0, {ssm_state.shape[0]}), got {slots.tolist()}")
    return out


def add_rms_norm(h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float, scale: float = 1.0) -> torch.Tensor | None:
    """``h += add * scale`` in place (when ``add`` is given), then ``rms_norm(h, weight, eps)``, for a
    float32 ``[rows, width]`` ``h`` of a few rows (at most ``KERNEL_MAX_ROWS``) on the CPU, in one call of
    this module's C kernel; ``None`` where it does not run (the caller runs torch). Float32 throughout;
    equal to torch's to float32 rounding (another order of the sum of squares). A ``weight`` or ``add``
    whose shape does not fit ``h`` raises ``ValueError``, ``h`` untouched."""
    if (h.dim() != 2 or h.shape[0] > KERNEL_MAX_ROWS or h.stride(1) != 1 or h.dtype != torch.float32 or h.device.type != "cpu"
            or not _f32(weight) or h.requires_grad
            or add is not None and (add.dim() != 2 or add.stride(1) != 1 or add.dtype != torch.float32 or add.device.type != "cpu")
            or not fused_decode_enabled()):
        return None
    _real("eps", eps)
    _real("scale", scale)
    if weight.dim() != 1 or weight.shape[0] != h.shape[1]:
        raise ValueError(f"weight must be [{h.shape[1]}], got {list(weight.shape)}")
    if add is not None and add.shape != h.shape:
        raise ValueError(f"add must be {list(h.shape)} like h, got {list(add.shape)}")
    assert _lib is not None
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    _lib.batchc_add_rms_norm(h.data_ptr(), h.stride(0), add.data_ptr() if add is not None else None, add.stride(0) if add is not None else 0,
                             scale, h.shape[0], h.shape[1], weight.data_ptr(), eps, out.data_ptr(), out.stride(0))
    return out
