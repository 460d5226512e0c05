"""A separate draft model as the trainer trains it (heads/training/kind.py): the student (heads/draft_model/student.py)
distilled from the frozen target at every position whose next token the data trains, one prediction per position
(the token after it, as the target's LM head predicts).

The target's forward gives its final hidden states alone (``HiddenPass()``: cacheable, so epochs after the first skip
the target); the loss turns the scored positions' states into the target's logits through the target's own LM head,
so no [B, T, V] tensor is built or stored:

    position t            scored where labels[t + 1] != -100 (an assistant token, not padding)
    target  f_t ─ LM head ─▶ p_target(x_{t+1} | x_<=t)
    student x_<=t ─ its layers, norm, LM head ─▶ q_draft(x_{t+1} | x_<=t)

loss.kind "kl": KL(p_target || q_draft); "ce": the cross-entropy of the target's own greedy token. Accuracy is the
student's top-r agreement with the target's greedy token (the trainer's acc[0][r]; greedy acceptance needs r = 0).

Shapes: B batch, T time, N scored positions, D hidden size, V vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from transformers import PreTrainedModel

from heads.base import base_name
from heads.draft_model.save import Distilled, save_draft_model
from heads.draft_model.student import Distillation, build_student, chosen_layers
from heads.training.config import TrainConfig
from heads.training.draft_vocab import draft_vocabulary, end_of_turn
from heads.training.kind import HeadKind, HiddenPass, save_on_main, unwrapped
from heads.training.losses import MedusaLoss, batch_loss, gather_scored
from selfspec.core import hf

log = logging.getLogger(__name__)
PREFIX = "student."
"""the student's tensors' prefix in the trained module's state dict (``Distillation.student``)."""


class DraftModelKind(HeadKind):
    project = "draft-model"
    """not "draft_model": TensorBoard writes to <output_dir>/<project>, the model goes to <output_dir>/draft_model."""
    final_dir = "draft_model"
    shape = ("draft_model.layers", "draft_model.num_layers", "draft_model.train_embeddings", "draft_model.draft_vocab")

    def check_recipe(self, cfg: TrainConfig) -> None:
        """The layers to copy."""
        if cfg.draft_model.layers is None and cfg.draft_model.num_layers is None:
            raise ValueError("draft_model: method draft_model needs draft_model.layers (target layer indices) or "
                             "draft_model.num_layers (evenly spaced), found neither")

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[Distillation, Distilled]:
        """The student on the target's section-chosen layers (checked against the target); its "config" is what
        ``save`` writes beside it (the target, the layers, the tokenizer)."""
        s = cfg.draft_model
        total = len(hf.decoder_layers(model))
        layers = chosen_layers(s.layers, s.num_layers, total)
        student = build_student(model, layers, s.train_embeddings)
        V = model.get_output_embeddings().weight.shape[0]
        vocab = None
        if train_rows is not None and 0 < s.draft_vocab < V:  # the V' most frequent training tokens, end of turn kept
            vocab = draft_vocabulary(train_rows, s.draft_vocab, V, end_of_turn(tokenizer)).tolist()
        facts = Distilled(base_model=base_name(model, cfg.model.name), base_revision=cfg.model.revision, layers=layers,
                          target_layers=total, train_embeddings=s.train_embeddings, tokenizer=tokenizer,
                          draft_vocab=vocab)
        log.info("draft model: %d of the target's %d layers %s, %.1fM trained parameters", len(layers), total, layers,
                 sum(p.numel() for p in student.parameters() if p.requires_grad) / 1e6)
        return Distillation(student, model), facts

    def predictions(self, cfg: TrainConfig) -> int:
        return 1

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        return HiddenPass()  # the final hidden states; the loss applies the target's LM head where it scores

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """hidden [B, T, D] the target's final hidden states -> the student's loss at the positions whose next token
        is trained, against the target's distribution there (see the module docstring)."""
        scored = gather_scored(batch["labels"], 1, first=0)[0]  # [B, T] labels[t + 1] is a training token
        p_logits = unwrapped(module).target_logits(hidden[scored])  # [N, V]
        greedy = p_logits.argmax(-1)[None]  # [1, N] the target's own token: what accuracy (and "ce") is scored on
        q_logits = module(batch["input_ids"], batch["attention_mask"], scored)  # [1, N, V]
        return batch_loss(q_logits, scored, greedy, [p_logits], cfg.loss.decay, cfg.loss.kind, ranks, per_row)

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: Distilled,
             model: PreTrainedModel, accuracy: list[list[float]] | None) -> Path:
        """The trained student as a transformers model directory with the target's tokenizer and a card naming the
        target, its layers and the measured top-1 agreement, on the main process only."""
        directory = cfg.final_dir

        def write(state: dict[str, torch.Tensor]) -> None:
            agreement = None if accuracy is None else float(accuracy[0][0])
            weights = {k[len(PREFIX):]: v.float() if v.is_floating_point() else v
                       for k, v in state.items() if k.startswith(PREFIX)}
            save_draft_model(directory, unwrapped(module).student, weights, config, agreement)
            log.info("saved the draft model to %s (top-1 agreement with the target %s)", directory, agreement)

        save_on_main(accelerator, module, write)
        return directory
