"""Random Hugging Face checkpoints of the hybrid families batchc serves, built with transformers'
own config classes and ``save_pretrained`` (nothing is downloaded), for the parity tests and for
timing ``batchc run --model DIR`` at a realistic width.

Weights are seeded and random, every parameter included (the Mamba ``A_log``, ``dt_bias``, ``D`` and
the norms too: transformers' default initialisation sets those to constants, which would hide a
wrong gate, skip or norm), and scaled so that the logits have real argmax margins. The tokenizer is
a byte-level BPE trained here on a few lines of code and mixed-script text.

Needs transformers (the test extra: ``pip install -e '.[test]'``)::

    python -m backend.tools.hf_random --family granitemoehybrid --preset granite-4.0-h-350m DIR
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

FAMILY_NAMES = ("bamba", "granitemoehybrid", "nemotron_h")


PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # Granite-4.0-H 350M's dimensions as published (dense, tied, no position embedding, 4 attention
    # layers among 32; where exactly the 4 sit is approximated: it does not change the cost)
    "granite-4.0-h-350m": ("granitemoehybrid", dict(
        vocab_size=100352, hidden_size=768, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4,
        layer_types=["mamba"] * 10 + ["attention"] + ["mamba"] * 2 + ["attention"] + ["mamba"] * 3 + ["attention"]
        + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4,
        shared_intermediate_size=2048, mamba_n_heads=48, mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1,
        mamba_chunk_size=256, embedding_multiplier=12.0, residual_multiplier=0.246, attention_multiplier=0.0078125,
        logits_scaling=3.0, rms_norm_eps=1e-5, bos_token_id=100257, eos_token_id=100257, pad_token_id=100256,
    )),
}
"""Named realistic shapes: ``name -> (family, config changes)``."""


def hf_config(family: str, **changes: Any) -> Any:
    """A tiny transformers config of ``family``: 2 Mamba and 2 attention layers (Nemotron-H: also
    2 MLP layers), grouped-query attention, 2 Mamba groups; ``changes`` override any field."""
    from transformers import BambaConfig, GraniteMoeHybridConfig, NemotronHConfig

    common: dict[str, Any] = dict(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "bamba":
        kw = dict(common, intermediate_size=96, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_n_heads=8,
                  mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8)
        kw.update(changes)
        return BambaConfig(**kw)
    if family == "granitemoehybrid":
        kw = dict(common, intermediate_size=96, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                  num_local_experts=0, shared_intermediate_size=80, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                  mamba_chunk_size=8, embedding_multiplier=0.5, residual_multiplier=2.0, attention_multiplier=0.0625,
                  logits_scaling=4.0, position_embedding_type="nope", tie_word_embeddings=True)
        kw.update(changes)
        return GraniteMoeHybridConfig(**kw)
    if family == "nemotron_h":
        kw = dict(common, intermediate_size=96, hybrid_override_pattern="M*-M-*", head_dim=16, mamba_num_heads=8,
                  mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8, time_step_min=0.001)
        kw.update(changes)
        return NemotronHConfig(**kw)
    raise ValueError(family)


def _fill(name: str, p: torch.Tensor, gen: torch.Generator, d_model: int, embed_std: float) -> None:
    shape = tuple(p.shape)
    if name.endswith("A_log"):
        p.copy_(torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen)))
    elif name.endswith("dt_bias"):
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-2), math.log(1e-1), generator=gen))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
    elif name.endswith(".D"):
        p.copy_(torch.empty(shape).uniform_(0.5, 1.5, generator=gen))
    elif p.dim() == 1:  # norms and biases
        p.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen) if "norm" in name else 0.1 * torch.randn(shape, generator=gen))
    elif "embed" in name:
        p.copy_(torch.randn(shape, generator=gen) * embed_std)
    elif name.startswith("lm_head"):
        p.copy_(torch.randn(shape, generator=gen) * (2.0 / math.sqrt(d_model)))
    else:  # [out, in] matrices and the conv [channels, 1, width]
        fan_in = shape[-1] if p.dim() == 2 else shape[-1]
        p.copy_(torch.randn(shape, generator=gen) / math.sqrt(fan_in))


def build_hf_model(family: str, seed: int = 0, *, noise: float = 0.0, **changes: Any) -> Any:
    """A tiny transformers model of ``family`` (eval mode, float32) with seeded random weights
    (Granite's multipliers are set so that random tied embeddings do not make greedy decoding
    repeat the last token); ``noise``: then every weight plus that much relative Gaussian noise
    (a draft that agrees with the model of the same seed most of the time)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(family, **changes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    # tied embeddings scaled up by a large embedding multiplier would dominate the residual stream:
    # keep the scaled embeddings near unit RMS
    embed_std = 1.0 / max(1.0, float(config.to_dict().get("embedding_multiplier", 1.0)))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            _fill(name, p, gen, config.hidden_size, embed_std)
        if noise:
            for _, p in sorted(model.named_parameters()):
                p.add_(noise * p.float().square().mean().sqrt() * torch.randn(tuple(p.shape), generator=gen))
    return model


def save_hf_model(family: str, directory: Path, seed: int = 0, *, noise: float = 0.0, **changes: Any) -> Any:
    model = build_hf_model(family, seed, noise=noise, **changes)
    model.save_pretrained(str(directory))
    return model


def hf_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' full-sequence float32 logits ``[len(tokens), vocab]``."""
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([tokens]), use_cache=False).logits
    return logits[0].float()


TOKENIZER_TEXT = (
    "def f(x):\n    return x * 2 + 1\n"
    "import re, os\nclass K:\n    pass\n"
    "for a in range(10):\n    print(a)\n"
    "Grüße, naïve café — 日本語のテキスト 🙂🚀 emoji and accents.\n"
) * 4


def save_tokenizer(directory: Path, *, vocab_size: int = 320, metaspace: bool = False) -> Any:
    """A byte-level BPE ``tokenizer.json`` trained here on a few lines of code and mixed-script text
    (ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>``; encoding adds ``<s>`` first, as a real model's
    post-processor does). ``metaspace``: SentencePiece-style word boundaries (``▁``) instead."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None if not metaspace else "<unk>", byte_fallback=metaspace))
    specials = ["<pad>", "<s>", "</s>"] + (["<unk>"] if metaspace else [])
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + alphabet, show_progress=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    return tok


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m backend.tools.hf_random", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="where to save (created; must not exist)")
    p.add_argument("--family", choices=FAMILY_NAMES, default="granitemoehybrid")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a realistic shape (default: the tiny test shape)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    d = Path(args.directory)
    if d.exists():
        p.error(f"{d} exists")
    d.mkdir(parents=True)
    family, changes = PRESETS[args.preset] if args.preset else (args.family, {})
    model = save_hf_model(family, d, seed=args.seed, **changes)
    save_tokenizer(d, vocab_size=min(2048, int(model.config.vocab_size)))
    params = sum(p.numel() for p in model.parameters())
    print(f"{family} ({args.preset or 'tiny'}): {params / 1e6:.1f}M parameters, saved to {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
