"""A draft tree from per-position candidates: for drafters whose guess at each depth does not depend on the tokens
drafted above it (Medusa heads: head d guesses depth d; a block drafter: block position d), the ``budget`` rank paths
of highest product of per-position probabilities (EAGLE-2's dynamic tree over Medusa's rank paths).

    logp [K, R]    each position's top-R log-probabilities, best first
    tokens [K, R]  the token ids they stand for
        └─ Tree.best_first   the budget best rank paths, every prefix of a kept path kept (parents first)
             └─ Draft        the tree, node (r1, ..., rd) holding position d's rank-rd token, its score the sum of its
                             path's log-probabilities (``Draft.scores``: what budget tuning reads)

Shapes: K positions, R ranks per position, N tree nodes (the root included).
"""

from __future__ import annotations

import math

import torch

from selfspec.core.drafter import Draft
from selfspec.core.tree import Tree

MAX_MEMO = 4096
"""trees remembered per memo (by their choices) before it is cleared: each tree builds its masks once."""


def best_first_draft(root: torch.Tensor, logp: torch.Tensor, tokens: torch.Tensor, budget: int,
                     memo: dict[tuple[tuple[int, ...], ...], Tree] | None = None,
                     min_logp: float = -math.inf) -> Draft:
    """root [1] (the target's newest token), logp [K, R] and tokens [K, R] (position d's top-R candidates, best first)
    -> the Draft of the ``budget`` rank paths of highest cumulative log-probability, none below ``min_logp`` (the
    root alone when no path reaches it), with their scores. ``memo``: a dict the caller keeps across steps, choices ->
    Tree (a tree's masks are then built once)."""
    if logp.shape != tokens.shape or logp.dim() != 2:
        raise ValueError(f"expected logp and tokens of one shape [K, R], found {tuple(logp.shape)} and "
                         f"{tuple(tokens.shape)}")
    lp = logp.detach().float().cpu()
    choices = Tree.best_first(lp, budget, min_logp)
    if not choices:
        return Draft(tree=Tree.chain(0), tokens=root.clone(), scores=torch.zeros(1))
    tree = None if memo is None else memo.get(choices)
    if tree is None:
        tree = Tree.from_choices(choices)
        if memo is not None:
            if len(memo) >= MAX_MEMO:
                memo.clear()
            memo[choices] = tree
    # Tree.from_choices orders nodes by (depth, path), the order best_first returns them in
    depth = torch.tensor([len(c) - 1 for c in choices], dtype=torch.long)  # [N - 1] the position filling each node
    rank = torch.tensor([c[-1] for c in choices], dtype=torch.long)  # [N - 1] its candidate rank there
    values = lp.tolist()
    scores = torch.tensor([0.0] + [sum(values[d][r] for d, r in enumerate(c)) for c in choices])  # [N] cumulative
    nodes = tokens[depth.to(tokens.device), rank.to(tokens.device)]  # [N - 1] token ids
    return Draft(tree=tree, tokens=torch.cat([root, nodes.to(device=root.device, dtype=root.dtype)]), scores=scores)
