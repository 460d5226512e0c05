"""Hydra heads as a selfspec Drafter: a static tree filled depth by depth, each node's token drawn given its path.

Medusa fills the node at rank path (r1, ..., rd) with head d's rank-rd candidate, the same under every parent. Here
head d reads the path above the node, so every node of depth d - 1 that has children asks head d once (batched):

    depth 1:  h_t, [root]                 ─ head 1 ─▶ top-R candidates: the root's children
    depth 2:  h_t, [root, x]  for each x  ─ head 2 ─▶ top-R candidates: x's children   ...

Drafts are deterministic (q = None): greedy acceptance is exact, and ``sample_accept`` treats each node as a point mass,
which keeps sampling lossless too. The tree is the checkpoint's, built from measured accuracy (heads.tree_search).

Shapes: N tree nodes, Q nodes expanded at a depth, d depth, D hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch

from heads.hydra import HydraHeads
from selfspec.accept import Acceptance
from selfspec.drafter import Draft, DraftState, check_tree
from selfspec.tree import DynamicTree, Tree


class HydraDrafter:
    def __init__(self, heads: HydraHeads, tree: Tree | DynamicTree | Sequence[Sequence[int]]):
        if isinstance(tree, DynamicTree):
            raise ValueError("Hydra heads draft the static tree built from their measured accuracy (or one you give: "
                             "chain:K, full:..., choices); --tree dynamic:N is for Medusa and EAGLE heads")
        tree = tree if isinstance(tree, Tree) else Tree.from_choices(tree)
        self.heads = heads.eval()
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

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        root = state.tokens[-1:]  # [1]
        tokens = root.new_zeros(len(self.tree))  # [N]
        tokens[0] = root[0]
        for d, (paths, nodes, rows, ranks, topk) in enumerate(self._levels, start=1):
            hidden = state.hidden.reshape(1, -1).expand(paths.shape[0], -1)  # [Q, D]
            logits = self.heads.head_logits(hidden, tokens[paths.to(tokens.device)], d)  # [Q, V]
            top = logits.topk(topk, dim=-1).indices  # [Q, R]
            tokens[nodes.to(tokens.device)] = top[rows.to(top.device), ranks.to(top.device)].to(tokens.device)
        return Draft(tree=self.tree, tokens=tokens)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None
