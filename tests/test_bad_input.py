"""Bad input gets an error that says what was expected and what was found, before any work is done."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, BertModel, T5Config, T5ForConditionalGeneration

from conftest import VOCAB, tiny_model
from selfspec import NoDrafter, Sampling, Target, Tree, stream
from selfspec.core.generate import generate
from selfspec.testing import RandomDrafter

CONTEXT = 32


@pytest.fixture(scope="module")
def target():
    return Target(tiny_model("llama", max_positions=CONTEXT))


def test_empty_prompt(target):
    with pytest.raises(ValueError, match="the prompt is empty: expected at least one token"):
        generate(target, NoDrafter(), torch.tensor([], dtype=torch.long), 4)


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 9])
def test_prompt_at_or_over_the_context(target, length):
    message = rf"the prompt has {length} tokens; this model's context holds {CONTEXT}: shorten the prompt"
    with pytest.raises(ValueError, match=message):
        generate(target, NoDrafter(), torch.zeros(length, dtype=torch.long), 1)


def test_prompt_plus_new_tokens_over_the_context(target):
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(13\) exceeds the model's context "
                                         rf"of {CONTEXT}; use max_new_tokens <= 12"):
        generate(target, NoDrafter(), torch.zeros(20, dtype=torch.long), 13)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_below_one(target, n):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be >= 1, found {n}"):
        generate(target, NoDrafter(), torch.tensor([1, 2]), n)


def test_batch_larger_than_one(target):
    with pytest.raises(ValueError, match=r"one sequence \(batch size 1\); found batch size 2: decode a batch with "
                                         r"selfspec.core.batch \(generate_batch\)"):
        generate(target, NoDrafter(), torch.zeros(2, 5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"expected input_ids of shape \[T\] or \[1, T\], found \(1, 1, 5\)"):
        generate(target, NoDrafter(), torch.zeros(1, 1, 5, dtype=torch.long), 4)
    # [1, T] is a batch of one: the same as [T]
    prompt = torch.tensor([5, 6, 7])
    assert generate(target, NoDrafter(), prompt[None], 4).tokens == generate(target, NoDrafter(), prompt, 4).tokens


def test_errors_come_before_any_step(target):
    """stream() is lazy, but its first step is the check: nothing is yielded for a bad request."""
    steps = stream(target, NoDrafter(), torch.tensor([], dtype=torch.long), 4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        next(steps)


def test_a_local_window_a_tree_mask_cannot_express_is_reached():
    """GPT-Neo's local layers window by a key's index in the sequence: beyond the window, refused (sliding windows by
    position are verified, tests/test_equivalence.py::test_decoding_far_beyond_the_sliding_window_is_token_identical)."""
    from test_architectures import SUPPORTED, build

    neo = Target(build("gpt_neo", {**SUPPORTED["gpt_neo"], "window_size": 64}))
    assert neo.window_limit == 64
    with pytest.raises(ValueError, match=r"prompt \+ max_new_tokens = 64 reaches this model's local attention window "
                                         r"\(64\), .* not supported for it; use max_new_tokens <= 23"):
        generate(neo, NoDrafter(), torch.zeros(40, dtype=torch.long), 24)


def _bert_config():
    return BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def _t5_config():  # a fresh config each time: T5's encoder-only classes rewrite the config they are given
    return T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.nn.Linear(4, 4), r"expected a transformers causal LM \(PreTrainedModel\), found Linear"),
        (lambda: BertModel(_bert_config()), r"expected a causal LM with an LM head, found BertModel without one"),
        (lambda: BertForMaskedLM(_bert_config()),
         r"expected a causal LM that transformers can generate with \(a \.\.\.ForCausalLM\), found BertForMaskedLM "
         r"\(model_type='bert'\)"),
        (lambda: T5ForConditionalGeneration(_t5_config()),
         r"expected a decoder-only causal LM, found encoder-decoder T5ForConditionalGeneration \(model_type='t5'\)"),
    ],
    ids=["not-a-model", "bert-no-head", "bert-masked-lm", "t5-encoder-decoder"],
)
def test_not_a_causal_lm(make, message):
    with pytest.raises(TypeError, match=message):
        Target(make())


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(temperature=-0.5), ValueError, r"temperature must be >= 0 \(0 = greedy\), got -0.5"),
        (dict(temperature=float("nan")), ValueError, r"temperature must be >= 0 \(0 = greedy\), got nan"),
        (dict(temperature=0.8, top_k=-1), ValueError, r"top_k must be >= 0 \(0 = off\), got -1"),
        (dict(temperature=0.8, top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        (dict(temperature=0.8, top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
        (dict(temperature="0.8"), TypeError, r"temperature must be a number, got str '0.8'"),
        (dict(temperature=0.8, top_k=2.5), TypeError, r"top_k must be an int, got float 2.5"),
        (dict(temperature=0.8, top_p=True), TypeError, r"top_p must be a number, got bool True"),
        (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be > 0 \(1.0 = off\), got 0.0"),
        (dict(repetition_penalty=float("nan")), ValueError, r"repetition_penalty must be > 0 \(1.0 = off\), got nan"),
    ],
)
def test_bad_sampling(kwargs, error, message):
    with pytest.raises(error, match=message):
        Sampling(**kwargs)


def test_good_sampling_values_pass():
    assert Sampling(temperature=0).greedy and not Sampling(temperature=1, top_k=3, top_p=1).greedy


def test_bad_accept_rule(target):
    with pytest.raises(ValueError, match=r"accept_rule must be 'exact' or 'typical', found 'fast'"):
        generate(target, NoDrafter(), torch.tensor([1, 2]), 4, accept_rule="fast")
    with pytest.raises(ValueError, match=r"typical acceptance is a sampling rule: set temperature > 0"):
        generate(target, NoDrafter(), torch.tensor([1, 2]), 4, accept_rule="typical")


def test_tree_token_count_mismatch(target):
    cache = target.new_cache()
    target.prefill(torch.tensor([1, 2, 3]), cache)
    with pytest.raises(ValueError, match=r"expected 4 tree tokens \(one per node\), found shape \(3,\)"):
        target.verify(Tree.chain(3), torch.tensor([1, 2, 3]), cache)


def test_typical_acceptance_runs_when_asked(target):
    """The opt-in lossy rule works through the loop (it is not compared with generate: it is not lossless)."""
    sampling, g = Sampling(temperature=1.0), torch.Generator().manual_seed(0)
    out = generate(target, RandomDrafter(Tree.chain(2), VOCAB), torch.tensor([1, 2]), 6, sampling=sampling,
                   accept_rule="typical", generator=g)
    assert len(out.tokens) == 6
