"""An EAGLE-style head as the trainer trains it (heads/training/kind.py): the head unrolls ``eagle.unroll`` drafting
steps over whole rows (``EagleHead.forward``), each scored on token t+2 (heads/eagle/loss.py); its draft vocabulary is
counted on the training rows, and the target's logits it distils from are computed by its loss, on that vocabulary
only (so the target's forward gives hidden states alone).

``Eagle3Kind`` (method ``eagle3``) trains the same way a draft of speculators' EAGLE-3 architecture
(heads/eagle/eagle3.py), from the same ``eagle`` section, and saves it in speculators' format: vLLM and speculators
load what it writes as it is.

What these kinds share with the block drafter's (building, the hidden pass, saving; speculators' saving) is
heads/decoder/kind.py's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from heads.decoder.kind import DecoderKind, SpeculatorsKind, draft_size, new_draft
from heads.eagle.config import EagleConfig
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.loss import eagle_loss
from heads.eagle.model import EagleHead
from heads.eagle.speculators_config import Eagle3Config, llama_layers_for
from heads.training.config import TrainConfig
from heads.training.losses import MedusaLoss


class EagleKind(DecoderKind):
    """The EAGLE head: ``DecoderKind`` (heads/decoder/kind.py: its build, hidden pass, feature split and saving) with
    the ``eagle`` section, the head's module and config, ``eagle.unroll`` predictions and the unrolled loss."""

    project = "eagle"
    final_dir = "eagle_head"
    shape = ("eagle.num_layers", "eagle.draft_vocab", "eagle.feature_layers")
    MODULE: type = EagleHead
    CONFIG: type = EagleConfig
    WHAT = "the EAGLE head"
    PER = "step"
    """what each row of the measured agreement is per (an unrolled drafting step)."""

    def section(self, cfg: TrainConfig) -> Any:
        return cfg.eagle

    def config_options(self, section: Any) -> dict[str, Any]:
        return {"topk": section.topk}

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.eagle.unroll

    def batch_loss(self, cfg: TrainConfig, module: nn.Module, inner: nn.Module, final: torch.Tensor,
                   features: torch.Tensor, batch: dict, ranks: int, per_row: bool) -> MedusaLoss | list[MedusaLoss]:
        """The unrolled loss (``EagleHead.forward`` over ``eagle.unroll`` steps), or one per row."""
        outs = module(features, batch["input_ids"], batch["lengths"], cfg.eagle.unroll)  # [U, B, n, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, feature_weight=cfg.eagle.feature_weight, ranks=ranks)
        if not per_row:
            return eagle_loss(outs, final, batch["labels"], inner, inner.verifier_lm_head, **args)
        return [eagle_loss(outs[:, b:b + 1], final[b:b + 1], batch["labels"][b:b + 1], inner, inner.verifier_lm_head,
                           **args) for b in range(final.shape[0])]


class Eagle3Kind(SpeculatorsKind, EagleKind):
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

    def stored(self, state: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """The target's embeddings written too, as speculators writes them (its loader leaves them uninitialised
        where a checkpoint lacks them)."""
        state.setdefault("embed_tokens.weight", model.get_input_embeddings().weight.detach().float().cpu())
        return state
