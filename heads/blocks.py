"""The small pieces heads are built from: a zero-initialised residual block, and the base's LM head applied frozen.

``ResBlock`` is Medusa's block, x + SiLU(W x + b) with W and b starting at zero, so a head built from them predicts
exactly what the base predicts until it is trained (Medusa heads, Hydra heads, exit heads). ``frozen_linear`` applies
the base's LM head (held by reference by every head, never registered, stored or trained) without ever training it.

Shapes: "..." any leading dimensions (batch, time), D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def frozen_linear(lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The base's LM head applied to x [..., D] -> [..., V] without ever training it (its weights are detached)."""
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
    return F.linear(x.to(lm_head.weight.dtype), lm_head.weight.detach(), bias)
