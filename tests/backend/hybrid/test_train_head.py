"""``batchc train-draft`` (``backend.tools.train_head``): a tiny run on a tiny random target learns,
an interrupted run resumed ends bit for bit where the uninterrupted run ends, the held-out
acceptance is computed right where the answer is known, and the command line refuses bad input in
one line with exit status 2."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from backend.hybrid import HybridModel, tiny
from backend.hybrid.head import HeadConfig, HeadModel, read_head
from backend.tools.train_head import (
    HeadTrainSettings,
    TokenCorpus,
    TrainError,
    acceptance_summary,
    chain_fractions,
    chain_matches,
    head_forward,
    resume_path,
    rollouts,
    token_corpus,
    train_head,
)
from tests.helpers import run_cli

SOURCE = (
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "import os\nimport sys\n\nfor i in range(10):\n    print(i)\n"
)
SETTINGS = HeadTrainSettings(steps=24, layers="mamba", batch=4, prompt_len=8, seq_len=24, sequences=8, held_out_sequences=2, gen_batch=8,
                             lr=1e-2, warmup=2, checkpoint_every=5, eval_stride=4)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stdlib")
    for i in range(10):  # the 10th file is held out
        (path / f"m{i:02d}.py").write_text(SOURCE.replace("10", str(i)) * 3)
    return path


@pytest.fixture(scope="module")
def corpus(root: Path) -> TokenCorpus:
    return token_corpus(None, 256, root)


@pytest.fixture(scope="module")
def target() -> HybridModel:
    return HybridModel.from_seed(tiny(), 3)


def _silent(line: str) -> None:
    del line


def test_the_corpus_is_the_stdlib_split(corpus: TokenCorpus) -> None:
    assert corpus.train.dtype == torch.int64 and corpus.held_out.numel() == len((SOURCE.replace("10", "9") * 3).encode())
    assert "9 files" in corpus.description and "1 files" in corpus.description


def test_rollouts_are_the_targets_greedy_continuations(target: HybridModel) -> None:
    from backend.hybrid.reference import reference_hidden, reference_logits

    prompts = torch.tensor([[10, 20, 30, 40], [50, 60, 70, 80], [1, 2, 3, 4]])
    data = rollouts(target, prompts, 12, batch=2)  # two batches: the second starts from a fresh pool
    assert torch.equal(data.ids[:, :4], prompts)
    for row in range(3):
        seq = data.ids[row].tolist()
        ref = reference_logits(target, seq)
        assert torch.equal(data.labels[row], ref.argmax(-1))  # greedy labels at every position ...
        assert torch.equal(data.ids[row, 4:], data.labels[row, 3:-1])  # ... and the continuation is greedy
        torch.testing.assert_close(data.hidden[row], reference_hidden(target, seq), atol=1e-4, rtol=1e-4)


def test_head_forward_equals_forward_train(target: HybridModel) -> None:
    head = HeadModel.from_seed(HeadConfig.for_target(target.config, "mamba,attn"), target, 1)
    hidden, ids = torch.randn(2, 11, 32), torch.randint(0, 256, (2, 11))
    o, logits = head_forward(head, hidden, ids)
    assert o.shape == (2, 11, 32)
    torch.testing.assert_close(logits, head.forward_train(hidden, ids), atol=0, rtol=0)


def test_chain_fractions_known_answer() -> None:
    matches = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert chain_fractions(matches) == [0.75, 0.5, 0.25, 0.25]
    summary = acceptance_summary([0.75, 0.5, 0.25, 0.25])
    assert summary["per_proposal"] == {"1": 0.75, "2": 0.625, "3": 0.5, "4": 0.4375}
    assert summary["tokens_per_verify"] == {"1": 1.75, "2": 2.25, "3": 2.5, "4": 2.75}
    with pytest.raises(ValueError, match="non-empty"):
        chain_fractions(torch.zeros((0, 4), dtype=torch.bool))


def test_chain_matches_feed_the_heads_output_back(target: HybridModel) -> None:
    """Against a per-start loop through the cache-free reference: proposal i at start c is the
    reference over x_0..x_{c+i-1} with the head's own o_{c..c+i-2} in place of h_{c..c+i-2}."""
    head = HeadModel.from_seed(HeadConfig.for_target(target.config, "mamba"), target, 2)
    data = rollouts(target, torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]), 16)
    got = chain_matches(head, data, k=3, stride=3, batch=3)
    expected = []
    for row in range(2):
        for c in range(6, 16 - 3, 3):
            ids, hidden = data.ids[row], data.hidden[row].clone()
            flags = []
            for i in range(1, 4):
                length = c + i
                logits = head.reference(hidden[:length], ids[:length])
                flags.append(int(logits[-1].argmax()) == int(ids[c + i]))
                o, _ = head_forward(head, hidden[None, :length], ids[None, :length])
                hidden[c + i - 1] = o[0, c + i - 1]
            expected.append(flags)
    assert got.tolist() == expected


def test_a_tiny_run_learns(target: HybridModel, corpus: TokenCorpus, tmp_path: Path) -> None:
    out = tmp_path / "head.safetensors"
    result = train_head(target, corpus, attrs.evolve(SETTINGS, eval_every=12), out, log=_silent)
    assert [step for step, _ in result.evals] == [12]  # and the final figure, below
    first, last = sum(result.losses[:4]) / 4, sum(result.losses[-4:]) / 4
    assert last < 0.8 * first, (first, last)
    config, weights, meta = read_head(out)
    assert config == result.config and config.layers == ("mamba",)
    assert all(torch.equal(weights[n], result.weights[n].float()) for n in weights)
    assert '"complete": true' in meta["training"] and '"held_out_acceptance": {"chain"' in meta["training"]
    assert resume_path(out).is_file()


class _Stop(Exception):
    pass


@pytest.mark.parametrize("hidden_dropout", [0.0, 0.5])
def test_resume_continues_to_the_uninterrupted_result(hidden_dropout: float, target: HybridModel, corpus: TokenCorpus, tmp_path: Path) -> None:
    """With hidden dropout too: its masks come from the batch generator, whose state the resume keeps."""
    settings = attrs.evolve(SETTINGS, steps=8, checkpoint_every=3, hidden_dropout=hidden_dropout)
    whole = train_head(target, corpus, settings, tmp_path / "whole.safetensors", log=_silent)

    out = tmp_path / "cut.safetensors"

    def stop_at_7(phase: str, done: int, total: int) -> None:
        if phase == "train" and done == 7:
            raise _Stop  # as SIGINT would, between two checkpoints (written at 3 and 6)

    with pytest.raises(_Stop):
        train_head(target, corpus, settings, out, log=_silent, progress=stop_at_7)
    assert '"steps_done": 6' in read_head(out)[2]["training"]
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left
    resumed = train_head(target, corpus, settings, out, resume=True, log=_silent)
    assert resumed.losses == whole.losses
    assert all(torch.equal(resumed.weights[n], whole.weights[n]) for n in whole.weights)
    assert resumed.acceptance == whole.acceptance

    with pytest.raises(TrainError, match="seed"):  # a resume state from other settings is refused by name
        train_head(target, corpus, attrs.evolve(settings, seed=1), out, resume=True, log=_silent)


def test_hidden_dropout_reaches_the_training_forward_and_is_bounded(target: HybridModel, corpus: TokenCorpus, tmp_path: Path) -> None:
    """The same seed draws the same first batch; dropping half the hidden inputs changes its loss
    (with none dropped the run is the plain one), and a fraction outside [0, 1) is refused by name."""
    runs = {p: train_head(target, corpus, attrs.evolve(SETTINGS, steps=2, hidden_dropout=p), tmp_path / f"h{p}.safetensors", log=_silent)
            for p in (0.0, 0.5)}
    plain = train_head(target, corpus, attrs.evolve(SETTINGS, steps=2), tmp_path / "plain.safetensors", log=_silent)
    assert runs[0.0].losses == plain.losses and runs[0.5].losses[0] != plain.losses[0]
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"^hidden_dropout must be in \[0, 1\), got"):
            HeadTrainSettings(hidden_dropout=bad)


def test_a_hugging_face_target_directory(root: Path, tmp_path: Path) -> None:
    """The corpus through the checkpoint's tokenizer.json, the hidden states from its own forward."""
    from backend.hybrid.head import load_head
    from backend.tools.hf_random import save_hf_model, save_tokenizer
    from compiler.offline.models import load_served

    directory = tmp_path / "hf"
    directory.mkdir()
    save_hf_model("granitemoehybrid", directory, vocab_size=320)
    save_tokenizer(directory, vocab_size=320)
    served = load_served(str(directory), role="target", dtype=torch.float32, bundled="target")
    corpus = token_corpus(served.tokenizer.encode, served.model.config.vocab, root)
    assert corpus.train.numel() < len(SOURCE) * 27  # BPE tokens, not bytes
    out = tmp_path / "head.safetensors"
    result = train_head(served.model, corpus, attrs.evolve(SETTINGS, steps=8, layers="mamba,attn"), out, log=_silent)
    assert sum(result.losses[-3:]) < sum(result.losses[:3])
    head = load_head(out, served.model)
    assert head.config.d_model == served.model.config.d_model == 64 and head.config.vocab == 320
    assert result.acceptance is not None and set(result.acceptance) == {"chain", "per_proposal", "tokens_per_verify"}


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--layers", "mamba,foo"], "argument --layers: expected layer kinds mamba or attn separated by commas, got 'mamba,foo' (the kind 'foo')"),
        (["--layers", ""], "argument --layers: expected 1 to 64 printable ASCII characters without spaces, got ''"),
        (["--minutes", "0"], "argument --minutes: expected a finite number in (0, 10080), got 0"),
        (["--target", "/nonexistent/t.safetensors"], "/nonexistent/t.safetensors: no such checkpoint file"),
        (["--resume"], "--resume: no resume state"),
        (["--sequences", "60000", "--seq-len", "4096"], "the rollouts would hold 93850 MiB in memory, over the bound of 8192 MiB"),
        (["--seq-len", "68"], "--seq-len 68: a rollout needs more than the 64-token prompt and k = 4 proposals (at least 69)"),
        (["--hidden-dropout", "1"], "argument --hidden-dropout: expected a finite number in [0, 1), got 1"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run_cli(["train-draft", "--out", str(tmp_path / "h.safetensors"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and said in err, err
    assert not (tmp_path / "h.safetensors").exists()


def test_an_interruption_names_the_last_checkpoint() -> None:
    import argparse

    from compiler.cli import _interrupted_line
    from compiler.cli import train as cli_train

    args = argparse.Namespace(command="train-draft")
    cli_train.saved.clear()
    assert _interrupted_line(args, 2) == "batchc: train-draft interrupted by SIGINT; no checkpoint written yet"
    cli_train.saved.extend([("h.safetensors", 50, 300), ("h.safetensors", 100, 300)])
    assert _interrupted_line(args, 15) == (
        "batchc: train-draft interrupted by SIGTERM; --out 'h.safetensors' holds step 100 of 300 (continue with --resume)"
    )
    cli_train.saved.clear()


def test_cli_refuses_a_bad_out_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["train-draft", "--steps", "5"]) == 2
    assert capsys.readouterr().err == "batchc: error: --out FILE is required: the head checkpoint to write\n"
    for out, said in ((str(tmp_path), "is a directory"), ("-", "a checkpoint is a file"), (str(tmp_path / "no" / "h"), "no such directory")):
        assert run_cli(["train-draft", "--out", out]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and said in err, err
