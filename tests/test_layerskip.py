"""Layer-skip drafting: drafts equal the skipped model's own greedy continuation, the cache is left exactly as found,
decoding through the runtime is token-identical to plain ``generate``, bad skip sets fail clearly; the skip-set search
and its config checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, reference, tiny_model

from selfspec import hf
from selfspec.drafter import DraftState
from selfspec.generate import generate
from selfspec.layerskip import LayerSkipDrafter
from selfspec.sampling import Sampling
from selfspec.target import Target
from selfspec.tree import Tree

LAYERS, VOCAB = 4, 96
WEAK = (1, 2)  # layers whose output is scaled down: skipping them keeps most drafts right (runs of accepted tokens)


def four_layer(arch: str, seed: int = 0):
    """A tiny 4-layer model with spread-out logits whose layers 1 and 2 write little to the residual stream."""
    extra = {"layer_types": ["full_attention"] * LAYERS} if arch == "qwen2" else {}
    model = tiny_model(arch, vocab=VOCAB, seed=seed, num_hidden_layers=LAYERS, initializer_range=0.5, **extra)
    with torch.no_grad():
        for i in WEAK:
            layer = hf.decoder_layers(model)[i]
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models():
    return {arch: four_layer(arch) for arch in ("llama", "qwen2")}


def prefilled(target: Target, prompt: torch.Tensor) -> DraftState:
    """The loop's state right after the prefill of ``prompt``: the root is the target's own first token."""
    cache = target.new_cache()
    out = target.prefill(prompt, cache)
    root = int(out.logits[-1].argmax())
    tokens = torch.cat([prompt, prompt.new_tensor([root])])
    return DraftState(tokens=tokens, prompt_length=prompt.shape[0], hidden=out.hidden[-1], cache=cache, sampling=Sampling())


@torch.inference_mode()
def skipped_greedy(model, tokens: torch.Tensor, skip: tuple[int, ...], n: int, start: int | None = None
                   ) -> tuple[list[int], list[float]]:
    """The skipped model's greedy continuation of tokens [T] on top of the full model's cache of tokens[:start]
    (default: all but the last): recomputed for every token in one causal forward over all tokens from ``start`` on
    (never appended one by one, as the drafter does)."""
    target = Target(model)
    start = tokens.shape[0] - 1 if start is None else start
    new = tokens[start:].clone()
    out, probs = [], []
    cache = target.new_cache()
    target.prefill(tokens[:start], cache)
    for _ in range(n):
        k = new.shape[0]
        allowed = torch.cat([torch.ones(k, start, dtype=torch.bool), torch.ones(k, k, dtype=torch.bool).tril()], dim=1)
        positions = torch.arange(start, start + k)
        with hf.replaced_layers(model, {i: hf.Passthrough() for i in skip}):
            logits, _ = hf.forward_partial(model, positions, hf.additive_mask(allowed, torch.float32), cache, input_ids=new)
        hf.cache_truncate(cache, start)
        p = logits[-1].float().softmax(-1)
        out.append(int(p.argmax()))
        probs.append(float(p.max()))
        new = torch.cat([new, new.new_tensor([out[-1]])])
    return out, probs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip", [(1,), (0, 2), (1, 2, 3)])
def test_chain_is_the_skipped_models_continuation_and_cache_is_untouched(models, arch, skip):
    model = models[arch]
    target = Target(model)
    state = prefilled(target, random_prompts(1, VOCAB, seed=3)[0])
    before = [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers]
    draft = LayerSkipDrafter(target, skip, depth=4).draft(state)
    assert draft.tree == Tree.chain(4) and draft.q is None
    want, _ = skipped_greedy(model, state.tokens, skip, 4)
    assert draft.tokens.tolist() == [int(state.tokens[-1])] + want
    assert hf.layer_lengths(state.cache) == [state.tokens.shape[0] - 1] * LAYERS
    for (k0, v0), layer in zip(before, state.cache.layers):
        assert torch.equal(k0, layer.keys) and torch.equal(v0, layer.values)
    assert all(type(m).__name__ != "Passthrough" for m in hf.decoder_layers(model))


def test_tree_nodes_are_the_drafts_top_k_under_their_parent(models):
    model = models["llama"]
    target = Target(model)
    state = prefilled(target, random_prompts(2, VOCAB, seed=5)[1])
    tree = Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    draft = LayerSkipDrafter(target, (2,), tree=tree).draft(state)
    assert draft.tree == tree
    for node in range(1, len(tree)):
        path = tree.path_to(node)[:-1]  # the parent's path from the root
        seq = torch.cat([state.tokens[:-1], draft.tokens[path]])
        want, _ = skipped_greedy(model, seq, (2,), 1, start=state.tokens.shape[0] - 1)
        if tree.ranks[node] == 0:
            assert int(draft.tokens[node]) == want[0], f"node {node}"
        else:  # rank 1: the second best of the same distribution
            assert int(draft.tokens[node]) != want[0]
            assert int(draft.tokens[node]) == int(draft.tokens[tree.children[tree.parents[node]][1]])


def test_confidence_stop_drops_the_levels_below_the_threshold(models):
    model = models["llama"]
    target = Target(model)
    for seed in range(6):
        state = prefilled(target, random_prompts(1, VOCAB, seed=seed)[0])
        _, probs = skipped_greedy(model, state.tokens, (1,), 6)
        low = sorted(probs)
        threshold = (low[1] + low[2]) / 2  # two of the six tokens fall below it, clear of float noise
        assert low[2] - low[1] > 1e-4
        draft = LayerSkipDrafter(target, (1,), depth=6, stop_below=threshold).draft(state)
        expected = next((d for d, p in enumerate(probs) if p < threshold), 6)
        assert draft.tree.depth == expected
        assert hf.layer_lengths(state.cache) == [state.tokens.shape[0] - 1] * LAYERS


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_is_token_identical_to_generate(models, arch):
    model = models[arch]
    target = Target(model)
    drafters = [
        LayerSkipDrafter(target, (1,), depth=3),
        LayerSkipDrafter(target, (1, 2), depth=5, stop_below=0.3),
        LayerSkipDrafter(target, (3,), tree=Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])),
        LayerSkipDrafter(target, (0,), depth=3),  # skips a strong layer: nearly every draft is rejected
    ]
    gained = []
    for i, prompt in enumerate(random_prompts(8, VOCAB, seed=11)):
        out = generate(target, drafters[i % len(drafters)], prompt, 24)
        assert out.tokens == reference(model, prompt, 24), f"prompt {i}"
        gained.append(out.mean_accepted)
    assert min(gained) < 1.1 and max(gained) > 2.0  # both long accepted runs and rejections were exercised


def test_greedy_with_eos_stops_where_generate_stops(models):
    model = models["llama"]
    target = Target(model)
    prompt = random_prompts(1, VOCAB, seed=2)[0]
    free = reference(model, prompt, 30)
    eos = free[7]
    got = generate(target, LayerSkipDrafter(target, (1,), depth=4), prompt, 30, eos_token_id=eos).tokens
    assert got == reference(model, prompt, 30, eos_token_id=eos) == free[: free.index(eos) + 1]


@pytest.mark.parametrize(
    "skip, message",
    [((), "empty"), ((0, 1, 2, 3), "all 4"), ((4,), "out of range"), ((-1,), "out of range"), ((1, 1), "twice")],
)
def test_bad_skip_sets_are_refused(models, skip, message):
    with pytest.raises(ValueError, match=message):
        LayerSkipDrafter(Target(models["llama"]), skip)


def test_bad_depth_and_threshold_are_refused(models):
    target = Target(models["llama"])
    with pytest.raises(ValueError, match="depth"):
        LayerSkipDrafter(target, (1,), depth=0)
    with pytest.raises(ValueError, match="stop_below"):
        LayerSkipDrafter(target, (1,), stop_below=1.0)
