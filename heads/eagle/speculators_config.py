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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from transformers import AutoConfig, LlamaConfig, PretrainedConfig, PreTrainedModel

from heads.base import base_sizes
from selfspec.core import typed

SPECULATORS_MODEL_TYPE = "eagle3"
SPECULATORS_VERSION = "0.9.0"
"""the speculators release whose format this file writes (and whose loader the tests run)."""
LAYER_TYPES = ("llama", "qwen3")
"""the decoder layer kinds speculators 0.9 builds an EAGLE-3 draft of (``speculators.models.eagle3.model_classes``)."""
DRAFTING = {"topk": 8, "budget": 32}
"""selfspec's drafting defaults for these drafts (speculators' config names only the chain length, speculative_tokens):
nodes expanded per depth, draft nodes kept per step."""


def is_speculators(config: dict[str, Any]) -> bool:
    """A config.json of vLLM's speculators library (it names a speculators_model_type, no selfspec draft_type)."""
    return isinstance(config.get("speculators_model_type"), str) and "draft_type" not in config


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default auxiliary layers for a target of ``num_layers`` layers (``resolve_target_layer_ids``)."""
    return [2, num_layers // 2, num_layers - 3]


class SpeculatorsDraft:
    """What the configs of speculators' drafts share (``Eagle3Config``, ``heads.block.dflash_config.DFlashConfig``):
    the draft layers' transformers config, the draft vocabulary, the verifier, the auxiliary layers (under each
    format's own key, ``AUX_FIELD``), read and written the same way."""

    MODEL_TYPE: ClassVar[str]
    """speculators_model_type."""
    AUX_FIELD: ClassVar[str]
    """config.json's key of the auxiliary layer ids."""
    transformer_layer_config: dict
    draft_vocab_size: int
    verifier: str | None

    def check_common(self) -> None:
        """The checks every format makes: the layers' sizes, full attention, the draft vocabulary, the aux ids."""
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
        ids = self.feature_layers
        if ids is not None and (not ids or min(ids) < 0 or len(set(ids)) != len(ids)):
            raise ValueError(f"{self.AUX_FIELD}: expected null or distinct layer ids >= 0, found {ids}")

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
    def base_model(self) -> str:
        return self.verifier or "its verifier (config.json names none)"

    @property
    def feature_layers(self) -> list[int] | None:
        return getattr(self, self.AUX_FIELD)

    @property
    def num_features(self) -> int:
        """How many target states fc fuses (speculators: 3 when the ids are left to its default)."""
        ids = self.feature_layers
        return len(ids) if ids else 3

    def aux_on(self, model: PreTrainedModel) -> dict[str, list[int]]:
        """The auxiliary layers on a target (``aux_layers_on``), keyed for ``dataclasses.replace``."""
        return {self.AUX_FIELD: aux_layers_on(self.feature_layers, model, self.AUX_FIELD)}

    # ---------------------------------------------------------------------------------------------- config.json
    @classmethod
    def read_common(cls, data: dict[str, Any], proposal: bool = False) -> dict[str, Any]:
        """What every format's config.json holds -> the shared fields (and, with ``proposal``, the proposal's
        speculative_tokens); a wrong model type, layer config, verifier or target width raises, naming the field."""
        if data.get("speculators_model_type") != cls.MODEL_TYPE:
            raise ValueError(f"speculators_model_type {data.get('speculators_model_type')!r}: expected "
                             f"{cls.MODEL_TYPE!r} ({cls.__name__} reads speculators' {cls.MODEL_TYPE} drafts only; "
                             "--draft picks the loader from the checkpoint's model type)")
        layer = data.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"transformer_layer_config: expected an object, found {type(layer).__name__}")
        spec = data.get("speculators_config")
        try:
            verifier = spec["verifier"]
            tokens = {"speculative_tokens": spec["proposal_methods"][0]["speculative_tokens"]} if proposal else {}
        except (KeyError, IndexError, TypeError):
            wanted = ", 'proposal_methods': [{'speculative_tokens': K, ...}]" if proposal else ""
            raise ValueError(f"speculators_config: expected {{'verifier': {{'name_or_path': ...}}{wanted}, ...}}, found "
                             f"{spec!r:.200}") from None
        width = data.get("target_hidden_size")
        if width is not None and width != layer.get("hidden_size"):
            raise ValueError(f"target_hidden_size {width}: the draft is {layer.get('hidden_size')} wide, and fc reads "
                             "aux states of the draft's width")
        return dict(transformer_layer_config=layer, draft_vocab_size=data.get("draft_vocab_size", 32000),
                    verifier=verifier.get("name_or_path"), verifier_architectures=verifier.get("architectures") or [],
                    **{cls.AUX_FIELD: data.get(cls.AUX_FIELD)}, **tokens)

    def write_common(self, architecture: str, fields: dict[str, Any], speculative_tokens: int) -> dict[str, Any]:
        """config.json, keyed and nested as speculators 0.9 writes it: the shared keys around a format's ``fields``."""
        return {
            "architectures": [architecture],
            "speculators_model_type": self.MODEL_TYPE,
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.transformer_layer_config,
            "draft_vocab_size": self.draft_vocab_size,
            self.AUX_FIELD: self.feature_layers,
            **fields,
            "target_hidden_size": None,
            "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": self.MODEL_TYPE,
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": self.verifier, "architectures": self.verifier_architectures},
            },
        }


@dataclass
class Eagle3Config(SpeculatorsDraft):
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


def aux_layers_on(ids: list[int] | None, model: PreTrainedModel, field: str) -> list[int]:
    """A speculators draft's auxiliary layers on a target: speculators' default where null, in increasing order (vLLM
    gathers the target's aux states in layer order, whatever order the ids are listed in), distinct, and among the
    layers whose states selfspec's verifier gives a drafter."""
    count = int(model.config.get_text_config().num_hidden_layers)
    ids = sorted(ids or default_aux_layers(count))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{field} {ids}: expected distinct ids (speculators' default for a target of {count} layers "
                         "repeats one: name them)")
    if min(ids) < 0 or max(ids) > count:
        raise ValueError(f"{field} {ids}: expected ids 0..{count - 1} for a target of {count} layers")
    if count in ids:
        raise ValueError(f"{field} {ids}: id {count} is the last layer's output before the final norm, which "
                         "selfspec's verifier does not give a drafter (its last hidden state is after the final norm)")
    return ids


def llama_layers_for(model: PreTrainedModel, num_layers: int = 1) -> dict:
    """transformer_layer_config for a new EAGLE-3 draft on ``model``: Llama layers (what vLLM runs every EAGLE-3 draft
    as) of the target's width, heads, MLP size, norm epsilon and rotary settings; attention biases where the target
    has them (Qwen2's q/k/v: Llama's attention_bias gives o_proj one too)."""
    text = model.config.get_text_config()
    return layers_for(model, num_layers, LlamaConfig, "EAGLE-3",
                      attention_bias=bool(getattr(text, "attention_bias", False) or text.model_type == "qwen2"),
                      mlp_bias=bool(getattr(text, "mlp_bias", False)))


def layers_for(model: PreTrainedModel, num_layers: int, config_class: type, what: str, **extra: Any) -> dict:
    """transformer_layer_config for a new speculators draft (``what``) on ``model``: ``num_layers`` layers of
    ``config_class`` with the target's width, heads, MLP size, activation, norm epsilon and rotary settings (and
    ``extra``), as a config.json dict."""
    text = model.config.get_text_config()
    missing = [k for k in ("intermediate_size", "rms_norm_eps", "num_attention_heads") if getattr(text, k, None) is None]
    if missing:
        raise ValueError(f"a speculators {what} draft on {text.model_type}: its layers are sized from the target's "
                         f"config, which has no {', '.join(missing)}")
    width, vocab = base_sizes(model)
    heads = int(text.num_attention_heads)
    config = config_class(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(text.intermediate_size),
        num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or width // heads), hidden_act=getattr(text, "hidden_act", "silu"),
        rms_norm_eps=float(text.rms_norm_eps), max_position_embeddings=int(text.max_position_embeddings),
        rope_parameters=copy.deepcopy(getattr(text, "rope_parameters", None)), tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )
    out = config.to_dict()
    for name in ("_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "output_attentions",
                 "output_hidden_states", "return_dict", "chunk_size_feed_forward", "problem_type", "id2label",
                 "label2id", "tokenizer_class", "is_encoder_decoder"):
        out.pop(name, None)
    return out
