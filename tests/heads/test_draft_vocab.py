"""Draft vocabularies for Medusa and Hydra heads (heads/draft_vocab.py): the heads' logits on V' rows are their full
logits at those tokens, drafts only ever hold those tokens, decoding stays token-identical to greedy ``generate``, the
vocabulary is stored strictly, and heads trained without one gain one without changing anything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, reference, state_after_prefill, tiny_model

from heads.training.base_model import lm_logits
from heads.training.draft_vocab import with_draft_vocab
from heads.training.recipe import load_config
from selfspec.core.draft_vocab import DraftVocab
from heads.hydra.drafter import HydraDrafter
from heads.hydra.model import HydraConfig, HydraHeads, following
from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter
from heads.medusa.model import MedusaHeads
from heads.training.evaluate import heads_loss
from heads.training.losses import IGNORE_INDEX, gather_scored, scored_loss
from selfspec import Target
from selfspec.core.generate import generate
from selfspec.core.tree import DynamicTree, Tree

REPO = Path(__file__).resolve().parents[2]
VOCAB = 96
KEEP = torch.tensor(sorted({3, 5, 8, 13, 21, 34, 89, 90} | set(range(40, 72))))  # 40 of the 96 tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.1)


def randomised(heads: torch.nn.Module, seed: int, scale: float) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads.eval()


def medusa(model, projection: str = "shared", vocab: torch.Tensor | None = KEEP) -> MedusaHeads:
    config = MedusaConfig.for_model(model, num_heads=3, projection=projection, lora_rank=4,
                                    draft_vocab_size=None if vocab is None else len(vocab))
    heads = randomised(MedusaHeads(config, model.get_output_embeddings()), seed=1, scale=0.05)
    if vocab is not None:
        heads.draft_vocab.set(vocab)
    return heads


def hydra(model, vocab: torch.Tensor | None = KEEP) -> HydraHeads:
    config = HydraConfig.for_model(model, num_heads=3, draft_vocab_size=None if vocab is None else len(vocab))
    heads = randomised(HydraHeads(config, model.get_input_embeddings(), model.get_output_embeddings()), 2, 0.3)
    if vocab is not None:
        heads.draft_vocab.set(vocab)
    return heads


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_medusa_logits_on_the_draft_vocabulary_are_the_full_logits_at_its_tokens(model, projection):
    heads = medusa(model, projection)
    hidden = torch.randn(32)
    full = heads(hidden)  # [K, V]
    torch.testing.assert_close(heads.draft_logits(hidden, 3), full[:, KEEP], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(heads.draft_logits(hidden, 2), full[:2, KEEP], rtol=1e-5, atol=1e-5)
    assert heads.draft_vocab.base_ids(torch.tensor([0, 39])).tolist() == [3, 90]
    without = medusa(model, projection, vocab=None)  # same weights (same seed), every token
    torch.testing.assert_close(without.draft_logits(hidden, 3), full, rtol=1e-5, atol=1e-5)


def test_hydra_logits_on_the_draft_vocabulary_are_the_full_logits_at_its_tokens(model):
    heads = hydra(model)
    hidden, path = torch.randn(2, 32), torch.tensor([[4, 9], [7, 1]])
    torch.testing.assert_close(heads.draft_logits(hidden, path, 2), heads.head_logits(hidden, path, 2)[:, KEEP],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_training_logits_on_the_draft_vocabulary_are_the_full_logits_at_its_tokens(model, projection):
    heads = medusa(model, projection)
    hidden = torch.randn(5, 32)
    full = heads(hidden)  # [K, N, V]
    on_vocab = heads(hidden, on_draft_vocab=True)  # [K, N, V']
    assert on_vocab.shape == (3, 5, len(KEEP))
    torch.testing.assert_close(on_vocab, full[..., KEEP], rtol=1e-5, atol=1e-5)
    on_vocab.sum().backward()  # the heads learn through it; the frozen LM head gets no gradient
    assert all(p.grad is not None for p in heads.parameters())
    assert model.get_output_embeddings().weight.grad is None
    without = medusa(model, projection, vocab=None)  # no draft vocabulary: every token
    torch.testing.assert_close(without(hidden, on_draft_vocab=True), full, rtol=1e-5, atol=1e-5)
    h = hydra(model)
    path = torch.tensor([[4, 9, 2], [7, 1, 5], [3, 3, 3], [0, 8, 6], [9, 2, 1]])
    torch.testing.assert_close(h(hidden, path, on_draft_vocab=True), h(hidden, path)[..., KEEP], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["medusa", "hydra"])
@pytest.mark.parametrize("kind", ["ce", "kl"])
def test_the_trainer_reads_the_loss_on_the_draft_vocabulary_unless_told_otherwise(model, method, kind):
    """heads_loss with loss.vocab=draft (the default) is scored_loss of the heads' logits at the draft vocabulary's
    columns; loss.vocab=full is the whole-vocabulary loss of the same heads."""
    heads = medusa(model) if method == "medusa" else hydra(model)
    g = torch.Generator().manual_seed(4)
    B, T = 2, 16
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    ids[:, ::3] = KEEP[:6].repeat(B, 1)[:, : ids[:, ::3].shape[1]]  # a share of the tokens in V', the rest anywhere
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt
    batch = {"input_ids": ids, "labels": labels}
    hidden, target_logits = torch.randn(B, T, 32, generator=g), torch.randn(B, T, VOCAB, generator=g)
    states = lambda batch, split: (hidden, target_logits if kind == "kl" else None)  # noqa: E731  the target's states
    scored, targets, shifted = gather_scored(labels, 3, target_logits if kind == "kl" else None)
    if method == "hydra":
        full = heads(hidden[scored], following(ids, scored, 3))
    else:
        full = heads(hidden[scored])  # [K, N, V]
    for vocab, want in (("draft", scored_loss(full[..., KEEP], targets, 0.8, kind, shifted, 5, KEEP)),
                        ("full", scored_loss(full, targets, 0.8, kind, shifted, 5))):
        cfg = load_config(REPO / "configs/medusa_tiny.yaml",
                          [f"method={method}", "heads.num_heads=3", f"loss.kind={kind}", f"loss.vocab={vocab}"])
        got = heads_loss(cfg, heads, states, batch, "train", ranks=5)
        torch.testing.assert_close(got.per_head, want.per_head, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.hits, want.hits) and torch.equal(got.count, want.count)
    assert not torch.allclose(want.per_head, scored_loss(full[..., KEEP], targets, 0.8, kind, shifted, 5, KEEP).per_head)


def test_the_targets_logits_on_draft_vocabulary_rows_are_its_full_logits_there(model):
    hidden, vocab = torch.randn(2, 5, 32), DraftVocab(len(KEEP), VOCAB)
    vocab.set(KEEP)
    torch.testing.assert_close(lm_logits(model, hidden, vocab), lm_logits(model, hidden)[..., KEEP], rtol=1e-5, atol=1e-6)


def test_drafts_hold_only_draft_vocabulary_tokens_below_the_root(model):
    state = state_after_prefill(model, random_prompts(1, VOCAB, seed=3, min_len=8, max_len=8)[0])
    free = {int(t) for drafter in (MedusaDrafter(medusa(model, vocab=None), DynamicTree(12, max_rank=4)),
                                   HydraDrafter(hydra(model, vocab=None), DynamicTree(12, max_rank=4)))
            for t in drafter.draft(state).tokens[1:]}
    vocab = torch.tensor([t for t in range(VOCAB) if t not in free][:40])  # without every otherwise drafted token
    drafters = [MedusaDrafter(medusa(model, vocab=vocab), Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]])),
                MedusaDrafter(medusa(model, vocab=vocab), DynamicTree(12, max_rank=4)),
                HydraDrafter(hydra(model, vocab=vocab), Tree.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]])),
                HydraDrafter(hydra(model, vocab=vocab), DynamicTree(12, max_rank=4))]
    for drafter in drafters:
        draft = drafter.draft(state)
        assert len(draft.tree) > 5 and set(draft.tokens[1:].tolist()) <= set(vocab.tolist())


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_decoding_with_a_draft_vocabulary_is_token_identical_to_generate(model, kind):
    target = Target(model)
    if kind == "medusa":
        drafters = [MedusaDrafter(medusa(model), Tree.from_choices([[0], [1], [0, 0], [0, 0, 0]])),
                    MedusaDrafter(medusa(model), DynamicTree(8, max_rank=3))]
    else:
        drafters = [HydraDrafter(hydra(model), Tree.from_choices([[0], [1], [0, 0], [0, 0, 0]])),
                    HydraDrafter(hydra(model), DynamicTree(8, max_rank=3))]
    for prompt in random_prompts(4, VOCAB, seed=6):
        expected = reference(model, prompt, 20)
        for drafter in drafters:
            assert generate(target, drafter, prompt, max_new_tokens=20).tokens == expected


def test_the_draft_vocabulary_round_trips_strictly_and_bad_ones_are_refused(model, tmp_path):
    heads = medusa(model)
    heads.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["draft_vocab_size"] == 40
    loaded = MedusaHeads.from_pretrained(tmp_path / "m", model)
    assert torch.equal(loaded.draft_vocab.tokens, KEEP) and loaded.draft_vocab.tokens.dtype == torch.long
    assert next(loaded.parameters()).dtype == torch.float32
    hy = hydra(model)
    hy.save_pretrained(tmp_path / "h")
    assert torch.equal(HydraHeads.from_pretrained(tmp_path / "h", model).draft_vocab.tokens, KEEP)

    with pytest.raises(ValueError, match="expected 40 distinct token ids, found \\(40,\\) with 39 distinct"):
        heads.draft_vocab.set(torch.cat([KEEP[:-1], KEEP[:1]]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 96\), found 3..96"):
        heads.draft_vocab.set(torch.cat([KEEP[:-1], torch.tensor([96])]))
    with pytest.raises(ValueError, match="draft from the whole vocabulary"):
        DraftVocab(None, VOCAB).set(KEEP)
    with pytest.raises(ValueError, match=r"draft_vocab_size: expected 1..96 \(the vocabulary\) or None, found 97"):
        MedusaConfig.for_model(model, draft_vocab_size=97)
    with pytest.raises(ValueError, match=r"draft_vocab_size: expected 1..96 \(the vocabulary\) or None, found 0"):
        HydraConfig.for_model(model, draft_vocab_size=0)
    # config.json and the weights must agree: a vocabulary of another size is refused on loading
    stored = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps(dict(stored, draft_vocab_size=41)))
    with pytest.raises(ValueError, match="wrong shapes"):
        HydraHeads.from_pretrained(tmp_path / "h", model)


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_heads_trained_without_a_vocabulary_gain_one_and_keep_their_weights(model, kind, tmp_path):
    old = medusa(model, vocab=None) if kind == "medusa" else hydra(model, vocab=None)
    assert not any(k.startswith("draft_vocab") for k in old.state_dict())  # older checkpoints: nothing stored
    rebuild = ((lambda c: MedusaHeads(c, model.get_output_embeddings())) if kind == "medusa"
               else (lambda c: HydraHeads.on_base(c, model)))
    new = with_draft_vocab(old, KEEP, rebuild)
    assert new.config.draft_vocab_size == 40 and torch.equal(new.draft_vocab.tokens, KEEP)
    assert {k: v for k, v in new.config.__dict__.items() if k != "draft_vocab_size"} == \
        {k: v for k, v in old.config.__dict__.items() if k != "draft_vocab_size"}
    state = new.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in old.state_dict().items())
    halved = with_draft_vocab(old.to(torch.bfloat16), KEEP, rebuild)
    assert next(halved.parameters()).dtype == torch.bfloat16  # stored as it was: bf16 heads stay bf16
    new.save_pretrained(tmp_path / "ck")
    loaded = type(new).from_pretrained(tmp_path / "ck", model)
    assert torch.equal(loaded.draft_vocab.tokens, KEEP)


def test_add_vocab_counts_the_recipes_data_and_the_heads_still_decode_losslessly(tmp_path, capsys):
    from conftest import decode_with_tiny_draft

    from heads import add_vocab
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig

    base, tokenizer = load_base(ModelConfig(name="tiny-random-llama"))
    recipe = {"model": {"name": "tiny-random-llama"},
              "data": {"source": str(REPO / "configs" / "data" / "tiny_chat.jsonl"), "max_length": 128}}
    config = MedusaConfig.for_model(base, base_model="tiny-random-llama", num_heads=3, recipe=recipe)
    heads = randomised(MedusaHeads(config, base.get_output_embeddings()), seed=5, scale=0.05)
    heads.save_pretrained(tmp_path / "heads")

    assert add_vocab.main([str(tmp_path / "heads"), "--size", "30", "--out", str(tmp_path / "v30")]) == 0
    assert "medusa checkpoint now drafts from the 30 tokens" in capsys.readouterr().out
    stored = json.loads((tmp_path / "v30" / "config.json").read_text())
    assert stored["draft_vocab_size"] == 30 and stored["recipe"] == recipe
    loaded = MedusaHeads.from_pretrained(tmp_path / "v30", base)
    assert tokenizer.eos_token_id in loaded.draft_vocab.tokens.tolist()  # end of turn is always draftable
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in heads.state_dict().items())
    decode_with_tiny_draft(tmp_path / "v30")

    assert add_vocab.main([str(tmp_path / "heads"), "--size", "0"]) == 2
    assert "--size: expected 1.." in capsys.readouterr().err


def test_the_vocabularys_lm_head_rows_are_gathered_once_and_again_only_when_the_base_changes(model):
    heads = medusa(model)
    first = heads.draft_vocab.rows(model.get_output_embeddings())[0]
    assert heads.draft_vocab.rows(model.get_output_embeddings())[0] is first  # drafting reads them every step
    heads.draft_vocab.set(KEEP.flip(0))
    assert heads.draft_vocab.rows(model.get_output_embeddings())[0] is not first
    other = tiny_model("llama", initializer_range=0.3)  # another base: other LM-head weights
    assert not torch.equal(other.get_output_embeddings().weight, model.get_output_embeddings().weight)
    rows = heads.draft_vocab.rows(other.get_output_embeddings())[0]
    assert torch.equal(rows, other.get_output_embeddings().weight.detach()[KEEP.flip(0)])


def test_add_vocab_mistakes_are_one_error_line(tmp_path, capsys):
    from tiny_chat_model import build, build_heads

    from heads import add_vocab

    model_dir = build(tmp_path / "model")
    heads_dir = build_heads(model_dir, tmp_path / "heads")
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"draft_type": "eagle"}))
    model_files = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    capsys.readouterr()
    takes = ("heads.add_vocab takes a selfspec checkpoint of Medusa heads, Hydra heads, an exit head or a layer-skip draft, "
             "or a draft model (train.py method draft_model)")
    cases = {
        (str(model_dir),): f"{model_dir} holds a transformers model directory; {takes}",
        (str(eagle),): f"{eagle} holds a selfspec eagle checkpoint; {takes} (an EAGLE head stores its draft vocabulary "
                       "when it is trained: eagle.draft_vocab)",
        (str(tmp_path / "missing"),): f"the directory {tmp_path / 'missing'} does not exist: expected a local checkpoint "
                                      "directory (or a Hub repo id 'owner/name'); check the path",
        (str(heads_dir), "--out", str(model_dir)): f"--out {model_dir} already holds a transformers model directory, not "
                                                   "a selfspec medusa checkpoint; writing there would overwrite its "
                                                   "files: choose another path or delete it",
        (str(heads_dir), "--source", str(tmp_path / "nope.jsonl")):
            f"--source {tmp_path / 'nope.jsonl'}: no such file or directory; expected 'sharegpt', a "
            ".json/.jsonl/.parquet file, a save_to_disk directory or a Hub dataset id",
    }
    for argv, message in cases.items():
        assert add_vocab.main(list(argv)) == 2, argv
        assert capsys.readouterr().err.splitlines()[-1] == f"error: {message}"
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == model_files
    with pytest.raises(SystemExit):
        add_vocab.main([str(heads_dir), "--max-conversations", "0"])
    assert capsys.readouterr().err.splitlines()[-1] == ("python -m heads.add_vocab: error: argument --max-conversations: "
                                                        "expected an integer >= 1, found '0'")
