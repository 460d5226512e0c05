"""Greedy acceptance from hidden states (selfspec/core/head_rows.py) decides exactly as ``greedy_accept`` on every
node's logits, and the decoding loop that uses it stays token-identical to ``model.generate``.

The shortlist is shrunk (``SHORTLIST`` 8 of a 96- or 200-token vocabulary) so that targets outside it, drafts outside
it and paths cut by them all happen; each test checks that its case happened, so none passes vacuously.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import ARCHS, VOCAB, random_prompts, reference, tiny_model
from selfspec import NGramDrafter, Target, Tree
import selfspec.core.head_rows as head_rows
from selfspec.core.accept import greedy_accept
from selfspec.core.batch import Job, generate_batch
from selfspec.core.generate import generate
from selfspec.core.sampling import Sampling
from selfspec.drafts.merge import MergedDrafter
from selfspec.testing import OracleDrafter, RandomDrafter

V, D = 200, 16


def _case(seed: int, tree: Tree, follow: float, bias: bool):
    """Random hidden states and LM head, and tree tokens that follow the target's argmax with probability ``follow``,
    else the best of the shortlist's 8 ids (what the shortlist's argmax would follow where the target's token is
    outside it), so that paths of every length and cut paths occur."""
    g = torch.Generator().manual_seed(seed)
    n = len(tree)
    hidden = torch.randn(n, D, generator=g)
    weight = torch.randn(V, D, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    logits = F.linear(hidden, weight, b)
    target, decoy = logits.argmax(-1), logits[:, :8].argmax(-1)  # decoy: the best of the first 8 ids (the shortlist)
    tokens = torch.randint(0, V, (n,), generator=g)
    for i in range(1, n):
        parent = tree.parents[i]
        siblings = {int(tokens[c]) for c in tree.children[parent] if c < i}
        want = int(target[parent]) if torch.rand(1, generator=g).item() < follow else int(decoy[parent])
        while want in siblings:  # sibling tokens distinct, as drafters make them
            want = (want + 1) % V
        tokens[i] = want
    return tokens, hidden, weight, b


@pytest.mark.parametrize("bias", [False, True])
def test_the_two_passes_decide_as_every_logit_does(monkeypatch, bias):
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    tree = Tree.full([3, 2, 2])
    cut = long = 0
    for seed in range(400):
        tokens, hidden, weight, b = _case(seed, tree, follow=0.8 if seed % 2 else 0.3, bias=bias)
        logits = F.linear(hidden, weight, b)
        want = greedy_accept(tree, tokens, logits)
        got, path_logits = head_rows.greedy_from_hidden(tree, tokens, hidden, weight, b)
        assert got == want, seed
        # the path's logits (for log-probabilities): the same, up to the rounding of a matmul of other rows
        assert torch.allclose(path_logits, logits[list(got.path)], rtol=1e-5, atol=1e-5), seed
        tentative_len = len(head_rows.tentatives([(tree, tokens)], hidden[None], weight, b)[0].path)
        cut += tentative_len > len(got.path)  # the shortlist's argmax led further than the true path
        long += len(got.path) >= 3
    assert cut >= 10 and long >= 10, (cut, long)


def test_the_path_pass_reads_only_the_heads_tail(monkeypatch):
    """Pass 2 computes the path's logits over ids SHORTLIST..V-1 only (pass 1 has the rest): the head's rows are read
    once in all; its logits are still the full-vocabulary logits of the path's nodes."""
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    real, heads = head_rows.lm_head, []
    monkeypatch.setattr(head_rows, "lm_head", lambda rows, w, b: heads.append(w.shape[0]) or real(rows, w, b))
    tree = Tree.full([3, 2])
    for seed in range(40):
        tokens, hidden, weight, b = _case(seed, tree, follow=0.8, bias=True)
        heads.clear()
        got, path_logits = head_rows.greedy_from_hidden(tree, tokens, hidden, weight, b)
        logits = F.linear(hidden, weight, b)
        assert got == greedy_accept(tree, tokens, logits), seed
        assert path_logits.shape == (len(got.path), V)
        assert torch.allclose(path_logits, logits[list(got.path)], rtol=1e-5, atol=1e-5), seed
        assert heads[0] == V - 8, heads  # the tail; a fallback to every logit (heads[1] == V) is the rare case
        assert heads[1:] in ([], [V]), heads


def test_a_tree_of_one_or_two_nodes_gets_every_logit_at_once(monkeypatch):
    """No shortlist pass where the whole head on every node costs as much (head_rows.FEW); the same verdict."""
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    passes = []
    real = head_rows.tentatives
    monkeypatch.setattr(head_rows, "tentatives", lambda *a: passes.append(1) or real(*a))
    for tree in (Tree.chain(0), Tree.chain(1), Tree.chain(2)):
        for seed in range(20):
            tokens, hidden, weight, _ = _case(seed, tree, follow=0.7, bias=False)
            logits = F.linear(hidden, weight)
            got, path_logits = head_rows.greedy_from_hidden(tree, tokens, hidden, weight, None)
            assert got == greedy_accept(tree, tokens, logits)
            assert torch.allclose(path_logits, logits[list(got.path)], rtol=1e-5, atol=1e-5)
        assert bool(passes) == (len(tree) > head_rows.FEW), len(tree)


@pytest.mark.parametrize("rows", [1, 2, 3, 7])
def test_the_lm_head_of_a_few_rows_is_the_linear_layers(rows):
    g = torch.Generator().manual_seed(rows)
    h, w, b = torch.randn(rows, D, generator=g), torch.randn(V, D, generator=g), torch.randn(V, generator=g)
    for bias in (None, b):
        got = head_rows.lm_head(h, w, bias)
        assert got.shape == (rows, V) and torch.allclose(got, F.linear(h, w, bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), F.linear(h, w, bias).argmax(-1))


def test_two_siblings_with_one_token_fall_back_to_every_logit(monkeypatch):
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    tree = Tree.full([2, 2])  # root, two children, four grandchildren
    tokens, hidden, weight, _ = _case(3, tree, follow=1.0, bias=False)
    logits = F.linear(hidden, weight)
    target = logits.argmax(-1)
    tokens[1] = tokens[2] = target[0]  # both children are the target's token; which one's subtree runs longer decides
    tokens[3], tokens[4] = (target[1] + 1) % V, (target[1] + 2) % V  # under the first: nothing accepted
    tokens[5] = target[2]  # under the second: its first child
    calls, everywhere = [], head_rows._everywhere
    monkeypatch.setattr(head_rows, "_everywhere", lambda *a: calls.append(1) or everywhere(*a))
    got, _ = head_rows.greedy_from_hidden(tree, tokens, hidden, weight, None)
    assert calls and got == greedy_accept(tree, tokens, logits)
    assert got.path == (0, 2, 5)  # the second child's branch is the longer one


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_with_the_lm_head_on_the_paths_nodes_is_generates(monkeypatch, tiny_models, arch):
    """Every drafter kind, a shortlist of 8 of 96 tokens: the loop verifies without the LM head (checked), and every
    answer is ``generate``'s; sampling and processed scores still get every logit."""
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    model = tiny_models[arch]
    target = Target(model)
    assert target.plain_head() is not None
    verify, seen = target.verify, []
    monkeypatch.setattr(target, "verify", lambda *a: seen.append(a[3] if len(a) > 3 else True) or verify(*a))
    prompts = random_prompts(12, VOCAB, seed=5)
    for p in prompts:
        ref = reference(model, p, 16)
        for drafter in (OracleDrafter(Tree.full([2, 2]), VOCAB, ref, branch_rank=1), RandomDrafter(Tree.chain(3), VOCAB, seed=1),
                        MergedDrafter([NGramDrafter(), RandomDrafter(Tree.full([3]), VOCAB, seed=2)])):
            assert generate(target, drafter, p, 16).tokens == ref
    assert seen and not any(seen)  # every step verified without the LM head
    seen.clear()
    generate(target, RandomDrafter(Tree.chain(2), VOCAB, seed=3), prompts[0], 8,
             sampling=Sampling(temperature=0.8), generator=torch.Generator().manual_seed(0))
    generate(target, RandomDrafter(Tree.chain(2), VOCAB, seed=3), prompts[0], 8,
             sampling=Sampling(repetition_penalty=1.3))
    assert seen and all(seen)  # sampling, a penalty: every logit, as before


def test_a_head_whose_output_is_not_the_logits_gets_every_logit():
    """Soft-capped logits (Gemma 2/3's final_logit_softcapping) are not the LM head's output: no shortcut."""
    capped = Target(tiny_model("gemma3", seed=0, final_logit_softcapping=0.5))
    assert capped.plain_head() is None
    assert Target(tiny_model("gemma3", seed=0)).plain_head() is not None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_greedy_batch_runs_the_lm_head_once_on_every_rows_path(monkeypatch, tiny_models, arch):
    """A batch of greedy sequences (a shortlist of 8): verified without the LM head, every answer ``generate``'s, each
    answer's log-probabilities those of every logit; one sampling sequence in the batch: every logit again."""
    monkeypatch.setattr(head_rows, "SHORTLIST", 8)
    model = tiny_models[arch]
    target = Target(model)
    verify_rows, seen = target.verify_rows, []
    monkeypatch.setattr(target, "verify_rows", lambda *a: seen.append(a[4] if len(a) > 4 else True) or verify_rows(*a))
    prompts = random_prompts(6, VOCAB, seed=8)
    refs = [reference(model, p, 16) for p in prompts]
    drafters = [OracleDrafter(Tree.full([2, 2]), VOCAB, r, branch_rank=1) if i % 2 else
                MergedDrafter([NGramDrafter(), RandomDrafter(Tree.full([3]), VOCAB, seed=i)]) for i, r in enumerate(refs)]
    outs = generate_batch(target, [Job(p, d, 16, logprobs=2) for p, d in zip(prompts, drafters)])
    assert [o.tokens for o in outs] == refs
    assert seen and not any(seen)
    alone = generate(Target(model), OracleDrafter(Tree.full([2, 2]), VOCAB, refs[1], branch_rank=1), prompts[1], 16,
                     logprobs=2)
    got = [lp.logprob for s in outs[1].steps for lp in s.logprobs]
    want = [lp.logprob for s in alone.steps for lp in s.logprobs]
    assert len(got) == 16 and got == pytest.approx(want, abs=1e-4)
    seen.clear()
    jobs = [Job(prompts[0], RandomDrafter(Tree.chain(2), VOCAB, seed=1), 8),
            Job(prompts[1], RandomDrafter(Tree.chain(2), VOCAB, seed=2), 8, sampling=Sampling(temperature=0.7),
                generator=torch.Generator().manual_seed(0))]
    generate_batch(target, jobs)
    assert seen and all(seen)
