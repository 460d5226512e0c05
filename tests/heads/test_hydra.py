"""Hydra heads: an untrained head is the LM head's guess, head k reads exactly the k tokens after t (the index shift),
distinct parameters, drafting fills each node with its head's candidate given the node's path, losslessness through
the runtime on several architectures, strict save / load, the registry, and train.py's hydra method end to end with an
exact resume.

The heads here are random or trained for a few steps on a tiny random target: these tests pin the plumbing and
losslessness."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (decode_with_tiny_draft, random_prompts, reference, state_after_prefill, tiny_model,
                      train_and_check_resume)

from heads.hydra.drafter import HydraDrafter, load_drafter
from heads.hydra.model import HydraConfig, HydraHeads, following
from heads.training.recipe import load_config
from selfspec import registry
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96


def make_heads(model, seed: int = 0, num_heads: int = 3, num_layers: int = 1, trained: bool = True) -> HydraHeads:
    """Hydra heads on ``model``; trained=True gives every weight random values (so each head reads its tokens)."""
    heads = HydraHeads(HydraConfig.for_model(model, num_heads=num_heads, num_layers=num_layers),
                       model.get_input_embeddings(), model.get_output_embeddings())
    if trained:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in heads.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


def test_an_untrained_head_makes_the_lm_heads_guess(model):
    heads = make_heads(model, trained=False)
    hidden = torch.randn(5, model.config.hidden_size)
    path = torch.randint(0, VOCAB, (5, 3))
    lm = model.get_output_embeddings()(hidden)
    for k in (1, 2, 3):
        torch.testing.assert_close(heads.head_logits(hidden, path, k), lm)


def test_following_is_the_index_shift_head_k_reads_tokens_t_plus_1_to_t_plus_k(model):
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    scored = torch.zeros(2, 5, dtype=torch.bool)
    scored[0, 0] = scored[0, 2] = scored[1, 4] = True
    assert following(ids, scored, 3).tolist() == [[11, 12, 13], [13, 14, 14], [24, 24, 24]]

    heads = make_heads(model)
    hidden = torch.randn(1, model.config.hidden_size)
    path = torch.tensor([[5, 6, 7]])
    for k in (1, 2, 3):
        base = heads.head_logits(hidden, path, k)
        for j in range(3):  # changing token t+1+j moves head k exactly when j < k
            changed = path.clone()
            changed[0, j] = 50
            moved = not torch.allclose(heads.head_logits(hidden, changed, k), base)
            assert moved == (j < k), (k, j)
    logits = heads(hidden, path)  # [K, N, V]: head k on the first k tokens
    assert logits.shape == (3, 1, VOCAB)
    torch.testing.assert_close(logits[1], heads.head_logits(hidden, path[:, :2], 2))


def test_each_head_and_block_has_its_own_parameters(model):
    heads = make_heads(model, num_heads=3, num_layers=2, trained=False)
    D = model.config.hidden_size
    assert [tuple(h.fc.weight.shape) for h in heads.heads] == [(D, 2 * D), (D, 3 * D), (D, 4 * D)]
    params = list(heads.parameters())
    assert len({p.data_ptr() for p in params}) == len(params) == 3 * (1 + 2 * 2)
    assert set(heads.state_dict()) == {f"heads.{k}.{name}" for k in range(3) for name in
                                       ("fc.weight", "blocks.0.linear.weight", "blocks.0.linear.bias",
                                        "blocks.1.linear.weight", "blocks.1.linear.bias")}  # no base weights stored


def test_drafting_fills_each_node_with_its_heads_candidate_given_the_path(model):
    heads = make_heads(model, seed=2)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 2]])
    prompt = random_prompts(1, VOCAB, seed=3, min_len=8, max_len=8)[0]
    state = state_after_prefill(model, prompt)
    draft = HydraDrafter(heads, tree).draft(state)
    assert draft.tree == tree and draft.q is None and int(draft.tokens[0]) == int(prompt[-1])
    tokens = draft.tokens.tolist()
    for i in range(1, len(tree)):
        path, a = [], tree.parents[i]
        while a >= 0:
            path.insert(0, tokens[a])
            a = tree.parents[a]
        d = tree.depths[i]
        logits = heads.head_logits(state.hidden[None], torch.tensor([path]), d)[0]
        assert tokens[i] == int(logits.topk(tree.ranks[i] + 1).indices[tree.ranks[i]]), i
    under = [heads.head_logits(state.hidden[None], torch.tensor([[tokens[0], tokens[p]]]), 2) for p in (1, 2)]
    assert not torch.allclose(*under)  # the same rank under another parent is another guess (unlike Medusa heads)


def test_a_dynamic_tree_keeps_the_budget_best_nodes_each_a_top_candidate_of_its_head_given_its_path(model):
    heads = make_heads(model, seed=7)
    prompt = random_prompts(1, VOCAB, seed=8, min_len=9, max_len=9)[0]
    state = state_after_prefill(model, prompt)
    draft = HydraDrafter(heads, DynamicTree(10, max_rank=3)).draft(state)
    tree, tokens = draft.tree, draft.tokens.tolist()
    assert len(tree) == 11 and tree.depth >= 2 and not tree.is_chain
    for i in range(1, len(tree)):
        path = [tokens[j] for j in tree.path_to(i)[:-1]]
        with torch.no_grad():
            logp = torch.log_softmax(heads.head_logits(state.hidden[None], torch.tensor([path]), len(path))[0], -1)
        assert tokens[i] in logp.topk(3).indices.tolist()
        want = float(draft.scores[tree.parents[i]]) + float(logp[tokens[i]])
        assert float(draft.scores[i]) == pytest.approx(want, abs=1e-5)
        assert draft.scores[i] <= draft.scores[tree.parents[i]]
    chain = HydraDrafter(heads, DynamicTree(3, max_rank=1)).draft(state)
    assert chain.tree == Tree.chain(3)  # one candidate per depth: the heads' greedy path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "gpt2"])
def test_hydra_drafts_through_the_runtime_stay_token_identical_to_generate(arch):
    model = tiny_model(arch, initializer_range=0.1)
    heads = make_heads(model, seed=4)
    target = Target(model)
    drafter = HydraDrafter(heads, Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))
    dynamic = HydraDrafter(heads, DynamicTree(9, max_rank=3))
    for prompt in random_prompts(5, VOCAB, seed=5):
        assert generate(target, drafter, prompt, max_new_tokens=24).tokens == reference(model, prompt, 24)
        assert generate(target, dynamic, prompt, max_new_tokens=24).tokens == reference(model, prompt, 24)


def test_hydra_heads_merged_with_prompt_lookup_stay_token_identical_to_generate():
    """ngram+hydra, the merged draft docs/benchmarks/log.md §22 measures (there with skip_after=3), here with
    skip_after=1: the heads rest whenever prompt lookup had a token accepted (stateless, they need nothing handed
    over), and the output is still plain decoding's."""
    from selfspec import NGramDrafter
    from selfspec.drafts.merge import MergedDrafter

    model = tiny_model("llama", initializer_range=0.5)  # repetitive greedy continuations: prompt lookup gets accepted
    heads = make_heads(model, seed=7)
    target = Target(model)
    merged = MergedDrafter([NGramDrafter(depth=4, max_nodes=6), HydraDrafter(heads, DynamicTree(8, depth=3))],
                           skip_after=1)
    for prompt in random_prompts(6, VOCAB, seed=9):
        assert generate(target, merged, prompt, max_new_tokens=32).tokens == reference(model, prompt, 32)
    assert merged.skipped[0] == 0 and merged.skipped[1] >= 5, merged.skipped  # the heads really sat out steps


def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    heads = make_heads(model, seed=6, num_layers=2)
    heads.config.tree = [[0], [1], [0, 0]]
    heads.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["draft_type"] == "hydra" and stored["num_heads"] == 3 and stored["tree"] == [[0], [1], [0, 0]]
    loaded = HydraHeads.from_pretrained(tmp_path / "ck", model)
    assert loaded.config == heads.config
    assert heads.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
    assert "Hydra heads for" in (tmp_path / "ck" / "README.md").read_text()

    with pytest.raises(ValueError, match="trained for vocab size 96, this model has 128: it belongs on"):
        HydraHeads.from_pretrained(tmp_path / "ck", tiny_model("llama", vocab=128))
    fields = {k: v for k, v in stored.items() if k != "selfspec_version"}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(fields, num_heads=4)))
    with pytest.raises(ValueError, match="disagrees with config.json: missing tensors \\['heads.3"):
        HydraHeads.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(fields, surprise=1)))
    with pytest.raises(ValueError, match=r"unknown HydraConfig keys \['surprise'\]"):
        HydraHeads.from_pretrained(tmp_path / "ck", model)
    with pytest.raises(ValueError, match="tree is 4 levels deep; 3 heads draft at most 3"):
        HydraConfig.from_dict(dict(fields, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))


def test_the_registry_loads_hydra_heads_with_their_tree(model, tmp_path):
    heads = make_heads(model)
    heads.config.tree = [[0], [1], [0, 0]]
    heads.save_pretrained(tmp_path / "ck")
    target = Target(model)
    spec = registry.parse_draft(str(tmp_path / "ck"))
    assert spec.kind == "hydra"
    assert registry.build_drafter(spec, target).tree == Tree.from_choices([[0], [1], [0, 0]])
    assert registry.build_drafter(spec, target, Tree.chain(2)).tree == Tree.chain(2)
    assert registry.build_drafter(spec, target, DynamicTree(8)).dynamic == DynamicTree(8)
    assert load_drafter(tmp_path / "ck", target, tree=DynamicTree(8, depth=5)).depth == 3  # no deeper than the heads
    with pytest.raises(ValueError, match="4 levels deep, but 3 is the most the Hydra heads can draft"):
        registry.build_drafter(spec, target, Tree.chain(4))


def test_recipe_refuses_hydra_heads_with_their_own_projection():
    with pytest.raises(ValueError, match="Hydra heads read the base's own LM head .shared., found 'lora'"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["method=hydra", "heads.projection=lora"])


def test_train_py_trains_hydra_heads_that_resume_exactly_and_decode_losslessly(tmp_path):
    common = ["--config", "configs/medusa_tiny.yaml", "method=hydra", "optim.scheduler=constant_with_warmup",
              "optim.epochs=100", "logging.every=1", "eval.every=0", "checkpoint.every=3", "heads.draft_vocab=40"]

    train_and_check_resume(tmp_path, common)
    out = tmp_path / "full" / "hydra_heads"
    config = json.loads((out / "config.json").read_text())
    assert config["draft_type"] == "hydra" and config["recipe"]["method"] == "hydra"
    assert config["draft_vocab_size"] == 40  # the 40 most frequent training tokens (heads/draft_vocab.py)
    assert len(config["head_accuracy"]) == 3 and all(0.0 <= a <= 1.0 for row in config["head_accuracy"] for a in row)
    assert 1 <= len(config["tree"]) <= 8  # tree.budget of the tiny recipe, from the measured accuracy
    decode_with_tiny_draft(out)
