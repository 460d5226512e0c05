"""What the trainer asks of the kind of draft it trains, so that no step of heads/training/trainer.py asks which kind
it is. Each kind answers in its own package (heads/medusa/kind.py, heads/hydra/kind.py, heads/eagle/kind.py,
heads/exit_head/kind.py); heads/kinds.py finds it by the recipe's ``method``.

    build         the module trained on the frozen target (its draft vocabulary counted on the training rows) and its
                  config
    predictions   K: the predictions per position a step scores (rows of the logged accuracy, acc[k][r])
    hidden_pass   what the target's forward must give the module: which hidden states, and its logits for a KL loss
    loss          a batch's loss and accuracy (``MedusaLoss``), from the target's states of the batch
    save          the trained module with what was measured on held-out data -> its checkpoint directory
    project       the tracker's project name when the recipe names none

and declares what it can do, read before anything is built: ``final_dir`` (where in output_dir its draft is saved),
``losses`` (the loss.kind values its loss computes), ``shape`` (the recipe values its weights' shapes follow: a run
resumes only with the same) and ``check_recipe`` (what it needs of the recipe beyond its
section's own types and ranges: refused when the recipe is read, not after the model and data have loaded).

Shapes: B batch, T time, D hidden size (F: the width the module reads), V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from datasets import Dataset
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from heads.training.config import TrainConfig
from heads.training.losses import MedusaLoss
from selfspec.core.draft_vocab import DraftVocab


@dataclass(frozen=True)
class HiddenPass:
    """What the frozen target's forward gives the trained module (heads/training/hidden_cache.py ``TargetStates``)."""

    layer: int | None = None
    """None: the final hidden states [B, T, D]; E: layer E's input (an exit head)."""
    feature_layers: list[int] | None = None
    """an EAGLE-3 head's: the states at these ``hidden_states`` indices too, [B, T, (1 + L) D]."""
    target_logits: bool = False
    """the target's logits too ([B, T, V], or [B, T, V'] on ``logit_vocab``), for a KL loss."""
    logit_vocab: DraftVocab | None = None
    """the draft vocabulary the KL loss reads the target's logits on (None: the whole vocabulary)."""


class HeadKind(Protocol):
    """One kind of trained draft, as the trainer sees it (see the module docstring); subclassed explicitly."""

    project: str
    """the tracker's project / run name when ``logging.project`` is null."""
    final_dir: str
    """the subdirectory of ``output_dir`` the trained draft is saved to (``TrainConfig.final_dir``)."""
    losses: tuple[str, ...] = ("ce", "kl")
    """the ``loss.kind`` values its loss computes."""
    shape: tuple[str, ...]
    """the recipe values that shape its draft's weights ('heads.num_heads', ...): a checkpoint of another shape cannot
    be resumed (heads/training/run_folder.py)."""
    shape_defaults: dict[str, Any] = {}
    """shape values added after runs were recorded without them: a run.json lacking one had this value."""

    def check_recipe(self, cfg: TrainConfig) -> None:
        """Refuse a recipe this kind cannot train, saying which value and why (called by ``TrainConfig.__post_init__``
        after every section has checked itself); the default needs nothing more."""
        return None

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows: Dataset | None = None,
              tokenizer: PreTrainedTokenizerBase | None = None) -> tuple[nn.Module, Any]:
        """(the module trained on the frozen ``model``, its config); a draft vocabulary is counted on ``train_rows``."""
        ...

    def predictions(self, cfg: TrainConfig) -> int:
        """K: the predictions per position a training step scores."""
        ...

    def hidden_pass(self, cfg: TrainConfig, module: nn.Module) -> HiddenPass:
        """What the target's forward must give ``module`` (possibly wrapped by DDP / DeepSpeed)."""
        ...

    def loss(self, cfg: TrainConfig, module: nn.Module, hidden: torch.Tensor, target_logits: torch.Tensor | None,
             batch: dict, ranks: int, per_row: bool = False) -> MedusaLoss | list[MedusaLoss]:
        """The loss of a batch from the target's states of it (``hidden_pass``): accuracy over ``ranks`` ranks (0:
        none); per_row: one MedusaLoss per row of the batch."""
        ...

    def save(self, cfg: TrainConfig, accelerator: Accelerator, module: nn.Module, config: Any, model: PreTrainedModel,
             accuracy: list[list[float]] | None) -> Path:
        """Save the trained ``module`` (its ``config`` from ``build``, ``accuracy`` acc[k][r] measured on held-out data
        or None) to ``cfg.final_dir``, on the main process only; every process calls it."""
        ...


def unwrapped(module: nn.Module) -> nn.Module:
    """The module DDP / DeepSpeed wrap (``module.module``), or the module itself."""
    return module.module if hasattr(module, "module") else module


def save_on_main(accelerator: Accelerator, module: nn.Module, write) -> None:
    """Gather ``module``'s state on every process (DeepSpeed gathers partitioned weights) and ``write(state)`` it on the
    main process only; every process waits for it."""
    state = accelerator.get_state_dict(module)
    if accelerator.is_main_process:
        write(state)
    accelerator.wait_for_everyone()
