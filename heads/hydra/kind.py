"""Hydra heads as the trainer trains them (heads/training/kind.py): Medusa's loss, index shift and saving
(heads/medusa/kind.py), with each head also reading the data's tokens after t (teacher forcing, ``following``)."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.hydra.model import HydraConfig, HydraHeads, following
from heads.medusa.kind import loss_vocab, save_with_tree
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocab_size
from heads.training.kind import HeadKind, HiddenPass
from heads.training.losses import MedusaLoss, batch_loss, gather_scored


class HydraKind(HeadKind):
    project = "hydra"

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[HydraHeads, HydraConfig]:
        lm_head = model.get_output_embeddings()
        config = HydraConfig.for_model(model, base_model=cfg.model.name, base_revision=cfg.model.revision,
                                       num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers,
                                       draft_vocab_size=draft_vocab_size(cfg.heads.draft_vocab, lm_head),
                                       recipe=to_dict(cfg))
        heads = HydraHeads(config, model.get_input_embeddings(), lm_head)
        count_vocabulary(heads.draft_vocab, train_rows, tokenizer)
        return heads, config

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.heads.num_heads

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(target_logits=cfg.loss.kind == "kl", logit_vocab=loss_vocab(cfg, module))

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The heads run on the positions some head is scored on only, each reading the tokens after t there."""
        K = cfg.heads.num_heads
        scored, targets, shifted = gather_scored(batch["labels"], K, target_logits)
        vocab = loss_vocab(cfg, module)
        args = {"on_draft_vocab": True} if vocab is not None else {}
        logits = module(hidden[scored], following(batch["input_ids"], scored, K), **args)  # [K, N, V or V']
        return batch_loss(logits, scored, targets, shifted, cfg.loss.decay, cfg.loss.kind, ranks, per_row,
                          None if vocab is None else vocab.tokens)

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: HydraConfig,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        return save_with_tree(accelerator, module, config, HydraHeads, model, accuracy, cfg.tree.budget,
                              cfg.final_dir)
