"""NGramDrafter: which continuations it finds, and the trie it builds from them."""

from __future__ import annotations

import pytest
import torch

from selfspec import DraftState, NGramDrafter, Sampling, Tree


def state(tokens: list[int]) -> DraftState:
    return DraftState(tokens=torch.tensor(tokens), prompt_length=len(tokens), hidden=torch.zeros(4), cache=None,
                      sampling=Sampling())


def test_longest_match_and_duplicates_dropped():
    # the suffix [1, 2, 3] occurred at the start; shorter suffixes find the same continuation again
    assert NGramDrafter().continuations(torch.tensor([1, 2, 3, 4, 1, 2, 3])) == [[4, 1, 2, 3]]


def test_most_recent_match_first_and_depth():
    tokens = torch.tensor([5, 1, 7, 5, 1, 8, 5, 1])
    assert NGramDrafter(depth=3).continuations(tokens) == [[8, 5, 1], [7, 5, 1]]
    assert NGramDrafter(depth=3, max_matches=1).continuations(tokens) == [[8, 5, 1]]


def test_min_ngram():
    tokens = torch.tensor([4, 6, 9, 6])  # only a 1-gram ([6]) matches
    assert NGramDrafter(depth=2).continuations(tokens) == [[9, 6]]
    assert NGramDrafter(depth=2, min_ngram=2).continuations(tokens) == []


def test_no_match_drafts_the_root_alone():
    d = NGramDrafter().draft(state([1, 2, 3]))
    assert d.tree == Tree.chain(0) and d.tokens.tolist() == [3] and d.q is None and d.copying == 0


def test_a_draft_says_how_long_a_suffix_its_first_continuation_matched():
    """Draft.copying: the n of the longest n-gram match (what a merge's skip_match reads), kept when the loop cuts
    the draft."""
    assert NGramDrafter().draft(state([1, 2, 3, 4, 1, 2, 3])).copying == 3
    assert NGramDrafter().draft(state([5, 1, 7, 5, 1, 8, 5, 1])).copying == 2  # [5, 1] occurred before, [8, 5, 1] not
    assert NGramDrafter(max_ngram=1).draft(state([5, 1, 7, 5, 1])).copying == 1
    assert NGramDrafter().matches(torch.tensor([4, 6, 9, 6])) == ([[9, 6]], 1)
    assert NGramDrafter().draft(state([1, 2, 3, 4, 1, 2, 3])).truncated(1).copying == 3


def test_draft_is_a_trie_of_the_continuations():
    d = NGramDrafter(depth=3).draft(state([5, 1, 7, 5, 1, 8, 5, 1]))
    # root 1; rank 0: 8 -> 5 -> 1 (most recent), rank 1: 7 -> 5 -> 1
    assert d.tokens.tolist() == [1, 8, 5, 1, 7, 5, 1]
    assert d.tree.parents == (-1, 0, 1, 2, 0, 4, 5)
    assert d.tree.ranks == (0, 0, 0, 0, 1, 0, 0)


def test_shared_prefixes_are_merged():
    d = NGramDrafter().draft(state([9, 3, 4, 9, 3, 5, 9]))
    # continuations [3, 5, 9] and [3, 4, 9, 3, 5, 9] share their first token: one node 3 with two children
    assert d.tokens.tolist() == [9, 3, 5, 9, 4, 9, 3, 5, 9]
    assert d.tree.parents == (-1, 0, 1, 2, 1, 4, 5, 6, 7)
    assert [d.tokens[c].item() for c in d.tree.children[1]] == [5, 4]


def test_node_budget():
    tokens = [9, 3, 4, 9, 3, 5, 9]
    for budget in range(1, 9):
        d = NGramDrafter(max_nodes=budget).draft(state(tokens))
        assert len(d.tree) == budget + 1
        full = NGramDrafter().draft(state(tokens))
        assert d.tokens.tolist() == full.tokens[: budget + 1].tolist()  # the best continuations are kept first


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_ngram=0), r"expected 1 <= min_ngram <= max_ngram, found min_ngram=0, max_ngram=3"),
        (dict(min_ngram=4, max_ngram=3), r"expected 1 <= min_ngram <= max_ngram, found min_ngram=4, max_ngram=3"),
        (dict(depth=0), r"depth, max_nodes and max_matches must be >= 1, found 0, 24, 8"),
        (dict(max_nodes=0), r"depth, max_nodes and max_matches must be >= 1, found 8, 0, 8"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NGramDrafter(**kwargs)


def test_copy_depth_runs_a_whole_max_ngram_match_deeper_and_nothing_else():
    """copy_depth: the first continuation of a match of the whole max_ngram runs copy_depth deep, with that many more
    nodes in the trie; a shorter match, and the continuations after the first, stay ``depth`` deep."""
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3]  # [1, 2, 3] matched: the copy 4 .. 11, 1, 2, 3 follows
    plain, deep = NGramDrafter(depth=3, max_nodes=4), NGramDrafter(depth=3, max_nodes=4, copy_depth=8)
    assert plain.draft(state(text)).tokens.tolist() == [3, 4, 5, 6]
    d = deep.draft(state(text))
    assert d.tokens.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11] and d.tree == Tree.chain(8) and d.copying == 3
    two = [9, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]  # only [2, 3] matches: depth 3
    assert deep.draft(state(two)).tokens.tolist() == [3, 4, 5, 6]
    several = [5, 1, 7, 7, 7, 5, 1, 8, 8, 8, 9, 5, 1]  # max_ngram 2: the newest match copies deep, the older one not
    d = NGramDrafter(max_ngram=2, depth=2, max_nodes=8, copy_depth=4).draft(state(several))
    assert [d.tokens[i].item() for i in range(len(d.tree)) if d.tree.depths[i] == 1] == [8, 7]
    assert d.tree.depth == 4 and len(d.tree) == 1 + 4 + 2
    with pytest.raises(ValueError, match="copy_depth .* must be >= depth \\(3\\), found 2"):
        NGramDrafter(depth=3, copy_depth=2)
