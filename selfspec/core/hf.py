"""Every contact with transformers internals, in one place (pinned by tests/test_hf_contact.py).

- ``forward``: one call of a decoder-only model with an explicit 4D additive mask, position ids and the cache; it
  returns the logits and the hidden state of every layer (``hidden_states``: embeddings, each layer's output, final).
- ``new_cache`` / ``WindowLayer`` / ``slide`` / ``layer_masks`` / ``window_limit``: sliding-window layers keep what a
  verification adds and drop, after each commit, what no later query sees; a tree's mask applies the window by
  position (per layer type), so trees are verified beyond the window; where that cannot be expressed, the window
  prompt + new tokens must stay inside.
- ``cache_keep``: the one cache operation a tree needs after acceptance: keep the given new entries, drop the rest.
- a batch's cache (``rows_cache``, ``join_rows``, ``select_rows``, ``keep_rows``) and ``forward_rows``: B sequences of
  different lengths in one cache of B rows, each row's accepted path moved to follow its own text.
- ``sdpa_or_eager``: build a model with sdpa attention, or eager where its architecture has none.
- ``grouped_attention``: on a CPU, grouped-query attention without transformers' per-head copy of the cache where a
  mask is in play (its own switch, set for a forward's duration).
- ``unverifiable``: why a tree cannot be verified losslessly on a model (ALiBi biases, recurrent layers), or None.
- ``decoder`` / ``decoder_layers``: the decoder stack under the LM head and its list of transformer blocks.
- self-speculation: ``replaced_layers`` (run the model with some layers swapped for ``Passthrough`` / ``Apply`` /
  ``Emit``), ``captured_output`` (a layer's output hidden state), ``forward_partial`` (a forward of such a model, with or
  without the LM head), and per-layer cache access (``layer_lengths``, ``cache_truncate``, ``layer_entries``,
  ``append_entries``).

Shapes: B batch (1, except in a batch's cache of rows: ``rows_cache`` and its neighbours, ``forward_rows``), H kv heads, S cached length, N new tokens, V vocabulary, D hidden size.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

RECURRENT_TYPES = ("rwkv", "xlstm")
"""Recurrent models that keep no transformers ``Cache`` layers at all (the others show LinearAttention cache layers)."""


def new_cache(model: PreTrainedModel) -> Cache:
    """The model's cache, its sliding-window layers as ``WindowLayer``: transformers' sliding layer drops its oldest
    entries as new ones arrive, so a tree verified near the window's edge would push out entries the accepted path
    still needs. A WindowLayer keeps what a verification adds, a tree's mask applies the window (``layer_masks``), and
    ``slide`` drops, after each commit, the entries no later query can see."""
    cache = DynamicCache(config=model.config)
    window = sliding_window(model)
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            # chunked-attention layers (Llama-4; no sliding window) are sliding layers to transformers: inside one chunk
            # (``window_limit``) they attend like full layers
            cache.layers[i] = WindowLayer(window) if window is not None else DynamicLayer()
    return cache


class WindowLayer(DynamicLayer):
    """A sliding-window cache layer for tree verification: ``offset`` entries (the oldest) are gone, so the entry at
    index i is position offset + i; ``get_seq_length`` counts positions (dropped entries included), like a full layer."""

    is_sliding = True  # transformers builds its own sliding masks (plain chains, prefills) from this layer's sizes

    def __init__(self, window: int):
        super().__init__()
        self.window, self.offset = window, 0

    def get_seq_length(self) -> int:
        return self.offset + self.stored

    @property
    def stored(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.offset

    def slide(self) -> None:
        """Drop the entries no later query can see: a query at position q >= the cache length sees keys > q - window,
        so the last window - 1 entries are all that stay visible."""
        drop = self.stored - (self.window - 1)
        if drop > 0:
            self.keys, self.values = self.keys[..., drop:, :], self.values[..., drop:, :]
            self.offset += drop

    def reset(self) -> None:
        super().reset()
        self.offset = 0


def slide(cache: Cache) -> None:
    """After a commit: every sliding-window layer drops the entries no later query can see (``WindowLayer.slide``)."""
    for layer in cache.layers:
        if isinstance(layer, WindowLayer):
            layer.slide()


def window_offset(cache: Cache | None) -> int:
    """How many of the oldest entries the sliding-window layers of ``cache`` have dropped (the same for all of them)."""
    return next((layer.offset for layer in (cache.layers if cache is not None else []) if isinstance(layer, WindowLayer)), 0)


def cache_length(cache: Cache) -> int:
    return cache.get_seq_length()


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [N, S + N] (True = may attend) -> float [1, 1, N, S + N]: 0 where allowed, dtype's minimum elsewhere;
    bool [B, N, S + N] (a batch's rows) -> [B, 1, N, S + N]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if allowed.dim() == 2 else mask[:, None]


def forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Cache,
    logits_to_keep: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """input_ids [N], position_ids [N], mask [1, 1, N, S + N] or None (plain causal) -> logits [n, V], states: L + 1
    tensors [N, D].

    n = N, or the last ``logits_to_keep`` positions when that is an int > 0, or the positions it lists when it is an
    index tensor (empty: no LM head at all). ``states`` are transformers' ``hidden_states`` at
    every one of the N positions: states[0] the embeddings, states[i] the output of decoder layer i, states[-1] the
    final hidden state (after the model's final norm), the input of the LM head, which is what draft heads read.
    They are computed by every forward anyway (the model keeps them for the caller; no copy is made).
    """
    with grouped_attention(input_ids.device):
        out = model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=layer_masks(model, mask, position_ids, cache),
            cache=cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
            return_dict=True,
        )
    return out.logits[0], tuple(h[0] for h in out.hidden_states)  # [n, V], L + 1 x [N, D]


def forward_rows(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 cache: Cache, logits: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``forward`` over a batch of rows: input_ids [B, N], position_ids [B, N], mask [B, 1, N, S + N] or None (plain
    causal, B = 1) -> logits [B, N, V] ([B, 0, V] with ``logits`` False: no LM head), states: L + 1 tensors [B, N, D].
    The cache holds B rows (``rows_cache``)."""
    keep = 0 if logits else torch.zeros(0, dtype=torch.long, device=input_ids.device)
    with grouped_attention(input_ids.device):
        out = model(input_ids=input_ids, position_ids=position_ids,
                    attention_mask=layer_masks(model, mask, position_ids, cache), cache=cache, use_cache=True,
                    output_hidden_states=True, logits_to_keep=keep, return_dict=True)
    return out.logits, tuple(out.hidden_states)


GROUPED_ATTENTION_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
"""transformers' sdpa attention reads this variable at every call (``use_gqa_in_sdpa``): "1" lets torch's
scaled_dot_product_attention group the query heads over the key/value heads (``enable_gqa``) where a mask is given."""


@contextmanager
def grouped_attention(device: torch.device) -> Iterator[None]:
    """For a forward on a CPU without autograd: a grouped-query model's sdpa attention runs grouped wherever a mask is
    in play (a tree's, a batch's, or the causal mask transformers builds for several new tokens over a cache: a chain,
    a draft head's new pairs) instead of copying every cached key and value once per query head (transformers'
    ``repeat_kv``, which it does with a mask because CUDA's masked kernels lack grouping). On a CPU torch's attention
    kernel groups with a mask, to the same bits (tests/test_hf_contact.py); SmolLM2 (9 query heads over 3) verifies a
    10-20-node tree ~1.5 ms faster at 400 cached tokens (docs/benchmarks/log.md §36). Elsewhere, or with the switch set
    already (a user's own): nothing changes. A forward without a mask groups anyway."""
    on = device.type == "cpu" and not torch.is_grad_enabled()
    if not on or os.environ.get(GROUPED_ATTENTION_SWITCH) is not None:
        yield
        return
    os.environ[GROUPED_ATTENTION_SWITCH] = "1"
    try:
        yield
    finally:
        os.environ.pop(GROUPED_ATTENTION_SWITCH, None)


def layer_masks(model: PreTrainedModel, mask: torch.Tensor | None, position_ids: torch.Tensor, cache: Cache | None):
    """A tree's mask [1, 1, N, K] over positions 0..K-1 (every earlier position, then the tree's own nodes) -> what the
    model's forward takes: the mask itself when no layer slides; with sliding-window layers, the window applied too (a
    query at position q sees the keys at positions > q - window, transformers' rule) over the keys those layers still
    hold (``WindowLayer``: from position ``window_offset`` on), alone when every layer slides, else
    {"full_attention": mask, "sliding_attention": windowed}.

    position_ids [N] ([B, N] with a mask [B, 1, N, K]: ``forward_rows``). A tree's own nodes sit at key positions >= the cache length, never further from a query than the
    tree is deep: inside any window wider than the tree, whatever their column."""
    window = sliding_window(model)
    if mask is None or window is None:
        return mask
    offset = window_offset(cache)
    keys = torch.arange(offset, mask.shape[-1], device=mask.device)  # the positions the sliding layers hold
    queries = position_ids.to(mask.device).reshape(mask.shape[0], -1)  # [B, N] (a batch's rows: ``forward_rows``)
    outside = keys <= queries[..., None] - window  # [B, N, K - offset]
    windowed = mask[..., offset:].masked_fill(outside[:, None], torch.finfo(mask.dtype).min)
    types = set(getattr(model.config.get_text_config(), "layer_types", None) or ["sliding_attention"])
    if types == {"sliding_attention"}:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def window_limit(model: PreTrainedModel) -> int | None:
    """The attention window that prompt + new tokens must stay inside (None: no limit): a window a tree's mask cannot
    express. GPT-Neo's local layers window by a key's index in the sequence (not its position); Llama-4's chunked
    layers see their own chunk only; a model that mixes sliding and full layers but whose decoder takes one mask for
    all (no per-layer-type dict, ``layer_masks``)."""
    cfg = model.config.get_text_config()
    if "local" in (getattr(cfg, "attention_layers", None) or []):
        return int(cfg.window_size)
    types = set(getattr(cfg, "layer_types", None) or [])
    if "chunked_attention" in types:  # Llama-4: tokens attend within their chunk only, by index
        return int(cfg.attention_chunk_size)
    window = sliding_window(model)
    if window is None or len(types) < 2:
        return None
    takes_dict = forward_source_matches(type(decoder(model)), r"attention_mask,\s*dict\)")
    return None if takes_dict else window


def key_limit(model: torch.nn.Module) -> int | None:
    """The most keys its attention can see in one forward where a fixed causal-bias buffer bounds them (GPT-Neo
    slices a [1, 1, M, M] ``bias`` by the key length; M = max_position_embeddings); None where nothing does."""
    sizes = [buf.shape[-1] for name, buf in model.named_buffers()
             if name.rsplit(".", 1)[-1] == "bias" and buf.dtype == torch.bool and buf.dim() == 4]
    return min(sizes) if sizes else None


def cache_keep(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep, of the entries from position ``start`` on, only those at offsets ``keep`` (in order); drop the rest.

    keep: long [K] offsets relative to ``start``. After the call the cache holds start + K entries.
    """
    total = cache.get_seq_length()
    k = int(keep.numel())
    moved = (keep != torch.arange(k, device=keep.device)).nonzero()  # kept entries not where they stay
    if moved.numel():
        first = int(moved[0])  # entries before it stay where they are
        sources = {}  # a layer's index of position start -> the indices its moved entries come from
        for layer in cache.layers:
            local = start - getattr(layer, "offset", 0)  # a WindowLayer's index of position start
            if local < 0 or layer.get_seq_length() != total:
                raise RuntimeError(f"cache_keep: a cache layer holds {layer.get_seq_length()} positions, expected "
                                   f"{total} from {start} on (a transformers sliding layer that dropped entries?)")
            src = sources.get(local)
            if src is None:
                src = sources[local] = keep[first:].to(layer.keys.device) + local  # [K - first]
            layer.keys[:, :, local + first : local + k] = layer.keys[:, :, src]  # [B, H, K - first, hd]
            layer.values[:, :, local + first : local + k] = layer.values[:, :, src]
    if total > start + k:
        cache.crop(-(total - start - k))


def contiguous(cache: Cache) -> None:
    """Every layer's keys and values in one contiguous block (a crop leaves a view of a longer one): what a compiled
    forward has seen, so that the next call reuses its graph instead of compiling another for the view's strides.
    Copies only the layers a crop left as views."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


# ------------------------------------------------------------------------------------------ a batch's cache (rows)
# B sequences decode together in one cache of B rows (selfspec/core/batch.py): every row has the same number of slots S,
# row b's text fills its first lengths[b]; the slots after that are stale (a longer neighbour's, a rejected draft's) and
# masked. Every layer keeps every entry (no sliding: a tree's mask applies a window by position, ``layer_masks``).


def rows_cache(model: PreTrainedModel) -> Cache:
    """An empty cache for a batch's rows: transformers' cache for the model, every layer a full ``DynamicLayer``."""
    cache = DynamicCache(config=model.config)
    cache.layers = [layer if type(layer) is DynamicLayer else DynamicLayer() for layer in cache.layers]
    return cache


def join_rows(cache: Cache, other: Cache) -> None:
    """Append the rows of ``other`` (a ``rows_cache``, its rows as long as it holds) to ``cache``; the shorter side's
    rows are padded with zeros to the longer one's slots."""
    if rows(cache) == 0:
        for mine, theirs in zip(cache.layers, other.layers):
            mine.keys, mine.values, mine.is_initialized = theirs.keys, theirs.values, theirs.is_initialized
            mine.device = getattr(theirs, "device", None)
        return
    slots = max(cache.get_seq_length(), other.get_seq_length())
    for mine, theirs in zip(cache.layers, other.layers):
        mine.keys = torch.cat([_padded(mine.keys, slots), _padded(theirs.keys, slots)])
        mine.values = torch.cat([_padded(mine.values, slots), _padded(theirs.values, slots)])


def _padded(entries: torch.Tensor, slots: int) -> torch.Tensor:
    """[B, H, S, hd] -> [B, H, slots, hd], zeros after the S held."""
    missing = slots - entries.shape[-2]
    return entries if missing == 0 else torch.nn.functional.pad(entries, (0, 0, 0, missing))


def rows(cache: Cache) -> int:
    """How many rows (sequences) the cache holds."""
    layer = cache.layers[0]
    return 0 if not layer.is_initialized or layer.keys.numel() == 0 else layer.keys.shape[0]


def select_rows(cache: Cache, keep: list[int], slots: int) -> None:
    """Keep rows ``keep`` (in that order) and their first ``slots`` entries."""
    index = torch.tensor(keep, dtype=torch.long, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[index, :, :slots], layer.values[index, :, :slots]


def keep_rows(cache: Cache, start: int, lengths: list[int], paths: list[torch.Tensor]) -> list[int]:
    """After a verification that added N slots from ``start`` to every row: row b keeps the entries at slots start +
    paths[b] (its accepted path, in order), moved to follow its own lengths[b] entries; the rows' new lengths; the
    cache keeps max(new lengths) slots. paths: long [A_b] offsets relative to ``start``."""
    device = cache.layers[0].keys.device
    row = torch.cat([torch.full((len(p),), b, dtype=torch.long) for b, p in enumerate(paths)]).to(device)  # [M]
    src = torch.cat([start + p for p in paths]).to(device)  # [M]
    dst = torch.cat([torch.arange(n, n + len(p)) for n, p in zip(lengths, paths)]).to(device)  # [M]
    moved = bool((src != dst).any())
    new = [n + len(p) for n, p in zip(lengths, paths)]
    for layer in cache.layers:
        if moved:
            layer.keys[row, :, dst] = layer.keys[row, :, src]  # [M, H, hd]
            layer.values[row, :, dst] = layer.values[row, :, src]
        layer.keys, layer.values = layer.keys[:, :, : max(new)], layer.values[:, :, : max(new)]
    return new


def sdpa_or_eager(build: Callable[[str], PreTrainedModel]) -> PreTrainedModel:
    """``build("sdpa")``, or ``build("eager")`` for an architecture transformers has no sdpa attention for (Gemma-2,
    gpt-oss, Mamba, ...: it raises a ValueError naming scaled_dot_product_attention)."""
    try:
        return build("sdpa")
    except ValueError as err:
        if "scaled_dot_product_attention" not in str(err):
            raise
        return build("eager")


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack under the LM head: transformers' ``get_decoder``, or the ``model`` / ``transformer`` attribute
    of a causal LM whose ``base_model_prefix`` names neither (``get_decoder`` then returns the causal LM itself, e.g.
    Llama-4's text model)."""
    base = model.get_decoder()
    if base is model:
        for name in ("model", "transformer"):
            inner = getattr(model, name, None)
            if isinstance(inner, torch.nn.Module):
                return inner
    return base


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of a decoder-only model (Llama-like ``model.model.layers`` or GPT-2's ``transformer.h``)."""
    base = decoder(model)
    for name in ("layers", "h"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}: expected `.layers` or `.h` on its decoder")


def unverifiable(model: PreTrainedModel) -> str | None:
    """Why a tree of drafts cannot be verified losslessly on ``model`` in one forward, or None when it can.

    Tree verification needs every layer to mix positions through attention alone, under the tree mask, at explicit
    positions. Two families break that: ALiBi biases (BLOOM, MPT, Falcon with ``alibi``) are computed from a key's index
    in the sequence, not from position ids, so a tree's side branches would get wrong biases (MPT silently decodes
    other text); recurrent, state-space and linear-attention layers (Mamba, Jamba, Qwen3-Next / Qwen3.5, LFM2, RWKV,
    ...) run a state through every token in order, which a tree mask cannot branch and a rejection cannot roll back.
    """
    cfg = model.config.get_text_config()
    kind = f"{type(model).__name__} (model_type={cfg.model_type!r})"
    if cfg.model_type in ("bloom", "mpt") or getattr(cfg, "alibi", False) is True \
            or getattr(getattr(cfg, "attn_config", None), "alibi", False) is True:
        return (f"{kind} uses ALiBi attention biases, computed from a key's index in the sequence rather than from "
                "position ids: the nodes of a draft tree would get wrong biases, so tree verification would not be "
                "lossless")
    try:
        layers = DynamicCache(config=model.config).layers
    except (TypeError, ValueError, AttributeError):
        layers = []
    recurrent = [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if recurrent or cfg.model_type in RECURRENT_TYPES:
        which = f"layers {recurrent} of {len(layers)} are" if recurrent else "its layers are"
        return (f"{kind}: {which} recurrent (state-space or linear attention): their state runs through every token "
                "in order, so a tree of drafts cannot be verified in one forward nor rolled back after a rejection")
    return None


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


# ------------------------------------------------------------------------------------------ self-speculation contact
# Drafting with part of the target (layer skipping, early exit) runs the model's own forward with some decoder layers
# temporarily replaced: a skipped layer by ``Passthrough`` (its cache layer never grows), an exit by an adapter module.
# The list keeps its length, so every remaining layer keeps its index (its cache layer, its Gemma/Qwen layer type).


class Passthrough(torch.nn.Module):
    """Stands in for a skipped decoder layer: returns its input hidden state unchanged, touches no cache."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states


class Apply(torch.nn.Module):
    """Stands in for a decoder layer by applying ``module`` to the hidden state alone (e.g. an exit head)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.module(hidden_states)


@contextmanager
def replaced_layers(model: PreTrainedModel, replace: Mapping[int, torch.nn.Module]) -> Iterator[None]:
    """Within the block, decoder layer i is ``replace[i]``; the original layers are back afterwards, even on error.

    Not thread-safe: the model must not run elsewhere meanwhile.
    """
    layers = decoder_layers(model)
    bad = [i for i in replace if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer indices {bad} are out of range: this model has {len(layers)} decoder layers (0..{len(layers) - 1})")
    saved = {i: layers[i] for i in replace}
    as_tuple = layers_return_tuples(type(decoder(model)))
    try:
        for i, module in replace.items():
            layers[i] = AsTuple(module) if as_tuple else module
        yield
    finally:
        for i, module in saved.items():
            layers[i] = module


class AsTuple(torch.nn.Module):
    """Returns ``(module(...),)``: a stand-in's output as older modeling files expect a layer's (``outputs[0]``)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor]:
        return (self.module(*args, **kwargs),)


def layers_return_tuples(decoder_class: type) -> bool:
    """Whether ``decoder_class.forward`` reads each layer's hidden state as ``outputs[0]`` (older modeling files: GPT-Neo,
    Falcon, ...) rather than taking the layer's output itself (Llama, GPT-2 and most models in transformers 5)."""
    return forward_source_matches(decoder_class, r"hidden_states\s*=\s*\w*outputs\[0\]")


@functools.cache
def forward_source_matches(decoder_class: type, pattern: str) -> bool:
    """Whether the source of ``decoder_class.forward`` (transformers' modeling file) matches ``pattern``; False when the
    source cannot be read. How the decoder treats its layers and masks, where transformers exposes no flag for it."""
    try:
        source = inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False
    return re.search(pattern, source) is not None


@contextmanager
def captured_output(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the hidden-state output [B, N, D] of every call of ``module`` (a decoder layer) within the block."""
    outputs: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _args: object, output: object) -> None:
        outputs.append(output[0] if isinstance(output, tuple) else output)  # type: ignore[index]

    handle = module.register_forward_hook(hook)
    try:
        yield outputs
    finally:
        handle.remove()


class Emit(torch.nn.Module):
    """Stands in for a decoder layer by returning given hidden states [1, N, D], whatever its input (computed before)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if hidden_states.shape != self.hidden.shape:
            raise ValueError(f"Emit holds hidden states of shape {tuple(self.hidden.shape)}, the forward has {tuple(hidden_states.shape)}")
        return self.hidden


def forward_partial(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache: Cache,
    lm_head: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """input_ids [N], position_ids [N], mask [1, 1, N, K] -> logits [N, V] (None without lm_head), hidden [N, D].

    For a model with some layers replaced (``replaced_layers``). ``hidden`` is the final hidden state after the model's
    final norm, as in ``forward``. K is the key length each attending layer sees (its cached entries + N): cache layers
    may hold different lengths, so the mask and the positions say everything and the cache's own length is never used.
    lm_head=False runs the decoder alone (no LM head).
    """
    kwargs = dict(input_ids=input_ids[None], position_ids=position_ids[None],
                  attention_mask=layer_masks(model, mask, position_ids, cache), cache=cache, use_cache=True)
    if not lm_head:
        return None, decoder(model)(**kwargs, return_dict=True).last_hidden_state[0]
    final: list[torch.Tensor] = []
    handle = decoder(model).register_forward_hook(lambda _m, _a, out: final.append(out.last_hidden_state))
    try:
        out = model(**kwargs, return_dict=True)
    finally:
        handle.remove()
    return out.logits[0], final[-1][0]


def layer_lengths(cache: Cache) -> list[int]:
    """How many entries each cache layer holds."""
    return [layer.get_seq_length() for layer in cache.layers]


def cache_truncate(cache: Cache, length: int) -> None:
    """Drop, layer by layer, every entry at position >= length (layers that hold fewer are left alone)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def layer_entries(cache: Cache, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H, end - start, hd] of cache layer ``layer`` at positions start..end-1."""
    entry = cache.layers[layer]
    offset = getattr(entry, "offset", 0)  # a WindowLayer's dropped entries
    if entry.get_seq_length() < end or start < offset or entry.keys.shape[-2] + offset != entry.get_seq_length():
        raise RuntimeError(f"cache layer {layer} holds positions {offset}..{entry.get_seq_length() - 1}, expected "
                           f"{start}..{end - 1}")
    return entry.keys[:, :, start - offset:end - offset], entry.values[:, :, start - offset:end - offset]


def append_entries(cache: Cache, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Append keys/values [B, H, n, hd] to cache layer ``layer`` (as the layer's own forward would have)."""
    cache.layers[layer].update(keys, values)
