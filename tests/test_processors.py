"""The generation config's own logits processors (``selfspec.core.processors``): each tree node gets transformers' processor
over its own text, so greedy decoding with drafts and sampled decoding stay token-identical to ``generate``, which
builds the same processors from the same config."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, random_prompts, tiny_model
from selfspec import NoDrafter, Sampling, Target, Tree
from selfspec.core.generate import generate
from selfspec.core.processors import by_depth, from_config
from selfspec.testing import OracleDrafter

def _configs(plain: list[list[int]]) -> dict[str, dict]:
    """Settings that touch what the model says without them (its greedy answers ``plain``), so each changes it."""
    first = sorted({a[0] for a in plain})
    common = max(range(VOCAB), key=lambda t: sum(a.count(t) for a in plain))
    a = plain[0]
    return {
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[common], a[3:5], a[6:9]]),
        "sequence_bias": dict(sequence_bias=[[[common], -3.0], [a[2:4], -4.0], [[a[5], a[6], 2], 5.0]]),
        "suppress": dict(suppress_tokens=[common], begin_suppress_tokens=first),
        "forced_eos": dict(forced_eos_token_id=17),
        "exponential_decay": dict(exponential_decay_length_penalty=(3, 1.6)),
    }


NAMES = ["no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress", "forced_eos", "exponential_decay"]


def _greedy(model, prompt: torch.Tensor) -> list[int]:
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=16,
                         pad_token_id=0, do_sample=False)
    return out[0, prompt.shape[0]:].tolist()


def test_by_depth_gives_each_node_the_processor_over_its_own_text():
    from transformers import NoRepeatNGramLogitsProcessor

    proc = NoRepeatNGramLogitsProcessor(2)
    text = torch.tensor([3, 5, 3])  # the root (3) last: 5 must not follow 3 again
    tree = Tree.from_choices([(0,), (1,), (0, 0)])
    tokens = torch.tensor([3, 5, 4, 3])  # node 1 = 5 (so after 3 5: ...), node 3 = 3 after node 1
    scores = torch.randn(len(tree), 8, generator=torch.Generator().manual_seed(0))
    got = by_depth([proc], scores, text, tree, tokens)
    for i in range(len(tree)):
        path = torch.cat([text, tokens[list(tree.path_to(i)[1:])]])
        assert torch.equal(got[i], proc(path[None], scores[i: i + 1].clone())[0]), f"node {i}"
    assert got[0, 5] == float("-inf") and got[3, 5] == float("-inf") and got[1, 5] != float("-inf")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_drafts_and_sampled_are_generates_with_the_configs_processors(arch, name):
    model = tiny_model(arch)
    model.generation_config.eos_token_id = 17
    prompts = random_prompts(6, VOCAB, seed=31)
    plain = [_greedy(model, p) for p in prompts]
    settings = _configs(plain)[name]
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    target = Target(model)
    changed = multi = 0
    for i, prompt in enumerate(prompts):
        t = prompt.shape[0]
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], max_new_tokens=16, pad_token_id=0)
        ref = _greedy(model, prompt)
        changed += ref != plain[i][: len(ref)] or len(ref) != len(plain[i])
        procs = from_config(model.generation_config, t, 16, [17])
        # the answer on rank 1 of a branching tree, random tokens on the other branches (each node its own text)
        oracle = OracleDrafter(Tree.full([2, 2, 2]), VOCAB, ref, branch_rank=1, seed=i)
        out = generate(target, oracle, prompt, 16, eos_token_id=17, processors=procs)
        assert out.tokens == ref, f"{name}, prompt {i}"
        multi += sum(n > 1 for n in out.accept_lengths)
        torch.manual_seed(i)
        sampled = model.generate(prompt[None], do_sample=True, temperature=0.9, top_k=0, **kwargs)[0, t:].tolist()
        torch.manual_seed(i)
        got = generate(target, NoDrafter(), prompt, 16, sampling=Sampling(temperature=0.9), eos_token_id=17,
                       processors=procs)
        assert got.tokens == sampled, f"{name}, sampled, prompt {i}"
    assert changed >= 1, f"{name} never changed generate's output: the check is vacuous"
    assert multi >= 6, "the oracle's runs were not accepted"


def test_the_api_applies_the_generation_configs_processors(model_dir):
    """SpecModel reads them from the model's generation config, as model.generate does, and no longer warns."""
    from selfspec import api

    m = api.load(str(model_dir), draft="ngram")
    prompt = "write a short story about the sea"
    base = m.generate(prompt, max_new_tokens=30)
    config = m.model.generation_config
    config.no_repeat_ngram_size, config.suppress_tokens = 2, [base.tokens[2]]
    try:
        spec = m.generate(prompt, max_new_tokens=30)
        plain = m.generate_plain(prompt, max_new_tokens=30)
    finally:
        config.no_repeat_ngram_size, config.suppress_tokens = None, None
    assert spec.tokens == plain.tokens != base.tokens and base.tokens[2] not in spec.tokens
