"""Early-exit drafting: the target drafts with its first E layers, then its own final norm and LM head.

    draft   x0 ─ layers 0..E-1 ─ [exit head] ─ final norm ─ LM head ─▶ d1 ─ layers 0..E-1 ─ ... ─▶ dk
    verify  layers 0..E-1 are already done for x0, d1..d(k-1) while drafting: only dk needs them; then layers E..L-1
            for the whole chain (LayerSkip's forward_early / forward_remainder split)

An exit head (optional, trained elsewhere) maps layer E's input hidden state [.., D] to a hidden state [.., D] that
the final norm and LM head read; without one, layer E's input goes to them directly. An exit head with a draft
vocabulary drafts from its V' rows of the LM head only (``PartialModelDrafter``). Drafting uses the
confidence stop and the static or dynamic tree of ``PartialModelDrafter`` (a chain by default).

KV reuse: the first E layers see the same inputs in drafting and in verification, so the KV entries and layer-E inputs
drafting computes are the ones a full forward computes. ``EarlyExitDrafter`` keeps them (``EarlyWork``) and leaves the
cache as it found it; ``EarlyExitTarget`` is a ``Target`` whose ``verify`` takes that work for a chain draft: it appends
the kept entries, runs layers 0..E-1 only for tokens not yet seen, then layers E..L-1 from the kept hidden states.
Anything else (a tree, another start) is verified by the full forward. Equal to the full forward up to float
rounding (one-token vs batched matmuls), like any batched verification.

Shapes: S cached length, M tokens fed while drafting, N verified tokens, D hidden size, V vocabulary,
B batch (1), H kv heads, hd head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Cache

from selfspec.core import hf
from selfspec.core.drafter import Draft, DraftKind, DraftState
from selfspec.drafts.layerskip import PartialModelDrafter, draft_tree
from selfspec.core.target import Target, Verified
from selfspec.core.tree import DynamicTree, Tree


def check_exit_layer(exit_layer: int, num_layers: int) -> int:
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= num_layers - 1:
        raise ValueError(
            f"exit layer must be in 1..{num_layers - 1} (draft with the first E of this model's {num_layers} layers), "
            f"found {exit_layer!r}"
        )
    return exit_layer


@dataclass(frozen=True)
class EarlyWork:
    """What drafting computed in layers 0..E-1, for verification to reuse."""

    start: int
    """cache length when drafting began (the root's position)."""
    tokens: torch.Tensor
    """[M] the tokens fed through layers 0..E-1, the root first."""
    hidden: torch.Tensor
    """[M, D] their output of layer E-1 (the input of layer E)."""
    keys: tuple[torch.Tensor, ...]
    """per layer 0..E-1: [B, H, M, hd] their key entries."""
    values: tuple[torch.Tensor, ...]


class EarlyExitDrafter(PartialModelDrafter):
    """Drafts with layers 0..exit_layer-1 (+ exit_head): a chain of ``depth`` tokens, the given static tree, or a
    dynamic tree (verified by the full forward: only chains reuse the early layers' work)."""

    def __init__(self, target: Target, exit_layer: int, depth: int = 4, tree: Tree | DynamicTree | None = None,
                 stop_below: float = 0.0, exit_head: torch.nn.Module | None = None):
        num_layers = len(hf.decoder_layers(target.model))
        self.exit_layer = check_exit_layer(exit_layer, num_layers)
        replace: dict[int, torch.nn.Module] = {i: hf.Passthrough() for i in range(exit_layer, num_layers)}
        if exit_head is not None:
            replace[exit_layer] = hf.Apply(exit_head)
        vocab = getattr(exit_head, "draft_vocab", None)  # an exit head trained with a draft vocabulary drafts from it
        super().__init__(target, replace, draft_tree(tree, depth), stop_below,
                         vocab=vocab if vocab is not None and vocab.size is not None else None)
        self.exit_head = exit_head
        self.last_work: EarlyWork | None = None
        """the early layers' work of the last chain draft (None after a tree draft, or once a verify took it)."""

    def verifier(self) -> "EarlyExitTarget":
        """The target verifying this drafter's chains with the early layers' work reused (``verifier_for``)."""
        return EarlyExitTarget(self)

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        start = state.tokens.shape[0] - 1
        self.last_work = None
        chain = self.tree is not None and self.tree == Tree.chain(self.tree.depth)  # dynamic trees: the full verify
        try:
            with hf.captured_output(hf.decoder_layers(self.model)[self.exit_layer - 1]) as outputs:
                draft, fed = self.grow(state)
            if chain and fed:
                m = len(fed)
                entries = [hf.layer_entries(state.cache, i, start, start + m) for i in range(self.exit_layer)]
                self.last_work = EarlyWork(
                    start=start, tokens=draft.tokens[:m].clone(),  # a chain feeds its nodes in order
                    hidden=torch.cat(outputs, dim=1)[0],  # [M, D]
                    keys=tuple(k for k, _ in entries), values=tuple(v for _, v in entries),
                )
        finally:
            hf.cache_truncate(state.cache, start)
        return draft


class EarlyExitTarget(Target):
    """The target, verifying chain drafts of ``drafter`` with the early layers' work reused (see module doc)."""

    def __init__(self, drafter: EarlyExitDrafter):
        super().__init__(drafter.model)
        self.drafter = drafter
        self.reused = 0
        """how many verified tokens skipped layers 0..E-1 (for tests and statistics)."""

    def plain_head(self) -> None:
        """None: this verify always runs the LM head (its remainder forward computes every logit)."""
        return None

    @torch.inference_mode()
    def verify(self, tree: Tree, tokens: torch.Tensor, cache: Cache, logits: bool = True) -> Verified:
        """Target.verify, the early layers' work reused where it fits; every logit whatever ``logits`` says (no
        ``plain_head``: the loop never asks for none)."""
        work, self.drafter.last_work = self.drafter.last_work, None
        start, n = hf.cache_length(cache), len(tree)
        usable = (
            work is not None and work.start == start and tree == Tree.chain(n - 1) and tokens.shape == (n,)
            and n <= work.tokens.shape[0] + 1 and torch.equal(tokens[: min(n, work.tokens.shape[0])], work.tokens[:n])
            and set(hf.layer_lengths(cache)) == {start}
        )
        if not usable:
            return super().verify(tree, tokens, cache)
        return self._verify_remainder(work, tokens, cache)

    def _verify_remainder(self, work: EarlyWork, tokens: torch.Tensor, cache: Cache) -> Verified:
        model, exit_layer, start, n = self.model, self.drafter.exit_layer, work.start, tokens.shape[0]
        num_layers = len(hf.decoder_layers(model))
        r = min(n, work.tokens.shape[0])  # tokens whose early work is kept
        device = tokens.device
        # 1. forward_early: the kept entries go back into layers 0..E-1; tokens not fed while drafting run through them
        for i in range(exit_layer):
            hf.append_entries(cache, i, work.keys[i][:, :, :r], work.values[i][:, :, :r])
        hidden = work.hidden[:r]  # [r, D]
        if n > r:
            allowed = torch.cat([torch.ones(n - r, start + r, dtype=torch.bool, device=device),
                                 torch.ones(n - r, n - r, dtype=torch.bool, device=device).tril()], dim=1)
            skip_rest = {i: hf.Passthrough() for i in range(exit_layer, num_layers)}
            with hf.replaced_layers(model, skip_rest), hf.captured_output(hf.decoder_layers(model)[exit_layer - 1]) as out:
                hf.forward_partial(model, tokens[r:], torch.arange(start + r, start + n, device=device),
                                   hf.additive_mask(allowed, self._mask_dtype), cache, lm_head=False)
            hidden = torch.cat([hidden, out[-1][0]])  # [N, D]
        # 2. forward_remainder: layers E..L-1 over the chain, starting from the layer-E inputs
        allowed = torch.cat([torch.ones(n, start, dtype=torch.bool, device=device),
                             torch.ones(n, n, dtype=torch.bool, device=device).tril()], dim=1)  # [N, S + N]
        early = {i: hf.Passthrough() for i in range(exit_layer - 1)} | {exit_layer - 1: hf.Emit(hidden[None])}
        with hf.replaced_layers(model, early):
            logits, final = hf.forward_partial(model, tokens, torch.arange(start, start + n, device=device),
                                               hf.additive_mask(allowed, self._mask_dtype), cache)
        self.reused += r
        return Verified(logits=logits, hidden=final)


KIND = DraftKind(dynamic_trees=True)
"""``--draft early-exit:layer=E``: fixed and dynamic trees; not tuned (it has no checkpoint to cache a tuning under)."""
