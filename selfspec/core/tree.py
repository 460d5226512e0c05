"""A tree of draft candidates: parent pointers and the tensors a tree verification needs.

Node 0 is the root: the last token the target itself produced (not yet in the KV cache). Every other node is a draft
token. Nodes are stored in topological order (a parent before its children) and, among siblings, in the order the
acceptance rule tries them (rank 0 first: the drafter's best guess).

Letters used in shape comments: N nodes, L leaves (root-to-leaf paths), D max depth + 1.

A Medusa-style "choices" path ``(r1, r2, ..., rd)`` names the node at depth ``d`` reached by taking the ``r1``-th
candidate at depth 1, then the ``r2``-th child of that, and so on. ``Tree.from_choices([(0,), (0, 0), (1,)])`` is the
root, two candidates at depth 1 and one child under the first.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Iterable, Sequence

import torch


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]
    """parents[i] is the index of node i's parent; parents[0] == -1 (the root)."""
    ranks: tuple[int, ...]
    """ranks[i] is node i's candidate rank among its siblings (0 = tried first); ranks[0] == 0."""

    def __post_init__(self) -> None:
        if len(self.parents) == 0 or self.parents[0] != -1:
            raise ValueError(f"a tree needs a root at index 0 with parent -1; found parents={list(self.parents)[:8]}")
        if len(self.ranks) != len(self.parents):
            raise ValueError(f"ranks has {len(self.ranks)} entries, expected one per node ({len(self.parents)})")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; expected a parent index in [0, {i}) (topological order)")
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(self.parents)):
            key = (self.parents[i], self.ranks[i])
            if key in seen:
                raise ValueError(f"node {i} repeats rank {self.ranks[i]} under parent {self.parents[i]}")
            seen.add(key)

    # ----------------------------------------------------------------------------------------------- constructors
    @classmethod
    def chain(cls, k: int) -> "Tree":
        """The root followed by a single chain of k draft tokens (classic speculative decoding)."""
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return cls(parents=tuple(range(-1, k)), ranks=(0,) * (k + 1))

    @classmethod
    def from_parents(cls, parents: Sequence[int], ranks: Sequence[int] | None = None) -> "Tree":
        """From parent pointers; without ranks, siblings are ranked in index order."""
        if ranks is None:
            count: dict[int, int] = {}
            ranks = []
            for p in parents:
                ranks.append(count.get(p, 0) if p >= 0 else 0)
                count[p] = count.get(p, 0) + 1
        return cls(parents=tuple(int(p) for p in parents), ranks=tuple(int(r) for r in ranks))

    @classmethod
    def from_choices(cls, choices: Iterable[Sequence[int]]) -> "Tree":
        """From Medusa-style paths of candidate ranks; every prefix of a path must itself be a path."""
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        index: dict[tuple[int, ...], int] = {(): 0}
        parents, ranks = [-1], [0]
        for path in paths:
            if len(path) == 0:
                continue
            if any(r < 0 for r in path):
                raise ValueError(f"choice {list(path)} has a negative rank")
            if path[:-1] not in index:
                raise ValueError(f"choice {list(path)} has no parent: add {list(path[:-1])} to the choices")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(parents=tuple(parents), ranks=tuple(ranks))

    @classmethod
    def best_first(cls, logp: torch.Tensor, budget: int,
                   min_logp: float = -math.inf) -> tuple[tuple[int, ...], ...]:
        """The ``budget`` rank paths with the highest cumulative draft probability (EAGLE-2's dynamic tree), for a
        drafter whose depth-d candidates do not depend on the path above them (Medusa heads): logp [K, R] holds the
        log-probabilities of each depth's top-R candidates, best first. Returns the choices, parents first; a path's
        score is the sum of its ranks' log-probabilities, so every prefix of a chosen path scores at least as high
        and is chosen too. Paths scoring below ``min_logp`` are left out (none at all when the best one does)."""
        K, R = logp.shape
        if budget < 1:
            raise ValueError(f"a dynamic tree needs a node budget >= 1, found {budget}")
        lp = logp.tolist()
        heap = [(-lp[0][r], (r,)) for r in range(R)]
        heapq.heapify(heap)
        chosen: list[tuple[int, ...]] = []
        while heap and len(chosen) < budget and -heap[0][0] >= min_logp:
            neg, path = heapq.heappop(heap)
            chosen.append(path)
            if len(path) < K:
                for r in range(R):
                    heapq.heappush(heap, (neg - lp[len(path)][r], path + (r,)))
        return tuple(sorted(chosen, key=lambda c: (len(c), c)))

    @classmethod
    def best_scored(cls, parent: Sequence[int], score: Sequence[float], depth: Sequence[int],
                    budget: int, min_logp: float = -math.inf) -> tuple["Tree", list[int]]:
        """EAGLE-2's rerank, for candidates grown by a drafter whose guesses depend on the path above them (EAGLE and
        Hydra heads): node i (0 the root) has ``parent[i]``, cumulative draft log-probability ``score[i]`` and
        ``depth[i]``. Keeps the ``budget`` best-scored nodes whose parent is kept (a child never scores above its
        parent), lays them out by depth, siblings best first, and returns the tree and the kept nodes in its order
        (tree node j + 1 is candidate kept[j]). Nodes scoring below ``min_logp`` are left out."""
        kept: list[int] = []
        keep = {0}
        for i in sorted(range(1, len(parent)), key=lambda i: (-score[i], depth[i], i)):
            if score[i] < min_logp:
                break
            if parent[i] in keep:
                kept.append(i)
                keep.add(i)
                if len(kept) == budget:
                    break
        kept.sort(key=lambda i: (depth[i], -score[i], i))
        index = {0: 0}
        parents, ranks, seen = [-1], [0], {}
        for i in kept:
            index[i] = len(parents)
            p = index[parent[i]]
            parents.append(p)
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return cls(parents=tuple(parents), ranks=tuple(ranks)), kept

    @classmethod
    def full(cls, topk: Sequence[int]) -> "Tree":
        """Every combination: topk[d] children under every node at depth d (a full k-ary tree per level)."""
        choices: list[tuple[int, ...]] = [()]
        out: list[tuple[int, ...]] = []
        for k in topk:
            choices = [c + (r,) for c in choices for r in range(k)]
            out.extend(choices)
        return cls.from_choices(out)

    # ------------------------------------------------------------------------------------------ derived structure
    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def depth(self) -> int:
        """Number of draft levels below the root."""
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        """True when every node has at most one child (plain causal attention verifies it)."""
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    @property
    def max_rank(self) -> int:
        """Largest candidate rank used anywhere (a drafter must offer top-(max_rank + 1))."""
        return max(self.ranks)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: node i's children, in the order they are tried (by rank)."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            kids[self.parents[i]].append(i)
        return tuple(tuple(sorted(k, key=lambda j: self.ranks[j])) for k in kids)

    @cached_property
    def choices(self) -> tuple[tuple[int, ...], ...]:
        """The Medusa-style rank path of every non-root node (inverse of from_choices)."""
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(self.parents)):
            paths.append(paths[self.parents[i]] + (self.ranks[i],))
        return tuple(paths[1:])

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        path = [i]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    # --------------------------------------------------------------------------------------------------- tensors
    def on(self, device: torch.device | str) -> "TreeTensors":
        """The tensors a verification and an acceptance rule read, built on ``device`` once per tree and device: the
        parent pointers go over as N integers, everything else is computed there (no host read, no Python loop per
        node)."""
        device = torch.device(device)
        cached = self._tensors.get(device)
        if cached is None:
            cached = self._tensors[device] = TreeTensors.build(self, device)
        return cached

    @cached_property
    def _tensors(self) -> dict[torch.device, "TreeTensors"]:
        return {}

    @property
    def ancestor_mask(self) -> torch.Tensor:
        """bool [N, N]: mask[i, j] is True when node j is node i or one of its ancestors (i may attend to j)."""
        return self.on("cpu").ancestors

    @property
    def depth_tensor(self) -> torch.Tensor:
        """long [N]: each node's depth, the offset of its position id from the root's."""
        return self.on("cpu").depth

    @property
    def parent_tensor(self) -> torch.Tensor:
        """long [N]: parent indices, with the root pointing at itself (so gathers stay in range)."""
        return self.on("cpu").parent

    @property
    def leaf_paths(self) -> torch.Tensor:
        """long [L, D]: root-to-leaf node indices, right-padded with -1."""
        return self.on("cpu").leaf_paths


@dataclass(frozen=True)
class TreeTensors:
    """A tree's tensors on one device (``Tree.on``). N nodes, L leaves, D = depth + 1, M = most children of a node."""

    parent: torch.Tensor
    """long [N]: parent indices, the root pointing at itself (so gathers stay in range)."""
    depth: torch.Tensor
    """long [N]: each node's depth."""
    ancestors: torch.Tensor
    """bool [N, N]: [i, j] True when j is i or one of its ancestors."""
    leaf_paths: torch.Tensor
    """long [L, D]: root-to-leaf node indices, right-padded with -1 (leaves in index order)."""
    children: torch.Tensor
    """long [N, M]: each node's children in the order they are tried (by rank), right-padded with -1 (M >= 1)."""
    inner: torch.Tensor
    """long [I]: the nodes that have children, in index order."""

    @classmethod
    def build(cls, tree: Tree, device: torch.device) -> "TreeTensors":
        n, width = len(tree), tree.depth + 1
        parent = torch.tensor([max(p, 0) for p in tree.parents], dtype=torch.long, device=device)  # [N]
        ancestors = ancestor_mask(parent, tree.depth)  # [N, N]
        depth = ancestors.sum(-1) - 1  # [N] a node's ancestors, itself left out
        leaves = torch.tensor([i for i in range(n) if not tree.children[i]], dtype=torch.long, device=device)  # [L]
        at = ancestors[leaves][:, :, None] & (depth[None, :, None] == torch.arange(width, device=device))  # [L, N, D]
        nodes = torch.arange(n, device=device)[None, :, None]
        leaf_paths = torch.where(at.any(1), (at * nodes).sum(1), -1)  # [L, D]: the one node per (leaf, depth)
        most = max(1, max(len(k) for k in tree.children))
        children = torch.tensor([list(k) + [-1] * (most - len(k)) for k in tree.children], dtype=torch.long,
                                device=device)  # [N, M]
        inner = torch.tensor([i for i in range(n) if tree.children[i]], dtype=torch.long, device=device)  # [I]
        return cls(parent=parent, depth=depth, ancestors=ancestors, leaf_paths=leaf_paths, children=children,
                   inner=inner)


def ancestor_mask(parent: torch.Tensor, depth: int) -> torch.Tensor:
    """parent long [N] (the root pointing at itself), the tree's depth -> bool [N, N]: [i, j] True when j is i or an
    ancestor of i. Pointer doubling on parent's device: after k rounds each row holds the ancestors up to 2^k levels
    up, so ceil(log2(depth)) rounds of [N, N] gathers build it, whatever the tree."""
    n = parent.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=parent.device)  # [N, N]
    mask = eye | eye[parent]  # node and parent
    jump, reach = parent, 1  # jump[i]: the ancestor 'reach' levels up (the root saturates)
    while reach < depth:
        mask = mask | mask[jump]  # rows reach..2*reach up
        jump, reach = jump[jump], 2 * reach
    return mask


class TokenTrie:
    """A tree of draft tokens grown by insertion (n-gram continuations, merged drafts): one node per (parent, token),
    siblings ranked in the order they were added, node 0 the root."""

    def __init__(self, root: int):
        self.parents, self.ranks, self.tokens = [-1], [0], [root]
        self._child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        self._num_children = [0]

    def __len__(self) -> int:
        return len(self.parents)

    def child(self, parent: int, token: int) -> int | None:
        return self._child.get((parent, token))

    def add(self, parent: int, token: int) -> int:
        """The node for ``token`` under ``parent``, added as its parent's last-ranked child if it is new."""
        node = self._child.get((parent, token))
        if node is None:
            node = self._child[(parent, token)] = len(self.parents)
            self.parents.append(parent)
            self.ranks.append(self._num_children[parent])
            self._num_children[parent] += 1
            self._num_children.append(0)
            self.tokens.append(token)
        return node

    def tree(self) -> Tree:
        return Tree(parents=tuple(self.parents), ranks=tuple(self.ranks))


def cut_logp(min_prob: float) -> float:
    """The adaptive length's cut as a log-probability: log(min_prob), -inf for 0 (no cut). 0 <= min_prob < 1."""
    if not 0.0 <= min_prob < 1.0:
        raise ValueError(f"a dynamic tree's min_prob is a probability below 1: expected 0 <= min_prob < 1, found "
                         f"{min_prob}")
    return math.log(min_prob) if min_prob > 0 else -math.inf


@dataclass(frozen=True)
class DynamicTree:
    """Not one tree but a rule for one per step: the ``budget`` draft nodes of highest cumulative draft probability,
    from each depth's top ``max_rank`` candidates (``Tree.best_first``), at most ``depth`` deep (None: as deep as the
    drafter drafts), and none whose cumulative draft probability is below ``min_prob`` — the adaptive length: a
    confident draft sends a long, narrow tree, an unsure one a short tree or none, so the verifier's width follows
    the draft's own confidence step by step. ``--tree dynamic:64``, ``dynamic:24,depth=4`` or
    ``dynamic:24,depth=4,min_prob=0.05``."""

    budget: int
    max_rank: int = 8
    depth: int | None = None
    min_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.budget < 1 or self.max_rank < 1 or (self.depth is not None and self.depth < 1):
            raise ValueError(f"a dynamic tree needs budget >= 1, max_rank >= 1 and depth >= 1 (or none), found "
                             f"{self.budget}, {self.max_rank}, {self.depth}")
        cut_logp(self.min_prob)  # refuses a min_prob that is no probability below 1

    @property
    def min_logp(self) -> float:
        """log(min_prob): the lowest cumulative draft log-probability a node may have (-inf: no cut)."""
        return cut_logp(self.min_prob)

    @classmethod
    def resized(cls, rule: "DynamicTree | None", budget: int, depth: int | None) -> "DynamicTree":
        """``rule`` at another budget and depth, its other settings (max_rank, min_prob) kept; None: the default rule
        (what ``Drafter.resized`` builds for budget tuning)."""
        return cls(budget, depth=depth) if rule is None else replace(rule, budget=budget, depth=depth)

    @property
    def spec(self) -> str:
        """The --tree string that gives this rule back ('dynamic:24,depth=4'; 'dynamic:24,depth=4,max_rank=4' is not
        a --tree form, so a rule of another max_rank has none)."""
        if self.max_rank != DynamicTree.max_rank:
            raise ValueError(f"a dynamic tree with max_rank={self.max_rank} has no --tree form (--tree dynamic:N takes "
                             f"the top {DynamicTree.max_rank} candidates per depth)")
        return (f"dynamic:{self.budget}" + (f",depth={self.depth}" if self.depth is not None else "")
                + (f",min_prob={self.min_prob:g}" if self.min_prob > 0 else ""))


def read_candidates(ids: torch.Tensor, values: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """ids long [Q, k] and values [Q, k] (a depth's top-k per expanded node) -> the same as Python lists, in one host
    read: what a drafter growing its tree on the host (``Tree.best_scored``) reads once per depth, never per node.
    (Token ids are exact in float64.)"""
    both = torch.stack([ids.to(torch.float64), values.to(torch.float64)]).tolist()  # [2][Q][k]
    return [[int(i) for i in row] for row in both[0]], both[1]
