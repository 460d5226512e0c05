"""EAGLE-3 and DFlash drafts in the format of vLLM's speculators library (heads/eagle/eagle3.py, heads/block/dflash.py,
heads/speculators_export.py), proved by the other side: speculators==0.9.0's own loader and draft model, run in a venv of its
own (its pins, transformers <= 5.19 and datasets <= 5.1, conflict with selfspec's), read what selfspec exports (random
drafts, and drafts trained by train.py's eagle3 and dflash methods) and compute the same draft logits and tokens as
selfspec's drafters on the same target features.

The venv is created once per machine under selfspec's cache (heads/speculators_check.py ``SPECULATORS_VENV``; ~2
minutes the first time, from the local package registries) and reused; the cross-check then costs one subprocess (~15 s, most of it importing
speculators) for all cases. Those tests are marked ``index``: where the venv cannot be created (pip fails), they fail
in one line quoting pip, never skip; a venv that installs but cannot import speculators fails too.

Tolerance (fp32): draft logits agree to 1e-4 (absolute and relative; measured differences are ~1e-6, rounding from
speculators' positions starting at 1 where selfspec's start at 0, which RoPE cancels only up to rounding), and their
top tokens and the drafted chain agree exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_prompts, reference, spread_weights, tiny_model
from safetensors.torch import load_file, save_file
from tiny_chat_model import build_tokenizer
from transformers import Qwen3Config

from heads import export as export_cli
from heads.block.dflash import DFlashHead
from heads.block.dflash_config import DFlashConfig, qwen3_layers_for
from heads.draft_types import push_folder
from heads.eagle.eagle3 import Eagle3Head
from heads.eagle.speculators_config import Eagle3Config, llama_layers_for
from heads.speculators_export import refuse
from heads.speculators_check import ATOL, RTOL, VenvError, dflash_side, eagle3_side, run_speculators
from heads.speculators_check import speculators_python as venv_python
from selfspec import registry
from selfspec.base_check import check_drafts
from selfspec.core.generate import generate
from selfspec.core.models import resolve as resolve_model
from selfspec.core.target import Target

STEPS = 3  # drafted tokens compared per chain (speculators' ttt_steps)


def speculators_python() -> Path:
    """The speculators venv (heads/speculators_check.py); where it cannot be created, the test fails in one line quoting
    pip (it needs the package index once: a skip would let a run without the check look green)."""
    try:
        return venv_python()
    except VenvError as err:
        pytest.fail(f"the speculators venv could not be created (needs the package index once): {err}", pytrace=False)


# ----------------------------------------------------------------------------------------------------- the cases
def qwen3_layers(num_layers: int = 1) -> dict:
    """transformer_layer_config of Qwen3 layers (per-head q/k norms), the other layer kind speculators builds."""
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    out = config.to_dict()
    for name in ("architectures", "dtype", "transformers_version", "output_hidden_states", "return_dict"):
        out.pop(name, None)
    return out


CASES = {
    # a Llama target, Llama layers, every flag at its default, 3 aux layers (what vLLM's fc takes)
    "llama": dict(arch="llama", layers=4, aux=[1, 2, 3], flags={}, draft_vocab=64, own_embedding=False),
    # a Qwen2 target (attention biases), 2 draft layers, aux layers out of order, the three norm options
    "qwen2": dict(arch="qwen2", layers=4, aux=[3, 1, 2], draft_layers=2, draft_vocab=64, own_embedding=False,
                  flags=dict(norm_before_residual=True, norm_output=True, fc_norm=True)),
    # speculators' default aux layers ([2, L // 2, L - 3]), Qwen3 layers, one norm over the fused states, the whole
    # vocabulary (no d2t / t2d) and the draft's own embeddings
    "qwen3-layers": dict(arch="llama", layers=8, aux=None, flags=dict(norm_before_fc=True), draft_vocab=96,
                         own_embedding=True, layer_kind="qwen3"),
}


TRAINED = "trained"
"""the case of a draft trained by train.py (method eagle3) on the tiny recipe's target, then exported."""
COMPARED = [*CASES, TRAINED]


TRAIN_ARGS = {
    "eagle3": ["method=eagle3", "eagle.draft_vocab=64", "eagle.feature_layers=[0,1]", "eagle.feature_weight=0",
               "eagle.depth=3"],
    "dflash": ["method=dflash", "block.draft_vocab=64", "block.feature_layers=[0,1]", "block.block_size=3",
               "block.anchors=8"],
}


def trained_draft(root: Path, method: str = "eagle3"):
    """train.py ``method`` (eagle3 or dflash) for a few steps on configs/medusa_tiny.yaml's target, exported with
    heads.export naming the target's saved directory as the verifier (speculators' loader reads it): (target, the
    export loaded back)."""
    from heads.training.base_model import load_base
    from heads.training.config import ModelConfig

    model, tokenizer = load_base(ModelConfig(name="tiny-random-llama"))
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    done = subprocess.run([sys.executable, "train.py", "--config", "configs/medusa_tiny.yaml", *TRAIN_ARGS[method],
                           "optim.max_steps=4", "eval.every=0", "logging.log_with=[]", f"output_dir={root / 'run'}"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert export_cli.main([str(root / "run" / f"{method}_head"), str(root / "draft"), "--format", "speculators",
                            "--model", str(root / "target"), "--verifier", str(root / "target")]) == 0
    cls = Eagle3Head if method == "eagle3" else DFlashHead
    return model, cls.from_pretrained(root / "draft", model)


DFLASH_CASES = {
    # a Llama target, 3 aux layers, a draft vocabulary, blocks of 4 drafted tokens
    "llama": dict(arch="llama", layers=4, aux=[1, 2, 3], draft_vocab=64, block=4, draft_layers=1),
    # a Qwen2 target, speculators' default aux layers, the whole vocabulary (no lm_head stored), 2 layers, blocks of 3
    "qwen2": dict(arch="qwen2", layers=8, aux=None, draft_vocab=96, block=3, draft_layers=2),
}
DFLASH_COMPARED = [*DFLASH_CASES, TRAINED]


def make_dflash(case: dict, model, verifier: Path, seed: int = 0) -> DFlashHead:
    """A random DFlash draft on ``model``, built by selfspec."""
    config = DFlashConfig(transformer_layer_config=qwen3_layers_for(model, case["draft_layers"]),
                          draft_vocab_size=case["draft_vocab"], block_size=case["block"] + 1, mask_token_id=5,
                          verifier=str(verifier), verifier_architectures=list(model.config.architectures or []),
                          aux_hidden_state_layer_ids=case["aux"])
    torch.manual_seed(seed)
    head = DFlashHead.on_base(config, model)
    spread_weights(head, keep=("lm_head.weight",))
    if case["draft_vocab"] < 96:
        head.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(seed))[: case["draft_vocab"]])
    head.init_lm_head()
    return head.eval()


def target_for(case: dict, directory: Path):
    overrides = {"num_hidden_layers": case["layers"]}
    if case["arch"] == "qwen2":
        overrides["layer_types"] = ["full_attention"] * case["layers"]
    model = tiny_model(case["arch"], initializer_range=0.1, **overrides)
    model.save_pretrained(directory)  # the verifier speculators' loader reads (config, embeddings)
    build_tokenizer().save_pretrained(directory)  # a model directory as users have them (heads.export loads one)
    return model


def make_draft(case: dict, model, verifier: Path, seed: int = 0) -> Eagle3Head:
    """A random EAGLE-3 draft in speculators' architecture on ``model``, built by selfspec."""
    layers = (qwen3_layers(case.get("draft_layers", 1)) if case.get("layer_kind") == "qwen3"
              else llama_layers_for(model, case.get("draft_layers", 1)))
    config = Eagle3Config(transformer_layer_config=layers, draft_vocab_size=case["draft_vocab"], verifier=str(verifier),
                          verifier_architectures=list(model.config.architectures or []),
                          eagle_aux_hidden_state_layer_ids=case["aux"], speculative_tokens=STEPS, **case["flags"])
    torch.manual_seed(seed)
    head = Eagle3Head.on_base(config, model, own_embedding=case["own_embedding"])
    spread_weights(head)
    head.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(seed))[: case["draft_vocab"]])
    return head.eval()


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """Every case exported by selfspec, then loaded and run by speculators in its venv (one subprocess):
    {"eagle3" | "dflash": {name: (selfspec's side, speculators' outputs)}}."""
    python = speculators_python()
    root = tmp_path_factory.mktemp("speculators")
    ours, cases = {}, []
    prompt = random_prompts(1, 96, seed=7, min_len=12, max_len=12)[0]
    for kind, names in (("eagle3", COMPARED), ("dflash", DFLASH_COMPARED)):
        for name in names:
            where = root / kind / name
            if name == TRAINED:
                model, head = trained_draft(where, kind)
            elif kind == "eagle3":
                model = target_for(CASES[name], where / "target")
                head = make_draft(CASES[name], model, where / "target")
                head.save_pretrained(where / "draft")
            else:
                model = target_for(DFLASH_CASES[name], where / "target")
                head = make_dflash(DFLASH_CASES[name], model, where / "target")
                head.save_pretrained(where / "draft")
            ours[kind, name] = dict(eagle3_side(head, model, prompt, STEPS) if kind == "eagle3" else
                                    dflash_side(head, model, prompt), head=head)
            cases.append((where / "draft", ours[kind, name], STEPS))
    theirs = run_speculators(python, cases, root)
    out: dict[str, dict] = {"eagle3": {}, "dflash": {}}
    for (kind, name), result in zip(ours, theirs):
        out[kind][name] = (ours[kind, name], result)
    return out


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """speculators' logits ``got`` are selfspec's ``want`` within ATOL / RTOL, with the same top tokens."""
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")
    print(f"{what}: max |logit difference| {float((got - want).abs().max()):.2e}")
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{what}: top tokens differ"


def assert_same_vocab(head, theirs: dict) -> None:
    """speculators loaded the draft vocabulary selfspec saved (d2t), where the head has one."""
    if head.d2t is not None:
        assert torch.equal(theirs["d2t"], head.d2t)


@pytest.mark.index
@pytest.mark.parametrize("name", COMPARED)
def test_speculators_computes_the_draft_logits_selfspec_computes(compared, name):
    """speculators' loader and model on selfspec's export: the same draft logits at every pair and chain step, the
    same top tokens, the same draft vocabulary."""
    ours, theirs = compared["eagle3"][name]
    n = ours["logits"].shape[1]
    for u in range(STEPS):  # step u at pair i (speculators keeps the pair's index across steps)
        assert_same_logits(theirs["logits"][u, :n], ours["logits"][u], f"{name} step {u}")
    assert_same_vocab(ours["head"], theirs)


@pytest.mark.index
@pytest.mark.parametrize("name", COMPARED)
def test_speculators_drafts_the_tokens_selfspec_drafts(compared, name):
    """The chain selfspec's EagleDrafter drafts after the prompt is speculators' greedy chain at the last pair (fed
    the same tokens), mapped to target ids through the d2t speculators loaded."""
    ours, theirs = compared["eagle3"][name]
    n = ours["logits"].shape[1]
    top = theirs["logits"][:, n - 1].argmax(-1)  # [STEPS] draft-vocabulary indices
    target_ids = top if ours["head"].d2t is None else top + theirs["d2t"][top]
    assert target_ids.tolist() == ours["drafted"].tolist()


@pytest.mark.index
@pytest.mark.parametrize("name", DFLASH_COMPARED)
def test_speculators_computes_the_dflash_logits_selfspec_computes(compared, name):
    """speculators' loader and DFlash model on selfspec's export (its anchored-block pass, every position an anchor):
    at every anchor, the block's draft logits are the ones selfspec's drafter computes with that prefix, slot by slot;
    the same top tokens, the same draft vocabulary."""
    ours, theirs = compared["dflash"][name]
    n = ours["logits"].shape[0] - 1
    got = theirs["logits"][1: n + 1, 1:]  # [n, K, V'] anchors 1..n, slots 1..K (slot 0 is the root: not drafted)
    assert_same_logits(got, ours["logits"][1:], f"dflash {name}")
    assert_same_vocab(ours["head"], theirs)


@pytest.mark.index
@pytest.mark.parametrize("name", DFLASH_COMPARED)
def test_speculators_drafts_the_block_selfspec_drafts(compared, name):
    """The chain selfspec's block drafter drafts after the prompt is speculators' block at the last root, greedily,
    mapped to target ids through the d2t speculators loaded."""
    ours, theirs = compared["dflash"][name]
    n = ours["logits"].shape[0] - 1
    top = theirs["logits"][n, 1:].argmax(-1)  # [K]
    target_ids = top if ours["head"].d2t is None else top + theirs["d2t"][top]
    assert target_ids.tolist() == ours["drafted"].tolist()


# ------------------------------------------------------------------------------ selfspec's side (no venv needed)
@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """The llama and qwen2 cases as selfspec makes them: target directory, target, draft directory."""
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for name in ("llama", "qwen2"):
        model = target_for(CASES[name], root / name / "target")
        make_draft(CASES[name], model, root / name / "target").save_pretrained(root / name / "draft")
        out[name] = (root / name / "target", model, root / name / "draft")
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_round_trip_export_then_draft_decodes_like_generate(drafts, name, tmp_path, capsys):
    """selfspec's draft -> heads.export --format speculators (renaming the verifier) -> --draft on the export: the
    registry takes it as an EAGLE draft, the base check reads its verifier, and decoding (the checkpoint's own tree,
    a dynamic tree, a chain) is plain greedy generate's, token for token (fp32)."""
    target_dir, model, draft = drafts[name]
    out = tmp_path / "export"
    assert export_cli.main([str(draft), str(out), "--format", "speculators", "--model", str(target_dir),
                            "--verifier", str(target_dir)]) == 0
    printed = capsys.readouterr()
    assert "in the speculators format" in printed.out
    notes = ["vLLM ignores norm_output=true", "vLLM ignores fc_norm=true"] if name == "qwen2" else []
    assert [line.split("but ")[1].split(":")[0] for line in printed.err.splitlines() if line.startswith("note:")] == notes
    stored = json.loads((out / "config.json").read_text())
    assert stored["speculators_model_type"] == "eagle3" and stored["norm_before_residual"] is CASES[name]["flags"].get(
        "norm_before_residual", False)
    spec = registry.parse_draft(str(out))
    assert spec.kind == "eagle"
    check_drafts(str(target_dir), [spec])
    target = Target(model)
    for tree in (None, "dynamic:8", "chain:3"):
        drafter = registry.build_drafter(registry.with_tree(spec, tree) if tree else spec, target,
                                         registry.parse_tree(tree))
        for prompt in random_prompts(3, 96, seed=11):
            assert generate(target, drafter, prompt, max_new_tokens=20).tokens == reference(model, prompt, 20), tree


def test_a_speculators_draft_is_published_and_drafts_from_its_hub_id(drafts, monkeypatch, tmp_path):
    """heads.publish takes the export as it is (with a card saying how vLLM serves it); --draft OWNER/NAME loads it
    back through the Hub cache and decodes losslessly."""
    from hub_server import HubServer, use_hub

    target_dir, model, draft = drafts["llama"]
    with HubServer() as server:
        use_hub(monkeypatch, server, tmp_path / "hf-home")
        push_folder(draft, "tester/eagle3")
        card = server.files("tester/eagle3", "main")["README.md"].decode()
        assert '"model": "tester/eagle3", "method": "eagle3"' in card
        spec = registry.parse_draft("tester/eagle3")
        drafter = registry.build_drafter(spec, Target(model))
    prompt = random_prompts(1, 96, seed=3)[0]
    assert generate(Target(model), drafter, prompt, max_new_tokens=16).tokens == reference(model, prompt, 16)


def eagle_checkpoint(tmp_path: Path, feature_layers) -> Path:
    from heads.eagle.config import EagleConfig
    from heads.eagle.model import EagleHead

    model = tiny_model("llama")
    head = EagleHead(EagleConfig.for_model(model, draft_vocab_size=64, feature_layers=feature_layers),
                     model.get_input_embeddings(), model.get_output_embeddings())
    return head.save_pretrained(tmp_path / f"eagle-{feature_layers}")


def test_export_refuses_selfspec_eagle_heads_saying_what_differs(tmp_path, capsys):
    """selfspec's own EAGLE heads cannot be written in the format without drafting differently: refused from config.json
    before any model loads, naming each part (EAGLE-1: the missing model first); Medusa heads are pointed to --format
    vllm. Nothing is written."""
    for layers, first in ((None, "features: an EAGLE-1 head"), ([0, 1], "input fusion: selfspec maps")):
        source = eagle_checkpoint(tmp_path, layers)
        assert export_cli.main([str(source), str(tmp_path / "out"), "--format", "speculators"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {source} cannot be exported in the speculators format: the format cannot express "
                              f"it, and a checkpoint that loads but drafts differently is not written. What differs:; - "
                              f"{first}"), err
        for part in ("input fusion:", "residual:", "fed-back state:"):
            assert part in err
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"no model of a selfspec 'medusa' draft .*\(--format vllm\)"):
        refuse({"draft_type": "medusa"}, "runs/medusa")


def broken(draft: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    """A copy of ``draft`` with config.json updated by ``config`` and the tensors by ``tensors`` (None: drop)."""
    out = tmp_path / f"broken-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(draft, out)
    data = {**json.loads((draft / "config.json").read_text()), **(config or {})}
    (out / "config.json").write_text(json.dumps(data))
    state = load_file(str(draft / "model.safetensors"))
    for key, value in (tensors or {}).items():
        state.pop(key) if value is None else state.__setitem__(key, value)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_speculators_checkpoints_are_read_strictly(drafts, tmp_path):
    """What selfspec cannot draft exactly is refused, saying what: another speculators model, layer kinds speculators
    does not build, a fc of another width, tensors missing or out of shape, a d2t out of speculators' order or
    disagreeing with t2d, an aux layer whose state the verifier does not give; a draft for another target too."""
    target_dir, model, draft = drafts["llama"]
    d2t = load_file(str(draft / "model.safetensors"))["d2t"]
    layer = json.loads((draft / "config.json").read_text())["transformer_layer_config"]
    refused = {
        broken(draft, tmp_path, {"speculators_model_type": "dflash"}): "'dflash': expected 'eagle3'",
        broken(draft, tmp_path, {"transformer_layer_config": {**layer, "model_type": "mistral"}}): "llama or qwen3 layers",
        broken(draft, tmp_path, {"target_hidden_size": 64}): "target_hidden_size 64: the draft is 32 wide",
        broken(draft, tmp_path, tensors={"layers.0.hidden_norm.weight": None}): r"missing tensors \['layers.0.hidden_no",
        broken(draft, tmp_path, tensors={"fc.weight": torch.zeros(32, 64)}): r"wrong shapes .*'fc.weight': \(\(32, 96\)",
        broken(draft, tmp_path, tensors={"d2t": d2t.flip(0)}): "d2t .*: expected 64 distinct token ids|increasing order",
        broken(draft, tmp_path, tensors={"t2d": torch.ones(96, dtype=torch.bool)}): "t2d and d2t name different",
        broken(draft, tmp_path, {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}): "id 4 is the last layer's output "
                                                                                  "before the final norm",
    }
    for directory, message in refused.items():
        with pytest.raises(ValueError, match=message):
            Eagle3Head.from_pretrained(directory, model)
    with pytest.raises(ValueError, match="belongs on"):
        Eagle3Head.from_pretrained(draft, tiny_model("llama", vocab=128, num_hidden_layers=4))
    spec = registry.parse_draft(str(broken(draft, tmp_path, {"speculators_config": {
        **json.loads((draft / "config.json").read_text())["speculators_config"],
        "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B", "architectures": []}}})))
    with pytest.raises(ValueError, match="trained for meta-llama/Llama-3.1-8B, but the target is"):
        check_drafts(str(target_dir), [spec])
    with pytest.raises(ValueError, match="a speculators 'mtp' checkpoint; selfspec drafts with speculators' eagle3"):
        registry.parse_draft(str(broken(draft, tmp_path, {"speculators_model_type": "mtp"})))
    with pytest.raises(ValueError, match="is a speculators draft checkpoint, not a model: pass it as the draft"):
        resolve_model(str(draft))


def test_a_draft_without_lm_head_or_t2d_reads_the_targets_rows(drafts, tmp_path):
    """As speculators' loader does: a checkpoint without lm_head takes the target's LM head rows of its draft
    vocabulary (in t2d order), one without t2d derives it from d2t."""
    target_dir, model, draft = drafts["llama"]
    head = Eagle3Head.from_pretrained(broken(draft, tmp_path, tensors={"lm_head.weight": None, "t2d": None}), model)
    full = Eagle3Head.from_pretrained(draft, model)
    tokens = torch.arange(64) + full.d2t
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[tokens])
    assert torch.equal(head.t2d, full.t2d)


def test_exports_carry_the_targets_embeddings_which_load_back_by_reference(drafts):
    """speculators' loader leaves embed_tokens uninitialised when a checkpoint lacks it, so a save writes the target's
    (as speculators' own saves do); selfspec reads them back as the target's, holding no copy."""
    target_dir, model, draft = drafts["llama"]
    assert torch.equal(load_file(str(draft / "model.safetensors"))["embed_tokens.weight"], model.model.embed_tokens.weight)
    head = Eagle3Head.from_pretrained(draft, model)
    assert head.embed_tokens is None and "embed_tokens.weight" not in head.state_dict()
