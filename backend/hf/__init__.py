"""Hugging Face checkpoints of the hybrid Mamba2/attention families batchc serves: Bamba,
Granite-4.0-H (dense) and Nemotron-H, loaded into ``backend.hybrid.HybridModel``.

``load_hf(directory)`` reads ``config.json`` (``backend.hf.config``: both transformers 4.x and 5.x
spellings) and the safetensors weights (``backend.hf.load``), and refuses with one line what it
cannot serve exactly.
"""

from backend.hf.config import FAMILIES, HFConfig, parse_config
from backend.hf.load import HFModel, load_hf

__all__ = ["FAMILIES", "HFConfig", "HFModel", "load_hf", "parse_config"]
