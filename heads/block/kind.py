"""A block drafter as the trainer trains it (heads/training/kind.py): one forward per batch over every true pair and
``block.anchors`` blocks of K - 1 mask queries per row (``BlockHead.forward``), scored per block offset
(heads/block/loss.py), so the trainer's K accuracy rows acc[k][r] are the block offsets; its draft vocabulary is
counted on the training rows, and the target's logits it distils from are computed by its loss, on that vocabulary
only (so the target's forward gives hidden states alone)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from heads.block.config import BlockConfig
from heads.block.loss import block_loss, sample_anchors
from heads.block.model import BlockHead
from heads.eagle.kind import EagleKind
from heads.training.config import TrainConfig
from heads.training.losses import MedusaLoss


class BlockKind(EagleKind):
    """The EAGLE head's kind (its build, hidden pass, feature split and saving) with the block drafter's section,
    module and card, K predictions (the block offsets) and the anchored-block loss."""

    project = "block"
    MODULE = BlockHead
    CONFIG = BlockConfig
    WHAT = "the block drafter"
    PER = "block offset"

    def section(self, cfg: TrainConfig) -> Any:
        return cfg.block

    def config_options(self, section: Any) -> dict[str, Any]:
        return {"block_size": section.block_size}

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.block.block_size

    def batch_loss(self, cfg: TrainConfig, module: nn.Module, inner: nn.Module, final: torch.Tensor,
                   features: torch.Tensor, batch: dict, ranks: int, per_row: bool) -> MedusaLoss | list[MedusaLoss]:
        """Every true pair and ``block.anchors`` anchored blocks per row in one forward, scored per block offset."""
        labels = batch["labels"]
        anchors = sample_anchors(labels, cfg.block.block_size, cfg.block.anchors, cfg.seed, batch["index"])  # [B, A]
        pairs, blocks = module(features, batch["input_ids"], batch["lengths"], anchors)  # [B, n, D], [B, A, M, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, ranks=ranks)
        if not per_row:
            return block_loss(pairs, blocks, anchors, final, labels, inner, **args)
        return [block_loss(pairs[b:b + 1], blocks[b:b + 1], anchors[b:b + 1], final[b:b + 1], labels[b:b + 1], inner,
                           **args) for b in range(final.shape[0])]
