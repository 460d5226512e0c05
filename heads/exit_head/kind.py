"""An exit head as the trainer trains it (heads/training/kind.py): one prediction per position, from layer E's input
through the exit head and the target's own final norm and LM head (``ExitLogits``), scored on token t+1 like the LM
head; with a target to distil from, on agreeing with the target's own greedy token."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.exit_head.model import ExitHead, ExitHeadConfig, ExitLogits, final_norm
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocab_size
from heads.training.kind import HeadKind, HiddenPass, save_on_main
from heads.training.losses import IGNORE_INDEX, MedusaLoss, batch_loss, gather_scored

log = logging.getLogger(__name__)


class ExitHeadKind(HeadKind):
    project = "exit"
    final_dir = "exit_head"
    shape = ("exit.layer", "exit.num_layers", "exit.draft_vocab")

    def check_recipe(self, cfg: TrainConfig) -> None:
        if cfg.exit.layer is None or cfg.exit.layer < 1:
            raise ValueError(f"exit.layer: method exit_head needs the exit layer E >= 1 (drafting runs layers "
                             f"0..E-1), found {cfg.exit.layer}")
        if cfg.hidden_cache.enabled and cfg.loss.kind == "kl":
            raise ValueError("hidden_cache.enabled with method exit_head and loss.kind kl: the KL loss needs the "
                             "target's final hidden states as well as layer E's, and the cache stores one; "
                             "set hidden_cache.enabled=false or loss.kind=ce")

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[ExitLogits, ExitHeadConfig]:
        lm_head = model.get_output_embeddings()
        config = ExitHeadConfig.for_model(
            model, cfg.exit.layer, base_model=cfg.model.name, base_revision=cfg.model.revision,
            num_layers=cfg.exit.num_layers, draft_depth=cfg.exit.draft_depth, stop_below=cfg.exit.stop_below,
            draft_vocab_size=draft_vocab_size(cfg.exit.draft_vocab, lm_head), recipe=to_dict(cfg),
        )
        exit_head = ExitHead(config)
        count_vocabulary(exit_head.draft_vocab, train_rows, tokenizer)
        return ExitLogits(exit_head, final_norm(model), lm_head), config

    def predictions(self, cfg: TrainConfig) -> int:
        return 1

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(layer=cfg.exit.layer, target_logits=cfg.loss.kind == "kl")

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """hidden [B, T, D] layer E's input -> logits [1, N, V] at the scored positions, a look-ahead of 0."""
        scored, targets, shifted = gather_scored(batch["labels"], 1, target_logits, first=0)
        if shifted is not None:  # scored on agreeing with the target itself
            targets = torch.where(targets == IGNORE_INDEX, targets, shifted[0].argmax(-1)[None])
        logits = module(hidden[scored])  # [1, N, V]
        return batch_loss(logits, scored, targets, shifted, cfg.loss.decay, cfg.loss.kind, ranks, per_row)

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: ExitHeadConfig,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        """The trained exit head with its measured top-1 agreement -> save_pretrained, on the main process only."""
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else float(accuracy[0][0])
            head = ExitHead(replace(config, top1_agreement=agreement))
            prefix = "exit_head."
            head.load_state_dict({k[len(prefix):]: v.float() if v.is_floating_point() else v
                                  for k, v in state.items() if k.startswith(prefix)})
            head.save_pretrained(directory)
            log.info("saved the exit head to %s (top-1 agreement with the target %s)", directory, agreement)

        save_on_main(accelerator, module, write)
        return directory
