"""Every contact with transformers internals, in one place (pinned by tests/test_hf_contact.py).

- ``forward``: one call of a decoder-only model with an explicit 4D additive mask, position ids and the cache.
- ``cache_keep``: the one cache operation a tree needs after acceptance: keep the given new entries, drop the rest.
- ``decoder_layers``: the model's list of transformer blocks (for self-speculation drafters).

Shapes: B batch (always 1 here), H kv heads, S cached length, N new tokens, V vocabulary, D hidden size.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> Cache:
    return DynamicCache(config=model.config)


def cache_length(cache: Cache) -> int:
    return cache.get_seq_length()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [N, S + N] (True = may attend) -> float [1, 1, N, S + N]: 0 where allowed, dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Cache,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [N], position_ids [N], mask [1, 1, N, S + N] or None (plain causal) -> logits [n, V], hidden [n, D].

    n = N, or the last ``logits_to_keep`` positions when that is > 0. ``hidden`` is the final hidden state (after the
    model's final norm), the input of the LM head, which is what draft heads read.
    """
    out = model(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=logits_to_keep,
        return_dict=True,
    )
    hidden = out.hidden_states[-1][0]  # [N, D]
    if logits_to_keep > 0:
        hidden = hidden[-logits_to_keep:]
    return out.logits[0], hidden


def cache_keep(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep, of the entries from position ``start`` on, only those at offsets ``keep`` (in order); drop the rest.

    keep: long [K] offsets relative to ``start``. After the call the cache holds start + K entries.
    """
    total = cache.get_seq_length()
    k = int(keep.numel())
    if k and not torch.equal(keep, torch.arange(k)):
        idx = keep + start
        for layer in cache.layers:
            if getattr(layer, "is_sliding", False) and layer.keys.shape[-2] != total:
                raise RuntimeError("cache_keep: a sliding-window layer has dropped entries; lengths beyond the window are not supported")
            layer.keys[:, :, start : start + k] = layer.keys[:, :, idx]  # [B, H, K, hd]
            layer.values[:, :, start : start + k] = layer.values[:, :, idx]
    if total > start + k:
        cache.crop(-(total - start - k))


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a decoder-only model (Llama-like ``model.model.layers`` or GPT-2's ``transformer.h``)."""
    base = model.get_decoder()
    for name in ("layers", "h"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}: expected `.layers` or `.h` on its decoder")


def sliding_window(model: PreTrainedModel) -> int | None:
    """The smallest sliding attention window of the model's layers, or None when every layer attends fully."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(window)
