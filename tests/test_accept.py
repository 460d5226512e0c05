"""Acceptance rules on stub logits and stub distributions: exact outcomes (distributions: test_distribution.py)."""

from __future__ import annotations

import pytest
import torch

from selfspec import Acceptance, Tree, greedy_accept, sample_accept, typical_accept

V = 8


def logits_for(next_tokens: list[int]) -> torch.Tensor:
    """[N, V] stub logits whose argmax after node i is next_tokens[i] (a clear winner)."""
    logits = torch.randn(len(next_tokens), V, generator=torch.Generator().manual_seed(len(next_tokens)))
    logits[torch.arange(len(next_tokens)), next_tokens] = 10.0
    return logits


CHAIN = Tree.chain(4)


def test_greedy_never_accepted():
    tokens = torch.tensor([0, 5, 5, 5, 5])
    acc = greedy_accept(CHAIN, tokens, logits_for([1, 2, 3, 4, 6]))
    assert acc == Acceptance(path=(0,), bonus=1) and acc.num_accepted_drafts == 0


def test_greedy_always_accepted():
    tokens = torch.tensor([0, 1, 2, 3, 4])
    acc = greedy_accept(CHAIN, tokens, logits_for([1, 2, 3, 4, 7]))
    assert acc == Acceptance(path=(0, 1, 2, 3, 4), bonus=7) and acc.num_accepted_drafts == 4


def test_greedy_sometimes_accepted():
    tokens = torch.tensor([0, 1, 2, 6, 4])  # the third draft is wrong; the fourth would match but follows a miss
    acc = greedy_accept(CHAIN, tokens, logits_for([1, 2, 3, 4, 7]))
    assert acc == Acceptance(path=(0, 1, 2), bonus=3)


def test_greedy_follows_the_matching_sibling():
    tree = Tree.from_choices([(0,), (1,), (1, 0), (0, 0)])  # nodes: 0 | 1 (rank 0) 2 (rank 1) | 3 under 1, 4 under 2
    assert tree.parents == (-1, 0, 0, 1, 2)
    tokens = torch.tensor([0, 5, 1, 2, 2])  # rank 0 is wrong, rank 1 is right, and so is its child
    acc = greedy_accept(tree, tokens, logits_for([1, 2, 2, 0, 3]))
    assert acc == Acceptance(path=(0, 2, 4), bonus=3)


def test_greedy_takes_the_longest_path_and_the_first_of_equals():
    tree = Tree.from_choices([(0,), (1,), (1, 0), (1, 1)])  # 0 | 1, 2 | 3, 4 under 2
    # node 1 and node 2 both carry the target's token 1 (a tree may repeat a token on two branches)
    tokens = torch.tensor([0, 1, 1, 3, 3])
    # after node 1 the target says 2; after node 2 it says 3: only the second branch goes deeper
    acc = greedy_accept(tree, tokens, logits_for([1, 2, 3, 5, 6]))
    assert acc == Acceptance(path=(0, 2, 3), bonus=5)
    # equally long accepted paths: the first one (lower ranks) wins, deterministically
    acc = greedy_accept(tree, torch.tensor([0, 1, 1, 7, 7]), logits_for([1, 2, 3, 5, 6]))
    assert acc == Acceptance(path=(0, 1), bonus=2)


def test_greedy_ties_break_to_the_lowest_token_like_generate():
    """Two tokens with exactly the same top logit: the target's choice is the lower id (torch.argmax, as generate)."""
    logits = torch.zeros(3, V)
    logits[0, [2, 5]] = 4.0  # a tie after the root
    logits[1, 3] = 1.0
    logits[2, 6] = 1.0
    assert int(torch.argmax(logits[0])) == 2
    tree = Tree.from_choices([(0,), (1,)])
    assert greedy_accept(tree, torch.tensor([0, 5, 2]), logits) == Acceptance(path=(0, 2), bonus=6)
    assert greedy_accept(Tree.chain(1), torch.tensor([0, 5]), logits[:2]) == Acceptance(path=(0,), bonus=2)


def one_hot(rows: list[int]) -> torch.Tensor:
    p = torch.zeros(len(rows), V)
    p[torch.arange(len(rows)), rows] = 1.0
    return p


def test_sample_accepts_what_the_target_is_sure_of():
    tokens = torch.tensor([0, 1, 2, 3, 4])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        acc = sample_accept(CHAIN, tokens, one_hot([1, 2, 3, 4, 7]), generator=g)
        assert acc == Acceptance(path=(0, 1, 2, 3, 4), bonus=7)


def test_sample_rejects_what_the_target_never_draws():
    tokens = torch.tensor([0, 1, 2, 3, 4])
    p = torch.full((5, V), 1.0 / (V - 1))
    p[0, 1] = 0.0  # the first draft is impossible under the target
    for seed in range(50):
        acc = sample_accept(CHAIN, tokens, p, generator=torch.Generator().manual_seed(seed))
        assert acc.path == (0,) and acc.bonus != 1


def test_sample_deterministic_rejection_removes_the_token_from_the_residual():
    """p = (1/2, 1/2) on tokens 0, 1; both children drafted deterministically: child 0 is kept half the time, and when
    it is not, token 0 is gone from the residual, so child 1 (token 1) is kept for sure: the bonus never decides."""
    tree = Tree.from_choices([(0,), (1,)])
    tokens = torch.tensor([7, 0, 1])
    p = torch.zeros(3, V)
    p[0, :2] = 0.5
    p[1:, 3] = 1.0
    kept = [sample_accept(tree, tokens, p, generator=torch.Generator().manual_seed(s)).path for s in range(200)]
    assert set(kept) == {(0, 1), (0, 2)}
    assert 60 < kept.count((0, 1)) < 140


def test_sample_with_q_equal_to_p_always_accepts():
    """q_draft[i] is what node i was drawn from, i.e. the draft's distribution after i's parent."""
    tokens = torch.tensor([0, 1, 2, 3, 4])
    p = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(0)), -1)
    q = p[CHAIN.parent_tensor]  # [N, V] node i drawn from the target's own distribution after its parent
    for seed in range(20):
        acc = sample_accept(CHAIN, tokens, p, q_draft=q, generator=torch.Generator().manual_seed(seed))
        assert acc.path == (0, 1, 2, 3, 4)


def test_sample_zero_q_row_means_deterministic():
    tokens = torch.tensor([0, 1])
    p = one_hot([1, 3])
    q = torch.zeros(2, V)  # no distribution given for node 1: a point mass on its token
    acc = sample_accept(Tree.chain(1), tokens, p, q_draft=q, generator=torch.Generator().manual_seed(0))
    assert acc == Acceptance(path=(0, 1), bonus=3)


def test_sample_when_every_token_is_rejected_the_bonus_comes_from_p():
    tree = Tree.from_choices([(0,), (1,)])
    tokens = torch.tensor([0, 4, 4])  # the same impossible token twice
    p = one_hot([6, 0, 0])
    for seed in range(10):
        assert sample_accept(tree, tokens, p, generator=torch.Generator().manual_seed(seed)) == Acceptance((0,), 6)


def test_typical_accept():
    tree = Tree.from_choices([(0,), (1,), (0, 0)])  # 0 | 1, 2 | 3 under 1
    tokens = torch.tensor([0, 1, 2, 3])
    p = torch.zeros(4, V)
    p[0] = torch.tensor([0.0, 0.05, 0.9, 0.05, 0, 0, 0, 0])  # token 1 is below the threshold, token 2 above
    p[1:, 5] = 1.0
    acc = typical_accept(tree, tokens, p, generator=torch.Generator().manual_seed(0))
    assert acc == Acceptance(path=(0, 2), bonus=5)
    # a low threshold keeps the first child (rank order), then its child is below it: bonus from p at node 1
    p[1] = torch.tensor([0.0, 0, 0, 0.01, 0, 0.99, 0, 0])
    acc = typical_accept(tree, tokens, p, posterior_threshold=0.02, posterior_alpha=1.0,
                         generator=torch.Generator().manual_seed(0))
    assert acc.path == (0, 1)
    assert acc.bonus in (3, 5)


def test_acceptance_counts_drafts():
    assert Acceptance(path=(0, 3, 7), bonus=1).num_accepted_drafts == 2
