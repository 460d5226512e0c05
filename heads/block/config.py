"""What a block drafter stores as config.json (``BlockConfig``, strict): its base, the decoder's transformers config
(as the EAGLE head's: heads/decoder/config.py ``decoder_config``), the block size K, the draft vocabulary size, the
feature layers, drafting defaults and the measured agreement per block offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from heads.decoder.config import DecoderHeadConfig

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
    condition_rank: int = 0
    """r of the low-rank Markov logit bias keyed on the token before each block position (heads/block/condition.py),
    chained per tree node when drafting; 0: none (the unconditioned block)."""
    confidence: bool = False
    """a confidence head per block position (the chance the target accepts its draft); false: none."""
    confidence_min: float = 0.0
    """drafting default: a branch stops where the product of its nodes' confidences falls below this (0: never; needs
    the confidence head)."""
    rank_by: Literal["probability", "confidence"] = "probability"
    """drafting default: the tree budget keeps the nodes of highest path probability ("probability"), or of highest
    estimated chance of acceptance, each node scored by its confidence times its probability relative to the best
    sibling ("confidence"; needs the confidence head)."""
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
        check_conditioning("BlockConfig.", self.condition_rank, self.confidence, self.confidence_min, self.rank_by)

    def to_dict(self) -> dict:
        """config.json: the conditioned block's fields only where they are not their defaults, so a checkpoint without
        them is byte for byte what it was before they existed."""
        out = super().to_dict()
        for name, default in CONDITIONING_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out


CONDITIONING_DEFAULTS = {"condition_rank": 0, "confidence": False, "confidence_min": 0.0, "rank_by": "probability"}
"""the conditioned block's fields (heads/block/condition.py) and their values when it is off."""


def check_conditioning(where: str, rank: int, confidence: bool, confidence_min: float, rank_by: str) -> None:
    """The conditioned block's options, as a checkpoint and a recipe both check them (``where``: the key prefix)."""
    if rank < 0:
        raise ValueError(f"{where}condition_rank: expected 0 (no Markov bias) or a rank >= 1, found {rank}")
    if not 0.0 <= confidence_min < 1.0:
        raise ValueError(f"{where}confidence_min: expected a probability in [0, 1), found {confidence_min}")
    if not confidence and (confidence_min > 0 or rank_by == "confidence"):
        raise ValueError(f"{where}confidence_min={confidence_min}, {where}rank_by={rank_by!r}: both read the "
                         f"confidence head, which is off; set {where}confidence=true, or confidence_min=0 and "
                         f"rank_by=probability")
