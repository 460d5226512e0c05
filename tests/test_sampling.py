"""process_logits is transformers' own warper chain (temperature, top-k, top-p, min-p), so selfspec and
``model.generate(do_sample=True)`` sample from the same distribution; next_token draws from it."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import (EpsilonLogitsWarper, EtaLogitsWarper, MinPLogitsWarper, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper)

from conftest import VOCAB, random_prompts, tiny_model
from selfspec import NoDrafter, Sampling, Target, Tree, next_token, process_logits
from selfspec.core.generate import generate

V = VOCAB


def hf_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """transformers' warpers in generate's order; logits [B, V] -> probs [B, V]."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(s.temperature)(ids, logits.clone())
    if s.top_k > 0:
        scores = TopKLogitsWarper(s.top_k)(ids, scores)
    if s.top_p < 1.0:
        scores = TopPLogitsWarper(s.top_p)(ids, scores)
    if s.min_p > 0.0:
        scores = MinPLogitsWarper(s.min_p)(ids, scores)
    if s.typical_p < 1.0:
        scores = TypicalLogitsWarper(s.typical_p)(ids, scores)
    if s.epsilon_cutoff > 0.0:
        scores = EpsilonLogitsWarper(s.epsilon_cutoff)(ids, scores)
    if s.eta_cutoff > 0.0:
        scores = EtaLogitsWarper(s.eta_cutoff)(ids, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    list(itertools.product([0.5, 0.8, 1.0, 1.7], [0, 1, 5, V], [1.0, 0.9, 0.5, 0.05])),
)
def test_process_logits_equals_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    logits = torch.randn(16, V, generator=g) * 3
    logits[8:] = logits[8:].round()  # half the rows full of exact ties, where the keep/remove rules differ most
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    ours, theirs = process_logits(logits, s), hf_probs(logits, s)
    assert torch.equal(ours > 0, theirs > 0), "a different set of tokens survives top-k / top-p"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p",
                         list(itertools.product([0.7, 1.5], [0, 5], [1.0, 0.9], [0.05, 0.3, 1.0])))
def test_min_p_equals_transformers_warper_after_the_others(temperature, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(int(min_p * 100) + top_k)
    logits = torch.randn(16, V, generator=g) * 3
    logits[8:] = logits[8:].round()  # ties with the top token: min_p = 1 keeps all of them
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours, theirs = process_logits(logits, s), hf_probs(logits, s)
    assert torch.equal(ours > 0, theirs > 0), "a different set of tokens survives min-p"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    without = process_logits(logits, Sampling(temperature=temperature, top_k=top_k, top_p=top_p))
    if min_p >= 0.3 or top_k == 0:
        assert (ours > 0).sum() < (without > 0).sum()  # min-p cut something


@pytest.mark.parametrize("typical_p, epsilon, eta", [(0.5, 0.0, 0.0), (0.9, 0.0, 0.0), (1.0, 0.05, 0.0),
                                                     (1.0, 0.0, 0.02), (0.8, 0.01, 0.01)])
def test_typical_epsilon_and_eta_are_transformers_warpers_after_min_p(typical_p, epsilon, eta):
    """The sampling warpers a generation config may ask for, in generate's order after top-k, top-p and min-p."""
    g = torch.Generator().manual_seed(int(typical_p * 10 + epsilon * 100 + eta * 1000))
    logits = torch.randn(16, V, generator=g) * 3
    s = Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, typical_p=typical_p, epsilon_cutoff=epsilon,
                 eta_cutoff=eta)
    ours, theirs = process_logits(logits, s), hf_probs(logits, s)
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
    without = process_logits(logits, Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01))
    assert (ours > 0).sum() < (without > 0).sum()  # the warper cut something
    assert process_logits(logits[:2, None], s).shape == (2, 1, V)  # any leading shape
    with pytest.raises(ValueError, match=r"typical_p must be in \(0, 1\]"):
        Sampling(typical_p=0.0)
    with pytest.raises(ValueError, match=r"eta_cutoff must be in \[0, 1\)"):
        Sampling(eta_cutoff=1.0)


def test_typical_p_sampling_through_the_loop_is_generate_do_sample():
    model = tiny_model("qwen2")
    target = Target(model)
    s = Sampling(temperature=1.3, typical_p=0.6, epsilon_cutoff=0.002)
    differs = 0
    for i, prompt in enumerate(random_prompts(5, VOCAB, seed=16)):
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], do_sample=True, temperature=s.temperature,
                      top_k=0, max_new_tokens=20, pad_token_id=0)
        torch.manual_seed(i)
        ref = model.generate(prompt[None], typical_p=0.6, epsilon_cutoff=0.002, **kwargs)[0, prompt.shape[0]:].tolist()
        torch.manual_seed(i)
        differs += ref != model.generate(prompt[None], **kwargs)[0, prompt.shape[0]:].tolist()
        torch.manual_seed(i)
        assert generate(target, NoDrafter(), prompt, 20, sampling=s).tokens == ref
    assert differs >= 3


def test_min_p_is_checked():
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\] \(0 = off\), got 1.5"):
        Sampling(temperature=1.0, min_p=1.5)
    with pytest.raises(TypeError, match="min_p must be a number, got str '0.1'"):
        Sampling(temperature=1.0, min_p="0.1")


def test_block_eos_blocks_the_chosen_rows_only():
    from selfspec.core.sampling import block_eos

    logits = torch.randn(4, 10)
    got = block_eos(logits, torch.tensor([True, False, True, False]), [3, 7])
    assert torch.isinf(got[[0, 2]][:, [3, 7]]).all() and (got[[0, 2]][:, [3, 7]] < 0).all()
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    assert torch.equal(got[:, [0, 1, 2, 4, 5, 6, 8, 9]], logits[:, [0, 1, 2, 4, 5, 6, 8, 9]])
    assert block_eos(logits, torch.tensor([False] * 4), [3]) is logits  # nothing blocked: no copy
    assert block_eos(logits, torch.tensor([True] * 4), []) is logits  # no EOS token


def test_process_logits_equals_what_generate_samples_from():
    """generate(do_sample=True) reports its processed scores: their softmax is process_logits of its raw logits."""
    model = tiny_model("llama")
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    s = Sampling(temperature=0.8, top_k=0, top_p=0.9)
    torch.manual_seed(0)
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p, max_new_tokens=6, output_scores=True, output_logits=True, return_dict_in_generate=True,
        pad_token_id=0,
    )
    for raw, processed in zip(out.logits, out.scores):
        torch.testing.assert_close(process_logits(raw, s), processed.softmax(-1), rtol=0, atol=1e-7)


def test_process_logits_keeps_the_top_token_and_normalises():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]])
    p = process_logits(logits, Sampling(temperature=1.0, top_p=0.01))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    p = process_logits(logits, Sampling(temperature=0.8, top_k=2))
    assert (p[0, [0, 3]] == 0).all() and float(p.sum()) == pytest.approx(1.0)
    assert p.dtype == torch.float32


def test_process_logits_refuses_greedy():
    with pytest.raises(ValueError, match="process_logits is for sampling; greedy decoding takes the argmax"):
        process_logits(torch.zeros(4), Sampling())


def test_next_token():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    assert next_token(logits, Sampling()) == 1
    assert next_token(logits, Sampling(temperature=1.0, top_k=1)) == 1
    s = Sampling(temperature=1.0)
    a = [next_token(logits, s, torch.Generator().manual_seed(i)) for i in range(30)]
    b = [next_token(logits, s, torch.Generator().manual_seed(i)) for i in range(30)]
    assert a == b and {1, 2} <= set(a)  # seeded: reproducible, and really sampling


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_plain_sampling_through_the_loop_is_generate_do_sample(arch):
    """NoDrafter with temperature 0.8 / top-p 0.9 draws token-for-token what generate(do_sample=True) draws from the
    same global seed: the same distribution and one multinomial draw per token. (This pins today's transformers RNG
    use as well; the distribution itself is pinned above and by test_distribution.py.)"""
    model = tiny_model(arch)
    target = Target(model)
    s = Sampling(temperature=0.8, top_p=0.9)
    for i, prompt in enumerate(random_prompts(5, VOCAB, seed=5)):
        torch.manual_seed(i)
        ref = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=True,
                             temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=20, pad_token_id=0)
        torch.manual_seed(i)
        assert generate(target, NoDrafter(), prompt, 20, sampling=s).tokens == ref[0, prompt.shape[0]:].tolist()


def test_min_p_sampling_through_the_loop_is_generate_do_sample():
    """min_p reaches the loop: NoDrafter samples token for token what generate(do_sample=True, min_p=...) samples."""
    model = tiny_model("llama")
    target = Target(model)
    s = Sampling(temperature=1.5, min_p=0.2)
    differs = 0
    for i, prompt in enumerate(random_prompts(5, VOCAB, seed=6)):
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], do_sample=True, temperature=s.temperature,
                      top_k=0, max_new_tokens=20, pad_token_id=0)
        torch.manual_seed(i)
        ref = model.generate(prompt[None], min_p=s.min_p, **kwargs)[0, prompt.shape[0]:].tolist()
        torch.manual_seed(i)
        differs += ref != model.generate(prompt[None], **kwargs)[0, prompt.shape[0]:].tolist()
        torch.manual_seed(i)
        assert generate(target, NoDrafter(), prompt, 20, sampling=s).tokens == ref
    assert differs >= 3  # min_p changes what is drawn


def test_repetition_penalty_equals_transformers_processor():
    """penalize_repeats over repeated: transformers' RepetitionPenaltyLogitsProcessor, row by row; in a tree, row i
    is penalised for the text and the drafts on the path to node i (not its siblings' or descendants'), each token
    once however often it occurs."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from selfspec.core.sampling import penalize_repeats, repeated

    g = torch.Generator().manual_seed(0)
    text = torch.tensor([3, 7, 7, 1])  # the root (1) last
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    tokens = torch.tensor([1, 5, 9, 2, 5, 7])  # [N]: node 4 repeats node 1's token on its path, node 5 the text's 7
    logits = torch.randn(len(tree), 12, generator=g) * 3  # [N, V]
    before = logits.clone()
    got = penalize_repeats(logits, repeated(text, 12, tree, tokens), 1.7)
    assert torch.equal(logits, before)  # a copy
    rule = RepetitionPenaltyLogitsProcessor(1.7)
    for i in range(len(tree)):
        path = torch.cat([text, tokens[tree.path_to(i)[1:]]])
        assert torch.equal(got[i], rule(path[None], logits[i:i + 1].clone())[0]), f"node {i}"
    assert torch.equal(penalize_repeats(logits[:1], repeated(text, 12), 1.7)[0],
                       rule(text[None], logits[:1].clone())[0])
    assert got[2, 9] != logits[2, 9] and got[1, 9] == logits[1, 9]  # node 2's own token, not its sibling's


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_and_sampled_decoding_with_a_repetition_penalty_are_generates(arch):
    """The penalty through the loop, greedy with drafts and sampled without: token for token what generate gives
    with the same repetition_penalty; and the penalty changes the output (the check is not vacuous)."""
    from selfspec import NGramDrafter

    model = tiny_model(arch)
    target = Target(model)
    changed = 0
    for i, prompt in enumerate(random_prompts(8, VOCAB, seed=9)):
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], max_new_tokens=20, pad_token_id=0)
        ref = model.generate(prompt[None], do_sample=False, repetition_penalty=1.3, **kwargs)[0, prompt.shape[0]:]
        plain = model.generate(prompt[None], do_sample=False, **kwargs)[0, prompt.shape[0]:]
        changed += not torch.equal(ref, plain)
        greedy = Sampling(repetition_penalty=1.3)
        assert generate(target, NGramDrafter(depth=4, max_nodes=12), prompt, 20, sampling=greedy).tokens == ref.tolist()
        torch.manual_seed(i)
        sampled = model.generate(prompt[None], do_sample=True, temperature=0.8, top_k=0, repetition_penalty=1.3,
                                 **kwargs)[0, prompt.shape[0]:]
        torch.manual_seed(i)
        s = Sampling(temperature=0.8, repetition_penalty=1.3)
        assert generate(target, NoDrafter(), prompt, 20, sampling=s).tokens == sampled.tolist()
    assert changed >= 4


def test_presence_and_frequency_penalties_count_each_nodes_own_answer():
    """penalize_presence over counted: row i is lowered by frequency x (times the token occurs in the answer and the
    drafts on the path to node i) + presence, for tokens that occur at all; the prompt and the root do not count
    twice, siblings never."""
    from selfspec.core.sampling import counted, penalize_presence

    g = torch.Generator().manual_seed(1)
    answer = torch.tensor([7, 7, 4, 1])  # the new tokens so far, the root (1) last
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    tokens = torch.tensor([1, 5, 9, 7, 5, 1])  # [N]
    logits = torch.randn(len(tree), 12, generator=g) * 3
    got = penalize_presence(logits, counted(answer, 12, tree, tokens), presence=0.4, frequency=0.25)
    for i in range(len(tree)):
        text = answer.tolist() + tokens[tree.path_to(i)[1:]].tolist()
        want = logits[i].clone()
        for token in set(text):
            want[token] -= 0.25 * text.count(token) + 0.4
        assert torch.allclose(got[i], want), f"node {i}"
    assert got[5, 1] == pytest.approx(float(logits[5, 1]) - 0.25 * 2 - 0.4)  # the root once, node 5 once
    assert got[2, 9] == pytest.approx(float(logits[2, 9]) - 0.65) and got[1, 9] == logits[1, 9]  # not a sibling's
    one = penalize_presence(logits[:1], counted(answer, 12), 0.4, 0.25)[0]
    assert one[7] == pytest.approx(float(logits[0, 7]) - 0.9) and one[3] == logits[0, 3]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logit_bias_and_presence_penalties_through_the_loop_are_generates(arch):
    """Greedy with drafts and sampled without: token for token ``generate`` with the same one-token sequence_bias and
    the penalties as a logits processor (``PresencePenalty``); each setting changes the output (not vacuous)."""
    from transformers import LogitsProcessorList

    from selfspec import NGramDrafter
    from selfspec.core.sampling import PresencePenalty

    model = tiny_model(arch)
    target = Target(model)
    changed = 0
    for i, prompt in enumerate(random_prompts(6, VOCAB, seed=19)):
        t = prompt.shape[0]
        bias = ((int(prompt[0]), 4.0), (int(prompt[-1]), -3.0), (5, 2.5))
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], max_new_tokens=20, pad_token_id=0,
                      sequence_bias={(k,): v for k, v in bias},
                      logits_processor=LogitsProcessorList([PresencePenalty(t, 0.7, 0.9)]))
        ref = model.generate(prompt[None], do_sample=False, **kwargs)[0, t:]
        plain = model.generate(prompt[None], do_sample=False, max_new_tokens=20, pad_token_id=0,
                               attention_mask=torch.ones_like(prompt)[None])[0, t:]
        changed += not torch.equal(ref, plain)
        s = Sampling(presence_penalty=0.7, frequency_penalty=0.9, logit_bias=bias)
        assert generate(target, NGramDrafter(depth=4, max_nodes=12), prompt, 20, sampling=s).tokens == ref.tolist()
        torch.manual_seed(i)
        sampled = model.generate(prompt[None], do_sample=True, temperature=0.8, top_k=0, **kwargs)[0, t:]
        torch.manual_seed(i)
        s = Sampling(temperature=0.8, presence_penalty=0.7, frequency_penalty=0.9, logit_bias=bias)
        assert generate(target, NoDrafter(), prompt, 20, sampling=s).tokens == sampled.tolist()
    assert changed >= 4


def test_bad_penalties_and_biases_are_refused():
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\] \(0 = off\), got 2.5"):
        Sampling(presence_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias must hold"):
        Sampling(logit_bias=((3, 101.0),))
    with pytest.raises(ValueError, match="logit_bias names token 500; this model's vocabulary has 96"):
        generate(Target(tiny_model("llama")), NoDrafter(), torch.tensor([1, 2]), 2,
                 sampling=Sampling(logit_bias=((500, 1.0),)))
