"""Layer-skip drafting (Draft & Verify, SWIFT): the target drafts with a subset of its own layers, no extra weights.

A draft forward runs the target's own forward with the skipped decoder layers replaced by a passthrough, through the
target's own cache: the kept layers append KV entries for the drafted tokens, the skipped layers' cache never grows.
After drafting every layer is truncated back to the start length, so the verifier finds the cache as it left it.

Drafting fills a static tree level by level (a chain by default): all nodes of depth d that have children are fed in
one forward with a tree mask, and their children get the draft's top-(rank + 1) tokens. Drafting stops early (the
deeper levels are dropped) when no node of a level has a top-1 draft probability of at least ``stop_below``
(confidence-based early stop, as in Kangaroo and SWIFT). Drafts are deterministic (q = None), hence lossless under both
greedy and sampled acceptance.

Shapes: S cached length (the prefix, root excluded), N tree nodes, F nodes fed so far, E nodes fed in one forward,
V vocabulary.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from selfspec import hf
from selfspec.accept import Acceptance
from selfspec.drafter import Draft, DraftState
from selfspec.target import Target
from selfspec.tree import Tree


def check_skip_layers(skip_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The skip set, sorted; refuses an empty set, every layer, duplicates and indices outside 0..num_layers-1."""
    skip = [int(i) for i in skip_layers]
    if not skip:
        raise ValueError("the skip set is empty: a draft through every layer is the target itself; skip at least one layer")
    bad = sorted({i for i in skip if not 0 <= i < num_layers})
    if bad:
        raise ValueError(f"skip layers {bad} are out of range: this model has {num_layers} layers, expected indices 0..{num_layers - 1}")
    if len(set(skip)) != len(skip):
        raise ValueError(f"the skip set {skip} names a layer twice; list each layer once")
    if len(skip) >= num_layers:
        raise ValueError(f"the skip set names all {num_layers} layers: keep at least one layer to draft with")
    return tuple(sorted(skip))


def check_stop_below(stop_below: float) -> float:
    if not 0.0 <= stop_below < 1.0:
        raise ValueError(f"stop_below (the top-1 draft probability under which drafting stops) must be in [0, 1), found {stop_below}")
    return float(stop_below)


class PartialModelDrafter:
    """Drafts a static tree with the target's forward, some decoder layers replaced (skipped, or an exit head).

    replace: decoder layer index -> module standing in for it (``hf.Passthrough`` to skip it).
    """

    def __init__(self, target: Target, replace: Mapping[int, torch.nn.Module], tree: Tree, stop_below: float = 0.0):
        if tree.depth < 1:
            raise ValueError(f"the draft tree must be at least one level deep, found depth {tree.depth}")
        self.target, self.model = target, target.model
        self.num_layers = len(hf.decoder_layers(self.model))
        self.replace = dict(replace)
        self.tree = tree
        self.stop_below = check_stop_below(stop_below)
        self._levels = [[i for i, d in enumerate(tree.depths) if d == depth and tree.children[i]] for depth in range(tree.depth)]
        self._width = [max((tree.ranks[c] + 1 for i in level for c in tree.children[i]), default=1) for level in self._levels]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """tokens [E], positions [E], mask [1, 1, E, S + F + E] -> draft logits [E, V] (the cache grows by E)."""
        with hf.replaced_layers(self.model, self.replace):
            logits, _ = hf.forward_partial(self.model, positions, mask, cache, input_ids=tokens)
        return logits

    def grow(self, state: DraftState) -> tuple[Draft, list[int]]:
        """Fill the tree level by level; returns the draft and the nodes fed, in cache order.

        The kept layers' cache then holds S + len(fed) entries; the caller must truncate it (``draft`` does).
        """
        cache, tree = state.cache, self.tree
        start = state.tokens.shape[0] - 1
        lengths = hf.layer_lengths(cache)
        if any(n != start for n in lengths):
            raise RuntimeError(
                f"the target's cache should hold the {start} tokens before the root in every layer; found per-layer lengths {lengths}"
            )
        device = state.tokens.device
        dtype = next(self.model.parameters()).dtype
        tokens = torch.zeros(len(tree), dtype=torch.long, device=device)  # [N]
        tokens[0] = state.tokens[-1]
        ancestors = tree.ancestor_mask.to(device)  # [N, N]
        fed: list[int] = []
        kept_depth = tree.depth
        for depth, (level, width) in enumerate(zip(self._levels, self._width)):
            if not level:
                kept_depth = depth
                break
            rows = torch.tensor(level, device=device)
            cols = torch.tensor(fed + level, device=device)
            allowed = torch.cat(
                [torch.ones(len(level), start, dtype=torch.bool, device=device), ancestors[rows][:, cols]], dim=1
            )  # [E, S + F + E]
            positions = torch.full((len(level),), start + depth, device=device)  # [E]
            logits = self._forward(tokens[rows], positions, hf.additive_mask(allowed, dtype), cache)  # [E, V]
            fed.extend(level)
            top = logits.float().softmax(-1).topk(width, dim=-1)  # values, indices [E, width]
            if float(top.values[:, 0].max()) < self.stop_below:
                kept_depth = depth
                break
            for j, node in enumerate(level):
                for child in tree.children[node]:
                    tokens[child] = top.indices[j, tree.ranks[child]]
        return Draft(tree=tree, tokens=tokens).truncated(kept_depth), fed

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        start = state.tokens.shape[0] - 1
        try:
            draft, _ = self.grow(state)
        finally:
            hf.cache_truncate(state.cache, start)
        return draft

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


class LayerSkipDrafter(PartialModelDrafter):
    """Drafts with the target minus ``skip_layers``; a chain of ``depth`` tokens, or the given static tree."""

    def __init__(self, target: Target, skip_layers: Sequence[int], depth: int = 4, tree: Tree | None = None,
                 stop_below: float = 0.0):
        num_layers = len(hf.decoder_layers(target.model))
        self.skip_layers = check_skip_layers(skip_layers, num_layers)
        if tree is None:
            if depth < 1:
                raise ValueError(f"depth (draft tokens per step) must be >= 1, found {depth}")
            tree = Tree.chain(depth)
        super().__init__(target, {i: hf.Passthrough() for i in self.skip_layers}, tree, stop_below)
