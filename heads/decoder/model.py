"""A light decoder of the target's own architecture over the target's features, as the EAGLE head
(heads/eagle/model.py ``EagleHead``) and the block drafter (heads/block/model.py ``BlockHead``) both build it:
``DecoderHead``, their shared pieces, and what reading and carding their checkpoints share.

Pair j of what the decoder reads is the target's feature at j (its final hidden state f_j, the LM head's input, or with
``feature_layers`` an EAGLE-3 fusion of several layers' states) and the embedding of the token that followed, x_{j+1}:

    (f_j, e(x_{j+1})) ─ fc [2D -> D] ─ decoder layer(s), causal over the pairs ─▶ [D] ─ LM head on V' ─▶ logits

The decoder layer is the target architecture's own (``build_decoder``: transformers' ``AutoModel.from_config`` of the
target's config cut to ``num_layers`` layers and no vocabulary, heads/decoder/config.py ``decoder_config``): no modeling
file is copied. The embeddings and the LM head are the target's, frozen and held by reference (never stored). The LM
head is read on a **draft vocabulary** only (``DraftVocab``: the ``draft_vocab_size`` tokens most frequent in the
training data). What the heads do with these pieces (an unroll of drafting steps, a block of mask queries), their
cards and their checkpoints' draft types are their own.

Shapes: B batch, N positions in one call, S cached positions, D hidden size, L feature layers, F the head's input
feature width (D, or L·D with feature_layers), V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel

from heads.checkpoints.draft import DraftCheckpoint
from heads.checkpoints.files import read_typed_checkpoint
from heads.decoder.config import check_feature_layers
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


def read_head_checkpoint(directory: Path, draft_type: str, what: str, config_class: type, head_class: type,
                         upgrade=None) -> tuple[Any, dict[str, torch.Tensor]]:
    """A checkpoint of a head built on DecoderHead (EAGLE heads, block drafters): its strict config, its tensors checked
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


class DecoderHead(nn.Module, DraftCheckpoint):
    """fc + a ``num_layers``-layer decoder of the base's architecture (+ the fusion of ``feature_layers``) + the draft
    vocabulary's token ids: what the EAGLE head and the block drafter share (each declares its own ``WHAT``,
    ``DRAFT_TYPE``, training ``forward``, card and checkpoint reader).

    ``step`` is one decoder call over pairs, through the head's own KV cache; ``logits`` reads the target's LM head on
    the draft vocabulary.
    """

    def __init__(self, config: Any, embed: nn.Module, lm_head: nn.Module):
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
            raise ValueError(f"{self.WHAT}: expected target features of width {self.feature_width} (hidden size "
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

    # -------------------------------------------------------------- storage (heads.checkpoints.draft.DraftCheckpoint)
    @classmethod
    def on_base(cls, config: Any, base_model: PreTrainedModel) -> "DecoderHead":
        check_feature_layers(config.feature_layers, base_model)
        return cls(config, base_model.get_input_embeddings(), base_model.get_output_embeddings())


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
