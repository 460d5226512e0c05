"""What the configs of heads built around a light decoder of the target's own architecture share (the EAGLE head's
``EagleConfig``, heads/eagle/config.py; the block drafter's ``BlockConfig``, heads/block/config.py):
``DecoderHeadConfig``, the decoder's transformers config (``decoder_config``) and the feature layers' checks.

The decoder is the base architecture's own, cut to ``num_layers`` layers and no vocabulary (``decoder_config``);
feature layers follow transformers' ``hidden_states`` indices (0 the embeddings, i decoder layer i's output).
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

from transformers import PreTrainedModel

from heads.base import BaseFields, base_sizes
from selfspec.core import typed


class DecoderHeadConfig(BaseFields):
    """What the configs of heads built around a decoder of the base's own architecture share (EAGLE heads,
    heads/eagle/config.py; block drafters, heads/block/config.py): building one for a base model, and checking the
    fields they have in common."""

    @classmethod
    def for_model(cls, model: PreTrainedModel, base_model: str | None = None, num_layers: int = 1,
                  **kwargs: Any) -> Any:
        vocab = base_sizes(model)[1]
        kwargs["draft_vocab_size"] = min(kwargs.get("draft_vocab_size", 8192) or vocab, vocab)
        check_feature_layers(kwargs.get("feature_layers"), model)
        return super().for_model(model, base_model, decoder_config=decoder_config(model, num_layers),
                                 num_layers=num_layers, **kwargs)

    def check_decoder_head(self, draft_type: str, positive: tuple[str, ...]) -> None:
        """Strict types, the draft type, ``positive`` fields >= 1 (and the base's sizes), the draft vocabulary within
        the base's, the feature layers, a decoder config transformers can rebuild, a recipe JSON can hold."""
        name, c = type(self).__name__, typing.cast(Any, self)
        typed.check(self)
        if c.draft_type != draft_type:
            raise ValueError(f"{name}.draft_type: expected {draft_type!r}, found {c.draft_type!r}")
        for field in ("hidden_size", "vocab_size") + positive:
            if getattr(c, field) < 1:
                raise ValueError(f"{name}.{field}: expected >= 1, found {getattr(c, field)}")
        if not 1 <= c.draft_vocab_size <= c.vocab_size:
            raise ValueError(f"{name}.draft_vocab_size: expected 1..{c.vocab_size} (the base's vocabulary), found "
                             f"{c.draft_vocab_size}")
        check_feature_layer_list(c.feature_layers, f"{name}.feature_layers")
        if "model_type" not in c.decoder_config:
            raise ValueError(f"{name}.decoder_config: expected a transformers config dict with 'model_type', found "
                             f"keys {sorted(c.decoder_config)[:8]}")
        json.dumps(c.recipe)  # stored in config.json


def decoder_config(model: PreTrainedModel, num_layers: int) -> dict:
    """The base's text config cut to ``num_layers`` layers and a one-entry vocabulary (the head's decoder reads
    embeddings it is given; it has no vocabulary of its own), as a dict. Its width is the LM head's (the features it
    predicts), where the base's layers are wider (OPT-350m: layers 1,024 wide, ``word_embed_proj_dim`` 512)."""
    cfg = copy.deepcopy(model.config.get_text_config())
    cfg.num_hidden_layers = num_layers
    width = base_sizes(model)[0]
    if width != cfg.hidden_size:
        if getattr(cfg, "word_embed_proj_dim", None) != width:
            raise ValueError(f"an EAGLE head on {type(model).__name__}: its LM head reads states {width} wide, its "
                             f"layers are {cfg.hidden_size} wide, and its config has no word_embed_proj_dim (OPT's) "
                             "saying so: train Medusa or Hydra heads, or an exit head, for this model")
        cfg.hidden_size = width  # one width for the head: no project_in / project_out of its own
    for name, value in (("vocab_size", 1), ("pad_token_id", None), ("bos_token_id", None), ("eos_token_id", None),
                        ("tie_word_embeddings", False)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    # the head attends fully (its cache holds every committed pair; a window would drop some mid-draft)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention" if t in ("sliding_attention", "chunked_attention") else t
                           for t in cfg.layer_types[:num_layers]]
    elif getattr(cfg, "sliding_window", None) is not None:  # Mistral: every layer slides
        cfg.sliding_window = None
    if getattr(cfg, "attention_layers", None) is not None:  # GPT-Neo: each layer's attention kind, from attention_types
        cfg.attention_layers = list(cfg.attention_layers[:num_layers])
        cfg.attention_types = [[cfg.attention_layers, 1]]
    out = cfg.to_dict()
    for name in ("_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version"):
        out.pop(name, None)
    return json.loads(json.dumps(out))  # as config.json will hold it (string keys, lists)


def check_feature_layer_list(layers: list[int] | None, where: str) -> None:
    """An EAGLE-3 head's feature layers: null, or distinct hidden-state indices >= 0 (the model's own range is checked
    where the model is known, check_feature_layers)."""
    if layers is not None and (not layers or min(layers) < 0 or len(set(layers)) != len(layers)):
        raise ValueError(f"{where}: expected null or distinct hidden-state indices >= 0, found {layers}")


def check_feature_layers(layers: list[int] | None, model: PreTrainedModel) -> None:
    """Refuse feature layers the model does not have (its hidden states are indexed 0..num_hidden_layers)."""
    count = int(model.config.get_text_config().num_hidden_layers)
    if layers and max(layers) > count:
        raise ValueError(f"EAGLE head feature_layers {layers}: expected hidden-state indices 0..{count} (this base has "
                         f"{count} decoder layers), found {max(layers)}")
    layer_width, width = base_sizes(model, at="layers")[0], base_sizes(model)[0]
    if layers and layer_width != width and any(i != count for i in layers):
        raise ValueError(f"EAGLE head feature_layers {layers}: this base's layers are {layer_width} wide but its LM "
                         f"head reads {width} (it projects its final state), so only its final state ({count}) can be "
                         "a feature; set eagle.feature_layers=null")
