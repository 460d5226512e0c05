"""The fine-tuned exit head: the loss's index shift (t+1, as the LM head), the layer-E states it reads, an untrained
head being plain early exit, strict save / load, train.py's exit_head method end to end, and decoding through the
runtime (with the early layers' KV reused) staying token-identical to plain greedy decoding.

The tiny random models here are nearly transparent (an untrained head already agrees with them), so these tests pin
the plumbing and losslessness; what training buys is measured on SmolLM2 in docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import decode_with_tiny_draft, random_prompts, reference, state_after_prefill, tiny_model
from test_layerskip import VOCAB, four_layer

from heads.exit_head.drafter import load_drafter
from heads.exit_head.model import ExitHead, ExitHeadConfig, ExitLogits, final_norm
from heads.training.base_model import final_hidden, layer_and_final_hidden
from heads.training.losses import gather_scored, head_targets
from heads.training.recipe import load_config
from selfspec.core import hf
from selfspec.drafts.early_exit import EarlyExitDrafter, EarlyExitTarget
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import DynamicTree

REPO = Path(__file__).resolve().parents[2]
EXIT = 2


@pytest.fixture(scope="module")
def model():
    return four_layer("llama", weak=(2, 3))


def test_exit_head_targets_are_the_next_token_and_the_targets_own_logits_at_t():
    labels = torch.tensor([[-100, -100, 11, 12, 13, 14]])
    assert head_targets(labels, 1, first=0).tolist() == [[[-100, 11, 12, 13, 14, -100]]]
    assert head_targets(labels, 2).tolist() == head_targets(labels, 2, first=1).tolist()  # Medusa unchanged
    logits = torch.arange(6.0)[None, :, None].expand(1, 6, 3)  # the target's logits at t are all t
    scored, targets, shifted = gather_scored(labels, 1, logits, first=0)
    assert scored.tolist() == [[False, True, True, True, True, False]]
    assert targets.tolist() == [[11, 12, 13, 14]]
    assert shifted[0][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # position t's own distribution predicts t+1


def test_layer_states_are_layer_e_inputs_from_one_forward(model):
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        layer, final = layer_and_final_hidden(model, ids, mask, EXIT)
        full = model(ids, output_hidden_states=True)
    assert torch.allclose(layer, full.hidden_states[EXIT], atol=1e-6)
    assert torch.equal(final, final_hidden(model, ids, mask))


def config_for(model, **kwargs) -> ExitHeadConfig:
    return ExitHeadConfig.for_model(model, EXIT, base_model="four-layer", **kwargs)


def test_untrained_exit_head_is_plain_early_exit(model):
    head = ExitHead(config_for(model))
    h = torch.randn(5, model.config.hidden_size)
    logits = ExitLogits(head, final_norm(model), model.get_output_embeddings())(h)
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert torch.equal(logits[0], model.lm_head(final_norm(model)(h)))
    assert [n for n, _ in ExitLogits(head, final_norm(model), model.lm_head).named_parameters()] == [
        "exit_head.blocks.0.linear.weight", "exit_head.blocks.0.linear.bias"]  # norm and LM head: not trained


def trained(model, seed: int = 0) -> ExitHead:
    head = ExitHead(config_for(model, top1_agreement=0.75))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return head.eval()


def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    head = trained(model)
    head.save_pretrained(tmp_path / "ck")
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["draft_type"] == "exit-head" and stored["exit_layer"] == EXIT and stored["top1_agreement"] == 0.75
    loaded = ExitHead.from_pretrained(tmp_path / "ck", model)
    assert loaded.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), loaded.state_dict().values()))

    deeper = tiny_model("llama", vocab=VOCAB, num_hidden_layers=6)
    with pytest.raises(ValueError, match="trained for number of layers 4, this model has 6"):
        ExitHead.from_pretrained(tmp_path / "ck", deeper)
    stored["num_layers"] = 2
    (tmp_path / "ck" / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="disagrees with config.json"):
        ExitHead.from_pretrained(tmp_path / "ck", model)
    stored["draft_type"] = "medusa"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match="expected 'exit-head'"):
        ExitHead.from_pretrained(tmp_path / "ck", model)
    with pytest.raises(ValueError, match=r"exit_layer: expected 1..3 for a base of 4 layers, found 4"):
        ExitHeadConfig.for_model(model, 4)


def test_drafting_with_a_trained_exit_head_is_lossless_and_reuses_the_early_layers(model, tmp_path):
    trained(model).save_pretrained(tmp_path / "ck")
    target = Target(model)
    drafter = load_drafter(tmp_path / "ck", target)
    assert isinstance(drafter, EarlyExitDrafter) and drafter.exit_layer == EXIT
    verifier = drafter.verifier()
    assert isinstance(verifier, EarlyExitTarget)
    for prompt in random_prompts(12, VOCAB, seed=3):
        out = generate(verifier, drafter, prompt, max_new_tokens=16)
        assert out.tokens == reference(model, prompt, 16)
    assert verifier.reused > 0


def test_an_exit_head_with_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(model, tmp_path):
    head = ExitHead(config_for(model, draft_vocab_size=40))
    head.load_state_dict(trained(model).state_dict() | {"draft_vocab.tokens": head.draft_vocab.tokens}, strict=True)
    keep = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:40].sort().values
    head.draft_vocab.set(keep)
    head.save_pretrained(tmp_path / "ck")
    loaded = ExitHead.from_pretrained(tmp_path / "ck", model)
    assert loaded.config.draft_vocab_size == 40 and torch.equal(loaded.draft_vocab.tokens, keep)

    # the draft forward on V' is the full draft forward's logits at V'
    whole = ExitHead(config_for(model))
    whole.load_state_dict({k: v for k, v in loaded.state_dict().items() if not k.startswith("draft_vocab.")})
    target = Target(model)
    prompt = random_prompts(1, VOCAB, seed=4, min_len=7, max_len=7)[0]
    S = len(prompt) - 1
    logits = []
    for exit_head in (loaded, whole):
        drafter = EarlyExitDrafter(target, EXIT, depth=3, exit_head=exit_head)
        state = state_after_prefill(model, prompt)
        mask = hf.additive_mask(torch.ones(1, S + 1, dtype=torch.bool), torch.float32)
        with torch.inference_mode():
            logits.append(drafter._forward(prompt[-1:], torch.tensor([S]), mask, state.cache))
    assert logits[0].shape == (1, 40) and logits[1].shape == (1, VOCAB)
    torch.testing.assert_close(logits[0], logits[1][:, keep], rtol=0, atol=1e-5)

    # decoding: every drafted token is in V', and the output is plain greedy decoding's (chain with the early layers'
    # work reused, and a dynamic tree)
    drafts = []
    for tree in (None, DynamicTree(6, max_rank=3, depth=3)):
        drafter = load_drafter(tmp_path / "ck", target, tree=tree)
        verifier = drafter.verifier()
        drafter.draft = lambda state, draft=drafter.draft: drafts.append(draft(state)) or drafts[-1]  # record them
        for prompt in random_prompts(8, VOCAB, seed=5):
            out = generate(verifier, drafter, prompt, max_new_tokens=14)
            assert out.tokens == reference(model, prompt, 14)
    drafted = {int(t) for d in drafts for t in d.tokens[1:]}
    assert any(not d.tree.is_chain for d in drafts) and verifier.reused == 0  # the tree's drafts: no early-layer reuse
    assert len(drafted) > 5 and drafted <= set(keep.tolist())

    small = ExitHead(config_for(model, draft_vocab_size=2))
    with pytest.raises(ValueError, match="the draft vocabulary holds 2 tokens, but the tree asks for the 3 best"):
        EarlyExitDrafter(target, EXIT, tree=DynamicTree(6, max_rank=3, depth=3), exit_head=small)


def test_add_vocab_gives_an_exit_head_trained_without_one_a_draft_vocabulary(tmp_path, capsys):
    from heads import add_vocab
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig

    base, tokenizer = load_base(ModelConfig(name="tiny-random-llama"))
    recipe = {"model": {"name": "tiny-random-llama"},
              "data": {"source": str(REPO / "configs" / "data" / "tiny_chat.jsonl"), "max_length": 128}}
    head = ExitHead(ExitHeadConfig.for_model(base, 1, base_model="tiny-random-llama", recipe=recipe))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    head.save_pretrained(tmp_path / "exit")
    assert add_vocab.main([str(tmp_path / "exit"), "--size", "30", "--out", str(tmp_path / "v30")]) == 0
    assert "exit-head checkpoint now drafts from the 30 tokens" in capsys.readouterr().out
    loaded = ExitHead.from_pretrained(tmp_path / "v30", base)
    assert loaded.config.draft_vocab_size == 30 and tokenizer.eos_token_id in loaded.draft_vocab.tokens.tolist()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in head.state_dict().items())
    decode_with_tiny_draft(tmp_path / "v30")


def test_recipe_needs_an_exit_layer_and_refuses_cached_states_with_kl(tmp_path):
    with pytest.raises(ValueError, match="exit.layer: method exit_head needs the exit layer"):
        load_config(REPO / "configs/medusa_tiny.yaml", ["method=exit_head"])
    with pytest.raises(ValueError, match="hidden_cache.enabled with method exit_head and loss.kind kl"):
        load_config(REPO / "configs/medusa_tiny.yaml",
                    ["method=exit_head", "exit.layer=1", "loss.kind=kl", "hidden_cache.enabled=true"])


def test_train_py_trains_an_exit_head_that_drafts_through_selfspec_load(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", f"output_dir={out}", "method=exit_head",
           "exit.layer=1", "loss.kind=kl", "optim.max_steps=6", "checkpoint.every=0", "exit.draft_vocab=40"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "exit_head" / "config.json").read_text())
    assert config["exit_layer"] == 1 and config["recipe"]["method"] == "exit_head"
    assert config["draft_vocab_size"] == 40  # counted on the training data: the decoding below drafts from it
    assert 0.0 <= config["top1_agreement"] <= 1.0
    assert list((out / "exit").rglob("events.out.tfevents*")) and not (out / "medusa").exists()  # TensorBoard
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"final"' in line]
    assert final and final[-1]["eval_top1"] == [config["top1_agreement"]]

    spec = decode_with_tiny_draft(out / "exit_head", max_new_tokens=12)
    assert isinstance(spec.target, EarlyExitTarget)  # the drafter's own verifier, reusing the early layers
