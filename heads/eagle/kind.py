"""An EAGLE-style head as the trainer trains it (heads/training/kind.py): the head unrolls ``eagle.unroll`` drafting
steps over whole rows (``EagleHead.forward``), each scored on token t+2 (heads/eagle/loss.py); its draft vocabulary is
counted on the training rows, and the target's logits it distils from are computed by its loss, on that vocabulary
only (so the target's forward gives hidden states alone).

``Eagle3Kind`` (method ``eagle3``) trains the same way a draft of speculators' EAGLE-3 architecture
(heads/eagle/eagle3.py), from the same ``eagle`` section, and saves it in speculators' format: vLLM and speculators
load what it writes as it is."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.checkpoints.files import write_checkpoint
from heads.base import base_sizes
from heads.eagle.config import EagleConfig
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.loss import eagle_loss
from heads.eagle.model import EagleHead
from heads.eagle.speculators_config import Eagle3Config, llama_layers_for
from heads.training.config import TrainConfig, to_dict
from heads.training.draft_vocab import count_vocabulary, draft_vocabulary, end_of_turn
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss

log = logging.getLogger(__name__)


class EagleKind(HeadKind):
    """The EAGLE head; the block drafter (heads/block/kind.py) is this kind with its own section, module, card,
    prediction count and batch loss."""

    project = "eagle"
    final_dir = "eagle_head"
    shape = ("eagle.num_layers", "eagle.draft_vocab", "eagle.feature_layers")
    MODULE: type = EagleHead
    CONFIG: type = EagleConfig
    WHAT = "the EAGLE head"
    PER = "step"
    """what each row of the measured agreement is per (an unrolled drafting step)."""

    def section(self, cfg: TrainConfig) -> Any:
        """The recipe section of this kind."""
        return cfg.eagle

    def config_options(self, section: Any) -> dict[str, Any]:
        """The config fields of this kind beyond what every EAGLE-style head has."""
        return {"topk": section.topk}

    def card(self, config: Any, location: str) -> str:
        return self.MODULE.card_for(config, location)

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[EagleHead, EagleConfig]:
        s = self.section(cfg)
        config = self.CONFIG.for_model(
            model, base_model=cfg.model.name, base_revision=cfg.model.revision, num_layers=s.num_layers,
            draft_vocab_size=s.draft_vocab, feature_layers=s.feature_layers, depth=s.depth, budget=s.budget,
            recipe=to_dict(cfg), **self.config_options(s))
        head = self.MODULE(config, model.get_input_embeddings(), model.get_output_embeddings())
        count_vocabulary(head.draft_vocab, train_rows, tokenizer)
        return head, config

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.eagle.unroll

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

    def batch_loss(self, cfg: TrainConfig, module: nn.Module, inner: nn.Module, final: torch.Tensor,
                   features: torch.Tensor, batch: dict, ranks: int, per_row: bool) -> MedusaLoss | list[MedusaLoss]:
        """The unrolled loss (``EagleHead.forward`` over ``eagle.unroll`` steps), or one per row."""
        outs = module(features, batch["input_ids"], batch["lengths"], cfg.eagle.unroll)  # [U, B, n, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, feature_weight=cfg.eagle.feature_weight, ranks=ranks)
        if not per_row:
            return eagle_loss(outs, final, batch["labels"], inner, inner.verifier_lm_head, **args)
        return [eagle_loss(outs[:, b:b + 1], final[b:b + 1], batch["labels"][b:b + 1], inner, inner.verifier_lm_head,
                           **args) for b in range(final.shape[0])]

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


class SpeculatorsSaving:
    """``save`` for a draft trained in one of speculators' architectures (``Eagle3Kind``, heads/block/kind.py
    ``DFlashKind``): the speculators checkpoint itself (config.json with no selfspec keys, model.safetensors under
    speculators' names, what ``stored`` adds or drops), its README.md naming the measured agreement."""

    WHAT: str
    PER: str
    MODULE: type

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


class Eagle3Kind(SpeculatorsSaving, EagleKind):
    """speculators' EAGLE-3 draft (heads/eagle/eagle3.py), trained from the ``eagle`` section as the EAGLE head is
    (the same unroll, loss and draft vocabulary), saved in speculators' format.

    What the section means here: ``num_layers`` Llama layers (what vLLM runs every EAGLE-3 draft as) sized like the
    target; ``feature_layers`` the aux layers fc fuses (null: speculators' default [2, L // 2, L - 3]; the final
    hidden state cannot be one: speculators and vLLM read the last layer's output before the final norm, which the
    verifier does not give a drafter); ``draft_vocab`` its d2t / t2d; ``depth`` the chain vLLM drafts
    (speculative_tokens). ``feature_weight`` must be 0 (the draft's state is not the target's: EAGLE-3 has no feature
    regression); ``topk`` and ``budget`` are selfspec's drafting defaults for every such draft, not stored. Its lm_head
    starts as the target's rows of the draft vocabulary and trains (speculators' trainer does the same)."""

    project = "eagle3"
    final_dir = "eagle3_head"
    MODULE = Eagle3Head
    CONFIG = Eagle3Config
    WHAT = "the EAGLE-3 draft (speculators' format)"

    def check_recipe(self, cfg: TrainConfig) -> None:
        if cfg.eagle.feature_weight != 0:
            raise ValueError(f"eagle.feature_weight: method eagle3 trains speculators' EAGLE-3 draft, whose state is "
                             f"not the target's (no feature regression): expected 0, found {cfg.eagle.feature_weight}")

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[Eagle3Head, Eagle3Config]:
        s = self.section(cfg)
        config = Eagle3Config(
            transformer_layer_config=llama_layers_for(model, s.num_layers),
            draft_vocab_size=draft_size(s.draft_vocab, model), verifier=cfg.model.name,
            verifier_architectures=list(model.config.architectures or []),
            eagle_aux_hidden_state_layer_ids=s.feature_layers, speculative_tokens=s.depth)
        return new_draft(Eagle3Head, config, model, "eagle.feature_layers (method eagle3)", train_rows, tokenizer)

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass(feature_layers=unwrapped(module).config.feature_layers)  # resolved: speculators' default

    def stored(self, state: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """The target's embeddings written too, as speculators writes them (its loader leaves them uninitialised
        where a checkpoint lacks them)."""
        state.setdefault("embed_tokens.weight", model.get_input_embeddings().weight.detach().float().cpu())
        return state


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
