"""Medusa heads as a drafter: node tokens by depth and rank, and decoding through the runtime stays exact."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_prompts, reference, tiny_model

from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter, load_drafter
from heads.medusa.model import MedusaHeads
from heads.tree_search import best_tree
from selfspec import DraftState, Sampling, Target, Tree
from selfspec.core.generate import generate
from selfspec.core.accept import sample_accept
from selfspec.core.sampling import process_logits

ACC = [[0.6, 0.2, 0.1], [0.4, 0.15], [0.3, 0.1], [0.2]]  # as if measured: 4 heads
TREE = best_tree(ACC, 10)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def untrained(model, projection: str, scale: float = 0.05, seed: int = 0) -> MedusaHeads:
    """Random-init heads whose residual blocks have small random weights, so drafts differ from the LM head's."""
    config = MedusaConfig.for_model(model, num_heads=4, num_layers=1, projection=projection, lora_rank=4)
    heads = MedusaHeads(config, model.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if "blocks" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


def state_for(hidden: torch.Tensor) -> DraftState:
    return DraftState(tokens=torch.tensor([3, 4, 5]), prompt_length=2, hidden=hidden, cache=None, sampling=Sampling())


def test_node_tokens_are_each_heads_ranked_candidates(llama):
    heads = untrained(llama, "shared")
    drafter = MedusaDrafter(heads, TREE)
    hidden = torch.randn(32)
    draft = drafter.draft(state_for(hidden))
    cand = heads(hidden).topk(TREE.max_rank + 1, dim=-1).indices  # [K, R]
    assert draft.q is None and draft.tree is TREE and int(draft.tokens[0]) == 5
    for node in range(1, len(TREE)):
        assert int(draft.tokens[node]) == int(cand[TREE.depths[node] - 1, TREE.ranks[node]])


def test_trees_the_heads_cannot_draft_are_refused(llama):
    heads = untrained(llama, "shared")
    with pytest.raises(ValueError, match="5 levels deep, but 4 is the most the Medusa heads can draft"):
        MedusaDrafter(heads, Tree.chain(5))
    with pytest.raises(ValueError, match="top-97 candidate, but top-96 is the most the Medusa heads can offer"):
        MedusaDrafter(heads, [[96]])


PROMPTS = random_prompts(20, 96, seed=1)


@pytest.fixture(scope="module")
def references(llama):
    return [reference(llama, prompt, 16) for prompt in PROMPTS]


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_greedy_decoding_with_heads_is_token_identical_to_generate(llama, references, projection):
    target = Target(llama)
    drafter = MedusaDrafter(untrained(llama, projection), TREE)
    accepted = 0
    for prompt, expected in zip(PROMPTS, references):
        out = generate(target, drafter, prompt, max_new_tokens=16)
        assert out.tokens == expected
        accepted += sum(n - 1 for n in out.accept_lengths)
    assert accepted > 10  # the drafts were really used, not only rejected


def test_eos_inside_an_accepted_run_stops_where_generate_stops(llama, references):
    target = Target(llama)
    drafter = MedusaDrafter(untrained(llama, "shared"), TREE)
    for prompt, expected in list(zip(PROMPTS, references))[:6]:
        eos = expected[5]
        out = generate(target, drafter, prompt, max_new_tokens=16, eos_token_id=eos)
        assert out.tokens == expected[: expected.index(eos) + 1]


def test_sampling_with_deterministic_drafts_keeps_the_targets_distribution(llama):
    """The first token a step emits (an accepted depth-1 draft, or the bonus) is distributed as the target's p.

    The heads' depth-1 candidates (three of them, point masses: q = None) are verified once; sample_accept then runs
    4000 times on that verification. Bound: total variation <= 0.06, while its sampling noise here is about 0.02 and
    the drafts carry over 0.1 of the target's mass (mishandling them, e.g. accepting a draft outright, shows up).
    """
    target = Target(llama)
    drafter = MedusaDrafter(untrained(llama, "shared", scale=0.02), TREE)
    sampling = Sampling(temperature=1.5)
    prompt = torch.tensor([7, 8, 9, 10, 11])
    cache = target.new_cache()
    pre = target.prefill(prompt[:-1], cache)
    state = DraftState(tokens=prompt, prompt_length=4, hidden=pre.hidden[-1], cache=cache, sampling=sampling)
    draft = drafter.draft(state)
    assert draft.q is None
    p_target = process_logits(target.verify(draft.tree, draft.tokens, cache).logits, sampling)  # [N, V]
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(96)
    for _ in range(4000):
        acc = sample_accept(draft.tree, draft.tokens, p_target, draft.q, g)
        first = int(draft.tokens[acc.path[1]]) if len(acc.path) > 1 else acc.bonus
        counts[first] += 1
    drafted = draft.tokens[[i for i in range(len(TREE)) if TREE.depths[i] == 1]]
    assert float(p_target[0, drafted].sum()) > 0.1  # the drafts matter: they carry real probability mass
    tv = 0.5 * (counts / counts.sum() - p_target[0]).abs().sum()
    assert tv < 0.06


def test_load_drafter_uses_the_stored_tree_or_a_chain(llama, tmp_path):
    heads = untrained(llama, "lora")
    heads.save_pretrained(tmp_path / "plain")
    drafter = load_drafter(tmp_path / "plain", Target(llama))
    assert drafter.tree == Tree.chain(4)
    heads.config.tree = [list(c) for c in TREE.choices]
    heads.config.head_accuracy = ACC
    heads.save_pretrained(tmp_path / "with-tree")
    drafter = load_drafter(tmp_path / "with-tree", Target(llama))
    assert drafter.tree == TREE
    assert load_drafter(tmp_path / "with-tree", Target(llama), tree=[[0], [0, 0]]).tree == Tree.chain(2)
    hidden = torch.randn(32)
    assert torch.equal(drafter.draft(state_for(hidden)).tokens, MedusaDrafter(heads, TREE).draft(state_for(hidden)).tokens)


def test_best_first_picks_the_paths_of_highest_cumulative_probability():
    logp = torch.tensor([[0.7, 0.2, 0.1], [0.9, 0.05, 0.05], [0.5, 0.3, 0.2]]).log()  # [K=3, R=3]
    # scores: (0,) .7  (0,0) .63  (0,0,0) .315  (1,) .2  (0,0,1) .189  (0,0,2) .126  (1,0) .18  (2,) .1
    assert Tree.best_first(logp, 5) == ((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 1))
    assert Tree.best_first(logp, 1) == ((0,),)
    for budget in range(1, 20):
        chosen = Tree.best_first(logp, budget)
        assert len(chosen) == min(budget, 3 + 9 + 27) and all(c[:-1] in chosen for c in chosen if len(c) > 1)
    with pytest.raises(ValueError, match="node budget >= 1"):
        Tree.best_first(logp, 0)
    # min_logp: the adaptive cut, every path above it and none below, whatever the budget left
    assert Tree.best_first(logp, 20, min_logp=math.log(0.19)) == ((0,), (1,), (0, 0), (0, 0, 0))
    assert Tree.best_first(logp, 2, min_logp=math.log(0.19)) == ((0,), (0, 0))
    assert Tree.best_first(logp, 20, min_logp=math.log(0.75)) == ()  # nothing worth verifying: the root alone


def test_best_scored_leaves_out_nodes_below_the_cut():
    #             root  a    b    a.a   a.b   b.a
    parent = [-1, 0, 0, 1, 1, 2]
    score = [0.0, -0.1, -1.0, -0.3, -2.0, -1.2]
    depth = [0, 1, 1, 2, 2, 2]
    assert Tree.best_scored(parent, score, depth, 10)[1] == [1, 2, 3, 5, 4]
    tree, kept = Tree.best_scored(parent, score, depth, 10, min_logp=-1.1)
    assert kept == [1, 2, 3] and tree == Tree.from_choices([(0,), (1,), (0, 0)])
    assert Tree.best_scored(parent, score, depth, 10, min_logp=0.5)[1] == []


@pytest.mark.parametrize("budget", [1, 6, 24])
def test_dynamic_trees_are_lossless_and_follow_the_heads_probabilities(llama, references, budget):
    from selfspec.core.tree import DynamicTree

    target = Target(llama)
    heads = untrained(llama, "shared")
    drafter = MedusaDrafter(heads, DynamicTree(budget, max_rank=4))
    shapes, accepted = set(), 0
    for prompt, expected in zip(PROMPTS, references):
        out = generate(target, drafter, prompt, max_new_tokens=16)
        assert out.tokens == expected
        accepted += sum(n - 1 for n in out.accept_lengths)
    state = state_for(torch.randn(llama.config.hidden_size, generator=torch.Generator().manual_seed(1)))
    draft = drafter.draft(state)
    assert len(draft.tree) == budget + 1
    logits = heads(state.hidden)  # [K, V]: the node reached by rank path c holds head len(c)'s rank-c[-1] candidate
    ranked = logits.argsort(dim=-1, descending=True)
    for i in range(1, len(draft.tree)):
        depth, rank = int(draft.tree.depth_tensor[i]) - 1, draft.tree.ranks[i]
        assert int(draft.tokens[i]) == int(ranked[depth, rank])
    assert accepted > 0 or budget == 1
