"""A draft vocabulary's row map: a draft that proposes only V' of the target's V tokens reads only their rows of the
target's LM head (FR-Spec, EAGLE-3). Heads trained with one (``heads``) and layer-skip checkpoints that carry one both
draft through it; which tokens it holds is chosen at training time (``heads.training.draft_vocab``).

Shapes: V vocabulary, V' draft vocabulary, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def check_draft_tokens(tokens, size: int, vocab_size: int) -> torch.Tensor:
    """``tokens`` as a long [size] tensor of distinct ids in [0, vocab_size), or a ValueError saying what is wrong."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if tokens.shape != (size,) or tokens.unique().numel() != tokens.numel():
        raise ValueError(f"expected {size} distinct token ids, found {tuple(tokens.shape)} with "
                         f"{tokens.unique().numel()} distinct")
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        raise ValueError(f"draft token ids must lie in [0, {vocab_size}), found {int(tokens.min())}..{int(tokens.max())}")
    return tokens


class DraftVocab(nn.Module):
    """The draft vocabulary of Medusa, Hydra, EAGLE or exit heads: a persistent ``tokens`` buffer [V'] when ``size``
    is set (stored in the checkpoint as ``draft_vocab.tokens``), nothing at all when it is None (the whole vocabulary,
    and the checkpoints of heads trained before draft vocabularies existed; an EAGLE head always has one). ``linear``
    is the frozen LM head on those rows."""

    def __init__(self, size: int | None, vocab_size: int):
        super().__init__()
        self.size, self.vocab_size = size, vocab_size
        if size is not None:
            self.register_buffer("tokens", torch.arange(size), persistent=True)  # [V'] long, sorted
        else:
            self.tokens = None
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def set(self, tokens) -> None:
        if self.size is None:
            raise ValueError("these heads draft from the whole vocabulary (draft_vocab_size None); build them with a "
                             "draft_vocab_size to give them a draft vocabulary")
        self.tokens.copy_(check_draft_tokens(tokens, self.size, self.vocab_size).to(self.tokens.device))
        self._rows = None

    def rows(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's weight [V', D] and bias [V'] (or None) on the draft vocabulary; cached, since drafting reads
        them every step (rebuilt when the vocabulary, the weight or its device changes)."""
        weight = lm_head.weight.detach()
        bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias.detach()
        if self.tokens is None:
            return weight, bias
        cached = self._rows  # keyed on the Parameter itself: weight.detach() is a new tensor at every call
        if (cached is None or cached[0] is not self.tokens or cached[1] is not lm_head.weight
                or cached[2].device != weight.device or cached[2].dtype != weight.dtype):
            index = self.tokens.to(weight.device)
            cached = self._rows = (self.tokens, lm_head.weight, weight[index], None if bias is None else bias[index])
        return cached[2], cached[3]

    def linear(self, lm_head: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> logits [..., V'] through the frozen LM head's rows of the draft vocabulary."""
        weight, bias = self.rows(lm_head)
        return F.linear(x.to(weight.dtype), weight, bias)

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] -> [..., V'] (projections other than the frozen LM head)."""
        return logits if self.tokens is None else logits[..., self.tokens.to(logits.device)]

    def base_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary -> the base's token ids."""
        return index if self.tokens is None else self.tokens.to(index.device)[index]
