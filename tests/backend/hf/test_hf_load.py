"""``backend.hf.load_hf`` on the layouts and spellings in the wild, and on hostile directories:
each refused with one ``CheckpointError`` line naming the file and the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from typeguard import suppress_type_checks

from backend.hf import load_hf
from backend.hybrid.checkpoint import CheckpointError
from backend.hybrid.reference import reference_logits
from tests.backend.hf.builders import hf_logits, save_hf_model

PROMPT = [5, 17, 33, 8, 60, 3, 44, 90, 12]


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return dict(safetensors.torch.load_file(str(d / "model.safetensors")))


def _write(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file(tensors, str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    d = tmp_path_factory.mktemp("nemotron")
    return save_hf_model("nemotron_h", d, seed=1), d


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_transformers_4_nemotron_config_loads_the_same(nemotron_dir: tuple[Any, Path], tmp_path: Path) -> None:
    """hybrid_override_pattern instead of layers_block_type, the ctor aliases, bare Infinity."""
    hf, src = nemotron_dir
    d = _copy(src, tmp_path / "v4")
    cfg = json.loads((d / "config.json").read_text())
    pattern = "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-"}[k] for k in cfg.pop("layers_block_type"))
    cfg.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern), mamba_n_groups=cfg.pop("n_groups"),
               mamba_d_conv=cfg.pop("conv_kernel"), torch_dtype="float32")
    text = json.dumps(cfg).replace('{"__float__": "Infinity"}', "Infinity")
    assert "Infinity" in text and "__float__" not in text
    (d / "config.json").write_text(text)
    a, b = load_hf(src), load_hf(d)
    assert a.model.config == b.model.config
    assert float((reference_logits(b.model, PROMPT) - hf_logits(hf, PROMPT)).abs().max()) <= 1e-4


def test_legacy_layer_names_and_top_level_rope_theta(tmp_path: Path) -> None:
    hf = save_hf_model("bamba", tmp_path, seed=2)
    base = load_hf(tmp_path).model.config
    _edit_config(tmp_path, attn_layer_indices=None, layer_types=["mamba", "attention", "mamba", "attention"],
                 rope_parameters=None, rope_theta=10000.0, partial_rotary_factor=0.5)
    loaded = load_hf(tmp_path)
    assert loaded.model.config == base
    assert float((reference_logits(loaded.model, PROMPT) - hf_logits(hf, PROMPT)).abs().max()) <= 1e-4


def test_sharded_bfloat16_weights_load_and_compute_in_the_chosen_dtype(tmp_path: Path) -> None:
    src = tmp_path / "one"
    save_hf_model("granitemoehybrid", src, seed=4)
    tensors = _tensors(src)
    d = _copy(src, tmp_path / "sharded")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        safetensors.torch.save_file({n: tensors[n].to(torch.bfloat16) for n in part}, str(d / file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    loaded = load_hf(d)
    assert all(t.dtype == torch.float32 for t in loaded.model.weights.values())
    want = load_hf(src).model.weights
    for name, t in loaded.model.weights.items():
        assert torch.equal(t, want[name].to(torch.bfloat16).float()), name
    assert load_hf(d, dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_eos_ids_come_from_generation_config_when_it_exists(tmp_path: Path) -> None:
    save_hf_model("bamba", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_hf(tmp_path).hf.eos_ids == (2, 7)
    (tmp_path / "generation_config.json").unlink()
    _edit_config(tmp_path, eos_token_id=[9, 2])
    assert load_hf(tmp_path).hf.eos_ids == (9, 2)


def test_an_untied_embedding_multiplier_is_folded_into_the_embeddings_exactly(tmp_path: Path) -> None:
    hf = save_hf_model("granitemoehybrid", tmp_path, seed=6, tie_word_embeddings=False, embedding_multiplier=0.75)
    loaded = load_hf(tmp_path)
    c = loaded.model.config
    assert c.embed_scale == 1.0 and not c.tie_embeddings and c.residual_scale == 2.0
    raw = _tensors(tmp_path)["model.embed_tokens.weight"]
    assert torch.equal(loaded.model.weights["embed"], raw * 0.75)
    assert float((reference_logits(loaded.model, PROMPT) - hf_logits(hf, PROMPT)).abs().max()) <= 1e-4


def test_a_granite_conv_without_bias_loads_as_zero_bias(tmp_path: Path) -> None:
    hf = save_hf_model("granitemoehybrid", tmp_path, seed=6, mamba_conv_bias=False)
    loaded = load_hf(tmp_path)
    assert not loaded.model.weights["layers.0.mixer.conv_bias"].any()
    assert float((reference_logits(loaded.model, PROMPT) - hf_logits(hf, PROMPT)).abs().max()) <= 1e-4


HOSTILE_CONFIGS = [
    ("bamba", {"model_type": "mamba2"}, "field 'model_type': 'mamba2' is not supported"),
    ("bamba", {"model_type": None}, "field 'model_type': None is not supported"),
    ("granitemoehybrid", {"num_local_experts": 8}, "field 'num_local_experts': 8: MoE variants are not supported"),
    ("nemotron_h", {"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "mlp"]},
     "layer 1 is a mixture-of-experts layer"),
    ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M*E-M-"}, "layer 2 is a mixture-of-experts layer"),
    ("bamba", {"attention_bias": True}, "field 'attention_bias': True is not supported"),
    ("granitemoehybrid", {"mlp_bias": True}, "field 'mlp_bias': True is not supported"),
    ("bamba", {"mamba_proj_bias": True}, "field 'mamba_proj_bias': True is not supported"),
    ("nemotron_h", {"use_bias": True}, "field 'use_bias': True is not supported"),
    ("bamba", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "field 'rope_scaling'"),
    ("bamba", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_type 'yarn' is not supported"),
    ("bamba", {"hidden_act": "gelu"}, "field 'hidden_act': 'gelu' is not supported"),
    ("nemotron_h", {"mlp_hidden_act": "silu"}, "field 'mlp_hidden_act': 'silu' is not supported"),
    ("bamba", {"hidden_size": "64"}, "field 'hidden_size': must be an integer"),
    ("bamba", {"hidden_size": None}, "missing field 'hidden_size'"),
    ("bamba", {"num_key_value_heads": 3}, "field 'num_key_value_heads': 3 does not divide num_attention_heads 4"),
    ("bamba", {"mamba_n_heads": 0}, "field 'mamba_n_heads': must be at least 1, got 0"),
    ("nemotron_h", {"ssm_state_size": -4}, "field 'ssm_state_size': must be at least 1, got -4"),
    ("bamba", {"vocab_size": 10**9}, "field 'vocab_size': must be at most 262144, got 1000000000"),
    ("bamba", {"attn_layer_indices": [1, 9]}, "field 'attn_layer_indices'"),
    ("granitemoehybrid", {"layer_types": ["mamba", "sliding_attention", "mamba", "attention"]}, "unknown layer 'sliding_attention'"),
    ("granitemoehybrid", {"position_embedding_type": "alibi"}, "field 'position_embedding_type'"),
    ("granitemoehybrid", {"logits_scaling": 0}, "field 'logits_scaling'"),
    ("bamba", {"time_step_limit": [0.0]}, "field 'time_step_limit'"),
    ("nemotron_h", {"num_hidden_layers": 3, "layers_block_type": None, "hybrid_override_pattern": "M*-M-*"}, "field 'num_hidden_layers'"),
    ("bamba", {"eos_token_id": [2, "x"]}, "field 'eos_token_id'"),
    # found by a red-team pass: each was a traceback, a hang or a silent acceptance
    ("bamba", {"num_hidden_layers": 10**9}, "field 'num_hidden_layers': at most 256 layers"),
    ("bamba", {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": {"__float__": "Infinity"}}}, "field 'partial_rotary_factor': must be a finite number"),
    ("bamba", {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 1.5}}, "field 'partial_rotary_factor': must be in [0, 1]"),
    ("bamba", {"rms_norm_eps": 10**400}, "field 'rms_norm_eps': must be a finite number, got an integer of 401 digits"),
    ("granitemoehybrid", {"logits_scaling": 10**400}, "field 'logits_scaling': must be a finite number"),
    ("nemotron_h", {"time_step_min": 10**400}, "field 'time_step_min': must be a finite number"),
    ("bamba", {"time_step_limit": [0, 10**400]}, None),  # an infinite upper bound is no clamp: loads
    ("bamba", {"time_step_limit": [10**400, 10**401]}, "field 'time_step_limit': must be [low, high]"),
    ("bamba", {"time_step_limit": [0.5, 0.1]}, "field 'time_step_limit': must be [low, high]"),
    ("bamba", {"attn_layer_indices": False}, "field 'attn_layer_indices': must be a list of layer indices"),
    ("bamba", {"attn_layer_indices": {}}, "field 'attn_layer_indices': must be a list of layer indices"),
    ("bamba", {"eos_token_id": 96}, "field 'eos_token_id': id 96 is not below the vocabulary size 96"),
    ("bamba", {"eos_token_id": list(range(3, 70))}, "field 'eos_token_id': at most 64 ids, got 67"),
    ("nemotron_h", {"layers_block_type": None, "hybrid_override_pattern": "M" * 300}, "field 'hybrid_override_pattern': at most 256 layers, got 300"),
]


@pytest.mark.parametrize(("family", "changes", "message"), HOSTILE_CONFIGS)
def test_a_config_batchc_cannot_serve_exactly_is_refused_in_one_line(
    tmp_path: Path, family: str, changes: dict[str, Any], message: str | None,
) -> None:
    save_hf_model(family, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(changes)
    text = json.dumps({k: v for k, v in cfg.items() if not (v is None and k in changes and k != "model_type")})
    (tmp_path / "config.json").write_text(text)
    if message is None:
        load_hf(tmp_path)
        return
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path / "config.json") in str(e.value)


# Every bound of batchc's own config, reached through each family's keys: the refusal names the key
# the config.json holds and its value, never batchc's field (d_model, attn_kv_heads, nheads, ...).
USER_WORDS = [
    ("bamba", {"hidden_size": 70000}, "field 'hidden_size': must be at most 65536, got 70000", "d_model"),
    ("bamba", {"num_attention_heads": 6}, "field 'num_attention_heads': 6 does not divide hidden_size 64 (and no head_dim is set)", "attn_heads"),
    ("bamba", {"num_key_value_heads": 8}, "field 'num_key_value_heads': 8 does not divide num_attention_heads 4", "attn_kv_heads"),
    ("bamba", {"mamba_n_groups": 3}, "field 'mamba_n_groups': 3 does not divide mamba_n_heads 8", "ngroups"),
    ("bamba", {"mamba_d_conv": 5}, "field 'mamba_d_conv': must be at most 4, got 5", "conv_width"),
    ("bamba", {"mamba_d_state": 10**6}, "field 'mamba_d_state': must be at most 65536, got 1000000", "d_state must"),
    ("bamba", {"mamba_d_head": 24}, "field 'mamba_d_head': 24 * mamba_n_heads 8 = 192 is not mamba_expand * hidden_size = 128", "head_dim"),
    ("bamba", {"rms_norm_eps": 0}, "field 'rms_norm_eps': must be in (0, 1], got 0", "rms_eps"),
    ("bamba", {"rope_parameters": {"rope_theta": 0.5}}, "field 'rope_parameters.rope_theta': must be at least 1, got 0.5", "rope_theta must"),
    ("bamba", {"head_dim": 18, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "field 'partial_rotary_factor': 0.5 of a head of 18 rotates 9 dims", "rotary_dim"),
    ("bamba", {"attn_layer_indices": [0, 1, 2, 3]}, "field 'attn_layer_indices': no Mamba layer among its 4 layers", "mamba layer"),
    ("bamba", {"intermediate_size": 0}, "field 'intermediate_size': must be at least 1, got 0", "mlp_hidden"),
    ("granitemoehybrid", {"hidden_size": 0}, "field 'hidden_size': must be at least 1, got 0", "d_model"),
    ("granitemoehybrid", {"num_key_value_heads": 3}, "field 'num_key_value_heads': 3 does not divide num_attention_heads 4", "attn_kv_heads"),
    ("granitemoehybrid", {"attention_multiplier": -1.0}, "field 'attention_multiplier': must be a finite positive number, got -1", "attn_scale"),
    ("granitemoehybrid", {"embedding_multiplier": 0.0}, "field 'embedding_multiplier': must be a finite positive number, got 0", "embed_scale"),
    ("granitemoehybrid", {"residual_multiplier": -2}, "field 'residual_multiplier': must be a finite positive number, got -2", "residual_scale"),
    ("granitemoehybrid", {"shared_intermediate_size": 10**5}, "field 'shared_intermediate_size': must be at most 65536, got 100000", "mlp_hidden"),
    ("granitemoehybrid", {"position_embedding_type": "rope", "head_dim": 15},
     "field 'head_dim': head_dim = 15: rotary embeddings (position_embedding_type 'rope') rotate pairs", "attn_head_dim"),
    ("granitemoehybrid", {"layer_types": ["attention"] * 4}, "field 'layer_types': no Mamba layer among its 4 layers", "mamba layer"),
    ("granitemoehybrid", {"mamba_n_heads": 3, "mamba_d_head": "auto"}, "field 'mamba_n_heads': 3 does not divide mamba_expand * hidden_size = 128", "nheads"),
    ("nemotron_h", {"num_key_value_heads": 3}, "field 'num_key_value_heads': 3 does not divide num_attention_heads 4", "attn_kv_heads"),
    ("nemotron_h", {"n_groups": 3}, "field 'n_groups': 3 does not divide mamba_num_heads 8", "ngroups"),
    ("nemotron_h", {"mamba_num_heads": 10**5}, "field 'mamba_num_heads': must be at most 65536, got 100000", "nheads"),
    ("nemotron_h", {"mamba_head_dim": 0}, "field 'mamba_head_dim': must be at least 1, got 0", "head_dim must"),
    ("nemotron_h", {"head_dim": 70000}, "field 'head_dim': must be at most 65536, got 70000", "attn_head_dim"),
    ("nemotron_h", {"conv_kernel": 1}, "field 'conv_kernel': must be at least 2, got 1", "conv_width"),
    ("nemotron_h", {"layer_norm_epsilon": 2.0}, "field 'layer_norm_epsilon': must be in (0, 1], got 2", "rms_eps"),
    ("nemotron_h", {"time_step_min": -0.5}, "field 'time_step_min': must be at least 0, got -0.5", "dt bounds"),
    ("nemotron_h", {"layers_block_type": ["full_attention", "mlp"] * 3}, "field 'layers_block_type': no Mamba layer among its 6 layers", "mamba layer"),
]


@pytest.mark.parametrize(("family", "changes", "message", "internal"), USER_WORDS)
def test_a_refused_config_names_the_key_and_value_the_user_wrote(
    tmp_path: Path, family: str, changes: dict[str, Any], message: str, internal: str,
) -> None:
    save_hf_model(family, tmp_path)
    _edit_config(tmp_path, **changes)
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path)
    text = str(e.value)
    assert message in text and "\n" not in text, text
    assert internal not in text and "unsupported config" not in text, text


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "missing tensor 'model.layers.0.mamba.A_log'"),
        ("extra", "unexpected tensor 'model.layers.0.mamba.extra'"),
        ("shape", "tensor 'model.layers.1.self_attn.k_proj.weight' has shape (16, 64), expected (32, 64)"),
        ("dtype", "tensor 'model.layers.0.mamba.D' has dtype I64"),
        ("not_safetensors", "not a safetensors file or corrupt"),
        ("no_weights", "no weights (model.safetensors or model.safetensors.index.json)"),
        ("untied_head_differs", "'lm_head.weight' differs from the embeddings"),
    ],
)
def test_damaged_weights_are_refused_in_one_line(tmp_path: Path, damage: str, message: str) -> None:
    save_hf_model("granitemoehybrid", tmp_path, tie_word_embeddings=True)
    t = _tensors(tmp_path)
    if damage == "missing":
        del t["model.layers.0.mamba.A_log"]
    elif damage == "extra":
        t["model.layers.0.mamba.extra"] = torch.zeros(2)
    elif damage == "shape":
        t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"][:16]
    elif damage == "dtype":
        t["model.layers.0.mamba.D"] = t["model.layers.0.mamba.D"].long()
    elif damage == "untied_head_differs":
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
    if damage == "not_safetensors":
        (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    elif damage == "no_weights":
        (tmp_path / "model.safetensors").unlink()
    else:
        _write(tmp_path, t)
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("family", "tensor", "value"),
    [
        ("bamba", "model.layers.0.mamba.A_log", float("nan")),
        ("granitemoehybrid", "model.layers.1.shared_mlp.input_linear.weight", float("inf")),  # fused [gate; up]: read once
        ("nemotron_h", "backbone.layers.1.mixer.o_proj.weight", float("-inf")),
        ("bamba", "lm_head.weight", float("nan")),
    ],
)
def test_weights_holding_nan_or_inf_are_refused_naming_the_checkpoint_tensor(
    tmp_path: Path, family: str, tensor: str, value: float,
) -> None:
    save_hf_model(family, tmp_path)
    t = _tensors(tmp_path)
    t[tensor].view(-1)[7] = value
    _write(tmp_path, t)
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path)
    message = str(e.value)
    assert f"tensor {tensor!r} has 1 non-finite values (NaN or infinity)" in message and "\n" not in message
    assert message.startswith(str(tmp_path / "model.safetensors"))


def test_weights_that_overflow_the_compute_dtype_are_refused_naming_the_checkpoint_tensor(tmp_path: Path) -> None:
    """Finite as stored (float32), infinite once converted to float16, or once an untied embedding is
    multiplied by Granite's embedding multiplier: refused in that dtype, served in float32."""
    save_hf_model("bamba", tmp_path)
    t = _tensors(tmp_path)
    t["model.layers.1.self_attn.q_proj.weight"][0, 0] = 1e6
    _write(tmp_path, t)
    load_hf(tmp_path)
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.self_attn.q_proj.weight' has 1 values that overflow float16"):
        load_hf(tmp_path, dtype=torch.float16)
    granite = tmp_path / "granite"
    save_hf_model("granitemoehybrid", granite, tie_word_embeddings=False, embedding_multiplier=1000.0)
    t = _tensors(granite)
    t["model.embed_tokens.weight"][3, 3] = 100.0
    _write(granite, t)
    load_hf(granite)
    with pytest.raises(CheckpointError, match="tensor 'model.embed_tokens.weight' has 1 values that overflow float16 once multiplied by embedding_multiplier 1000.0"):
        load_hf(granite, dtype=torch.float16)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": {}}, "field 'weight_map': must be a non-empty object"),
        ("not an object", "must hold a JSON object"),
        ({"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}, "must be a file name in the directory"),
        ({"weight_map": {"model.embed_tokens.weight": "missing.safetensors"}}, "no shard named by model.safetensors.index.json"),
        ({"weight_map": {"model.embed_tokens.weight": "model.safetensors", "model.norm.weight": "other.safetensors"}},
         "no shard named by"),
    ],
)
def test_a_bad_shard_index_is_refused_in_one_line(tmp_path: Path, index: Any, message: str) -> None:
    save_hf_model("granitemoehybrid", tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        load_hf(tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path: Path) -> None:
    save_hf_model("bamba", tmp_path)
    names = list(_tensors(tmp_path)) + ["model.layers.0.mamba.ghost"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.0.mamba.ghost': model.safetensors.index.json names this shard"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_dir", "not a directory"),
        ("no_config", "no config.json"),
        ("config_not_json", "config.json is not JSON"),
        ("config_list", "config.json must hold a JSON object, got list"),
        ("config_dir", "config.json is a directory, not a regular file"),
        ("config_huge", "config.json of 16777218 bytes is over the limit"),
        ("config_deep", "config.json is nested too deeply"),
        ("config_not_utf8", "cannot read config.json"),
        ("config_long_int", "an integer of more than"),
        ("generation_dangling", "no generation_config.json"),
        ("no_tensors", "missing tensor"),
        ("shard_extra", "tensor 'evil': in this shard, but model.safetensors.index.json does not list it here"),
        ("bad_name", "shard 'a\\nb\\x1b[31m' must be a file name in the directory"),
    ],
)
def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path, setup: str, message: str) -> None:
    d = tmp_path / "ckpt"
    if setup != "no_dir":
        save_hf_model("bamba", d)
    if setup == "no_config":
        (d / "config.json").unlink()
    elif setup == "config_not_json":
        (d / "config.json").write_text("{nope")
    elif setup == "config_list":
        (d / "config.json").write_text("[1, 2]")
    elif setup == "config_dir":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    elif setup == "config_huge":
        (d / "config.json").write_text("{" + " " * (16 << 20) + "}")
    elif setup == "config_deep":
        (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif setup == "config_not_utf8":
        (d / "config.json").write_bytes(b'{"model_type": "\xff"}')
    elif setup == "config_long_int":
        (d / "config.json").write_text('{"hidden_size": ' + "9" * 5000 + "}")
    elif setup == "generation_dangling":
        (d / "generation_config.json").unlink()
        (d / "generation_config.json").symlink_to(d / "gone.json")
    elif setup == "no_tensors":
        (d / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    elif setup == "shard_extra":
        tensors = _tensors(d)
        tensors["evil"] = torch.zeros(1)
        _write(d, tensors)
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in tensors if n != "evil"}}))
    elif setup == "bad_name":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "a\nb\u001b[31m"}}))
    with pytest.raises(CheckpointError) as e:
        load_hf(d)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_arguments_are_refused() -> None:
    with suppress_type_checks(), pytest.raises(TypeError, match="directory must be a path, got 3"):
        load_hf(3)  # type: ignore[arg-type]  # deliberately wrong: the refusal is what is tested
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_hf("x", dtype=torch.int64)
    with suppress_type_checks(), pytest.raises(ValueError, match="dtype must be one of"):
        load_hf("x", dtype=np.array([1, 2]))  # type: ignore[arg-type]  # deliberately wrong
    with pytest.raises(ValueError, match="directory must be a path, got ''"):
        load_hf("")
    with pytest.raises(ValueError, match="tpu"):
        load_hf("x", device="tpu")
