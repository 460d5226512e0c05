"""Prompt-lookup / n-gram tree drafting: no training, no extra weights.

The last n tokens (n from ``max_ngram`` down to ``min_ngram``) are looked up earlier in the prompt and the text
generated so far; the continuations that followed each match, most recent first and longest match first, are merged
into a trie under a node budget. Code, extraction and summarisation repeat their input, so their drafts run deep.

A match of the whole ``max_ngram`` is the likeliest to go on copying: with ``copy_depth`` its first continuation runs
that deep (the trie ``copy_depth - depth`` nodes bigger), the others and shorter matches ``depth`` deep.
"""

from __future__ import annotations

import torch

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftKind, DraftState
from selfspec.core.tree import TokenTrie


class NGramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, depth: int = 8, max_nodes: int = 24,
                 max_matches: int = 8, copy_depth: int | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"expected 1 <= min_ngram <= max_ngram, found min_ngram={min_ngram}, max_ngram={max_ngram}")
        if depth < 1 or max_nodes < 1 or max_matches < 1:
            raise ValueError(f"depth, max_nodes and max_matches must be >= 1, found {depth}, {max_nodes}, {max_matches}")
        if copy_depth is not None and copy_depth < depth:
            raise ValueError(f"copy_depth (how deep a whole-max_ngram match's continuation runs) must be >= depth "
                             f"({depth}), found {copy_depth}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.depth, self.max_nodes, self.max_matches = depth, max_nodes, max_matches
        self.copy_depth = copy_depth

    def continuations(self, tokens: torch.Tensor) -> list[list[int]]:
        """Token runs that followed earlier occurrences of the current suffix, best first. tokens [T]."""
        return self.matches(tokens)[0]

    def matches(self, tokens: torch.Tensor) -> tuple[list[list[int]], int]:
        """``continuations(tokens)`` and the length of the suffix the first of them matched (0: none). tokens [T]."""
        t = tokens.shape[0]
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        longest = 0
        for n in range(min(self.max_ngram, t - 1), self.min_ngram - 1, -1):
            windows = tokens[: t - 1].unfold(0, n, 1)  # [T - n, n] every earlier n-gram that has a successor
            hits = (windows == tokens[t - n :]).all(dim=-1).nonzero().flatten().tolist()
            for start in reversed(hits):  # most recent first
                deep = self.copy_depth if self.copy_depth and n == self.max_ngram and not found else self.depth
                cont = tokens[start + n : start + n + deep].tolist()
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    longest = longest or n
                if len(found) >= self.max_matches:
                    return found, longest
        return found, longest

    def trie(self, tokens: torch.Tensor, continuations: list[list[int]] | None = None) -> TokenTrie:
        """The continuations (default: ``continuations(tokens)``) merged into a trie under the root tokens[-1], in
        order, until it holds ``max_nodes`` drafts (and the extra nodes of a ``copy_depth`` continuation). tokens
        [T]."""
        found = self.continuations(tokens) if continuations is None else continuations
        extra = max(len(found[0]) - self.depth, 0) if found else 0  # a copy_depth continuation's nodes beyond depth
        trie = TokenTrie(int(tokens[-1]))
        for cont in found:
            node = 0
            for tok in cont:
                nxt = trie.child(node, tok)
                if nxt is None:
                    if len(trie) >= self.max_nodes + extra + 1:
                        break
                    nxt = trie.add(node, tok)
                node = nxt
        return trie

    def draft(self, state: DraftState) -> Draft:
        found, copying = self.matches(state.tokens)
        trie = self.trie(state.tokens, found)
        return Draft(tree=trie.tree(), tokens=torch.tensor(trie.tokens, dtype=torch.long, device=state.tokens.device),
                     copying=copying)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


KIND = DraftKind(fixed_trees=False, dynamic_trees=True)
"""``--draft ngram``: it grows its own trie, so no fixed tree; ``--tree dynamic:N,depth=D`` sizes that trie (max_nodes
N, depth D). ``infer.py tune-tree`` tunes those two options (``budget.tune_lookup``), not a budget of scored nodes."""
