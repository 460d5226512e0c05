"""The EAGLE-style sequential head: the training unroll computes exactly what drafting computes, the loss's index
shift, the draft vocabulary, drafting (chain and tree) through the head's own cache, losslessness through the runtime
on several architectures, strict save / load, and train.py's eagle method end to end with an exact resume; the same
for EAGLE-3's multi-layer features (training reads the states the runtime gives the drafter).

The heads here are random or trained for a few steps on a tiny random target: these tests pin the plumbing and
losslessness; what training buys is measured on SmolLM2 in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import (decode_with_tiny_draft, random_prompts, reference, state_after_prefill, tiny_model,
                      train_and_check_resume)
from safetensors.torch import load_file
from transformers import DynamicCache

from heads.eagle.config import EagleConfig
from heads.eagle.drafter import EagleDrafter, load_drafter
from heads.eagle.loss import eagle_loss
from heads.eagle.model import EagleHead, unroll_mask
from heads.training.draft_vocab import draft_vocabulary
from heads.training.losses import IGNORE_INDEX
from heads.training.recipe import load_config
from selfspec import registry
from selfspec.core import hf
from selfspec.core.drafter import DraftState
from selfspec.core.generate import generate
from selfspec.drafts.merge import MergedDrafter
from selfspec.drafts.ngram import NGramDrafter
from selfspec.core.sampling import Sampling
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree, Tree

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96


FEATURES = [0, 1, 2]  # EAGLE-3 on a 2-layer tiny model: the embeddings, layer 1's output, the final hidden state


def make_head(model, seed: int = 0, draft_vocab: int = 64, num_layers: int = 1, feature_layers=None) -> EagleHead:
    cfg = EagleConfig.for_model(model, num_layers=num_layers, draft_vocab_size=draft_vocab,
                                feature_layers=feature_layers)
    torch.manual_seed(seed)
    head = EagleHead(cfg, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    head.draft_vocab.set(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    return head


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


def chain(head, features, ids, true_pairs: int, own: int) -> torch.Tensor:
    """Drafting by hand: the true pairs 0..true_pairs-1 in one causal call, then ``own`` pairs one at a time, each fed
    the head's previous output (and the data's token): the head's output after the last pair [D]."""
    cache = DynamicCache(config=head.decoder.config)
    out = head.step(features[:, :true_pairs], ids[:, 1:true_pairs + 1], torch.arange(true_pairs)[None], None, cache)
    f = out[:, -1:]
    for p in range(true_pairs, true_pairs + own):
        f = head.step(f, ids[:, p + 1:p + 2], torch.tensor([[p]]), None, cache)
    return f[0, -1]


@pytest.mark.parametrize("arch,layers", [("llama", None), ("qwen2", None), ("llama", FEATURES)])
def test_training_unroll_is_what_drafting_computes(arch, layers):
    """Step u of the unroll at pair i = the chain of true pairs 0..i-u and u of the head's own predictions, also for a
    right-padded row (padding changes nothing before it); with multi-layer features the true pairs read their fusion."""
    model = tiny_model(arch, initializer_range=0.1)
    check_unroll(model, make_head(model, num_layers=2, feature_layers=layers), layers)


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss", "falcon", "gpt_neo", "deepseek_v3", "opt"])
def test_training_unroll_is_what_drafting_computes_on_more_architectures(model_type):
    """The same on decoders whose layers differ most (eager-only attention with soft-capping or sinks, tuple-returning
    layers, GPT-Neo's per-layer attention kinds, multi-head latent attention, learned positions)."""
    from test_architectures import SUPPORTED, build

    model = build(model_type, SUPPORTED[model_type])
    check_unroll(model, make_head(model, num_layers=2), None)


def check_unroll(model, head: EagleHead, layers) -> None:
    T = 11
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([T, 8])
    with torch.no_grad():
        states = hf.decoder(model)(input_ids=ids, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in layers or [-1]], dim=-1)  # [2, T, F]
        outs = head(features, ids, lengths, unroll=3)  # [3, 2, T - 1, D]
        true = head.true_features(features)  # [2, T, D]
        for u in range(3):
            for row, n_valid in ((0, T - 1), (1, 7)):
                for i in range(u, n_valid):
                    want = chain(head, true[row:row + 1], ids[row:row + 1], i - u + 1, u)
                    torch.testing.assert_close(outs[u, row, i], want, rtol=1e-4, atol=1e-4)


def test_unroll_mask_attends_to_the_true_prefix_the_chain_and_itself():
    allowed = unroll_mask(2, 5, torch.tensor([6]), torch.float32)[0, 0] == 0  # [5, 15]: keys of steps 0, 1, 2
    i = 3
    assert allowed[i, :5].nonzero().flatten().tolist() == [0, 1]  # true pairs <= i - u
    assert allowed[i, 5:10].nonzero().flatten().tolist() == [2]  # step 1's key at i - u + 1
    assert allowed[i, 10:].nonzero().flatten().tolist() == [3]  # its own
    padded = unroll_mask(0, 5, torch.tensor([4]), torch.float32)[0, 0] == 0  # pairs 3, 4 are padding
    assert padded[2].nonzero().flatten().tolist() == [0, 1, 2] and not padded[:3, 3:].any()


def test_loss_index_shift_a_head_predicting_the_next_feature_scores_zero(model):
    """If every step's output at pair i were f_{i+1}, the KL and feature losses are 0 and top-1 agreement is 1 (with
    the whole vocabulary drafted), scored exactly where labels[i + 2] is a training token and i >= u."""
    model = tiny_model("llama")  # spread-out logits: a feature one position off is far from right
    head = make_head(model, draft_vocab=VOCAB)
    T = 9
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # a prompt: pairs 0, 1 predict x_2, x_3 and are not scored
    with torch.no_grad():
        features = model.model(input_ids=ids).last_hidden_state
    perfect = features[:, 1:].expand(2, 1, T - 1, features.shape[-1])  # [U = 2, 1, n, D]: f_{i+1} at pair i
    out = eagle_loss(perfect, features, labels, head, model.get_output_embeddings(), kind="kl", feature_weight=1.0)
    assert out.per_head.abs().max() < 1e-5
    assert out.count.tolist() == [5, 5]  # pairs 2..6 (labels[4..8]); i >= 1 removes none of them
    assert out.top1.tolist() == [1.0, 1.0]
    unmeasured = eagle_loss(perfect, features, labels, head, model.get_output_embeddings(), kind="kl", feature_weight=1.0,
                            ranks=0)  # what the trainer runs on batches it does not log: the loss, no accuracy
    assert torch.equal(unmeasured.per_head, out.per_head)
    assert unmeasured.hits.shape == (2, 0) and unmeasured.count.tolist() == [0, 0]
    shifted = features[:, :-1].expand(2, 1, T - 1, features.shape[-1])  # f_i instead of f_{i+1}: wrong by one
    wrong = eagle_loss(shifted, features, labels, head, model.get_output_embeddings(), kind="kl")
    assert wrong.per_head.min() > 0.1


def test_draft_vocabulary_is_the_most_frequent_training_tokens_with_the_end_of_turn():
    rows = datasets.Dataset.from_dict({"labels": [[5, 5, 5, -100, 7, 7, 9], [-100, -100, 9, 9, 9, 9, 3]]})
    assert draft_vocabulary(rows, 2, 12).tolist() == [5, 9]  # 9 x5, 5 x3, 7 x2; prompt tokens (-100) not counted
    assert draft_vocabulary(rows, 3, 12, always=(11,)).tolist() == [5, 9, 11]
    with pytest.raises(ValueError, match="expected a size in 1..12, found 13"):
        draft_vocabulary(rows, 13, 12)


def test_chain_drafting_is_the_heads_greedy_path(model):
    head = make_head(model)
    prompt = random_prompts(1, VOCAB, seed=5, min_len=8, max_len=8)[0]
    draft = EagleDrafter(head, depth=4, topk=1, budget=4).draft(state_after_prefill(model, prompt))
    assert draft.tree == Tree.chain(4)
    ids = prompt[None].clone()
    want = []
    with torch.no_grad():
        features = model.model(input_ids=prompt[None]).last_hidden_state
        for d in range(4):  # the head's greedy token after the true pairs and its own d drafts, by hand
            f = chain(head, features, ids, len(prompt) - 1, d)
            want.append(int(head.draft_vocab.base_ids(head.logits(f).argmax())))
            ids = torch.cat([ids, torch.tensor([[want[-1]]])], dim=1)
    assert draft.tokens.tolist() == [int(prompt[-1])] + want


def test_tree_drafting_keeps_the_budget_best_nodes_each_a_top_candidate_of_its_path(model):
    head = make_head(model, seed=3)
    prompt = random_prompts(1, VOCAB, seed=6, min_len=9, max_len=9)[0]
    draft = EagleDrafter(head, depth=4, topk=3, budget=10).draft(state_after_prefill(model, prompt))
    tree = draft.tree
    assert len(tree) == 11 and tree.depth >= 2 and not tree.is_chain
    with torch.no_grad():
        features = model.model(input_ids=prompt[None]).last_hidden_state
        for node in range(1, len(tree)):
            path = tree.path_to(node)  # root .. node
            ids = torch.cat([prompt, draft.tokens[path[1:-1]]])[None]
            f = chain(head, features, ids, len(prompt) - 1, len(path) - 2)
            top = head.draft_vocab.base_ids(head.logits(f).topk(3).indices).tolist()
            assert int(draft.tokens[node]) in top, f"node {node} (path {path})"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_eagle_drafts_through_the_runtime_stay_token_identical_to_generate(arch):
    model = tiny_model(arch, initializer_range=0.1)
    head = make_head(model, draft_vocab=VOCAB)
    target = Target(model)
    drafter = EagleDrafter(head, depth=5, topk=4, budget=12)  # one drafter across prompts: its cache restarts
    for prompt in random_prompts(6, VOCAB, seed=7):
        out = generate(target, drafter, prompt, max_new_tokens=24)
        assert out.tokens == reference(model, prompt, 24)
        assert drafter.committed == prompt.shape[0] + sum(len(s.tokens) for s in out.steps[:-1]) - 1
    merged = MergedDrafter([EagleDrafter(head, depth=3, topk=2, budget=6), NGramDrafter(depth=4, max_nodes=6)])
    for prompt in random_prompts(4, VOCAB, seed=8):  # an EAGLE head and prompt lookup verified as one tree
        assert generate(target, merged, prompt, max_new_tokens=24).tokens == reference(model, prompt, 24)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_eagle3_drafts_through_the_runtime_stay_token_identical_to_generate(arch):
    """A head reading the target's embeddings, middle and final states (EAGLE-3) through selfspec.core.generate."""
    model = tiny_model(arch, initializer_range=0.1)
    head = make_head(model, draft_vocab=VOCAB, feature_layers=FEATURES)
    torch.nn.init.normal_(head.fuse.weight, std=0.3)  # a fusion that matters (a trained one is not the identity)
    drafter = EagleDrafter(head, depth=4, topk=3, budget=10)
    target = Target(model)
    for prompt in random_prompts(5, VOCAB, seed=17):
        out = generate(target, drafter, prompt, max_new_tokens=24)
        assert out.tokens == reference(model, prompt, 24)
        assert drafter.committed == prompt.shape[0] + sum(len(s.tokens) for s in out.steps[:-1]) - 1


def test_the_final_state_among_the_feature_layers_is_stored_once():
    """transformers' last hidden_states entry (index L) is the final hidden state itself: the hidden cache stores it
    once and expand_feature_states puts it back wherever the head lists L, equal to reading every layer."""
    from heads.training.base_model import expand_feature_states, final_and_layer_states, stored_feature_layers

    model = tiny_model("llama", initializer_range=0.1)
    L = model.config.num_hidden_layers
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    for layers in ([0, L], [L, 1], [1, L - 1], [L]):
        stored = stored_feature_layers(model, layers)
        assert stored == [i for i in layers if i != L]
        with torch.no_grad():
            full = final_and_layer_states(model, ids, mask, layers)  # [2, 7, (1 + len(layers)) D]
            kept = final_and_layer_states(model, ids, mask, stored)
        assert kept.shape[-1] == (1 + len(stored)) * model.config.hidden_size
        torch.testing.assert_close(expand_feature_states(kept, model, layers), full, rtol=0, atol=0)


def test_the_drafter_reads_the_states_training_reads():
    """What the trainer feeds an EAGLE-3 head (heads.base_model.final_and_layer_states over a padded batch) equals what
    selfspec.core.generate hands its drafter (every layer's states from the target's prefill), at the head's layers."""
    from heads.training.base_model import final_and_layer_states

    model = tiny_model("qwen2", initializer_range=0.1)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    with torch.no_grad():
        trained = final_and_layer_states(model, ids, mask, FEATURES)  # [2, 9, 4 D]
    D = model.config.hidden_size
    for row, n in ((0, 9), (1, 6)):
        state = state_after_prefill(model, torch.cat([ids[row, :n], ids.new_tensor([0])]))
        torch.testing.assert_close(trained[row, :n, :D], state.new_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(trained[row, :n, D:], state.new_states.take(FEATURES), rtol=1e-5, atol=1e-5)


def test_eagle3_feature_layers_are_checked():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"feature_layers \[0, 3\]: expected hidden-state indices 0..2 \(this base has 2 "
                                         r"decoder layers\), found 3"):
        make_head(model, feature_layers=[0, 3])
    with pytest.raises(ValueError, match=r"feature_layers: expected null or distinct hidden-state indices >= 0, found \[1, 1\]"):
        make_head(model, feature_layers=[1, 1])
    with pytest.raises(ValueError, match=r"eagle.feature_layers: expected null or distinct"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["method=eagle", "eagle.feature_layers=[]"])
    head = make_head(model, feature_layers=FEATURES)
    with pytest.raises(ValueError, match=r"expected target features of width 96 \(hidden size 32 x 3 layers\), found 32"):
        head.true_features(torch.zeros(2, 32))
    prompt = random_prompts(1, VOCAB, seed=8, min_len=8, max_len=8)[0]
    state = state_after_prefill(model, prompt)
    from dataclasses import replace
    with pytest.raises(ValueError, match=r"reads the target's hidden states at layers \[0, 1, 2\]: expected "
                                         r"DraftState.new_states"):
        EagleDrafter(head, 2, 2, 3).draft(replace(state, new_states=None))


def test_an_eagle_head_that_sits_out_steps_of_a_merged_draft_stays_in_step():
    """ngram+eagle with skip_after=1: the head rests whenever prompt lookup had a token accepted, and is handed every
    hidden state committed meanwhile (else it would refuse to go on, out of step), every layer's for an EAGLE-3 head;
    output still plain decoding's."""
    model = tiny_model("llama", initializer_range=0.5)  # repetitive greedy continuations: prompt lookup gets accepted
    head = make_head(model, draft_vocab=VOCAB, feature_layers=FEATURES)
    target = Target(model)
    eagle = EagleDrafter(head, depth=3, topk=2, budget=6)
    merged = MergedDrafter([NGramDrafter(depth=4, max_nodes=6), eagle], skip_after=1)
    drafted = 0
    for prompt in random_prompts(6, VOCAB, seed=9):
        out = generate(target, merged, prompt, max_new_tokens=32)
        assert out.tokens == reference(model, prompt, 32)
        drafted = eagle.committed
    assert merged.skipped[0] == 0 and merged.skipped[1] >= 5, merged.skipped  # the head really sat out steps
    assert drafted > 0


def test_a_drafter_that_missed_a_step_refuses_to_go_on(model):
    drafter = EagleDrafter(make_head(model), depth=2, topk=2, budget=3)
    prompt = random_prompts(1, VOCAB, seed=8, min_len=8, max_len=8)[0]
    state = state_after_prefill(model, prompt)
    drafter.draft(state)
    later = DraftState(tokens=torch.cat([prompt, prompt[:3]]), prompt_length=8, hidden=state.hidden, cache=state.cache,
                       sampling=Sampling(), new_hidden=state.new_hidden[:2])
    with pytest.raises(RuntimeError, match=r"out of step: its cache holds \d+ committed positions and 2 new ones"):
        drafter.draft(later)


def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    head = make_head(model, seed=4)
    head.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["draft_type"] == "eagle" and stored["draft_vocab_size"] == 64
    loaded = EagleHead.from_pretrained(tmp_path / "ck", model)
    assert loaded.config == head.config
    assert head.state_dict().keys() == loaded.state_dict().keys()
    eagle3 = make_head(model, seed=4, feature_layers=FEATURES)
    eagle3.save_pretrained(tmp_path / "ck3")
    loaded3 = EagleHead.from_pretrained(tmp_path / "ck3", model)
    assert loaded3.config.feature_layers == FEATURES and torch.equal(loaded3.fuse.weight, eagle3.fuse.weight)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))
    prompt = random_prompts(1, VOCAB, seed=9, min_len=8, max_len=8)[0]
    a = EagleDrafter(head, 3, 2, 5).draft(state_after_prefill(model, prompt))
    b = EagleDrafter(loaded, 3, 2, 5).draft(state_after_prefill(model, prompt))
    assert a.tree == b.tree and torch.equal(a.tokens, b.tokens)

    other = tiny_model("llama", vocab=128)
    with pytest.raises(ValueError, match="trained for vocab size 96, this model has 128"):
        EagleHead.from_pretrained(tmp_path / "ck", other)
    bad = dict(stored, num_layers=2, decoder_config=dict(stored["decoder_config"], num_hidden_layers=2))
    (tmp_path / "ck" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="disagrees with config.json"):
        EagleHead.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps(dict(stored, surprise=1)))
    with pytest.raises(ValueError, match=r"unknown EagleConfig keys \['surprise'\]"):
        EagleHead.from_pretrained(tmp_path / "ck", model)
    (tmp_path / "ck" / "config.json").write_text(json.dumps({k: v for k, v in stored.items() if k != "hidden_size"}))
    with pytest.raises(ValueError) as missing:  # the message names the file it read
        EagleHead.from_pretrained(tmp_path / "ck", model)
    assert str(missing.value) == f"{tmp_path / 'ck' / 'config.json'}: EagleConfig is missing required keys ['hidden_size']"
    fields = {k: v for k, v in stored.items() if k != "selfspec_version"}
    with pytest.raises(ValueError, match="draft_vocab_size: expected 1..96 .the base's vocabulary., found 97"):
        EagleConfig.from_dict(dict(fields, draft_vocab_size=97))


def test_heads_saved_before_the_draft_vocab_module_still_load(model, tmp_path):
    """Checkpoints (and resumable training states) written when the head kept its vocabulary in a ``draft_tokens``
    buffer load into today's ``draft_vocab.tokens``, through from_pretrained and a plain load_state_dict alike."""
    from safetensors.torch import load_file, save_file

    head = make_head(model, seed=5)
    head.save_pretrained(tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    old = load_file(str(weights))
    old["draft_tokens"] = old.pop("draft_vocab.tokens")  # the tensor's name in older checkpoints
    save_file(old, str(weights))
    loaded = EagleHead.from_pretrained(tmp_path / "ck", model)
    assert torch.equal(loaded.draft_vocab.tokens, head.draft_vocab.tokens)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))

    fresh = make_head(model, seed=6)
    fresh.load_state_dict({k: v.clone() for k, v in old.items()}, strict=True)  # an accelerate resume's path
    assert torch.equal(fresh.draft_vocab.tokens, head.draft_vocab.tokens)

    old["draft_tokens"] = torch.zeros_like(old["draft_tokens"])  # not a vocabulary: every id the same
    save_file(old, str(weights))
    with pytest.raises(ValueError, match=r"draft vocabulary \(draft_vocab.tokens\): expected 64 distinct token ids"):
        EagleHead.from_pretrained(tmp_path / "ck", model)


def test_tree_options_for_an_eagle_head(model, tmp_path):
    make_head(model).save_pretrained(tmp_path / "ck")
    target = Target(model)
    assert (load_drafter(tmp_path / "ck", target).budget, load_drafter(tmp_path / "ck", target).depth) == (32, 6)
    assert load_drafter(tmp_path / "ck", target, tree=DynamicTree(12)).budget == 12
    chained = load_drafter(tmp_path / "ck", target, tree=Tree.chain(3))
    assert (chained.depth, chained.topk, chained.budget) == (3, 1, 3)
    with pytest.raises(ValueError, match="grows its own tree each step: use --tree dynamic:N"):
        load_drafter(tmp_path / "ck", target, tree=Tree.full([2, 2]))
    spec = registry.parse_draft(str(tmp_path / "ck"))
    assert spec.kind == "eagle"
    assert isinstance(registry.build_drafter(spec, target, DynamicTree(8)), EagleDrafter)


def test_recipe_checks_the_eagle_section():
    with pytest.raises(ValueError, match="eagle.unroll: expected a value >= 1, found 0"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["method=eagle", "eagle.unroll=0"])
    cfg = load_config(REPO / "configs/eagle_smollm2.yaml")
    assert cfg.method == "eagle" and cfg.loss.kind == "kl" and cfg.eagle.draft_vocab == 8192
    eagle3 = load_config(REPO / "configs/eagle3_smollm2.yaml")
    assert eagle3.eagle.feature_layers == [2, 15, 30] and eagle3.eagle.feature_weight == 0.0
    speculators = load_config(REPO / "configs/eagle3_speculators_smollm2.yaml")
    assert speculators.method == "eagle3" and speculators.eagle.feature_layers == [2, 15, 27]
    assert str(speculators.final_dir) == "runs/eagle3-speculators-smollm2/eagle3_head"


def test_train_py_trains_an_eagle_head_that_resumes_exactly_and_decodes_losslessly(tmp_path):
    common = ["--config", "configs/medusa_tiny.yaml", "method=eagle", "loss.kind=kl", "eagle.draft_vocab=128",
              "optim.scheduler=constant_with_warmup", "optim.epochs=100", "logging.every=1", "eval.every=0",
              "logging.log_with=[tensorboard]", "checkpoint.every=3"]

    train_and_check_resume(tmp_path, common)
    out = tmp_path / "full" / "eagle_head"
    config = json.loads((out / "config.json").read_text())
    assert config["recipe"]["method"] == "eagle" and config["draft_vocab_size"] == 128
    assert len(config["top1_agreement"]) == 3 and all(0.0 <= a <= 1.0 for a in config["top1_agreement"])
    assert list((tmp_path / "full" / "eagle").rglob("events.out.tfevents*"))  # TensorBoard, beside the head
    decode_with_tiny_draft(out)


def test_train_py_trains_an_eagle3_head_from_cached_multi_layer_states(tmp_path):
    """EAGLE-3 features through train.py with the hidden cache: the cache stores the final and the feature layers'
    states side by side, a resumed run (reading them from the cache) continues exactly, and the head decodes
    losslessly."""
    common = ["--config", "configs/medusa_tiny.yaml", "method=eagle", "loss.kind=kl", "eagle.draft_vocab=128",
              "eagle.feature_layers=[0,1,2]", "eagle.feature_weight=0", "hidden_cache.enabled=true",
              "optim.scheduler=constant_with_warmup", "optim.epochs=100", "logging.every=1", "eval.every=0",
              "checkpoint.every=3"]
    train_and_check_resume(tmp_path, common)
    config = json.loads((tmp_path / "full" / "eagle_head" / "config.json").read_text())
    assert config["feature_layers"] == [0, 1, 2]
    meta = json.loads(next((tmp_path / "cut" / "hidden_cache").glob("*/meta.json")).read_text())
    # layer 2 of 2 is the final hidden state: stored once, beside layers 0 and 1
    assert meta["hidden_size"] == 3 * 64 and meta["fingerprint"]["target"]["feature_layers"] == [0, 1, 2]
    assert meta["fingerprint"]["target"]["stored_layers"] == [0, 1]
    decode_with_tiny_draft(tmp_path / "full" / "eagle_head")


def test_train_py_trains_a_speculators_eagle3_draft_that_resumes_exactly_and_decodes_losslessly(tmp_path):
    """method eagle3: speculators' EAGLE-3 architecture trained from the eagle section (the same unroll and loss), an
    exact resume, the draft saved in speculators' format (no selfspec keys; the target's embeddings written, as
    speculators writes them; the agreement in the card), loaded back through --draft and decoding losslessly."""
    common = ["--config", "configs/medusa_tiny.yaml", "method=eagle3", "loss.kind=kl", "eagle.draft_vocab=64",
              "eagle.feature_layers=[1,0]", "eagle.feature_weight=0", "optim.scheduler=constant_with_warmup",
              "optim.epochs=100", "logging.every=1", "eval.every=0", "checkpoint.every=3"]
    full = train_and_check_resume(tmp_path, common)
    losses = {r["step"]: r["loss"] for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert min(losses[5], losses[6]) < losses[1]  # it learns
    out = tmp_path / "full" / "eagle3_head"
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "draft_type" not in config
    assert config["draft_vocab_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # sorted
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-random-llama"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6  # eagle.depth
    assert "embed_tokens.weight" in load_file(str(out / "model.safetensors"))
    assert "Top-1 agreement with the target on held-out data, per step: [" in (out / "README.md").read_text()
    assert registry.parse_draft(str(out)).kind == "eagle"
    decode_with_tiny_draft(out)


def test_a_speculators_eagle3_draft_starts_from_the_targets_lm_head_rows_and_trains_them():
    """Eagle3Kind.build: the draft vocabulary counted on the training rows (with the end of turn), lm_head the target's
    rows of it (speculators' starting point); the loss reads the target's LM head, the logits the draft's own."""
    from heads.eagle.kind import Eagle3Kind
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig

    model, tokenizer = load_base(ModelConfig(name="tiny-random-llama"))
    cfg = load_config(REPO / "configs/medusa_tiny.yaml", ["method=eagle3", "eagle.draft_vocab=48",
                                                         "eagle.feature_layers=[0,1]", "eagle.feature_weight=0"])
    labels = [[IGNORE_INDEX, 5, 5, 7, tokenizer.eos_token_id], [9, 9, 9, 5, IGNORE_INDEX]]
    rows = datasets.Dataset.from_dict({"labels": labels})
    head, config = Eagle3Kind().build(cfg, model, rows, tokenizer)
    tokens = head.draft_vocab.tokens
    assert tokens.tolist() == draft_vocabulary(rows, 48, config.vocab_size, (tokenizer.eos_token_id,)).tolist()
    assert torch.equal(head.lm_head.weight, model.get_output_embeddings().weight[tokens])
    assert head.verifier_lm_head is model.get_output_embeddings()
    assert head.lm_head.weight.requires_grad and not any(p is model.get_output_embeddings().weight
                                                        for p in head.parameters())


def test_method_eagle3_refuses_what_speculators_cannot_express(tmp_path):
    with pytest.raises(ValueError, match=r"eagle.feature_weight: method eagle3 .* expected 0, found 0.1"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["method=eagle3"])
    done = subprocess.run([sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", "method=eagle3",
                           "eagle.feature_weight=0", "eagle.feature_layers=[0,2]", f"output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "eagle.feature_layers (method eagle3): eagle_aux_hidden_state_layer_ids [0, 2]: id 2 is the last " \
           "layer's output before the final norm" in done.stderr
