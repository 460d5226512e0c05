"""What an EAGLE-style head stores as config.json (``EagleConfig``, strict): its base, the decoder's transformers
config, the draft vocabulary size, drafting defaults, the target layers an EAGLE-3 head reads, and measured agreement.

What it shares with the block drafter's config (building one for a base model, the decoder's config, the feature
layers' checks) is heads/decoder/config.py's ``DecoderHeadConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from heads.decoder.config import DecoderHeadConfig

DRAFT_TYPE = "eagle"


@dataclass
class EagleConfig(DecoderHeadConfig):
    """Everything needed to rebuild the head on its base model; stored as config.json. Strict."""

    decoder_config: dict
    """the transformers config (``to_dict``) of the draft decoder: the base's architecture, ``num_layers`` layers."""
    num_layers: int = 1
    """decoder layers in the head."""
    draft_vocab_size: int = 8192
    """V': how many of the base's tokens the head can draft (the most frequent in its training data)."""
    depth: int = 6
    """drafting default: tokens drafted along any path of the tree."""
    topk: int = 8
    """drafting default: nodes expanded per depth, and children tried per expanded node."""
    budget: int = 32
    """drafting default: draft nodes kept (the highest cumulative draft probability; EAGLE-2's rerank)."""
    feature_layers: list[int] | None = None
    """EAGLE-3's multi-layer features: the target's hidden states (transformers' ``hidden_states`` indices: 0 the
    embeddings, i decoder layer i's output) the true pairs read, fused by a linear map; null: the final hidden state."""
    top1_agreement: list[float] | None = None
    """measured on held-out data, per unrolled step: how often the head's argmax is the target's own next token
    (null: not measured)."""
    recipe: dict | None = None
    draft_type: str = DRAFT_TYPE

    def __post_init__(self) -> None:
        self.check_decoder_head(DRAFT_TYPE, ("num_layers", "depth", "topk", "budget"))
