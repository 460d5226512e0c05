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

from heads.eagle.speculators_config import SPECULATORS_VERSION, aux_layers_on, layers_for
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
class DFlashConfig:
    """A DFlash draft in speculators' format (see the module docstring); ``from_json`` / ``to_dict`` read and write its
    config.json. Strict: see ``__post_init__``."""

    transformer_layer_config: dict
    draft_vocab_size: int
    block_size: int
    mask_token_id: int
    verifier: str | None
    verifier_architectures: list[str] = field(default_factory=list)
    aux_hidden_state_layer_ids: list[int] | None = None

    def __post_init__(self) -> None:
        typed.check(self)
        layer = self.transformer_layer_config
        for name in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(layer.get(name), int) or layer[name] < 1:
                raise ValueError(f"transformer_layer_config.{name}: expected an integer >= 1, found {layer.get(name)!r}")
        if layer.get("use_sliding_window") or any(t != "full_attention" for t in layer.get("layer_types") or []):
            raise ValueError("transformer_layer_config: draft layers with sliding-window attention are not supported "
                             "(selfspec's drafter attends over every committed position)")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size: expected 1..{self.vocab_size} (the target's vocabulary), found "
                             f"{self.draft_vocab_size}")
        if self.block_size < 2:
            raise ValueError(f"block_size: expected >= 2 (the anchor and at least one mask slot), found "
                             f"{self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id: expected a token id in [0, {self.vocab_size}), found {self.mask_token_id}")
        ids = self.aux_hidden_state_layer_ids
        if ids is not None and (not ids or min(ids) < 0 or len(set(ids)) != len(ids)):
            raise ValueError(f"aux_hidden_state_layer_ids: expected null or distinct layer ids >= 0, found {ids}")

    # ----------------------------------------------------------------------------- what selfspec's drafter reads
    @property
    def hidden_size(self) -> int:
        return self.transformer_layer_config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.transformer_layer_config["vocab_size"]

    @property
    def num_layers(self) -> int:
        return self.transformer_layer_config["num_hidden_layers"]

    @property
    def drafted(self) -> int:
        """K: tokens one forward drafts (the mask slots)."""
        return self.block_size - 1

    @property
    def base_model(self) -> str:
        return self.verifier or "its verifier (config.json names none)"

    @property
    def feature_layers(self) -> list[int] | None:
        return self.aux_hidden_state_layer_ids

    @property
    def num_features(self) -> int:
        ids = self.aux_hidden_state_layer_ids
        return len(ids) if ids else 3

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
        return replace(self, aux_hidden_state_layer_ids=aux_layers_on(self.aux_hidden_state_layer_ids, model,
                                                                       "aux_hidden_state_layer_ids"))

    # ---------------------------------------------------------------------------------------------- config.json
    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DFlashConfig":
        """config.json as speculators writes it -> DFlashConfig; what it cannot express raises, saying which field."""
        if data.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
            raise ValueError(f"speculators_model_type {data.get('speculators_model_type')!r}: expected "
                             f"{SPECULATORS_MODEL_TYPE!r}")
        layer = data.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"transformer_layer_config: expected an object, found {type(layer).__name__}")
        spec = data.get("speculators_config")
        try:
            verifier = spec["verifier"]
        except (KeyError, TypeError):
            raise ValueError(f"speculators_config: expected {{'verifier': {{'name_or_path': ...}}, ...}}, found "
                             f"{spec!r:.200}") from None
        if data.get("sample_from_anchor"):
            raise ValueError("sample_from_anchor true: the anchor slot drafts too, which selfspec's block drafter "
                             "does not run (and vLLM may not); expected false")
        if data.get("mask_token_id") is None:
            raise ValueError("mask_token_id: expected the token id of the mask slots, found null")
        width = data.get("target_hidden_size")
        if width is not None and width != layer.get("hidden_size"):
            raise ValueError(f"target_hidden_size {width}: the draft is {layer.get('hidden_size')} wide, and fc reads "
                             "aux states of the draft's width")
        return cls(transformer_layer_config=layer, draft_vocab_size=data.get("draft_vocab_size", 32000),
                   block_size=data.get("block_size", 8), mask_token_id=data["mask_token_id"],
                   verifier=verifier.get("name_or_path"), verifier_architectures=verifier.get("architectures") or [],
                   aux_hidden_state_layer_ids=data.get("aux_hidden_state_layer_ids"))

    def to_dict(self) -> dict[str, Any]:
        """config.json, keyed and nested as speculators 0.9 writes it."""
        return {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": SPECULATORS_MODEL_TYPE,
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.transformer_layer_config,
            "draft_vocab_size": self.draft_vocab_size,
            "block_size": self.block_size,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": self.aux_hidden_state_layer_ids,
            "mask_token_id": self.mask_token_id,
            "sliding_window_non_causal": False,
            "sample_from_anchor": False,
            "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": SPECULATORS_MODEL_TYPE,
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.drafted,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": self.verifier, "architectures": self.verifier_architectures},
            },
        }


def qwen3_layers_for(model: PreTrainedModel, num_layers: int = 1) -> dict:
    """transformer_layer_config for a new DFlash draft on ``model``: Qwen3 layers (speculators' DFlash layers) sized
    like the target."""
    text = model.config.get_text_config()
    return layers_for(model, num_layers, Qwen3Config, "DFlash", attention_bias=bool(getattr(text, "attention_bias", False)))


def is_dflash(config: dict[str, Any]) -> bool:
    """A config.json of a speculators DFlash draft."""
    return config.get("speculators_model_type") == SPECULATORS_MODEL_TYPE and "draft_type" not in config
