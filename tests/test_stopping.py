"""Where the loop stops besides EOS and max_new_tokens, and when it may stop at all, as ``generate`` does: stopping
criteria checked after every new token (a step that accepts several tokens is cut after the first that stops), and
min_new_tokens blocking the end-of-sequence token at every tree node whose text is still too short."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from conftest import ARCHS, VOCAB, random_prompts, tiny_model
from selfspec import NGramDrafter, NoDrafter, Sampling, Target
from selfspec.core.generate import generate
from selfspec.core.stopping import first_stop


class EndsWith(StoppingCriteria):
    """Stop once the text ends with ``tail`` (a few tokens): a criterion of transformers' kind, without a tokenizer."""

    def __init__(self, tail: list[int]):
        self.tail = torch.tensor(tail)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        n = self.tail.numel()
        if input_ids.shape[-1] < n:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return (input_ids[:, -n:] == self.tail).all(-1)


def test_first_stop_finds_the_first_new_token_after_which_a_criterion_stops():
    tokens = torch.tensor([5, 6, 7, 8, 9, 1, 7, 8])  # the last 4 are new
    assert first_stop([EndsWith([7, 8])], tokens, 4) == 3  # 7 8 at the prompt's end is not a new stop
    assert first_stop([EndsWith([8, 9])], tokens, 4) == 0  # spans the prompt's last token and the first new one
    assert first_stop([EndsWith([1]), EndsWith([9, 1])], tokens, 4) == 1
    assert first_stop([EndsWith([1, 2])], tokens, 4) is None
    assert first_stop([], tokens, 4) is None
    assert first_stop([EndsWith([7, 8])], tokens, 4, eos={1}) == 1  # an EOS before the criterion's stop
    assert first_stop([], tokens, 4, eos={9, 8}) == 0 and first_stop([], tokens, 4, eos={5}) is None  # new tokens only


def _with_drafts() -> list:
    """Plain decoding through the loop, and drafts that accept several tokens a step."""
    return [NoDrafter(), NGramDrafter(depth=4, max_nodes=12)]


def _inside_a_step(prompt: list[int], out) -> tuple[int, list[int]] | None:
    """A new token that is not the last of its step, and the shortest tail of the text ending there that occurs
    nowhere earlier (drafts copied from the text repeat short tails): a stop on that tail must cut the step short."""
    text, start = prompt + out.tokens, 0
    for n in out.accept_lengths:
        for k in range(start, start + n - 1):
            i = len(prompt) + k
            for width in range(1, i + 1):
                tail = text[i + 1 - width: i + 1]
                if not any(text[j + 1 - width: j + 1] == tail for j in range(width - 1, i)):
                    return k, tail
        start += n
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_stopping_criteria_cut_a_step_where_generate_stops(arch):
    """A stop sequence taken from inside a step that accepted several drafts: selfspec stops where
    generate(stopping_criteria=...) stops, that step cut after the stopping token; plain decoding through the loop
    too."""
    model = tiny_model(arch, initializer_range=0.1)
    target = Target(model)
    cut = 0
    for prompt in random_prompts(8, VOCAB, seed=11):
        full = generate(target, NGramDrafter(depth=4, max_nodes=12), prompt, 30)
        found = _inside_a_step(prompt.tolist(), full)
        if found is None:
            continue
        k, tail = found
        crit = EndsWith(tail)
        ref = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], do_sample=False,
                             max_new_tokens=30, pad_token_id=0, stopping_criteria=StoppingCriteriaList([crit]))
        ref = ref[0, prompt.shape[0]:].tolist()
        assert ref == full.tokens[: k + 1]
        out = generate(target, NGramDrafter(depth=4, max_nodes=12), prompt, 30, stopping_criteria=[crit])
        assert out.tokens == ref
        assert out.accept_lengths[-1] < full.accept_lengths[len(out.steps) - 1]  # the step was cut short
        assert generate(target, NoDrafter(), prompt, 30, stopping_criteria=[crit]).tokens == ref
        cut += 1
    assert cut >= 3, f"only {cut} prompts stop inside a step: the check is hardly exercised"


@pytest.mark.parametrize("arch", ARCHS)
def test_min_new_tokens_blocks_eos_at_every_tree_node_as_generate_does(arch):
    """The model's own 4th token plays EOS: without min_new_tokens decoding stops there; with min_new_tokens=12,
    greedy decoding with drafts (which propose that token inside their trees) and sampled decoding give what
    generate(min_new_tokens=12) gives."""
    model = tiny_model(arch, initializer_range=0.1)
    target = Target(model)
    for i, prompt in enumerate(random_prompts(5, VOCAB, seed=12)):
        kwargs = dict(attention_mask=torch.ones_like(prompt)[None], max_new_tokens=24)
        eos = model.generate(prompt[None], do_sample=False, pad_token_id=0, **kwargs)[0, prompt.shape[0] + 3].item()
        ref = model.generate(prompt[None], do_sample=False, eos_token_id=eos, pad_token_id=eos, min_new_tokens=12,
                             **kwargs)[0, prompt.shape[0]:].tolist()
        early = generate(target, NoDrafter(), prompt, 24, eos_token_id=eos).tokens
        assert len(early) <= 4 and early[-1] == eos
        ref = ref[: ref.index(eos) + 1] if eos in ref[12:] else ref  # generate pads after EOS
        assert len(ref) > 12 and eos not in ref[:12]
        for drafter in _with_drafts():
            assert generate(target, drafter, prompt, 24, eos_token_id=eos, min_new_tokens=12).tokens == ref
        s = Sampling(temperature=0.8)
        torch.manual_seed(i)
        sampled = model.generate(prompt[None], do_sample=True, temperature=0.8, top_k=0, eos_token_id=eos,
                                 pad_token_id=eos, min_new_tokens=6, **kwargs)[0, prompt.shape[0]:].tolist()
        sampled = sampled[: sampled.index(eos) + 1] if eos in sampled else sampled
        torch.manual_seed(i)
        assert generate(target, NoDrafter(), prompt, 24, sampling=s, eos_token_id=eos, min_new_tokens=6).tokens == sampled


def test_min_new_tokens_must_not_be_negative():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="min_new_tokens must be an int >= 0, found -1"):
        generate(Target(model), NoDrafter(), torch.tensor([1, 2, 3]), 4, min_new_tokens=-1)
