"""Config, weights, perturbation, KV cache / token table and argument checks of the hybrid model."""

from __future__ import annotations

import pytest
import torch

from backend.hybrid import HybridConfig, HybridModel, TokenTable, init_weights, perturb, small, tiny, weight_shapes
from backend.pool import MambaStatePool
from ir.ids import DRAFT_POOL
from tests.helpers import DEVICE, Backend, grid, ids, tiny_model


def test_presets_and_pool_layout() -> None:
    for config in (tiny(), small()):
        layout = config.pool_layout(torch.float32, torch.bfloat16)
        assert len(layout.layers) == config.n_mamba == config.layers.count("mamba")
        spec = layout.layers[0]
        assert spec.conv_dim == config.d_inner + 2 * config.ngroups * config.d_state
        assert spec.ssm_shape == (config.nheads, config.head_dim, config.d_state)
        assert spec.kernel_width == 4 and spec.ssm_dtype == torch.bfloat16
        assert config.n_attn >= 1
    c = tiny()
    assert [c.mamba_index(i) for i in c.mamba_layers] == list(range(c.n_mamba))
    assert [c.attn_index(i) for i in c.attn_layers] == list(range(c.n_attn))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": ("attn",)}, "at least one mamba layer"),
        ({"layers": ("attn", "attn")}, "at least one mamba layer"),
        ({"layers": ("mamba", "moe")}, "layer kinds"),
        ({"layers": ("mamba", "mlp")}, "'mlp' layers need block='single'"),
        ({"block": "parallel"}, "block must be one of"),
        ({"mlp_kind": "gelu"}, "mlp_kind must be one of"),
        ({"attn_kv_heads": 3}, "attn_kv_heads must divide"),
        ({"attn_kv_heads": 0}, "attn_kv_heads must divide"),
        ({"attn_kv_heads": True}, "attn_kv_heads must be an int or None"),
        ({"rotary_dim": 5}, "rotary_dim must be even"),
        ({"rotary_dim": 18}, "rotary_dim must be even and in"),
        ({"norm_groups": 5}, "norm_groups must divide d_inner"),
        ({"attn_scale": 0.0}, "attn_scale must be a finite positive number"),
        ({"residual_scale": float("nan")}, "residual_scale must be a finite positive number"),
        ({"dt_min": 0.5, "dt_max": 0.1}, "dt bounds"),
        ({"dt_min": -1.0}, "dt bounds"),
        ({"tie_embeddings": 1}, "tie_embeddings must be a bool"),
        ({"ngroups": 3}, "not a multiple of ngroups"),
        ({"attn_head_dim": 15}, "even"),
        ({"d_model": 0}, "d_model must be positive"),
    ],
)
def test_bad_configs_are_rejected(changes: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "d_model": 32, "layers": ("mamba", "attn"), "nheads": 4, "head_dim": 8, "d_state": 8,
        "attn_heads": 2, "attn_head_dim": 16, "mlp_hidden": 64,
    }
    with pytest.raises(ValueError, match=message):
        HybridConfig(**{**base, **changes})  # type: ignore[arg-type]  # the point is bad values


def test_init_is_deterministic_and_shaped() -> None:
    config = tiny()
    a, b, c = init_weights(config, 0), init_weights(config, 0), init_weights(config, 1)
    assert {n: tuple(t.shape) for n, t in a.items()} == weight_shapes(config)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed"], c["embed"])
    assert all(torch.isfinite(t).all() for t in a.values())


def test_perturb() -> None:
    weights = init_weights(tiny(), 0)
    originals = {n: t.clone() for n, t in weights.items()}
    same = perturb(weights, 0.0, seed=3)
    assert all(torch.equal(same[n], weights[n]) for n in weights)
    p1, p1_again, p2 = perturb(weights, 0.1, seed=3), perturb(weights, 0.1, seed=3), perturb(weights, 0.1, seed=4)
    assert all(torch.equal(p1[n], p1_again[n]) for n in weights)
    assert all(not torch.equal(p1[n], p2[n]) for n in weights)
    assert all(torch.equal(weights[n], originals[n]) for n in weights), "perturb must not modify its input"
    w = weights["layers.0.mixer.in_proj"]
    relative = float((p1["layers.0.mixer.in_proj"] - w).square().mean().sqrt() / w.square().mean().sqrt())
    assert 0.08 < relative < 0.12
    with pytest.raises(ValueError, match="non-negative"):
        perturb(weights, -0.1, seed=0)


def test_model_rejects_mismatched_weights_and_pools() -> None:
    config = tiny()
    weights = init_weights(config, 0, device=DEVICE)
    del weights["lm_head"]
    with pytest.raises(ValueError, match="missing"):
        HybridModel(config, weights)
    model = tiny_model()
    wrong = MambaStatePool(DRAFT_POOL, small().pool_layout(), 4, device=DEVICE)
    be = Backend(model)
    with pytest.raises(ValueError, match="layout does not match"):
        model.decode(wrong, be.kv, be.table, slots=ids([1]), input_ids=ids([1]), positions=ids([0]), kv_locs=ids([1]))


def test_entry_points_check_their_arguments() -> None:
    model = tiny_model()
    be = Backend(model)
    common = {"cu_seqlens": ids([0, 3]), "input_ids": ids([1, 2, 3]), "kv_locs": ids([1, 2, 3])}
    with pytest.raises(ValueError, match="positions must be prefix_lens"):
        model.extend(be.pool, be.kv, be.table, slots=ids([1]), prefix_lens=ids([0]), positions=ids([0, 1, 3]), **common)
    with pytest.raises(ValueError, match="repeats slots"):
        model.decode(be.pool, be.kv, be.table, slots=ids([1, 1]), input_ids=ids([1, 2]), positions=ids([0, 0]),
                     kv_locs=ids([1, 2]))
    with pytest.raises(ValueError, match="consecutive"):
        model.verify(be.pool, be.kv, be.table, slots=ids([1]), input_ids=grid([[1, 2]]),
                     positions=grid([[0, 2]]), kv_locs=grid([[1, 2]]))
    with pytest.raises(ValueError, match="int64"):
        model.decode(be.pool, be.kv, be.table, slots=ids([1]), input_ids=ids([1]).int(), positions=ids([0]),
                     kv_locs=ids([1]))


def test_token_table_copy_prefix() -> None:
    table = TokenTable(4, 8, device=DEVICE)
    table.write(ids([2, 2, 2]), ids([0, 1, 2]), ids([7, 8, 9]))
    table.copy_prefix(2, 3, 2)
    assert table.table[3].tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert table.rows(ids([2, -1]), 3).tolist() == [[7, 8, 9], [0, 0, 0]]
    with pytest.raises(ValueError, match="out of range"):
        table.copy_prefix(2, 5, 1)


def test_empty_batches_are_no_ops() -> None:
    model = tiny_model()
    be = Backend(model)
    none, none2 = ids([]), grid([[], []])[:0].reshape(0, 2)
    before = be.pool.copy_buffer()
    assert model.decode(be.pool, be.kv, be.table, slots=none, input_ids=none, positions=none, kv_locs=none).logits.shape == (0, 256)
    out = model.extend(be.pool, be.kv, be.table, slots=none, cu_seqlens=ids([0]), prefix_lens=none, input_ids=none,
                       positions=none, kv_locs=none)
    assert out.logits.shape == (0, 256)
    ver = model.verify(be.pool, be.kv, be.table, slots=none, input_ids=none2, positions=none2, kv_locs=none2)
    assert ver.logits.shape == (0, 2, 256)
    model.commit(be.pool, ver.states, accept_pos=none, slots=none)
    tokens = model.propose(be.pool, be.kv, be.table, slots=none, input_ids=none, positions=none, kv_locs=none2, k=2)
    assert tokens.shape == (0, 2)
    assert torch.equal(be.pool.buffer, before)
