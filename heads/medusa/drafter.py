"""Medusa heads as a selfspec Drafter: each head's top candidates fill a static tree.

As in Medusa, a node's token depends only on its depth and rank: the node reached by the rank path (r1, ..., rd) holds
head d's rank-rd candidate, computed once per step from the target's hidden state at the position before the root.

    hidden h_t ──▶ LM head ──▶ root x_{t+1} (the target's own token)
               ──▶ head 1  ──▶ top-k for x_{t+2}   (depth 1 of the tree)
               ──▶ head 2  ──▶ top-k for x_{t+3}   (depth 2)  ...

Drafts are deterministic (q = None): greedy acceptance is exact, and selfspec's ``sample_accept`` treats each node as
a point mass, which keeps sampling lossless too.

Shapes: K heads, R ranks used by the tree, N tree nodes, V vocabulary, V' draft vocabulary
(selfspec/core/draft_vocab.py), D hidden size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from heads.medusa.model import MedusaHeads
from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState, check_tree
from selfspec.core.position_draft import best_first_draft
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree


class MedusaDrafter(Drafter):
    """tree: a static tree (or its choices), filled each step with the heads' candidates; or a DynamicTree, whose
    shape is chosen each step: the ``budget`` rank paths of highest product of the heads' probabilities."""

    def __init__(self, heads: MedusaHeads, tree: Tree | DynamicTree | Sequence[Sequence[int]]):
        self.heads = heads.eval()
        self.dynamic = tree if isinstance(tree, DynamicTree) else None
        if self.dynamic is not None:
            self._trees: dict[tuple[tuple[int, ...], ...], Tree] = {}  # best_first_draft's memo: choices -> Tree
            return
        tree = tree if isinstance(tree, Tree) else Tree.from_choices(tree)
        self.tree = check_tree(tree, max_depth=len(heads.heads), max_topk=heads.config.vocab_size, drafter="Medusa heads")
        self.topk = self.tree.max_rank + 1
        self._depth = self.tree.depth_tensor[1:] - 1  # [N - 1] the head that fills each draft node (0-based)
        self._rank = torch.tensor(self.tree.ranks[1:], dtype=torch.long)  # [N - 1] its candidate rank

    @property
    def max_depth(self) -> int:
        """head k drafts depth k: no deeper tree than the heads."""
        return self.heads.config.num_heads

    def resized(self, depth: int, budget: int) -> "MedusaDrafter":
        return MedusaDrafter(self.heads, DynamicTree.resized(self.dynamic, budget, depth))

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        if self.dynamic is not None:
            return self._draft_dynamic(state)
        root = state.tokens[-1:]  # [1]
        if len(self.tree) == 1:
            return Draft(tree=self.tree, tokens=root.clone())
        used = self.tree.depth  # the heads the tree reads (no host read of _depth)
        logits = self.heads.draft_logits(state.hidden, used)  # [K', V']
        cand = self.heads.draft_vocab.base_ids(logits.topk(self.topk, dim=-1).indices)  # [K', R] token ids
        nodes = cand[self._depth.to(cand.device), self._rank.to(cand.device)]  # [N - 1]
        return Draft(tree=self.tree, tokens=torch.cat([root, nodes.to(root.device)]))

    def _draft_dynamic(self, state: DraftState) -> Draft:
        """1. every head's top-R log-probabilities; 2. the best-first rank paths under the budget, with their tokens
        and scores (``best_first_draft``)."""
        used = min(self.dynamic.depth or len(self.heads.heads), len(self.heads.heads))
        logits = self.heads.draft_logits(state.hidden, used).float()  # [K, V'] (K <= the tree's depth)
        top = torch.log_softmax(logits, dim=-1).topk(self.dynamic.max_rank, dim=-1)  # [K, R] values and indices
        return best_first_draft(state.tokens[-1:], top.values, self.heads.draft_vocab.base_ids(top.indices),
                                self.dynamic.budget, self._trees, self.dynamic.min_logp)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


def default_tree(num_heads: int) -> Tree:
    """Without a measured tree: a chain of every head's top-1 candidate."""
    return Tree.chain(num_heads)


def load_drafter(
    path_or_repo_id: str | Path, target: Target, revision: str | None = None,
    tree: Tree | DynamicTree | Sequence[Sequence[int]] | None = None,
) -> MedusaDrafter:
    """Heads from a checkpoint (local directory or Hub id) on ``target``'s model, drafting ``tree``; tree=None uses the
    checkpoint's stored tree, or a chain of the heads' top-1 candidates when it stores none."""
    heads = MedusaHeads.from_pretrained(path_or_repo_id, target.model, revision=revision)
    if isinstance(tree, DynamicTree):
        return MedusaDrafter(heads, tree)
    if tree is None:
        tree = Tree.from_choices(heads.config.tree) if heads.config.tree else default_tree(heads.config.num_heads)
    return MedusaDrafter(heads, tree)


KIND = DraftKind(load=load_drafter, dynamic_trees=True, tunable=True)
"""Medusa heads (entry point ``medusa`` of ``selfspec.drafters``): fixed and dynamic trees (no deeper than its heads:
``max_depth``), tuned by ``infer.py tune-tree``."""
