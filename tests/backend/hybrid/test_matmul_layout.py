"""``matmul_layout``: the projections stored as transposes of row-major ``[in, out]`` matrices, same
shapes and values; the loaders store them so; a model over them computes what it computes over
row-major weights (to float rounding: the matrix library may sum in another order) and saves the
same checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from backend.hybrid import HybridModel, init_weights, tiny
from backend.hybrid.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from backend.hybrid.weights import matmul_layout, projections, weight_shapes


def test_every_projection_and_only_they_change_layout_not_value() -> None:
    for config in (tiny(), attrs.evolve(tiny(), tie_embeddings=True)):
        weights = init_weights(config, 0)
        before = {n: t.clone() for n, t in weights.items()}
        laid = matmul_layout(config, weights)
        names = set(projections(config))
        assert names == {n for n, s in weight_shapes(config).items() if len(s) == 2 and not n.endswith("conv_weight")
                         and (n != "embed" or config.tie_embeddings)}
        assert ("embed" in names) == config.tie_embeddings and ("lm_head" in names) == (not config.tie_embeddings)
        for name, t in laid.items():
            assert torch.equal(t, weights[name]) and t.shape == weights[name].shape
            if name in names:
                assert t.T.is_contiguous() and not t.is_contiguous()
            else:
                assert t is weights[name]
        assert all(torch.equal(weights[n], before[n]) and weights[n].is_contiguous() for n in weights)  # the input is untouched
        again = matmul_layout(config, laid)
        assert all(again[n].data_ptr() == laid[n].data_ptr() for n in laid)  # already laid out: kept, not copied


def test_a_loaded_checkpoint_is_laid_out_and_computes_what_row_major_weights_compute(tmp_path: Path) -> None:
    config = attrs.evolve(tiny(), tie_embeddings=True)
    weights = init_weights(config, 1)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, config, weights)
    loaded = load_checkpoint(path)
    assert all(loaded.weights[n].T.is_contiguous() for n in projections(config))
    plain = HybridModel(config, weights)
    pool_a, pool_b = plain.new_pool(2), loaded.new_pool(2)
    kv_a, kv_b = plain.new_kv_cache(64), loaded.new_kv_cache(64)
    table_a, table_b = plain.new_token_table(2, 32), loaded.new_token_table(2, 32)
    ids = torch.randint(0, config.vocab, (20,), generator=torch.Generator().manual_seed(0))
    kw: dict[str, Any] = {"slots": torch.tensor([1, 2]), "cu_seqlens": torch.tensor([0, 12, 20]), "prefix_lens": torch.tensor([0, 0]),
          "input_ids": ids, "positions": torch.cat([torch.arange(12), torch.arange(8)]), "kv_locs": torch.arange(1, 21)}
    a = plain.extend(pool_a, kv_a, table_a, **kw).logits
    b = loaded.extend(pool_b, kv_b, table_b, **kw).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    step = {"slots": torch.tensor([1, 2]), "input_ids": a.argmax(-1), "positions": torch.tensor([12, 8]), "kv_locs": torch.tensor([21, 22])}
    torch.testing.assert_close(loaded.decode(pool_b, kv_b, table_b, **step).logits, plain.decode(pool_a, kv_a, table_a, **step).logits,
                               rtol=1e-5, atol=1e-5)
    # saved again, the checkpoint holds the same tensors
    save_checkpoint(tmp_path / "again.safetensors", config, loaded.weights)
    _, saved, _ = read_checkpoint(tmp_path / "again.safetensors")
    assert all(torch.equal(saved[n], weights[n]) for n in weights)
