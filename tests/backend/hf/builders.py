"""Tiny Hugging Face models of each supported family, built with transformers' own config classes,
seeded random weights (every parameter, the Mamba ``A_log``, ``dt_bias``, ``D`` and the norms
included: transformers' default initialisation sets those to constants, which would hide a wrong
gate, skip or norm), scaled so that the logits have real argmax margins, and saved with
``save_pretrained``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

FAMILY_NAMES = ("bamba", "granitemoehybrid", "nemotron_h")


def hf_config(family: str, **changes: Any) -> Any:
    """A tiny transformers config of ``family``: 2 Mamba and 2 attention layers (Nemotron-H: also
    2 MLP layers), grouped-query attention, 2 Mamba groups."""
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


def _fill(name: str, p: torch.Tensor, gen: torch.Generator, d_model: int) -> None:
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
        p.copy_(torch.randn(shape, generator=gen))
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
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            _fill(name, p, gen, config.hidden_size)
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
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float()


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
