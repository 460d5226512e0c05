"""Hydra heads as a selfspec Drafter: a static tree filled depth by depth, each node's token drawn given its path.

Medusa fills the node at rank path (r1, ..., rd) with head d's rank-rd candidate, the same under every parent. Here
head d reads the path above the node, so every node of depth d - 1 that has children asks head d once (batched):

    depth 1:  h_t, [root]                 ─ head 1 ─▶ top-R candidates: the root's children
    depth 2:  h_t, [root, x]  for each x  ─ head 2 ─▶ top-R candidates: x's children   ...

With a ``DynamicTree`` (``--tree dynamic:N``, or ``auto``: the budget ``infer.py tune-tree`` measured fastest) the tree
is grown each step as EAGLE-2 grows it: depth by depth, the ``max_rank`` best nodes of the newest depth (by cumulative
draft log-probability) each offer their ``max_rank`` best children; then the ``budget`` best nodes are kept
(``Tree.best_scored``).

Drafts are deterministic (q = None): greedy acceptance is exact, and ``sample_accept`` treats each node as a point mass,
which keeps sampling lossless too. The static tree is the checkpoint's, built from measured accuracy
(heads.tree_search).

Shapes: N tree nodes, Q nodes expanded at a depth, d depth, D hidden size, V vocabulary, V' draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from heads.hydra.model import HydraHeads
from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState, check_tree
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree, read_candidates


class HydraDrafter(Drafter):
    def __init__(self, heads: HydraHeads, tree: Tree | DynamicTree | Sequence[Sequence[int]]):
        self.heads = heads.eval()
        self.dynamic = tree if isinstance(tree, DynamicTree) else None
        if self.dynamic is not None:
            self.depth = min(self.dynamic.depth or heads.config.num_heads, heads.config.num_heads)
            return
        tree = tree if isinstance(tree, Tree) else Tree.from_choices(tree)
        self.tree = check_tree(tree, max_depth=heads.config.num_heads, max_topk=heads.config.vocab_size,
                               drafter="Hydra heads")
        # per depth d: the nodes of depth d - 1 that have children, their paths from the root, and for each node of
        # depth d the row of its parent among them and its rank
        self._levels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        depths = tree.depths
        paths = {0: [0]}
        for i in range(1, len(tree)):
            paths[i] = paths[tree.parents[i]] + [i]
        for d in range(1, tree.depth + 1):
            nodes = [i for i in range(len(tree)) if depths[i] == d]
            parents = sorted({tree.parents[i] for i in nodes})
            row = {p: q for q, p in enumerate(parents)}
            self._levels.append((
                torch.tensor([paths[p] for p in parents], dtype=torch.long),  # [Q, d] node indices, root first
                torch.tensor(nodes, dtype=torch.long),  # [n_d] the nodes of depth d
                torch.tensor([row[tree.parents[i]] for i in nodes], dtype=torch.long),  # [n_d] their parent's row
                torch.tensor([tree.ranks[i] for i in nodes], dtype=torch.long),  # [n_d] their rank
                max(tree.ranks[i] for i in nodes) + 1,
            ))

    @property
    def max_depth(self) -> int:
        """head k drafts depth k: no deeper tree than the heads."""
        return self.heads.config.num_heads

    def resized(self, depth: int, budget: int) -> "HydraDrafter":
        return HydraDrafter(self.heads, DynamicTree.resized(self.dynamic, budget, depth))

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        if self.dynamic is not None:
            return self._draft_dynamic(state)
        root = state.tokens[-1:]  # [1]
        tokens = root.new_zeros(len(self.tree))  # [N]
        tokens[0] = root[0]
        for d, (paths, nodes, rows, ranks, topk) in enumerate(self._levels, start=1):
            hidden = state.hidden.reshape(1, -1).expand(paths.shape[0], -1)  # [Q, D]
            logits = self.heads.draft_logits(hidden, tokens[paths.to(tokens.device)], d)  # [Q, V']
            top = self.heads.draft_vocab.base_ids(logits.topk(topk, dim=-1).indices)  # [Q, R] token ids
            tokens[nodes.to(tokens.device)] = top[rows.to(top.device), ranks.to(top.device)].to(tokens.device)
        return Draft(tree=self.tree, tokens=tokens)

    def _draft_dynamic(self, state: DraftState) -> Draft:
        """1. expand the best nodes of the newest depth, one batched head call per depth; 2. keep the budget best."""
        root, k = state.tokens[-1], self.dynamic.max_rank
        first = int(root)
        tok, parent, score, depth, path = [first], [-1], [0.0], [0], [[first]]
        layer = [0]
        for d in range(1, self.depth + 1):
            expand = sorted(layer, key=lambda i: -score[i])[:k]
            hidden = state.hidden.reshape(1, -1).expand(len(expand), -1)  # [Q, D]
            paths = torch.tensor([path[i] for i in expand], device=root.device)  # [Q, d]
            logp = torch.log_softmax(self.heads.draft_logits(hidden, paths, d).float(), dim=-1)  # [Q, V']
            top = logp.topk(k, dim=-1)
            ids, values = read_candidates(self.heads.draft_vocab.base_ids(top.indices), top.values)  # [Q][k], one read
            layer = []
            for q, node in enumerate(expand):
                for token, value in zip(ids[q], values[q]):
                    layer.append(len(tok))
                    tok.append(token)
                    parent.append(node)
                    score.append(score[node] + value)
                    depth.append(d)
                    path.append(path[node] + [token])
        tree, kept = Tree.best_scored(parent, score, depth, self.dynamic.budget, self.dynamic.min_logp)
        tokens = torch.tensor([tok[0]] + [tok[i] for i in kept], dtype=state.tokens.dtype, device=root.device)
        return Draft(tree=tree, tokens=tokens, scores=torch.tensor([0.0] + [score[i] for i in kept]))

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


def load_drafter(path_or_repo_id: str | Path, target: Target, revision: str | None = None,
                 tree: Tree | DynamicTree | Sequence[Sequence[int]] | None = None) -> HydraDrafter:
    """The ``hydra`` entry point of ``selfspec.drafters``: the heads on ``target`` as a HydraDrafter. tree: None (the
    checkpoint's tree, or a chain of every head's top-1 without one), a static tree / choices, or a DynamicTree
    (grown each step from the heads' probabilities)."""
    heads = HydraHeads.from_pretrained(path_or_repo_id, target.model, revision=revision)
    if tree is None:
        tree = Tree.from_choices(heads.config.tree) if heads.config.tree else Tree.chain(heads.config.num_heads)
    return HydraDrafter(heads, tree)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""Hydra heads (entry point ``hydra`` of ``selfspec.drafters``): fixed and dynamic trees (no deeper than its heads:
``max_depth``), tuned by ``infer.py tune-tree``."""
