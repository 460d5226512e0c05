"""Acceptance rules: which draft tokens of a verified tree the target keeps, and the token it adds itself.

Pure functions over tensors. Every rule gets the tree, its tokens and the target's output at every node, and returns an
``Acceptance``: the accepted root-to-node path and the bonus token (the target's own next token after the path).

Shapes: N tree nodes, V vocabulary.

- ``greedy_accept``  exact: a draft token is kept iff it equals the target's argmax after its parent.
- ``sample_accept``  lossless tree rejection sampling (SpecInfer, EAGLE): at each node the children are tried in rank
  order; child c drafted from q is kept with probability min(1, p(c) / q(c)); otherwise p <- norm(max(p - q, 0)) and the
  next child is tried; when none is kept, the bonus token is drawn from what is left of p. A deterministic draft
  (q = None) is a point mass: kept with probability p(c), and rejecting it zeroes p(c). The output distribution is
  exactly the target's.
- ``typical_accept`` Medusa's typical acceptance: keeps c when p(c) > min(epsilon, delta * exp(-H(p))). Faster on
  open-ended text but NOT distribution-preserving; opt-in only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.core.tree import Tree


@dataclass(frozen=True)
class Acceptance:
    path: tuple[int, ...]
    """accepted node indices from the root (always path[0] == 0) to the deepest accepted draft node."""
    bonus: int
    """the target's own token after the last accepted node (the next step's root)."""

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


def greedy_accept(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> Acceptance:
    """tokens [N] (tokens[0] is the root), logits [N, V] of the target at every node."""
    target = logits.argmax(-1)  # [N] the target's next token after each node
    path = greedy_path(tree, tokens, target)
    return Acceptance(path=path, bonus=int(target[path[-1]]))


def greedy_path(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, ...]:
    """tokens [N], target [N] the target's next token after each node -> the accepted path: the longest run of nodes
    each equal to the target after its parent (the first longest, a deterministic tie-break)."""
    match = tokens == target[tree.parent_tensor]  # [N] node i agrees with the target after its parent
    match[0] = True
    paths = tree.leaf_paths  # [L, D]
    ok = match[paths.clamp(min=0)] & (paths >= 0)  # [L, D]
    run = ok.long().cumprod(dim=-1).sum(dim=-1)  # [L] accepted prefix length of each path, root included
    best = int(run.argmax())  # first longest: a deterministic tie-break
    return tuple(int(i) for i in paths[best, : int(run[best])])


def sample_accept(
    tree: Tree,
    tokens: torch.Tensor,
    p_target: torch.Tensor,
    q_draft: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Lossless tree rejection sampling.

    p_target [N, V]: the target's processed next-token distribution after each node (``process_logits``).
    q_draft [N, V] or None: q_draft[i] is the distribution node i's token was drawn from; None (or a row that is all
    zero) means node i is a deterministic draft, a point mass on tokens[i].
    """
    node = 0
    path = [0]
    while True:
        p = p_target[node].double().clone()  # [V]
        kept = None
        for child in tree.children[node]:
            c = int(tokens[child])
            q = None if q_draft is None else q_draft[child].double()
            if q is None or float(q.sum()) == 0.0:  # point mass on c
                accept_prob = float(p[c])
                residual = p.clone()
                residual[c] = 0.0
            else:
                accept_prob = min(1.0, float(p[c]) / max(float(q[c]), 1e-30))
                residual = (p - q).clamp(min=0.0)
            if float(torch.rand((), generator=generator, dtype=torch.float64, device=p.device)) < accept_prob:
                kept = child
                break
            total = float(residual.sum())
            if total <= 0.0:  # p was (numerically) all on rejected tokens: nothing left to try
                break
            p = residual / total
        if kept is None:
            bonus = int(torch.multinomial(p.float(), 1, generator=generator))
            return Acceptance(path=tuple(path), bonus=bonus)
        node = kept
        path.append(node)


def typical_accept(
    tree: Tree,
    tokens: torch.Tensor,
    p_target: torch.Tensor,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance (lossy: does not preserve the target's distribution).

    A child c of node i is kept when p_i(c) > min(posterior_threshold, posterior_alpha * exp(-H(p_i))); the first
    such child (in rank order) is followed. The bonus token is drawn from p at the last accepted node.
    """
    entropy = -(p_target * torch.log(p_target.clamp(min=1e-10))).sum(-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    node, path = 0, [0]
    while True:
        nxt = next((c for c in tree.children[node] if p_target[node, tokens[c]] > threshold[node]), None)
        if nxt is None:
            bonus = int(torch.multinomial(p_target[node].float(), 1, generator=generator))
            return Acceptance(path=tuple(path), bonus=bonus)
        node = nxt
        path.append(node)
