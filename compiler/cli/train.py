"""``batchc train-draft``: train a draft head for a target (``backend.tools.train_head``).

Every input is checked before anything runs (the output path by ``check_output``; the target by
loading it; a ``--resume`` state by the tool, against this run's target, seed and settings); a bad
one is one line on stderr and exit status 2. ``saved`` records the last step whose checkpoint was
put in place, for the line an interruption prints (the checkpoint on disk is always a whole one).
Exit status: 0 when every step ran, 1 when ``--minutes`` stopped it early (the head holds the step
reached; ``--resume`` continues it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from compiler.cli.args import UsageError, shown_path
from compiler.cli.output import check_output

saved: list[tuple[str, int, int]] = []
"""``(path, step, steps)`` of the last checkpoint this process put in place."""

MAX_ROLLOUT_BYTES = 8 << 30
"""Most memory the rollouts (the target's hidden states, ids and labels) may take."""

_PHASES = {"data": "target rollouts", "train": "training", "eval": "held-out acceptance"}


def interrupted_note() -> str | None:
    """What an interruption leaves: the last checkpoint written, or None when none was."""
    if not saved:
        return None
    path, step, steps = saved[-1]
    return f"--out {shown_path(path)} holds step {step} of {steps} (continue with --resume)"


def cmd_train_draft(args: argparse.Namespace, console: Console) -> int:
    from backend.tools.train_head import BUNDLED, resume_path, token_corpus, train_head
    from compiler.offline.models import load_served

    saved.clear()
    if args.out is None:  # (not required by argparse, so that every other option parses on its own)
        raise UsageError("--out FILE is required: the head checkpoint to write")
    if args.out == "-":
        raise UsageError("--out '-': a checkpoint is a file, not stdout")
    check_output("--out", args.out)
    out = Path(args.out)
    check_output("--out", str(resume_path(out)))
    if args.resume and not resume_path(out).is_file():
        raise UsageError(f"--resume: no resume state {shown_path(str(resume_path(out)))} beside --out {shown_path(args.out)}")
    import torch

    torch.set_num_threads(args.threads)
    target = load_served(args.target, role="target", dtype=torch.float32, bundled="target")
    if args.seq_len is not None and args.seq_len <= BUNDLED.prompt_len + 4:
        raise UsageError(f"--seq-len {args.seq_len}: a rollout needs more than the {BUNDLED.prompt_len}-token prompt and k = 4 proposals "
                         f"(at least {BUNDLED.prompt_len + 5})")
    settings = attrs.evolve(
        BUNDLED, seed=args.seed, eval_every=args.eval_every,
        steps=BUNDLED.steps if args.steps is None else args.steps,
        layers=BUNDLED.layers if args.layers is None else args.layers,
        sequences=BUNDLED.sequences if args.sequences is None else args.sequences,
        seq_len=BUNDLED.seq_len if args.seq_len is None else args.seq_len,
        held_out_sequences=BUNDLED.held_out_sequences if args.held_out is None else args.held_out,
        hidden_dropout=BUNDLED.hidden_dropout if args.hidden_dropout is None else args.hidden_dropout,
        checkpoint_every=BUNDLED.checkpoint_every if args.checkpoint_every is None else args.checkpoint_every,
    )
    rows = settings.sequences + settings.held_out_sequences
    held = rows * settings.seq_len * (4 * target.model.config.d_model + 16)  # hidden float32, ids and labels int64
    if held > MAX_ROLLOUT_BYTES:
        raise UsageError(f"--sequences {settings.sequences}, --held-out {settings.held_out_sequences} and --seq-len {settings.seq_len}: "
                         f"the rollouts would hold {held >> 20} MiB in memory, over the bound of {MAX_ROLLOUT_BYTES >> 20} MiB")
    encode = None if not target.hf else target.tokenizer.encode
    corpus = token_corpus(encode, target.model.config.vocab)
    console.print(f"{target.name}; {corpus.description}", highlight=False)
    start = time.monotonic()
    deadline = None if args.minutes is None else start + 60.0 * args.minutes
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=False) as bar:
        tasks: dict[str, object] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=total)
            bar.update(tasks[phase], completed=done, total=total)  # type: ignore[arg-type]  # a TaskID, kept as object

        def on_save(step: int) -> None:
            saved.append((args.out, step, settings.steps))

        result = train_head(target.model, corpus, settings, out, resume=args.resume, deadline=deadline, progress=progress,
                            log=lambda line: bar.console.print(line, highlight=False),
                            extra_meta={"target_name": target.name}, on_save=on_save)
    losses = result.losses
    tail = losses[-50:]
    console.print(
        f"head {result.config.to_json()}\n{result.steps_done}/{settings.steps} steps, last-50 loss {sum(tail) / max(1, len(tail)):.4f} "
        f"nats/token, {result.seconds:.0f} s in all ({result.data_seconds:.0f} s of target rollouts)\n"
        f"held-out acceptance: {json.dumps(result.acceptance)}\nwritten: {args.out} and {resume_path(out)}",
        highlight=False,
    )
    if result.stopped_early:
        print(f"batchc: train-draft stopped by --minutes {args.minutes:g} at step {result.steps_done} of {settings.steps}; "
              f"--out {shown_path(args.out)} holds that step (continue with --resume)", file=sys.stderr)
        return 1
    return 0
