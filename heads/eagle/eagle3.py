"""An EAGLE-3 draft in the architecture of vLLM's ``speculators`` library (0.9): what selfspec loads from a
speculators checkpoint (``--draft DIR`` or a Hub id) and writes back in that format, drafted by heads/eagle/drafter.py.

speculators' ``Eagle3DraftModel`` at inference (and vLLM's ``Eagle3LlamaForCausalLM``), step by step:

    g_j  = fc([norm?(h_j^(l1)), norm?(h_j^(l2)), ...])        [A·D -> D, no bias]  the target's aux states at j
    pair j: x = [e(x_{j+1}), g_j]                             [2D]: the embedding FIRST, then the features
    first layer: r = g (or hidden_norm(g): norm_before_residual)
                 a = attn([input_layernorm(e), hidden_norm(g)])   q/k/v read 2D; the rest of the layer as usual
                 o = r + a;  o = o + mlp(post_attention_layernorm(o))
    more layers: ordinary decoder layers of width D
    f̂_{j+1} = the last layer's output (pre-norm); q(x_{j+2}) = lm_head(norm(f̂))   [V'] the draft's OWN lm_head
    next pair:  (f̂_{j+1}, e(x̂_{j+2})), or (norm(f̂), ...) with norm_output (speculators' "Eagle 3.1")
    draft index k -> target token k + d2t[k]

selfspec's own EAGLE head (heads/eagle/model.py) computes something else: fc([e, f]) [2D -> D, with bias] before an
ordinary decoder layer, whose final-norm output is both read by the LM head and fed back; one cannot be written as the
other (heads/speculators_export.py refuses the export, saying so). Both are drafted by the same ``EagleDrafter``, through
the same few calls: ``true_features``, ``step``, ``logits``, ``base_ids``.

The decoder is transformers' model of transformer_layer_config's kind (``AutoModel.from_config``, Llama or Qwen3), its
first layer wrapped by ``FirstLayer`` (the only code here that speaks to a decoder layer's parts); no modeling file is
copied. The embeddings are the target's (a plain lookup, as in speculators and vLLM) unless the checkpoint stores
other ones in ``embed_tokens.weight`` (a save writes the target's there, as speculators does); lm_head is the
checkpoint's, or the target's LM head rows of the draft vocabulary where the checkpoint has none (as speculators'
loader fills it). Tensor names are speculators': the module's state_dict is the checkpoint. What it shares with
speculators' DFlash draft (its features through fc, d2t / t2d, reading and loading a checkpoint) is
heads/decoder/speculators.py's ``SpeculatorsDraft``.

selfspec trains such a draft too (train.py ``method: eagle3``, heads/eagle/kind.py ``Eagle3Kind``): ``forward`` is the
EAGLE head's training unroll (heads/eagle/model.py ``unrolled``) through ``true_features`` and ``step``, scored by the
EAGLE head's loss on ``draft_vocab`` (a view of d2t) against ``verifier_lm_head`` (the target's, held by reference);
``lm_head`` starts as the target's rows of the draft vocabulary (``init_lm_head``) and trains. What it saves is the
speculators checkpoint itself.

Shapes: B batch, N positions, D hidden size, A aux layers, V target vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from heads.checkpoints.draft import DraftCheckpoint
from heads.decoder.model import build_decoder, run_decoder
from heads.decoder.speculators import SpeculatorsDraft, load_speculators_state, read_speculators
from heads.eagle.model import unrolled
from heads.eagle.speculators_config import Eagle3Config
from selfspec.core.draft_vocab import DraftVocab

TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")
"""tensors some speculators checkpoints carry for training (the target's own head and norm): ignored."""
OPTIONAL = ("lm_head.weight", "t2d")
"""tensors a checkpoint may leave out: lm_head is then the target's rows of the draft vocabulary, t2d follows d2t."""


class FirstLayer(nn.Module):
    """speculators' EAGLE-3 first layer (``Eagle3FirstLayerMixin``) over a transformers decoder layer's own parts: it
    reads [embedding, features] [B, N, 2D], normalises each half by its own norm, attends with q/k/v over the 2D, and
    keeps the features (or their norm) as the residual."""

    def __init__(self, layer: nn.Module, config, norm_before_residual: bool):
        super().__init__()
        D = config.hidden_size
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.hidden_norm = type(layer.input_layernorm)(D, eps=config.rms_norm_eps)
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self.self_attn, name, nn.Linear(2 * D, getattr(self.self_attn, name).out_features, bias=bias))
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache: bool = False, position_embeddings=None, **kwargs) -> torch.Tensor:
        embeds, features = hidden_states.chunk(2, dim=-1)  # [B, N, D] each
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, N, 2D]
        x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                              use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        x = residual + x
        return x + self.mlp(self.post_attention_layernorm(x))


def read_eagle3_checkpoint(directory: Path) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """config.json and model.safetensors of a speculators EAGLE-3 checkpoint, checked against each other
    (``read_speculators``; ``TRAINING_ONLY`` tensors dropped, ``OPTIONAL`` ones may be absent). Strict."""
    return read_speculators(
        directory, "EAGLE-3", Eagle3Config.from_json, TRAINING_ONLY, OPTIONAL,
        lambda config, tensors: Eagle3Head(config, nn.Embedding(config.vocab_size, config.hidden_size),
                                           own_embedding="embed_tokens.weight" in tensors))


def eagle3_card(config: Eagle3Config, location: str) -> str:
    return f"""---
library_name: speculators
base_model: {config.verifier}
tags: [speculative-decoding, eagle3, speculators, selfspec]
---
# EAGLE-3 draft for {config.verifier} (speculators format)

{config.num_layers} decoder layer(s) ({config.transformer_layer_config['model_type']}) over the target's hidden
states at layers {config.eagle_aux_hidden_state_layer_ids or 'speculators default'} and its token embeddings, drafting
over a {config.draft_vocab_size}-token draft vocabulary (of {config.vocab_size}), {config.speculative_tokens} tokens per
step. The format of vLLM's speculators library (0.9): vLLM and speculators load it as it is.

```bash
vllm serve {config.verifier} --speculative-config '{{"model": "{location}", "method": "eagle3", "num_speculative_tokens": {config.speculative_tokens}}}'
python infer.py --model {config.verifier} --draft {location}
```
"""


class Eagle3Head(nn.Module, SpeculatorsDraft, DraftCheckpoint):
    """speculators' EAGLE-3 draft (see the module docstring): fc, the decoder layers, the final norm, its own lm_head
    and the draft vocabulary's maps; the target's embeddings held by reference unless the checkpoint has its own."""

    WHAT = "speculators EAGLE-3 draft"
    SPECULATORS_TYPE = "eagle3"
    CONFIG = Eagle3Config

    def __init__(self, config: Eagle3Config, embed: nn.Module, own_embedding: bool = False,
                 verifier_lm_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        D, A, V, Vd = config.hidden_size, config.num_features, config.vocab_size, config.draft_vocab_size
        decoder_config = config.layer_config()
        decoder_config.vocab_size = 1  # the decoder reads the embeddings it is given (no V x D table of its own)
        decoder = build_decoder(decoder_config)
        decoder.embed_tokens = None
        Norm = type(decoder.norm)
        self.embed_tokens = nn.Embedding(V, D) if own_embedding else None
        self.input_norm = Norm(A * D, eps=layer_config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList([Norm(D, eps=layer_config.rms_norm_eps) for _ in range(A)]) if config.fc_norm else None
        self.fc = nn.Linear(A * D, D, bias=False)  # [A·D] -> [D]
        decoder.layers[0] = FirstLayer(decoder.layers[0], layer_config, config.norm_before_residual)
        self.layers = decoder.layers  # registered here, so the tensor names are speculators' (layers.0.hidden_norm...)
        self.norm, decoder.norm = decoder.norm, nn.Identity()  # the decoder returns the pre-norm state
        self.rotary_emb = decoder.rotary_emb  # moves with the head (no tensors of its own in the checkpoint)
        self._decoder = (decoder,)  # a tuple: its modules are registered above, under speculators' names
        self.lm_head = nn.Linear(D, Vd, bias=False)  # [D] -> [V']
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long) if Vd < V else None)  # [V'] offsets
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool) if Vd < V else None)  # [V]
        self._frozen = (embed, verifier_lm_head)  # the target's, not registered (save_pretrained writes embed)

    # ----------------------------------------------------------------------------------- what the drafter calls
    @property
    def decoder(self) -> nn.Module:
        """transformers' decoder model these layers run in (its config sizes the drafter's KV cache)."""
        return self._decoder[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [...] -> [..., D]: the checkpoint's embeddings, or the target's (a plain lookup, no scale)."""
        weight = self.embed_tokens.weight if self.embed_tokens is not None else self._frozen[0].weight
        return F.embedding(tokens, weight.detach())

    def true_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's aux states [..., A·D] (in eagle_aux_hidden_state_layer_ids order) -> g [..., D]."""
        x = self.checked_features(features)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(x)

    def step(self, features: torch.Tensor, tokens: torch.Tensor, position_ids: torch.Tensor,
             mask: torch.Tensor | None, cache) -> torch.Tensor:
        """features [B, N, D], tokens [B, N], position_ids [B, N], mask [B, 1, N, S + N] additive or None (causal) ->
        what the next pair reads [B, N, D] (pre-norm, or normed with norm_output); appends N entries to ``cache``."""
        dtype = self.fc.weight.dtype
        x = torch.cat([self.embed(tokens).to(dtype), features.to(dtype)], dim=-1)  # [B, N, 2D]: embedding first
        out = run_decoder(self.decoder, x, position_ids, mask, cache)
        return self.norm(out) if self.config.norm_output else out

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """What ``step`` returned [..., D] -> draft-vocabulary logits [..., V'] (its own lm_head, after the norm)."""
        x = features if self.config.norm_output else self.norm(features)
        return self.lm_head(x.to(self.lm_head.weight.dtype))

    def base_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids (k + d2t[k])."""
        return index if self.d2t is None else index + self.d2t.to(index.device)[index]

    # ------------------------------------------------------------------------- training (train.py, method eagle3)
    @property
    def verifier_lm_head(self) -> nn.Module:
        """The target's LM head (frozen, held by reference): what the loss distils from (speculators'
        ``verifier_lm_head``). Heads built by ``on_base`` hold it."""
        if self._frozen[1] is None:
            raise ValueError("this EAGLE-3 draft was built without its target's LM head: build it with on_base")
        return self._frozen[1]

    @property
    def draft_vocab(self) -> DraftVocab:
        """The draft vocabulary as the training loss reads it (heads/eagle/loss.py): its target ids (k + d2t[k], or
        every id) and the target's LM head on their rows. A view of d2t, so it follows a resumed run's buffers."""
        vocab = DraftVocab(self.config.draft_vocab_size, self.config.vocab_size)
        device = self.lm_head.weight.device
        vocab.tokens = self.base_ids(torch.arange(self.config.draft_vocab_size, device=device))
        return vocab

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, unroll: int) -> torch.Tensor:
        """The training unroll (heads/eagle/model.py ``unrolled``), through this draft's own ``true_features`` and
        ``step``: [U, B, n, D], each what ``step`` returns (the pre-norm state, or the normed one with norm_output)."""
        return unrolled(self, features, input_ids, lengths, unroll)

    def init_lm_head(self) -> None:
        """lm_head := the target's LM head rows of the draft vocabulary (what speculators' trainer starts from, and
        what its loader fills in where a checkpoint has no lm_head)."""
        tokens = self.base_ids(torch.arange(self.config.draft_vocab_size))
        with torch.no_grad():
            rows = self.verifier_lm_head.weight.detach()[tokens.to(self.verifier_lm_head.weight.device)]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    # ---------------------------------------------------------------------------------------------------- storage
    card_for = staticmethod(eagle3_card)
    read_checkpoint = staticmethod(read_eagle3_checkpoint)

    @classmethod
    def on_base(cls, config: Eagle3Config, base_model: PreTrainedModel, own_embedding: bool = False) -> "Eagle3Head":
        return cls(config.on_model(base_model), base_model.get_input_embeddings(), own_embedding=own_embedding,
                   verifier_lm_head=base_model.get_output_embeddings())

    def saved_state(self) -> dict[str, torch.Tensor]:
        """As speculators 0.9 saves an EAGLE-3 draft: the embeddings too (the target's, where the draft has none of
        its own), since its loader leaves embed_tokens uninitialised when a checkpoint lacks it (transformers allocates
        the missing tensor empty, and the verifier's weights replace only NaN ones)."""
        state = self.state_dict()
        state.setdefault("embed_tokens.weight", self._frozen[0].weight.detach())
        return state

    @classmethod
    def loaded(cls, config: Eagle3Config, tensors: dict[str, torch.Tensor],
               base_model: PreTrainedModel) -> "Eagle3Head":
        """A speculators EAGLE-3 checkpoint's tensors on ``base_model``: stored embeddings equal to the target's are
        held by reference, not copied; then completed as speculators' loader completes them
        (``load_speculators_state``)."""
        embed = base_model.get_input_embeddings().weight
        stored = tensors.get("embed_tokens.weight")
        if stored is not None and torch.equal(stored.to(embed.device, embed.dtype), embed.detach()):
            del tensors["embed_tokens.weight"]  # the target's own (as exports write them): held by reference
        head = cls.on_base(config, base_model, own_embedding="embed_tokens.weight" in tensors)
        return load_speculators_state(head, tensors, base_model)
