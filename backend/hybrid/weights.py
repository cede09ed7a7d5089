"""Weights of the reference hybrid model: a flat ``dict[str, torch.Tensor]`` with stable names.

Names (``i`` is the layer index in the pattern; matrices are ``[out, in]``, applied as ``x @ W.T``)::

    embed                          [vocab, d_model]
    layers.{i}.norm                [d_model]              pre-mixer RMSNorm
    layers.{i}.mixer.in_proj       [d_inner + conv_dim + nheads, d_model]   (mamba: z, xBC, dt)
    layers.{i}.mixer.conv_weight   [conv_dim, conv_width]
    layers.{i}.mixer.conv_bias     [conv_dim]
    layers.{i}.mixer.dt_bias       [nheads]
    layers.{i}.mixer.A_log         [nheads]               A = -exp(A_log)
    layers.{i}.mixer.D             [nheads]
    layers.{i}.mixer.norm          [d_inner]              gated RMSNorm weight
    layers.{i}.mixer.out_proj      [d_model, d_inner]
    layers.{i}.mixer.q_proj        [attn_heads * attn_head_dim, d_model]    (attn)
    layers.{i}.mixer.{k,v}_proj    [kv_heads * attn_head_dim, d_model]
    layers.{i}.mixer.o_proj        [d_model, attn_heads * attn_head_dim]
    layers.{i}.mlp_norm            [d_model]              pre-MLP RMSNorm (block "mixer_mlp")
    layers.{i}.mlp.gate_proj       [mlp_hidden, d_model]  (mlp_kind "swiglu")
    layers.{i}.mlp.up_proj         [mlp_hidden, d_model]
    layers.{i}.mlp.down_proj       [d_model, mlp_hidden]
    final_norm                     [d_model]
    lm_head                        [vocab, d_model]       (absent with tie_embeddings: embed is used)

With ``block="mixer_mlp"`` every layer has a mixer and an MLP; with ``block="single"`` a layer of
kind ``"mlp"`` has ``layers.{i}.norm`` and ``layers.{i}.mlp.*`` only, and the others no MLP.

Initialisation (``init_weights``) is deterministic in the seed (drawn on the CPU in float32 in
sorted-name order, then moved), and scaled so the residual stream stays near unit RMS: input
matrices ``N(0, 1/fan_in)``, output matrices (``out_proj``, ``o_proj``, ``down_proj``) further
divided by ``sqrt(2 * n_layers)``, embeddings ``N(0, 1)``, ``lm_head`` ``N(0, 4/d_model)`` (logits
of std ~2 so that argmax margins are not dominated by noise), Mamba2's usual ``A`` in ``[1, 16]``
and ``dt`` in ``[1e-3, 1e-1]`` (through ``dt_bias = softplus^-1(dt)``), ``D = 1``, norms ``1``.
"""

from __future__ import annotations

import math

import torch

from backend.hybrid.config import HybridConfig

__all__ = ["Weights", "check_weights", "init_weights", "matmul_layout", "perturb", "projections", "weight_shapes", "with_weight_dtype"]

Weights = dict[str, torch.Tensor]
"""A model's tensors by name (the names ``weight_shapes`` lists)."""

_OUTPUT_MATRICES = ("mixer.out_proj", "mixer.o_proj", "mlp.down_proj")


def weight_shapes(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape for ``config`` (the exact key set of a valid weight dict)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab, c.d_model)}
    mlp_layers = set(c.mlp_layers)
    for i, kind in enumerate(c.layers):
        p = f"layers.{i}"
        shapes[f"{p}.norm"] = (c.d_model,)
        if kind == "mamba":
            shapes[f"{p}.mixer.in_proj"] = (c.in_proj_dim, c.d_model)
            shapes[f"{p}.mixer.conv_weight"] = (c.conv_dim, c.conv_width)
            shapes[f"{p}.mixer.conv_bias"] = (c.conv_dim,)
            shapes[f"{p}.mixer.dt_bias"] = (c.nheads,)
            shapes[f"{p}.mixer.A_log"] = (c.nheads,)
            shapes[f"{p}.mixer.D"] = (c.nheads,)
            shapes[f"{p}.mixer.norm"] = (c.d_inner,)
            shapes[f"{p}.mixer.out_proj"] = (c.d_model, c.d_inner)
        elif kind == "attn":
            shapes[f"{p}.mixer.q_proj"] = (c.attn_dim, c.d_model)
            shapes[f"{p}.mixer.k_proj"] = (c.kv_dim, c.d_model)
            shapes[f"{p}.mixer.v_proj"] = (c.kv_dim, c.d_model)
            shapes[f"{p}.mixer.o_proj"] = (c.d_model, c.attn_dim)
        if i in mlp_layers:
            if c.block == "mixer_mlp":
                shapes[f"{p}.mlp_norm"] = (c.d_model,)
            if c.mlp_kind == "swiglu":
                shapes[f"{p}.mlp.gate_proj"] = (c.mlp_hidden, c.d_model)
            shapes[f"{p}.mlp.up_proj"] = (c.mlp_hidden, c.d_model)
            shapes[f"{p}.mlp.down_proj"] = (c.d_model, c.mlp_hidden)
    shapes["final_norm"] = (c.d_model,)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.vocab, c.d_model)
    return shapes


def check_weights(config: HybridConfig, weights: Weights) -> None:
    """``ValueError`` unless ``weights`` has exactly the names and shapes of ``config``, on one
    device, in one floating dtype, but for float32 weights whose matrices of ``projections(config)``
    are stored in one 16-bit dtype (``with_weight_dtype``)."""
    shapes = weight_shapes(config)
    missing = sorted(shapes.keys() - weights.keys())
    extra = sorted(weights.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing[:6]}, unexpected {extra[:6]}")
    wrong = [f"{n}: {tuple(weights[n].shape)} != {s}" for n, s in shapes.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ValueError(f"weight shapes do not match the config: {wrong[:6]}")
    devices = {t.device for t in weights.values()}
    stored = set(projections(config))
    dtypes = {t.dtype for n, t in weights.items() if n not in stored}
    half = {t.dtype for n, t in weights.items() if n in stored} - dtypes
    if half and (dtypes != {torch.float32} or len(half) != 1 or not half <= {torch.float16, torch.bfloat16}):
        raise ValueError(f"only float32 weights may store their matrices in float16 or bfloat16 (with_weight_dtype), got {sorted(map(str, half))} "
                         f"matrices beside {sorted(map(str, dtypes))} tensors")
    if len(devices) != 1 or len(dtypes) != 1:
        raise ValueError(f"weights must share one device and dtype, got {devices} and {dtypes}")
    (dtype,) = dtypes
    if not dtype.is_floating_point:
        raise ValueError(f"weights must be floating point, got {dtype}")


def projections(config: HybridConfig) -> tuple[str, ...]:
    """The names of the matrices applied as ``x @ W.T``: every projection, and the LM head (``embed``
    when the embeddings are tied)."""
    c = config
    names = [n for n, shape in weight_shapes(c).items() if len(shape) == 2 and n != "embed" and not n.endswith(".conv_weight")]
    return (*names, *(("embed",) if c.tie_embeddings else ()))


def matmul_layout(config: HybridConfig, weights: Weights) -> Weights:
    """``weights`` with every matrix of ``projections(config)`` stored as the transpose of a contiguous
    ``[in, out]`` matrix: the same shapes and values (``torch.equal`` to the input), so ``x @ W.T``
    is a product of two row-major matrices, which torch's CPU matrix library (MKL) read at memory
    speed for a decode step's few rows, where it read ``[out, in]`` storage more slowly (a decode step
    of the Granite-4.0-H-350M shape at one row: 0.91 of the time; docs/measurements). Other tensors
    are the input's own; a matrix already in that layout is kept as it is. The input is not modified.
    The loaders (``backend.hybrid.checkpoint.load_checkpoint``, ``backend.hf.load_hf``) store their
    matrices so."""
    names = set(projections(config))
    return {name: t.T.contiguous().T if name in names else t for name, t in weights.items()}


def with_weight_dtype(config: HybridConfig, weights: Weights, dtype: torch.dtype) -> Weights:
    """float32 ``weights`` with every matrix of ``projections(config)`` stored in ``dtype`` (float16
    or bfloat16) as a contiguous ``[out, in]`` matrix, the layout ``backend.kernels.lowp`` reads; the
    other tensors (norms, the conv, ``A``, ``D``, ``dt``'s bias, an untied embedding table) are the
    input's own, and compute stays float32. ``dtype`` float32 returns the input. The input is not
    modified. ``ValueError`` for other dtypes or weights not in float32."""
    if dtype == torch.float32:
        return weights
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"with_weight_dtype: dtype must be float32, float16 or bfloat16, got {dtype}")
    check_weights(config, weights)
    names = set(projections(config))
    if {t.dtype for t in weights.values()} != {torch.float32}:
        raise ValueError(f"with_weight_dtype: the weights must be float32, got {sorted({str(t.dtype) for t in weights.values()})}")
    return {name: t.to(dtype).contiguous() if name in names else t for name, t in weights.items()}


def _init_one(name: str, shape: tuple[int, ...], config: HybridConfig, gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed":
        return torch.randn(shape, generator=gen)
    if name == "lm_head":
        return torch.randn(shape, generator=gen) * (2.0 / math.sqrt(config.d_model))
    if leaf in ("norm", "mlp_norm", "final_norm", "D"):
        return torch.ones(shape)
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if leaf == "dt_bias":
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    if leaf in ("conv_weight", "conv_bias"):
        bound = 1.0 / math.sqrt(config.conv_width)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    # a matrix [out, in]
    std = 1.0 / math.sqrt(shape[1])
    if any(name.endswith(suffix) for suffix in _OUTPUT_MATRICES):
        std /= math.sqrt(2 * config.n_layers)
    return torch.randn(shape, generator=gen) * std


def init_weights(
    config: HybridConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Weights:
    """Fresh weights for ``config``, a deterministic function of ``seed`` (independent of device)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = weight_shapes(config)
    return {name: _init_one(name, shapes[name], config, gen).to(device=device, dtype=dtype) for name in sorted(shapes)}


def perturb(weights: Weights, scale: float, seed: int) -> Weights:
    """``weights`` plus Gaussian noise of relative scale ``scale``: each tensor gets
    ``scale * rms(tensor) * N(0, 1)`` (drawn on the CPU in float32 in sorted-name order).

    This is how a draft model is made from the target ("the target's weights plus noise");
    ``scale == 0`` returns exact copies. The inputs are not modified.
    """
    if scale < 0:
        raise ValueError(f"scale must be non-negative, got {scale}")
    gen = torch.Generator().manual_seed(seed)
    out: Weights = {}
    for name in sorted(weights):
        w = weights[name]
        noise = torch.randn(tuple(w.shape), generator=gen)
        if scale == 0:
            out[name] = w.clone()
            continue
        w32 = w.detach().float().cpu()
        rms = float(w32.square().mean().sqrt()) if w32.numel() else 0.0
        out[name] = (w32 + (scale * rms) * noise).to(device=w.device, dtype=w.dtype)
    return out
