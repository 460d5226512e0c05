"""A block drafter as the trainer trains it (heads/training/kind.py): one forward per batch over every true pair and
``block.anchors`` blocks of K - 1 mask queries per row (``BlockHead.forward``), scored per block offset
(heads/block/loss.py), so the trainer's K accuracy rows acc[k][r] are the block offsets; its draft vocabulary is
counted on the training rows, and the target's logits it distils from are computed by its loss, on that vocabulary
only (so the target's forward gives hidden states alone).

``DFlashKind`` (method ``dflash``) trains, from the same ``block`` section and loss, a draft of speculators' DFlash
architecture (heads/block/dflash.py: ``block.anchors`` blocks of [root, mask x K] per row over the target's context),
and saves it in speculators' format: vLLM and speculators load what it writes as it is."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from transformers import PreTrainedModel

from heads.block.config import BlockConfig
from heads.block.dflash import DFlashHead
from heads.block.dflash_config import DFlashConfig, qwen3_layers_for
from heads.block.loss import block_loss, sample_anchors
from heads.block.model import BlockHead
from heads.decoder.kind import DecoderKind, SpeculatorsKind, draft_size, new_draft
from heads.training.config import TrainConfig
from heads.training.losses import MedusaLoss


class BlockKind(DecoderKind):
    """``DecoderKind`` (heads/decoder/kind.py: its build, hidden pass, feature split and saving, as the EAGLE head's
    kind) with the ``block`` section, the block drafter's module and config, K predictions (the block offsets) and the
    anchored-block loss."""

    project = "block"
    final_dir = "block_head"
    shape = ("block.num_layers", "block.block_size", "block.draft_vocab", "block.feature_layers",
             "block.condition_rank", "block.confidence")
    shape_defaults = {"block.condition_rank": 0, "block.confidence": False}  # runs recorded before these options
    losses = ("ce", "kl", "rkl", "tv", "jsd", "tv_ce")  # heads/block/loss.py
    MODULE = BlockHead
    CONFIG = BlockConfig
    WHAT = "the block drafter"
    PER = "block offset"
    FIRST_OFFSET = 1
    """the first block offset an anchored block trains (offset 0 is every pair's here; a DFlash block trains all)."""

    def section(self, cfg: TrainConfig) -> Any:
        return cfg.block

    def config_options(self, section: Any) -> dict[str, Any]:
        return {"block_size": section.block_size, "condition_rank": section.condition_rank,
                "confidence": section.confidence, "confidence_min": section.confidence_min, "rank_by": section.rank_by}

    def predictions(self, cfg: TrainConfig) -> int:
        return cfg.block.block_size

    def batch_loss(self, cfg: TrainConfig, module: nn.Module, inner: nn.Module, final: torch.Tensor,
                   features: torch.Tensor, batch: dict, ranks: int, per_row: bool) -> MedusaLoss | list[MedusaLoss]:
        """Every true pair and ``block.anchors`` anchored blocks per row in one forward, scored per block offset."""
        labels = batch["labels"]
        anchors = sample_anchors(labels, cfg.block.block_size, cfg.block.anchors, cfg.seed, batch["index"],
                                 self.FIRST_OFFSET)  # [B, A]
        pairs, blocks = module(features, batch["input_ids"], batch["lengths"], anchors)  # [B, n, D] (None: DFlash), [B, A, M or K, D]
        args = dict(kind=cfg.loss.kind, decay=cfg.loss.decay, ranks=ranks, ce_mix=cfg.loss.ce_mix,
                    confidence_weight=cfg.block.confidence_weight)
        ids = batch["input_ids"]  # a conditioned block's Markov bias reads the true token before each position
        if not per_row:
            return block_loss(pairs, blocks, anchors, final, labels, inner, input_ids=ids, **args)
        return [block_loss(None if pairs is None else pairs[b:b + 1], blocks[b:b + 1], anchors[b:b + 1],
                           final[b:b + 1], labels[b:b + 1], inner, input_ids=ids[b:b + 1], **args)
                for b in range(final.shape[0])]


class DFlashKind(SpeculatorsKind, BlockKind):
    """speculators' DFlash draft (heads/block/dflash.py), trained from the ``block`` section with the block drafter's
    loss, saved in speculators' format.

    What the section means here: ``num_layers`` Qwen3-style layers sized like the target; ``block_size`` K, the tokens
    one forward drafts (speculators' block_size is K + 1: the root's slot too); ``anchors`` the blocks trained per row;
    ``feature_layers`` the aux layers fc fuses (null: speculators' default [2, L // 2, L - 3]; not the final hidden
    state, as for EAGLE-3); ``draft_vocab`` its d2t / t2d (lm_head: the target's rows, frozen, as in speculators);
    ``mask_token_id`` the token whose embedding fills the mask slots. ``depth`` and ``budget`` are selfspec's drafting
    defaults for every such draft (the whole block, 16 nodes), not stored."""

    project = "dflash"
    final_dir = "dflash_head"
    MODULE = DFlashHead
    CONFIG = DFlashConfig
    WHAT = "the DFlash draft (speculators' format)"
    FIRST_OFFSET = 0

    def check_recipe(self, cfg: TrainConfig) -> None:
        b = cfg.block
        if b.condition_rank or b.confidence:
            raise ValueError(f"block.condition_rank={b.condition_rank}, block.confidence={b.confidence}: method dflash "
                             "saves speculators' DFlash format, which has no Markov bias or confidence head; use "
                             "method block, or set block.condition_rank=0 and block.confidence=false")

    def build(self, cfg: TrainConfig, model: PreTrainedModel, train_rows=None, tokenizer=None
              ) -> tuple[DFlashHead, DFlashConfig]:
        s = cfg.block
        config = DFlashConfig(
            transformer_layer_config=qwen3_layers_for(model, s.num_layers),
            draft_vocab_size=draft_size(s.draft_vocab, model), block_size=s.block_size + 1,
            mask_token_id=mask_token(s.mask_token_id, tokenizer), verifier=cfg.model.name,
            verifier_architectures=list(model.config.architectures or []), aux_hidden_state_layer_ids=s.feature_layers)
        return new_draft(DFlashHead, config, model, "block.feature_layers (method dflash)", train_rows, tokenizer)

    def stored(self, state: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """lm_head only with a draft vocabulary (without one it is the target's, as speculators saves it)."""
        if "d2t" not in state:
            state.pop("lm_head.weight", None)
        return state


def mask_token(configured: int | None, tokenizer) -> int:
    """The mask slots' token: ``block.mask_token_id``, else the tokenizer's mask, unknown or padding token (one that
    chat text does not use: its embedding is a fixed input the draft learns to read as "unknown")."""
    if configured is not None:
        return configured
    for name in ("mask_token_id", "unk_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return int(getattr(tokenizer, name))
    raise ValueError("block.mask_token_id (method dflash): the tokenizer has no mask, unknown or padding token to "
                     "fill the mask slots with; set block.mask_token_id to a token id that chat text does not use")
