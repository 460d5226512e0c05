"""Trees from measured accuracy: the greedy frontier tree is the best tree, and accuracy is measured with the right shift."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_model

from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads
from heads.tree_search import best_choices, best_tree, expected_accept_length, measure_accuracy, rank_hits

ACC = [[0.7, 0.2], [0.5, 0.25], [0.4, 0.1]]


def test_known_accuracies_give_the_expected_tree_and_value():
    # path probabilities: (0) .7, (0,0) .35, (1) .2, (0,1) .175, (0,0,0) .14, (1,0) .1, ...
    assert best_choices(ACC, 5) == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert expected_accept_length(ACC, best_choices(ACC, 5)) == pytest.approx(1 + 0.7 + 0.2 + 0.35 + 0.175 + 0.14)
    assert best_choices(ACC, 1) == [[0]]
    assert best_choices(ACC, 0) == []
    assert best_tree(ACC, 3).choices == ((0,), (1,), (0, 0))


def test_zero_probability_nodes_are_never_added():
    assert best_choices([[1.0, 0.0], [0.0, 0.0]], 10) == [[0]]
    assert expected_accept_length([[1.0, 0.0], [0.0, 0.0]], [[0]]) == 2.0


def test_greedy_tree_is_optimal_against_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        acc = torch.rand(3, 2, generator=g) * 0.5  # each head's ranks sum to <= 1
        nodes = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]
        for budget in (2, 4, 5):
            best = max(
                expected_accept_length(acc, subset)
                for subset in itertools.combinations(nodes, budget)
                if all(p[:-1] in subset or len(p) == 1 for p in subset)  # a tree: every parent included
            )
            assert expected_accept_length(acc, best_choices(acc, budget)) == pytest.approx(best, abs=1e-12)


def test_bad_accuracies_are_refused():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        best_choices([[1.5]], 3)
    with pytest.raises(ValueError, match="at least one head"):
        best_choices([], 3)
    with pytest.raises(ValueError, match="uses rank 2 at depth 1; head 1 has ranks 0..1"):
        expected_accept_length(ACC, [[2]])


def test_rank_hits_uses_the_shift_of_head_k():
    V = 10
    ids = torch.tensor([[5, 5, 1, 2, 3, 4, -100]])  # [B=1, T=7]; -100: not a target
    logits = torch.zeros(1, 7, V)
    # head k=0 at position t predicts ids[t + 2]
    logits[0, 0, 1] = 2.0  # t=0 -> target ids[2]=1 at rank 0
    logits[0, 1, 9], logits[0, 1, 2] = 2.0, 1.0  # t=1 -> target ids[3]=2 at rank 1
    logits[0, 2, 8] = 2.0  # t=2 -> target 3 missed
    logits[0, 3, 4] = 2.0  # t=3 -> target 4 at rank 0
    logits[0, 4, 0] = 9.0  # t=4 -> target is -100: not counted
    hits, n = rank_hits(logits, ids, k=0, topk=2)
    assert hits.tolist() == [2, 1] and n == 4
    hits, n = rank_hits(logits, ids, k=1, topk=2)  # head k=1 at t predicts ids[t + 3]: targets 2, 3, 4
    assert n == 3 and hits.tolist() == [0, 0]


def test_measured_accuracy_of_new_heads_on_a_matching_continuation():
    model = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_model(model, num_heads=2), model.lm_head)
    hidden = torch.randn(2, 9, 32)
    pred = model.lm_head(hidden).argmax(-1)  # [2, 9] what every new head predicts
    ids = torch.randint(0, 96, (2, 9))
    ids[:, 2:] = pred[:, :7]  # ids[t + 2] = head 1's prediction at t
    with torch.no_grad():
        acc = measure_accuracy(heads, [(hidden, ids), (hidden[:1], ids[:1])], topk=3)
    assert acc.shape == (2, 3)
    assert acc[0].tolist() == [1.0, 0.0, 0.0]
    repeats = pred[:, :6] == pred[:, 1:7]  # [2, 6] head 2 (target ids[t + 3] = pred[t + 1]) is right where pred repeats
    assert acc[1, 0].item() == (repeats.sum() + repeats[0].sum()).item() / 18  # 6 positions x 3 rows
    tree = best_tree(acc, 4)
    assert MedusaConfig.for_model(model, num_heads=2, tree=[list(c) for c in tree.choices]).tree


def test_measure_refuses_batches_too_short_for_a_head():
    model = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_model(model, num_heads=3), model.lm_head)
    with pytest.raises(ValueError, match="no target positions to measure head 3"):
        measure_accuracy(heads, [(torch.randn(1, 4, 32), torch.zeros(1, 4, dtype=torch.long))])


def test_step_cost_interpolates_and_refuses_unmeasured_sizes():
    from heads.tree_search import step_cost

    costs = {1: 10.0, 2: 12.0, 4: 20.0}
    assert step_cost(costs, 1) == 10.0 and step_cost(costs, 3) == 16.0 and step_cost(costs, 4) == 20.0
    with pytest.raises(ValueError, match="no verify cost measured for 5 nodes"):
        step_cost(costs, 5)


def test_fastest_tree_follows_the_cost_of_verification():
    from heads.tree_search import best_choices, fastest_choices

    acc = [[0.5, 0.2], [0.4, 0.1]]  # nodes by probability: [0] .5, [1] .2, [0,0] .2, [0,1] .05, [1,0] .08, [1,1] .02
    flat = {1: 1.0, 8: 1.0}  # verification is free: take every node that adds anything
    choices, rate = fastest_choices(acc, flat, max_nodes=6)
    assert choices == best_choices(acc, 6) and rate == pytest.approx(1 + 0.5 + 0.2 + 0.2 + 0.05 + 0.08 + 0.02)
    steep = {1: 1.0, 2: 1.6, 8: 8.0}  # one draft node costs 60%: no tree beats plain decoding (1.5 / 1.6 < 1)
    assert fastest_choices(acc, steep, max_nodes=6) == ([], 1.0)
    mid = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.9, 8: 3.0}  # cheap up to 2 drafts, then expensive: 1.7 / 1.2 is the best
    choices, rate = fastest_choices(acc, mid, max_nodes=6)
    assert choices == [[0], [1]] or choices == [[0], [0, 0]]
    assert rate == pytest.approx(1.7 / 1.2)
