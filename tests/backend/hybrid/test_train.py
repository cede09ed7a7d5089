"""The training forward computes the same function as ``reference_logits``; a tiny training run
lowers the loss and is reproducible from its seed; the helpers of the training script."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from backend.hybrid import HybridModel, init_weights, tiny
from backend.hybrid.checkpoint import load_checkpoint, read_checkpoint
from backend.hybrid.config import HybridConfig
from backend.hybrid.functional import forward_logits, ssd_scan
from backend.hybrid.presets import trained_draft, trained_target
from backend.hybrid.reference import reference_logits
from backend.tools.train import (
    TrainSettings,
    bits_per_byte,
    bytes_tensor,
    sample_batch,
    stdlib_corpus,
    tokens_per_round,
    train,
)
from tests.helpers import REPO

ATOL = RTOL = 1e-4

TEXT = (
    b"def add(a, b):\n    return a + b\n\n\n"
    b"class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    b"import os\nimport sys\n\nfor i in range(10):\n    print(i)\n"
) * 8


def _sequences(n: int, length: int, seed: int) -> list[list[int]]:
    data = bytes_tensor(TEXT)
    gen = torch.Generator().manual_seed(seed)
    return sample_batch(data, n, length - 1, gen).tolist()  # type: ignore[no-any-return]


# ---- the training forward equals the reference ---------------------------------------------------------


@pytest.mark.parametrize(("length", "chunk"), [(1, None), (19, None), (40, 8), (40, 7), (33, 64), (24, 1)])
def test_forward_matches_reference_tiny(length: int, chunk: int | None) -> None:
    model = HybridModel.from_seed(tiny(), 5)
    seqs = _sequences(3, length, seed=length)
    logits = forward_logits(model.config, model.weights, torch.tensor(seqs), chunk=chunk)
    assert logits.shape == (3, length, 256)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], reference_logits(model, seq), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("config", [trained_target(), trained_draft()], ids=["target", "draft"])
def test_forward_matches_reference_presets(config: HybridConfig) -> None:
    model = HybridModel.from_seed(config, 1)
    seqs = _sequences(2, 70, seed=2)  # two chunks of 64 and a ragged one
    logits = forward_logits(config, model.weights, torch.tensor(seqs))
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], reference_logits(model, seq), atol=ATOL, rtol=RTOL)


def test_forward_matches_reference_trained_weights() -> None:
    """Trained weights have long decays (large ``dt``): the chunked scan still agrees."""
    for model in (load_checkpoint(_bundled("target")), load_checkpoint(_bundled("draft"))):
        seqs = _sequences(2, 150, seed=9)
        logits = forward_logits(model.config, model.weights, torch.tensor(seqs))
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(logits[row], reference_logits(model, seq), atol=ATOL, rtol=RTOL)


def _bundled(name: str) -> Path:
    return REPO / "backend" / "hybrid" / "weights" / f"{name}.safetensors"


def test_ssd_scan_matches_a_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    b, length, H, P, N = 2, 13, 3, 4, 5
    x = torch.randn(b, length, H, P, generator=gen)
    dt = torch.rand(b, length, H, generator=gen) * 2
    A = -torch.rand(H, generator=gen) * 4
    B = torch.randn(b, length, H, N, generator=gen)
    C = torch.randn(b, length, H, N, generator=gen)
    state = torch.zeros(b, H, P, N)
    ys = []
    for t in range(length):
        state = state * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    expected = torch.stack(ys, dim=1)
    for chunk in (1, 4, 5, 13, 100):
        torch.testing.assert_close(ssd_scan(x, dt, A, B, C, chunk), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        ssd_scan(x, dt, A, B, C, 0)


def test_forward_rejects_bad_tokens() -> None:
    weights = init_weights(tiny(), 0)
    with pytest.raises(ValueError, match="int64"):
        forward_logits(tiny(), weights, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one"):
        forward_logits(tiny(), weights, torch.zeros(2, 0, dtype=torch.int64))


def test_gradients_reach_every_weight() -> None:
    params = {k: v.requires_grad_(True) for k, v in init_weights(tiny(), 0).items()}
    tokens = torch.tensor(_sequences(2, 20, seed=1))
    logits = forward_logits(tiny(), params, tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()  # type: ignore[no-untyped-call]
    for name, p in params.items():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and bool(p.grad.abs().sum() > 0), name


# ---- training ---------------------------------------------------------------------------------------------

SETTINGS = TrainSettings(steps=40, batch=4, seq_len=32, lr=1e-2, warmup=5, seed=7, log_every=20)


def test_tiny_training_lowers_the_loss_and_is_reproducible() -> None:
    data = bytes_tensor(TEXT)
    logs: list[str] = []
    first = train(tiny(), data, SETTINGS, log=logs.append)
    second = train(tiny(), data, SETTINGS, log=lambda _: None)
    assert len(first.losses) == SETTINGS.steps and not first.stopped_early
    assert sum(first.losses[-5:]) / 5 < 0.6 * sum(first.losses[:5]) / 5
    assert first.losses == second.losses
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)
    assert [line.split(" loss")[0] for line in logs] == ["[model] step 20/40", "[model] step 40/40"]
    other = train(tiny(), data, TrainSettings(steps=3, batch=4, seq_len=32, seed=8), log=lambda _: None)
    assert other.losses[0] != first.losses[0]
    # the trained weights evaluate better than the initial ones
    before = bits_per_byte(tiny(), init_weights(tiny(), SETTINGS.seed), data, seq_len=32, windows=8)
    after = bits_per_byte(tiny(), first.weights, data, seq_len=32, windows=8)
    assert after < before - 1.0


def test_deadline_stops_early() -> None:
    result = train(tiny(), bytes_tensor(TEXT), SETTINGS, deadline=0.0, log=lambda _: None)
    assert result.stopped_early and len(result.losses) == 1


def test_lr_schedule() -> None:
    s = TrainSettings(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(55) == pytest.approx(0.55)
    assert s.lr_at(99) == pytest.approx(0.1, abs=1e-3)


def test_sample_batch() -> None:
    data = bytes_tensor(bytes(range(100)))
    rows = sample_batch(data, 3, 9, torch.Generator().manual_seed(0))
    assert rows.shape == (3, 10) and rows.dtype == torch.int64
    for row in rows.tolist():
        assert row == list(range(row[0], row[0] + 10))
    with pytest.raises(ValueError, match="too short"):
        sample_batch(data, 1, 99, torch.Generator())


def test_stdlib_corpus_split(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"m{i:02d}.py").write_bytes(f"x = {i}\n".encode())
    (tmp_path / "notes.txt").write_bytes(b"ignored")
    corpus = stdlib_corpus(tmp_path)
    assert bytes(corpus.held_out.tolist()) == b"x = 9\n\nx = 19\n"
    assert b"x = 0\n" in bytes(corpus.train.tolist()) and b"x = 9\n" not in bytes(corpus.train.tolist())
    assert "18 files" in corpus.description and "2 files" in corpus.description
    with pytest.raises(ValueError, match="too few"):
        stdlib_corpus(tmp_path / "m00.py")


def test_tokens_per_round() -> None:
    assert tokens_per_round([True] * 8, 4) == 5.0  # each verify: 4 accepted plus the target's token
    assert tokens_per_round([False] * 6, 4) == 1.0
    assert tokens_per_round([True, False, True, True], 4) == 2.0  # one full round: 1 accepted + 1
    assert tokens_per_round([True, False, True, True, True, True, False, True], 4) == pytest.approx(3.5)  # 2, then 4 + 1
    assert math.isclose(tokens_per_round([], 4), 0.0)


def test_script_writes_loadable_checkpoints(tmp_path: Path) -> None:
    from backend.tools.train import main

    threads = torch.get_num_threads()
    try:
        assert main(["--out", str(tmp_path), "--target-steps", "1", "--draft-steps", "1", "--no-eval"]) == 0
    finally:
        torch.set_num_threads(threads)
    target = load_checkpoint(tmp_path / "target.safetensors")
    draft = load_checkpoint(tmp_path / "draft.safetensors")
    assert target.config == trained_target() and draft.config == trained_draft()
    assert '"steps_done": 1' in read_checkpoint(tmp_path / "target.safetensors")[2]["training"]
