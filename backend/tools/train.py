r"""Train the bundled byte-level target and draft models on the Python standard library's source.

Run ``python -m backend.tools.train --out DIR [--minutes M] [--seed S]``; it writes
``DIR/target.safetensors`` and ``DIR/draft.safetensors`` (``backend.hybrid.checkpoint`` format,
with the training settings and losses in the metadata ``training``) and logs to stderr.

Data: the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``, sorted by name; every
10th file (index 9, 19, ...) is held out, the rest is the training text (files joined by a
newline). Bytes are tokens (vocab 256), the task is next-byte prediction. The corpus depends on
the Python installation (3.11.7 here: 168 files, 4.7 MB).

Training: ``init_weights(config, seed)``, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices
only), linear warm-up then cosine decay to a tenth of the peak rate, gradient clipping at 1,
random 256-byte windows (``torch.Generator`` seeded from the seed), a fixed number of steps, two
CPU threads. The forward is ``backend.hybrid.functional.forward_logits`` (the same function as
``HybridModel``; the tests compare it with ``reference_logits``). With the same seed, Python and
torch build, a run is reproducible step for step; ``--minutes`` is only a safety cap (if a model
hits its share of it, its training stops early and a warning is logged).

Presets: ``backend.hybrid.presets.trained_target()`` (4 layers, d_model 96, 572,310 parameters)
and ``trained_draft()`` (2 Mamba layers and no attention, d_model 64, 154,584 parameters).

The shipped run (``--seed 0``, the default steps, 2 CPU cores, Python 3.11.7, torch 2.13 CPU),
in ``backend/hybrid/weights/`` (2.2 MB + 0.6 MB, float32)::

    model   steps  train time  train bits/byte  held-out bits/byte
    target  1000   297 s       1.503            2.000
    draft   1500   175 s       1.739            2.074
    both models with their loss evaluations: 473 s; the whole script with the
    agreement measurement and samples: 8 min 10 s

    draft vs target greedy agreement (``reference_logits``, teacher-forced, 8 x 256 held-out bytes):
    0.708, i.e. 2.89 tokens per target verify with 4 draft tokens; on the target's own greedy
    continuations of held-out prefixes: 0.711, 2.95 tokens per verify.

    greedy samples (target, then draft):
    'def __init__(self, other):\n            return self.__class__\n\n    def __init__(self,'
    'def tests and the state the state the state the state the state the state the state '
    '    if self._set_text is not None:\n            return self._set_prefixlen(self._file, s'
    '    if not self._signature_name = self._signature_names():\n            return self._sel'

The target's weights are bit-identical to those of the previous shipped run (which trained the
earlier attention draft; the target trains first and from its own seed); only the train time of a
run varies with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from backend.hybrid.checkpoint import DRAFT_FILE, TARGET_FILE, save_checkpoint
from backend.hybrid.config import HybridConfig
from backend.hybrid.functional import forward_logits
from backend.hybrid.model import HybridModel
from backend.hybrid.presets import trained_draft, trained_target
from backend.hybrid.reference import greedy_generate_reference, reference_logits
from backend.hybrid.weights import Weights, init_weights

LN2 = math.log(2.0)
Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- data -----------------------------------------------------------------------------------------------


@attrs.frozen
class Corpus:
    """Byte streams (``uint8``) for training and held-out evaluation."""

    train: torch.Tensor
    held_out: torch.Tensor
    description: str


def stdlib_corpus(root: Path | None = None, *, held_out_every: int = 10) -> Corpus:
    """The top-level ``*.py`` files of the standard library (sorted); every ``held_out_every``-th held out."""
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = sorted(base.glob("*.py"))
    if len(files) < held_out_every:
        raise ValueError(f"too few *.py files under {base} ({len(files)})")
    train: list[bytes] = []
    held: list[bytes] = []
    for index, path in enumerate(files):
        (held if index % held_out_every == held_out_every - 1 else train).append(path.read_bytes())
    train_bytes, held_bytes = b"\n".join(train), b"\n".join(held)
    description = (
        f"stdlib top-level *.py of Python {sys.version.split()[0]}: {len(train)} files / {len(train_bytes)} bytes train, "
        f"{len(held)} files / {len(held_bytes)} bytes held out"
    )
    return Corpus(train=bytes_tensor(train_bytes), held_out=bytes_tensor(held_bytes), description=description)


def bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, seq_len + 1]`` int64 random windows of ``data``."""
    if data.numel() < seq_len + 2:
        raise ValueError(f"data of {data.numel()} bytes is too short for windows of {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=gen)
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


# ---- training -----------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TrainSettings:
    steps: int
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 50

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@attrs.frozen
class TrainResult:
    weights: Weights
    losses: tuple[float, ...]  # per step, nats per byte
    seconds: float
    stopped_early: bool


def train(
    config: HybridConfig,
    data: torch.Tensor,
    settings: TrainSettings,
    *,
    deadline: float | None = None,
    log: Log = _stderr,
    name: str = "model",
) -> TrainResult:
    """Train ``config`` from ``init_weights(config, settings.seed)`` on random windows of ``data``.

    Deterministic in the settings (for a fixed torch build and thread count); ``deadline`` is a
    ``time.monotonic()`` value after which training stops early."""
    start = time.monotonic()
    # exp of long decays gives denormal floats, which make CPU kernels ~10x slower
    flushed = torch.set_flush_denormal(True)
    try:
        return _train(config, data, settings, deadline=deadline, log=log, name=name, start=start)
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def _train(
    config: HybridConfig, data: torch.Tensor, settings: TrainSettings, *, deadline: float | None, log: Log, name: str, start: float
) -> TrainResult:
    params = {k: v.clone().requires_grad_(True) for k, v in init_weights(config, settings.seed).items()}
    decayed = [p for _, p in sorted(params.items()) if p.dim() == 2]
    plain = [p for _, p in sorted(params.items()) if p.dim() != 2]
    opt = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": settings.weight_decay}, {"params": plain, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(settings.seed + 1)
    losses: list[float] = []
    stopped = False
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = settings.lr_at(step)
        batch = sample_batch(data, settings.batch, settings.seq_len, gen)
        logits = forward_logits(config, params, batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(list(params.values()), settings.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if done % settings.log_every == 0 or done == settings.steps:
            recent = losses[-settings.log_every :]
            log(
                f"[{name}] step {done}/{settings.steps} loss {sum(recent) / len(recent) / LN2:.3f} bits/byte "
                f"lr {settings.lr_at(step):.2e} {time.monotonic() - start:.0f}s"
            )
        if deadline is not None and time.monotonic() > deadline and done < settings.steps:
            log(f"[{name}] WARNING: time budget reached, stopping at step {done}/{settings.steps} (not the reproducible run)")
            stopped = True
            break
    weights = {k: v.detach().clone() for k, v in params.items()}
    return TrainResult(weights=weights, losses=tuple(losses), seconds=time.monotonic() - start, stopped_early=stopped)


@torch.no_grad()
def bits_per_byte(
    config: HybridConfig, weights: Weights, data: torch.Tensor, *, seq_len: int = 256, windows: int = 64, batch: int = 16
) -> float:
    """Mean next-byte cross-entropy in bits over ``windows`` evenly spaced windows of ``data``."""
    starts = torch.linspace(0, data.numel() - seq_len - 1, windows).long()
    total, count = 0.0, 0
    for i in range(0, windows, batch):
        rows = data[starts[i : i + batch, None] + torch.arange(seq_len + 1)].long()
        logits = forward_logits(config, weights, rows[:, :-1])
        total += float(F.cross_entropy(logits.reshape(-1, config.vocab), rows[:, 1:].reshape(-1), reduction="sum"))
        count += rows[:, 1:].numel()
    return total / count / LN2


# ---- evaluation of the pair -------------------------------------------------------------------------------


def _argmax_reference(model: HybridModel, tokens: list[int]) -> list[int]:
    return [int(t) for t in reference_logits(model, tokens).argmax(dim=-1)]


def teacher_forced_agreement(target: HybridModel, draft: HybridModel, sequences: Sequence[list[int]]) -> list[list[bool]]:
    """Per sequence and position: do the target's and the draft's greedy next bytes agree
    (both fed the same prefix, through ``reference_logits``)?"""
    return [
        [a == b for a, b in zip(_argmax_reference(target, seq), _argmax_reference(draft, seq), strict=True)]
        for seq in sequences
    ]


def tokens_per_round(matches: Sequence[bool], k: int) -> float:
    """Greedy speculative decoding with ``k`` draft tokens per round along a sequence whose
    draft/target agreement flags are ``matches``: the mean number of tokens each target verify
    emits (accepted drafts plus the target's own next token), ``1 .. k + 1``. Only rounds with
    all ``k`` flags inside the sequence count (no truncated last round); ``0.0`` if there is none."""
    i, rounds, emitted = 0, 0, 0
    while i + k <= len(matches):
        accepted = 0
        while accepted < k and matches[i + accepted]:
            accepted += 1
        rounds += 1
        emitted += accepted + 1
        i += accepted + 1
    return emitted / rounds if rounds else 0.0


def evaluate_pair(
    target: HybridModel, draft: HybridModel, held_out: torch.Tensor, *, windows: int = 8, length: int = 256, k: int = 4
) -> dict[str, float]:
    """Draft-vs-target greedy agreement on held-out text, and on the target's own greedy
    continuations of held-out prefixes (the sequence speculative decoding actually walks)."""
    starts = torch.linspace(0, held_out.numel() - length - 1, windows).long().tolist()
    texts = [held_out[s : s + length].tolist() for s in starts]
    flags = teacher_forced_agreement(target, draft, texts)
    flat = [f for row in flags for f in row]
    # the target's greedy path: 64 greedy bytes after 64 bytes of held-out text
    paths = []
    for text in texts[: max(1, windows // 2)]:
        prompt = text[:64]
        paths.append(prompt + greedy_generate_reference(target, prompt, 64))
    path_flags = [row[63:-1] for row in teacher_forced_agreement(target, draft, paths)]  # predictions of generated bytes
    path_flat = [f for row in path_flags for f in row]
    return {
        "held_out_agreement": sum(flat) / len(flat),
        "held_out_tokens_per_round": sum(tokens_per_round(row, k) for row in flags) / len(flags),
        "greedy_path_agreement": sum(path_flat) / len(path_flat),
        "greedy_path_tokens_per_round": sum(tokens_per_round(row, k) for row in path_flags) / len(path_flags),
        "k": float(k),
    }


def sample(model: HybridModel, prompt: str, n: int = 80) -> str:
    """``prompt`` and ``n`` greedy bytes (decoded leniently)."""
    data = list(prompt.encode())
    return bytes(data + greedy_generate_reference(model, data, n)).decode("utf-8", errors="replace")


# ---- the script ---------------------------------------------------------------------------------------------

TARGET_SETTINGS = TrainSettings(steps=1000, lr=3e-3)
DRAFT_SETTINGS = TrainSettings(steps=1500, lr=4e-3)


def _train_one(
    name: str, config: HybridConfig, settings: TrainSettings, corpus: Corpus, out: Path, deadline: float
) -> tuple[HybridModel, dict[str, object]]:
    n_params = sum(math.prod(t.shape) for t in init_weights(config, 0).values())
    _stderr(f"[{name}] {n_params} parameters, {settings}")
    result = train(config, corpus.train, settings, deadline=deadline, name=name)
    stats: dict[str, object] = {
        "settings": attrs.asdict(settings),
        "parameters": n_params,
        "steps_done": len(result.losses),
        "stopped_early": result.stopped_early,
        "train_seconds": round(result.seconds, 1),
        "train_bpb": round(bits_per_byte(config, result.weights, corpus.train), 4),
        "held_out_bpb": round(bits_per_byte(config, result.weights, corpus.held_out), 4),
        "corpus": corpus.description,
        "torch": torch.__version__,
    }
    _stderr(f"[{name}] done: {json.dumps(stats)}")
    save_checkpoint(out / (TARGET_FILE if name == "target" else DRAFT_FILE), config, result.weights, metadata={"training": json.dumps(stats)})
    return HybridModel(config, result.weights), stats


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.tools.train", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="directory for target.safetensors and draft.safetensors")
    parser.add_argument("--minutes", type=float, default=10.0, help="safety cap on the training time of both models")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=TARGET_SETTINGS.steps)
    parser.add_argument("--draft-steps", type=int, default=DRAFT_SETTINGS.steps)
    parser.add_argument("--no-eval", action="store_true", help="skip the agreement measurement and samples")
    parser.add_argument("--report", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    corpus = stdlib_corpus()
    _stderr(corpus.description)
    start = time.monotonic()
    budget = 60.0 * args.minutes
    target, target_stats = _train_one(
        "target",
        trained_target(),
        attrs.evolve(TARGET_SETTINGS, steps=args.target_steps, seed=args.seed),
        corpus,
        args.out,
        start + 0.85 * budget,
    )
    draft, draft_stats = _train_one(
        "draft",
        trained_draft(),
        attrs.evolve(DRAFT_SETTINGS, steps=args.draft_steps, seed=args.seed + 1000),
        corpus,
        args.out,
        start + budget,
    )
    total = time.monotonic() - start
    _stderr(f"training (both models, with the loss evaluations) took {total:.0f}s")
    report: dict[str, object] = {"target": target_stats, "draft": draft_stats, "total_seconds": round(total, 1)}
    if not args.no_eval:
        report["acceptance"] = evaluate_pair(target, draft, corpus.held_out)
        _stderr(f"acceptance: {json.dumps(report['acceptance'])}")
        samples = {}
        for prompt in ("def ", "import ", "class ", "    if "):
            samples[prompt] = {"target": sample(target, prompt), "draft": sample(draft, prompt)}
            _stderr(f"target {samples[prompt]['target']!r}\ndraft  {samples[prompt]['draft']!r}")
        report["samples"] = samples
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
