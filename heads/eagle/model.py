"""An EAGLE-style sequential draft head on a frozen target: one light decoder layer over the target's own features.

Medusa heads guess every future position from one hidden state; this head drafts autoregressively, each step
conditioned on the tokens it has drafted so far, as EAGLE does. Pair j of the sequence is the target's final hidden
state f_j (the LM head's input at j) and the embedding of the token that followed, x_{j+1}:

    (f_j, e(x_{j+1})) ─ fc [2D -> D] ─ decoder layer(s), causal over pairs 0..j ─▶ f̂_{j+1} ─ LM head ─▶ x̂_{j+2}

At draft time the pairs of the committed text use the target's true features (kept in the head's own small KV cache);
beyond them the head feeds on its own predictions, (f̂_{j+1}, e(x̂_{j+2})) -> f̂_{j+2} -> x̂_{j+3}, and so on
(heads/eagle/drafter.py). Training unrolls those steps so the head learns from its own mistakes (heads/eagle/loss.py).

The decoder layer is the target architecture's own (built with transformers' ``AutoModel.from_config`` from the target's
config with ``num_layers`` layers and no vocabulary): no modeling file is copied. These pieces (fc, the decoder, the
fusion below, the draft vocabulary) are ``DecoderHead``'s (heads/decoder/model.py), which the block drafter builds on
too; this head's own are its unroll, its card and its checkpoint's draft type. The embeddings and the LM head are the
target's, frozen and held by reference (never stored). The LM head is read on a **draft vocabulary** only: the
``draft_vocab_size`` tokens most frequent in the training data (EAGLE-3 / FR-Spec's trick): on a 135M model with a 49k
vocabulary the full LM head costs as much as 8 of its 30 layers, on every drafted position.

**Multi-layer features** (EAGLE-3): with ``feature_layers`` set, the true pairs read, instead of f_j, a fusion of the
target's hidden states at several depths, g_j = fuse([h_j^(l1), h_j^(l2), ...]) [L·D -> D] (low layers still know the
token, high layers what comes next); the pairs the head drafts itself read its own f̂ as before, so drafting beyond the
committed text is unchanged. Layer indices follow transformers' ``hidden_states``: 0 the embeddings, i the output of
decoder layer i, the last one the final hidden state (after the final norm).

A checkpoint (``save_pretrained``) is config.json (``EagleConfig``, heads/eagle/config.py: draft_type "eagle", the base,
the decoder's transformers config, the draft vocabulary size, drafting defaults, measured agreement) + model.safetensors
(fc, the decoder, the draft vocabulary's token ids) + README.md, written atomically like every selfspec checkpoint;
heads/eagle/drafter.py's ``load_drafter`` is its ``selfspec.drafters`` entry point (``--draft DIR``).

Shapes: B batch, T time, n = T - 1 pairs, U unrolled steps, D hidden size, L feature layers, F the head's input
feature width (D, or L·D with feature_layers), V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import DynamicCache

from heads.base import card_usage
from heads.decoder.model import DecoderHead, card_facts, read_head_checkpoint, upgrade_state
from heads.eagle.config import DRAFT_TYPE, EagleConfig
from selfspec.core import hf


def read_eagle_checkpoint(directory: Path) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of an EAGLE-head checkpoint directory, checked against each other. Strict."""
    return read_head_checkpoint(directory, DRAFT_TYPE, "EAGLE-head", EagleConfig, EagleHead, upgrade_state)


def eagle_card(config: EagleConfig, location: str) -> str:
    features, agreement = card_facts(config, "steps 1, 2, ...")
    return f"""---
library_name: selfspec
base_model: {config.base_model}
tags: [speculative-decoding, eagle, selfspec]
---
# EAGLE-style draft head for {config.base_model}

{config.num_layers} decoder layer(s) of the base's architecture over the base's own {features} and token
embeddings, drafting autoregressively over a {config.draft_vocab_size}-token draft vocabulary (of {config.vocab_size});
the base verifies every draft tree in one forward, so greedy output is the base's own. Drafting defaults: depth
{config.depth}, {config.topk} expanded per depth, {config.budget} nodes. Top-1 agreement with the base on held-out data:
{agreement}.

{card_usage(config.base_model, location)}
"""


class EagleHead(DecoderHead):
    """fc + a ``num_layers``-layer decoder of the base's architecture + the draft vocabulary's token ids (the pieces
    of ``DecoderHead``, heads/decoder/model.py).

    ``forward`` is the training unroll (one call, so DDP / DeepSpeed see a single forward); ``step`` is one drafting
    call over the head's own KV cache; ``logits`` reads the target's LM head on the draft vocabulary.
    """

    WHAT = "EAGLE head"
    DRAFT_TYPE = DRAFT_TYPE
    SPECULATORS_INSTEAD = ("train.py method: eagle3 trains an EAGLE-3 draft of speculators' architecture, which exports "
                           "as it is")

    # ------------------------------------------------------------------------------------------------- training
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, unroll: int) -> torch.Tensor:
        """The training unroll (``unrolled``): [U, B, n, D]."""
        return unrolled(self, features, input_ids, lengths, unroll)

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(eagle_card)
    read_checkpoint = staticmethod(read_eagle_checkpoint)


def unrolled(head, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, unroll: int) -> torch.Tensor:
    """The training unroll of ``head`` (an ``EagleHead``, or speculators' EAGLE-3 draft, heads/eagle/eagle3.py: what
    either drafts with, ``true_features`` and ``step``, is what it trains). features [B, T, F] (the target's features
    at positions 0..T-1: f_j, or the chosen layers' states, see ``true_features``), input_ids [B, T], lengths [B]
    (right padding) -> [U, B, n, D]: step u's prediction, at pair i, of f_{i+1}, made from the true pairs up to i - u and
    the head's own predictions for positions i - u + 1 .. i (exactly what drafting depth u + 1 sees).

    Step 0 is plain causal attention over the true pairs. Step u >= 1 feeds pair i the head's own step-(u-1)
    prediction of f_i (made at pair i - 1) and attends to step 0's keys at pairs <= i - u, to step m's key at pair
    i - u + m (m = 1..u-1), and to its own (EAGLE-3's training-time test, as one KV cache growing by n per step).
    """
    B, T, _ = features.shape
    n = T - 1
    limit = hf.key_limit(head.decoder)
    if limit is not None and unroll * n > limit:
        raise ValueError(f"the EAGLE head's unroll attends over {unroll} x {n} keys, but its "
                         f"{head.decoder.config.model_type} layer attends over at most {limit} "
                         f"(max_position_embeddings): lower data.max_length to {limit // unroll + 1} or eagle.unroll "
                         f"to {limit // n}")
    tokens = input_ids[:, 1:]  # [B, n] x_{i+1}
    positions = torch.arange(n, device=features.device).expand(B, n)
    cache = DynamicCache(config=head.decoder.config)
    outs = []
    true = head.true_features(features[:, :n])  # [B, n, D] f_i (or g_i)
    feats = true
    for u in range(unroll):
        mask = unroll_mask(u, n, lengths, head.fc.weight.dtype, features.device)  # [B, 1, n, (u + 1) n]
        out = head.step(feats, tokens, positions, mask, cache)  # [B, n, D]
        outs.append(out)
        feats = torch.cat([true[:, :1], out[:, :-1]], dim=1)  # pair i reads the prediction made at i - 1
    return torch.stack(outs)


def unroll_mask(u: int, n: int, lengths: torch.Tensor, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """The additive mask of unroll step u: [B, 1, n, (u + 1) n] over the keys of steps 0..u (see ``unrolled``).

    Queries of pairs i < u have no full chain behind them; they attend to what exists (their own key at least) and are
    never scored. Keys of padding pairs (i >= length - 1) are masked for every query.
    """
    device = torch.device(device or lengths.device)
    keys, own = unroll_keys(u, n, device)  # [n, (u + 1) n] each, built once per shape
    valid_key = (torch.arange(n, device=device)[None, :] < (lengths.to(device)[:, None] - 1)).repeat(1, u + 1)
    allowed = (keys[None] & valid_key[:, None, :]) | own[None]  # [B, n, (u + 1) n]; a query always sees its own key
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)  # additive: the decoder may attend eagerly (bool: sdpa only)
    return mask[:, None]


@functools.lru_cache(maxsize=64)
def unroll_keys(u: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Unroll step u's mask where it is the same for every row, bool on ``device``, built once per (u, n, device):
    (keys [n, (u + 1) n]: step 0's true pairs up to i - u, step m's key at pair i - u + m; own [n, (u + 1) n]: each
    query's own key). Read only: callers never write into them."""
    i = torch.arange(n, device=device)[:, None]  # [n, 1] query pair
    j = torch.arange(n, device=device)[None, :]  # [1, n] key pair
    blocks = [j <= i - u]  # step 0's keys: the true pairs up to i - u
    blocks += [j == i - u + m for m in range(1, u + 1)]  # step m's key at pair i - u + m (m = u: its own)
    own = torch.cat([torch.zeros(n, u * n, dtype=torch.bool, device=device),
                     torch.eye(n, dtype=torch.bool, device=device)], dim=1)  # [n, (u + 1) n]
    return torch.cat(blocks, dim=1), own
