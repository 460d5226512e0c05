"""A DFlash draft in the architecture of vLLM's ``speculators`` library (0.9): what selfspec loads from a speculators
DFlash checkpoint (``--draft DIR`` or a Hub id), trains (train.py ``method: dflash``) and writes back in that format,
drafted by heads/block/drafter.py as a block drafter.

speculators' ``DFlashDraftModel`` (and vLLM's DFlash draft), at the step whose root, the target's newest token x_a,
has no states yet:

    ctx_j = hidden_norm(fc([h_j^(l1), ..., h_j^(lA)]))   [A·D -> D, no bias] the target's aux states at j < a
    block = embed([x_a, m, m, ..., m])                   block_size slots: the anchor, then the mask token m
    per layer:  x = input_layernorm(block)
                q = q_norm(q_proj(x))                    the block's slots only
                k = k_norm(k_proj([ctx; x])), v = v_proj([ctx; x])   ctx enters every layer as it is (no norm)
                rotary: ctx_j at position j, slot i at a + i; every slot sees every ctx and every slot (no mask)
                block = block + o_proj(attn);  block = block + mlp(post_attention_layernorm(block))
    q(x_{a+i}) = lm_head(norm(block_i)), i = 1 .. block_size - 1        [V'] the target's LM head rows, frozen
    draft index k -> target token k + d2t[k]

so one forward drafts K = block_size - 1 tokens, for x_{a+1} .. x_{a+K} (the block offsets 0 .. K-1 of selfspec's
own block drafter, heads/block/model.py, which reads pairs through fc and learned mask vectors instead: one cannot be
written as the other: heads/speculators_export.py says which parts differ). The context's keys and values are the same at
every step for a committed position, so the drafter keeps them (``ContextCache``) and computes the block's alone.

The layers are transformers' Qwen3 decoder layers (``AutoModel.from_config`` of ``DFlashConfig.layer_config``); their
parts are driven by ``_layer`` below (the only code here that speaks to a decoder layer's parts: speculators' layer
computes the context's keys from ctx without the layer norm, which a transformers layer cannot be told); no modeling
file is copied. Tensor names are speculators': the module's state_dict is the checkpoint (the embeddings, which
speculators' loader always reads from the verifier, are neither stored nor read; lm_head is stored with a draft
vocabulary, and is the target's whole LM head without one).

Training (``forward``): every row's anchors j (pair indices, as heads/block/loss.py samples them: the root x_{j+1})
each get a block at positions j+1 .. j+K+1 that sees the context at positions <= j and its own block, as drafting
does; the outputs of slots 1..K are the block offsets 0..K-1 (scored by ``block_loss``).

Shapes: B batch, T time, n = T - 1 context positions, A anchors (training) or aux layers (features), K drafted per
forward, Q block slots in one call, S cached context positions, D hidden size, H_kv key-value heads, d head size,
V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, rotate_half

from heads.block.dflash_config import DFlashConfig
from heads.checkpoints.draft import DraftCheckpoint
from heads.decoder.model import build_decoder
from heads.decoder.speculators import SpeculatorsDraft, load_speculators_state, read_speculators
from selfspec.core.draft_vocab import DraftVocab

IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight")
"""tensors a speculators DFlash checkpoint may carry that change nothing here: its training-only verifier head and
norm, and embeddings (speculators' loader replaces them with the verifier's)."""
OPTIONAL = ("lm_head.weight", "t2d")
"""tensors a checkpoint may leave out: lm_head is then the target's LM head rows of the draft vocabulary (all of it
without one), t2d follows d2t."""


class ContextCache:
    """The committed context's keys and values per draft layer, [1, H_kv, S, d] each (rotated at their positions):
    what every later block attends to. Appended, never cut (only committed positions enter it)."""

    def __init__(self, layers: int):
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.length = 0

    def extend(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = [new if old is None else (torch.cat([old[0], new[0]], 2), torch.cat([old[1], new[1]], 2))
                   for old, new in zip(self.kv, kv)]
        self.length += kv[0][0].shape[2]


def dflash_card(config: DFlashConfig, location: str) -> str:
    return f"""---
library_name: speculators
base_model: {config.verifier}
tags: [speculative-decoding, dflash, block-drafting, speculators, selfspec]
---
# DFlash draft for {config.verifier} (speculators format)

{config.num_layers} Qwen3-style layer(s) over the target's hidden states at layers
{config.aux_hidden_state_layer_ids or 'speculators default'} (as keys and values) and a block of {config.block_size}
slots (the newest token, then {config.drafted} mask tokens), drafting {config.drafted} tokens in one forward over a
{config.draft_vocab_size}-token draft vocabulary (of {config.vocab_size}). The format of vLLM's speculators library
(0.9).

```bash
vllm serve {config.verifier} --speculative-config '{{"model": "{location}", "method": "dflash", "num_speculative_tokens": {config.drafted}}}'
python infer.py --model {config.verifier} --draft {location}
```
"""


def read_dflash_checkpoint(directory: Path) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a speculators DFlash checkpoint, checked against each other
    (heads/decoder/speculators.py ``read_speculators``; ``IGNORED`` tensors dropped, ``OPTIONAL`` ones may be absent)."""
    return read_speculators(directory, "DFlash", DFlashConfig.from_json, IGNORED, OPTIONAL,
                            lambda config, _: DFlashHead(config, nn.Embedding(config.vocab_size, config.hidden_size)))


class DFlashHead(nn.Module, SpeculatorsDraft, DraftCheckpoint):
    """speculators' DFlash draft (see the module docstring): fc, hidden_norm, the layers, the final norm, lm_head (the
    target's rows, frozen) and the draft vocabulary's maps; the target's embeddings and LM head held by reference."""

    WHAT = "speculators DFlash draft"
    SPECULATORS_TYPE = "dflash"
    CONFIG = DFlashConfig
    chained = False
    """no Markov bias or confidence head (speculators' format has neither): the block drafter's plain tree."""

    def __init__(self, config: DFlashConfig, embed: nn.Module, verifier_lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        D, A, V, Vd = config.hidden_size, config.num_features, config.vocab_size, config.draft_vocab_size
        decoder = build_decoder(layer_config)
        self.fc = nn.Linear(A * D, D, bias=False)  # [A·D] -> [D]
        self.hidden_norm = type(decoder.norm)(D, eps=layer_config.rms_norm_eps)
        self.layers = decoder.layers  # registered here, so the tensor names are speculators' (layers.0.self_attn...)
        self.norm = decoder.norm
        self.rotary_emb = decoder.rotary_emb  # moves with the head (no tensors of its own in the checkpoint)
        self.lm_head = nn.Linear(D, Vd, bias=False).requires_grad_(False)  # [D] -> [V'], the target's rows
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long) if Vd < V else None)  # [V'] offsets
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool) if Vd < V else None)  # [V]
        self._frozen = (embed, verifier_lm_head)  # the target's, not registered

    # ----------------------------------------------------------------------------------- what the drafter calls
    @property
    def block_size(self) -> int:
        """K: tokens one forward drafts (speculators' block_size counts the anchor slot too)."""
        return self.config.drafted

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> the target's embeddings [..., D] (a plain lookup, as speculators and vLLM do)."""
        return F.embedding(tokens, self._frozen[0].weight.detach())

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's aux states [..., A·D] (in aux_hidden_state_layer_ids order) -> ctx [..., D]."""
        return self.hidden_norm(self.fc(self.checked_features(features)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [B, S, D] at positions [B, S] -> per layer the keys (normed, rotated) and values, [B, H_kv, S, d]."""
        cos, sin = self.rotary_emb(ctx, positions)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(ctx).unflatten(-1, (-1, attn.head_dim))).transpose(1, 2)
            v = attn.v_proj(ctx).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
            k = k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1)  # apply_rotary_pos_emb's, keys only
            out.append((k, v))
        return out

    def run(self, block: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
            mask: torch.Tensor | None) -> torch.Tensor:
        """block [B, Q, D] (the slots' embeddings) at positions [B, Q] over ``context`` (per layer [B, H_kv, S, d]),
        mask [B, 1, Q, S + Q] bool (True: attend) or None (every slot sees everything) -> the last layer's output
        [B, Q, D]."""
        cos, sin = self.rotary_emb(block, positions)
        for layer, kv in zip(self.layers, context):
            block = _layer(layer, block, kv, cos, sin, mask)
        return block

    def block(self, cache: ContextCache, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One drafting forward. cache holds the context of positions 0..S-1; features [T-1-S, A·D] the target's aux
        states of the positions committed since (S..T-2); tokens [T] the text, its last one the root -> the states
        [K, D] whose ``logits`` draft x_T .. x_{T+K-1}; the new positions join ``cache``."""
        T, S = tokens.shape[0], cache.length
        device = tokens.device
        ctx = self.true_features(features)[None]  # [1, T-1-S, D]
        cache.extend(self.context_kv(ctx, torch.arange(S, T - 1, device=device)[None]))
        ids = torch.full((1, self.block_size + 1), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = tokens[-1]
        positions = torch.arange(T - 1, T + self.block_size, device=device)[None]  # [1, K + 1]
        out = self.run(self.embed(ids).to(self.fc.weight.dtype), positions, cache.kv, None)
        return out[0, 1:]

    def new_cache(self) -> ContextCache:
        return ContextCache(len(self.layers))

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """What ``block`` returned [..., D] -> draft-vocabulary logits [..., V'] (lm_head after the final norm)."""
        return self.lm_head(self.norm(states).to(self.lm_head.weight.dtype))

    def base_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids (k + d2t[k])."""
        return index if self.d2t is None else index + self.d2t.to(index.device)[index]

    # ---------------------------------------------------------------------- training (train.py, method dflash)
    @property
    def verifier_lm_head(self) -> nn.Module:
        """The target's LM head (frozen, held by reference): what the loss distils from."""
        if self._frozen[1] is None:
            raise ValueError("this DFlash draft was built without its target's LM head: build it with on_base")
        return self._frozen[1]

    @property
    def draft_vocab(self) -> DraftVocab:
        """The draft vocabulary as the training loss reads it (heads/block/loss.py): its target ids and the target's
        LM head on their rows. A view of d2t, so it follows a resumed run's buffers."""
        vocab = DraftVocab(self.config.draft_vocab_size, self.config.vocab_size)
        vocab.tokens = self.base_ids(torch.arange(self.config.draft_vocab_size, device=self.fc.weight.device))
        return vocab

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                anchors: torch.Tensor) -> tuple[None, torch.Tensor]:
        """The training pass. features [B, T, A·D] (the target's aux states at 0..T-1), input_ids [B, T], lengths [B]
        (right padding), anchors [B, A] (pair indices j, the root x_{j+1}; -1: none) -> (None: DFlash has no pair
        outputs; blocks [B, A, K, D]: slot 1 + k of anchor j's block, predicting x_{j+2+k}, block offset k)."""
        B, T, _ = features.shape
        n, A, K, D = T - 1, anchors.shape[1], self.block_size, self.config.hidden_size
        device = features.device
        ctx = self.true_features(features[:, :n])  # [B, n, D]
        context = self.context_kv(ctx, torch.arange(n, device=device).expand(B, n))
        roots = input_ids.gather(1, anchors.clamp(min=0) + 1)  # [B, A] x_{j+1}
        ids = torch.full((B, A, K + 1), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[:, :, 0] = roots
        slots = torch.arange(K + 1, device=device)
        positions = (anchors.clamp(min=0)[:, :, None] + 1 + slots).reshape(B, A * (K + 1))  # [B, Q]
        mask = dflash_mask(n, anchors, lengths, K + 1).to(device)  # [B, 1, Q, n + Q]
        out = self.run(self.embed(ids).to(ctx.dtype).reshape(B, A * (K + 1), D), positions, context, mask)
        return None, out.reshape(B, A, K + 1, D)[:, :, 1:]

    # ---------------------------------------------------------------------------------------------------- storage
    @staticmethod
    def card_for(config: DFlashConfig, location: str) -> str:
        return dflash_card(config, location)

    read_checkpoint = staticmethod(read_dflash_checkpoint)

    def init_lm_head(self) -> None:
        """lm_head := the target's LM head rows of the draft vocabulary (speculators' loader does the same)."""
        tokens = self.base_ids(torch.arange(self.config.draft_vocab_size))
        with torch.no_grad():
            weight = self.verifier_lm_head.weight.detach()
            self.lm_head.weight.copy_(weight[tokens.to(weight.device)].to(self.lm_head.weight))

    @classmethod
    def on_base(cls, config: DFlashConfig, base_model: PreTrainedModel) -> "DFlashHead":
        return cls(config.on_model(base_model), base_model.get_input_embeddings(), base_model.get_output_embeddings())

    def saved_state(self) -> dict[str, torch.Tensor]:
        """As speculators 0.9 saves a DFlash draft: lm_head only with a draft vocabulary (without one it is the
        target's)."""
        return {k: v for k, v in self.state_dict().items() if k != "lm_head.weight" or self.d2t is not None}

    @classmethod
    def loaded(cls, config: DFlashConfig, tensors: dict[str, torch.Tensor],
               base_model: PreTrainedModel) -> "DFlashHead":
        """A speculators DFlash checkpoint's tensors on ``base_model``, completed as speculators' loader completes
        them (``load_speculators_state``)."""
        return load_speculators_state(cls.on_base(config, base_model), tensors, base_model)


def _layer(layer: nn.Module, block: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], cos: torch.Tensor,
           sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """speculators' DFlash decoder layer over a transformers Qwen3 layer's parts: block [B, Q, D] attends to the
    context's keys / values ``kv`` [B, H_kv, S, d] and to its own slots -> [B, Q, D]."""
    attn = layer.self_attn
    x = layer.input_layernorm(block)
    q = attn.q_norm(attn.q_proj(x).unflatten(-1, (-1, attn.head_dim))).transpose(1, 2)  # [B, H, Q, d]
    k = attn.k_norm(attn.k_proj(x).unflatten(-1, (-1, attn.head_dim))).transpose(1, 2)  # [B, H_kv, Q, d]
    v = attn.v_proj(x).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)  # [B, H_kv, S + Q, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    block = block + attn.o_proj(out.transpose(1, 2).flatten(2))
    return block + layer.mlp(layer.post_attention_layernorm(block))


def dflash_mask(n: int, anchors: torch.Tensor, lengths: torch.Tensor, slots: int) -> torch.Tensor:
    """The training pass's mask [B, 1, Q, n + Q] (Q = A·slots; True: attend): anchor j's block sees the context at
    positions <= j that lie in the row (< length) and every slot of its own block, nothing of another block; an absent
    anchor (-1) sees its own block only and is never scored."""
    B, A = anchors.shape
    device = anchors.device
    position = torch.arange(n, device=device)
    sees = (position[None, None, :] <= anchors[:, :, None]) & \
        (position[None, None, :] < lengths.to(device)[:, None, None])  # [B, A, n]
    allowed = torch.cat([sees.repeat_interleave(slots, dim=1),  # [B, Q, n]
                         own_blocks(A, slots, device)[None].expand(B, -1, -1)], dim=2)  # [B, Q, n + Q]
    return allowed[:, None]


@functools.lru_cache(maxsize=64)
def own_blocks(A: int, slots: int, device: torch.device) -> torch.Tensor:
    """bool [Q, Q] (Q = A·slots) on ``device``, built once per shape: each slot sees every slot of its own block.
    Read only."""
    block = torch.arange(A, device=device).repeat_interleave(slots)  # [Q] the anchor each slot belongs to
    return block[:, None] == block[None, :]
