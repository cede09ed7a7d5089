"""What the hybrid model's entry points return (``backend.hybrid.model``), in a module of their own.

Both the model, which builds these, and its serving hook (``backend.hybrid.hook``), which reads
them, import this module; the model imports the hook and the hook never imports the model, so the
two form no import cycle. Frozen: an output is handed on, never edited.
"""

from __future__ import annotations

import attrs
import torch

from backend.kernels.window import SsmWindow

__all__ = ["ForwardOut", "VerifyOut", "VerifyStates"]


@attrs.frozen
class ForwardOut:
    """``logits [n, vocab]`` (float32) and ``hidden [n, d_model]`` at each row's last token."""

    logits: torch.Tensor
    hidden: torch.Tensor
    all_hidden: torch.Tensor | None = None
    """Every token's hidden state, packed ``[total, d_model]`` like the extend's tokens, when the
    extend was asked for it (``keep_hidden``; a draft head's extend reads them); else ``None``."""


@attrs.frozen
class VerifyStates:
    """Per Mamba layer (pool layer order), every verify position's state:
    ``conv[m] [n, T, conv_dim, width - 1]``, ``ssm[m] [n, T, nheads, head_dim, d_state]``;
    position ``t`` holds the state after the row's token ``t``. A verify on the torch path keeps
    each SSM layer's states as an ``SsmWindow`` instead (``backend.kernels.window``: the committed
    state and per-token factors; the commit computes the accepted position's state)."""

    conv: tuple[torch.Tensor, ...]
    ssm: tuple[torch.Tensor | SsmWindow, ...]


@attrs.frozen
class VerifyOut:
    """``logits [n, T, vocab]`` (float32), ``hidden [n, T, d_model]``, and the states to commit from."""

    logits: torch.Tensor
    hidden: torch.Tensor
    states: VerifyStates
