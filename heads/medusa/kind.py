"""Medusa heads as the trainer trains them (heads/training/kind.py): K heads on the final hidden state, head k scored
on token t+1+k (heads/training/losses.py), their loss read on their draft vocabulary; saved with the accuracy measured
on held-out data and the tree built from it (heads/tree_search.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocab_size
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss, batch_loss, gather_scored
from heads.tree_search import best_choices
from selfspec.core.draft_vocab import DraftVocab

log = logging.getLogger(__name__)


class MedusaKind(HeadKind):
    project = "medusa"
    final_dir = "heads"
    shape = ("heads.num_heads", "heads.num_layers", "heads.projection", "heads.lora_rank", "heads.draft_vocab")
    MODULE: type = MedusaHeads
    """the module class saved at the end (Hydra heads subclass this kind)."""

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[MedusaHeads, MedusaConfig]:
        lm_head = model.get_output_embeddings()
        config = MedusaConfig.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_heads=cfg.heads.num_heads,
            num_layers=cfg.heads.num_layers, projection=cfg.heads.projection, lora_rank=cfg.heads.lora_rank,
            lora_alpha=cfg.heads.lora_alpha, draft_vocab_size=draft_vocab_size(cfg.heads.draft_vocab, lm_head),
            recipe=to_dict(cfg),
        )
        heads = MedusaHeads(config, lm_head)
        count_vocabulary(heads.draft_vocab, train_rows, tokenizer)
        return heads, config

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.heads.num_heads

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(target_logits=cfg.loss.kind == "kl", logit_vocab=loss_vocab(cfg, module))

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The heads run on the positions some head is scored on only (hidden [B, T, D] -> logits [K, N, V or V'])."""
        scored, targets, shifted = gather_scored(batch["labels"], cfg.heads.num_heads, target_logits)
        vocab = loss_vocab(cfg, module)
        logits = self.logits(cfg, module, hidden[scored], batch, scored, on_draft_vocab=vocab is not None)
        return batch_loss(logits, scored, targets, shifted, cfg.loss.decay, cfg.loss.kind, ranks, per_row,
                          None if vocab is None else vocab.tokens)

    def logits(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, batch: dict, scored: torch.Tensor,
               on_draft_vocab: bool) -> torch.Tensor:
        """hidden [N, D] at the scored positions -> the heads' logits [K, N, V], or [K, N, V'] on the draft
        vocabulary."""
        return module(hidden, **({"on_draft_vocab": True} if on_draft_vocab else {}))

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: MedusaConfig,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        return save_with_tree(accelerator, module, config, self.MODULE, model, accuracy, cfg.tree.budget,
                              cfg.final_dir)


def loss_vocab(cfg: TrainConfig, heads: nn.Module) -> DraftVocab | None:
    """The draft vocabulary that Medusa and Hydra heads read their loss on (loss.vocab "draft", heads with one), or
    None: the whole vocabulary."""
    if cfg.loss.vocab != "draft":
        return None
    vocab = unwrapped(heads).draft_vocab  # DDP / DeepSpeed wrap them
    return vocab if vocab.tokens is not None else None


def save_with_tree(accelerator: Accelerator, heads: nn.Module, config: Any, cls: type, model: PreTrainedModel,
                   accuracy: list[list[float]] | None, budget: int, directory: Path) -> Path:
    """Medusa or Hydra heads (``cls``) with the measured accuracy and the tree built from it -> save_pretrained, on
    the main process only. (Hydra heads' accuracy is measured with the true tokens on the path, which is what the tree
    search assumes: a node is only reached when every token above it was accepted.)"""
    def write(state: dict[str, torch.Tensor]) -> None:
        tree = best_choices(accuracy, budget) if accuracy is not None else None
        final = cls.on_base(replace(config, tree=tree, head_accuracy=accuracy), model)
        final.load_state_dict({k: v.float() for k, v in state.items()})
        final.save_pretrained(directory)
        log.info("saved the heads to %s (tree of %d nodes from measured accuracy)", directory, len(tree or []))

    save_on_main(accelerator, heads, write)
    return directory
