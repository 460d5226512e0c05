"""The target model: prefill a prompt, verify a token tree in one forward, commit the accepted path to the cache.

Works for any transformers decoder-only model through its public forward: an additive 4D attention mask (each tree node
attends to the whole cache and to its own ancestors), explicit position ids (cache length + node depth) and the HF
cache. A chain (or the root alone) is plain causal attention, so it goes without a custom mask, exactly as plain
decoding does. No modeling files are copied.

Batches (selfspec/core/batch.py): ``verify_rows`` verifies one tree per sequence of a batch in one forward, each row of
the cache (``hf.rows_cache``) holding one sequence's text in its first ``lengths[b]`` slots, and ``commit_rows`` keeps
each row's accepted path.

Shapes: B sequences, S cached length (slots), N tree nodes, V vocabulary, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from selfspec.core import compiled, hf
from selfspec.core.tree import Tree


@dataclass(frozen=True)
class Verified:
    logits: torch.Tensor
    """[N, V] the target's next-token logits after each tree node ([1, V]: after the prompt's last token, for a prefill;
    [T, V] after each prompt token, for a prefill asked for every logit; [0, V]: a verify without the LM head)."""
    hidden: torch.Tensor
    """[N, D] the target's final hidden state at each tree node (at every prompt position, for a prefill)."""
    states: tuple[torch.Tensor, ...] | None = None
    """L + 1 tensors [N, D]: the hidden states at every layer at the same positions (0 the embeddings, i decoder layer
    i's output, -1 = ``hidden``), what an EAGLE-3 head fuses; None from verifiers that do not run every layer."""


class Target:
    """A frozen decoder-only causal LM with the three operations speculative decoding needs."""

    def __init__(self, model: PreTrainedModel):
        if not isinstance(model, PreTrainedModel) or not hasattr(model, "get_output_embeddings"):
            raise TypeError(f"expected a transformers causal LM (PreTrainedModel), found {type(model).__name__}")
        if getattr(model.config, "is_encoder_decoder", False):
            raise TypeError(
                f"expected a decoder-only causal LM, found encoder-decoder {type(model).__name__} "
                f"(model_type={model.config.model_type!r})"
            )
        if model.get_output_embeddings() is None:
            raise TypeError(f"expected a causal LM with an LM head, found {type(model).__name__} without one")
        if not model.can_generate():  # e.g. BertForMaskedLM: an LM head, but bidirectional attention
            raise TypeError(
                f"expected a causal LM that transformers can generate with (a ...ForCausalLM), found "
                f"{type(model).__name__} (model_type={model.config.model_type!r}), which cannot generate"
            )
        reason = hf.unverifiable(model)
        if reason is not None:
            raise TypeError(f"selfspec cannot decode this model: {reason}. Supported: decoders whose layers all attend "
                            "with rotary or learned positions (Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-2, ...)")
        self.model = model.eval()
        cfg = model.config.get_text_config()
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.hidden_size: int = model.get_output_embeddings().weight.shape[1]
        """D of the final hidden state, the LM head's input (OPT-350m projects its 1,024-wide layers to 512)."""
        self.max_length: int = int(
            getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2**31
        )
        self.window_limit: int | None = hf.window_limit(model)
        """prompt + new tokens must stay inside this sliding window (None: no limit; see hf.window_limit)."""
        self._mask_dtype = next(model.parameters()).dtype
        self._head: tuple[torch.Tensor, torch.Tensor | None] | None | bool = False  # False: not checked yet

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> Cache:
        return hf.new_cache(self.model)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: Cache, every_logit: bool = False) -> Verified:
        """input_ids [T] -> logits [1, V] at the last prompt position ([T, V] at every one with every_logit, for the
        prompt's own log-probabilities), hidden [T, D] at every one (what a sequential draft head reads); the cache
        then holds T entries."""
        start = hf.cache_length(cache)
        positions = torch.arange(start, start + input_ids.shape[0], device=input_ids.device)
        with compiled.eager(self.model):  # a compiled target's one graph is the verify step's
            logits, states = hf.forward(self.model, input_ids, positions, None, cache,
                                        logits_to_keep=0 if every_logit else 1)
        return Verified(logits=logits, hidden=states[-1], states=states)

    @torch.inference_mode()
    def plain_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The LM head's weight [V, D] and bias [V] or None when its output on the final hidden state is exactly the
        model's logits (checked once, on a two-token forward: no soft-capping or scaling after it) and the forward is
        not compiled, so that ``selfspec.core.head_rows`` may compute the logits of some nodes only; else None."""
        if self._head is False:
            head = self.model.get_output_embeddings()
            self._head = None
            if isinstance(head, torch.nn.Linear) and not compiled.is_compiled(self.model):
                ids = torch.tensor([[0, min(1, self.vocab_size - 1)]], device=self.device)
                out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False, return_dict=True)
                mine = F.linear(out.hidden_states[-1], head.weight, head.bias)
                if out.logits.shape == mine.shape and torch.equal(out.logits.to(mine.dtype), mine):
                    self._head = (head.weight, head.bias)
        return self._head

    @torch.inference_mode()
    def verify(self, tree: Tree, tokens: torch.Tensor, cache: Cache, logits: bool = True) -> Verified:
        """tokens [N] laid out as ``tree`` (tokens[0] = root) -> logits [N, V], hidden [N, D]; adds N cache entries.
        logits False: no LM head at all (``Verified.logits`` [0, V]), for ``head_rows`` to run it where needed."""
        start = hf.cache_length(cache)
        n = len(tree)
        if tokens.shape != (n,):
            raise ValueError(f"expected {n} tree tokens (one per node), found shape {tuple(tokens.shape)}")
        device = tokens.device
        one_graph = compiled.is_compiled(self.model)  # every step in one form: a mask, 2+ nodes (compiled.py)
        if one_graph:
            hf.contiguous(cache)  # a crop's view would be another graph
            # a lone root gets a padding child, dropped by ``commit``; an inference tensor either way, as the cache's
            tree, tokens = (Tree.chain(1), tokens.repeat(2)) if n == 1 else (tree, tokens.clone())
        mask = None  # a chain is plain causal attention: let the model build its own mask, as in plain decoding
        if not tree.is_chain or one_graph:
            allowed = torch.cat(
                [torch.ones(len(tree), start, dtype=torch.bool, device=device), tree.on(device).ancestors], dim=1
            )  # [N, S + N]
            mask = hf.additive_mask(allowed, self._mask_dtype)  # [1, 1, N, S + N]
        positions = start + tree.on(device).depth  # [N]
        keep = 0 if logits else torch.zeros(0, dtype=torch.long, device=device)  # 0: every position's logits
        out, states = hf.forward(self.model, tokens, positions, mask, cache, logits_to_keep=keep)
        if len(tokens) > n:  # the padding's outputs mean nothing
            out, states = out[:n], tuple(h[:n] for h in states)
        return Verified(logits=out, hidden=states[-1], states=states)

    @torch.inference_mode()
    def verify_rows(self, trees: list[Tree], tokens: list[torch.Tensor], cache: Cache, lengths: list[int],
                    logits: bool = True) -> Verified:
        """One tree per row of a batch's cache (row b's text in its first lengths[b] slots), tokens[b] [N_b] laid out
        as trees[b] -> logits [B, N, V] ([B, 0, V] with ``logits`` False), hidden [B, N, D], states L + 1 x [B, N, D],
        N = max N_b (rows padded: the padding's outputs mean nothing); adds N slots to every row.

        Row b's node i attends to its row's text and to its own ancestors, at position lengths[b] + depth; a padding
        node to itself alone. One row whose text fills the cache and whose tree is a chain goes without a mask, as
        ``verify`` does."""
        start, b, n = hf.cache_length(cache), len(trees), max(len(t) for t in trees)
        one_graph = compiled.is_compiled(self.model)  # a compiled target's steps in one form, as in ``verify``
        if one_graph:  # a mask always, 2+ nodes, a contiguous cache (joined, dropped and kept rows leave views)
            n = max(n, 2)
            hf.contiguous(cache)
        device = self.device
        ids = torch.zeros(b, n, dtype=torch.long, device=device)
        positions = torch.tensor(lengths, device=device)[:, None].repeat(1, n)  # [B, N]; padding at its row's end
        plain = b == 1 and lengths[0] == start and trees[0].is_chain and not one_graph  # no mask to build
        allowed = None if plain else torch.zeros(b, n, start + n, dtype=torch.bool, device=device)  # [B, N, S + N]
        if allowed is not None:
            allowed[:, :, start:] = torch.eye(n, dtype=torch.bool, device=device)
        for row, (tree, toks, length) in enumerate(zip(trees, tokens, lengths)):
            if toks.shape != (len(tree),):
                raise ValueError(f"row {row}: expected {len(tree)} tree tokens (one per node), found shape "
                                 f"{tuple(toks.shape)}")
            k = len(tree)
            ids[row, :k] = toks
            positions[row, :k] += tree.on(device).depth
            if allowed is not None:
                allowed[row, :k, :length] = True
                allowed[row, :k, start: start + k] = tree.on(device).ancestors
        mask = None if allowed is None else hf.additive_mask(allowed, self._mask_dtype)  # [B, 1, N, S + N]
        out, states = hf.forward_rows(self.model, ids, positions, mask, cache, logits)
        return Verified(logits=out, hidden=states[-1], states=states)

    @torch.inference_mode()
    def commit_rows(self, cache: Cache, start: int, lengths: list[int], paths: list[tuple[int, ...]]) -> list[int]:
        """After ``verify_rows`` of trees from slot ``start``: row b keeps its accepted path (node indices, root first)
        right after its lengths[b] entries; the rows' new lengths."""
        return hf.keep_rows(cache, start, lengths, [torch.tensor(p, dtype=torch.long) for p in paths])

    @torch.inference_mode()
    def commit(self, cache: Cache, start: int, path: tuple[int, ...]) -> None:
        """Keep in the cache only the accepted path of the tree verified from position ``start``."""
        hf.cache_keep(cache, start, torch.tensor(path, dtype=torch.long))
        hf.slide(cache)  # sliding-window layers drop what no later query can see
