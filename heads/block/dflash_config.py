"""The config.json of a DFlash draft in the format of vLLM's ``speculators`` library (0.9): ``DFlashConfig``, what
selfspec reads from such a checkpoint and writes back, checked strictly where it decides what the draft computes.

What speculators 0.9 writes (``DFlashSpeculatorConfig.to_dict``), and what each field means here:

    speculators_model_type       "dflash"  (the registry's key: selfspec.registry.SPECULATORS_KINDS -> "block")
    transformer_layer_config     the draft layers' transformers config (speculators builds Qwen3-style layers, with
                                 per-head q / k norms, whatever its model_type; selfspec writes "qwen3"),
                                 num_hidden_layers = the draft's layers, vocab_size = the TARGET's V
    draft_vocab_size             V': the rows of lm_head; d2t / t2d map them to target ids
    block_size                   the block's slots: the anchor (the root, the target's newest token) and
                                 block_size - 1 mask slots, each drafting one token (selfspec's K = block_size - 1)
    aux_hidden_state_layer_ids   the target layers fused by fc; transformers' hidden_states indices (as EAGLE-3's)
    mask_token_id                the token whose (the target's) embedding every mask slot reads
    sample_from_anchor           false: the anchor slot drafts nothing (true is refused: vLLM may not run it)
    sliding_window_non_causal    refused with sliding-window layers (selfspec's drafter attends over every position)
    target_hidden_size           null or the draft's hidden size (fc reads aux states of the draft's width)
    speculators_config           algorithm "dflash", proposal_methods [{"proposal_type": "greedy",
                                 "speculative_tokens": block_size - 1, ...}], and verifier {"name_or_path": the target}

Other keys (transformers' PretrainedConfig bookkeeping) change nothing and are not kept.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import AutoConfig, PreTrainedModel, Qwen3Config

from heads.decoder.speculators_config import SpeculatorsConfig, layers_for
from selfspec.core import typed

SPECULATORS_MODEL_TYPE = "dflash"
DRAFTING = {"budget": 16}
"""selfspec's drafting default for these drafts (speculators' config names only the block): draft nodes kept per
step, the best by product of per-position probabilities, the whole block deep."""
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias",
                "attention_dropout")
"""what speculators' DFlash layers read of transformer_layer_config (Qwen3DFlashDecoderLayer: the attention, Qwen3MLP,
Qwen3RMSNorm, the rotary embedding)."""


@dataclass
class DFlashConfig(SpeculatorsConfig):
    """A DFlash draft in speculators' format (see the module docstring); ``from_json`` / ``to_dict`` read and write its
    config.json. Strict: see ``__post_init__``."""

    transformer_layer_config: dict
    draft_vocab_size: int
    block_size: int
    mask_token_id: int
    verifier: str | None
    verifier_architectures: list[str] = field(default_factory=list)
    aux_hidden_state_layer_ids: list[int] | None = None

    MODEL_TYPE = SPECULATORS_MODEL_TYPE
    AUX_FIELD = "aux_hidden_state_layer_ids"

    def __post_init__(self) -> None:
        typed.check(self)
        self.check_common()
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2 (the anchor and at least one mask slot), found "
                             f"{self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: expected a token id in [0, {self.vocab_size}), found {self.mask_token_id}")

    @property
    def drafted(self) -> int:
        """K: tokens one forward drafts (the mask slots)."""
        return self.block_size - 1

    @property
    def budget(self) -> int:
        return DRAFTING["budget"]

    @property
    def depth(self) -> None:
        return None  # the whole block

    def layer_config(self) -> Qwen3Config:
        """The Qwen3 config of speculators' DFlash layers (Qwen3-style whatever transformer_layer_config's kind):
        its sizes, norm epsilon, activation and rotary settings, no vocabulary."""
        data = copy.deepcopy(self.transformer_layer_config)
        source = AutoConfig.for_model(data.pop("model_type", "qwen3"), **data)  # its kind's defaults, as speculators
        kept = {k: getattr(source, k) for k in LAYER_FIELDS if getattr(source, k, None) is not None}
        return Qwen3Config(vocab_size=1, num_hidden_layers=self.num_layers, tie_word_embeddings=False,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None, **kept)

    def on_model(self, model: PreTrainedModel) -> "DFlashConfig":
        """This config on a target: its auxiliary layers resolved (``aux_layers_on``)."""
        return replace(self, **self.aux_on(model))

    # ---------------------------------------------------------------------------------------------- config.json
    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DFlashConfig":
        """config.json as speculators writes it -> DFlashConfig; what it cannot express raises, saying which field."""
        common = cls.read_common(data)
        if data.get("sample_from_anchor"):
            raise ValueError("sample_from_anchor true: the anchor slot drafts too, which selfspec's block drafter "
                             "does not run (and vLLM may not); expected false")
        if data.get("mask_token_id") is None:
            raise ValueError("mask_token_id: expected the token id of the mask slots, found null")
        return cls(**common, block_size=data.get("block_size", 8), mask_token_id=data["mask_token_id"])

    def to_dict(self) -> dict[str, Any]:
        """config.json, keyed and nested as speculators 0.9 writes it."""
        return self.write_common("DFlashDraftModel", {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                                                      "sliding_window_non_causal": False, "sample_from_anchor": False},
                                 self.drafted)


def qwen3_layers_for(model: PreTrainedModel, num_layers: int = 1) -> dict:
    """transformer_layer_config for a new DFlash draft on ``model``: Qwen3 layers (speculators' DFlash layers) sized
    like the target."""
    text = model.config.get_text_config()
    return layers_for(model, num_layers, Qwen3Config, "DFlash", attention_bias=bool(getattr(text, "attention_bias", False)))


def is_dflash(config: dict[str, Any]) -> bool:
    """A config.json of a speculators DFlash draft."""
    return config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE and "draft_type" not in config
