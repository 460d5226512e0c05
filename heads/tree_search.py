"""Trees from measured accuracy: measure how often each head's rank-r candidate is right, then build the tree that
maximises the expected accepted length under a node budget. No tree is ever written by hand.

The model (Medusa's): acc[k][r] is the probability that head k+1's rank-r candidate is the token the target emits at
that depth, independently across heads. A node reached by the rank path (r1, ..., rd) is accepted iff every candidate
on its path is right, with probability prod_i acc[i-1][r_i]; the candidates of one head are distinct tokens, so at most
one node per depth is accepted, and

    expected accepted tokens per step = 1 (the target's bonus token) + sum over draft nodes of their path probability.

A child's path probability never exceeds its parent's (acc <= 1), so taking the ``max_nodes`` paths of highest
probability gives a valid tree (every prefix is taken first), and it is optimal: the greedy frontier search below.

Shapes: K heads, R ranks measured per head, B batch, T time, D hidden size, V vocabulary.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import torch

from selfspec.core.tree import Tree

IGNORE_INDEX = -100


def _as_rows(acc: Sequence[Sequence[float]] | torch.Tensor) -> list[list[float]]:
    rows = acc.tolist() if isinstance(acc, torch.Tensor) else [list(map(float, row)) for row in acc]
    if not rows or any(len(row) == 0 for row in rows):
        raise ValueError("expected head accuracies acc[k][r] with at least one head and one rank per head")
    if any(not 0.0 <= a <= 1.0 for row in rows for a in row):
        raise ValueError("expected head accuracies in [0, 1] (probabilities that a candidate is right)")
    return rows


def path_probability(acc: Sequence[Sequence[float]] | torch.Tensor, path: Sequence[int]) -> float:
    """prod_i acc[i][path[i]]: the probability that the node reached by rank path ``path`` is accepted."""
    rows = _as_rows(acc)
    if len(path) > len(rows):
        raise ValueError(f"path {list(path)} is {len(path)} deep but only {len(rows)} heads were measured")
    prob = 1.0
    for depth, rank in enumerate(path):
        if not 0 <= rank < len(rows[depth]):
            raise ValueError(
                f"path {list(path)} uses rank {rank} at depth {depth + 1}; "
                f"head {depth + 1} has ranks 0..{len(rows[depth]) - 1}"
            )
        prob *= rows[depth][rank]
    return prob


def expected_accept_length(acc: Sequence[Sequence[float]] | torch.Tensor, choices: Iterable[Sequence[int]]) -> float:
    """Expected tokens per target forward with the tree ``choices``: 1 + sum of its nodes' path probabilities."""
    return 1.0 + sum(path_probability(acc, c) for c in {tuple(c) for c in choices})


def best_choices(acc: Sequence[Sequence[float]] | torch.Tensor, max_nodes: int) -> list[list[int]]:
    """The Medusa-style choices of the tree with the highest expected accepted length and at most max_nodes drafts.

    Greedy frontier search: start from the depth-1 candidates, repeatedly take the frontier node of highest path
    probability and put its children on the frontier. Ties go to the shallower, then lexicographically smaller path.
    Nodes of zero probability are never taken (they add nothing).
    """
    rows = _as_rows(acc)
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, found {max_nodes}")
    frontier: list[tuple[float, int, tuple[int, ...]]] = []  # (-probability, depth, path): a min-heap

    def push_children(path: tuple[int, ...], prob: float) -> None:
        if len(path) < len(rows):
            for rank, a in enumerate(rows[len(path)]):
                heapq.heappush(frontier, (-prob * a, len(path) + 1, path + (rank,)))

    push_children((), 1.0)
    taken: list[list[int]] = []
    while frontier and len(taken) < max_nodes:
        neg_prob, _, path = heapq.heappop(frontier)
        if -neg_prob <= 0.0:
            break
        taken.append(list(path))
        push_children(path, -neg_prob)
    return sorted(taken, key=lambda c: (len(c), c))


def best_tree(acc: Sequence[Sequence[float]] | torch.Tensor, max_nodes: int) -> Tree:
    return Tree.from_choices(best_choices(acc, max_nodes))


# ---------------------------------------------------------------------------------------------- measuring accuracy
def rank_hits(logits: torch.Tensor, ids: torch.Tensor, k: int, topk: int) -> tuple[torch.Tensor, int]:
    """How often head k (0-based, predicting token t+2+k) has the right token at each rank.

    logits [B, T, V] of head k at every position; ids [B, T] token ids, IGNORE_INDEX (-100) where a position is not a
    target (e.g. the data's labels: prompt tokens, padding). Returns (hits [topk]: count of positions where the rank-r
    candidate is the target, positions counted).

        position t:   t     t+1    t+2    t+3 ...
        LM head:      ──▶   x
        head k=0:     ──────────▶  x
        head k=1:     ─────────────────▶  x
    """
    shift = k + 2
    T = ids.shape[1]
    if T <= shift:
        return torch.zeros(topk, dtype=torch.long), 0
    target = ids[:, shift:]  # [B, T - shift]
    cand = logits[:, : T - shift].topk(topk, dim=-1).indices  # [B, T - shift, topk]
    valid = target != IGNORE_INDEX  # [B, T - shift]
    hit = (cand == target[..., None]) & valid[..., None]  # [B, T - shift, topk]
    return hit.sum(dim=(0, 1)).cpu(), int(valid.sum())


@torch.no_grad()
def measure_accuracy(heads: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], topk: int = 10) -> torch.Tensor:
    """acc [K, topk]: acc[k][r] = fraction of target positions where head k's rank-r candidate is the right token.

    batches: held-out (hidden [B, T, D] the base's final hidden states, ids [B, T] with -100 where not a target).
    """
    num_heads = len(heads.heads)
    hits = torch.zeros(num_heads, topk, dtype=torch.long)
    counts = [0] * num_heads
    for hidden, ids in batches:
        if hidden.dim() != 3 or ids.shape != hidden.shape[:2]:
            raise ValueError(f"expected hidden [B, T, D] and ids [B, T], found {tuple(hidden.shape)} and {tuple(ids.shape)}")
        for k in range(num_heads):
            logits = heads.head_logits(hidden, k)  # [B, T, V]
            h, n = rank_hits(logits, ids.to(logits.device), k, topk)
            hits[k] += h
            counts[k] += n
    if min(counts) == 0:
        k = counts.index(0)
        raise ValueError(
            f"no target positions to measure head {k + 1} on: expected held-out batches longer than {k + 2} tokens "
            "with labels (ids other than -100)"
        )
    return hits.double() / torch.tensor(counts, dtype=torch.float64)[:, None]


# ------------------------------------------------------------------------------------------ trees for this machine
def step_cost(costs: dict[int, float], nodes: int) -> float:
    """Cost of verifying a tree of ``nodes`` nodes (root included), linearly interpolated from measured sizes."""
    sizes = sorted(costs)
    if nodes <= sizes[0]:
        return costs[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if nodes <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (nodes - lo) / (hi - lo)
    raise ValueError(f"no verify cost measured for {nodes} nodes (measured up to {sizes[-1]}); measure larger trees")


def fastest_choices(acc: Sequence[Sequence[float]] | torch.Tensor, costs: dict[int, float],
                    max_nodes: int) -> tuple[list[list[int]], float]:
    """The tree that maximises expected tokens per second, not accepted length, on the machine ``costs`` describe.

    costs: verify time (any unit) of a tree of n nodes, root included (``selfspec.tools.costs.verify_costs``). The best
    n-draft tree is the greedy one of ``best_choices`` (nested in n), so the search is over n alone:
    argmax_n expected_accept_length(best_choices(acc, n)) / cost(n + 1). Returns (choices, expected tokens per unit).
    """
    if not costs:
        raise ValueError("expected measured verify costs {nodes: time}, found none")
    all_choices = best_choices(acc, max_nodes)
    rows = _as_rows(acc)
    # the greedy order: nodes by decreasing path probability, so every prefix is a valid tree
    order = sorted(all_choices, key=lambda c: (-path_probability(rows, c), len(c), c))
    best, best_rate, expected = [], 1.0 / step_cost(costs, 1), 1.0
    for n, node in enumerate(order, start=1):
        expected += path_probability(rows, node)
        rate = expected / step_cost(costs, n + 1)
        if rate > best_rate:
            best, best_rate = order[:n], rate
    return sorted(best, key=lambda c: (len(c), c)), best_rate
