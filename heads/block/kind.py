"""A block drafter as the trainer trains it (heads/training/kind.py): one forward per batch over every true pair and
``block.anchors`` blocks of K - 1 mask queries per row (``BlockHead.forward``), scored per block offset
(heads/block/loss.py), so the trainer's K accuracy rows acc[k][r] are the block offsets; its draft vocabulary is
counted on the training rows, and the target's logits it distils from are computed by its loss, on that vocabulary
only (so the target's forward gives hidden states alone)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.block.config import BlockConfig
from heads.block.loss import block_loss, sample_anchors
from heads.block.model import BlockHead, block_card
from heads.checkpoints.files import write_checkpoint
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss

log = logging.getLogger(__name__)


class BlockKind(HeadKind):
    project = "block"

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[BlockHead, BlockConfig]:
        b = cfg.block
        config = BlockConfig.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_layers=b.num_layers,
            block_size=b.block_size, draft_vocab_size=b.draft_vocab, feature_layers=b.feature_layers, depth=b.depth,
            budget=b.budget, recipe=to_dict(cfg))
        head = BlockHead(config, model.get_input_embeddings(), model.get_output_embeddings())
        count_vocabulary(head.draft_vocab, train_rows, tokenizer)
        return head, config

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.block.block_size

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(feature_layers=cfg.block.feature_layers)

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The loss of a batch (one forward of the wrapped head), or one per row. hidden [B, T, D] (the final hidden
        states), or [B, T, (1 + L) D] with feature layers (the final ones first, see TargetStates)."""
        inner = unwrapped(module)  # DDP / DeepSpeed wrap the head
        D = inner.config.hidden_size
        final = hidden[..., :D]  # [B, T, D] what the loss reads
        features = hidden[..., D:] if inner.config.feature_layers else final  # [B, T, F] what the head reads
        labels = batch["labels"]
        anchors = sample_anchors(labels, cfg.block.block_size, cfg.block.anchors, cfg.seed, batch["index"])  # [B, A]
        pairs, blocks = module(features, batch["input_ids"], batch["lengths"], anchors)  # [B, n, D], [B, A, M, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, ranks=ranks)
        if not per_row:
            return block_loss(pairs, blocks, anchors, final, labels, inner, **args)
        return [block_loss(pairs[b:b + 1], blocks[b:b + 1], anchors[b:b + 1], final[b:b + 1], labels[b:b + 1], inner,
                           **args) for b in range(final.shape[0])]

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: BlockConfig,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        """The trained head with its measured per-offset agreement -> its checkpoint, on the main process only."""
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else [float(row[0]) for row in accuracy]
            final = replace(config, top1_agreement=agreement)
            # the gathered state is written as it is (see heads/eagle/kind.py: no fresh head under ZeRO-3); the
            # checkpoint is checked against its config when it is read
            write_checkpoint(directory, {k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                             final.to_dict(), block_card(final, str(directory)))
            log.info("saved the block drafter to %s (top-1 agreement with the target per block offset: %s)", directory,
                     agreement)

        save_on_main(accelerator, module, write)
        return directory
