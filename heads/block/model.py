"""A block drafter on a frozen target: the EAGLE head's pairs, then K - 1 mask queries, drafting a whole block of K
future tokens in one forward (the block-parallel drafting of BlockPilot and DFlash, on the target's own features).

The sequence the head reads is the EAGLE head's (heads/decoder/model.py, which both build on): pair j is the target's
feature at j (its final hidden state f_j, or an EAGLE-3 fusion of ``feature_layers``) and the embedding of the token
that followed, x_{j+1}, through fc [2D -> D] and ``num_layers`` decoder layers of the target's own architecture, causal
over the pairs. With T tokens x_0 .. x_{T-1} (the last one the root, the target's newest token), the output at the last
pair (f_{T-2}, root) predicts x_T. Then K - 1 mask queries follow, mask i at position T - 1 + i, its input a learned
vector of its own (``mask`` [K - 1, D]); each attends to every true pair and to every mask of its block
(bidirectionally), and its output, through the frozen LM head on the draft vocabulary, predicts x_{T+1+i}:

    pairs   (f_0, x_1) ... (f_{T-2}, x_{T-1} = root) │ mask_0   mask_1   ...  mask_{K-2}
    pos     0          ...  T-2                      │ T-1      T        ...  T+K-3
    attends causal over the pairs                    │ every pair, every mask of the block
    predicts x_2       ...  x_T                      │ x_{T+1}  x_{T+2}  ...  x_{T+K-1}

so one forward over the newly committed pairs and the K - 1 masks (heads/block/drafter.py) gives K per-position
distributions, for x_T .. x_{T+K-1} (block offsets 0 .. K-1). Training (``BlockHead.forward``) runs, in one call per
row, every true pair (causal) and, for A anchor pairs j, a block of K - 1 masks attending to the pairs <= j and to
their own block (``block_mask``): exactly what drafting sees with pair j the last true one.

The mask inputs are one learned vector per block offset, not one shared vector told apart by its position: the decoder
then knows each query's offset from its input (a rotary position says it only through attention scores, and a
learned absolute position would tie the offset to where in the text the block sits), at a cost of (K - 1) x D
parameters (3,000 for K = 6 on SmolLM2). No refinement passes (the block's guesses fed back in place of the masks):
one forward per step is the point of the drafter, and a second would need a second training pass to match it.

The decoder, the fusion, fc, the draft vocabulary and the frozen embeddings / LM head held by reference are the ones
the EAGLE head has too (``DecoderHead``, heads/decoder/model.py, which this class extends); its own are the mask
vectors, the training forward and the checkpoint (config.json ``BlockConfig``, draft_type "block"; model.safetensors:
fc, the decoder, the fusion, ``mask``, the draft vocabulary's token ids; README.md). A conditioned block (``condition_rank`` > 0 and / or ``confidence``)
adds ``markov`` (the low-rank logit bias keyed on the token before a position) and ``confidence`` (a per-position
head), heads/block/condition.py; drafting chains them per tree node after the one forward (heads/block/chained.py).

Shapes: B batch, T time, n = T - 1 pairs, A anchors per row, K block size, M = K - 1 mask queries, L the training
sequence (n + A·M), D hidden size, F the width a true pair reads (D, or L·D with feature layers), V' draft vocabulary.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from heads.base import card_usage
from heads.block.condition import Confidence, MarkovBias
from heads.block.config import DRAFT_TYPE, BlockConfig
from heads.decoder.model import DecoderHead, card_facts, read_head_checkpoint, run_decoder
from selfspec.core import hf


def read_block_checkpoint(directory: Path) -> tuple[BlockConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a block-drafter checkpoint directory, checked against each other. Strict."""
    return read_head_checkpoint(directory, DRAFT_TYPE, "EAGLE-style block drafter", BlockConfig, BlockHead)


def block_card(config: BlockConfig, location: str) -> str:
    features, agreement = card_facts(config, "block offsets 0, 1, ...")
    return f"""---
library_name: selfspec
base_model: {config.base_model}
tags: [speculative-decoding, block-drafting, selfspec]
---
# Block drafter for {config.base_model}

{config.num_layers} decoder layer(s) of the base's architecture over the base's own {features} and token
embeddings, drafting a block of {config.block_size} tokens in one forward ({config.block_size - 1} learned mask
queries after the last committed token) over a {config.draft_vocab_size}-token draft vocabulary (of
{config.vocab_size}); the base verifies every draft tree in one forward, so greedy output is the base's own. Drafting
default: the {config.budget} best nodes by product of per-position probabilities, {config.depth or config.block_size}
deep.{conditioning_facts(config)} Top-1 agreement with the base on held-out data: {agreement}.

{card_usage(config.base_model, location)}
"""


def conditioning_facts(config: BlockConfig) -> str:
    """What the card says of the conditioned block (heads/block/condition.py): nothing when it is off."""
    parts = []
    if config.condition_rank:
        parts.append(f" Each block position after the first gets a rank-{config.condition_rank} logit bias keyed on "
                     "the token drafted before it, chained per tree node.")
    if config.confidence:
        parts.append(f" A confidence head per position stops branches below {config.confidence_min} and the tree "
                     f"keeps nodes by {config.rank_by}.")
    return "".join(parts)


class BlockHead(DecoderHead):
    """``DecoderHead``'s pieces (fusion, fc, decoder, draft vocabulary: the EAGLE head's too) + ``mask`` [K - 1, D],
    one learned input per mask query.

    ``forward`` is the training pass (pairs and anchored blocks in one call); ``run`` is one decoder call over given
    inputs (drafting: the new pairs and a block, over the head's own KV cache); ``logits`` reads the target's LM head
    on the draft vocabulary.
    """

    WHAT = "block drafter"
    DRAFT_TYPE = DRAFT_TYPE
    SPECULATORS_INSTEAD = ("train.py method: dflash trains a block drafter of DFlash's architecture, which exports as "
                           "it is")

    def __init__(self, config: BlockConfig, embed: nn.Module, lm_head: nn.Module):
        super().__init__(config, embed, lm_head)
        dcfg = self.decoder.config
        self.mask = nn.Parameter(torch.empty(config.block_size - 1, config.hidden_size))  # [M, D]
        nn.init.normal_(self.mask, std=float(getattr(dcfg, "initializer_range", 0.02)))
        r = config.condition_rank  # the conditioned block (heads/block/condition.py); absent: today's block head
        self.markov = MarkovBias(config.hidden_size, r, config.draft_vocab_size) if r else None
        self.confidence = Confidence(config.hidden_size, r) if config.confidence else None

    @property
    def block_size(self) -> int:
        """K: tokens one forward drafts (the last true pair's and the K - 1 masks')."""
        return self.config.block_size

    @property
    def chained(self) -> bool:
        """Whether drafting chains anything after the forward (a Markov bias or a confidence head): the tree is then
        grown node by node (heads/block/chained.py), not from the block's per-position candidates alone."""
        return self.markov is not None or self.confidence is not None

    def prev_code(self, prev: torch.Tensor) -> torch.Tensor | None:
        """prev [N] target token ids (each the token before a block position) -> their codes [N, r] (None: not
        conditioned)."""
        return None if self.markov is None else self.markov.code(self.embed(prev))

    def conditioned_logits(self, states: torch.Tensor, code: torch.Tensor | None) -> torch.Tensor:
        """states [N, D] and the codes [N, r] of the tokens before them (None: block offset 0, or not conditioned) ->
        draft-vocabulary logits [N, V'] with the Markov bias added."""
        logits = self.logits(states)
        return logits if code is None or self.markov is None else logits + self.markov.bias(code).to(logits.dtype)

    def confidence_logits(self, states: torch.Tensor, code: torch.Tensor | None) -> torch.Tensor:
        """states [N, D] (and codes [N, r], None at offset 0) -> the confidence head's logits [N]."""
        if self.confidence is None:
            raise ValueError("this block drafter has no confidence head (config confidence: false)")
        return self.confidence(states, code)

    def new_cache(self) -> DynamicCache:
        """The drafter's cache of this head's decoder: the committed pairs (and, between steps, the last block)."""
        return DynamicCache(config=self.decoder.config)

    def block(self, cache: DynamicCache, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One drafting forward. cache holds the pairs of positions 0..S-1 (and the last step's block, dropped here);
        features [A, F] the target's features of the positions committed since (S..T-2, A = T - 1 - S); tokens [T] the
        text, its last one the root -> the states [K, D] whose ``logits`` draft x_T .. x_{T+K-1} (the last true pair's,
        then the K - 1 masks'); the new pairs and the block join ``cache``."""
        T, A = tokens.shape[0], features.shape[0]
        S, M, device = T - 1 - A, self.config.block_size - 1, tokens.device
        hf.cache_truncate(cache, S)  # the last step's block
        # the new pairs (f_j, x_{j+1}), j = S .. T-2, then the masks at positions T-1 .. T+M-2
        pairs = self.pair_inputs(self.true_features(features)[None], tokens[S + 1:][None])  # [1, A, D]
        inputs = torch.cat([pairs, self.mask.to(pairs.dtype)[None]], dim=1)  # [1, A + M, D]
        positions = torch.arange(S, T - 1 + M, device=device)[None]  # [1, A + M]
        allowed = torch.ones(A + M, S + A + M, dtype=torch.bool)
        allowed[:A, S:] = False
        allowed[:A, S:S + A] = torch.ones(A, A, dtype=torch.bool).tril()  # the new pairs: causal, no mask
        mask = hf.additive_mask(allowed.to(device), self.fc.weight.dtype)  # [1, 1, A + M, S + A + M]
        return self.run(inputs, positions, mask, cache)[0, A - 1:]  # [K, D]

    def run(self, inputs: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
            cache=None) -> torch.Tensor:
        """inputs [B, N, D], position_ids [B, N], mask [B, 1, N, S + N] additive -> outputs [B, N, D] (one decoder
        forward; appends N entries to ``cache`` when one is given)."""
        return run_decoder(self.decoder, inputs, position_ids, mask, cache)

    # ------------------------------------------------------------------------------------------------- training
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The training pass. features [B, T, F] (the target's features at positions 0..T-1), input_ids [B, T],
        lengths [B] (right padding), anchors [B, A] (pair indices, -1: none) -> (pairs [B, n, D]: pair j's output,
        predicting x_{j+2}; blocks [B, A, M, D]: mask i of anchor j's output, predicting x_{j+3+i})."""
        B, T, _ = features.shape
        n, A, M, D = T - 1, anchors.shape[1], self.config.block_size - 1, self.config.hidden_size
        limit = hf.key_limit(self.decoder)
        if limit is not None and n + A * M > limit:
            raise ValueError(f"the block drafter's training pass attends over {n} pairs + {A} x {M} mask queries, but "
                             f"its {self.decoder.config.model_type} layer attends over at most {limit} "
                             f"(max_position_embeddings): lower data.max_length or block.anchors")
        pairs = self.pair_inputs(self.true_features(features[:, :n]), input_ids[:, 1:])  # [B, n, D]
        masks = self.mask.to(pairs.dtype).expand(B, A, M, D).reshape(B, A * M, D)
        offsets = torch.arange(M, device=features.device)
        positions = torch.cat([torch.arange(n, device=features.device).expand(B, n),
                               (anchors.clamp(min=0)[:, :, None] + 1 + offsets).reshape(B, A * M)], dim=1)  # [B, L]
        mask = block_mask(n, anchors, lengths, M, self.fc.weight.dtype)  # [B, 1, L, L]
        out = self.run(torch.cat([pairs, masks], dim=1), positions, mask.to(features.device))  # [B, L, D]
        return out[:, :n], out[:, n:].reshape(B, A, M, D)

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    card_for = staticmethod(block_card)
    read_checkpoint = staticmethod(read_block_checkpoint)


def block_mask(n: int, anchors: torch.Tensor, lengths: torch.Tensor, M: int, dtype: torch.dtype) -> torch.Tensor:
    """The training pass's additive mask [B, 1, L, L] (L = n + A·M): the pairs first, then anchor a's M masks.

    A pair query sees the pairs up to itself; a mask query of anchor j sees the pairs <= j and every mask of its own
    block, nothing of another block. Keys of padding pairs (j >= length - 1) are masked for every query; an absent
    anchor (-1) sees its own block only and is never scored. Every query sees itself (no empty row).
    """
    B, A = anchors.shape
    device = anchors.device
    causal, blocks, eye = block_structure(n, A, M, device)  # [n, n], [A·M, A·M], [L, L]: built once per shape
    pair = torch.arange(n, device=device)
    valid_key = pair[None, :] < (lengths.to(device)[:, None] - 1)  # [B, n] keys of true (not padding) pairs
    sees = (pair[None, None, :] <= anchors[:, :, None]) & valid_key[:, None, :]  # [B, A, n] pairs <= the anchor
    top = torch.cat([causal[None] & valid_key[:, None, :], torch.zeros(B, n, A * M, dtype=torch.bool, device=device)],
                    dim=2)  # [B, n, L] pairs: causal
    bottom = torch.cat([sees.repeat_interleave(M, dim=1), blocks[None].expand(B, -1, -1)], dim=2)  # [B, A·M, L]
    allowed = torch.cat([top, bottom], dim=1) | eye[None]  # [B, L, L]; its own block both ways, itself always
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)  # additive: the decoder may attend eagerly (bool: sdpa only)
    return mask[:, None]


@functools.lru_cache(maxsize=64)
def block_structure(n: int, A: int, M: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_mask``'s parts that are the same for every row, bool on ``device``, built once per (n, A, M, device):
    (causal [n, n] over the pairs, blocks [A·M, A·M] a mask query's own block, eye [L, L]). Read only."""
    pair = torch.arange(n, device=device)
    block = torch.arange(A, device=device).repeat_interleave(M)  # [A·M] the anchor each mask query belongs to
    eye = torch.eye(n + A * M, dtype=torch.bool, device=device)
    return pair[None, :] <= pair[:, None], block[:, None] == block[None, :], eye
