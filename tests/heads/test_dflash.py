"""speculators' DFlash draft as a selfspec block drafter (heads/block/dflash.py): the training pass computes exactly
what drafting computes, drafting reuses the context's keys and values across steps, losslessness through the runtime
on the tiny architectures, strict reading of speculators checkpoints, the speculators export (and the refusal of
selfspec's own block head), and train.py's dflash method end to end with an exact resume. That speculators' own
loader and model compute the same draft is tests/heads/test_speculators.py.

The drafts here are random or trained for a few steps on a tiny random target: these tests pin the plumbing and
losslessness, not what training buys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (decode_with_tiny_draft, random_prompts, reference, spread_weights, state_after_prefill,
                      tiny_model, train_and_check_resume)
from safetensors.torch import load_file, save_file
from tiny_chat_model import build_tokenizer

from heads import export as export_cli
from heads.block.dflash import DFlashHead, dflash_mask
from heads.block.dflash_config import DFlashConfig, qwen3_layers_for
from heads.block.drafter import BlockDrafter
from heads.block.loss import sample_anchors
from heads.training.losses import IGNORE_INDEX
from heads.training.recipe import load_config
from selfspec import registry
from selfspec.core.generate import generate
from selfspec.core.target import Target
from selfspec.core.tree import Tree

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
AUX = [0, 1]  # on a 2-layer tiny target: the embeddings and layer 1's output (layer 2's is the last: not readable)
MASK = 7


def make_dflash(model, seed: int = 0, block_size: int = 4, draft_vocab: int = 64, num_layers: int = 1,
                verifier: str = "tiny") -> DFlashHead:
    """A random DFlash draft drafting ``block_size`` tokens per forward, its weights of the draft's own scale."""
    config = DFlashConfig(transformer_layer_config=qwen3_layers_for(model, num_layers), draft_vocab_size=draft_vocab,
                          block_size=block_size + 1, mask_token_id=MASK, verifier=verifier,
                          aux_hidden_state_layer_ids=AUX)
    torch.manual_seed(seed)
    head = DFlashHead.on_base(config, model)
    spread_weights(head, keep=("lm_head.weight",))
    if draft_vocab < VOCAB:
        head.set_draft_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab])
    head.init_lm_head()
    return head.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


# ------------------------------------------------------------------------------------------ training = drafting
def test_training_mask_says_which_slot_sees_which_position():
    n, slots = 6, 3
    anchors = torch.tensor([[1, 4, -1]])
    allowed = dflash_mask(n, anchors, torch.tensor([5]), slots)[0, 0]  # [9, 6 + 9]
    seen = lambda q: allowed[q].nonzero().flatten().tolist()  # noqa: E731
    assert seen(0) == seen(2) == [0, 1, n + 0, n + 1, n + 2]  # anchor 1 (root x_2): context 0..1, its whole block
    assert seen(4) == [0, 1, 2, 3, 4, n + 3, n + 4, n + 5]  # anchor 4: context 0..4 (5 is padding), its block
    assert seen(7) == [n + 6, n + 7, n + 8]  # an absent anchor: its own block only (never scored)


def test_anchors_of_a_dflash_block_start_at_offset_0():
    """A DFlash block trains offsets 0..K-1 (x_{j+2} ..): an anchor whose only training token is x_{j+2} counts;
    selfspec's block head trains offset 0 at every pair, so its anchors need one in x_{j+3} .."""
    labels = torch.full((1, 12), IGNORE_INDEX)
    labels[0, 6] = 5  # x_6 is the only training token
    ours = sample_anchors(labels, 3, 16, 0, torch.tensor([0]), first_offset=0)[0]
    theirs = sample_anchors(labels, 3, 16, 0, torch.tensor([0]))[0]
    assert ours[ours >= 0].tolist() == [2, 3, 4]  # x_6 is offset 2, 1, 0 of anchors 2, 3, 4
    assert theirs[theirs >= 0].tolist() == [2, 3]  # offsets 2 and 1 (offset 0 of anchor 4 is its pair's)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_pass_is_what_drafting_computes(arch):
    """The training forward's block at anchor j (root x_{j+1}, context 0..j) is exactly the block drafting computes
    with that prefix: the same states, slot by slot."""
    model = tiny_model(arch, initializer_range=0.1)
    head = make_dflash(model)
    prompt = random_prompts(1, VOCAB, seed=3, min_len=14, max_len=14)[0]
    feats = state_after_prefill(model, prompt).new_states.take(AUX)  # [13, A·D] positions 0..12
    features = torch.cat([feats, torch.zeros_like(feats[:1])])[None]  # [1, 14, A·D] (position 13 is never read)
    anchors = torch.tensor([[0, 4, 9, 11, -1]])
    with torch.no_grad():
        _, blocks = head(features, prompt[None], torch.tensor([14]), anchors)  # [1, 5, K, D]
        for a, j in enumerate([0, 4, 9, 11]):
            alone = head.block(head.new_cache(), feats[: j + 1], prompt[: j + 2])  # [K, D]
            torch.testing.assert_close(blocks[0, a], alone, atol=1e-5, rtol=1e-5)


def test_drafting_keeps_the_context_and_computes_only_the_block(model):
    """Step by step through the cache (only the new positions' keys and values computed) = from scratch."""
    head = make_dflash(model)
    prompt = random_prompts(1, VOCAB, seed=4, min_len=14, max_len=14)[0]
    feats = state_after_prefill(model, prompt).new_states.take(AUX)
    with torch.no_grad():
        cache = head.new_cache()
        head.block(cache, feats[:5], prompt[:6])
        stepped = head.block(cache, feats[5:9], prompt[:10])
        assert cache.length == 9
        torch.testing.assert_close(stepped, head.block(head.new_cache(), feats[:9], prompt[:10]), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_dflash_drafts_through_the_runtime_stay_token_identical_to_generate(arch, tmp_path):
    """Saved in speculators' format, loaded through --draft (the block kind), every tree decodes exactly as plain
    greedy generate does (fp32)."""
    model = tiny_model(arch, initializer_range=0.1)
    make_dflash(model, draft_vocab=48).save_pretrained(tmp_path / "dflash")
    spec = registry.parse_draft(str(tmp_path / "dflash"))
    assert spec.kind == "block"
    target = Target(model)
    for tree in (None, "dynamic:8", "chain:3", "dynamic:6,depth=2"):
        drafter = registry.build_drafter(registry.with_tree(spec, tree) if tree else spec, target,
                                         registry.parse_tree(tree))
        assert isinstance(drafter, BlockDrafter) and isinstance(drafter.head, DFlashHead)
        for prompt in random_prompts(3, VOCAB, seed=11):
            assert generate(target, drafter, prompt, max_new_tokens=20).tokens == reference(model, prompt, 20), tree


def test_a_dflash_draft_refuses_trees_deeper_than_its_block(model):
    with pytest.raises(ValueError, match="depth"):
        BlockDrafter(make_dflash(model, block_size=3), Tree.chain(4))


# --------------------------------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_is_strict_and_exact(model, tmp_path):
    head = make_dflash(model, draft_vocab=48)
    head.save_pretrained(tmp_path / "d")
    stored = json.loads((tmp_path / "d" / "config.json").read_text())
    assert stored["speculators_model_type"] == "dflash" and stored["block_size"] == 5 and stored["mask_token_id"] == MASK
    assert stored["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert stored["transformer_layer_config"]["model_type"] == "qwen3"
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape == (48, 32)
    assert sorted(k for k in tensors if not k.startswith("layers.")) == ["d2t", "fc.weight", "hidden_norm.weight",
                                                                         "lm_head.weight", "norm.weight", "t2d"]
    back = DFlashHead.from_pretrained(tmp_path / "d", model)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))

    whole = make_dflash(model, draft_vocab=VOCAB)  # the whole vocabulary: no lm_head stored (it is the target's)
    whole.save_pretrained(tmp_path / "w")
    assert "lm_head.weight" not in load_file(str(tmp_path / "w" / "model.safetensors"))
    assert torch.equal(DFlashHead.from_pretrained(tmp_path / "w", model).lm_head.weight,
                       model.get_output_embeddings().weight)


@pytest.mark.parametrize("change,expected", [
    (lambda c, t: c.update(sample_from_anchor=True), "sample_from_anchor true"),
    (lambda c, t: c.update(mask_token_id=None), "mask_token_id: expected the token id of the mask slots"),
    (lambda c, t: c.update(block_size=1), "block_size: expected >= 2"),
    (lambda c, t: c.update(speculators_model_type="dflash2"), "expected 'dflash'"),
    (lambda c, t: t.update({"layers.0.extra": torch.zeros(1)}), "unexpected \\['layers.0.extra'\\]"),
    (lambda c, t: t.pop("fc.weight"), "missing tensors \\['fc.weight'\\]"),
    (lambda c, t: t.update(d2t=torch.zeros(48, dtype=torch.long)), "d2t"),
])
def test_speculators_dflash_checkpoints_are_read_strictly(model, tmp_path, change, expected):
    make_dflash(model, draft_vocab=48).save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    change(config, tensors)
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match=expected):
        DFlashHead.from_pretrained(tmp_path / "d", model)


def test_training_only_tensors_and_embeddings_in_a_checkpoint_are_ignored(model, tmp_path):
    """What speculators' trainer may leave in a checkpoint (its verifier head and norm, embeddings its loader replaces
    with the verifier's) changes nothing: the draft reads the target's embeddings."""
    head = make_dflash(model, draft_vocab=48)
    head.save_pretrained(tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    tensors.update({"verifier_lm_head.weight": torch.zeros(48, 32), "verifier_norm.weight": torch.ones(32),
                    "embed_tokens.weight": torch.zeros(VOCAB, 32)})
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    back = DFlashHead.from_pretrained(tmp_path / "d", model)
    assert back.embed(torch.tensor([3])).equal(model.get_input_embeddings().weight[3:4])


# ------------------------------------------------------------------------------------------------------ export
def test_export_writes_a_dflash_draft_and_refuses_selfspec_block_heads(tmp_path, capsys):
    from test_block import make_head

    model = tiny_model("llama", initializer_range=0.1)
    model.save_pretrained(tmp_path / "target")
    build_tokenizer().save_pretrained(tmp_path / "target")  # a model directory as users have them
    make_dflash(model, draft_vocab=48, verifier=str(tmp_path / "target")).save_pretrained(tmp_path / "dflash")
    assert export_cli.main([str(tmp_path / "dflash"), str(tmp_path / "out"), "--format", "speculators",
                            "--verifier", "me/target"]) == 0
    assert "(DFlash, 1 layer(s), blocks of 5, draft vocabulary 48)" in capsys.readouterr().out
    stored = json.loads((tmp_path / "out" / "config.json").read_text())
    assert stored["speculators_config"]["verifier"]["name_or_path"] == "me/target"
    target = Target(model)
    drafter = registry.build_drafter(registry.parse_draft(str(tmp_path / "out")), target)
    for prompt in random_prompts(2, VOCAB, seed=5):
        assert generate(target, drafter, prompt, max_new_tokens=16).tokens == reference(model, prompt, 16)

    make_head(model).save_pretrained(tmp_path / "block")
    assert export_cli.main([str(tmp_path / "block"), str(tmp_path / "x"), "--format", "speculators"]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported in the speculators format" in err and "mask slots: selfspec's block head" in err
    assert "Instead: train.py method: dflash trains a block drafter of DFlash's architecture" in err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------------- train.py
def test_train_py_trains_a_dflash_draft_that_resumes_exactly_and_decodes_losslessly(tmp_path):
    """method dflash: speculators' DFlash architecture trained from the block section with the block loss (every
    offset from a mask slot), an exact resume, the draft saved in speculators' format with the tokenizer's padding
    token as the mask (the tiny tokenizer has no mask or unknown token), loaded back through --draft and decoding
    losslessly."""
    common = ["--config", "configs/medusa_tiny.yaml", "method=dflash", "loss.kind=kl", "block.block_size=3",
              "block.anchors=8", "block.draft_vocab=64", "block.feature_layers=[0,1]",
              "optim.scheduler=constant_with_warmup", "optim.epochs=100", "logging.every=1", "eval.every=0",
              "checkpoint.every=3"]
    full = train_and_check_resume(tmp_path, common)
    losses = {r["step"]: r["loss"] for r in map(json.loads, (full / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert min(losses[5], losses[6]) < losses[1]  # it learns
    out = full / "dflash_head"
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and "draft_type" not in config
    assert config["block_size"] == 4 and config["draft_vocab_size"] == 64 and config["aux_hidden_state_layer_ids"] == [0, 1]
    assert config["mask_token_id"] == build_tokenizer().pad_token_id
    assert "Top-1 agreement with the target on held-out data, per block offset: [" in (out / "README.md").read_text()
    decode_with_tiny_draft(out)


def test_recipe_for_dflash_loads():
    cfg = load_config(REPO / "configs/dflash_smollm2.yaml")
    assert cfg.method == "dflash" and cfg.block.block_size == 6 and cfg.block.feature_layers == [2, 15, 27]
    assert str(cfg.final_dir) == "runs/dflash-smollm2/dflash_head"
