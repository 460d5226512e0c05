"""What a block drafter stores as config.json (``BlockConfig``, strict): its base, the decoder's transformers config
(the EAGLE head's: heads/eagle/config.py ``decoder_config``), the block size K, the draft vocabulary size, the
feature layers, drafting defaults and the measured agreement per block offset.
"""

from __future__ import annotations

from dataclasses import dataclass

from heads.eagle.config import DecoderHeadConfig

DRAFT_TYPE = "block"


@dataclass
class BlockConfig(DecoderHeadConfig):
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
        self.check_decoder_head(DRAFT_TYPE, ("num_layers", "budget"))
        if self.block_size < 2:
            raise ValueError(f"BlockConfig.block_size: expected >= 2 (the root's successor and at least one mask "
                             f"query), found {self.block_size}")
        if self.depth is not None and not 1 <= self.depth <= self.block_size:
            raise ValueError(f"BlockConfig.depth: expected null or 1..{self.block_size} (the block size), found "
                             f"{self.depth}")
