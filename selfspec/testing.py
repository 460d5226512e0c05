"""Drafters for tests: one that knows the answer, one that guesses at random.

``OracleDrafter`` places the target's own continuation on a chosen branch of a static tree (and random tokens on the
other branches), so every step accepts the whole oracle branch. ``RandomDrafter`` fills the tree with random tokens: the
adversarial case, where almost nothing is accepted. Both must leave the output identical to plain decoding.
"""

from __future__ import annotations

from typing import Sequence

import torch

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftState
from selfspec.core.tree import Tree


class RandomDrafter(Drafter):
    def __init__(self, tree: Tree, vocab_size: int, seed: int = 0):
        self.tree, self.vocab_size = tree, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def draft(self, state: DraftState) -> Draft:
        toks = torch.randint(0, self.vocab_size, (len(self.tree),), generator=self.generator)
        toks[0] = state.tokens[-1]
        return Draft(tree=self.tree, tokens=toks.to(state.tokens.device))

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


class OracleDrafter(RandomDrafter):
    """continuation: the tokens the target generates after the prompt (from plain ``generate``)."""

    def __init__(self, tree: Tree, vocab_size: int, continuation: Sequence[int], branch_rank: int = 0, seed: int = 0):
        super().__init__(tree, vocab_size, seed)
        self.continuation = list(continuation)
        # the oracle branch: from the root, always the child of rank `branch_rank` (or the last child if fewer)
        branch, node = [], 0
        while tree.children[node]:
            kids = tree.children[node]
            node = next((c for c in kids if tree.ranks[c] == branch_rank), kids[-1])
            branch.append(node)
        self.branch = branch

    def draft(self, state: DraftState) -> Draft:
        draft = super().draft(state)
        done = state.tokens.shape[0] - state.prompt_length  # generated so far, root included
        for j, node in enumerate(self.branch):
            if done + j < len(self.continuation):
                draft.tokens[node] = self.continuation[done + j]
        return draft
