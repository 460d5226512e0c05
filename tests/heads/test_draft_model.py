"""A separate draft model distilled from the target (heads/draft_model/): the student is exactly the chosen target
layers (all of them: the target itself; some: the target with the others skipped, sliding-window layer types and KV
cache slots included), the distillation loss and its agreement, strict layer choices and recipe checks, and train.py's
draft_model method end to end: an exact resume and a plain transformers model directory that loads with no selfspec
code, names its target and carries the target's tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import losses_over_steps, tiny_model, train_and_check_resume
from transformers import AutoModelForCausalLM

from heads.draft_model.kind import DraftModelKind
from heads.draft_model.save import Distilled, save_draft_model
from heads.draft_model.student import Distillation, build_student, chosen_layers
from heads.training.base_model import final_hidden, load_base
from heads.training.losses import IGNORE_INDEX
from heads.training.recipe import load_config
from selfspec.core import hf

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/draft_model_tiny.yaml"
SLIDING = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]


def sliding_qwen2():
    """A 4-layer Qwen2 whose odd layers attend over a window of 3 tokens (the test sequences are longer)."""
    return tiny_model("qwen2", num_hidden_layers=4, layer_types=SLIDING, sliding_window=3, use_sliding_window=True,
                      max_window_layers=0)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ------------------------------------------------------------------------------------------ the student
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_student_of_every_layer_is_the_target(arch):
    model = tiny_model(arch)
    student = build_student(model, [0, 1]).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(student, ids), logits(model, ids))
    assert student.config.tie_word_embeddings == model.config.tie_word_embeddings


@pytest.mark.parametrize("make,layers", [(lambda: tiny_model("llama", num_hidden_layers=4), [0, 3]),
                                         (sliding_qwen2, [1, 2]), (sliding_qwen2, [0, 3])])
def test_a_student_of_some_layers_is_the_target_skipping_the_others(make, layers):
    """Logits equal to the target's with the other layers passed through; each copied layer keeps its attention type
    (full / sliding window) and takes its new index, so its KV cache slot is its own: cached greedy decoding equals
    uncached."""
    model = make()
    student = build_student(model, layers).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(1))
    skipped = {i: hf.Passthrough() for i in range(4) if i not in layers}
    with hf.replaced_layers(model, skipped):
        assert torch.equal(logits(student, ids), logits(model, ids))
    assert student.config.num_hidden_layers == len(hf.decoder_layers(student)) == len(layers)
    if getattr(model.config, "layer_types", None) == SLIDING:
        assert student.config.layer_types == [SLIDING[i] for i in layers]
    assert [layer.self_attn.layer_idx for layer in hf.decoder_layers(student)] == list(range(len(layers)))
    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(student.generate(ids, **greedy), student.generate(ids, use_cache=False, **greedy))


def test_the_embeddings_and_lm_head_are_frozen_copies_unless_trained():
    model = tiny_model("llama")  # untied embeddings and LM head
    frozen = build_student(model, [1])
    assert [n for n, p in frozen.named_parameters() if p.requires_grad and ("embed" in n or "lm_head" in n)] == []
    assert frozen.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()  # a copy, not the target's
    trained = build_student(model, [1], train_embeddings=True)
    assert trained.get_input_embeddings().weight.requires_grad and trained.get_output_embeddings().weight.requires_grad


def test_layer_choices_are_checked_against_the_target():
    assert chosen_layers(None, 6, 30) == [0, 6, 12, 17, 23, 29]
    assert chosen_layers(None, 5, 30) == [0, 7, 15, 22, 29]
    assert chosen_layers(None, 1, 30) == [0] and chosen_layers(None, 30, 30) == list(range(30))
    assert chosen_layers([2, 5], None, 30) == [2, 5]
    with pytest.raises(ValueError, match=r"draft_model.layers: layer 31 does not exist; the target has 30 layers "
                                         r"\(0..29\)"):
        chosen_layers([0, 31], None, 30)
    with pytest.raises(ValueError, match=r"num_layers: expected 1..30 \(the target has 30 layers\), found 31"):
        chosen_layers(None, 31, 30)
    with pytest.raises(ValueError, match="strictly increasing"):
        build_student(tiny_model("llama"), [1, 0])


def test_recipe_checks_the_draft_model_section():
    bad = {("draft_model.layers=[0,3]",): "expected layers or num_layers, found both",
           ("draft_model.num_layers=0",): "draft_model.num_layers: expected null or a value >= 1, found 0",
           ("draft_model.num_layers=null", "draft_model.layers=[]"): "expected a non-empty list of layer indices",
           ("draft_model.num_layers=null", "draft_model.layers=[-1,2]"): "expected a non-empty list of layer indices",
           ("draft_model.num_layers=null", "draft_model.layers=[3,1]"): r"strictly increasing .*, found \[3, 1\]",
           ("draft_model.num_layers=null",): "needs draft_model.layers .* or draft_model.num_layers .*, found neither",
           ("draft_model.draft_vocab=-1",): "draft_model.draft_vocab: expected 0 .* or a size >= 1, found -1"}
    for overrides, message in bad.items():
        with pytest.raises(ValueError, match=message):
            load_config(TINY, list(overrides))
    cfg = load_config(TINY, ["draft_model.num_layers=null", "draft_model.layers=[1,2]"])
    assert cfg.draft_model.layers == [1, 2] and cfg.final_dir == Path("runs/draft-model-tiny/draft_model")
    smollm2 = load_config(REPO / "configs/draft_model_smollm2.yaml")
    assert smollm2.method == "draft_model" and smollm2.loss.kind == "kl" and not smollm2.draft_model.train_embeddings
    assert chosen_layers(smollm2.draft_model.layers, smollm2.draft_model.num_layers, 30) == [0, 6, 12, 17, 23, 29]
    lines = (REPO / "configs/draft_model_smollm2.yaml").read_text().splitlines()
    assert lines[1] == "#   python train.py --config configs/draft_model_smollm2.yaml"
    with pytest.raises(ValueError, match="layer 4 does not exist; the target has 4 layers"):  # checked at build
        DraftModelKind().build(load_config(TINY, ["draft_model.num_layers=null", "draft_model.layers=[0,4]"]),
                               load_base(cfg.model)[0])


# ------------------------------------------------------------------------------------------ the objective
def batch_of(vocab: int) -> dict:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[1, 20:] = IGNORE_INDEX  # padding
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "lengths": torch.tensor([24, 20]),
            "index": torch.tensor([0, 1])}


def test_the_loss_is_zero_for_the_target_itself_and_scores_the_trained_positions():
    cfg = load_config(TINY, ["draft_model.num_layers=4"])  # every layer: the student is the target
    base, _ = load_base(cfg.model)
    kind = DraftModelKind()
    module, _ = kind.build(cfg, base)
    module.eval()
    batch = batch_of(base.config.vocab_size)
    hidden = final_hidden(base, batch["input_ids"], batch["attention_mask"])  # [B, T, D]
    out = kind.loss(cfg, module, hidden, None, batch, ranks=5)
    # position t is scored where labels[t + 1] is trained: t = 4..22 in row 0, 4..18 in row 1
    assert out.count.tolist() == [19 + 15] and out.per_head.abs().max() < 1e-5 and out.top1.item() == 1.0
    rows = kind.loss(cfg, module, hidden, None, batch, ranks=5, per_row=True)
    assert [r.count.item() for r in rows] == [19, 15]


def test_the_loss_falls_on_a_repeated_batch():
    """20 AdamW steps of the kind's loss on one batch, a 2-layer student of a 4-layer target with spread logits."""
    cfg = load_config(TINY, ["model.config.initializer_range=0.3"])
    base, _ = load_base(cfg.model)
    kind = DraftModelKind()
    module, facts = kind.build(cfg, base)
    assert facts.layers == [0, 3] and isinstance(module, Distillation)
    assert all(k.startswith("student.") for k in module.state_dict())  # the target is held, never stored
    batch = batch_of(base.config.vocab_size)
    hidden = final_hidden(base, batch["input_ids"], batch["attention_mask"])  # [B, T, D]
    losses = losses_over_steps(lambda: kind.loss(cfg, module, hidden, None, batch, ranks=5), module.parameters())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0], losses
    ce = kind.loss(load_config(TINY, ["loss.kind=ce"]), module, hidden, None, batch, ranks=0)
    assert torch.isfinite(ce.total) and ce.hits.shape == (1, 0)


# ------------------------------------------------------------------------------------------ saving, train.py
def test_save_writes_a_transformers_directory_atomically_that_loads_to_the_same_logits(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    student = build_student(model, [1])
    with torch.no_grad():
        hf.decoder_layers(student)[0].mlp.up_proj.weight.mul_(2.0)  # trained: no longer the target's layer
    facts = Distilled("tiny", "abc123", [1], 2, False, None)
    directory = tmp_path / "draft"
    directory.mkdir()
    (directory / "notes.txt").write_text("kept")  # an existing directory's other files stay
    save_draft_model(directory, student, student.state_dict(), facts, 0.5)
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits(loaded, ids), logits(student.eval(), ids))
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()  # tied as the target
    assert (directory / "notes.txt").read_text() == "kept" and not list(tmp_path.glob(".draft.tmp-*"))
    card = (directory / "README.md").read_text()
    assert "revision abc123" in card and "layers [1] (of 2)" in card and "0.500" in card


LOAD_PLAIN = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
assert not [m for m in sys.modules if m.split(".")[0] in ("heads", "selfspec")]
print(json.dumps({"layers": len(model.model.layers), "vocab": len(tokenizer), "eos": tokenizer.eos_token}))
"""


def test_train_py_distils_a_draft_model_that_resumes_exactly_and_loads_without_selfspec(tmp_path):
    common = ["--config", "configs/draft_model_tiny.yaml", "optim.scheduler=constant_with_warmup", "optim.epochs=100",
              "logging.every=1", "eval.every=0", "checkpoint.every=3"]
    out = train_and_check_resume(tmp_path, common) / "draft_model"
    done = subprocess.run([sys.executable, "-c", LOAD_PLAIN, str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    target, tokenizer = load_base(load_config(TINY).model)
    assert json.loads(done.stdout) == {"layers": 2, "vocab": len(tokenizer), "eos": tokenizer.eos_token}
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["selfspec_target"] == "tiny-random-llama"
    assert config["selfspec_layers"] == [0, 3] and 0.0 <= config["selfspec_top1_agreement"] <= 1.0
    vocab = config["selfspec_draft_vocab"]  # the 40 most frequent training tokens, end of turn among them
    assert len(vocab) == 40 == len(set(vocab)) and vocab == sorted(vocab) and tokenizer.eos_token_id in vocab
    card = (out / "README.md").read_text()
    assert "# Draft model for tiny-random-llama" in card and f"--draft model:{out}" in card
    student = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(student.get_input_embeddings().weight, target.get_input_embeddings().weight)  # frozen copies
    trained, copied = hf.decoder_layers(student)[1], hf.decoder_layers(target)[3]  # student layer 1: target layer 3
    assert not torch.equal(trained.mlp.up_proj.weight, copied.mlp.up_proj.weight)
    assert not list((tmp_path / "full" / "draft_model").glob("events.out.tfevents*"))  # logs go beside, not inside


def test_deepspeed_zero3_builds_the_student_from_the_target_and_saves_it_whole(tmp_path):
    """Under ZeRO-3 transformers builds the student partitioned (zero.Init): the target's weights are loaded into its
    gathered parameters (``whole``), so the run starts from them and saves a whole model."""
    out = tmp_path / "ds3"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/deepspeed_zero3.yaml",
           "train.py", "--config", "configs/draft_model_tiny.yaml", f"output_dir={out}", "optim.max_steps=2",
           "checkpoint.every=0", "eval.every=0", "logging.log_with=[]"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    student = AutoModelForCausalLM.from_pretrained(out / "draft_model")
    target, _ = load_base(load_config(TINY).model)
    assert torch.equal(student.get_input_embeddings().weight, target.get_input_embeddings().weight)  # frozen copies


def test_add_vocab_gives_a_draft_model_a_draft_vocabulary_in_its_config(tmp_path, capsys):
    """``python -m heads.add_vocab DIR`` on a draft model directory: the vocabulary lands in config.json, the rest of
    the directory is untouched, and --draft model:DIR drafts from it."""
    from heads import add_vocab
    from selfspec.drafts.draft_model_load import load_model_drafter
    from selfspec.core.target import Target

    target, tokenizer = load_base(load_config(TINY).model)
    student = build_student(target, [0], train_embeddings=False)
    student.config.selfspec_target = "tiny-random-llama"
    student.save_pretrained(tmp_path / "dm")
    tokenizer.save_pretrained(tmp_path / "dm")
    weights = (tmp_path / "dm" / "model.safetensors").read_bytes()
    data = str(REPO / "configs" / "data" / "tiny_chat.jsonl")
    assert add_vocab.main([str(tmp_path / "dm"), "--size", "30", "--source", data]) == 0
    assert "draft model checkpoint now drafts from the 30 tokens" in capsys.readouterr().out
    config = json.loads((tmp_path / "dm" / "config.json").read_text())
    assert len(config["selfspec_draft_vocab"]) == 30 and config["num_hidden_layers"] == 1
    assert (tmp_path / "dm" / "model.safetensors").read_bytes() == weights
    drafter = load_model_drafter(tmp_path / "dm", Target(target))
    assert drafter.draft_vocab.tolist() == config["selfspec_draft_vocab"]
