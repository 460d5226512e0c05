"""The target's log-probabilities, as the loop reports them: each new token's is the model's own (unprocessed) log-softmax
at that token's position, what a plain forward over the finished text gives, and what ``generate(output_logits=True)``
holds, whether the token came from an accepted draft, a bonus token or the prefill; the prompt's come from the prefill.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, VOCAB, random_prompts, reference
from selfspec import NGramDrafter, NoDrafter, Sampling, Target, Tree, stream
from selfspec.core.generate import generate
from selfspec.core import logprobs as lp_mod
from selfspec.core.logprobs import token_logprobs
from selfspec.testing import OracleDrafter

NEW = 16
TOL = 1e-4  # fp32: a tree's wider forward rounds differently from a one-token step, by far less than this


def _teacher_forced(model, prompt: torch.Tensor, new: list[int]) -> torch.Tensor:
    """log p(x_t | x_<t) for every token after the first of prompt + new, from one plain forward: [T + n - 1]."""
    ids = torch.cat([prompt, torch.tensor(new, dtype=torch.long)])
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


def test_token_logprobs_are_log_softmax_with_the_likeliest_first(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=g) * 3
    tokens = torch.randint(0, 50, (7,), generator=g)
    monkeypatch.setattr(lp_mod, "CHUNK", 3)  # rows are taken three at a time: the chunks must join in order
    got = token_logprobs(logits, tokens, k=4)
    want = torch.log_softmax(logits, -1)
    assert [t.token for t in got] == tokens.tolist()
    assert torch.allclose(torch.tensor([t.logprob for t in got]), want.gather(-1, tokens[:, None])[:, 0])
    for row, t in zip(want, got):
        assert [i for i, _ in t.top] == row.argsort(descending=True)[:4].tolist()
        assert torch.allclose(torch.tensor([v for _, v in t.top]), row.sort(descending=True).values[:4])
    assert all(t.top == () for t in token_logprobs(logits, tokens, k=0))
    with pytest.raises(ValueError, match="between 0 and 20 alternatives per token, found 21"):
        token_logprobs(logits, tokens, k=21)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_new_token_carries_the_targets_own_logprob(arch, tiny_models):
    """Greedy with drafts that accept several tokens a step: every token's log-probability and its alternatives equal
    ``generate(output_logits=True)``'s, and a plain forward over the answer's."""
    model = tiny_models[arch]
    target = Target(model)
    several = 0
    for i, prompt in enumerate(random_prompts(6, VOCAB, seed=7)):
        ref = reference(model, prompt, NEW)
        drafter = OracleDrafter(Tree.chain(4), VOCAB, ref) if i % 2 else NGramDrafter(depth=4, max_nodes=12)
        steps = list(stream(target, drafter, prompt, NEW, logprobs=3))
        tokens = [t for s in steps for t in s.tokens]
        assert tokens == ref
        assert all(len(s.logprobs) == len(s.tokens) for s in steps)
        several += sum(len(s.tokens) > 1 for s in steps)
        got = [lp for s in steps for lp in s.logprobs]
        assert [g.token for g in got] == ref
        forced = _teacher_forced(model, prompt, ref)[prompt.shape[0] - 1:]
        assert torch.allclose(torch.tensor([g.logprob for g in got]), forced, atol=TOL)
        with torch.inference_mode():
            out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        plain = torch.log_softmax(torch.cat(out.logits).float(), -1)  # [NEW, V]
        for g, row in zip(got, plain):
            assert [i for i, _ in g.top] == row.topk(3).indices.tolist()
            assert torch.allclose(torch.tensor([v for _, v in g.top]), row.topk(3).values, atol=TOL)
    assert several >= 6, f"{arch}: the drafts were hardly accepted ({several} multi-token steps): the check is vacuous"


def test_logprobs_are_the_models_before_sampling_and_penalties(tiny_models):
    """Sampled at temperature 0.7 with a repetition penalty: the reported log-probabilities are still the model's own
    (not the processed distribution the tokens were drawn from), as vLLM reports them by default."""
    model = tiny_models["llama"]
    target = Target(model)
    prompt = random_prompts(1, VOCAB, seed=3)[0]
    sampling = Sampling(temperature=0.7, top_k=20, repetition_penalty=1.5)
    g = torch.Generator().manual_seed(1)
    steps = list(stream(target, NGramDrafter(depth=4, max_nodes=12), prompt, NEW,
                                                       sampling=sampling, generator=g, logprobs=0))
    tokens = [t for s in steps for t in s.tokens]
    got = torch.tensor([lp.logprob for s in steps for lp in s.logprobs])
    assert torch.allclose(got, _teacher_forced(model, prompt, tokens)[prompt.shape[0] - 1:], atol=TOL)


def test_the_prompts_logprobs_come_with_the_prefill(tiny_models):
    model = tiny_models["qwen2"]
    prompt = random_prompts(1, VOCAB, seed=11, min_len=12)[0]
    steps = list(stream(Target(model), NoDrafter(), prompt, 4, prompt_logprobs=2))
    first = steps[0].prompt_logprobs
    assert [p.token for p in first] == prompt[1:].tolist() and all(len(p.top) == 2 for p in first)
    forced = _teacher_forced(model, prompt, [t for s in steps for t in s.tokens])[: prompt.shape[0] - 1]
    assert torch.allclose(torch.tensor([p.logprob for p in first]), forced, atol=TOL)
    assert all(s.prompt_logprobs == () and s.logprobs == () for s in steps[1:])
    # decoding is unchanged by asking for them
    assert [t for s in steps for t in s.tokens] == generate(Target(model), NoDrafter(), prompt, 4).tokens


def test_a_cut_step_reports_the_tokens_it_keeps(tiny_models):
    """An end-of-sequence token inside an accepted run cuts the step: one log-probability per token kept, each read
    from the node that token follows."""
    model = tiny_models["gpt2"]
    prompt = random_prompts(1, VOCAB, seed=5)[0]
    ref = reference(model, prompt, 7)
    eos = ref[2]
    assert eos not in ref[:2], "pick a prompt whose third greedy token is new"
    steps = list(stream(Target(model), OracleDrafter(Tree.chain(4), VOCAB, ref), prompt, 7, eos_token_id=eos,
                        logprobs=1))
    assert [len(s.tokens) for s in steps] == [1, 2]  # the oracle's run of 5 is cut after the EOS
    assert [lp.token for s in steps for lp in s.logprobs] == ref[:3]
    got = torch.tensor([lp.logprob for s in steps for lp in s.logprobs])
    assert torch.allclose(got, _teacher_forced(model, prompt, ref[:3])[prompt.shape[0] - 1:], atol=TOL)


def test_bad_numbers_of_alternatives_are_refused_before_any_work(tiny_models):
    target = Target(tiny_models["llama"])
    prompt = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"logprobs: expected None or 0..20 alternatives per token \(an int\), found -1"):
        next(stream(target, NoDrafter(), prompt, 4, logprobs=-1))
    with pytest.raises(ValueError, match=r"prompt_logprobs: expected None or 0..20 alternatives per token \(an int\), found 99"):
        next(stream(target, NoDrafter(), prompt, 4, prompt_logprobs=99))
