"""What the kinds of heads built on a decoder of the target's own architecture share as the trainer trains them
(heads/training/kind.py): ``DecoderKind``, which the EAGLE head's kind (heads/eagle/kind.py ``EagleKind``) and the block
drafter's (heads/block/kind.py ``BlockKind``) both extend: building the head from the kind's recipe section, its draft
vocabulary counted on the training rows; the hidden pass (the final hidden states, and the feature layers' states);
splitting those into what the loss reads and what the head reads; saving the trained head with its measured
agreement. Each kind says its own section, config fields, prediction count and batch loss.

``SpeculatorsKind``, ``draft_size`` and ``new_draft`` are what the kinds training a draft of one of speculators'
architectures (heads/eagle/kind.py ``Eagle3Kind``, heads/block/kind.py ``DFlashKind``) share: sizing and building the
draft, its hidden pass, and saving it as speculators' own checkpoint.

Shapes: B batch, T time, D hidden size, L feature layers, F the width the head reads (D, or L·D).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.base import base_sizes
from heads.checkpoints.files import write_checkpoint
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocabulary, end_of_turn
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss

log = logging.getLogger(__name__)


class DecoderKind(HeadKind):
    """A head built on ``DecoderHead`` (heads/decoder/model.py), as the trainer trains it (see the module docstring).
    A kind extending it names its ``MODULE`` and ``CONFIG`` classes, its ``WHAT`` and ``PER``, and answers
    ``section``, ``predictions`` and ``batch_loss`` (and ``config_options`` for its config's own fields)."""

    MODULE: type
    """the head's module class (a ``DecoderHead``)."""
    CONFIG: type
    """its config class (a ``DecoderHeadConfig``: ``for_model``)."""
    WHAT: str
    """its name in the log ("the EAGLE head")."""
    PER: str
    """what each row of the measured agreement is per ("step", "block offset")."""

    def section(self, cfg: TrainConfig) -> Any:
        """The recipe section of this kind."""
        raise NotImplementedError

    def config_options(self, section: Any) -> dict[str, Any]:
        """The config fields of this kind beyond what every head built on a decoder has."""
        return {}

    def batch_loss(self, cfg: TrainConfig, module: nn.Module, inner: nn.Module, final: torch.Tensor,
                   features: torch.Tensor, batch: dict, ranks: int, per_row: bool) -> MedusaLoss | list[MedusaLoss]:
        """The loss of a batch from the final hidden states [B, T, D] (what the loss reads) and the features [B, T, F]
        (what the head reads), through the wrapped ``module`` (``inner`` unwrapped), or one per row."""
        raise NotImplementedError

    def card(self, config: Any, location: str) -> str:
        return self.MODULE.card_for(config, location)

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[nn.Module, Any]:
        s = self.section(cfg)
        config = self.CONFIG.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_layers=s.num_layers,
            draft_vocab_size=s.draft_vocab, feature_layers=s.feature_layers, depth=s.depth, budget=s.budget,
            recipe=to_dict(cfg), **self.config_options(s))
        head = self.MODULE(config, model.get_input_embeddings(), model.get_output_embeddings())
        count_vocabulary(head.draft_vocab, train_rows, tokenizer)
        return head, config

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(feature_layers=self.section(cfg).feature_layers)

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The loss of a batch (one forward of the wrapped head), or one per row. hidden [B, T, D] (the final hidden
        states), or [B, T, (1 + L) D] with feature layers (the final ones first, see TargetStates)."""
        inner = unwrapped(module)  # DDP / DeepSpeed wrap the head
        D = inner.config.hidden_size
        final = hidden[..., :D]  # [B, T, D] what the loss reads
        features = hidden[..., D:] if inner.config.feature_layers else final  # [B, T, F] what the head reads
        return self.batch_loss(cfg, module, inner, final, features, batch, ranks, per_row)

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: Any,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        """The trained head with its measured agreement per step (per block offset) -> its checkpoint, on the main
        process only."""
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else [float(row[0]) for row in accuracy]
            final = replace(config, top1_agreement=agreement)
            # the gathered tensors (the trained head's own state dict) are written as they are: a fresh head to load
            # them into would be built empty under DeepSpeed ZeRO-3, whose transformers integration partitions every
            # new model (zero.Init); the checkpoint is checked against its config when it is read
            write_checkpoint(directory, {k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                             final.to_dict(), self.card(final, str(directory)))
            log.info("saved %s to %s (top-1 agreement with the target per %s: %s)", self.WHAT, directory, self.PER,
                     agreement)

        save_on_main(accelerator, module, write)
        return directory


class SpeculatorsKind:
    """What a draft trained in one of speculators' architectures (heads/eagle/kind.py ``Eagle3Kind``, heads/block/kind.py
    ``DFlashKind``) does differently, put before the kind it extends: its hidden pass reads the aux layers its config
    resolved (speculators' default where the recipe says null); ``save`` writes the speculators checkpoint itself
    (config.json with no selfspec keys, model.safetensors under speculators' names, what ``stored`` adds or drops), its
    README.md naming the measured agreement."""

    WHAT: str
    PER: str
    MODULE: type

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(feature_layers=unwrapped(module).config.feature_layers)  # resolved: speculators' default

    def stored(self, state: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
        return state

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: Any,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else [round(float(row[0]), 4) for row in accuracy]
            state = self.stored({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, model)
            card = self.MODULE.card_for(config, str(directory))
            if agreement is not None:
                card += f"\nTop-1 agreement with the target on held-out data, per {self.PER}: {agreement}.\n"
            write_checkpoint(directory, state, config.to_dict(), card)
            log.info("saved %s to %s (top-1 agreement with the target per %s: %s)", self.WHAT, directory, self.PER,
                     agreement)

        save_on_main(accelerator, module, write)
        return directory


def draft_size(draft_vocab: int, model: PreTrainedModel) -> int:
    """A speculators draft's draft_vocab_size from its recipe key: the whole vocabulary for 0 or one no smaller."""
    _, vocab = base_sizes(model)
    return draft_vocab if 0 < draft_vocab < vocab else vocab


def new_draft(cls: type, config: Any, model: PreTrainedModel, where: str, train_rows, tokenizer) -> tuple[Any, Any]:
    """A new speculators draft (``cls``: Eagle3Head, DFlashHead) on ``model``: its aux layers resolved (a refusal names
    the recipe key ``where``), its draft vocabulary the most frequent training tokens with the end of turn, lm_head
    the target's rows of it -> (the draft, its config)."""
    try:
        head = cls.on_base(config, model)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if config.draft_vocab_size < config.vocab_size and train_rows is not None:
        head.set_draft_vocab(draft_vocabulary(train_rows, config.draft_vocab_size, config.vocab_size,
                                              end_of_turn(tokenizer)))
    head.init_lm_head()
    return head, head.config
