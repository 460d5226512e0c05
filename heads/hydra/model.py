"""Hydra-style heads: Medusa heads that also read the tokens drafted before them, on the frozen target.

A Medusa head guesses token t+1+k from the hidden state h_t alone: the same guess under every branch of the tree. A
Hydra head (Ankner et al., 2024) reads the tokens on the path to the node it drafts under, so its guesses are
sequentially dependent:

    head k at t:  [h_t ; e(x_{t+1}) ; ... ; e(x_{t+k})] ─ fc_k [(k+1)D -> D] ─ residual blocks ─ LM head ─▶ x_{t+1+k}

x_{t+1} is the root (the target's own token at t+1), x_{t+2..t+k} the drafted tokens on the path. The index shift is
Medusa's (heads/training/losses.py): head k at t is scored on labels[t+1+k]; in training its inputs are the data's
tokens t+1..t+k (teacher forcing, ``following``). fc_k starts as [I 0 ... 0] and the blocks as the identity, so an
untrained Hydra head makes exactly the LM head's guess, like an untrained Medusa head; the residual blocks are
Medusa's (distinct modules per head and per layer). The base's embeddings and LM head are held by reference: never
stored, never trained.

A checkpoint (``save_pretrained``) is config.json (draft_type "hydra", the base, sizes, the tree built from measured
accuracy) + model.safetensors (each head's fc and blocks) + README.md, written atomically like every selfspec
checkpoint; heads/hydra/drafter.py drafts, and its ``load_drafter`` is the ``selfspec.drafters`` entry point
(``--draft DIR``).

Shapes: K heads, B batch, T time, N positions, D hidden size, V vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from heads.base import BaseFields, card_usage, check_lm_head
from heads.blocks import ResBlock, frozen_linear
from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import read_typed_checkpoint
from selfspec.core import typed
from selfspec.core.draft_vocab import DraftVocab
from selfspec.core.tree import Tree

DRAFT_TYPE = "hydra"


@dataclass
class HydraConfig(BaseFields):
    """Everything needed to rebuild the heads on their base model; stored as config.json. Strict."""

    num_heads: int = 4
    """K: head k reads h_t and the k tokens after t, and predicts token t+1+k."""
    num_layers: int = 1
    """residual blocks per head (distinct modules)."""
    tree: list[list[int]] | None = None
    """Medusa-style choices, built from measured accuracy by heads.tree_search (never by hand); a node's token is
    the head's candidate of that rank given the path above it."""
    head_accuracy: list[list[float]] | None = None
    """[K][r]: measured probability that head k's rank-r candidate is the right token, the path above it right."""
    draft_vocab_size: int | None = None
    """V': the heads draft only from these most frequent training tokens (heads/training/draft_vocab.py); None: every
    token."""
    recipe: dict | None = None
    draft_type: str = DRAFT_TYPE

    def __post_init__(self) -> None:
        typed.check(self)
        if self.draft_type != DRAFT_TYPE:
            raise ValueError(f"HydraConfig.draft_type: expected {DRAFT_TYPE!r}, found {self.draft_type!r}")
        for name in ("hidden_size", "vocab_size", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"HydraConfig.{name}: expected >= 1, found {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"HydraConfig.num_layers: expected >= 0, found {self.num_layers}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"HydraConfig.draft_vocab_size: expected 1..{self.vocab_size} (the vocabulary) or None, "
                             f"found {self.draft_vocab_size}")
        if self.tree is not None and Tree.from_choices(self.tree).depth > self.num_heads:
            raise ValueError(f"HydraConfig.tree is {Tree.from_choices(self.tree).depth} levels deep; {self.num_heads} "
                             f"heads draft at most {self.num_heads}")
        if self.head_accuracy is not None and len(self.head_accuracy) != self.num_heads:
            raise ValueError(f"HydraConfig.head_accuracy has {len(self.head_accuracy)} rows, expected one per head "
                             f"({self.num_heads})")
        json.dumps(self.recipe)  # stored in config.json


class HydraHead(nn.Module):
    """Head k: fc [(k+1)D -> D], initialised to read h_t only, then ``num_layers`` residual blocks."""

    def __init__(self, k: int, hidden_size: int, num_layers: int):
        super().__init__()
        D = hidden_size
        self.fc = nn.Linear((k + 1) * D, D, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :D].copy_(torch.eye(D))
        self.blocks = nn.ModuleList([ResBlock(D) for _ in range(num_layers)])

    def features(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """hidden [N, D], embeds [N, k, D] (the k tokens after t) -> [N, D]."""
        x = self.fc(torch.cat([hidden, embeds.flatten(-2)], dim=-1).to(self.fc.weight.dtype))
        for block in self.blocks:
            x = block(x)
        return x


def read_hydra_checkpoint(directory: Path) -> tuple[HydraConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a Hydra checkpoint directory, checked against each other. Strict."""
    def build(config: HydraConfig) -> HydraHeads:
        stub = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # the base's pieces are not stored
        return HydraHeads(config, stub, stub)

    return read_typed_checkpoint(directory, DRAFT_TYPE, "Hydra-heads", HydraConfig.from_dict, build)


def hydra_card(config: HydraConfig, location: str) -> str:
    accuracy = ("not measured" if config.head_accuracy is None
                else ", ".join(f"{row[0]:.3f}" for row in config.head_accuracy) + " (heads 1, 2, ...)")
    tree = f"{len(config.tree)} nodes, built from the measured accuracy" if config.tree else "none stored (a chain)"
    vocab = ("" if config.draft_vocab_size is None else f" Drafts come from the {config.draft_vocab_size} tokens most "
             f"frequent in the training data.")
    return f"""---
library_name: selfspec
base_model: {config.base_model}
tags: [speculative-decoding, hydra, selfspec]
---
# Hydra heads for {config.base_model}

{config.num_heads} Hydra heads ({config.num_layers} residual block(s) each over the base's final hidden state and the
embeddings of the tokens drafted before them; the base's LM head, frozen). Head k predicts the token k steps beyond the
base's next token; the base verifies every draft tree in one forward, so greedy output is the base's own. Top-1
accuracy on held-out data: {accuracy}. Tree: {tree}.{vocab}

{card_usage(config.base_model, location)}
"""


class HydraHeads(nn.Module, DraftCheckpoint):
    WHAT = "Hydra heads"
    DRAFT_TYPE = DRAFT_TYPE
    ADDS_VOCAB = True

    def __init__(self, config: HydraConfig, embed: nn.Module, lm_head: nn.Module):
        """embed, lm_head: the base model's (frozen) input embeddings and LM head, held by reference."""
        super().__init__()
        check_lm_head(config, lm_head)
        self.config = config
        self._frozen = (embed, lm_head)  # a tuple: not registered, never in state_dict or the optimizer
        self.heads = nn.ModuleList([HydraHead(k, config.hidden_size, config.num_layers)
                                    for k in range(1, config.num_heads + 1)])
        self.draft_vocab = DraftVocab(config.draft_vocab_size, config.vocab_size)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> the base's input embeddings [..., D], frozen."""
        embed = self._frozen[0]
        return F.embedding(tokens, embed.weight.detach()) * getattr(embed, "embed_scale", 1.0)

    def head_logits(self, hidden: torch.Tensor, path: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [N, D] (h_t), path [N, >= k] (x_{t+1}, x_{t+2}, ...) -> logits [N, V] of head k (1-based: head 1
        reads x_{t+1}, the root, and predicts x_{t+2})."""
        features = self.heads[k - 1].features(hidden, self.embed(path[:, :k]))
        return frozen_linear(self._frozen[1], features)

    def draft_logits(self, hidden: torch.Tensor, path: torch.Tensor, k: int) -> torch.Tensor:
        """As ``head_logits``, on the draft vocabulary: [N, V'] (``draft_vocab.base_ids`` maps a column to its token)."""
        return self.draft_vocab.linear(self._frozen[1], self.heads[k - 1].features(hidden, self.embed(path[:, :k])))

    def forward(self, hidden: torch.Tensor, following: torch.Tensor, on_draft_vocab: bool = False) -> torch.Tensor:
        """hidden [N, D], following [N, K] (tokens t+1..t+K, from ``following``) -> logits [K, N, V], or [K, N, V'] on
        the draft vocabulary (``on_draft_vocab``, for heads that have one: what training reads,
        heads/training/losses.py)."""
        logits = self.draft_logits if on_draft_vocab else self.head_logits
        return torch.stack([logits(hidden, following, k) for k in range(1, len(self.heads) + 1)])

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(hydra_card)
    read_checkpoint = staticmethod(read_hydra_checkpoint)

    @classmethod
    def on_base(cls, config: HydraConfig, base_model: PreTrainedModel) -> "HydraHeads":
        return cls(config, base_model.get_input_embeddings(), base_model.get_output_embeddings())


def following(input_ids: torch.Tensor, scored: torch.Tensor, num_heads: int) -> torch.Tensor:
    """input_ids [B, T], scored [B, T] bool -> [N, K]: at each scored position (b, t), the tokens t+1 .. t+K that
    Hydra heads 1..K read there (head k reads the first k). Positions past the end repeat the last token: a head whose
    inputs run past the end would predict past it too, where the targets are -100 (heads/training/losses.py)."""
    b, t = scored.nonzero(as_tuple=True)  # [N], [N]
    T = input_ids.shape[1]
    offsets = torch.arange(1, num_heads + 1, device=input_ids.device)  # [K]
    return input_ids[b[:, None], (t[:, None] + offsets).clamp(max=T - 1)]  # [N, K]
