"""Several drafters as one: their trees merged into one trie, verified in one forward.

A trained head and prompt lookup fail on different steps: the head guesses generic continuations, the n-gram trie
copies spans of the prompt and of the answer so far (names, code, quoted text), which the head rarely ranks first.
Verifying both in one tree accepts what either would have, for one target forward; on this CPU a 24-node verify costs
little more than a 12-node one (docs/BENCHMARKS.md §1).

    1. draft   every drafter drafts from the same state
    2. merge   their trees become one trie: a node is one token under one parent, so a path two drafters share is
               verified once; nodes keep the order they came in (the first drafter's first), siblings ranked in that
               order, which the acceptance rules follow
    3. update  every drafter hears the verdict on its own draft, in its own node indices

The merged draft is deterministic (q = None): a draft node is treated as a point mass on its token, which keeps
sampling lossless whatever drew the candidates (``accept.sample_accept``). Drafters that verify with their own
target (``verifier()``: early exit reuses the early layers it ran while drafting) cannot be merged.

Shapes: N nodes of the merged tree, N_k nodes of drafter k's tree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfspec.accept import Acceptance
from selfspec.drafter import Draft, Drafter, DraftState
from selfspec.tree import Tree


def merge_drafts(drafts: Sequence[Draft]) -> Draft:
    """One trie of every draft's nodes, in the order given. All drafts must share the root token."""
    root = int(drafts[0].tokens[0])
    for k, d in enumerate(drafts):
        if int(d.tokens[0]) != root:
            raise ValueError(f"drafts to merge must share the root token: draft 0 has {root}, draft {k} has "
                             f"{int(d.tokens[0])}")
    parents, ranks, tokens = [-1], [0], [root]
    child: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    num_children = [0]
    for d in drafts:
        to_merged = [0] * len(d.tree)
        ids = d.tokens.tolist()  # [N_k]
        for i in range(1, len(d.tree)):
            p, tok = to_merged[d.tree.parents[i]], ids[i]
            node = child.get((p, tok))
            if node is None:
                node = len(parents)
                child[(p, tok)] = node
                parents.append(p)
                ranks.append(num_children[p])
                num_children[p] += 1
                num_children.append(0)
                tokens.append(tok)
            to_merged[i] = node
    return Draft(tree=Tree(parents=tuple(parents), ranks=tuple(ranks)),
                 tokens=torch.tensor(tokens, dtype=drafts[0].tokens.dtype, device=drafts[0].tokens.device))


def restrict(accepted: Sequence[int], own: Draft) -> Acceptance:
    """The verdict on a merged tree as one of its drafts saw it. accepted: the tokens the step added (the accepted
    drafts, then the bonus). Returns the longest prefix of them that is a path of ``own``'s tree, in its node indices,
    and the target's token after that prefix. Token paths, not node indices: the loop may have cut the merged tree."""
    children = own.tree.children
    ids = own.tokens.tolist()  # [N_k]
    path = [0]
    for tok in accepted[:-1]:
        nxt = next((c for c in children[path[-1]] if ids[c] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
    return Acceptance(path=tuple(path), bonus=accepted[len(path) - 1])


class MergedDrafter:
    """``--draft A+B``: the drafts of A and B (and more) verified as one tree."""

    def __init__(self, drafters: Sequence[Drafter]):
        if len(drafters) < 2:
            raise ValueError(f"merging needs at least two drafters, found {len(drafters)}")
        for d in drafters:
            if callable(getattr(d, "verifier", None)):
                raise ValueError(f"{type(d).__name__} verifies its drafts with its own target (it reuses the work it "
                                 "did while drafting), so it cannot share a tree with other drafters; use it alone")
        self.drafters = list(drafters)
        self._drafts: list[Draft] = []

    def draft(self, state: DraftState) -> Draft:
        # 1. draft; 2. merge
        self._drafts = [d.draft(state) for d in self.drafters]
        return merge_drafts(self._drafts)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        # 3. each drafter hears the verdict on its own draft
        accepted = [int(draft.tokens[i]) for i in acceptance.path[1:]] + [acceptance.bonus]
        for d, own in zip(self.drafters, self._drafts):
            d.update(own, restrict(accepted, own))
