"""The reference hybrid Mamba2/attention byte model.

``config`` (shapes, presets), ``weights`` (named tensors, seeded init, draft perturbation), ``kv``
(token-granular KV cache and the slot/position table), ``model`` (the forward entry points over
the slot-major pool), ``reference`` (a cache-free full-sequence oracle for tests).
"""

from backend.hybrid.config import HybridConfig, LayerKind, small, tiny
from backend.hybrid.kv import KVCache, TokenTable
from backend.hybrid.model import HybridModel, greedy
from backend.hybrid.outputs import ForwardOut, VerifyOut, VerifyStates
from backend.hybrid.weights import Weights, init_weights, perturb, weight_shapes

__all__ = [
    "ForwardOut",
    "HybridConfig",
    "HybridModel",
    "KVCache",
    "LayerKind",
    "TokenTable",
    "VerifyOut",
    "VerifyStates",
    "Weights",
    "greedy",
    "init_weights",
    "perturb",
    "small",
    "tiny",
    "weight_shapes",
]

# Trained models and checkpoint files: presets, safetensors IO, the bundled weights.
from backend.hybrid.checkpoint import (  # noqa: E402
    CheckpointError,
    default_draft,
    default_target,
    load_checkpoint,
    save_checkpoint,
)
from backend.hybrid.presets import trained_draft, trained_target  # noqa: E402

__all__ += [
    "CheckpointError",
    "default_draft",
    "default_target",
    "load_checkpoint",
    "save_checkpoint",
    "trained_draft",
    "trained_target",
]
