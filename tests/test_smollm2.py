"""The real SmolLM2-135M-Instruct in fp32: speculative greedy output is token-identical to its own ``generate``.

Ten short chat prompts (chat template, 32 new tokens, the model's EOS), with the n-gram drafter and an oracle tree
drafter. The model is built offline from its PyPI package by selfspec.models on first use (~30 s), then read from the
cache.
"""

from __future__ import annotations

import pytest
import torch

from selfspec import NGramDrafter, Target, Tree, generate
from selfspec.models import load_model
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
    from heads.exit_head import ExitHead, ExitHeadConfig
    from selfspec.drafter import verifier_for
    from selfspec.early_exit import EarlyExitDrafter, EarlyExitTarget
    from selfspec.layerskip import LayerSkipDrafter

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
