"""An EAGLE-style head as the trainer trains it (heads/training/kind.py): the head unrolls ``eagle.unroll`` drafting
steps over whole rows (``EagleHead.forward``), each scored on token t+2 (heads/eagle/loss.py); its draft vocabulary is
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

from heads.checkpoints.files import write_checkpoint
from heads.eagle.config import EagleConfig
from heads.eagle.loss import eagle_loss
from heads.eagle.model import EagleHead, eagle_card
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss

log = logging.getLogger(__name__)


class EagleKind(HeadKind):
    project = "eagle"

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[EagleHead, EagleConfig]:
        e = cfg.eagle
        config = EagleConfig.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_layers=e.num_layers,
            draft_vocab_size=e.draft_vocab, feature_layers=e.feature_layers, depth=e.depth, topk=e.topk,
            budget=e.budget, recipe=to_dict(cfg))
        head = EagleHead(config, model.get_input_embeddings(), model.get_output_embeddings())
        count_vocabulary(head.draft_vocab, train_rows, tokenizer)
        return head, config

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.eagle.unroll

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(feature_layers=cfg.eagle.feature_layers)

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The unrolled loss of a batch (one forward of the wrapped head), or one per row. hidden [B, T, D] (the final
        hidden states), or [B, T, (1 + L) D] with feature layers (the final ones first, see TargetStates)."""
        inner = unwrapped(module)  # DDP / DeepSpeed wrap the head
        D = inner.config.hidden_size
        final = hidden[..., :D]  # [B, T, D] what the loss reads
        features = hidden[..., D:] if inner.config.feature_layers else final  # [B, T, F] what the head reads
        outs = module(features, batch["input_ids"], batch["lengths"], cfg.eagle.unroll)  # [U, B, n, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, feature_weight=cfg.eagle.feature_weight, ranks=ranks)
        if not per_row:
            return eagle_loss(outs, final, batch["labels"], inner, inner.lm_head, **args)
        return [eagle_loss(outs[:, b:b + 1], final[b:b + 1], batch["labels"][b:b + 1], inner, inner.lm_head, **args)
                for b in range(final.shape[0])]

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: EagleConfig,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        """The trained head with its measured per-step agreement -> its checkpoint, on the main process only."""
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else [float(row[0]) for row in accuracy]
            final = replace(config, top1_agreement=agreement)
            # the gathered tensors (the trained head's own state dict) are written as they are: a fresh head to load
            # them into would be built empty under DeepSpeed ZeRO-3, whose transformers integration partitions every
            # new model (zero.Init); the checkpoint is checked against its config when it is read
            write_checkpoint(directory, {k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                             final.to_dict(), eagle_card(final, str(directory)))
            log.info("saved the EAGLE head to %s (top-1 agreement with the target per step: %s)", directory, agreement)

        save_on_main(accelerator, module, write)
        return directory
