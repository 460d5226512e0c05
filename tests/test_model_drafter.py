"""A separate draft model (selfspec/drafts/draft_model.py): greedy decoding with it is token-identical to ``generate``
on every tiny architecture, as a chain, a static tree and a dynamic tree; its cache follows what the target accepts,
across requests too; ``--draft model:DIR`` loads it checked against the target (tokenizer, device, dtype, size); bench
runs transformers' assisted generation with the same draft model beside it. Sampling with its q: test_distribution.py.
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch

import tiny_chat_model
from conftest import ARCHS, REPEATING, VOCAB, Recording, random_prompts, reference, tiny_model
from selfspec import GenerationOptions, Sampling, Target, Tree, api, registry
from selfspec.core.generate import generate
from selfspec.core.models import load_model
from selfspec.core.tree import DynamicTree
from selfspec.drafts.draft_model import ModelDrafter, common_prefix, draws, on_vocab
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.ngram import NGramDrafter

NEW = 20
TREES = {"chain": Tree.chain(4), "static": Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
         "dynamic": DynamicTree(8, max_rank=4, depth=4), "cut": DynamicTree(8, max_rank=4, depth=4, min_prob=0.05)}


def first_layers(model, k: int):
    """A copy of ``model`` keeping its first k decoder layers: a draft that agrees with it often, not always."""
    draft = copy.deepcopy(model)
    if hasattr(draft, "transformer"):  # GPT-2
        draft.transformer.h = draft.transformer.h[:k]
        draft.config.n_layer = k
    else:
        draft.model.layers = draft.model.layers[:k]
        draft.config.num_hidden_layers = k
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = draft.config.layer_types[:k]
    return draft


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_models):
    arch = request.param
    model = tiny_models[arch]
    prompts = random_prompts(12, VOCAB, seed=300 + ARCHS.index(arch))
    return arch, model, Target(model), prompts, [reference(model, p, NEW) for p in prompts]


@pytest.mark.parametrize("shape", list(TREES))
def test_greedy_with_a_draft_model_is_generate(case, shape):
    """A one-layer copy of the target drafts: every answer is generate's, and drafts are accepted on some steps (with
    the min_prob cut, on these flat random distributions, most steps send the root alone instead)."""
    arch, model, target, prompts, refs = case
    drafter = Recording(ModelDrafter(first_layers(model, 1), target, TREES[shape]))
    for p, ref in zip(prompts, refs):
        assert generate(target, drafter, p, NEW).tokens == ref, f"{arch}/{shape}: differs from generate on {p.tolist()}"
    accepted = sum(acc.num_accepted_drafts for _, acc in drafter.records)
    root_alone = sum(len(d.tree) == 1 for d, _ in drafter.records)
    if shape == "cut":
        assert all(float(d.scores[1:].min()) >= math.log(0.05) for d, _ in drafter.records if len(d.tree) > 1)
        assert root_alone > len(prompts), f"{arch}: the cut never left the root alone"
    else:
        # the root alone only where the loop cut the draft: the last step of a request, when one token is left
        assert accepted > len(prompts) and root_alone <= len(prompts), f"{arch}/{shape}: {accepted}, {root_alone}"


def test_the_target_as_its_own_draft_model_is_accepted_whole(case):
    """A draft model identical to the target: every drafted chain is accepted to its end (its cache is in step with
    the target's text at every step, and the drafts are exactly the target's greedy continuation)."""
    arch, model, target, prompts, refs = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "a draft as large as the target cannot pay": here it is the point
        drafter = Recording(ModelDrafter(copy.deepcopy(model), target, Tree.chain(4)))
    for p, ref in zip(prompts, refs):
        out = generate(target, drafter, p, NEW)
        assert out.tokens == ref
        assert out.accept_lengths[1:-1] == [5] * (len(out.accept_lengths) - 2), f"{arch}: {out.accept_lengths}"


def test_the_cache_keeps_a_shared_prefix_across_requests_and_drops_the_rest():
    """A second request continuing the first one's text reuses the draft's cache for it; a different prompt starts
    over; both decode as generate does."""
    model = tiny_model("llama", initializer_range=REPEATING)
    target = Target(model)
    drafter = ModelDrafter(first_layers(model, 1), target, Tree.chain(3))
    first = random_prompts(1, VOCAB, seed=5)[0]
    out = generate(target, drafter, first, 8)
    assert out.tokens == reference(model, first, 8)
    assert drafter.fed.shape[0] >= first.shape[0]
    follow = torch.cat([first, torch.tensor(out.tokens[:5])])  # a second turn: the first's text and more
    kept = common_prefix(drafter.fed, follow)
    assert kept >= first.shape[0]
    assert generate(target, drafter, follow, 8).tokens == reference(model, follow, 8)
    other = torch.tensor([7, 8, 9, 10])
    assert common_prefix(drafter.fed, other) == 0
    assert generate(target, drafter, other, 8).tokens == reference(model, other, 8)


def test_merged_with_prompt_lookup_is_generate():
    model = tiny_model("qwen2", initializer_range=REPEATING)
    target = Target(model)
    merged = MergedDrafter([NGramDrafter(), ModelDrafter(first_layers(model, 1), target, TREES["dynamic"])])
    for p in random_prompts(8, VOCAB, seed=9):
        assert generate(target, merged, p, NEW).tokens == reference(model, p, NEW)


def test_a_resized_draft_model_grows_the_tree_it_is_asked_for():
    """What tune-tree builds at each (depth, budget): the same model and min_prob cut, that budget and depth."""
    model = tiny_model("llama", initializer_range=REPEATING)
    target = Target(model)
    drafter = ModelDrafter(first_layers(model, 1), target, TREES["cut"])
    small = drafter.resized(2, 3)
    assert small.tree == DynamicTree(3, max_rank=4, depth=2, min_prob=0.05) and small.model is drafter.model
    assert ModelDrafter(drafter.model, target).resized(3, 5).tree == DynamicTree(5, depth=3)  # as --tree auto builds it
    p = random_prompts(1, VOCAB, seed=2)[0]
    out = generate(target, Recording(small), p, NEW)
    assert out.tokens == reference(model, p, NEW)
    assert max(s.tree_size for s in out.steps) <= 4


def test_sampled_drafts_are_seeded_by_the_request():
    """Sampling: the draft draws from the request's generator, so one seed gives one answer."""
    model = tiny_model("llama", initializer_range=0.3, vocab=16)
    target = Target(model)
    drafter = ModelDrafter(first_layers(model, 1), target, TREES["dynamic"])
    sampling = Sampling(temperature=0.9)
    prompt = torch.tensor([1, 2, 3, 4])
    runs = [generate(target, drafter, prompt, 16, sampling=sampling,
                     generator=torch.Generator().manual_seed(s)).tokens for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def test_draws_are_without_replacement_each_from_q_less_the_earlier_draws():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0])
    out = draws(q, 4, torch.Generator().manual_seed(0))
    tokens = [t for t, _, _ in out]
    assert len(out) == 3 and sorted(tokens) == [0, 1, 2]  # token 3 has no probability: never drawn
    left = q.clone()
    for token, logp, dist in out:
        assert torch.allclose(dist, left / left.sum()) and logp == pytest.approx(float(q[token].log()))
        left[token] = 0.0


def test_a_draft_vocabulary_padded_otherwise_is_put_on_the_targets():
    logits = torch.arange(6.0).reshape(1, 6)
    assert on_vocab(logits, 4).tolist() == [[0.0, 1.0, 2.0, 3.0]]
    assert on_vocab(logits, 8)[0, 6:].tolist() == [float("-inf")] * 2


# ----------------------------------------------------------------------------------------- --draft model:DIR
@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    return tiny_chat_model.build_draft_model(model_dir, tmp_path_factory.mktemp("draft") / "draft")


def test_draft_model_by_directory_decodes_as_plain_generate(model_dir, draft_dir):
    for draft in (f"model:{draft_dir}", str(draft_dir), f"model:{draft_dir}@chain:3", f"model:{draft_dir}+ngram"):
        m = api.load(str(model_dir), draft=draft.split("@")[0], tree=(draft.split("@") + [None])[1])
        for prompt in ("the quick brown fox", "Hello, how are you today?"):
            assert m.generate(prompt, max_new_tokens=24).tokens == m.generate_plain(prompt, max_new_tokens=24).tokens
    spec = registry.parse_draft(str(draft_dir))
    assert spec.kind == "model" and spec.text == f"model:{draft_dir}" and registry.parse_draft(spec.text) == spec


def test_draft_model_bad_input(model_dir, draft_dir, tmp_path):
    with pytest.raises(ValueError, match="expected the draft model after the colon"):
        registry.parse_draft("model:")
    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        registry.parse_draft(f"model:{tmp_path / 'missing'}")
    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    with pytest.raises(ValueError, match="is a draft checkpoint, not a model: pass it as --draft"):
        registry.parse_draft(f"model:{heads}")
    # another tokenizer: one token more
    other = tmp_path / "other"
    tiny_chat_model.build_draft_model(model_dir, other)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="does not share the target's tokenizer: its tokenizer has .* tokens, the "
                                         "target's"):
        api.load(str(model_dir), draft=f"model:{other}")


def test_draft_model_on_another_device_dtype_or_larger_than_the_target(model_dir, draft_dir):
    model, _ = load_model(str(model_dir))
    target = Target(model)
    draft, _ = load_model(str(draft_dir), dtype="bfloat16")
    with pytest.warns(UserWarning, match="the draft model is in torch.bfloat16, the target in torch.float32"):
        ModelDrafter(draft, target)
    with pytest.warns(UserWarning, match="a draft at least as large as the target costs more per token"):
        ModelDrafter(copy.deepcopy(model), target)
    meta = copy.deepcopy(load_model(str(draft_dir))[0]).to("meta")
    with pytest.raises(ValueError, match="the draft model is on meta, the target on cpu: expected both on one device"):
        ModelDrafter(meta, target)


def test_bench_runs_transformers_assisted_generation_beside_selfspecs_draft_model(model_dir, draft_dir, tmp_path):
    """One bench run: plain, transformers' assistant_model with the draft model, selfspec's chain and tree with it;
    every fp32 answer is plain decoding's, and the assisted method really drafted (steps of more than one token)."""
    from selfspec.tools import bench

    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["the quick brown fox", "again?"]}\n'
                         '{"question_id": 2, "category": "coding", "turns": ["Hello, how are you today?"]}\n')
    methods = ("plain", f"assisted:{draft_dir}", f"model:{draft_dir}@chain:3", f"model:{draft_dir}@dynamic:6,depth=3")
    bench.run_bench(bench.BenchConfig(questions=questions, out_dir=tmp_path / "out", methods=methods,
                                      dtypes=("float32",), model=str(model_dir),
                                      options=GenerationOptions(max_new_tokens=16), warmup_tokens=2, progress=False))
    labels = ["plain", "assisted:draft", "draft@chain:3", "draft@dynamic:6,depth=3"]
    files = {m: tmp_path / "out" / f"model-{m.replace(':', '-')}-float32.jsonl" for m in labels}
    answers = {m: [json.loads(line) for line in files[m].read_text().splitlines()] for m in labels}
    plain = [a["choices"][0]["turns"] for a in answers["plain"]]
    for m in labels[1:]:
        assert [a["choices"][0]["turns"] for a in answers[m]] == plain, m
    assisted_steps = [n for a in answers["assisted:draft"] for n in a["choices"][0]["accept_lengths"]]
    assert max(assisted_steps) > 1
    with pytest.raises(ValueError, match="expected the draft model after the colon"):
        bench.parse_methods(("assisted:",), num_layers=2)


def test_a_draft_vocabulary_restricts_the_drafts_and_keeps_greedy_exact():
    """With a draft vocabulary the draft proposes only its tokens (q is 0 elsewhere when sampling), its logits on them
    are the full LM head's, and greedy decoding stays generate's."""
    model = tiny_model("llama", initializer_range=REPEATING)
    target = Target(model)
    vocab = torch.arange(0, VOCAB, 2)  # the even tokens
    draft = first_layers(model, 1)
    drafter = Recording(ModelDrafter(draft, target, TREES["dynamic"], draft_vocab=vocab))
    full = ModelDrafter(draft, target, TREES["dynamic"])
    ids, positions = torch.tensor([3, 4, 5]), torch.arange(3)
    restricted_logits = drafter.inner._forward(ids, positions, None)
    full_logits = full._forward(ids, positions, None)
    assert torch.allclose(restricted_logits[:, vocab], full_logits[:, vocab], atol=1e-5)
    assert torch.isinf(restricted_logits[:, 1::2]).all()
    for p in random_prompts(6, VOCAB, seed=4):
        assert generate(target, drafter, p, NEW).tokens == reference(model, p, NEW)
    drafted = torch.cat([d.tokens[1:] for d, _ in drafter.records])
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all())
    sampled = Recording(ModelDrafter(draft, target, Tree.chain(3), draft_vocab=vocab))
    generate(target, sampled, random_prompts(1, VOCAB, seed=1)[0], 8, sampling=Sampling(temperature=1.0),
             generator=torch.Generator().manual_seed(0))
    q = torch.cat([d.q[1:] for d, _ in sampled.records if d.q is not None])  # [n, V]
    assert q.shape[0] > 0 and float(q[:, 1::2].abs().sum()) == 0.0 and torch.allclose(q.sum(-1), torch.ones(len(q)))


def test_tune_tree_tunes_a_draft_model_for_tree_auto(model_dir, draft_dir, tmp_path, monkeypatch, capsys):
    """infer.py tune-tree --draft model:DIR: the best (budget, depth, min_prob) is cached, and --tree auto then builds
    that dynamic tree for the draft model."""
    from selfspec.tools import budget, cli

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # the tiny model's ~1 ms verifications time noisily
    assert cli.main(["tune-tree", "--model", str(model_dir), "--draft", f"model:{draft_dir}", "--dtype", "fp32",
                     "--depths", "2,3", "--budgets", "2,6", "--prompts", "2", "--max-new-tokens", "8"]) == 0
    best = json.loads(next((tmp_path / "cache").rglob("tree-*.json")).read_text())["best"]
    tree = DynamicTree(best["budget"], depth=best["depth"], min_prob=best["min_prob"])
    assert f"best: --tree {tree.spec} " in capsys.readouterr().out
    m = api.load(str(model_dir), draft=f"model:{draft_dir}", tree="auto")
    assert m.drafter.tree == tree
    assert m.generate("the quick brown fox", max_new_tokens=16).tokens == \
        m.generate_plain("the quick brown fox", max_new_tokens=16).tokens
