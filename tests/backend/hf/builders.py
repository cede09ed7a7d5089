"""The random Hugging Face checkpoints of the tests (``backend.tools.hf_random``)."""

from backend.tools.hf_random import FAMILY_NAMES, build_hf_model, hf_config, hf_logits, save_hf_model, save_tokenizer

__all__ = ["FAMILY_NAMES", "build_hf_model", "hf_config", "hf_logits", "save_hf_model", "save_tokenizer"]
