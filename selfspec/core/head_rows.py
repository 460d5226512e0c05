"""Greedy acceptance that computes the target's full-vocabulary logits only where the accepted path needs them.

Verifying N nodes runs the target's LM head on N rows over the whole vocabulary ([N, D] x [D, V]); on SmolLM2 in bf16
on the 2-core CPU that is 4.5 ms of a one-node step and 8.7 ms of a 21-node one (docs/BENCHMARKS.md §35), yet greedy
acceptance reads the argmax of the accepted path's nodes only. ``greedy_from_hidden`` gets the same Acceptance as
``greedy_accept`` on every node's logits, from the final hidden states, in two passes:

    1. shortlist  every node's logits over S = the first ``SHORTLIST`` token ids and the tree's own tokens
                  ([N, D] x [D, |S|], a small slice of the head); each node's argmax over S, its tentative target
    2. path       the tentative accepted path (``greedy_path`` on the tentative targets); the full-vocabulary logits
                  of its nodes only, their true targets
    3. cut        the path up to the first node whose true target differs from its tentative one: that true target
                  lies outside S (an argmax over all of V that is in S is the argmax over S), so no child of the node
                  carries it (every tree token is in S): the path ends there, the true target its bonus

Why it is exact: a node off the tentative path is accepted only if its parent's target is its token; a parent on the
path has its true target (pass 2), so its one matching child is the path's (sibling tokens distinct) or none is. Where
that does not hold (two siblings with one token) or the passes round one logit differently (a true target in S other
than the tentative one), every node's logits are computed and ``greedy_accept`` decides, as without this module.

Shapes: N tree nodes, D hidden size, V vocabulary, P nodes on the path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.core.accept import Acceptance, greedy_accept, greedy_path
from selfspec.core.tree import Tree

SHORTLIST = 8192
"""token ids 0..SHORTLIST-1 in pass 1: BPE vocabularies number tokens roughly by frequency (SmolLM2's first 8,192 are
89% of its MT-bench answers' tokens); a target token outside them only ends a path, it never breaks exactness."""


@torch.inference_mode()
def greedy_from_hidden(tree: Tree, tokens: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> tuple[Acceptance, torch.Tensor]:
    """tokens [N] (tokens[0] the root), hidden [N, D] the target's final hidden states at the nodes, weight [V, D] and
    bias [V] or None its LM head -> (the Acceptance of ``greedy_accept``, the logits [P, V] of the path's nodes)."""
    V = weight.shape[0]
    k = min(SHORTLIST, V)
    extra = torch.unique(tokens[tokens >= k])  # [E] sorted: the tree's tokens beyond the first k ids
    ids = torch.cat([torch.arange(k, device=tokens.device), extra])  # [k + E] ascending: argmax ties go to the lower id
    short = torch.cat([F.linear(hidden, weight[:k], None if bias is None else bias[:k]),
                       F.linear(hidden, weight[extra], None if bias is None else bias[extra])], dim=-1)  # [N, k + E]
    tentative = ids[short.argmax(-1)]  # [N]
    path = greedy_path(tree, tokens, tentative)
    full = F.linear(hidden[list(path)], weight, bias)  # [P, V]
    true = full.argmax(-1)  # [P]
    shortlisted = set(extra.tolist())
    for j, node in enumerate(path):
        t = int(true[j])
        wrong = t != int(tentative[node])
        if _matching_children(tree, tokens, node, t) > 1 or (wrong and (t < k or t in shortlisted)):
            return _everywhere(tree, tokens, hidden, weight, bias)
        if wrong:  # outside S: no child carries it, the path ends here
            return Acceptance(path=path[: j + 1], bonus=t), full[: j + 1]
    return Acceptance(path=path, bonus=int(true[-1])), full


def _matching_children(tree: Tree, tokens: torch.Tensor, node: int, token: int) -> int:
    return sum(int(tokens[c]) == token for c in tree.children[node])


@torch.inference_mode()
def _everywhere(tree: Tree, tokens: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[Acceptance, torch.Tensor]:
    """Every node's logits and ``greedy_accept``: the rare steps the two passes cannot decide alone."""
    logits = F.linear(hidden, weight, bias)  # [N, V]
    acc = greedy_accept(tree, tokens, logits)
    return acc, logits[list(acc.path)]
