"""A draft tree from a conditioned block (heads/block/condition.py): one forward of the head gives the block's states,
then the cheap parts are chained node by node, each branch on its own tokens.

    states [depth, D]  ─ lm_head, once ─▶ base logits z [depth, V']
    node at depth d holding token t  ─▶  its children: the top-R of log_softmax(z_d + bias(t))          (d >= 1)
                                          the root's children: the top-R of log_softmax(z_0)             (no bias)
                                     ─▶  c_d(t): the confidence that position d's draft is accepted after t

So a branch's position d is drafted knowing the token its own parent holds, as the head was trained (teacher forcing:
the true token before each position). The heavy part, the head's decoder, still runs once per step; a node costs one
r x V' product and a softmax over the draft vocabulary.

``grow`` (``--tree dynamic:N``): best first, as ``Tree.best_first`` does for an unconditioned block (the heap pops the
highest score; a popped node's children are computed and pushed): the N nodes of highest score, every prefix of a kept
path kept (a child never scores above its parent). A node's score is its path's log-probability (``rank_by:
probability``) or, with ``rank_by: confidence``, the sum over its path of log c + log q(token) - log q(best sibling):
the confidence head's estimate for the best candidate, scaled down for the others. Paths whose probability is below
the tree's ``min_prob`` are left out, and so is every node whose product of confidences along its path is below the
checkpoint's ``confidence_min`` (the adaptive length: an unsure branch stops, a sure one goes on).

``fill`` (static trees, ``chain:k``): each node holds its rank of the distribution after its own parent's token; the
same confidence cut drops the nodes below it (and what hangs under them).

Drafts are deterministic (q = None): every node is the top-ranked candidates of the conditioned distribution, a point
mass for the verifier; ``sample_accept`` keeps the target's distribution exactly whatever chose them.

Shapes: D hidden size, V' draft vocabulary, R ranks, N tree nodes (the root included).
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.nn.functional as F

from selfspec.core.drafter import Draft
from selfspec.core.position_draft import MAX_MEMO
from selfspec.core.tree import Tree


class Chain:
    """The conditioned distributions of one step's block: ``expand(d, prev)`` -> position d's top-R after token prev."""

    def __init__(self, head, states: torch.Tensor, ranks: int):
        self.head, self.states, self.ranks = head, states, ranks
        self.base = head.logits(states).float()  # [depth, V']
        cut = head.config.confidence_min if head.confidence is not None else 0.0
        self.min_log_conf = math.log(cut) if cut > 0 else -math.inf
        self.by_confidence = head.config.rank_by == "confidence"

    @torch.no_grad()
    def expand(self, d: int, prev: int) -> tuple[list[float], list[int], float]:
        """Position d's candidates after token ``prev`` (a target id): their log-probabilities (best first), target
        ids, and log c_d(prev) (0 without a confidence head)."""
        code = None if d == 0 else self.head.prev_code(torch.tensor([prev], device=self.states.device))  # [1, r]
        logits = self.head.conditioned_logits(self.states[d:d + 1], code) if code is not None else self.base[d:d + 1]
        top = torch.log_softmax(logits.float(), dim=-1)[0].topk(self.ranks)
        log_conf = 0.0
        if self.head.confidence is not None:
            log_conf = float(F.logsigmoid(self.head.confidence_logits(self.states[d:d + 1], code).float()))
        return top.values.tolist(), self.head.base_ids(top.indices).tolist(), log_conf

    def term(self, values: list[float], r: int, log_conf: float) -> float:
        """The score a child of rank r adds to its parent's."""
        return log_conf + values[r] - values[0] if self.by_confidence else values[r]


def grow(chain: Chain, root: torch.Tensor, budget: int, depth: int, min_logp: float,
         memo: dict[tuple[tuple[int, ...], ...], Tree]) -> Draft:
    """The ``budget`` best nodes, at most ``depth`` deep (see the module docstring) -> the Draft with their scores."""
    heap: list[tuple[float, tuple[int, ...], float, float, int]] = []  # (-score, path, path logp, path log c, token)

    def push_children(path: tuple[int, ...], score: float, logp: float, log_conf: float, prev: int) -> None:
        values, tokens, conf = chain.expand(len(path), prev)
        if log_conf + conf < chain.min_log_conf:  # the branch stops: its next position is too unsure
            return
        for r, (v, token) in enumerate(zip(values, tokens)):
            if logp + v < min_logp:
                break  # the rest rank lower
            heapq.heappush(heap, (-(score + chain.term(values, r, conf)), path + (r,), logp + v, log_conf + conf, token))

    push_children((), 0.0, 0.0, 0.0, int(root[0]))
    kept: list[tuple[tuple[int, ...], int, float]] = []  # (path, token, score)
    while heap and len(kept) < budget:
        neg, path, logp, log_conf, token = heapq.heappop(heap)
        kept.append((path, token, -neg))
        if len(path) < depth:
            push_children(path, -neg, logp, log_conf, token)
    if not kept:
        return Draft(tree=Tree.chain(0), tokens=root.clone(), scores=torch.zeros(1))
    kept.sort(key=lambda node: (len(node[0]), node[0]))  # Tree.from_choices's node order
    choices = tuple(path for path, _, _ in kept)
    tree = memo.get(choices)
    if tree is None:
        if len(memo) >= MAX_MEMO:
            memo.clear()
        tree = memo[choices] = Tree.from_choices(choices)
    tokens = torch.tensor([int(root[0])] + [token for _, token, _ in kept], dtype=root.dtype, device=root.device)
    return Draft(tree=tree, tokens=tokens, scores=torch.tensor([0.0] + [score for _, _, score in kept]))


def fill(chain: Chain, root: torch.Tensor, tree: Tree) -> Draft:
    """A static tree: node i holds rank ranks[i] of the distribution after its parent's token; nodes whose product of
    confidences is below the cut are dropped with their subtrees."""
    token, log_conf = [int(root[0])], [0.0]  # per node
    kept = [0]
    expanded: dict[int, tuple[list[float], list[int], float]] = {}
    index = {0: 0}  # old node -> new node
    parents, ranks = [-1], [0]
    for i in range(1, len(tree)):
        p = tree.parents[i]
        if p not in index:  # under a dropped node: dropped too
            token.append(-1)
            log_conf.append(-math.inf)
            continue
        if p not in expanded:
            expanded[p] = chain.expand(tree.depths[p], token[p])
        _, tokens, conf = expanded[p]
        token.append(tokens[tree.ranks[i]])
        log_conf.append(log_conf[p] + conf)
        if log_conf[i] >= chain.min_log_conf:
            index[i] = len(parents)
            parents.append(index[p])
            ranks.append(tree.ranks[i])
            kept.append(i)
    out = tree if len(kept) == len(tree) else Tree(parents=tuple(parents), ranks=tuple(ranks))
    return Draft(tree=out, tokens=torch.tensor([token[i] for i in kept], dtype=root.dtype, device=root.device))
