"""Load a Hugging Face checkpoint directory of a supported hybrid family as a ``HybridModel``.

A directory holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``{"weight_map": {tensor: file}}``), optionally
``generation_config.json`` (its ``eos_token_id`` wins over the config's, as in ``generate``).
Tensors are read memory-mapped, one at a time, in float32, bfloat16 or float16, and converted to
the compute dtype. Before any tensor is read, the header of every file is checked against the
config: every tensor the family needs is there with its shape, and nothing else is (Nemotron-H's
multi-token-prediction ``mtp.*`` tensors, which transformers also drops, excepted). Every tensor read
is refused if it holds a NaN or an infinity, as stored or once converted to the compute dtype
(float32 values beyond float16's range), so that no poisoned checkpoint is served. Everything that
cannot be loaded is a ``CheckpointError`` naming the file and the tensor (the checkpoint's own
name) or field.

An embedding multiplier (Granite) is folded into an untied embedding matrix (exact: the same
product, rounded once, as transformers' multiply after the lookup); tied, it stays a scale of the
looked-up rows, as do the residual and logit multipliers (folding those into a matrix would round
differently).

Tensor names (``backend.hybrid.weights`` names on the right):

- Bamba / Granite-4.0-H: ``model.embed_tokens`` -> ``embed``; ``model.layers.{i}.input_layernorm``
  -> ``layers.{i}.norm``; ``pre_ff_layernorm`` (Bamba) / ``post_attention_layernorm`` (Granite) ->
  ``mlp_norm``; ``mamba.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}`` and
  ``self_attn.{q,k,v,o}_proj`` -> ``mixer.*``; Bamba's ``feed_forward.{gate,up,down}_proj`` and
  Granite's ``shared_mlp.input_linear`` (rows ``[gate; up]``) / ``output_linear`` -> ``mlp.*``;
  ``model.final_layernorm`` (Bamba) / ``model.norm`` (Granite) -> ``final_norm``; ``lm_head``, absent
  when the embeddings are tied.
- Nemotron-H (prefix ``backbone.`` as published, or ``model.``): ``embeddings`` (or ``embedding``),
  ``layers.{i}.norm``, ``layers.{i}.mixer.*`` (Mamba, attention, or an MLP's ``up_proj`` /
  ``down_proj``), ``norm_f``, and ``lm_head``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import safetensors
import torch

from backend.hf.config import FAMILIES, HFConfig, _Fields, parse_config, read_json
from backend.hybrid.checkpoint import CheckpointError, file_kind
from backend.hybrid.config import HybridConfig
from backend.hybrid.model import HybridModel
from backend.hybrid.weights import Weights, projections, weight_shapes
from backend.pool import device_problem
from ir.errors import short_repr

__all__ = ["HFModel", "load_hf"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"
_LOADABLE = (torch.float32, torch.bfloat16, torch.float16)

# How a batchc tensor comes out of a checkpoint tensor: the whole of it, the conv weight without
# its singleton axis, or one half of Granite's fused [gate; up] rows.
_Take = Callable[[torch.Tensor], torch.Tensor]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def _conv(t: torch.Tensor) -> torch.Tensor:
    return t[:, 0, :]


def _half(second: bool) -> _Take:
    def take(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // 2
        return t[n:] if second else t[:n]

    return take


@attrs.frozen
class _Source:
    """Where a batchc tensor comes from: the checkpoint tensor, its expected shape, and how to take it."""

    name: str
    shape: tuple[int, ...]
    take: _Take = _whole


@attrs.frozen(kw_only=True)
class HFModel:
    """A loaded checkpoint: the model, its parsed config and the directory it came from."""

    model: HybridModel
    hf: HFConfig
    directory: Path

    @property
    def family(self) -> str:
        """The family's name as people write it ("Bamba", "Granite-4.0-H", "Nemotron-H")."""
        return FAMILIES[self.hf.family]


def _sources(hf: HFConfig, prefix: str, embed_name: str) -> dict[str, _Source]:
    """batchc tensor name -> its source in the checkpoint, for ``hf``'s family and config."""
    c: HybridConfig = hf.config
    shapes = weight_shapes(c)
    nemotron = hf.family == "nemotron_h"
    out: dict[str, _Source] = {}
    mamba_module = "mixer" if nemotron else "mamba"
    attn_module = "mixer" if nemotron else "self_attn"
    for name, shape in shapes.items():
        parts = name.split(".")
        if name == "embed":
            out[name] = _Source(f"{prefix}{embed_name}.weight", shape)
        elif name == "final_norm":
            final = "norm_f" if nemotron else "final_layernorm" if hf.family == "bamba" else "norm"
            out[name] = _Source(f"{prefix}{final}.weight", shape)
        elif name == "lm_head":
            out[name] = _Source("lm_head.weight", shape)
        else:
            i, rest = parts[1], ".".join(parts[2:])
            layer = f"{prefix}layers.{i}."
            kind = c.layers[int(i)]
            if rest == "norm":
                out[name] = _Source(f"{layer}{'norm' if nemotron else 'input_layernorm'}.weight", shape)
            elif rest == "mlp_norm":
                out[name] = _Source(f"{layer}{'pre_ff_layernorm' if hf.family == 'bamba' else 'post_attention_layernorm'}.weight", shape)
            elif rest.startswith("mlp."):
                leaf = rest.removeprefix("mlp.")
                if nemotron:
                    out[name] = _Source(f"{layer}mixer.{leaf}.weight", shape)
                elif hf.family == "bamba":
                    out[name] = _Source(f"{layer}feed_forward.{leaf}.weight", shape)
                elif leaf == "down_proj":
                    out[name] = _Source(f"{layer}shared_mlp.output_linear.weight", shape)
                else:
                    fused = (2 * c.mlp_hidden, c.d_model)
                    out[name] = _Source(f"{layer}shared_mlp.input_linear.weight", fused, _half(leaf == "up_proj"))
            else:
                leaf = rest.removeprefix("mixer.")
                module = mamba_module if kind == "mamba" else attn_module
                if leaf == "conv_weight":
                    out[name] = _Source(f"{layer}{module}.conv1d.weight", (shape[0], 1, shape[1]), _conv)
                elif leaf == "conv_bias":
                    out[name] = _Source(f"{layer}{module}.conv1d.bias", shape)
                elif leaf in ("dt_bias", "A_log", "D"):
                    out[name] = _Source(f"{layer}{module}.{leaf}", shape)
                else:
                    out[name] = _Source(f"{layer}{module}.{leaf}.weight", shape)
    return out


def _regular(path: Path, what: str) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(path, f"no {what}") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"cannot read {what} ({e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(path, f"{what} is {file_kind(st.st_mode)}, not a regular file")


def _files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the index, or the single file)."""
    index = directory / INDEX
    if not index.exists() and not index.is_symlink():
        single = directory / SINGLE
        _regular(single, f"weights ({SINGLE} or {INDEX})")
        return {name: single for name in _header_names(single)}
    _regular(index, "shard index")
    raw = read_json(index, "the shard index")
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(index, f"field 'weight_map': must be a non-empty object of tensor -> file, got {short_repr(weight_map)}")
    shards: dict[str, Path] = {}
    listed: dict[Path, set[str]] = {}
    out: dict[str, Path] = {}
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file in (".", "..") or not file.isprintable():
            raise CheckpointError(index, f"tensor {short_repr(tensor)}: shard {short_repr(file)} must be a file name in the directory")
        if file not in shards:
            shards[file] = directory / file
            _regular(shards[file], f"shard named by {INDEX}")
            listed[shards[file]] = set()
        out[tensor] = shards[file]
        listed[shards[file]].add(tensor)
    for path, names in listed.items():  # each shard holds exactly what the index lists for it
        held = set(_header_names(path))
        lacking = sorted(names - held)
        if lacking:
            raise CheckpointError(path, f"tensor {short_repr(lacking[0])}: {INDEX} names this shard, which does not hold it")
        unlisted = sorted(held - names)
        if unlisted:
            raise CheckpointError(path, f"tensor {short_repr(unlisted[0])}: in this shard, but {INDEX} does not list it here")
    return out


def _open(path: Path) -> Any:
    try:
        return safetensors.safe_open(str(path), framework="pt")
    except OSError as e:
        raise CheckpointError(path, f"cannot read the file ({e.strerror})") from None
    except Exception as e:  # the Rust reader raises SafetensorError; odd bytes may raise others
        raise CheckpointError(path, f"not a safetensors file or corrupt ({e})") from None


def _header_names(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _check_headers(
    directory: Path, files: dict[str, Path], sources: dict[str, _Source], ignored: Callable[[str], bool],
) -> None:
    """Every source tensor present with its shape and a loadable dtype, nothing unexpected."""
    wanted = {s.name: s for s in sources.values()}
    missing = sorted(set(wanted) - set(files))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(directory, f"missing tensor {missing[0]!r}{more}")
    extra = sorted(n for n in set(files) - set(wanted) if not ignored(n))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(files[extra[0]], f"unexpected tensor {short_repr(extra[0])}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with _open(path) as f:
            for name in sorted(names):
                sl = f.get_slice(name)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != wanted[name].shape:
                    raise CheckpointError(path, f"tensor {name!r} has shape {shape}, expected {wanted[name].shape}")
                if dtype not in _DTYPES:
                    raise CheckpointError(path, f"tensor {name!r} has dtype {dtype}, expected one of {sorted(_DTYPES)}")


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _check_finite(path: Path, name: str, t: torch.Tensor, overflow: str | None = None) -> None:
    """``CheckpointError`` naming the checkpoint's tensor ``name`` if ``t`` holds a NaN or an
    infinity (``overflow``: what made finite stored values infinite, when that is the cause)."""
    if bool(torch.isfinite(t).all()):
        return
    bad = int((~torch.isfinite(t)).sum())
    what = "non-finite values (NaN or infinity)" if overflow is None else f"values that overflow {overflow}"
    raise CheckpointError(path, f"tensor {name!r} has {bad} {what} of {t.numel()}; a model with them computes no meaningful logits")


def _check_eos(path: Path, ids: tuple[int, ...], vocab: int) -> None:
    beyond = [i for i in ids if i >= vocab]
    if beyond:
        raise CheckpointError(path, f"field 'eos_token_id': id {beyond[0]} is not below the vocabulary size {vocab}")


def load_hf(directory: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> HFModel:
    """The checkpoint in ``directory`` as a model computing in ``dtype`` on ``device``."""
    if not isinstance(directory, (str, Path)):
        raise TypeError(f"directory must be a path, got {short_repr(directory)}")
    if not str(directory):
        raise ValueError("directory must be a path, got ''")
    if not any(dtype is d for d in _LOADABLE):  # identity: torch dtypes are singletons, and an array compares elementwise
        raise ValueError(f"dtype must be one of {_LOADABLE}, got {short_repr(dtype)}")
    problem = device_problem(device)
    if problem is not None:
        raise ValueError(problem)
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(d, "not a directory (a Hugging Face checkpoint is a directory with config.json)")
    config_path = d / CONFIG
    _regular(config_path, CONFIG)
    hf = parse_config(config_path, read_json(config_path, CONFIG))
    _check_eos(config_path, hf.eos_ids, hf.config.vocab)
    generation = d / GENERATION
    if os.path.lexists(generation):  # a dangling link is refused, not skipped
        _regular(generation, GENERATION)
        eos = _Fields(generation, read_json(generation, GENERATION)).ids("eos_token_id")
        _check_eos(generation, eos, hf.config.vocab)
        if eos:
            hf = attrs.evolve(hf, eos_ids=eos)
    files = _files(d)
    nemotron = hf.family == "nemotron_h"
    prefix = "model."
    embed_name = "embeddings" if nemotron else "embed_tokens"
    if nemotron:
        prefix = "backbone." if any(n.startswith("backbone.") for n in files) else "model."
        if f"{prefix}embedding.weight" in files:  # the name the original remote code saved
            embed_name = "embedding"
    sources = _sources(hf, prefix, embed_name)
    if not hf.conv_bias:
        sources = {k: v for k, v in sources.items() if not k.endswith(".conv_bias")}
    tied_head = hf.config.tie_embeddings and "lm_head.weight" in files

    def ignored(name: str) -> bool:
        return (nemotron and name.startswith("mtp.")) or (tied_head and name == "lm_head.weight")

    _check_headers(d, files, sources, ignored)
    weights: Weights = {}
    cache: dict[str, torch.Tensor] = {}
    applied = set(projections(hf.config))  # stored for x @ W.T as a row-major product (backend.hybrid.weights.matmul_layout)
    for name in sorted(sources):
        src = sources[name]
        path = files[src.name]
        if src.name not in cache:
            with _open(path) as f:
                cache = {src.name: f.get_tensor(src.name)}  # one checkpoint tensor at a time (Granite's fused MLP: two uses)
            _check_finite(path, src.name, cache[src.name])
        taken = src.take(cache[src.name]).to(device=device, dtype=dtype)
        weights[name] = taken.T.contiguous().T if name in applied else taken.contiguous()
        if weights[name].dtype != cache[src.name].dtype:  # float32 -> float16 can overflow to infinity
            _check_finite(path, src.name, weights[name], _DTYPE_NAMES[dtype])
    if not hf.conv_bias:
        c = hf.config
        for i in c.mamba_layers:
            weights[f"layers.{i}.mixer.conv_bias"] = torch.zeros(c.conv_dim, device=device, dtype=dtype)
    if tied_head:
        with _open(files["lm_head.weight"]) as f:
            head = f.get_tensor("lm_head.weight")
        if tuple(head.shape) != tuple(weights["embed"].shape) or not torch.equal(head.to(dtype), weights["embed"].to("cpu")):
            raise CheckpointError(files["lm_head.weight"], "tensor 'lm_head.weight' differs from the embeddings, but tie_word_embeddings is true")
    c = hf.config
    if c.embed_scale != 1.0 and not c.tie_embeddings:
        # exact: transformers multiplies the looked-up rows by the same number in the same dtype
        weights["embed"] = weights["embed"] * c.embed_scale
        _check_finite(files[sources["embed"].name], sources["embed"].name, weights["embed"], f"{_DTYPE_NAMES[dtype]} once multiplied by embedding_multiplier {c.embed_scale}")
        hf = attrs.evolve(hf, config=attrs.evolve(c, embed_scale=1.0))
    try:
        model = HybridModel(hf.config, weights)
    except ValueError as e:  # pragma: no cover - the headers were checked against the same shapes
        raise CheckpointError(d, str(e)) from None
    return HFModel(model=model, hf=hf, directory=d)
