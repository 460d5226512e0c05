"""The config.json of an EAGLE-3 draft in the format of vLLM's ``speculators`` library (0.9): ``Eagle3Config``, what
selfspec reads from such a checkpoint and writes back, checked strictly where it decides what the draft computes.

What speculators 0.9 writes (``Eagle3SpeculatorConfig.to_dict``), and what each field means here:

    speculators_model_type            "eagle3"  (the registry's key: selfspec.registry.SPECULATORS_KINDS -> "eagle")
    transformer_layer_config          the draft decoder's transformers config: model_type "llama" or "qwen3" (the
                                      layer kinds speculators 0.9 builds; vLLM builds Llama layers for every EAGLE-3
                                      draft), num_hidden_layers = the draft's layers, vocab_size = the TARGET's V
    draft_vocab_size                  V': the rows of the draft's own lm_head; d2t / t2d map them to target ids
    eagle_aux_hidden_state_layer_ids  the target layers fused by fc; transformers' hidden_states indices (0 the
                                      embeddings, i the output of decoder layer i); null: [2, L // 2, L - 3]
    norm_before_residual              the first layer's residual is hidden_norm(features) instead of the features
    norm_output                       the final norm's output is fed to the next step (else the pre-norm state)
    norm_before_fc / fc_norm          one RMSNorm over the concatenated aux states / one per aux state, before fc
    target_hidden_size                null or the draft's hidden size (speculators' fc reads the draft's width)
    speculators_config                algorithm "eagle3", proposal_methods [{"proposal_type": "greedy",
                                      "speculative_tokens": K, ...}], default_proposal_method "greedy", and
                                      verifier {"name_or_path": the target, "architectures": [...]}

Other keys of config.json (transformers' PretrainedConfig bookkeeping: dtype, auto_map, ...) change nothing and are
not kept. Refused: a speculators model type other than eagle3, layer kinds speculators does not build, draft layers
with sliding-window attention, a target_hidden_size other than the draft's width.

What every speculators format reads and writes alike (the shared keys, their checks, the auxiliary layers on a target)
is heads/decoder/speculators_config.py's ``SpeculatorsConfig``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import AutoConfig, LlamaConfig, PretrainedConfig, PreTrainedModel

from heads.decoder.speculators_config import SpeculatorsConfig, layers_for
from selfspec.core import typed

SPECULATORS_MODEL_TYPE = "eagle3"
LAYER_TYPES = ("llama", "qwen3")
"""the decoder layer kinds speculators 0.9 builds an EAGLE-3 draft of (``speculators.models.eagle3.model_classes``)."""
DRAFTING = {"topk": 8, "budget": 32}
"""selfspec's drafting defaults for these drafts (speculators' config names only the chain length, speculative_tokens):
nodes expanded per depth, draft nodes kept per step."""


@dataclass
class Eagle3Config(SpeculatorsConfig):
    """An EAGLE-3 draft in speculators' format (see the module docstring); ``from_json`` / ``to_dict`` read and write
    its config.json. Strict where it matters: see ``__post_init__``."""

    transformer_layer_config: dict
    draft_vocab_size: int
    verifier: str | None
    """speculators_config.verifier.name_or_path: the target (a Hub id, or a local path on the machine that wrote it)."""
    verifier_architectures: list[str] = field(default_factory=list)
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    speculative_tokens: int = 3
    norm_before_residual: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False

    MODEL_TYPE = SPECULATORS_MODEL_TYPE
    AUX_FIELD = "eagle_aux_hidden_state_layer_ids"

    def __post_init__(self) -> None:
        typed.check(self)
        kind = self.transformer_layer_config.get("model_type")
        if kind not in LAYER_TYPES:
            raise ValueError(f"transformer_layer_config.model_type: speculators 0.9 builds EAGLE-3 drafts of "
                             f"{' or '.join(LAYER_TYPES)} layers, found {kind!r}")
        self.check_common()
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive (as in speculators)")
        if self.speculative_tokens < 1:
            raise ValueError(f"speculative_tokens: expected >= 1, found {self.speculative_tokens}")

    @property
    def depth(self) -> int:
        return self.speculative_tokens

    @property
    def topk(self) -> int:
        return DRAFTING["topk"]

    @property
    def budget(self) -> int:
        return DRAFTING["budget"]

    def layer_config(self) -> PretrainedConfig:
        """transformer_layer_config as a transformers config of its model_type."""
        data = copy.deepcopy(self.transformer_layer_config)
        return AutoConfig.for_model(data.pop("model_type"), **data)

    def on_model(self, model: PreTrainedModel) -> "Eagle3Config":
        """This config on a target: its auxiliary layers resolved (``aux_layers_on``); fc fuses as many states as it
        was built for."""
        aux = self.aux_on(model)
        if len(aux[self.AUX_FIELD]) != self.num_features:
            raise ValueError(f"{self.AUX_FIELD} {aux[self.AUX_FIELD]}: fc fuses {self.num_features} states")
        return replace(self, **aux)

    # ---------------------------------------------------------------------------------------------- config.json
    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Eagle3Config":
        """config.json as speculators writes it -> Eagle3Config; what it cannot express raises, saying which field."""
        flags = {k: data.get(k, False) for k in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")}
        return cls(**cls.read_common(data, proposal=True), **flags)

    def to_dict(self) -> dict[str, Any]:
        """config.json, keyed and nested as speculators 0.9 writes it (every flag written: vLLM reads a missing
        norm_before_residual as true)."""
        flags = {k: getattr(self, k) for k in ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")}
        return self.write_common("Eagle3DraftModel", {**flags, "embed_requires_grad": False}, self.speculative_tokens)


def llama_layers_for(model: PreTrainedModel, num_layers: int = 1) -> dict:
    """transformer_layer_config for a new EAGLE-3 draft on ``model``: Llama layers (what vLLM runs every EAGLE-3 draft
    as) of the target's width, heads, MLP size, norm epsilon and rotary settings; attention biases where the target
    has them (Qwen2's q/k/v: Llama's attention_bias gives o_proj one too)."""
    text = model.config.get_text_config()
    return layers_for(model, num_layers, LlamaConfig, "EAGLE-3",
                      attention_bias=bool(getattr(text, "attention_bias", False) or text.model_type == "qwen2"),
                      mlp_bias=bool(getattr(text, "mlp_bias", False)))
