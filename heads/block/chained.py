"""A draft tree from a conditioned block (heads/block/condition.py): one forward of the head gives the block's states,
then the cheap parts are chained depth by depth, each branch on its own tokens.

    states [depth, D]  ─ lm_head, once ─▶ base logits z [depth, V']
    node at depth d holding token t  ─▶  its children: the top-R of log_softmax(z_d + bias(t))          (d >= 1)
                                          the root's children: the top-R of log_softmax(z_0)             (no bias)
                                     ─▶  c_d(t): the confidence that position d's draft is accepted after t

So a branch's position d is drafted knowing the token its own parent holds, as the head was trained (teacher forcing:
the true token before each position). The heavy part, the head's decoder, still runs once per step; a node costs one
r x V' product and a softmax over the draft vocabulary, and all the nodes of one depth are computed together and read
by the host at once (``Chain.read``): one host read per depth, never one per node (tests/test_host_reads.py).

``grow`` (``--tree dynamic:N``): the N nodes of highest score, every prefix of a kept path kept, ties to the smaller
rank path (the order a best-first heap pops them in). A node's score is its path's log-probability (``rank_by:
probability``) or, with ``rank_by: confidence``, the sum over its path of log c + log q(token) - log q(best sibling):
the confidence head's estimate for the best candidate, scaled down for the others. Paths whose probability is below
the tree's ``min_prob`` are left out, and so is every node whose product of confidences along its path is below the
checkpoint's ``confidence_min`` (the adaptive length: an unsure branch stops, a sure one goes on).

Depth by depth is best first. Every term a child adds to its parent's score is <= 0 in both modes (log q <= 0;
log c <= 0 and log q(token) <= log q(best sibling)), so a child never ranks above its parent, and the N best nodes
of everything reachable are closed under parents. So a node of the final N is among the N best of any reachable
set that holds it: expanding, at each depth, only the nodes still among the N best scored so far (and keeping only
those N between depths) loses none of them, and the N best at the end are exactly best-first's. Scores are summed on
the host in best-first's order, so the ranking is the same to the last bit.

``fill`` (static trees, ``chain:k``): each node holds its rank of the distribution after its own parent's token; the
same confidence cut drops the nodes below it (and what hangs under them).

Drafts are deterministic (q = None): every node is the top-ranked candidates of the conditioned distribution, a point
mass for the verifier; ``sample_accept`` keeps the target's distribution exactly whatever chose them.

Shapes: D hidden size, V' draft vocabulary, R ranks, n nodes expanded at one depth, N tree nodes (the root included).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from selfspec.core.drafter import Draft
from selfspec.core.position_draft import MAX_MEMO
from selfspec.core.tree import Tree

Candidates = tuple[list[float], list[int], float]
"""one node's children as the host reads them: their log-probabilities (best first), target ids, and log c_d(prev)."""


class Chain:
    """The conditioned distributions of one step's block: ``read(d, prev)`` -> position d's top-R after each token of
    prev, for all of them in one host read."""

    def __init__(self, head, states: torch.Tensor, ranks: int):
        self.head, self.states, self.ranks = head, states, ranks
        self.base = head.logits(states)  # [depth, V'] z, in the head's dtype (the bias is added in it)
        cut = head.config.confidence_min if head.confidence is not None else 0.0
        self.min_log_conf = math.log(cut) if cut > 0 else -math.inf
        self.by_confidence = head.config.rank_by == "confidence"

    @torch.no_grad()
    def candidates(self, d: int, prev: list[int] | None) -> torch.Tensor:
        """Position d's candidates after each token of prev (n target ids; None at d = 0, whose query holds the root:
        one row, no bias) -> [n, 2R + 1] float64 on the device: per row the top-R log-probabilities (best first), their
        target ids (exact in float64), and log c_d(prev) (0 without a confidence head)."""
        n = 1 if prev is None else len(prev)
        code = None
        if d > 0 and prev is not None:
            code = self.head.prev_code(torch.tensor(prev, device=self.states.device))  # [n, r] or None (no bias)
        logits = self.base[d:d + 1].expand(n, -1)  # [n, V']
        if code is not None:
            logits = logits + self.head.markov.bias(code).to(logits.dtype)  # one [n, r] x [r, V'] product
        top = torch.log_softmax(logits.float(), dim=-1).topk(self.ranks, dim=-1)  # [n, R]
        log_conf = torch.zeros(n, device=logits.device)  # [n]
        if self.head.confidence is not None:
            states = self.states[d:d + 1].expand(n, -1)  # [n, D]
            log_conf = F.logsigmoid(self.head.confidence_logits(states, code).float())
        return torch.cat([top.values.double(), self.head.base_ids(top.indices).double(), log_conf.double()[:, None]],
                         dim=1)

    def read(self, d: int, prev: list[int] | None) -> list[Candidates]:
        """``candidates`` as Python numbers, one host read: each node's (log-probabilities, target ids, log c)."""
        R = self.ranks
        return [(row[:R], [int(t) for t in row[R:2 * R]], row[2 * R]) for row in self.candidates(d, prev).tolist()]

    def expand(self, d: int, prev: int) -> Candidates:
        """One node's candidates: position d's after token ``prev`` (a target id)."""
        return self.read(d, [prev])[0]

    def term(self, values: list[float], r: int, log_conf: float) -> float:
        """The score a child of rank r adds to its parent's (<= 0)."""
        return log_conf + values[r] - values[0] if self.by_confidence else values[r]


class Node(NamedTuple):
    """A node of a growing tree: its score, rank path, path log-probability, path log-confidence and token."""
    score: float
    path: tuple[int, ...]
    logp: float
    log_conf: float
    token: int


def best_first_order(node: Node) -> tuple[float, tuple[int, ...]]:
    """Highest score first, ties to the smaller rank path (a parent before its children): a best-first heap's order."""
    return -node.score, node.path


def grow(chain: Chain, root: torch.Tensor, budget: int, depth: int, min_logp: float,
         memo: dict[tuple[tuple[int, ...], ...], Tree]) -> Draft:
    """The ``budget`` best nodes, at most ``depth`` deep (see the module docstring) -> the Draft with their scores.
    One host read per depth: the children of that depth's nodes among the best so far."""
    best: list[Node] = []  # the budget best nodes scored so far, best first
    frontier = [Node(0.0, (), 0.0, 0.0, -1)]  # the root (its token is not read: depth 0 has no bias)
    for d in range(depth):
        children: list[Node] = []
        for node, (values, tokens, conf) in zip(frontier, chain.read(d, [n.token for n in frontier] if d else None)):
            if node.log_conf + conf < chain.min_log_conf:  # the branch stops: its next position is too unsure
                continue
            for r, (v, token) in enumerate(zip(values, tokens)):
                if node.logp + v < min_logp:
                    break  # the rest rank lower
                children.append(Node(node.score + chain.term(values, r, conf), node.path + (r,), node.logp + v,
                                     node.log_conf + conf, token))
        best = sorted(best + children, key=best_first_order)[:budget]
        frontier = [node for node in best if len(node.path) == d + 1]
        if not frontier:
            break
    if not best:
        return Draft(tree=Tree.chain(0), tokens=root.clone(), scores=torch.zeros(1))
    best.sort(key=lambda node: (len(node.path), node.path))  # Tree.from_choices's node order
    choices = tuple(node.path for node in best)
    tree = memo.get(choices)
    if tree is None:
        if len(memo) >= MAX_MEMO:
            memo.clear()
        tree = memo[choices] = Tree.from_choices(choices)
    tokens = torch.tensor([node.token for node in best], dtype=root.dtype, device=root.device)
    return Draft(tree=tree, tokens=torch.cat([root, tokens]),
                 scores=torch.tensor([0.0] + [node.score for node in best]))


def fill(chain: Chain, root: torch.Tensor, tree: Tree) -> Draft:
    """A static tree: node i holds rank ranks[i] of the distribution after its parent's token; nodes whose product of
    confidences is below the cut are dropped with their subtrees. One host read per depth."""
    N, depths, children = len(tree), tree.depths, tree.children
    token, log_conf, kept = [-1] * N, [0.0] * N, [True] + [False] * (N - 1)  # per node; the root's token is not read
    for d in range(tree.depth):
        parents = [p for p in range(N) if depths[p] == d and kept[p] and children[p]]
        if not parents:
            break
        for p, (_, tokens, conf) in zip(parents, chain.read(d, [token[p] for p in parents] if d else None)):
            for i in children[p]:
                token[i], log_conf[i] = tokens[tree.ranks[i]], log_conf[p] + conf
                kept[i] = log_conf[i] >= chain.min_log_conf
    nodes = [i for i in range(1, N) if kept[i]]  # tree order
    index = {0: 0}  # old node -> new node
    parents, ranks = [-1], [0]
    for i in nodes:
        index[i] = len(parents)
        parents.append(index[tree.parents[i]])
        ranks.append(tree.ranks[i])
    out = tree if len(nodes) == N - 1 else Tree(parents=tuple(parents), ranks=tuple(ranks))
    tokens = torch.tensor([token[i] for i in nodes], dtype=root.dtype, device=root.device)
    return Draft(tree=out, tokens=torch.cat([root, tokens]))
