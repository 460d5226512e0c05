"""Early-exit drafting: drafts are the first-E-layers model's continuation (with or without an exit head), the KV entries
and hidden states reused from drafting equal those of a full forward, decoding with and without reuse is
token-identical to plain ``generate``, and bad exit layers fail clearly."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, reference, tiny_model
from test_layerskip import LAYERS, VOCAB, four_layer, prefilled, skipped_greedy

from selfspec.core import hf
from selfspec.drafts.early_exit import EarlyExitDrafter, EarlyExitTarget
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree

EXIT = 2  # layers 2 and 3 of the test models are weak: drafts from layer 2 are mostly right


@pytest.fixture(scope="module")
def models():
    return {arch: four_layer(arch, weak=(2, 3)) for arch in ("llama", "qwen2")}


def near_identity(dim: int, seed: int = 0) -> torch.nn.Module:
    """An 'exit head' that changes the hidden state a little (what a trained adapter might do)."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(dim, dim)
    with torch.no_grad():
        head.weight.mul_(0.2).add_(torch.eye(dim))
    return head.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_chain_is_the_first_layers_continuation(models, arch, exit_layer):
    model = models[arch]
    target = Target(model)
    state = prefilled(target, random_prompts(1, VOCAB, seed=7)[0])
    drafter = EarlyExitDrafter(target, exit_layer, depth=4)
    draft = drafter.draft(state)
    want, _ = skipped_greedy(model, state.tokens, tuple(range(exit_layer, LAYERS)), 4)
    assert draft.tokens.tolist() == [int(state.tokens[-1])] + want
    assert hf.layer_lengths(state.cache) == [state.tokens.shape[0] - 1] * LAYERS
    assert drafter.last_work is not None and drafter.last_work.tokens.tolist() == draft.tokens[:4].tolist()


def test_exit_head_sits_between_layer_e_and_the_final_norm(models):
    model = models["llama"]
    target = Target(model)
    head = near_identity(32)
    state = prefilled(target, random_prompts(1, VOCAB, seed=8)[0])
    draft = EarlyExitDrafter(target, EXIT, depth=3, exit_head=head).draft(state)
    start = state.tokens.shape[0] - 1
    seq = state.tokens[start:]
    with torch.inference_mode():
        for j in range(3):  # reference: layers 0..E-1 by hand on the full model's cache, head, final norm, LM head
            cache = target.new_cache()
            target.prefill(state.tokens[:start], cache)
            n = seq.shape[0]
            allowed = torch.cat([torch.ones(n, start, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
            with hf.replaced_layers(model, {2: hf.Passthrough(), 3: hf.Passthrough()}), \
                    hf.captured_output(hf.decoder_layers(model)[EXIT - 1]) as out:
                hf.forward_partial(model, seq, torch.arange(start, start + n), hf.additive_mask(allowed, torch.float32), cache)
            logits = model.lm_head(model.model.norm(head(out[-1][0, -1])))
            assert int(draft.tokens[j + 1]) == int(logits.argmax()), f"draft token {j + 1}"
            seq = torch.cat([seq, draft.tokens[j + 1 : j + 2]])
    headless = EarlyExitDrafter(target, EXIT, depth=3).draft(prefilled(target, random_prompts(1, VOCAB, seed=8)[0]))
    assert headless.tokens.tolist() != draft.tokens.tolist()  # the head is really used


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kv_entries_reused_from_drafting_equal_a_full_forward(models, arch):
    model = models[arch]
    prompt = random_prompts(1, VOCAB, seed=9)[0]
    full, fast = Target(model), EarlyExitTarget(EarlyExitDrafter(Target(model), EXIT, depth=4))
    state = prefilled(fast, prompt)
    draft = fast.drafter.draft(state)
    work = fast.drafter.last_work
    n = len(draft.tree)
    assert n == 5 and work.tokens.shape == (4,)  # the root and 3 drafts were fed; the 4th draft was not
    reference_state = prefilled(full, prompt)
    want = full.verify(draft.tree, draft.tokens, reference_state.cache)
    got = fast.verify(draft.tree, draft.tokens, state.cache)
    assert fast.reused == 4 and fast.drafter.last_work is None
    start = prompt.shape[0]
    # rtol: the same numbers from GEMMs of other shapes round differently per CPU (an AMD EPYC differed by 1.001e-5
    # on a key of magnitude 5); a wrong entry would differ by O(1)
    for i in range(EXIT):  # what drafting kept is what the full forward computes
        k, v = hf.layer_entries(reference_state.cache, i, start, start + 4)
        torch.testing.assert_close(work.keys[i], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(work.values[i], v, rtol=1e-5, atol=1e-5)
    assert hf.layer_lengths(state.cache) == hf.layer_lengths(reference_state.cache) == [start + n] * LAYERS
    for mine, theirs in zip(state.cache.layers, reference_state.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


def test_reuse_is_skipped_for_what_drafting_did_not_compute(models):
    model = models["llama"]
    fast = EarlyExitTarget(EarlyExitDrafter(Target(model), EXIT, depth=3))
    state = prefilled(fast, random_prompts(1, VOCAB, seed=10)[0])
    draft = fast.drafter.draft(state)
    other = draft.tokens.clone()
    other[1] = (other[1] + 1) % VOCAB  # not the tokens drafting fed
    fast.verify(draft.tree, other, state.cache)
    assert fast.reused == 0
    hf.cache_truncate(state.cache, state.tokens.shape[0] - 1)
    fast.drafter.draft(state)
    short = draft.truncated(1)  # the loop cut the chain: still reusable
    fast.verify(short.tree, short.tokens, state.cache)
    assert fast.reused == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_with_and_without_reuse_is_token_identical_to_generate(models, arch):
    model = models[arch]
    target = Target(model)
    drafters = [
        EarlyExitDrafter(target, EXIT, depth=4),
        EarlyExitDrafter(target, 1, depth=3, stop_below=0.3),
        EarlyExitDrafter(target, 3, depth=5, exit_head=near_identity(32)),
        EarlyExitDrafter(target, EXIT, tree=Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])),
        EarlyExitDrafter(target, 3, tree=DynamicTree(6, max_rank=2), exit_head=near_identity(32)),  # 4 deep, grown
    ]
    gained = []
    for i, prompt in enumerate(random_prompts(10, VOCAB, seed=12)):
        drafter = drafters[i % len(drafters)]
        want = reference(model, prompt, 24)
        assert generate(target, drafter, prompt, 24).tokens == want, f"prompt {i} without reuse"
        fast = EarlyExitTarget(drafter)
        out = generate(fast, drafter, prompt, 24)
        assert out.tokens == want, f"prompt {i} with reuse"
        chain = drafter.tree is not None and drafter.tree == Tree.chain(drafter.tree.depth)
        assert (fast.reused > 0) == chain  # trees, static or dynamic: full verification
        gained.append(out.mean_accepted)
    assert max(gained) > 2.0  # long accepted runs were exercised


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "gpt2"])
def test_other_architectures_decode_like_generate_with_reuse(arch):
    model = tiny_model(arch)
    drafter = EarlyExitDrafter(Target(model), 1, depth=3)
    fast = EarlyExitTarget(drafter)
    for prompt in random_prompts(2, 64, seed=1):
        assert generate(fast, drafter, prompt, 16).tokens == reference(model, prompt, 16)
    assert fast.reused > 0


@pytest.mark.parametrize("exit_layer", [0, 4, -1, "2"])
def test_bad_exit_layers_are_refused(models, exit_layer):
    with pytest.raises(ValueError, match=r"exit layer must be in 1\.\.3"):
        EarlyExitDrafter(Target(models["llama"]), exit_layer)


@pytest.mark.smollm2
def test_smollm2_fp32_greedy_is_token_identical_to_generate():
    from selfspec.tools.layerskip_search import calibration_inputs
    from selfspec.core.models import load_model

    model, tokenizer = load_model()
    drafter = EarlyExitDrafter(Target(model), 20, depth=4, stop_below=0.2)
    fast = EarlyExitTarget(drafter)
    gained = 0
    for prompt in calibration_inputs(tokenizer, 2):
        out = generate(fast, drafter, prompt, 20)
        assert out.tokens == reference(model, prompt, 20)
        gained += len(out.tokens) - len(out.steps)
    assert fast.reused > 0 and gained > 0
