"""Merging drafters (``--draft A+B``): the trie of their trees, each drafter's own verdict, and the registry's A+B."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, Recording, random_prompts, reference, tiny_model
from selfspec import NGramDrafter, Target, Tree, registry
from selfspec.core.generate import generate
from selfspec.core.accept import Acceptance
from selfspec.tools.bench import parse_methods
from selfspec.core.drafter import Draft
from selfspec.drafts.early_exit import EarlyExitDrafter
from selfspec.drafts.merge import MergedDrafter, merge_drafts, restrict
from selfspec.testing import OracleDrafter, RandomDrafter


def draft(parents, tokens):
    return Draft(tree=Tree.from_parents(parents), tokens=torch.tensor(tokens))


def test_merge_builds_one_trie_in_the_order_given():
    a = draft([-1, 0, 0, 1], [5, 10, 11, 12])  # root 5: 10 -> 12, and 11
    b = draft([-1, 0, 1, 1, 0], [5, 10, 12, 13, 14])  # shares 10 -> 12; adds 10 -> 13 and 14
    m = merge_drafts([a, b])
    assert m.tokens.tolist() == [5, 10, 11, 12, 13, 14]
    assert m.tree.parents == (-1, 0, 0, 1, 1, 0)
    assert m.tree.ranks == (0, 0, 1, 0, 1, 2)  # a's nodes first among siblings, b's new ones after
    assert m.q is None and m.scores is None
    assert merge_drafts([a]).tree == a.tree  # one draft: itself
    with pytest.raises(ValueError, match="must share the root token: draft 0 has 5, draft 1 has 6"):
        merge_drafts([a, draft([-1, 0], [6, 1])])


def test_each_drafter_hears_the_verdict_on_its_own_tree():
    own = draft([-1, 0, 0, 1], [5, 10, 11, 12])
    assert restrict([10, 12, 7], own) == Acceptance(path=(0, 1, 3), bonus=7)  # inside its tree, then the bonus
    assert restrict([10, 13, 7], own) == Acceptance(path=(0, 1), bonus=13)  # the path leaves its tree after 10
    assert restrict([9], own) == Acceptance(path=(0,), bonus=9)  # nothing accepted


def test_merged_drafter_updates_each_part_and_refuses_what_it_cannot_merge():
    model = tiny_model("llama")
    target = Target(model)
    prompt = random_prompts(1, VOCAB, seed=3, min_len=6, max_len=6)[0]
    ref = reference(model, prompt, 12)
    oracle = Recording(OracleDrafter(Tree.chain(3), VOCAB, ref, seed=1))
    noise = Recording(RandomDrafter(Tree.full([2, 2]), VOCAB, seed=2))
    out = generate(target, MergedDrafter([noise, oracle]), prompt, 12)
    assert out.tokens == ref
    for rec in (oracle, noise):  # every part heard a verdict on its own draft, in its own indices
        drafts = [d for d, _ in rec.records]
        assert all(max(acc.path) < len(d.tree) for d, acc in rec.records)
        assert len(drafts) == len(out.steps) - 1
    assert all(acc.num_accepted_drafts == 3 for _, acc in oracle.records[:-1])  # the oracle's chain, every step
    with pytest.raises(ValueError, match="at least two drafters, found 1"):
        MergedDrafter([NGramDrafter()])
    with pytest.raises(ValueError, match="EarlyExitDrafter verifies its drafts with its own target"):
        MergedDrafter([NGramDrafter(), EarlyExitDrafter(target, 1)])


def test_a_plus_b_in_the_registry_and_the_bench():
    spec = registry.parse_draft("ngram+ngram:depth=4,max_nodes=9")
    assert (spec.kind, spec.label, [p.config for p in spec.parts]) == ("merged", "ngram+ngram:depth=4,max_nodes=9",
                                                                            [{}, {"depth": 4, "max_nodes": 9}])
    model = tiny_model("llama")
    drafter = registry.build_drafter(spec, Target(model))
    assert isinstance(drafter, MergedDrafter) and [d.depth for d in drafter.drafters] == [8, 4]
    with pytest.raises(ValueError, match="a merged draft joins drafts that draft something; found 'none'"):
        registry.parse_draft("ngram+none")
    with pytest.raises(ValueError, match="bad n-gram option 'width=3'"):
        registry.parse_draft("ngram+ngram:width=3")
    with pytest.raises(ValueError, match="--tree does not apply to --draft ngram"):  # the tree goes to the first part
        registry.build_drafter(spec, Target(model), Tree.chain(2))
    methods = parse_methods(("ngram+ngram:depth=4",), num_layers=2)
    assert [m.label for m in methods] == ["plain", "ngram+ngram:depth=4"]
    gated = registry.parse_draft("ngram+ngram:depth=4+skip_after=3")
    assert (gated.label, gated.config) == ("ngram+ngram:depth=4+skip_after=3", {"skip_after": 3})
    assert registry.build_drafter(gated, Target(model)).skip_after == 3
    with pytest.raises(ValueError, match="at least two drafts joined by '\\+', found 1"):
        registry.parse_draft("ngram+skip_after=3")
    with pytest.raises(ValueError, match="skip_after must be >= 1"):
        registry.build_drafter(registry.parse_draft("ngram+ngram+skip_after=0"), Target(model))
    both = registry.parse_draft("ngram+ngram:depth=4+skip_match=2+skip_after=3")  # one name in either order
    assert (both.label, both.config) == ("ngram+ngram:depth=4+skip_after=3+skip_match=2",
                                         {"skip_after": 3, "skip_match": 2})
    built = registry.build_drafter(both, Target(model))
    assert (built.skip_after, built.skip_match) == (3, 2)
    with pytest.raises(ValueError, match="skip_match must be >= 1 \\(or None\\), found 0"):
        registry.build_drafter(registry.parse_draft("ngram+ngram+skip_match=0"), Target(model))
