"""``--draft PATH`` naming a draft head checkpoint (``compiler.offline.models.load_draft``): a head
file yields a head bound to the target, a model file or ``None`` a separate draft as before, and a
head of another shape is refused naming both sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.hybrid import HybridConfig, HybridModel, tiny
from backend.hybrid.checkpoint import CheckpointError, save_checkpoint
from backend.hybrid.head import HeadConfig, init_head_weights, save_head
from compiler.offline.models import Served, ServedHead, load_draft
from compiler.offline.tokenizer import ByteTokenizer
from compiler.workload import ServeError


def _served(model: HybridModel) -> Served:
    return Served(model=model, tokenizer=ByteTokenizer(), eos=(), name="target t.safetensors", hf=False)


def test_a_head_file_is_bound_to_the_target(tmp_path: Path) -> None:
    target = HybridModel.from_seed(tiny(), 1)
    config = HeadConfig.for_target(tiny(), "mamba")
    path = tmp_path / "head.safetensors"
    save_head(path, config, init_head_weights(config, 0))
    loaded = load_draft(str(path), target=_served(target), dtype=torch.float32)
    assert isinstance(loaded, ServedHead) and loaded.head.target is target and loaded.head.config == config
    assert loaded.name == f"draft head {path}"


def test_a_model_file_is_a_separate_draft(tmp_path: Path) -> None:
    target = HybridModel.from_seed(tiny(), 1)
    path = tmp_path / "draft.safetensors"
    save_checkpoint(path, target.config, target.weights)
    loaded = load_draft(str(path), target=_served(target), dtype=torch.float32)
    assert isinstance(loaded, Served) and loaded.name == f"draft {path}"


def test_a_head_of_another_shape_is_refused(tmp_path: Path) -> None:
    small = HybridConfig(d_model=16, layers=("mamba",), nheads=2, head_dim=8, d_state=8, ngroups=2, chunk_size=8, attn_heads=2,
                         attn_head_dim=8, mlp_hidden=32)
    config = HeadConfig.for_target(small, "mamba")
    path = tmp_path / "head.safetensors"
    save_head(path, config, init_head_weights(config, 0))
    with pytest.raises(ServeError) as info:
        load_draft(str(path), target=_served(HybridModel.from_seed(tiny(), 1)), dtype=torch.float32)
    assert str(info.value) == f"draft {path}: head d_model 16 does not match the target's d_model 32 (target t.safetensors)"


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        load_draft(str(tmp_path / "nope.safetensors"), target=_served(HybridModel.from_seed(tiny(), 1)), dtype=torch.float32)
