"""The frozen base model a recipe trains heads for, and the two things the trainer asks of it.

``load_base`` returns (model, tokenizer): a named / local / Hub / GGUF model through ``selfspec.core.models.load_model``, or
a randomly initialised model built from a config (``model.config`` in the recipe, or the name "tiny-random-llama") with
a byte-level ChatML tokenizer built in code (256 bytes + 3 specials; no files, no downloads). The model comes back
frozen: eval mode, ``requires_grad_(False)``.

``final_hidden`` runs the decoder stack only (embeddings, blocks, final norm) and skips the LM head: the heads read
the final hidden state, and for a 49k vocabulary the LM head is a fifth of the forward. ``lm_logits`` applies the LM
head (and a final logit soft-cap where the architecture has one) to such hidden states, for the KL loss.

Shapes: B batch, T time, D hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast,
)

from heads.base import base_sizes
from heads.training.config import ModelConfig
from selfspec.core import hf
from selfspec.core.models import load_model, parse_dtype

TINY_NAME = "tiny-random-llama"
TINY_LLAMA = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with no merges (every byte is a token) and a ChatML chat template; 259 tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHATML
    return fast


def random_model(config: dict, tokenizer: PreTrainedTokenizerBase, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """A randomly initialised causal LM from a transformers config dict (vocab size defaults to the tokenizer's)."""
    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"model.config: expected a transformers config dict with a 'model_type' key, "
                         f"found keys {sorted(config)}")
    config.setdefault("vocab_size", len(tokenizer))
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        config.setdefault(name, getattr(tokenizer, name))
    if config["vocab_size"] < len(tokenizer):
        raise ValueError(f"model.config.vocab_size: expected at least the tokenizer's {len(tokenizer)} tokens, "
                         f"found {config['vocab_size']}")
    hf_config = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


class UnsupportedModel(ValueError):
    """The recipe's target is a model selfspec cannot verify drafts on (``selfspec.core.hf.unverifiable``)."""


def load_base(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The recipe's target (frozen, eval mode, on CPU) and its tokenizer."""
    if cfg.config is not None or cfg.name == TINY_NAME:
        tokenizer = byte_tokenizer()
        config = cfg.config if cfg.config is not None else TINY_LLAMA
        model = random_model(config, tokenizer, cfg.seed, parse_dtype(cfg.dtype))
    else:
        model, tokenizer = load_model(cfg.name, dtype=cfg.dtype, revision=cfg.revision,
                                      attn_implementation=cfg.attn_implementation)
    reason = hf.unverifiable(model)
    if reason is not None:  # refused before hours of training, not after
        what = (f"model.name={cfg.name!r}" if cfg.config is None
                else f"model.config (model_type={cfg.config.get('model_type')!r})")
        raise UnsupportedModel(f"{what}: drafts for this model could never be verified: {reason}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.requires_grad_(False)
    return model.eval(), tokenizer


def final_hidden(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """input_ids, attention_mask [B, T] -> [B, T, D]: the final hidden state (after the final norm), no LM head."""
    out = hf.decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
    return out.last_hidden_state


def layer_and_final_hidden(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [B, T] -> (layer ``layer``'s input [B, T, D], the final hidden state [B, T, D]),
    from one forward: what an exit head reads, and what the target's own logits come from."""
    with hf.captured_output(hf.decoder_layers(model)[layer - 1]) as outputs:
        final = final_hidden(model, input_ids, attention_mask)
    return outputs[-1], final


def final_and_layer_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           layers: list[int]) -> torch.Tensor:
    """input_ids, attention_mask [B, T] -> [B, T, (1 + L) D]: the final hidden state, then the hidden states at
    ``layers`` (transformers' ``hidden_states`` indices: 0 the embeddings, i decoder layer i's output), from one
    forward: what an EAGLE-3 head reads (its loss reads the final one)."""
    out = hf.decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              output_hidden_states=True, return_dict=True)
    states = out.hidden_states
    return torch.cat([states[-1]] + [states[i] for i in layers], dim=-1)


def stored_feature_layers(model: PreTrainedModel, layers: list[int]) -> list[int]:
    """The feature layers whose states must be stored beside the final hidden state: ``layers`` without index L (the
    number of decoder layers: transformers' last ``hidden_states`` entry is the final hidden state itself)."""
    final = model.config.get_text_config().num_hidden_layers
    return [i for i in layers if i != final]


def expand_feature_states(states: torch.Tensor, model: PreTrainedModel, layers: list[int]) -> torch.Tensor:
    """states [..., (1 + S) D]: the final hidden state, then the states of ``stored_feature_layers(model, layers)`` ->
    [..., (1 + L) D]: the final hidden state, then every one of ``layers``' states (the final one where L is listed)."""
    stored = stored_feature_layers(model, layers)
    if stored == list(layers):
        return states
    # final, then one per stored layer; the widths agree (EAGLE-3 heads take no other feature layers where the LM head's
    # input is narrower than the layers, heads.decoder.config.check_feature_layers)
    blocks = states.split(base_sizes(model)[0], dim=-1)
    by_layer = {layer: blocks[1 + j] for j, layer in enumerate(stored)}
    return torch.cat([blocks[0]] + [by_layer.get(layer, blocks[0]) for layer in layers], dim=-1)


def lm_logits(model: PreTrainedModel, hidden: torch.Tensor, vocab=None) -> torch.Tensor:
    """hidden [B, T, D] -> the target's logits [B, T, V], as its own forward computes them from that hidden state;
    with vocab (a ``selfspec.core.draft_vocab.DraftVocab``) only its columns, [B, T, V'], at V'/V of the cost."""
    lm_head = model.get_output_embeddings()
    if vocab is None:
        logits = lm_head(hidden.to(lm_head.weight.dtype))
    else:
        logits = vocab.linear(lm_head, hidden)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
