"""What a block drafter stores as config.json (``BlockConfig``, strict): its base, the decoder's transformers config
(the EAGLE head's: heads/eagle/config.py ``decoder_config``), the block size K, the draft vocabulary size, the
feature layers, drafting defaults and the measured agreement per block offset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from heads.base import BaseFields, base_name, base_sizes
from heads.eagle.config import check_feature_layer_list, check_feature_layers, decoder_config
from selfspec.core import typed

DRAFT_TYPE = "block"


@dataclass
class BlockConfig(BaseFields):
    """Everything needed to rebuild the block drafter on its base model; stored as config.json. Strict."""

    decoder_config: dict
    """the transformers config (``to_dict``) of the draft decoder: the base's architecture, ``num_layers`` layers."""
    num_layers: int = 1
    """decoder layers in the head."""
    block_size: int = 6
    """K: tokens drafted by one forward (the root's successor, from the last true pair, and K - 1 mask queries)."""
    draft_vocab_size: int = 8192
    """V': how many of the base's tokens the head can draft (the most frequent in its training data)."""
    depth: int | None = None
    """drafting default: the tree's depth (at most K; null: K, the whole block)."""
    budget: int = 16
    """drafting default: draft nodes kept each step (the rank paths of highest product of per-position
    probabilities)."""
    feature_layers: list[int] | None = None
    """EAGLE-3's multi-layer features: the target's hidden states (transformers' ``hidden_states`` indices) the true
    pairs read, fused by a linear map; null: the final hidden state."""
    top1_agreement: list[float] | None = None
    """measured on held-out data, per block offset (0: the token after the root, k: mask k): how often the head's
    argmax is the target's own token (null: not measured)."""
    recipe: dict | None = None
    draft_type: str = DRAFT_TYPE

    def __post_init__(self) -> None:
        typed.check(self)
        if self.draft_type != DRAFT_TYPE:
            raise ValueError(f"BlockConfig.draft_type: expected {DRAFT_TYPE!r}, found {self.draft_type!r}")
        for name in ("hidden_size", "vocab_size", "num_layers", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockConfig.{name}: expected >= 1, found {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"BlockConfig.block_size: expected >= 2 (the root's successor and at least one mask "
                             f"query), found {self.block_size}")
        if self.depth is not None and not 1 <= self.depth <= self.block_size:
            raise ValueError(f"BlockConfig.depth: expected null or 1..{self.block_size} (the block size), found "
                             f"{self.depth}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"BlockConfig.draft_vocab_size: expected 1..{self.vocab_size} (the base's vocabulary), "
                             f"found {self.draft_vocab_size}")
        check_feature_layer_list(self.feature_layers, "BlockConfig.feature_layers")
        if "model_type" not in self.decoder_config:
            raise ValueError(f"BlockConfig.decoder_config: expected a transformers config dict with 'model_type', found "
                             f"keys {sorted(self.decoder_config)[:8]}")
        json.dumps(self.recipe)  # stored in config.json

    @classmethod
    def for_model(cls, model: PreTrainedModel, base_model: str | None = None, num_layers: int = 1,
                  **kwargs: Any) -> "BlockConfig":
        hidden, vocab = base_sizes(model)
        kwargs.setdefault("base_revision", None)
        kwargs["draft_vocab_size"] = min(kwargs.get("draft_vocab_size", 8192) or vocab, vocab)
        check_feature_layers(kwargs.get("feature_layers"), model)
        return cls(base_model=base_name(model, base_model), hidden_size=hidden, vocab_size=vocab,
                   decoder_config=decoder_config(model, num_layers), num_layers=num_layers, **kwargs)
