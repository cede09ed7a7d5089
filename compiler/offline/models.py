"""The models ``batchc run`` serves and the text they speak: the bundled byte-level models, a
batchc checkpoint file, or a Hugging Face checkpoint directory (``backend.hf``) with its
``tokenizer.json``; and the ``--outputs`` lines of a run."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

import attrs
import torch

from backend.hybrid.config import HybridConfig
from backend.hybrid.head import HeadModel
from backend.hybrid.model import HybridModel
from compiler.engine.nonfinite import ERROR_MESSAGE
from compiler.offline.stops import scan
from compiler.offline.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from compiler.workload import Request, ServeError
from ir.ids import RequestId

__all__ = [
    "MTP_DRAFT", "DraftModel", "Served", "ServedHead", "check_same_vocabulary", "draft_config", "draft_kind", "draft_path", "finish_reason",
    "load_draft", "load_served", "on_device", "output_lines",
]


@attrs.frozen(kw_only=True)
class Served:
    """A model to serve: the model, its tokenizer, its end-of-sequence ids, and how to name it."""

    model: HybridModel
    tokenizer: Tokenizer
    eos: tuple[int, ...]
    name: str
    hf: bool
    """Whether it came from a Hugging Face directory (token-level serving)."""
    max_positions: int | None = None
    """A Hugging Face checkpoint's ``max_position_embeddings`` (``None``: batchc models record none)."""


def load_served(path: str | None, *, role: str, dtype: torch.dtype, bundled: str) -> Served:
    """``path``: None (the bundled model ``bundled``, ``"target"`` or ``"draft"``), a directory (a
    Hugging Face checkpoint and its tokenizer), or a batchc ``.safetensors`` file. ``role`` names it
    in messages (``"target"``, ``"draft"``)."""
    from backend.hybrid.checkpoint import default_draft, default_target, load_checkpoint

    if path is None:
        model = default_target(dtype=dtype) if bundled == "target" else default_draft(dtype=dtype)
        return Served(model=model, tokenizer=ByteTokenizer(), eos=(), name=f"bundled {role}", hf=False)
    if Path(path).is_dir():
        from backend.hf import load_hf

        loaded = load_hf(path, dtype=dtype)
        return Served(model=loaded.model, tokenizer=HFTokenizer(Path(path) / "tokenizer.json"), eos=loaded.hf.eos_ids,
                      name=f"{role} {path} ({loaded.family})", hf=True, max_positions=loaded.hf.max_positions)
    return Served(model=load_checkpoint(path, dtype=dtype), tokenizer=ByteTokenizer(), eos=(), name=f"{role} {path}", hf=False)


@attrs.frozen(kw_only=True)
class ServedHead:
    """A draft head to serve beside its target (``--draft PATH`` naming a head checkpoint): the head,
    bound to the target's model, and how to name it. It speaks the target's tokenizer."""

    head: HeadModel
    name: str


MTP_DRAFT = "mtp"
"""``--draft mtp``: the bundled target's trained draft head (``backend/hybrid/weights/mtp.safetensors``)."""

DraftModel: TypeAlias = HybridModel | HeadModel
"""What an engine drafts with: a separate model or a head bound to the target."""


def draft_path(given: str | None, *, target: Served) -> str | None:
    """``--draft``'s path: ``mtp`` names the bundled target's head (``ServeError`` for another
    target: a head is trained for one target), anything else is itself."""
    if given != MTP_DRAFT:
        return given
    if target.hf or target.name != "bundled target":
        raise ServeError(f"--draft {MTP_DRAFT} is the bundled target's trained head; for {target.name} give --draft HEAD_FILE "
                         "(batchc train-draft --target ... --out HEAD_FILE trains one)")
    from backend.hybrid.checkpoint import HEAD_FILE, bundled_path

    return str(bundled_path(HEAD_FILE))


def on_device(target: HybridModel, draft: DraftModel | None, device: str | torch.device) -> tuple[HybridModel, DraftModel | None]:
    """``target`` and ``draft`` with their weights on ``device`` (``cpu``, ``cuda`` or ``cuda:N``),
    each tensor moved once: a draft head is bound again to the moved target (it shares the target's
    embedding, final norm and LM head), a separate draft model is moved on its own. Models already
    there are returned as they are. The engine built on them then keeps its pools, KV caches, token
    tables, staged plans and sampler on that device. ``ServeError`` in one line when the models
    cannot be placed there (no such device, or this torch was built without it)."""
    try:
        moved = target.to(device)
        placed: DraftModel | None
        if isinstance(draft, HeadModel):
            placed = draft if draft.target is moved else HeadModel(draft.config, draft.weights, moved)
        else:
            placed = draft.to(device) if draft is not None else None
    except (RuntimeError, AssertionError) as exc:  # (torch's: a CPU-only build, a device past the count, out of memory)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ServeError(f"--device {device}: the models cannot be placed there ({first})") from None
    return moved, placed


def draft_config(draft: DraftModel) -> HybridConfig:
    """The layer configuration a memory estimate counts for ``draft`` (a head's own layers)."""
    return draft.layers_config if isinstance(draft, HeadModel) else draft.config


def draft_kind(drafted: Served | ServedHead | None) -> str:
    """``"none"``, ``"model"`` or ``"mtp"``: the draft kind a benchmark row or a summary names."""
    return "none" if drafted is None else "mtp" if isinstance(drafted, ServedHead) else "model"


def load_draft(path: str | None, *, target: Served, dtype: torch.dtype) -> Served | ServedHead:
    """``--draft PATH``: a draft head checkpoint (``backend.hybrid.head``, format
    ``batchc.head/1``) gives a ``ServedHead`` bound to ``target.model`` (in its dtype; ``ServeError``
    when the head's ``d_model`` or ``vocab`` differ from the target's); anything else is a separate
    draft model, as ``load_served(path, role="draft", ...)`` loads it; ``mtp`` is the bundled head
    (``draft_path``) (the bundled draft for
    ``None``). A bad file raises ``CheckpointError`` naming it."""
    from backend.hybrid.head import is_head_checkpoint, read_head

    path = draft_path(path, target=target)
    if path is None or Path(path).is_dir() or not is_head_checkpoint(path):
        return load_served(path, role="draft", dtype=dtype, bundled="draft")
    config, weights, _ = read_head(path)
    try:
        head = HeadModel(config, weights, target.model)
    except ValueError as e:
        raise ServeError(f"draft {path}: {e} ({target.name})") from None
    return ServedHead(head=head, name=f"draft head {path}")


def check_same_vocabulary(target: Served, draft: Served) -> None:
    """``ServeError`` unless the draft speaks the target's vocabulary: the same model vocabulary
    size and, for checkpoint tokenizers, the same token -> id map."""
    if target.hf != draft.hf:
        raise ServeError(f"{draft.name}: its vocabulary is not the one of {target.name} (a Hugging Face checkpoint and a byte-level model)")
    if draft.model.config.vocab != target.model.config.vocab:
        raise ServeError(f"{draft.name}: vocab {draft.model.config.vocab} does not match the vocab {target.model.config.vocab} of {target.name}")
    if isinstance(target.tokenizer, HFTokenizer) and isinstance(draft.tokenizer, HFTokenizer):
        a, b = target.tokenizer.vocab(), draft.tokenizer.vocab()
        if a != b:
            diff = next(iter(sorted(set(a.items()) ^ set(b.items()))))
            raise ServeError(f"{draft.name}: its tokenizer's vocabulary differs from {target.name}'s (first difference: {diff[0]!r})")


def finish_reason(r: Request, output: Sequence[int], eos: Sequence[int], aborted: bool, errored: bool = False,
                  stopped: bool = False) -> str:
    """``"stop"`` (a stop string ended it, ``stopped``; or its last id is an end-of-sequence id, not
    with ``sampling.ignore_eos``, or one of its ``sampling.stop_token_ids``, at an index >=
    ``sampling.min_tokens``), ``"length"`` (it reached its ``max_new_tokens``), ``"abort"`` (a failed
    forward cut it short) or ``"refused"`` (it was never served: ``Request.refused`` says why) or
    ``"error"`` (``errored``: the logits for its next token were not finite, and it ended there)."""
    if r.refused is not None:
        return "refused"
    if errored:
        return "error"
    if aborted:
        return "abort"
    if stopped:
        return "stop"
    stops = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(eos))
    return "stop" if len(output) > r.sampling.min_tokens and output[-1] in stops else "length"


def output_lines(
    workload: Sequence[Request], outputs: Mapping[RequestId, Sequence[int]], aborted: Collection[RequestId], tokenizer: Tokenizer, eos: Sequence[int],
    errored: Collection[RequestId] = (), logprobs: Mapping[RequestId, Sequence[Mapping[str, object]]] | None = None,
) -> list[dict[str, object]]:
    """One ``--outputs`` object per completion of each request, in workload order: ``rid`` (its
    line), ``index`` (the completion, 0 to ``sampling.n - 1``; each under its engine id
    ``Request.completions()`` in ``outputs``, ``aborted``, ``errored`` and ``logprobs``), ``prompt``, ``prompt_ids``,
    ``output_ids`` (an ending end-of-sequence id included, and the tokens of an ending stop string),
    ``text`` (the output decoded incrementally, special tokens left out, ending before the stop string
    that ended it: ``compiler.offline.stops``) and ``finish_reason``; a refused request's line adds
    ``reason`` (``Request.refused``). ``outputs``: each request's generated ids by rid, as served
    (cut at the token that completed a stop string); ``aborted``: the rids a failed forward cut short;
    ``errored``: the rids that ended at non-finite logits (``finish_reason`` ``"error"``, and
    ``reason`` says so). A request that asked for logprobs (``SamplingParams.logprobs``) has
    ``logprobs``: one entry per output id, ``{"id", "logprob", "top": [{"id", "logprob"}, ...]}``,
    ``top`` sorted by logprob, from the target's distribution before any sampling transform
    (``logprobs``: ``Engine.logprobs`` by rid)."""
    lines: list[dict[str, object]] = []
    for r, index, rid in ((req, i, member) for req in workload for i, member in enumerate(req.completions())):
        out = outputs.get(rid, ())
        served = r.refused is None and rid not in aborted and rid not in errored
        cut = scan(tokenizer, r.sampling.stop, out, min_tokens=r.sampling.min_tokens) if served else None
        if cut is not None:
            text = cut.text
        else:
            detok = tokenizer.detokenizer()
            text = "".join(detok.push(t) for t in out) + detok.flush()
        lines.append({
            "rid": int(r.rid), "index": index, "prompt": r.prompt.decode("utf-8", errors="replace"),
            "prompt_ids": [int(t) for t in r.token_ids], "output_ids": list(out), "text": text,
            "finish_reason": finish_reason(r, out, eos, rid in aborted, rid in errored, stopped=cut is not None),
        })
        if logprobs is not None and r.sampling.logprobs is not None and r.refused is None:
            lines[-1]["logprobs"] = list(logprobs.get(rid, ()))[: len(out)]
        if r.refused is not None:
            lines[-1]["reason"] = r.refused
        elif rid in errored:
            lines[-1]["reason"] = ERROR_MESSAGE
    return lines
