"""Checkpoint files of the hybrid model: one safetensors file, the config as JSON metadata.

Format: every weight of ``backend.hybrid.weights.weight_shapes(config)`` under its own name, in
float32 (``load_checkpoint`` also accepts bfloat16 and float16 tensors and upcasts them), and the
safetensors header metadata

- ``format``: ``"batchc.hybrid/1"``;
- ``config``: the ``HybridConfig`` fields as a JSON object (``layers`` a list of strings);
- any extra string entries the writer passed (``backend.tools.train`` records its settings and losses).

``load_checkpoint`` validates everything before building the model and raises ``CheckpointError``
with a one-line message that starts with the file and names the bad tensor or config field. The
file must be a regular file of at most ``MAX_CHECKPOINT_BYTES``; sizes come from the config (with
``HybridConfig``'s sanity bounds) and the header and are checked before any tensor is read, so the
memory a file can make ``load_checkpoint`` use is bounded by the file's size. The
trained models shipped with the package are ``default_target()`` and ``default_draft()``.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import attrs
import safetensors
import safetensors.torch
import torch

from backend.files import CheckpointError as CheckpointError  # (re-exported: defined torch-free)
from backend.files import file_kind as file_kind
from backend.hybrid.config import ARCHITECTURE_SWITCHES, BLOCK_KINDS, LAYER_KINDS, MLP_KINDS, HybridConfig
from backend.hybrid.model import HybridModel
from backend.hybrid.weights import Weights, check_weights, projections, weight_shapes
from backend.pool import device_problem
from ir.errors import short_repr

__all__ = [
    "DRAFT_FILE", "FORMAT", "HEAD_FILE", "HEAD_FORMAT", "MAX_CHECKPOINT_BYTES", "TARGET_FILE", "CheckpointError", "bundled_path", "config_from_json",
    "config_kwargs", "config_number", "config_to_json", "default_draft", "default_target", "file_kind", "load_checkpoint", "read_checkpoint",
    "read_safetensors", "save_checkpoint",
]

T = TypeVar("T")

FORMAT = "batchc.hybrid/1"
"""The ``format`` metadata of a full model's checkpoint (this module's files)."""
HEAD_FORMAT = "batchc.head/1"
"""The ``format`` of a draft head's checkpoint (``backend.hybrid.head``): not a model on its own,
so ``load_checkpoint`` refuses it by name, and the head's loader refuses a full model."""
_RESERVED = ("format", "config")
_LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TARGET_FILE = "target.safetensors"
"""The bundled trained target's file name under ``backend/hybrid/weights/`` (``default_target``)."""
DRAFT_FILE = "draft.safetensors"
"""The bundled trained draft's file name under ``backend/hybrid/weights/`` (``default_draft``)."""
MAX_CHECKPOINT_BYTES = 4 << 30
"""Largest checkpoint file ``read_checkpoint`` opens (4 GiB; the bundled ones are 2.3 MB and 0.6 MB)."""


# ---- config <-> JSON ------------------------------------------------------------------------------


_CHOICES: dict[str, tuple[str, ...]] = {"block": BLOCK_KINDS, "mlp_kind": MLP_KINDS}
"""The string fields of ``HybridConfig`` and their values."""


def config_to_json(config: HybridConfig) -> str:
    """The config as a JSON object. Architecture switches at their defaults are left out (so the
    bundled models' metadata is what it always was, and ``dt_max``'s default of infinity, which
    JSON cannot spell, is never written)."""
    fields = attrs.asdict(config)
    fields["layers"] = list(config.layers)
    switched = config.switched()
    return json.dumps({k: v for k, v in fields.items() if k not in ARCHITECTURE_SWITCHES or k in switched}, sort_keys=True)


def _field_kind(cls: type[Any], field: Any) -> str:
    """``"int"``, ``"float"``, ``"int | None"``, ``"float | None"``, ``"bool"``, ``"choice"`` or
    ``"layers"`` for an attribute of the config class ``cls``."""
    if field.name == "layers":
        return "layers"
    if field.name in _CHOICES:
        return "choice"
    annotation = str(field.type)
    if annotation not in ("int", "float", "int | None", "float | None", "bool"):  # pragma: no cover - a new field kind needs a rule here
        raise TypeError(f"{cls.__name__}.{field.name}: no JSON rule for type {annotation!r}")
    return annotation


def config_number(value: object) -> float | None:
    """A JSON config value as a float (an int beyond the float range, 10**400, is infinite), or
    None if it is not a number (``bool`` is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def config_kwargs(path: str | Path, text: str, cls: type[Any], what: str) -> dict[str, Any]:
    """The constructor arguments of the attrs class ``cls`` (a model's or a head's config) from its
    JSON ``config`` metadata, each field checked by its kind (``_field_kind``); ``CheckpointError``
    naming ``what`` and the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(path, f"bad {what} metadata: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, f"bad {what} metadata: expected a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in attrs.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise CheckpointError(path, f"bad {what}: unknown field {unknown[0]!r}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in raw:
            if field.default is attrs.NOTHING:
                raise CheckpointError(path, f"bad {what}: missing field {name!r}")
            continue
        value = raw[name]
        kind = _field_kind(cls, field)
        if kind.endswith(" | None"):
            if value is None:
                kwargs[name] = None
                continue
            kind = kind.removesuffix(" | None")
        if kind == "choice":
            if value not in _CHOICES[name]:
                raise CheckpointError(path, f"bad {what}: field {name!r} must be one of {list(_CHOICES[name])}, got {short_repr(value)}")
            kwargs[name] = value
        elif kind == "bool":
            if not isinstance(value, bool):
                raise CheckpointError(path, f"bad {what}: field {name!r} must be true or false, got {short_repr(value)}")
            kwargs[name] = value
        elif kind == "layers":
            if not isinstance(value, list) or not all(isinstance(k, str) and k in LAYER_KINDS for k in value):
                raise CheckpointError(path, f"bad {what}: field 'layers' must be a list of {list(LAYER_KINDS)}, got {value!r}")
            kwargs[name] = tuple(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise CheckpointError(path, f"bad {what}: field {name!r} must be an integer, got {value!r}")
            kwargs[name] = value
        else:
            parsed = config_number(value)
            number = math.nan if parsed is None else parsed
            if not math.isfinite(number):
                shown = short_repr(value) if not isinstance(value, int) else f"an integer of {len(str(abs(value)))} digits"
                raise CheckpointError(path, f"bad {what}: field {name!r} must be a finite number, got {shown}")
            kwargs[name] = number
    return kwargs


def config_from_json(path: str | Path, text: str) -> HybridConfig:
    """Parse and validate the ``config`` metadata of ``path`` (``CheckpointError`` naming the field)."""
    kwargs = config_kwargs(path, text, HybridConfig, "config")
    try:
        return HybridConfig(**kwargs)
    except ValueError as e:
        raise CheckpointError(path, f"bad config: {e}") from None


# ---- save / load ----------------------------------------------------------------------------------


def save_checkpoint(
    path: str | Path, config: HybridConfig, weights: Weights, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``weights`` (float32, on the CPU) and ``config`` to the safetensors file ``path``.

    ``ValueError`` if the weights do not match the config or hold non-finite values, or if
    ``metadata`` uses a reserved key (``format``, ``config``)."""
    check_weights(config, weights)
    for name in sorted(weights):
        if not bool(torch.isfinite(weights[name]).all()):
            raise ValueError(f"weight {name!r} has non-finite values")
    extra = dict(metadata or {})
    reserved = sorted(set(extra) & set(_RESERVED))
    if reserved:
        raise ValueError(f"metadata keys {reserved} are reserved")
    tensors = {name: t.detach().to(device="cpu", dtype=torch.float32).contiguous() for name, t in weights.items()}
    meta = {**extra, "format": FORMAT, "config": config_to_json(config)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path), metadata=meta)


def _regular_size(p: Path) -> int:
    """The size of the regular file ``p``; ``CheckpointError`` for anything else or over the bound."""
    try:
        st = os.stat(p)
    except ValueError:  # a NUL byte in the path
        raise CheckpointError(repr(str(p)), "a path cannot hold a NUL byte") from None
    except FileNotFoundError:
        raise CheckpointError(p, "no such checkpoint file") from None
    except OSError as e:
        raise CheckpointError(p, f"cannot read the file ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(p, f"no such checkpoint file: {file_kind(st.st_mode)}, not a regular file")
    if st.st_size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(p, f"file of {st.st_size} bytes is over the limit of {MAX_CHECKPOINT_BYTES} (4 GiB)")
    return st.st_size


def read_checkpoint(path: str | Path) -> tuple[HybridConfig, Weights, dict[str, str]]:
    """The validated config, float32 CPU weights and all metadata of the checkpoint ``path``.

    Memory stays bounded by the file: the file must be a regular file of at most
    ``MAX_CHECKPOINT_BYTES``; it is memory-mapped (``safetensors.safe_open``), the config is
    validated (``HybridConfig``'s sanity bounds) and every tensor's name and shape is checked
    against it from the header before any tensor is read, one at a time."""
    p = Path(path)
    _regular_size(p)

    def read(f: Any) -> tuple[HybridConfig, Weights, dict[str, str]]:
        meta = f.metadata()
        if meta is None:
            raise CheckpointError(p, "missing config metadata (the safetensors header has no __metadata__)")
        return _read(p, f, dict(meta))

    return read_safetensors(p, read)


def read_safetensors(p: Path, read: Callable[[Any], T]) -> T:
    """``read(f)`` of the opened safetensors file ``p`` (its header and offsets validated on open); a
    file that cannot be read or is not safetensors is a ``CheckpointError`` in one line."""
    try:
        with safetensors.safe_open(str(p), framework="pt") as f:
            return read(f)
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(p, f"cannot read the file ({e.strerror})") from None
    except Exception as e:  # the Rust reader raises SafetensorError, odd bytes may raise others
        raise CheckpointError(p, f"not a safetensors file or corrupt ({e})") from None


def _read(p: Path, f: Any, meta: dict[str, str]) -> tuple[HybridConfig, Weights, dict[str, str]]:
    if meta.get("format") == HEAD_FORMAT:
        raise CheckpointError(p, f"is a draft head checkpoint (format {HEAD_FORMAT!r}), not a full model: load it as a draft head bound to a target")
    if meta.get("format", FORMAT) != FORMAT:
        raise CheckpointError(p, f"unsupported format {meta['format']!r}, expected {FORMAT!r}")
    if "config" not in meta:
        raise CheckpointError(p, "missing config metadata 'config'")
    config = config_from_json(p, meta["config"])

    shapes = weight_shapes(config)
    names = set(f.keys())
    missing = sorted(shapes.keys() - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(p, f"missing tensor {missing[0]!r}{more}")
    unexpected = sorted(names - shapes.keys())
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(p, f"unexpected tensor {unexpected[0]!r}{more}")
    for name in sorted(shapes):  # shapes from the header: nothing is read yet
        shape = tuple(f.get_slice(name).get_shape())
        if shape != shapes[name]:
            raise CheckpointError(p, f"tensor {name!r} has shape {shape}, expected {shapes[name]}")
    weights: Weights = {}
    for name in sorted(shapes):
        t = f.get_tensor(name)
        if t.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(p, f"tensor {name!r} has dtype {t.dtype}, expected torch.float32")
        t = t.float()
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise CheckpointError(p, f"tensor {name!r} has {bad} non-finite values (of {t.numel()})")
        weights[name] = t
    return config, weights, meta


def _check_load_args(path: object, device: object, dtype: object) -> None:
    """``load_checkpoint``'s argument checks (``CheckpointError``)."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(repr(path), f"path must be a str or a path, not {type(path).__name__}")
    path = str(path)
    problem = device_problem(device)
    if problem is not None:
        raise CheckpointError(path, problem)
    if not isinstance(dtype, torch.dtype) or dtype not in _LOADABLE_DTYPES:
        raise CheckpointError(path, f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")


def load_checkpoint(path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HybridModel:
    """The model stored in ``path`` (validated; ``CheckpointError`` otherwise), on ``device`` in ``dtype``.

    ``device`` is ``"cpu"`` or a CUDA device this process can use (``"cuda"``, ``"cuda:1"``, or a
    ``torch.device``); ``dtype`` is ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``. Both
    are checked before the file is read (``CheckpointError`` naming the argument and the value). A
    tensor with values beyond ``dtype``'s range (float16 overflows at 65504) is refused by name."""
    _check_load_args(path, device, dtype)
    config, weights, _ = read_checkpoint(path)
    converted: Weights = {}
    applied = set(projections(config))  # stored for x @ W.T as a row-major product (backend.hybrid.weights.matmul_layout)
    for name in sorted(weights):
        t = weights[name].to(device=device, dtype=dtype)
        t = converted[name] = t.T.contiguous().T if name in applied else t
        if not bool(torch.isfinite(t).all()):  # read_checkpoint refused non-finite float32: these overflow the dtype
            bad = int((~torch.isfinite(t)).sum())
            raise CheckpointError(path, f"tensor {name!r} has {bad} values that overflow {dtype} (of {t.numel()})")
    return HybridModel(config, converted)


# ---- the bundled models -------------------------------------------------------------------------------


def _bundled(filename: str, device: torch.device | str, dtype: torch.dtype) -> HybridModel:
    ref = resources.files("backend.hybrid").joinpath("weights", filename)
    with resources.as_file(ref) as path:
        return load_checkpoint(path, device=device, dtype=dtype)


def bundled_path(filename: str) -> Path:
    """Where the bundled checkpoint ``filename`` lives in the source tree / installed package."""
    return Path(__file__).resolve().parent / "weights" / filename


def default_target(*, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HybridModel:
    """The trained target model shipped in ``backend/hybrid/weights/target.safetensors``."""
    return _bundled(TARGET_FILE, device, dtype)


HEAD_FILE = "mtp.safetensors"
"""The bundled target's trained draft head (``backend.hybrid.head``; ``--draft mtp``)."""


def default_draft(*, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HybridModel:
    """The trained draft model shipped in ``backend/hybrid/weights/draft.safetensors``."""
    return _bundled(DRAFT_FILE, device, dtype)
