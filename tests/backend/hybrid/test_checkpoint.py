"""Checkpoint IO: save/load round trip, one-line ``CheckpointError`` naming the file and the bad
tensor or field for every kind of bad file, and the bundled trained target and draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from backend.hybrid import HybridModel, init_weights, tiny
from backend.hybrid.checkpoint import (
    CheckpointError,
    bundled_path,
    config_to_json,
    default_draft,
    default_target,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from backend.hybrid.presets import trained_draft, trained_target
from backend.hybrid.reference import reference_logits
from backend.hybrid.weights import weight_shapes
from ir.errors import BatchcError
from tests.helpers import DEVICE, Backend, assert_close


def _tensors() -> dict[str, torch.Tensor]:
    return init_weights(tiny(), 3)


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _config_meta(**changes: object) -> dict[str, str]:
    fields = json.loads(config_to_json(tiny()))
    for key, value in changes.items():
        if value is _DROP:
            del fields[key]
        else:
            fields[key] = value
    return {"format": "batchc.hybrid/1", "config": json.dumps(fields)}


_DROP = object()


def _expect(path: Path, *fragments: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return info.value


# ---- round trip ---------------------------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    weights = _tensors()
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny(), weights, metadata={"note": "hello"})
    model = load_checkpoint(path)
    assert model.config == tiny()
    assert model.weights.keys() == weights.keys()
    for name, t in weights.items():
        assert model.weights[name].dtype == torch.float32
        assert torch.equal(model.weights[name], t), name
    config, _, meta = read_checkpoint(path)
    assert config == tiny()
    assert meta["note"] == "hello" and meta["format"] == "batchc.hybrid/1"
    tokens = list(b"def f(x): return x")
    assert torch.equal(reference_logits(model, tokens), reference_logits(HybridModel(tiny(), weights), tokens))


def test_load_to_dtype(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny(), _tensors())
    model = load_checkpoint(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.config == tiny()


def test_bf16_tensors_load_as_float32(tmp_path: Path) -> None:
    tensors = {k: v.to(torch.bfloat16) for k, v in _tensors().items()}
    path = _write(tmp_path / "bf16.safetensors", tensors, _config_meta())
    model = load_checkpoint(path)
    assert model.dtype == torch.float32
    assert torch.equal(model.weights["embed"], tensors["embed"].float())


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    weights = _tensors()
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "a.safetensors", tiny(), weights, metadata={"config": "{}"})
    del weights["embed"]
    with pytest.raises(ValueError, match="embed"):
        save_checkpoint(tmp_path / "b.safetensors", tiny(), weights)
    weights = _tensors()
    weights["lm_head"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="lm_head"):
        save_checkpoint(tmp_path / "c.safetensors", tiny(), weights)
    assert not list(tmp_path.iterdir())


def test_error_types() -> None:
    err = CheckpointError("x.safetensors", "bad\nthing")
    assert isinstance(err, BatchcError) and isinstance(err, ValueError)
    assert str(err) == "x.safetensors: bad thing"


# ---- every kind of bad file -----------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    _expect(tmp_path / "nope.safetensors", "no such checkpoint file")


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    _expect(path, "not a safetensors file")
    path.write_bytes(b"")
    _expect(path, "not a safetensors file")


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny(), _tensors())
    path.write_bytes(path.read_bytes()[:-100])
    _expect(path, "not a safetensors file or corrupt")


def test_corrupt_header(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, tiny(), _tensors())
    data = bytearray(path.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"  # inside the JSON header
    path.write_bytes(bytes(data))
    _expect(path, "not a safetensors file or corrupt")


def test_missing_metadata(tmp_path: Path) -> None:
    _expect(_write(tmp_path / "a.safetensors", _tensors(), None), "missing config metadata")
    _expect(_write(tmp_path / "b.safetensors", _tensors(), {"format": "batchc.hybrid/1"}), "missing config metadata 'config'")


def test_wrong_format(tmp_path: Path) -> None:
    meta = {**_config_meta(), "format": "something/9"}
    _expect(_write(tmp_path / "a.safetensors", _tensors(), meta), "unsupported format 'something/9'")


@pytest.mark.parametrize(
    ("meta", "fragments"),
    [
        ({"config": "{not json"}, ("bad config metadata", "not JSON")),
        ({"config": "[1, 2]"}, ("expected a JSON object",)),
        (_config_meta(d_model=_DROP), ("missing field 'd_model'",)),
        (_config_meta(d_model=0), ("d_model must be positive",)),
        (_config_meta(nheads="four"), ("field 'nheads' must be an integer",)),
        (_config_meta(nheads=True), ("field 'nheads'",)),
        (_config_meta(rms_eps="tiny"), ("field 'rms_eps' must be a finite number",)),
        (_config_meta(layers=["mamba", "moe"]), ("field 'layers'",)),
        (_config_meta(layers=["mamba", "mlp"]), ("bad config", "'mlp' layers need block='single'")),
        (_config_meta(block="parallel"), ("field 'block' must be one of",)),
        (_config_meta(tie_embeddings=1), ("field 'tie_embeddings' must be true or false",)),
        (_config_meta(attn_kv_heads=3), ("bad config", "attn_kv_heads must divide attn_heads")),
        (_config_meta(rotary_dim=3), ("bad config", "rotary_dim must be even")),
        (_config_meta(attn_kv_heads=1.0), ("field 'attn_kv_heads' must be an integer",)),
        (_config_meta(layers=["attn", "attn"]), ("bad config", "at least one mamba layer")),
        (_config_meta(ngroups=3), ("nheads 4 is not a multiple of ngroups 3",)),
        (_config_meta(colour="blue"), ("unknown field 'colour'",)),
    ],
)
def test_bad_config(tmp_path: Path, meta: dict[str, str], fragments: tuple[str, ...]) -> None:
    err = _expect(_write(tmp_path / "m.safetensors", _tensors(), meta), *fragments)
    assert "bad config" in str(err)


def test_missing_tensor(tmp_path: Path) -> None:
    tensors = _tensors()
    del tensors["layers.1.mixer.o_proj"]
    _expect(_write(tmp_path / "m.safetensors", tensors, _config_meta()), "missing tensor 'layers.1.mixer.o_proj'")


def test_unexpected_tensor(tmp_path: Path) -> None:
    tensors = {**_tensors(), "layers.0.mixer.bias": torch.zeros(3)}
    _expect(_write(tmp_path / "m.safetensors", tensors, _config_meta()), "unexpected tensor 'layers.0.mixer.bias'")


def test_weights_of_another_config(tmp_path: Path) -> None:
    """A checkpoint whose config says one model and whose tensors are another's."""
    meta = _config_meta(layers=["mamba", "attn"])
    _expect(_write(tmp_path / "m.safetensors", _tensors(), meta), "unexpected tensor 'layers.2.")


def test_wrong_shape(tmp_path: Path) -> None:
    tensors = {**_tensors(), "layers.0.mixer.in_proj": torch.zeros(5, 32)}
    expected = weight_shapes(tiny())["layers.0.mixer.in_proj"]
    _expect(
        _write(tmp_path / "m.safetensors", tensors, _config_meta()),
        "tensor 'layers.0.mixer.in_proj' has shape (5, 32), expected " + str(expected),
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8])
def test_wrong_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {**_tensors(), "final_norm": torch.ones(32, dtype=dtype)}
    _expect(_write(tmp_path / "m.safetensors", tensors, _config_meta()), f"tensor 'final_norm' has dtype {dtype}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite(tmp_path: Path, value: float) -> None:
    tensors = _tensors()
    tensors["layers.2.mlp.up_proj"][3, 4] = value
    _expect(_write(tmp_path / "m.safetensors", tensors, _config_meta()), "tensor 'layers.2.mlp.up_proj' has 1 non-finite")


def test_values_that_overflow_the_compute_dtype_are_refused_by_name(tmp_path: Path) -> None:
    """Finite in float32, infinite in float16: refused when loading in float16, served in float32."""
    tensors = _tensors()
    tensors["layers.1.mixer.q_proj"][0, 0] = 1e6
    path = _write(tmp_path / "m.safetensors", tensors, _config_meta())
    load_checkpoint(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, dtype=torch.float16)
    message = str(info.value)
    assert "tensor 'layers.1.mixer.q_proj' has 1 values that overflow torch.float16" in message and "\n" not in message


# ---- the bundled trained models ----------------------------------------------------------------------


def test_bundled_files_are_small() -> None:
    sizes = [bundled_path(name).stat().st_size for name in ("target.safetensors", "draft.safetensors")]
    assert sum(sizes) <= 10 * 2**20


@pytest.mark.parametrize(("load", "config"), [(default_target, trained_target()), (default_draft, trained_draft())])
def test_bundled_models_load_and_match_their_configs(load: object, config: object) -> None:
    assert callable(load)
    model = load()
    assert isinstance(model, HybridModel)
    assert model.config == config
    assert model.dtype == torch.float32
    meta = read_checkpoint(bundled_path("target.safetensors" if config == trained_target() else "draft.safetensors"))[2]
    training = json.loads(meta["training"])
    assert training["steps_done"] == training["settings"]["steps"] and not training["stopped_early"]
    # it learned Python-ish bytes: far better than uniform (8 bits) on a line it was not trained on
    text = list(b"import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n")
    logits = reference_logits(model, text)
    bits = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text[1:])) / torch.log(torch.tensor(2.0))
    assert float(bits) < 4.0


def test_bundled_target_serves_through_the_pool() -> None:
    """The shipped shapes (6 Mamba heads, d_model 96) run through extend like the test model."""
    for model in (default_target(device=DEVICE), default_draft(device=DEVICE)):
        prompt = list(b"class Foo:\n    def __init__(self):\n        self.")
        out = Backend(model).extend([(1, prompt, 0)])
        assert_close(out.logits[0], reference_logits(model, prompt)[-1])
