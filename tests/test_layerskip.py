"""Layer-skip drafting: drafts equal the skipped model's own greedy continuation, the cache is left exactly as found,
decoding through the runtime is token-identical to plain ``generate``, bad skip sets fail clearly; the skip-set search
and its config checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, reference, state_after_prefill, tiny_model

from selfspec.core import hf
from selfspec.core.drafter import DraftState
from selfspec.core.generate import generate
from selfspec.drafts.layerskip import LayerSkipConfig, LayerSkipDrafter, load_drafter
from selfspec.tools.layerskip_search import Measurement, search_skip_layers
from selfspec.core.sampling import Sampling
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree

LAYERS, VOCAB = 4, 96
WEAK = (1, 2)  # layers whose output is scaled down: skipping them keeps most drafts right (runs of accepted tokens)


def four_layer(arch: str, seed: int = 0, weak: tuple[int, ...] = WEAK):
    """A tiny 4-layer model with spread-out logits whose ``weak`` layers write little to the residual stream."""
    extra = {"layer_types": ["full_attention"] * LAYERS} if arch == "qwen2" else {}
    model = tiny_model(arch, vocab=VOCAB, seed=seed, num_hidden_layers=LAYERS, initializer_range=0.5, **extra)
    with torch.no_grad():
        for i in weak:
            layer = hf.decoder_layers(model)[i]
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


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
            logits, _ = hf.forward_partial(model, new, positions, hf.additive_mask(allowed, torch.float32), cache)
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


def test_a_dynamic_tree_of_rank_one_is_the_chain(models):
    model = models["llama"]
    target = Target(model)
    for seed in range(3):
        state = prefilled(target, random_prompts(1, VOCAB, seed=seed)[0])
        chain = LayerSkipDrafter(target, (1,), depth=4).draft(state)
        grown = LayerSkipDrafter(target, (1,), tree=DynamicTree(4, max_rank=1, depth=4)).draft(state)
        assert grown.tree == chain.tree == Tree.chain(4)
        assert torch.equal(grown.tokens, chain.tokens)
        assert hf.layer_lengths(state.cache) == [state.tokens.shape[0] - 1] * LAYERS


@torch.inference_mode()
def skipped_logprobs(model, seq: torch.Tensor, skip: tuple[int, ...], start: int) -> torch.Tensor:
    """[V] the skipped model's next-token log-probabilities after seq, over the full model's cache of seq[:start]."""
    target = Target(model)
    cache = target.new_cache()
    target.prefill(seq[:start], cache)
    k = seq.shape[0] - start
    allowed = torch.cat([torch.ones(k, start, dtype=torch.bool), torch.ones(k, k, dtype=torch.bool).tril()], dim=1)
    with hf.replaced_layers(model, {i: hf.Passthrough() for i in skip}):
        logits, _ = hf.forward_partial(model, seq[start:], torch.arange(start, seq.shape[0]),
                                       hf.additive_mask(allowed, torch.float32), cache)
    return logits[-1].float().log_softmax(-1)


def test_dynamic_tree_nodes_are_top_k_under_their_path_with_cumulative_scores(models):
    model = models["llama"]
    target = Target(model)
    state = prefilled(target, random_prompts(2, VOCAB, seed=5)[1])
    draft = LayerSkipDrafter(target, (2,), tree=DynamicTree(9, max_rank=3, depth=3)).draft(state)
    tree, start = draft.tree, state.tokens.shape[0] - 1
    assert len(tree) == 10 and tree.depth == 3 and draft.q is None
    assert any(tree.ranks[i] > 0 for i in range(1, 10)) and any(d == 3 for d in tree.depths)  # wide and deep
    for node in range(1, len(tree)):
        path = tree.path_to(node)[:-1]  # the parent's path from the root
        logp = skipped_logprobs(model, torch.cat([state.tokens[:-1], draft.tokens[path]]), (2,), start)
        token = int(draft.tokens[node])
        assert token in logp.topk(3).indices.tolist(), f"node {node}"
        parent = tree.parents[node]
        assert float(draft.scores[node]) == pytest.approx(float(draft.scores[parent]) + float(logp[token]), abs=1e-4)
        assert float(draft.scores[node]) <= float(draft.scores[parent])
    assert hf.layer_lengths(state.cache) == [start] * LAYERS


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
        LayerSkipDrafter(target, (1,), tree=DynamicTree(8, max_rank=3, depth=4)),  # grown each step
        LayerSkipDrafter(target, (1, 2), depth=4, tree=DynamicTree(5, max_rank=2), stop_below=0.3),
    ]
    gained = []
    for i, prompt in enumerate(random_prompts(12, VOCAB, seed=11)):
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


def test_sampling_with_top_k_1_takes_the_lossless_path_and_equals_greedy(models):
    model = models["qwen2"]
    target = Target(model)
    drafter = LayerSkipDrafter(target, (1,), depth=4)
    for prompt in random_prompts(3, VOCAB, seed=21):
        out = generate(target, drafter, prompt, 20, sampling=Sampling(temperature=0.7, top_k=1),
                       generator=torch.Generator().manual_seed(0))
        assert out.tokens == reference(model, prompt, 20) and out.mean_accepted > 1.0


def test_replaced_layers_are_restored_after_an_error_and_checked(models):
    model = models["llama"]
    layers = list(hf.decoder_layers(model))
    with pytest.raises(RuntimeError, match="boom"):
        with hf.replaced_layers(model, {1: hf.Passthrough(), 3: hf.Passthrough()}):
            assert isinstance(hf.decoder_layers(model)[3], hf.Passthrough)
            raise RuntimeError("boom")
    assert list(hf.decoder_layers(model)) == layers
    with pytest.raises(ValueError, match="out of range: this model has 4 decoder layers"):
        with hf.replaced_layers(model, {4: hf.Passthrough()}):
            pass


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


# ------------------------------------------------------------------------------------------- search and checkpoint
def fake_score(speeds: dict[tuple[int, ...], float], calls: list):
    """A deterministic stand-in for timing: tokens/s looked up per skip set (1.0 when not listed)."""
    def score(skip):
        calls.append(skip)
        return Measurement(new_tokens=int(speeds.get(skip, 1.0) * 100), seconds=100.0, steps=10)
    return score


def test_greedy_search_adds_the_fastest_layer_each_round_and_stops_without_gain(models):
    target = Target(models["llama"])
    speeds = {(2,): 3.0, (0, 2): 2.0, (1, 2): 4.0, (2, 3): 3.5, (0, 1, 2): 3.9, (1, 2, 3): 3.0}
    calls: list = []
    result = search_skip_layers(target, random_prompts(1, VOCAB, seed=0), max_new_tokens=2,
                                score=fake_score(speeds, calls))
    assert calls == [(0,), (1,), (2,), (3,), (0, 2), (1, 2), (2, 3), (0, 1, 2), (1, 2, 3)]
    assert result.skip_layers == (1, 2) and result.best.tokens_per_s == 4.0
    assert [s for s, _ in result.trials] == calls and result.plain.new_tokens == 2


def test_search_respects_candidates_max_skip_patience_and_per_round(models):
    target = Target(models["llama"])
    prompts = random_prompts(1, VOCAB, seed=0)
    calls: list = []
    search_skip_layers(target, prompts, max_new_tokens=2, candidates=[1, 3], score=fake_score({}, calls))
    assert calls == [(1,), (3,), (1, 3)]  # only the candidates; round 2 gains nothing, and patience is 1
    calls.clear()
    speeds = {(0,): 2.0, (0, 1): 1.0, (0, 1, 2): 5.0}
    result = search_skip_layers(target, prompts, max_new_tokens=2, patience=2, score=fake_score(speeds, calls))
    assert result.skip_layers == (0, 1, 2) and len(calls) == 4 + 3 + 2
    calls.clear()
    search_skip_layers(target, prompts, max_new_tokens=2, per_round=2, max_skip=2, patience=2, seed=1,
                       score=fake_score({}, calls))
    assert [len(c) for c in calls] == [1, 1, 2, 2] and len(set(calls)) == 4
    for bad in (dict(candidates=[4]), dict(max_skip=4), dict(patience=0), dict(per_round=0)):
        with pytest.raises(ValueError):
            search_skip_layers(target, prompts, score=fake_score({}, []), **bad)


def test_real_search_saves_a_checkpoint_that_decodes_like_generate(models, tmp_path):
    model = models["llama"]
    target = Target(model)
    prompts = random_prompts(2, VOCAB, seed=4)
    result = search_skip_layers(target, prompts, depth=3, max_new_tokens=8, candidates=[1, 2], max_skip=1)
    assert result.skip_layers in ((1,), (2,)) and [s for s, _ in result.trials] == [(1,), (2,)]
    assert result.plain.new_tokens == 16 == result.best.new_tokens and result.plain.steps == 16
    assert result.best.tokens_per_s == max(m.tokens_per_s for _, m in result.trials)
    config = result.config("tiny-llama", LAYERS, draft_depth=3, stop_below=0.1)
    path = config.save(tmp_path / "skip")
    data = json.loads(path.read_text())
    assert data["draft_type"] == "layerskip" and data["skip_layers"] == list(result.skip_layers)
    assert data["measured"]["mean_accepted"] == result.best.mean_accepted
    assert LayerSkipConfig.load(tmp_path / "skip") == config == LayerSkipConfig.load(path)
    drafter = load_drafter(tmp_path / "skip", target)
    assert drafter.skip_layers == result.skip_layers and drafter.tree == Tree.chain(3) and drafter.stop_below == 0.1
    tree_drafter = load_drafter(str(tmp_path / "skip"), target, tree=[[0], [1], [0, 0]])
    assert tree_drafter.tree == Tree.from_choices([[0], [1], [0, 0]])
    for prompt in prompts:
        assert generate(target, drafter, prompt, 16).tokens == reference(model, prompt, 16)


def test_config_is_strict_and_refuses_another_layer_count(models, tmp_path):
    good = dict(draft_type="layerskip", base_model="m", num_hidden_layers=4, skip_layers=[1, 2], draft_depth=3,
                stop_below=0.0, measured={})
    assert LayerSkipConfig.from_dict(good).skip_layers == (1, 2)
    cases = [
        ({**good, "extra": 1}, ValueError, "unknown keys"),
        ({**good, "num_hidden_layers": "4"}, TypeError, "num_hidden_layers must be int"),
        ({**good, "draft_depth": True}, TypeError, "draft_depth must be int"),
        ({**good, "skip_layers": [1.5]}, TypeError, "list of integers"),
        ({k: v for k, v in good.items() if k != "skip_layers"}, ValueError, "lacks keys"),
        ({**good, "skip_layers": [0, 1, 2, 3]}, ValueError, "all 4"),
        ({**good, "draft_type": "medusa"}, ValueError, "draft_type"),
    ]
    for data, error, message in cases:
        with pytest.raises(error, match=message):
            LayerSkipConfig.from_dict(data)
    LayerSkipConfig.from_dict({**good, "num_hidden_layers": 6}).save(tmp_path / "six")
    with pytest.raises(ValueError, match="6 layers, but the target has 4"):
        load_drafter(tmp_path / "six", Target(models["llama"]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(tmp_path / "missing", Target(models["llama"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_drafter(tmp_path / "empty", Target(models["llama"]))


@pytest.mark.smollm2
def test_smollm2_fp32_greedy_is_token_identical_to_generate():
    from selfspec.tools.layerskip_search import calibration_inputs
    from selfspec.core.models import load_model

    model, tokenizer = load_model()
    target = Target(model)
    prompts = calibration_inputs(tokenizer, 2)
    assert all(p.dim() == 1 and p.shape[0] > 10 for p in prompts)
    drafter = LayerSkipDrafter(target, tuple(range(4, 26, 2)), depth=4, stop_below=0.2)
    gained = 0
    for prompt in prompts:
        out = generate(target, drafter, prompt, 20)
        assert out.tokens == reference(model, prompt, 20)
        gained += len(out.tokens) - len(out.steps)
    assert gained > 0  # some drafts were accepted


def test_a_draft_vocabulary_keeps_layer_skip_drafts_in_it_and_lossless(models, tmp_path):
    """A layer-skip checkpoint with ``draft_vocab`` drafts only those tokens (the LM head's rows of them) and still
    decodes token-identically to generate; an id the target does not have is refused, naming the checkpoint."""
    model = models["llama"]
    vocab = tuple(range(0, VOCAB, 2))  # the even ids
    LayerSkipConfig(base_model="tiny", num_hidden_layers=LAYERS, skip_layers=(1,), draft_depth=3,
                    draft_vocab=vocab).save(tmp_path / "v")
    assert json.loads((tmp_path / "v" / "config.json").read_text())["draft_vocab"] == list(vocab)
    target = Target(model)
    drafter = load_drafter(tmp_path / "v", target, tree=DynamicTree(6, depth=3))
    assert drafter.vocab is not None and drafter.vocab.size == len(vocab)
    drafted = set()
    for prompt in random_prompts(4, VOCAB, seed=31):
        drafted |= set(drafter.draft(state_after_prefill(model, prompt)).tokens[1:].tolist())
        assert generate(target, drafter, prompt, max_new_tokens=16).tokens == reference(model, prompt, 16)
    assert drafted and all(t % 2 == 0 for t in drafted)
    LayerSkipConfig(base_model="tiny", num_hidden_layers=LAYERS, skip_layers=(1,), draft_depth=3,
                    draft_vocab=(0, VOCAB + 5)).save(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"layer-skip checkpoint .*bad: its draft_vocab does not fit this target"):
        load_drafter(tmp_path / "bad", target)
    with pytest.raises(ValueError, match=r"draft_vocab must hold distinct token ids >= 0"):
        LayerSkipConfig(base_model="tiny", num_hidden_layers=LAYERS, skip_layers=(1,), draft_depth=3, draft_vocab=(3, 3))


def test_add_vocab_gives_a_layer_skip_checkpoint_a_draft_vocabulary(tmp_path, capsys):
    from conftest import decode_with_tiny_draft

    from heads import add_vocab

    LayerSkipConfig(base_model="tiny-random-llama", num_hidden_layers=2, skip_layers=(1,), draft_depth=3).save(
        tmp_path / "skip")
    data = str(Path(__file__).resolve().parents[1] / "configs" / "data" / "tiny_chat.jsonl")
    assert add_vocab.main([str(tmp_path / "skip"), "--size", "30", "--source", data, "--out", str(tmp_path / "v30")]) == 0
    assert "layerskip checkpoint now drafts from the 30 tokens" in capsys.readouterr().out
    config = LayerSkipConfig.load(tmp_path / "v30")
    assert len(config.draft_vocab) == 30 and config.skip_layers == (1,)
    assert LayerSkipConfig.load(tmp_path / "skip").draft_vocab == ()  # --out: the original is untouched
    decode_with_tiny_draft(tmp_path / "v30")
