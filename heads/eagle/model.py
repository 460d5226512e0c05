"""An EAGLE-style sequential draft head on a frozen target: one light decoder layer over the target's own features.

Medusa heads guess every future position from one hidden state; this head drafts autoregressively, each step
conditioned on the tokens it has drafted so far, as EAGLE does. Pair j of the sequence is the target's final hidden
state f_j (the LM head's input at j) and the embedding of the token that followed, x_{j+1}:

    (f_j, e(x_{j+1})) ─ fc [2D -> D] ─ decoder layer(s), causal over pairs 0..j ─▶ f̂_{j+1} ─ LM head ─▶ x̂_{j+2}

At draft time the pairs of the committed text use the target's true features (kept in the head's own small KV cache);
beyond them the head feeds on its own predictions, (f̂_{j+1}, e(x̂_{j+2})) -> f̂_{j+2} -> x̂_{j+3}, and so on
(heads/eagle/drafter.py). Training unrolls those steps so the head learns from its own mistakes (heads/eagle/loss.py).

The decoder layer is the target architecture's own (built with transformers' ``AutoModel.from_config`` from the target's
config with ``num_layers`` layers and no vocabulary): no modeling file is copied. The embeddings and the LM head are the
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, DynamicCache, PreTrainedModel

from heads.base import card_usage
from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import read_typed_checkpoint
from heads.eagle.config import DRAFT_TYPE, EagleConfig, check_feature_layers
from selfspec.core import hf
from selfspec.core.draft_vocab import DraftVocab, check_draft_tokens


def build_decoder(config) -> PreTrainedModel:
    """The head's decoder (transformers' model of ``config``'s architecture) with sdpa attention, or eager attention
    for the architectures that have no sdpa path (Gemma-2, gpt-oss)."""
    return hf.sdpa_or_eager(lambda attn: AutoModel.from_config(config, attn_implementation=attn))


def run_decoder(decoder: PreTrainedModel, inputs: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
    """One forward of a head's decoder: inputs [B, N, D_in] (D, or 2D into an EAGLE-3 head's first layer),
    position_ids [B, N], mask [B, 1, N, S + N] additive or None (causal) -> its last hidden state [B, N, D]; appends N
    entries to ``cache`` when one is given. On a CPU without autograd (drafting) the attention runs grouped
    (``hf.grouped_attention``: no cache copy per head)."""
    with hf.grouped_attention(inputs.device):
        out = decoder(inputs_embeds=inputs, position_ids=position_ids, attention_mask=mask, cache=cache,
                      use_cache=cache is not None, return_dict=True)
    return out.last_hidden_state


def read_eagle_checkpoint(directory: Path) -> tuple[EagleConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of an EAGLE-head checkpoint directory, checked against each other. Strict."""
    return read_head_checkpoint(directory, DRAFT_TYPE, "EAGLE-head", EagleConfig, EagleHead, upgrade_state)


def read_head_checkpoint(directory: Path, draft_type: str, what: str, config_class: type, head_class: type,
                         upgrade=None) -> tuple[Any, dict[str, torch.Tensor]]:
    """A checkpoint of a head built on EagleHead (EAGLE heads, block drafters): its strict config, its tensors checked
    against the head that config builds, and its draft vocabulary checked against the base's."""
    def build(config: Any) -> nn.Module:
        stub = nn.Linear(1, config.vocab_size)  # the base's embeddings and LM head are not part of the checkpoint
        return head_class(config, stub, stub)

    config, tensors = read_typed_checkpoint(directory, draft_type, what, config_class.from_dict, build, upgrade=upgrade)
    try:
        check_draft_tokens(tensors["draft_vocab.tokens"], config.draft_vocab_size, config.vocab_size)
    except ValueError as err:
        raise ValueError(f"{directory / 'model.safetensors'}: the draft vocabulary (draft_vocab.tokens): {err}") from None
    return config, tensors


def card_facts(config: Any, offsets: str) -> tuple[str, str]:
    """What a head's model card says of its features and its measured agreement (per ``offsets``: 'steps 1, 2, ...')."""
    features = ("final hidden states" if not config.feature_layers
                else f"hidden states of layers {config.feature_layers} (fused, EAGLE-3 style)")
    agreement = ("not measured" if config.top1_agreement is None
                 else ", ".join(f"{a:.3f}" for a in config.top1_agreement) + f" ({offsets})")
    return features, agreement


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


class EagleHead(nn.Module, DraftCheckpoint):
    """fc + a ``num_layers``-layer decoder of the base's architecture + the draft vocabulary's token ids.

    ``forward`` is the training unroll (one call, so DDP / DeepSpeed see a single forward); ``step`` is one drafting
    call over the head's own KV cache; ``logits`` reads the target's LM head on the draft vocabulary.
    """

    WHAT = "EAGLE head"
    DRAFT_TYPE = DRAFT_TYPE
    SPECULATORS_INSTEAD = ("train.py method: eagle3 trains an EAGLE-3 draft of speculators' architecture, which exports "
                           "as it is")

    def __init__(self, config: EagleConfig, embed: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        D = config.hidden_size
        layers = config.feature_layers
        self.fuse = nn.Linear(len(layers) * D, D, bias=False) if layers else None  # EAGLE-3: [L·D] -> [D]
        self.fc = nn.Linear(2 * D, D)
        dcfg = dict(config.decoder_config)
        self.decoder = build_decoder(AutoConfig.for_model(dcfg.pop("model_type"), **dcfg))
        # it reads the embeddings it is given: no unused parameter (DDP refuses those). Where the decoder names its
        # embedding otherwise (GPT-Neo's wte, OPT's nested one) it stays, for the checkpoints' tensor names, untrained
        self.decoder.get_input_embeddings().requires_grad_(False)
        self.decoder.embed_tokens = None
        self.draft_vocab = DraftVocab(config.draft_vocab_size, config.vocab_size)  # buffer draft_vocab.tokens [V']
        self._frozen = (embed, lm_head)  # a tuple: not registered, never in state_dict or the optimizer
        self.register_load_state_dict_pre_hook(_upgrade_state_hook)  # checkpoints and resumable runs from before

    # ----------------------------------------------------------------------------------------------------- pieces
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> the base's (frozen) input embeddings [..., D]."""
        embed = self._frozen[0]
        return F.embedding(tokens, embed.weight.detach()) * getattr(embed, "embed_scale", 1.0)

    @property
    def lm_head(self) -> nn.Module:
        """The base's LM head (frozen, held by reference)."""
        return self._frozen[1]

    @property
    def verifier_lm_head(self) -> nn.Module:
        """What the training loss distils from: the base's LM head (``lm_head`` itself: the head drafts through it)."""
        return self._frozen[1]

    @property
    def feature_width(self) -> int:
        """F: the width of the target features a true pair reads (D, or L·D for multi-layer features)."""
        return self.config.hidden_size * (len(self.config.feature_layers) if self.config.feature_layers else 1)

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features of committed positions [..., F] -> what a true pair reads [..., D]: the fusion of the
        chosen layers' states (``feature_layers``), or the final hidden state itself."""
        if features.shape[-1] != self.feature_width:
            raise ValueError(f"EAGLE head: expected target features of width {self.feature_width} (hidden size "
                             f"{self.config.hidden_size} x {self.feature_width // self.config.hidden_size} layers), "
                             f"found {features.shape[-1]}")
        if self.fuse is None:
            return features
        return self.fuse(features.to(self.fuse.weight.dtype))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., D] -> draft-vocabulary logits [..., V'] (through the frozen LM head's rows of V')."""
        return self.draft_vocab.linear(self.lm_head, features)

    def base_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> the base's token ids."""
        return self.draft_vocab.base_ids(index)

    def step(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
             mask: torch.Tensor | None, cache) -> torch.Tensor:
        """features [B, N, D] (f_j), tokens [B, N] (x_{j+1}), position_ids [B, N], mask [B, 1, N, S + N] additive or
        None (causal) -> f̂_{j+1} [B, N, D]; appends N entries to ``cache``."""
        return run_decoder(self.decoder, self.pair_inputs(features, tokens), position_ids, mask, cache)

    def pair_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features [B, N, D] (f_j, or the fused g_j), tokens [B, N] (x_{j+1}) -> the decoder's inputs [B, N, D]:
        fc over each pair's token embedding and feature."""
        dtype = self.fc.weight.dtype
        return self.fc(torch.cat([self.embed(tokens).to(dtype), features.to(dtype)], -1))

    # ------------------------------------------------------------------------------------------------- training
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, unroll: int) -> torch.Tensor:
        """The training unroll (``unrolled``): [U, B, n, D]."""
        return unrolled(self, features, input_ids, lengths, unroll)

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(eagle_card)
    read_checkpoint = staticmethod(read_eagle_checkpoint)

    @classmethod
    def on_base(cls, config: EagleConfig, base_model: PreTrainedModel) -> "EagleHead":
        check_feature_layers(config.feature_layers, base_model)
        return cls(config, base_model.get_input_embeddings(), base_model.get_output_embeddings())


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


LEGACY_KEYS = {"draft_tokens": "draft_vocab.tokens"}
"""Tensor names of EAGLE heads saved before the head used ``selfspec.core.draft_vocab.DraftVocab`` -> their names
now."""


def upgrade_state(state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Rename, in place, the tensors of an older EAGLE-head state dict (``LEGACY_KEYS``) under ``prefix``."""
    for old, new in LEGACY_KEYS.items():
        if prefix + old in state and prefix + new not in state:
            state[prefix + new] = state.pop(prefix + old)
    return state


def _upgrade_state_hook(module, state_dict, prefix, *args) -> None:
    upgrade_state(state_dict, prefix)
