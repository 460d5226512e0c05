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

Every rule runs on the device the scores are on, as tensor operations over all nodes at once (a loop over depths or
sibling ranks at most, whose bounds the tree's shape gives), and reads the host once: ``read`` hands over the accepted
path, its draft tokens and the bonus token as one small tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.core.tree import Tree


@dataclass(frozen=True)
class Acceptance:
    path: tuple[int, ...]
    """accepted node indices from the root (always path[0] == 0) to the deepest accepted draft node."""
    bonus: int
    """the target's own token after the last accepted node (the next step's root)."""
    drafts: tuple[int, ...] | None = field(default=None, compare=False)
    """the accepted drafts' tokens (the draft's tokens at path[1:]) when they were read with the path (``read``);
    None: not read (the loop reads them from the draft)."""

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.path) - 1


def read(tokens: torch.Tensor, nodes: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    """The step's one host read: tokens [N], nodes long [D] (the accepted path from the root, valid up to ``length``,
    anything after), length long [] (nodes on the path, the root included), bonus long [] -> the Acceptance."""
    d = nodes.shape[0]
    flat = torch.cat([nodes, tokens[nodes].long(), length.reshape(1), bonus.reshape(1).long()]).tolist()  # [2D + 2]
    n = flat[2 * d]
    return Acceptance(path=tuple(flat[:n]), bonus=flat[-1], drafts=tuple(flat[d + 1: d + n]))


def at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] for a long tensor i of one element, without the host read that indexing by a 0-dim tensor makes (torch
    turns it into a Python int)."""
    return t.index_select(0, i.reshape(1))[0]


def follow(kept: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kept long [N]: the child each node's rule kept, -1 for none -> (nodes long [depth + 1], the path from the root
    along kept children, repeating its last node once it ends; length long [], its nodes)."""
    cur = torch.zeros((), dtype=torch.long, device=kept.device)
    nodes, length = [cur], torch.ones((), dtype=torch.long, device=kept.device)
    for _ in range(depth):
        nxt = at(kept, cur)
        going = nxt >= 0
        cur = torch.where(going, nxt, cur)
        nodes.append(cur)
        length = length + going.long()
    return torch.stack(nodes), length


def greedy_accept(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor) -> Acceptance:
    """tokens [N] (tokens[0] is the root), logits [N, V] of the target at every node."""
    target = logits.argmax(-1)  # [N] the target's next token after each node
    nodes, length = greedy_run(tree, tokens, target)
    return read(tokens, nodes, length, at(target, at(nodes, length - 1)))


def greedy_run(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N], target [N] the target's next token after each node -> the accepted path as (nodes long [D], valid
    up to length long []), on their device: the longest run of nodes each equal to the target after its parent (the
    first longest, a deterministic tie-break)."""
    t = tree.on(tokens.device)
    match = tokens == target[t.parent]  # [N] node i agrees with the target after its parent
    match[0] = True
    ok = match[t.leaf_paths.clamp(min=0)] & (t.leaf_paths >= 0)  # [L, D]
    run = ok.long().cumprod(dim=-1).sum(dim=-1)  # [L] accepted prefix length of each path, root included
    best = run.argmax()  # first longest: a deterministic tie-break
    return at(t.leaf_paths, best).clamp(min=0), at(run, best)


def greedy_path(tree: Tree, tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, ...]:
    """``greedy_run``'s path as node indices (one host read)."""
    nodes, length = greedy_run(tree, tokens, target)
    flat = torch.cat([nodes, length.reshape(1)]).tolist()
    return tuple(flat[: flat[-1]])


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

    Every node with children runs its trial at once (``try_children``: the children in rank order); the path follows
    the kept children from the root; the bonus is drawn from what is left of p at the path's last node (p itself at a
    leaf). The uniforms are one fixed block per step, ``uniforms``: the trial of a node at depth d on its j-th child
    reads u[d, j]. The path meets each depth once, so its trials read distinct draws, as trying the path's nodes one
    after another would; and a step draws the same whatever its tree's size, so a tree cut to a batch's node budget
    (core/batch.py) samples what the whole tree would have wherever their paths agree. A tree of the root alone draws
    none: it samples exactly as plain sampling does.
    """
    t = tree.on(p_target.device)
    n = len(tree)
    inner = t.inner  # [I] the nodes with children
    kids = t.children[inner]  # [I, M]
    u = uniforms(tree.depth + 1, kids.shape[1] if n > 1 else 0, generator, p_target.device)[t.depth[inner]]  # [I, M']
    kept, rest = try_children(kids, tokens, p_target[inner].double(), q_draft, u)  # [I], [I, V]
    nxt = torch.full((n,), -1, dtype=torch.long, device=p_target.device).index_copy(0, inner, kept)  # [N]
    nodes, length = follow(nxt, tree.depth)
    last = at(nodes, length - 1)
    slot = torch.full((n,), -1, dtype=torch.long, device=p_target.device)
    slot[inner] = torch.arange(inner.shape[0], device=p_target.device)  # [N] a node's row of rest, -1 for a leaf
    row = at(slot, last)
    left = at(p_target, last).double() if inner.numel() == 0 else \
        torch.where(row >= 0, at(rest, row.clamp(min=0)), at(p_target, last).double())  # [V]
    bonus = torch.multinomial(left.float(), 1, generator=generator)[0]
    return read(tokens, nodes, length, bonus)


UNIFORMS = (32, 32)
"""the block of uniforms a sampled step draws, [depth, rank]: larger than the trees selfspec grows (a deeper or wider
tree draws a larger block)."""


def uniforms(depths: int, ranks: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """float64 [max(depths, 32), max(ranks, 32)] uniforms, the trial draws of one step (none when ranks is 0: a tree
    of the root alone, which draws nothing but its token)."""
    if ranks == 0:
        return torch.ones(depths, 1, dtype=torch.float64, device=device)
    shape = (max(depths, UNIFORMS[0]), max(ranks, UNIFORMS[1]))
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=device)


def try_children(kids: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, q_draft: torch.Tensor | None,
                 u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection trial of I nodes at once: kids long [I, M] (each node's children by rank, -1 padding), tokens
    [N], p float64 [I, V] each node's target distribution, q_draft [N, V] or None, u float64 [I, >= M] a uniform per
    node and child rank ->
    (kept long [I]: the first child kept, -1 for none; p float64 [I, V]: what is left after the rejected children).

    Child c with token x: kept with probability min(1, p(x) / q(x)), else p <- norm(max(p - q, 0)); a point mass
    (no q, or a zero row) is kept with probability p(x), else p <- p with x zeroed, renormalised. A node whose residual
    is (numerically) empty stops trying and keeps p as it was."""
    rows = kids.shape[0]
    kept = torch.full((rows,), -1, dtype=torch.long, device=p.device)
    done = torch.zeros(rows, dtype=torch.bool, device=p.device)
    for j in range(kids.shape[1]):
        child = kids[:, j].clamp(min=0)  # [I]
        active = (kids[:, j] >= 0) & ~done
        x = tokens[child].long()[:, None]  # [I, 1]
        p_x = p.gather(1, x)[:, 0]  # [I]
        chance, residual = p_x, p.scatter(1, x, 0.0)  # point mass: p(x); p without x
        if q_draft is not None:
            q = q_draft[child].double()  # [I, V]
            point = q.sum(-1) == 0  # [I]
            ratio = (p_x / q.gather(1, x)[:, 0].clamp(min=1e-30)).clamp(max=1.0)
            chance = torch.where(point, p_x, ratio)
            residual = torch.where(point[:, None], residual, (p - q).clamp(min=0.0))
        took = active & (u[:, j] < chance)
        kept = torch.where(took, kids[:, j], kept)
        total = residual.sum(-1)  # [I]
        rejected = active & ~took
        p = torch.where((rejected & (total > 0))[:, None], residual / total.clamp(min=1e-300)[:, None], p)
        done = done | took | (rejected & (total <= 0))
    return kept, p


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
    t = tree.on(p_target.device)
    entropy = -(p_target * torch.log(p_target.clamp(min=1e-10))).sum(-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    typical = p_target[t.parent, tokens.long()] > threshold[t.parent]  # [N] node i is typical after its parent
    good = typical[t.children.clamp(min=0)] & (t.children >= 0)  # [N, M]
    first = good.long().argmax(-1, keepdim=True)  # [N, 1] the first typical child (by rank), if any
    kept = torch.where(good.any(-1), t.children.gather(1, first)[:, 0], -1)  # [N]
    nodes, length = follow(kept, tree.depth)
    bonus = torch.multinomial(at(p_target, at(nodes, length - 1)).float(), 1, generator=generator)[0]
    return read(tokens, nodes, length, bonus)
