"""A fine-tuned exit head for early-exit self-speculation, on a frozen target.

The early-exit drafter (``selfspec.drafts.early_exit``) drafts with the target's first E layers and then its own final norm
and LM head. Layer E's input was never trained to be read that way; an exit head is a small map trained to make it so:

    tokens ─ layers 0..E-1 ─▶ h_E ─ exit head ─▶ h' ─ final norm ─ LM head ─▶ draft logits   (trained, E layers)
    tokens ─ layers 0..L-1 ──────────────────────▶ h_L ─ final norm ─ LM head ─▶ target logits (frozen, all layers)

It is ``num_layers`` zero-initialised residual blocks (x + SiLU(W x + b), as in the Medusa heads), so an untrained
exit head is exactly plain early exit. Training (``train.py`` with ``method: exit_head``) minimises the KL from the
target's next-token distribution at position t to the draft's at t (or the cross-entropy of the data's next token),
the same index shift as the LM head: nothing is predicted further ahead. The final norm and LM head stay the
target's own, held by reference and never stored.

A checkpoint (``save_pretrained``) is config.json (draft_type "exit-head", the base, the exit layer, the drafting
depth and confidence stop, the measured top-1 agreement with the target) + model.safetensors + README.md, written
atomically like the heads' (``heads.checkpoints.files``); heads/exit_head/drafter.py's ``load_drafter`` is its
``selfspec.drafters`` entry point (``--draft DIR``).

Shapes: N positions, D hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.base import BaseFields, base_name, base_sizes, card_usage
from heads.blocks import ResBlock, frozen_linear
from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import read_typed_checkpoint
from selfspec.core import hf, typed
from selfspec.core.draft_vocab import DraftVocab

DRAFT_TYPE = "exit-head"


@dataclass
class ExitHeadConfig(BaseFields):
    """Everything needed to rebuild the exit head on its base model; stored as config.json. Strict. Its hidden_size
    is the width of the decoder's layers (what layer E's input is), which can differ from the LM head's."""

    num_hidden_layers: int
    """the base's decoder layers (L): the exit layer is only meaningful for this depth."""
    exit_layer: int
    """E: drafting runs layers 0..E-1, then the exit head (1 <= E < L)."""
    num_layers: int = 1
    """residual blocks in the exit head."""
    draft_depth: int = 4
    """tokens drafted per step (a chain), unless --tree says otherwise."""
    stop_below: float = 0.0
    """stop drafting once the draft's top probability falls below this (0: never)."""
    draft_vocab_size: int | None = None
    """V': drafting reads only the LM head's rows of these most frequent training tokens
    (heads/training/draft_vocab.py); None: every token (and exit heads trained before draft vocabularies existed)."""
    top1_agreement: float | None = None
    """measured on held-out data: how often the draft's argmax is the target's own (trained with loss kl) or the
    data's next token (loss ce) (null: not measured)."""
    recipe: dict | None = None
    draft_type: str = DRAFT_TYPE

    def __post_init__(self) -> None:
        typed.check(self)
        if self.draft_type != DRAFT_TYPE:
            raise ValueError(f"ExitHeadConfig.draft_type: expected {DRAFT_TYPE!r}, found {self.draft_type!r}")
        if not 1 <= self.exit_layer <= self.num_hidden_layers - 1:
            raise ValueError(f"ExitHeadConfig.exit_layer: expected 1..{self.num_hidden_layers - 1} for a base of "
                             f"{self.num_hidden_layers} layers, found {self.exit_layer}")
        for name in ("hidden_size", "vocab_size", "draft_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExitHeadConfig.{name}: expected >= 1, found {getattr(self, name)}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"ExitHeadConfig.draft_vocab_size: expected 1..{self.vocab_size} (the vocabulary) or None, "
                             f"found {self.draft_vocab_size}")
        if self.num_layers < 0:
            raise ValueError(f"ExitHeadConfig.num_layers: expected >= 0, found {self.num_layers}")
        if not 0.0 <= self.stop_below < 1.0:
            raise ValueError(f"ExitHeadConfig.stop_below: expected a probability in [0, 1), found {self.stop_below}")

    @classmethod
    def for_model(cls, model: PreTrainedModel, exit_layer: int, base_model: str | None = None,
                  **kwargs: Any) -> "ExitHeadConfig":
        hidden, vocab = base_sizes(model, at="layers")
        kwargs.setdefault("base_revision", None)
        return cls(base_model=base_name(model, base_model), hidden_size=hidden, vocab_size=vocab,
                   num_hidden_layers=len(hf.decoder_layers(model)), exit_layer=exit_layer, **kwargs)


NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def final_norm(model: PreTrainedModel) -> nn.Module:
    """What the decoder does to its last layer's output before the LM head reads it (and the early-exit draft reuses):
    its final norm, then the projection to the LM head's width where it has one (OPT-350m's ``project_out``)."""
    decoder = hf.decoder(model)
    norm = next((m for m in (getattr(decoder, name, None) for name in NORMS) if isinstance(m, nn.Module)), None)
    if norm is None:
        raise TypeError(f"expected the decoder of {type(model).__name__} to have a final norm ({' / '.join(NORMS)}), "
                        f"found none among {[n for n, _ in decoder.named_children()]}")
    project_out = getattr(decoder, "project_out", None)
    return nn.Sequential(norm, project_out) if isinstance(project_out, nn.Module) else norm


def read_exit_checkpoint(directory: Path) -> tuple[ExitHeadConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of an exit-head checkpoint directory, checked against each other. Strict."""
    return read_typed_checkpoint(directory, DRAFT_TYPE, "exit-head", ExitHeadConfig.from_dict, ExitHead)


def exit_card(config: ExitHeadConfig, location: str) -> str:
    agreement = "not measured" if config.top1_agreement is None else f"{config.top1_agreement:.3f}"
    vocab = ("" if config.draft_vocab_size is None else f" Drafts come from the {config.draft_vocab_size} tokens most "
             f"frequent in its training data (of {config.vocab_size}).")
    return f"""---
library_name: selfspec
base_model: {config.base_model}
tags: [speculative-decoding, early-exit, selfspec]
---
# Early-exit head for {config.base_model}

Drafts with the first {config.exit_layer} of the base's {config.num_hidden_layers} layers, then this exit head
({config.num_layers} residual block(s)) and the base's own final norm and LM head; the full model verifies, so
greedy output is the base's own.{vocab} Top-1 agreement with the base on held-out data: {agreement}.

{card_usage(config.base_model, location)}
"""


class ExitHead(nn.Module, DraftCheckpoint):
    """hidden [..., D] (layer E's input) -> [..., D] for the final norm; the identity until trained."""

    WHAT = "exit head"
    DRAFT_TYPE = DRAFT_TYPE
    ADDS_VOCAB = True
    READS = "layers"  # layer E's input

    def __init__(self, config: ExitHeadConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([ResBlock(config.hidden_size) for _ in range(config.num_layers)])
        self.draft_vocab = DraftVocab(config.draft_vocab_size, config.vocab_size)  # read by the drafter, not forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden
        for block in self.blocks:
            x = block(x.to(block.linear.weight.dtype))
        return x

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(exit_card)
    read_checkpoint = staticmethod(read_exit_checkpoint)

    @classmethod
    def on_base(cls, config: ExitHeadConfig, base_model: PreTrainedModel) -> "ExitHead":
        return cls(config)

    @classmethod
    def base_checks(cls, config: ExitHeadConfig, base_model: PreTrainedModel) -> tuple[tuple[str, int, int], ...]:
        return (("number of layers", config.num_hidden_layers, len(hf.decoder_layers(base_model))),)


class ExitLogits(nn.Module):
    """What training optimises: hidden [N, D] at layer E -> draft logits [1, N, V] through the exit head and the
    target's own final norm and LM head (both frozen, held by reference: only the exit head is trained or stored).
    The leading 1 is the "one head" axis of the Medusa loss (``heads.training.losses``), with a look-ahead of 0."""

    def __init__(self, exit_head: ExitHead, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.exit_head = exit_head
        self._frozen = (norm, lm_head)  # a tuple: not registered, never in state_dict or the optimizer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, lm_head = self._frozen
        return frozen_linear(lm_head, norm(self.exit_head(hidden).to(lm_head.weight.dtype)))[None]
