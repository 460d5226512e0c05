"""Pins selfspec/core/hf.py (every contact with transformers internals) against transformers itself.

- a tree verification (4D additive mask, explicit positions, cache) gives, at every node, the logits and final hidden
  state of a plain causal forward over the prefix and that node's root-to-node path;
- cache_keep leaves the cache a plain forward over prefix + kept path would build;
- the small helpers (additive_mask, decoder_layers, sliding_window, layer_masks) read the models as expected, and the
  target's sliding-window layers keep what a verification adds and slide after a commit.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import BertConfig, BertModel, DynamicCache

from conftest import ARCHS, VOCAB, tiny_model
from selfspec import Target, Tree
from selfspec.core import hf

TREE = Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
S = 11  # cached prefix length


def _setup(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (S,), generator=g)
    tokens = torch.randint(0, VOCAB, (len(TREE),), generator=g)
    return prefix, tokens


def _plain(model, ids: torch.Tensor):
    """A plain causal forward without a cache: logits [T, V], final hidden [T, D], and the cache it builds."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids[None], cache=cache, use_cache=True, output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0], cache


def _models():
    for arch in ARCHS:
        yield arch, "sdpa"
    yield "llama", "eager"
    yield "gpt2", "eager"


@pytest.fixture(scope="module", params=list(_models()), ids=lambda p: f"{p[0]}-{p[1]}")
def model(request):
    arch, attn = request.param
    m = tiny_model(arch)
    m.set_attn_implementation(attn)
    assert m.config._attn_implementation == attn
    return m


def test_prefill_is_a_plain_forward(model):
    prefix, _ = _setup(model)
    target = Target(model)
    cache = target.new_cache()
    pre = target.prefill(prefix, cache)
    logits, hidden, plain_cache = _plain(model, prefix)
    assert pre.logits.shape == (1, VOCAB) and pre.hidden.shape == (prefix.shape[0], 32)
    torch.testing.assert_close(pre.logits[0], logits[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre.hidden, hidden, rtol=1e-5, atol=1e-5)  # every prompt position
    assert hf.cache_length(cache) == S
    for a, b in zip(cache.layers, plain_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)


def test_tree_verify_equals_plain_forward_along_every_path(model):
    prefix, tokens = _setup(model)
    target = Target(model)
    cache = target.new_cache()
    target.prefill(prefix, cache)
    out = target.verify(TREE, tokens, cache)
    assert out.logits.shape == (len(TREE), VOCAB) and out.hidden.shape == (len(TREE), 32)
    assert hf.cache_length(cache) == S + len(TREE)
    for row in TREE.leaf_paths.tolist():
        path = [i for i in row if i >= 0]
        logits, hidden, _ = _plain(model, torch.cat([prefix, tokens[path]]))
        torch.testing.assert_close(out.logits[path], logits[S:], rtol=1e-5, atol=1e-5, msg=f"path {path}")
        torch.testing.assert_close(out.hidden[path], hidden[S:], rtol=1e-5, atol=1e-5, msg=f"path {path}")


@pytest.mark.parametrize(
    "keep",
    [[0], [0, 1], [0, 1, 4, 7], [0, 1, 5, 8], [0, 2, 6], [0, 3], list(range(len(TREE)))],
    ids=["root", "contiguous", "deep-branch", "deep-rank-1", "rank-1-branch", "rank-2", "everything"],
)
def test_cache_keep_equals_recomputation(model, keep):
    """Keep a path's entries (a gather when they are not contiguous, then a crop): the cache is as if only that path
    had ever been fed. "everything" keeps all nodes in order (nothing to drop)."""
    prefix, tokens = _setup(model)
    target = Target(model)
    cache = target.new_cache()
    target.prefill(prefix, cache)
    target.verify(TREE, tokens, cache)
    target.commit(cache, S, tuple(keep))  # hf.cache_keep, under inference mode like the cache it edits
    *_, want = _plain(model, torch.cat([prefix, tokens[keep]]))
    assert hf.cache_length(cache) == S + len(keep)
    for i, (a, b) in enumerate(zip(cache.layers, want.layers)):
        if keep == list(range(len(TREE))):  # a tree cache, not a path: compare only the prefix and the root
            a_k, b_k = a.keys[:, :, : S + 1], b.keys[:, :, : S + 1]
            a_v, b_v = a.values[:, :, : S + 1], b.values[:, :, : S + 1]
        else:
            a_k, b_k, a_v, b_v = a.keys, b.keys, a.values, b.values
        torch.testing.assert_close(a_k, b_k, rtol=1e-5, atol=1e-5, msg=f"layer {i} keys")
        torch.testing.assert_close(a_v, b_v, rtol=1e-5, atol=1e-5, msg=f"layer {i} values")


def test_forward_logits_to_keep():
    model = tiny_model("qwen2")
    ids = torch.arange(9) % VOCAB
    logits, states = hf.forward(model, ids, torch.arange(9), None, hf.new_cache(model), logits_to_keep=2)
    full_logits, full_hidden, _ = _plain(model, ids)
    hidden = states[-1]
    assert logits.shape == (2, VOCAB) and hidden.shape == (9, 32)  # logits for the last 2; hidden states for all
    assert len(states) == model.config.num_hidden_layers + 1 and all(s.shape == (9, 32) for s in states)
    torch.testing.assert_close(states[0], model.get_input_embeddings()(ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, full_logits[-2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden, full_hidden, rtol=1e-5, atol=1e-5)


def test_additive_mask():
    allowed = torch.tensor([[True, False, True], [True, True, False]])
    mask = hf.additive_mask(allowed, torch.bfloat16)
    assert mask.shape == (1, 1, 2, 3) and mask.dtype == torch.bfloat16
    low = torch.finfo(torch.bfloat16).min
    assert mask[0, 0].tolist() == [[0.0, low, 0.0], [0.0, 0.0, low]]


def test_decoder_layers():
    assert len(hf.decoder_layers(tiny_model("llama"))) == 2
    gpt2 = tiny_model("gpt2")
    assert hf.decoder_layers(gpt2) is gpt2.transformer.h
    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(TypeError, match=r"cannot find the decoder layers of BertModel: expected `.layers` or `.h`"):
        hf.decoder_layers(bert)


def test_sliding_window():
    assert hf.sliding_window(tiny_model("gemma3")) == 256
    assert hf.sliding_window(tiny_model("mistral")) == 1024
    assert hf.sliding_window(tiny_model("llama")) is None
    assert hf.sliding_window(tiny_model("gpt2")) is None
    assert hf.sliding_window(tiny_model("mistral", sliding_window=None)) is None
    qwen = tiny_model("qwen2")
    assert qwen.config.use_sliding_window is False and hf.sliding_window(qwen) is None
    # every layer full attention: no window even if the config names one
    gemma = tiny_model("gemma3", layer_types=["full_attention", "full_attention"])
    assert hf.sliding_window(gemma) is None


def test_layer_masks_apply_the_sliding_window_by_position():
    """A query at position q sees the keys at positions > q - window (transformers' rule); full layers keep the mask."""
    mask = hf.additive_mask(torch.ones(3, 10, dtype=torch.bool), torch.float32)  # [1, 1, 3, 10]: every key allowed
    positions = torch.tensor([7, 8, 8])
    gemma = tiny_model("gemma3", sliding_window=4)
    masks = hf.layer_masks(gemma, mask, positions, None)
    assert set(masks) == {"full_attention", "sliding_attention"} and masks["full_attention"] is mask
    seen = (masks["sliding_attention"][0, 0] == 0).tolist()
    assert [[k for k, ok in enumerate(row) if ok] for row in seen] == [[4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]
    windowed = hf.layer_masks(tiny_model("mistral", sliding_window=4), mask, positions, None)  # every layer slides
    assert torch.equal(windowed, masks["sliding_attention"])
    assert hf.layer_masks(tiny_model("llama"), mask, positions, None) is mask
    assert hf.layer_masks(gemma, None, positions, None) is None  # a prefill: the model builds its own masks


def test_sliding_layers_keep_what_a_verification_adds_and_slide_after_a_commit():
    """A verification near the window's edge needs entries a transformers sliding layer would drop mid-forward: the
    target's sliding layers keep them, then ``slide`` drops what no later query can see (the last window - 1 stay)."""
    gemma = tiny_model("gemma3", sliding_window=4)  # layer 0 slides, layer 1 attends fully
    target = Target(gemma)
    cache = target.new_cache()
    assert cache.is_sliding == [True, False] and isinstance(cache.layers[0], hf.WindowLayer)
    target.prefill(torch.arange(12), cache)
    tree = Tree.from_choices([(0,), (1,), (0, 0)])
    target.verify(tree, torch.tensor([12, 13, 14, 15]), cache)
    assert hf.layer_lengths(cache) == [16, 16] and cache.layers[0].stored == 16  # nothing dropped mid-verification
    target.commit(cache, 12, (0, 1, 3))  # root, node 1, node 3 (its child)
    assert hf.layer_lengths(cache) == [15, 15] and hf.cache_length(cache) == 15
    assert cache.layers[0].stored == 3 and cache.layers[0].offset == 12  # positions 12..14 stay, 0..11 are gone
    full_keys = cache.layers[1].keys[:, :, 12:]
    assert full_keys.shape[-2] == 3
    with torch.inference_mode():  # the kept entries are those of the accepted path: a plain forward over it agrees
        _, _, plain = _plain(gemma, torch.tensor(list(range(12)) + [12, 13, 15]))
    torch.testing.assert_close(cache.layers[0].keys, plain.layers[0].keys[:, :, -3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full_keys, plain.layers[1].keys[:, :, 12:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_verification_on_a_cpu_groups_its_attention_to_the_same_bits(monkeypatch, dtype):
    """transformers copies every cached key and value once per query head where a mask is in play (``repeat_kv``);
    ``hf.grouped_attention`` lets torch group the heads instead: a tree's or a chain's verification on a CPU then copies
    nothing, and its hidden states and logits are those of the copying path bit for bit (4 query heads over 2)."""
    from transformers.integrations import sdpa_attention

    model = tiny_model("llama").to(dtype)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prefix, tokens = _setup(model)
    copies = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real_repeat(x, n))

    def verified():
        """A tree (its own mask) and a chain of 3 (the causal mask transformers builds over the cache)."""
        out = []
        for tree, toks in ((TREE, tokens), (Tree.chain(2), tokens[:3])):
            target = Target(model)
            cache = target.new_cache()
            target.prefill(prefix, cache)
            out.append(target.verify(tree, toks, cache))
        return out

    grouped = verified()
    assert copies == []  # grouped: no copy of the cache, in any layer
    monkeypatch.setenv(hf.GROUPED_ATTENTION_SWITCH, "0")  # a user's own setting wins: transformers' copying path
    copying = verified()
    assert len(copies) >= 2 * 2 * model.config.num_hidden_layers  # keys and values, every layer, both verifications
    for a, b in zip(grouped, copying):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
    monkeypatch.delenv(hf.GROUPED_ATTENTION_SWITCH)
    verified()
    assert hf.GROUPED_ATTENTION_SWITCH not in os.environ  # the switch is set only during the forward


def test_draft_heads_group_their_drafting_attention_and_train_as_transformers_does(monkeypatch):
    """The EAGLE head's and the block drafter's drafting forwards (inference) copy no cache per query head, as the
    target's verification; a training forward (autograd) keeps transformers' own path."""
    from transformers.integrations import sdpa_attention

    from heads.block.config import BlockConfig
    from heads.block.drafter import BlockDrafter
    from heads.block.model import BlockHead
    from heads.eagle.config import EagleConfig
    from heads.eagle.drafter import EagleDrafter
    from heads.eagle.model import EagleHead
    from selfspec.core.generate import generate
    from selfspec.core.tree import DynamicTree

    model = tiny_model("llama")
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    torch.manual_seed(0)
    block = BlockHead(BlockConfig.for_model(model, block_size=4, draft_vocab_size=64), embed, lm_head).eval()
    eagle = EagleHead(EagleConfig.for_model(model, draft_vocab_size=64), embed, lm_head).eval()
    copies = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or real_repeat(x, n))
    prompt = torch.arange(3, 14)
    for drafter in (BlockDrafter(block, DynamicTree(10)), EagleDrafter(eagle, depth=3, topk=3, budget=10)):
        assert len(generate(Target(model), drafter, prompt, 12).tokens) == 12
    assert copies == []
    block.train()
    features = torch.randn(1, 10, model.config.hidden_size)
    pairs, blocks = block(features, torch.arange(10)[None], torch.tensor([10]), torch.tensor([[2, 5]]))
    (pairs.sum() + blocks.sum()).backward()
    assert copies  # training: transformers' copying path, as before
