"""The MTP/EAGLE draft head as a model kind (``backend.hybrid.head``): config checks, binding to a
target, the training forward against the cache-free reference, the pool's carried hidden state,
and head checkpoints (round trip; a head file and a full model's file refused by each other's loader)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from backend.hybrid import HybridConfig, HybridModel, tiny
from backend.hybrid.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from backend.hybrid.head import (
    HeadConfig,
    HeadModel,
    head_weight_shapes,
    init_head_weights,
    is_head_checkpoint,
    load_head,
    read_head,
    save_head,
)
from backend.hybrid.reference import reference_hidden
from backend.pool import MambaLayerSpec, MambaStatePool, PoolLayout
from ir.ids import DRAFT_POOL


def _target(seed: int = 1) -> HybridModel:
    return HybridModel.from_seed(tiny(), seed)


def _config(layers: Any = ("mamba", "attn"), **changes: Any) -> HeadConfig:
    base = HeadConfig.for_target(tiny())
    fields = {"layers": layers, **{k: getattr(base, k) for k in ("d_model", "vocab", "nheads", "head_dim", "d_state", "ngroups",
                                              "conv_width", "chunk_size", "attn_heads", "attn_head_dim", "rope_theta", "mlp_hidden")},
              **changes}
    return HeadConfig(**fields)


# ---- config -------------------------------------------------------------------------------------------


def test_layer_pattern_as_string_or_tuple() -> None:
    assert _config("mamba, attn").layers == ("mamba", "attn")
    assert _config("attn attn").layers == ("attn", "attn")
    assert _config(["mamba"]).layers == ("mamba",)
    assert _config("attn").n_mamba == 0


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"layers": ()}, "at least one layer"),
        ({"layers": ("mamba", "mlp")}, "got 'mlp'"),
        ({"layers": "mamba,conv"}, "got 'conv'"),
        ({"layers": 3}, "layers must be a tuple"),
        ({"d_model": 0}, "d_model must be positive, got 0"),
        ({"nheads": 3}, "nheads 3 is not a multiple of ngroups 2"),
        ({"conv_width": 5}, "conv_width must be in [2, 4], got 5"),
        ({"vocab": 1 << 30}, "vocab must be at most"),
        ({"mlp_hidden": 2.5}, "mlp_hidden must be an int, got 2.5"),
        ({"attn_heads": True}, "attn_heads must be an int, got True"),
        ({"rope_theta": 0.5}, "rope_theta must be a finite number >= 1, got 0.5"),
    ],
)
def test_config_is_validated(changes: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        _config(**changes)
    assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_binding_refuses_a_target_of_another_shape() -> None:
    cfg = _config(d_model=16, nheads=2)
    with pytest.raises(ValueError, match=r"^head d_model 16 does not match the target's d_model 32$"):
        HeadModel(cfg, init_head_weights(cfg, 0), _target())
    cfg = _config(vocab=300)
    with pytest.raises(ValueError, match=r"^head vocab 300 does not match the target's vocab 256$"):
        HeadModel(cfg, init_head_weights(cfg, 0), _target())


def test_weights_must_match_the_config() -> None:
    cfg = _config()
    w = init_head_weights(cfg, 0)
    del w["fc"]
    with pytest.raises(ValueError, match=r"missing \['fc'\]"):
        HeadModel(cfg, w, _target())
    w = init_head_weights(cfg, 0)
    w["norm_embed"] = torch.ones(3)
    with pytest.raises(ValueError, match="norm_embed"):
        HeadModel(cfg, w, _target())


def test_init_is_seeded_and_owns_no_shared_tensor() -> None:
    cfg = _config()
    a, b, c = init_head_weights(cfg, 5), init_head_weights(cfg, 5), init_head_weights(cfg, 6)
    assert set(a) == set(head_weight_shapes(cfg))
    assert not {"embed", "final_norm", "lm_head"} & set(a)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["fc"], c["fc"])
    assert head_weight_shapes(cfg)["fc"] == (32, 64)


def test_the_head_shares_the_targets_tensors() -> None:
    target = _target()
    head = HeadModel.from_seed(_config(), target, 0)
    for name in ("embed", "final_norm", "lm_head"):
        assert head.body.weights[name] is target.weights[name]


# ---- forwards -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", ["mamba", "attn", "mamba,attn"])
def test_training_forward_equals_the_reference(layers: str) -> None:
    target = _target()
    head = HeadModel.from_seed(_config(layers), target, 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 11), generator=gen)
    hidden = torch.stack([reference_hidden(target, row.tolist()) for row in ids])
    logits = head.forward_train(hidden, ids, chunk=4)
    assert logits.shape == (2, 11, 256) and logits.dtype == torch.float32
    for b in range(2):
        torch.testing.assert_close(logits[b], head.reference(hidden[b], ids[b]), rtol=1e-4, atol=1e-4)


def test_the_pairing_is_previous_hidden_with_current_token() -> None:
    """Position j reads h_{j-1}: changing h at the last position changes no logits, changing it at
    position 0 changes position 1 on (and not position 0, which reads h_{-1} = 0)."""
    target = _target()
    head = HeadModel.from_seed(_config(), target, 2)
    ids = torch.arange(7, dtype=torch.int64) * 11
    hidden = reference_hidden(target, ids.tolist())
    base = head.reference(hidden, ids)
    moved = hidden.clone()
    moved[-1] += 1.0
    torch.testing.assert_close(head.reference(moved, ids), base)
    moved = hidden.clone()
    moved[0] += 1.0
    out = head.reference(moved, ids)
    torch.testing.assert_close(out[0], base[0])
    assert not torch.allclose(out[1], base[1])


def test_training_forward_has_gradients_for_the_heads_weights() -> None:
    target = _target()
    head = HeadModel.from_seed(_config(), target, 2)
    weights = {n: t.clone().requires_grad_(True) for n, t in head.weights.items()}
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(2))
    loss = torch.nn.functional.cross_entropy(head.forward_train(hidden, ids, weights=weights)[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(w.grad is not None and bool(torch.isfinite(w.grad).all()) for w in weights.values())
    assert weights["fc"].grad is not None and float(weights["fc"].grad.abs().sum()) > 0


@pytest.mark.parametrize(
    ("hidden", "ids", "fragment"),
    [
        ((2, 5, 32), (2, 5), None),
        ((2, 5, 16), (2, 5), "hidden must be [batch, length, 32]"),
        ((2, 5, 32), (2, 4), "hidden must be"),
        ((2, 0, 32), (2, 0), "length >= 1"),
    ],
)
def test_training_forward_checks_shapes(hidden: tuple[int, ...], ids: tuple[int, ...], fragment: str | None) -> None:
    head = HeadModel.from_seed(_config(), _target(), 0)
    h, i = torch.zeros(hidden), torch.zeros(ids, dtype=torch.int64)
    if fragment is None:
        assert head.forward_train(h, i).shape == (2, 5, 256)
        return
    with pytest.raises(ValueError) as info:
        head.forward_train(h, i)
    assert fragment in str(info.value)


def test_reference_checks_shapes() -> None:
    head = HeadModel.from_seed(_config(), _target(), 0)
    with pytest.raises(ValueError, match=r"hidden must be \[length, 32\]"):
        head.reference(torch.zeros(4, 32), torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="ids must be an int64"):
        head.reference(torch.zeros(4, 32), torch.zeros(4))


# ---- the pool -----------------------------------------------------------------------------------------


def test_pool_layout_carries_the_hidden_state() -> None:
    head = HeadModel.from_seed(_config(("mamba", "attn", "mamba")), _target(), 0)
    layout = head.pool_layout()
    plain = tiny().pool_layout()
    assert layout.layers == plain.layers and layout.conv_offsets == plain.conv_offsets and layout.ssm_offsets == plain.ssm_offsets
    assert layout.carried_offset == plain.row_bytes and layout.row_bytes == plain.row_bytes + 256
    pool = head.new_pool(3)
    assert pool.pool_id == DRAFT_POOL
    view = pool.carried_hidden()
    assert view.shape == (4, 32) and view.dtype == torch.float32
    view[2] = 1.5
    assert float(pool.ssm_state(1)[2].abs().sum()) == 0.0  # its own bytes
    assert int(pool.buffer[2, layout.carried_offset : layout.carried_offset + 128].count_nonzero()) > 0


def test_layouts_without_a_carried_state_are_as_they_were() -> None:
    spec = MambaLayerSpec(conv_dim=40, kernel_width=4, nheads=3, head_dim=5, d_state=7)
    layout = PoolLayout(layers=[spec, spec])
    # conv 480 B -> 512, ssm 420 B -> 512, per layer: the offsets and row size from before
    assert (layout.conv_offsets, layout.ssm_offsets, layout.row_bytes) == ((0, 1024), (512, 1536), 2048)
    assert layout.carried_offset == layout.row_bytes
    with pytest.raises(ValueError, match="carries no hidden state"):
        MambaStatePool(DRAFT_POOL, layout, 2).carried_hidden()


def test_an_attention_only_head_still_has_a_pool() -> None:
    head = HeadModel.from_seed(_config("attn"), _target(), 0)
    layout = head.pool_layout()
    assert layout.layers == () and layout.row_bytes == 256 and layout.carried_hidden == 32
    with pytest.raises(ValueError, match=r"PoolLayout\.layers: a pool layout needs at least one Mamba layer or a carried hidden state"):
        PoolLayout(layers=())


# ---- checkpoints -----------------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    target = _target()
    head = HeadModel.from_seed(_config("mamba,attn"), target, 4)
    path = tmp_path / "head.safetensors"
    save_head(path, head.config, head.weights, metadata={"note": "x"})
    assert is_head_checkpoint(path)
    config, weights, meta = read_head(path)
    assert config == head.config and meta["note"] == "x" and meta["format"] == "batchc.head/1"
    assert json.loads(meta["config"])["layers"] == ["mamba", "attn"]
    loaded = load_head(path, target)
    assert all(torch.equal(loaded.weights[n], head.weights[n]) for n in head.weights)
    ids = torch.arange(5, dtype=torch.int64)
    hidden = reference_hidden(target, ids.tolist())
    torch.testing.assert_close(loaded.reference(hidden, ids), head.reference(hidden, ids))
    with safetensors.safe_open(str(path), framework="pt") as f:  # the target's tensors are not in the file
        assert not {"embed", "final_norm", "lm_head"} & set(f.keys())


def test_a_head_file_and_a_model_file_are_told_apart(tmp_path: Path) -> None:
    target = _target()
    head = HeadModel.from_seed(_config(), target, 4)
    head_path, model_path = tmp_path / "head.safetensors", tmp_path / "model.safetensors"
    save_head(head_path, head.config, head.weights)
    save_checkpoint(model_path, target.config, target.weights)
    assert not is_head_checkpoint(model_path)
    with pytest.raises(CheckpointError, match=r"is a draft head checkpoint \(format 'batchc.head/1'\), not a full model"):
        load_checkpoint(head_path)
    with pytest.raises(CheckpointError, match=r"is a full model checkpoint \(format 'batchc.hybrid/1'\), not a draft head"):
        load_head(model_path, target)


def test_loading_a_head_for_another_target_is_refused(tmp_path: Path) -> None:
    other = HybridModel.from_seed(HybridConfig(
        d_model=16, layers=("mamba",), nheads=2, head_dim=8, d_state=8, ngroups=2, chunk_size=8, attn_heads=2, attn_head_dim=8, mlp_hidden=32,
    ), 0)
    head = HeadModel.from_seed(_config(), _target(), 4)
    path = tmp_path / "head.safetensors"
    save_head(path, head.config, head.weights)
    with pytest.raises(CheckpointError) as info:
        load_head(path, other)
    assert str(info.value) == f"{path}: head d_model 32 does not match the target's d_model 16"


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda t, m: (t, {**m, "config": "{"}), "bad head config metadata: not JSON"),
        (lambda t, m: (t, {**m, "config": json.dumps({**json.loads(m["config"]), "extra": 1})}), "unknown field 'extra'"),
        (lambda t, m: (t, {**m, "config": json.dumps({**json.loads(m["config"]), "nheads": "4"})}), "field 'nheads' must be an integer"),
        (lambda t, m: (t, {**m, "config": json.dumps({**json.loads(m["config"]), "layers": ["mlp"]})}), "bad head config: head layer kinds"),
        (lambda t, m: ({k: v for k, v in t.items() if k != "fc"}, m), "missing tensor 'fc'"),
        (lambda t, m: ({**t, "embed": torch.zeros(256, 32)}, m), "unexpected tensor 'embed'"),
        (lambda t, m: ({**t, "fc": torch.zeros(32, 32)}, m), "tensor 'fc' has shape (32, 32)"),
        (lambda t, m: ({**t, "fc": torch.full((32, 64), float("nan"))}, m), "tensor 'fc' has 2048 non-finite values"),
        (lambda t, m: (t, {k: v for k, v in m.items() if k != "format"}), "has no format metadata"),
        (lambda t, m: (t, {**m, "format": "batchc.head/9"}), "unsupported format 'batchc.head/9'"),
    ],
)
def test_bad_head_files_are_refused_in_one_line(tmp_path: Path, edit: Any, fragment: str) -> None:
    head = HeadModel.from_seed(_config(), _target(), 4)
    good = tmp_path / "good.safetensors"
    save_head(good, head.config, head.weights)
    with safetensors.safe_open(str(good), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata() or {})
    tensors, meta = edit(tensors, meta)
    bad = tmp_path / "bad.safetensors"
    safetensors.torch.save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(CheckpointError) as info:
        read_head(bad)
    message = str(info.value)
    assert message.startswith(str(bad)) and "\n" not in message and fragment in message, message
