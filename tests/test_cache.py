"""After many speculative steps the KV cache is exactly the cache of one plain forward over the accepted tokens.

The loop's cache holds the prompt and every emitted token but the last (the newest root, not yet fed to the model).
Every layer's keys and values must match a fresh causal forward over those tokens, to float rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import ARCHS, VOCAB, Recording, random_prompts, reference
from selfspec import Acceptance, Draft, Drafter, DraftState, NGramDrafter, Sampling, Target, Tree
from selfspec.core.generate import generate
from selfspec.testing import OracleDrafter, RandomDrafter

TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
NEW = 40


def plain_cache(model, tokens: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=tokens[None], cache=cache, use_cache=True)
    return cache


def assert_same_cache(got, want, where: str) -> None:
    assert len(got.layers) == len(want.layers)
    assert got.get_seq_length() == want.get_seq_length(), f"{where}: cache length differs"
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert a.keys.shape == b.keys.shape, f"{where}: layer {i} keys {tuple(a.keys.shape)} vs {tuple(b.keys.shape)}"
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: layer {i} {name}: {m}")


def _drafters(ref):
    return {
        "oracle": OracleDrafter(TREE, VOCAB, ref, branch_rank=1),
        "random": RandomDrafter(TREE, VOCAB, seed=1),
        "ngram": NGramDrafter(depth=4, max_nodes=12),
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_many_greedy_steps(tiny_models, arch):
    model = tiny_models[arch]
    target = Target(model)
    for k, prompt in enumerate(random_prompts(2, VOCAB, seed=7, min_len=8, max_len=12)):
        ref = reference(model, prompt, NEW)
        for name, drafter in _drafters(ref).items():
            rec = Recording(drafter)
            out = generate(target, rec, prompt, NEW)
            assert out.tokens == ref
            assert len(out.steps) > 5  # many speculative steps, not one
            accepted = torch.cat([prompt, torch.tensor(out.tokens[:-1])])
            assert_same_cache(rec.states[-1].cache, plain_cache(model, accepted), f"{arch}/{name}/prompt {k}")


class PeekingDrafter(Drafter):
    """Drafts the target's own top-3 next tokens, each followed by the target's greedy token after it (it runs the
    model itself, without the cache): with sampling, branches of every rank get accepted."""

    TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (1, 0), (2, 0)])

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def draft(self, state: DraftState) -> Draft:
        top = self.model(state.tokens[None]).logits[0, -1].topk(3).indices  # [3]
        grown = torch.cat([state.tokens.expand(3, -1), top[:, None]], dim=1)  # [3, T + 1]
        after = self.model(grown).logits[:, -1].argmax(-1)  # [3]
        return Draft(tree=self.TREE, tokens=torch.cat([state.tokens[-1:], top, after]))

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        return None


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_cache_after_many_sampled_steps(tiny_models, arch):
    """With sampling, the accepted path is random (and often a rank > 0 branch): the cache still matches."""
    model = tiny_models[arch]
    rec = Recording(PeekingDrafter(model))
    prompt = torch.arange(10) % VOCAB
    sampling = Sampling(temperature=1.5, top_k=4)  # a flat, narrow distribution: random drafts get accepted
    out = generate(Target(model), rec, prompt, NEW, sampling=sampling, generator=torch.Generator().manual_seed(0))
    ranks = [PeekingDrafter.TREE.ranks[acc.path[1]] for _, acc in rec.records if len(acc.path) > 1]
    assert len(ranks) > 10 and {1, 2} & set(ranks), f"accepted ranks {ranks}: expected many, some > 0"
    accepted = torch.cat([prompt, torch.tensor(out.tokens[:-1])])
    assert_same_cache(rec.states[-1].cache, plain_cache(model, accepted), f"{arch}/sampled")
