"""Greedy acceptance that computes the target's full-vocabulary logits only where the accepted path needs them.

Verifying N nodes runs the target's LM head on N rows over the whole vocabulary ([N, D] x [D, V]); for a small model
with a large vocabulary on a CPU that is a large share of a step (docs/benchmarks/log.md, "The LM head on the
accepted path's nodes only"), yet greedy acceptance reads the argmax of the accepted path's nodes only. ``greedy_from_hidden`` gets the same Acceptance as
``greedy_accept`` on every node's logits, from the final hidden states, in two passes:

    1. shortlist  every node's logits over S = the first ``SHORTLIST`` token ids and the tree's own tokens
                  ([N, D] x [D, |S|], a small slice of the head); each node's argmax over S, its tentative target
    2. path       the tentative accepted path (``greedy_path`` on the tentative targets); its nodes' logits over
                  the rest of the vocabulary (ids SHORTLIST..V-1, the head's tail), which with pass 1's logits over
                  ids 0..SHORTLIST-1 are their full-vocabulary logits: their true targets (the head's weights read
                  once in all, as one row's logits read them)
    3. cut        the path up to the first node whose true target differs from its tentative one: that true target
                  lies outside S (an argmax over all of V that is in S is the argmax over S), so no child of the node
                  carries it (every tree token is in S): the path ends there, the true target its bonus

Every pass runs on the device over the tentative path padded to the tree's depth (a path's nodes are not known to
the host before the step's one read, ``accept.read``; the padding rows cost the head's product a few rows more, which
reads the same weights). A batch (``rows_accept``) runs each pass once for all its rows.
Step 2's product is ``lm_head``: in fp32 on a
CPU it is computed as weight @ rows.T, several times faster there than transformers' order for a few rows.

Why it is exact: a node off the tentative path is accepted only if its parent's target is its token; a parent on the
path has its true target (pass 2), so its one matching child is the path's (sibling tokens distinct) or none is. Where
that does not hold (two siblings with one token) or the passes round one logit differently (a true target in S other
than the tentative one), every node's logits are computed and ``greedy_accept`` decides, as without this module.

Shapes: N tree nodes, D hidden size, V vocabulary, P nodes on the path, W = the tree's depth + 1 (a padded path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from selfspec.core.accept import Acceptance, at, greedy_accept, greedy_run, read
from selfspec.core.drafter import Draft
from selfspec.core.tree import Tree

SHORTLIST = 8192
"""token ids 0..SHORTLIST-1 in pass 1: BPE vocabularies number tokens roughly by frequency (the share of a workload's
tokens the first ids cover is measured in docs/benchmarks/log.md, "The LM head on the accepted path's nodes only"); a
target token outside them only ends a path, it never breaks exactness."""

FEW = 2
"""trees of at most this many nodes get every node's logits at once: the two passes read the shortlist's rows and then
the whole head for one or two rows anyway (a one-node step is dearer through them: docs/benchmarks/log.md, "Where a tree
verification's time goes")."""


@dataclass(frozen=True)
class Tentative:
    """Pass 1's verdict on one tree: the tentative path and every node's tentative target, on the device."""

    nodes: torch.Tensor
    """long [W] the tentative path from the root, valid up to ``length``."""
    length: torch.Tensor
    """long [] its nodes, the root included."""
    targets: torch.Tensor
    """[N] each node's argmax over the shortlist."""
    head: torch.Tensor
    """[N, k] each node's logits over ids 0..k-1 (pass 1's), the first k of its full-vocabulary logits."""
    shortlist: int
    """k: ids 0..k-1 are in the shortlist."""
    extra: torch.Tensor
    """long [E] the tree's tokens beyond them, in the shortlist too."""

    @property
    def path(self) -> tuple[int, ...]:
        """The tentative path as node indices (a host read: for tests and tools, never the loop)."""
        flat = torch.cat([self.nodes, self.length.reshape(1)]).tolist()
        return tuple(flat[: flat[-1]])


@torch.inference_mode()
def greedy_from_hidden(tree: Tree, tokens: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[Acceptance, torch.Tensor]:
    """tokens [N] (tokens[0] the root), hidden [N, D] the target's final hidden states at the nodes, weight [V, D] and
    bias [V] or None its LM head -> (the Acceptance of ``greedy_accept``, the logits [P, V] of the path's nodes)."""
    if len(tree) <= FEW:  # the head over every node costs what the two passes would
        return _everywhere(tree, tokens, hidden, weight, bias)
    [guess] = tentatives([(tree, tokens)], hidden[None], weight, bias)
    [full] = path_logits([guess], hidden[guess.nodes], weight, bias)  # [W, V]
    return settle(tree, tokens, guess, full) or _everywhere(tree, tokens, hidden, weight, bias)


@torch.inference_mode()
def tentatives(trees: Sequence[tuple[Tree, torch.Tensor]], hidden: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> list[Tentative]:
    """Step 1 and the tentative paths of step 2 for B trees (tree, tokens [N_b]) verified in the rows of hidden
    [B, N, D]: one shortlist product for all of them, the shortlist's extra ids every tree's tokens."""
    k = min(SHORTLIST, weight.shape[0])
    tokens = torch.cat([t for _, t in trees])
    extra = torch.unique(tokens[tokens >= k])  # [E] sorted: the trees' tokens beyond the first k ids
    ids = torch.cat([torch.arange(k, device=tokens.device), extra])  # [k + E] ascending: argmax ties go to the lower id
    short = torch.cat([F.linear(hidden, weight[:k], None if bias is None else bias[:k]),
                       F.linear(hidden, weight[extra], None if bias is None else bias[extra])], dim=-1)  # [B, N, k + E]
    targets = ids[short.argmax(-1)]  # [B, N]
    return [Tentative(*greedy_run(tree, toks, targets[b, : len(tree)]), targets=targets[b, : len(tree)],
                      head=short[b, : len(tree), :k], shortlist=k, extra=extra)
            for b, (tree, toks) in enumerate(trees)]


def path_logits(guesses: Sequence[Tentative], rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> list[torch.Tensor]:
    """Step 2's product, once for B trees: rows [sum W_b, D], the final hidden states of each guess's padded path
    nodes in turn -> each padded path's full-vocabulary logits [W_b, V]: pass 1's over ids 0..k-1, the head's tail
    (ids k..V-1) computed now."""
    k = guesses[0].shortlist
    tails = lm_head(rows, weight[k:], None if bias is None else bias[k:]).split([g.nodes.shape[0] for g in guesses])
    return [torch.cat([g.head[g.nodes], tail], dim=-1) for g, tail in zip(guesses, tails)]  # W_b x [W_b, V]


def lm_head(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [P, D] -> logits [P, V]. fp32 on a CPU as weight @ rows.T with at least two rows: a CPU's fp32 product
    for a few rows is several times faster this way round (docs/benchmarks/log.md, "The LM head on the accepted path's
    nodes only")."""
    if rows.dtype != torch.float32 or rows.device.type != "cpu":
        return F.linear(rows, weight, bias)
    p = rows.shape[0]
    out = (weight @ (rows if p >= 2 else rows.expand(2, -1)).T).T[:p]  # [P, V]
    return out if bias is None else out + bias


def settle(tree: Tree, tokens: torch.Tensor, guess: Tentative,
           full: torch.Tensor) -> tuple[Acceptance, torch.Tensor] | None:
    """Step 3: the full logits [W, V] of the tentative (padded) path's nodes -> (the Acceptance, the accepted path's
    logits), or None where the two passes cannot decide alone (every node's logits must). Along the path, the first
    node whose true target is not its tentative one ends it (its true target the bonus) unless that target is in the
    shortlist; a node with two children carrying its true target cannot be decided either. One host read."""
    t = tree.on(tokens.device)
    true = full.argmax(-1)  # [W]
    wrong = true != guess.targets[guess.nodes]  # [W]
    kids = t.children[guess.nodes]  # [W, M]
    twins = ((tokens[kids.clamp(min=0)] == true[:, None]) & (kids >= 0)).sum(-1) > 1  # [W]
    listed = (true < guess.shortlist) | torch.isin(true, guess.extra)  # [W]
    bad = twins | (wrong & listed)
    on_path = torch.arange(true.shape[0], device=true.device) < guess.length
    stop = on_path & (bad | wrong)  # [W]
    end = torch.where(stop.any(), stop.long().argmax(), guess.length - 1)  # the path's last node's place
    undecided = stop.any() & at(bad, end)
    acc = read(tokens, guess.nodes, torch.where(undecided, 0, end + 1), at(true, end))  # length 0: undecided
    return (acc, full[: len(acc.path)]) if acc.path else None


@torch.inference_mode()
def rows_accept(drafts: Sequence[Draft], hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[list[Acceptance], list[torch.Tensor]]:
    """A batch's rows: drafts[b] verified in row b of hidden [B, N, D] -> each row's Acceptance and its path's logits
    [P_b, V]; step 2's LM head runs once, on every row's tentative path (the head's weights read once)."""
    guesses = tentatives([(d.tree, d.tokens) for d in drafts], hidden, weight, bias)
    rows = torch.cat([hidden[b, g.nodes] for b, g in enumerate(guesses)])  # [sum W_b, D]
    full = path_logits(guesses, rows, weight, bias)  # W_b x [W_b, V]
    out = [settle(d.tree, d.tokens, g, f) or _everywhere(d.tree, d.tokens, hidden[b, : len(d.tree)], weight, bias)
           for b, (d, g, f) in enumerate(zip(drafts, guesses, full))]
    return [a for a, _ in out], [logits for _, logits in out]


@torch.inference_mode()
def _everywhere(tree: Tree, tokens: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[Acceptance, torch.Tensor]:
    """Every node's logits and ``greedy_accept``: a tree of at most ``FEW`` nodes, and the rare steps the two passes
    cannot decide alone."""
    logits = lm_head(hidden, weight, bias)  # [N, V]
    acc = greedy_accept(tree, tokens, logits)
    return acc, logits[list(acc.path)]
