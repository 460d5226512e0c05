"""Hydra heads as the trainer trains them (heads/training/kind.py): Medusa's loss, index shift and saving
(heads/medusa/kind.py), with each head also reading the data's tokens after t (teacher forcing, ``following``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.hydra.model import HydraConfig, HydraHeads, following
from heads.medusa.kind import MedusaKind
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocab_size


class HydraKind(MedusaKind):
    """Medusa's kind (its predictions, loss, saving), with Hydra heads built and each head reading the data's tokens
    after t."""

    project = "hydra"
    final_dir = "hydra_heads"
    MODULE = HydraHeads

    def check_recipe(self, cfg: TrainConfig) -> None:
        if cfg.heads.projection != "shared":
            raise ValueError(f"heads.projection: Hydra heads read the base's own LM head (shared), found "
                             f"{cfg.heads.projection!r}; set heads.projection=shared")

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

    def logits(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, batch: dict, scored: torch.Tensor,
               on_draft_vocab: bool) -> torch.Tensor:
        """As Medusa heads', each head also reading the tokens after t (teacher forcing): [K, N, V or V']."""
        args = {"on_draft_vocab": True} if on_draft_vocab else {}
        return module(hidden, following(batch["input_ids"], scored, cfg.heads.num_heads), **args)
