"""Greedy speculative decoding is token-identical to ``model.generate(do_sample=False)``.

For tiny random Llama, Qwen2, Mistral, Gemma-3 (text) and GPT-2 models, over 50 prompts each, with the oracle, random
and n-gram drafters, each as a chain and as a tree, and all three merged into one tree; plain decoding through the loop with NoDrafter; EOS inside an
accepted run, as a bonus token and as the very first token; max_new_tokens cutting an accepted run; a request that
fills the model's context exactly. Each test also checks that its drafter did what it is there for (the oracle's whole
branch is accepted, the n-gram drafter gets tokens accepted), so no case passes vacuously.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, REPEATING, VOCAB, Recording, random_prompts, reference, tiny_model
from fake_clock import FakeClock
from selfspec import NGramDrafter, NoDrafter, Target, Tree
import selfspec.core.generate as generate_module
from selfspec.core.generate import generate
from selfspec.drafts.merge import MergedDrafter
from selfspec.testing import OracleDrafter, RandomDrafter

N_PROMPTS = 50
NEW = 20
CHAIN = Tree.chain(4)
# a Medusa-style tree: 3 candidates at depth 1, a deep rank-0 branch, side branches that must be skipped
MEDUSA = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)])
FULL = Tree.full([2, 2, 2])  # 15 nodes; the oracle puts the answer on rank 1 at every level


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_models):
    """(arch, Target, prompts, greedy references of NEW tokens), built once per architecture."""
    arch = request.param
    model = tiny_models[arch]
    prompts = random_prompts(N_PROMPTS, VOCAB, seed=100 + ARCHS.index(arch))
    refs = [reference(model, p, NEW) for p in prompts]
    return arch, Target(model), prompts, refs


def _run_all(target, prompts, refs, make_drafter, **kwargs):
    """Run every prompt; return (mismatches, recordings)."""
    bad, recs = [], []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        rec = Recording(make_drafter(ref))
        got = generate(target, rec, p, NEW, **kwargs).tokens
        if got != ref:
            bad.append((i, p.tolist(), ref, got))
        recs.append(rec)
    return bad, recs


def _accepted(recs) -> int:
    return sum(acc.num_accepted_drafts for rec in recs for _, acc in rec.records)


def test_no_drafter_is_plain_decoding(case):
    arch, target, prompts, refs = case
    bad, recs = _run_all(target, prompts[:10], refs[:10], lambda ref: NoDrafter())
    assert not bad, f"{arch}: NoDrafter differs from generate on {len(bad)} prompts, first {bad[0]}"
    assert all(len(d.tree) == 1 for rec in recs for d, _ in rec.records)


@pytest.mark.parametrize("shape", ["chain", "medusa", "full"])
def test_oracle(case, shape):
    arch, target, prompts, refs = case
    tree, rank = {"chain": (CHAIN, 0), "medusa": (MEDUSA, 0), "full": (FULL, 1)}[shape]
    bad, recs = _run_all(target, prompts, refs, lambda ref: OracleDrafter(tree, VOCAB, ref, branch_rank=rank, seed=7))
    assert not bad, f"{arch}/{shape}: oracle output differs from generate on {len(bad)} prompts, first {bad[0]}"
    # every step but the last accepts the whole oracle branch (the last is cut by max_new_tokens)
    for rec in recs:
        for draft, acc in rec.records[:-1]:
            assert acc.num_accepted_drafts == tree.depth, f"{arch}/{shape}: oracle branch not fully accepted"


@pytest.mark.parametrize("shape", ["chain", "medusa"])
def test_random(case, shape):
    arch, target, prompts, refs = case
    tree = {"chain": Tree.chain(3), "medusa": MEDUSA}[shape]
    bad, _ = _run_all(target, prompts, refs, lambda ref: RandomDrafter(tree, VOCAB, seed=len(ref)))
    assert not bad, f"{arch}/{shape}: random-draft output differs from generate on {len(bad)} prompts, first {bad[0]}"


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_ngram(case, shape):
    arch, target, prompts, refs = case
    make = {
        "chain": lambda ref: NGramDrafter(max_matches=1, depth=5, max_nodes=5),  # one continuation: a chain
        "tree": lambda ref: NGramDrafter(depth=6, max_nodes=24),
    }[shape]
    bad, recs = _run_all(target, prompts, refs, make)
    assert not bad, f"{arch}/{shape}: n-gram output differs from generate on {len(bad)} prompts, first {bad[0]}"
    trees = [d.tree for rec in recs for d, _ in rec.records]
    if shape == "chain":
        assert all(max(len(c) for c in t.children) <= 1 for t in trees)
    else:
        assert any(len(t.children[0]) > 1 for t in trees), "the n-gram drafter never proposed a branching tree"
    assert _accepted(recs) >= N_PROMPTS, f"{arch}/{shape}: only {_accepted(recs)} n-gram tokens accepted in total"


def test_merged(case):
    """An oracle chain merged with an n-gram trie and random side branches: one tree, still plain decoding's output."""
    arch, target, prompts, refs = case
    make = lambda ref: MergedDrafter([NGramDrafter(depth=4, max_nodes=8), RandomDrafter(MEDUSA, VOCAB, seed=len(ref)),
                                      OracleDrafter(CHAIN, VOCAB, ref, seed=7)])
    bad, recs = _run_all(target, prompts[:20], refs[:20], make)
    assert not bad, f"{arch}: merged-draft output differs from generate on {len(bad)} prompts, first {bad[0]}"
    for rec in recs:  # the oracle's chain sits somewhere in the merged tree and is accepted whole
        assert all(acc.num_accepted_drafts >= CHAIN.depth for _, acc in rec.records[:-1])


def _first_occurrence(ref: list[int], positions) -> int | None:
    return next((j for j in positions if ref[j] not in ref[:j]), None)


@pytest.mark.parametrize("shape", ["chain", "medusa"])
@pytest.mark.parametrize("where", ["inside", "bonus", "first"])
def test_eos(case, where, shape):
    """EOS inside an accepted run (the run is cut right after it), as a bonus token, and as the first token.

    The oracle on a chain of 4 (or on the depth-4 branch of the Medusa tree) accepts 4 drafts + 1 bonus per step:
    output positions 1-4 are drafts, 5 the bonus, and so on.
    eos_token_id is set to a token the greedy continuation produces at such a position (for the first time).
    """
    arch, target, prompts, refs = case
    positions = {"inside": [1, 2, 6, 7, 11, 12], "bonus": [5, 10, 15], "first": [0]}[where]
    tried = 0
    for p, ref in zip(prompts[:20], refs[:20]):
        j = _first_occurrence(ref, positions)
        if j is None:
            continue
        eos = ref[j]
        expected = reference(target.model, p, NEW, eos_token_id=eos)
        assert expected == ref[: j + 1], "the reference itself must stop right after EOS"
        for eos_arg in (eos, [VOCAB + 5, eos]):  # one id, or a list of ids
            rec = Recording(OracleDrafter(CHAIN if shape == "chain" else MEDUSA, VOCAB, ref))
            out = generate(target, rec, p, NEW, eos_token_id=eos_arg)
            assert out.tokens == expected, f"{arch}: eos={eos} at {j}: got {out.tokens}, generate gave {expected}"
        if where == "inside":  # the target accepted drafts beyond EOS, and the loop cut the run right after it
            _, acc = rec.records[-1]
            assert len(out.steps[-1].tokens) < acc.num_accepted_drafts + 1
        if where == "first":
            assert len(out.steps) == 1 and not rec.records
        tried += 1
    assert tried >= 3, f"{arch}: only {tried} prompts had a usable EOS position {positions}"


def test_max_new_tokens_cuts_a_run(case):
    """Every max_new_tokens from 1 to 12 against generate with that max_new_tokens; the last run is cut to fit."""
    arch, target, prompts, refs = case
    for p, ref in zip(prompts[:3], refs[:3]):
        for m in range(1, 13):
            expected = reference(target.model, p, m)
            rec = Recording(OracleDrafter(MEDUSA, VOCAB, ref))
            out = generate(target, rec, p, m)
            assert out.tokens == expected, f"{arch}: max_new_tokens={m}: got {out.tokens}, generate gave {expected}"
            last = (m - 1) % (MEDUSA.depth + 1)  # tokens the last step may still add
            if m > 1 and last:  # the oracle would accept 4 drafts + bonus; the draft was cut to what is still wanted
                assert rec.records[-1][0].tree.depth == last - 1 < MEDUSA.depth


def test_request_that_fills_the_context():
    """prompt + max_new_tokens == the context length: allowed, drafts are cut at the context end, same output."""
    for arch in ("llama", "gpt2"):
        model = tiny_model(arch, max_positions=24)
        p = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
        ref = reference(model, p, 24 - 9)
        out = generate(Target(model), OracleDrafter(CHAIN, VOCAB, ref), p, 24 - 9)
        assert out.tokens == ref


def test_steps_add_up(case, monkeypatch):
    """Step records: the prefill, then one per verify; tokens add up to the output; Spec-Bench accept_lengths; each
    step's time split exactly into the target's forward (verify_s) and the rest of the step (other_s, of it draft_s in
    the drafter), read off a clock
    that moves only in the prefill (3 s), each verify (5 s) and each draft (2 s)."""
    arch, target, prompts, refs = case
    clock = FakeClock()
    monkeypatch.setattr(generate_module, "time", clock)
    prefill, verify = target.prefill, target.verify
    monkeypatch.setattr(target, "prefill", lambda *a, **k: clock.advance(3.0) or prefill(*a, **k))
    monkeypatch.setattr(target, "verify", lambda *a, **k: clock.advance(5.0) or verify(*a, **k))
    drafter = OracleDrafter(CHAIN, VOCAB, refs[0])
    draft = drafter.draft
    monkeypatch.setattr(drafter, "draft", lambda state: clock.advance(2.0) or draft(state))
    out = generate(target, drafter, prompts[0], NEW)
    assert out.steps[0].tree_size == 0 and len(out.steps[0].tokens) == 1
    assert [t for s in out.steps for t in s.tokens] == out.tokens
    assert out.accept_lengths == [1, 5, 5, 5, 4]  # 1 + 5 + 5 + 5 + 4 = 20
    assert all(s.tree_size == 5 for s in out.steps[1:4])
    assert [(s.verify_s, s.other_s) for s in out.steps] == [(3.0, 0.0)] + [(5.0, 2.0)] * 4  # prefill, then 4 verifies
    assert [s.draft_s for s in out.steps] == [0.0] + [2.0] * 4  # the drafter's own share of other_s
    assert out.seconds == 3.0 + 4 * (5.0 + 2.0)
    assert out.mean_accepted == pytest.approx(4.0)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_decoding_far_beyond_the_sliding_window_is_token_identical(arch):
    """A sliding window of 16 (Gemma-3: alternating with full layers; Mistral: every layer), prompts of 10-30 tokens and
    40 new ones: the sliding layers' cache keeps every entry and the tree's mask applies the window, so trees are
    verified beyond it exactly as generate's own sliding cache decodes."""
    model = tiny_model(arch, initializer_range=REPEATING, sliding_window=16)
    target = Target(model)
    assert target.window_limit is None
    for i, prompt in enumerate(random_prompts(8, VOCAB, seed=3, min_len=10, max_len=30)):
        ref = reference(model, prompt, 40)
        for drafter in (OracleDrafter(Tree.full([3, 2, 2]), VOCAB, ref, branch_rank=1, seed=i),
                        RandomDrafter(Tree.full([4, 2]), VOCAB, seed=i), NGramDrafter(depth=4, max_nodes=8)):
            rec = Recording(drafter)
            assert generate(target, rec, prompt, 40).tokens == ref, f"{arch}, prompt {i}, {type(drafter).__name__}"
        assert len(rec.states[-1].tokens) > 3 * 16  # far beyond the window
