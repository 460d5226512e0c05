"""What the config.json of every draft in the format of vLLM's ``speculators`` library (0.9) shares, whatever its
speculators_model_type (EAGLE-3, heads/eagle/speculators_config.py ``Eagle3Config``; DFlash,
heads/block/dflash_config.py ``DFlashConfig``): ``SpeculatorsConfig``, the fields, checks and keys they have in common
(transformer_layer_config, draft_vocab_size, the verifier, the auxiliary layers, speculators_config), telling such a
config.json from selfspec's own (``is_speculators``), resolving the auxiliary layers on a target (``aux_layers_on``)
and sizing a new draft's layers like the target (``layers_for``).

The module side of these drafts (their d2t / t2d draft vocabulary, reading their checkpoints) is
heads/decoder/speculators.py.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from transformers import PreTrainedModel

from heads.base import base_sizes

SPECULATORS_VERSION = "0.9.0"
"""the speculators release whose format this file writes (and whose loader the tests run)."""


def is_speculators(config: dict[str, Any]) -> bool:
    """A config.json of vLLM's speculators library (it names a speculators_model_type, no selfspec draft_type)."""
    return isinstance(config.get("speculators_model_type"), str) and "draft_type" not in config


def default_aux_layers(num_layers: int) -> list[int]:
    """speculators' default auxiliary layers for a target of ``num_layers`` layers (``resolve_target_layer_ids``)."""
    return [2, num_layers // 2, num_layers - 3]


class SpeculatorsConfig:
    """What the configs of speculators' drafts share (heads/eagle/speculators_config.py ``Eagle3Config``,
    heads/block/dflash_config.py ``DFlashConfig``): the draft layers' transformers config, the draft vocabulary, the
    verifier, the auxiliary layers (under each format's own key, ``AUX_FIELD``), read and written the same way."""

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
