"""Checkpoints other tools write and read: FasterDecoding Medusa imports, vLLM Medusa exports (checked by loading back).

The reference forwards below are written from the two projects' code, independently of heads/:
FasterDecoding: head = Sequential(*[ResBlock] * L, Linear(D, V, bias=False)), ResBlock(x) = x + SiLU(W x + b);
vLLM: ResidualBlock(x) = for each layer: x = x + SiLU(layer(x)); logits = lm_heads[i](blocks[i](x)).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, reference, tiny_model
from huggingface_hub import CommitOperationAdd, HfApi
from hub_server import TOKEN, HubServer, use_hub
from safetensors.torch import load_file, save_file
from tiny_chat_model import build

from heads import export as export_cli, import_medusa as import_cli
from heads.medusa.config import MedusaConfig
from heads.medusa.drafter import MedusaDrafter, load_drafter
from heads.medusa.fasterdecoding import import_medusa
from heads.medusa.model import MedusaHeads
from heads.medusa.vllm import export_vllm, heads_from_vllm, read_vllm
from selfspec import Target, Tree
from selfspec.core.generate import generate

K, L = 3, 2  # heads, residual blocks per head


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def references(llama):
    return [(p, reference(llama, p, 12)) for p in random_prompts(4, llama.config.vocab_size, seed=3)]


# ------------------------------------------------------------------------------------------ FasterDecoding Medusa
def medusa_state(model, seed: int = 0, distinct_layers: bool = False) -> dict[str, torch.Tensor]:
    """A FasterDecoding state dict: per head one ResBlock stored under every layer index ([ResBlock] * L; or distinct
    blocks, which catch a layer-order mix-up), and a perturbed copy of the LM head as the head's own projection."""
    g = torch.Generator().manual_seed(seed)
    d = model.config.hidden_size
    state = {}
    for h in range(K):
        for i in range(L):
            if i == 0 or distinct_layers:
                weight, bias = torch.randn(d, d, generator=g) * 0.05, torch.randn(d, generator=g) * 0.05
            state[f"{h}.{i}.linear.weight"], state[f"{h}.{i}.linear.bias"] = weight, bias
        lm_head = model.lm_head.weight.detach()
        state[f"{h}.{L}.weight"] = lm_head + torch.randn(lm_head.shape, generator=g) * 0.01
    return state


def medusa_logits(state: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """FasterDecoding's forward of the stored heads: hidden [S, D] -> [K, S, V]."""
    out = []
    for h in range(K):
        x = hidden
        for i in range(L):
            x = x + F.silu(F.linear(x, state[f"{h}.{i}.linear.weight"], state[f"{h}.{i}.linear.bias"]))
        out.append(F.linear(x, state[f"{h}.{L}.weight"]))
    return torch.stack(out)


def write_medusa(directory: Path, state: dict, kind: str, config: dict | None) -> Path:
    directory.mkdir(parents=True)
    if kind == "safetensors":
        save_file({k: t.clone().contiguous() for k, t in state.items()}, str(directory / "medusa_lm_head.safetensors"))
    elif kind == "pt":
        torch.save(state, directory / "medusa_lm_head.pt")  # shared tensors, as [ResBlock] * L stores them
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


CONFIG = {"medusa_num_heads": K, "medusa_num_layers": L, "base_model_name_or_path": "tiny-llama",
          "transformers_version": "4.33.1"}


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_imported_medusa_heads_compute_medusas_logits_and_decode_exactly(llama, references, tmp_path, kind):
    state = medusa_state(llama, distinct_layers=kind == "safetensors")
    source = write_medusa(tmp_path / "medusa", state, kind, CONFIG)
    out = import_medusa(source, tmp_path / "imported")
    heads = MedusaHeads.from_pretrained(out, llama)
    assert heads.config.num_heads == K and heads.config.num_layers == L and heads.config.projection == "own"
    assert heads.config.base_model == "tiny-llama" and heads.config.recipe["format"] == "FasterDecoding Medusa-1"
    hidden = torch.randn(5, llama.config.hidden_size)
    torch.testing.assert_close(heads(hidden), medusa_logits(state, hidden), rtol=0, atol=0)

    drafter = load_drafter(out, Target(llama), tree=Tree.full([2, 2, 1]))
    for prompt, expected in references:
        assert generate(Target(llama), drafter, prompt, max_new_tokens=12).tokens == expected


def test_config_that_disagrees_with_the_tensors_trusts_the_tensors_and_says_so(llama, tmp_path, caplog):
    source = write_medusa(tmp_path / "medusa", medusa_state(llama), "safetensors", {**CONFIG, "medusa_num_heads": 2})
    with caplog.at_level(logging.WARNING, logger="heads.medusa.fasterdecoding"):
        out = import_medusa(source, tmp_path / "imported")
    said = f"config.json says medusa_num_heads=2 but the weights store {K} heads: trusting the weights ({K} heads)"
    assert said in caplog.text
    assert MedusaHeads.from_pretrained(out, llama).config.num_heads == K

    caplog.clear()
    bare = write_medusa(tmp_path / "bare", medusa_state(llama), "pt", {"base_model_name_or_path": "tiny-llama"})
    with caplog.at_level(logging.WARNING, logger="heads.medusa.fasterdecoding"):
        import_medusa(bare, tmp_path / "imported-bare")
    assert f"has no medusa_num_heads: using the {K} heads stored in the weights" in caplog.text
    assert f"has no medusa_num_layers: using the {L} layers per head stored in the weights" in caplog.text


class NotATensor:
    pass


def test_bad_medusa_checkpoints_are_refused(llama, tmp_path):
    state = medusa_state(llama)
    with pytest.raises(FileNotFoundError, match="has neither medusa_lm_head.safetensors nor medusa_lm_head.pt"):
        import_medusa(write_medusa(tmp_path / "empty", {}, "none", CONFIG), tmp_path / "x")
    with pytest.raises(ValueError, match=r"unexpected keys \['0.0.extra'\]"):
        extra = {**state, "0.0.extra": torch.zeros(1)}
        import_medusa(write_medusa(tmp_path / "extra", extra, "pt", CONFIG), tmp_path / "x")
    uneven = {k: v for k, v in state.items() if not k.startswith("2.")}
    uneven |= {"2.0.linear.weight": state["0.0.linear.weight"], "2.0.linear.bias": state["0.0.linear.bias"],
               "2.1.weight": state[f"0.{L}.weight"]}
    with pytest.raises(ValueError, match=r"heads have different numbers of layers \[1, 2\]"):
        import_medusa(write_medusa(tmp_path / "uneven", uneven, "pt", CONFIG), tmp_path / "x")
    no_bias = {k: v for k, v in state.items() if k != "1.1.linear.bias"}
    holds = r"head 1 holds .*expected residual blocks 0..1 \(linear.weight \+ linear.bias\)"
    with pytest.raises(ValueError, match=holds):
        import_medusa(write_medusa(tmp_path / "no-bias", no_bias, "pt", CONFIG), tmp_path / "x")
    with pytest.raises(ValueError, match="names no base_model_name_or_path: pass the base model"):
        import_medusa(write_medusa(tmp_path / "no-base", state, "pt", {"medusa_num_heads": K}), tmp_path / "x")
    assert import_medusa(tmp_path / "no-base", tmp_path / "named", base_model="tiny-llama").is_dir()
    pickled = write_medusa(tmp_path / "pickled", {}, "none", CONFIG)
    torch.save({"0.0.linear.weight": NotATensor()}, pickled / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="could not be read safely.*weights_only=True"):
        import_medusa(pickled, tmp_path / "x")
    assert not (tmp_path / "x").exists()  # nothing half-written


def test_import_from_a_hub_id_and_the_cli(llama, tmp_path, monkeypatch, capsys):
    state = medusa_state(llama)
    source = write_medusa(tmp_path / "medusa", state, "safetensors", CONFIG)
    with HubServer() as hub:
        use_hub(monkeypatch, hub, tmp_path / "hf-home")
        api = HfApi(token=TOKEN)
        api.create_repo("tester/medusa-tiny")
        api.create_commit("tester/medusa-tiny", commit_message="FasterDecoding layout", operations=[
            CommitOperationAdd(p.name, str(p)) for p in source.iterdir()])
        assert import_cli.main(["tester/medusa-tiny", str(tmp_path / "from-hub")]) == 0
    assert capsys.readouterr().out == f"imported tester/medusa-tiny -> {tmp_path / 'from-hub'}\n"
    heads = MedusaHeads.from_pretrained(tmp_path / "from-hub", llama)
    hidden = torch.randn(3, llama.config.hidden_size)
    assert torch.equal(heads(hidden), medusa_logits(state, hidden))
    assert import_cli.main([str(tmp_path / "missing"), str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err == (f"error: the directory {tmp_path / 'missing'} does not exist: expected a local "
                                       "checkpoint directory (or a Hub repo id 'owner/name'); check the path\n")


# ------------------------------------------------------------------------------------------------ vLLM export
def vllm_logits(config: dict, tensors: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa forward + compute_logits on the exported files: hidden [S, D] -> [K, S, V]."""
    out = []
    for i in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            bias = tensors[f"blocks.{i}.layers.{j}.bias"] if config["medusa_fc_bias"] else None
            x = x + F.silu(F.linear(x, tensors[f"blocks.{i}.layers.{j}.weight"], bias))
        out.append(F.linear(x, tensors[f"lm_heads.{0 if config['original_lm_head'] else i}.weight"]))
    return torch.stack(out)


def trained(model, projection: str, seed: int = 0) -> MedusaHeads:
    config = MedusaConfig.for_model(model, base_model="tiny-llama", num_heads=K, num_layers=L, projection=projection,
                                    lora_rank=4)
    heads = MedusaHeads(config, model.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return heads


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_vllm_export_has_vllms_names_and_computes_the_same_logits(llama, references, tmp_path, projection):
    heads = trained(llama, projection)
    out = export_vllm(heads, tmp_path / "vllm")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vllm"]  # no temporary directory left behind
    config = json.loads((out / "config.json").read_text())
    d, v = llama.config.hidden_size, llama.config.vocab_size
    assert config == {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": d, "vocab_size": v,
                      "truncated_vocab_size": v, "num_heads": K, "num_hidden_layers": L, "medusa_fc_bias": True,
                      "original_lm_head": False, "torch_dtype": "float32", "base_model_name_or_path": "tiny-llama"}
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]  # vLLM renames any other "num" key
    tensors = load_file(out / "model.safetensors")
    blocks = {f"blocks.{i}.layers.{j}.{w}" for i in range(K) for j in range(L) for w in ("weight", "bias")}
    assert set(tensors) == blocks | {f"lm_heads.{i}.weight" for i in range(K)}
    for i, head in enumerate(heads.heads):
        assert torch.equal(tensors[f"blocks.{i}.layers.1.bias"], head.blocks[1].linear.bias)
    if projection == "shared":
        assert all(torch.equal(tensors[f"lm_heads.{i}.weight"], llama.lm_head.weight) for i in range(K))
    if projection == "own":
        assert all(torch.equal(tensors[f"lm_heads.{i}.weight"], heads.heads[i].proj.weight) for i in range(K))

    hidden = torch.randn(6, d)
    with torch.no_grad():
        want = heads(hidden)
    exact = projection != "lora"  # a merged LoRA rounds differently from base + delta
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(vllm_logits(config, tensors, hidden), want, **tol)
    back = heads_from_vllm(out, llama.lm_head)
    with torch.no_grad():
        torch.testing.assert_close(back(hidden), want, **tol)

    drafter = MedusaDrafter(back, Tree.full([2, 2, 1]))
    for prompt, expected in references[:2]:
        assert generate(Target(llama), drafter, prompt, max_new_tokens=12).tokens == expected


def test_vllm_export_with_one_shared_lm_head(llama, tmp_path):
    heads = trained(llama, "shared")
    out = export_vllm(heads, tmp_path / "vllm", original_lm_head=True)
    config, tensors = read_vllm(out)
    assert config["original_lm_head"] is True
    assert [k for k in tensors if k.startswith("lm_heads")] == ["lm_heads.0.weight"]
    hidden = torch.randn(4, llama.config.hidden_size)
    torch.testing.assert_close(vllm_logits(config, tensors, hidden), heads(hidden).detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="original_lm_head shares the base LM head.*'own' projection"):
        export_vllm(trained(llama, "own"), tmp_path / "own", original_lm_head=True)


def test_exports_vllm_cannot_load_are_refused(llama, tmp_path):
    biased = torch.nn.Linear(llama.config.hidden_size, llama.config.vocab_size, bias=True)
    heads = MedusaHeads(MedusaConfig.for_model(llama, base_model="tiny-llama"), biased)
    with pytest.raises(ValueError, match="vLLM's Medusa lm_heads have no bias, but the base model's LM head has one"):
        export_vllm(heads, tmp_path / "x")
    assert not (tmp_path / "x").exists()

    out = export_vllm(trained(llama, "shared"), tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    ignored = r"medusa_fc_bias=False.*unexpected \['blocks.0.layers.0.bias'.*vLLM would ignore"
    with pytest.raises(ValueError, match=ignored):
        read_vllm(out)
    (out / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": 10}))
    with pytest.raises(ValueError, match="truncated vocabulary"):
        read_vllm(out)


def test_export_cli(tmp_path, capsys):
    model_dir = build(tmp_path / "model")
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    trained(model, "lora").save_pretrained(tmp_path / "heads")
    assert export_cli.main([str(tmp_path / "heads"), str(tmp_path / "vllm"), "--model", str(model_dir)]) == 0
    assert "in vLLM's Medusa format" in capsys.readouterr().out
    assert read_vllm(tmp_path / "vllm")[0]["num_heads"] == K
    assert export_cli.main([str(tmp_path / "heads"), str(tmp_path / "v2"), "--model", str(model_dir),
                            "--original-lm-head"]) == 2
    assert "error: original_lm_head shares the base LM head" in capsys.readouterr().err
    for cli in (export_cli, import_cli):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--help"])
        assert exit_.value.code == 0
    assert "usage: python -m heads.export" in capsys.readouterr().out


def test_tools_refuse_output_directories_that_are_not_theirs(llama, tmp_path, capsys):
    model_dir = build(tmp_path / "model")
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    heads_dir = trained(model, "own").save_pretrained(tmp_path / "heads")
    source = write_medusa(tmp_path / "medusa", medusa_state(llama), "safetensors", CONFIG)
    before = {d: {p.name: p.read_bytes() for p in d.iterdir()} for d in (model_dir, heads_dir)}
    capsys.readouterr()
    refused = {
        (export_cli, str(heads_dir), str(heads_dir)): f"{heads_dir} is the checkpoint being exported: exporting onto "
            "it would overwrite its config.json and model.safetensors; choose another output path",
        (export_cli, str(heads_dir), str(model_dir)): f"the output directory {model_dir} already holds a transformers "
            "model directory, not a vLLM Medusa export; writing there would overwrite its files: choose another path "
            "or delete it",
        (import_cli, str(source), str(model_dir)): f"the output directory {model_dir} already holds a transformers "
            "model directory, not a selfspec medusa checkpoint; writing there would overwrite its files: choose "
            "another path or delete it",
        (import_cli, str(source), str(source)): f"the output directory {source} already holds a FasterDecoding Medusa "
            "checkpoint, not a selfspec medusa checkpoint; writing there would overwrite its files: choose another "
            "path or delete it",
        (import_cli, str(heads_dir), str(tmp_path / "new")): f"{heads_dir} holds a selfspec medusa checkpoint, not a "
            "FasterDecoding Medusa checkpoint (it has neither medusa_lm_head.safetensors nor medusa_lm_head.pt); "
            "heads.import_medusa converts FasterDecoding's format: it is selfspec's own format already, use it as it is",
    }
    for (cli, src, out), message in refused.items():
        extra = ["--model", str(model_dir)] if cli is export_cli else ["--base-model", "tiny-llama"]
        assert cli.main([src, out, *extra]) == 2, (src, out)
        assert capsys.readouterr().err == f"error: {message}\n"
    assert {d: {p.name: p.read_bytes() for p in d.iterdir()} for d in (model_dir, heads_dir)} == before
    assert not (tmp_path / "new").exists()

    # each tool's own earlier output (and an empty directory) may be written over
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "vllm", tmp_path / "vllm", tmp_path / "empty"):
        assert export_cli.main([str(heads_dir), str(out), "--model", str(model_dir)]) == 0
    assert import_cli.main([str(source), str(tmp_path / "imported"), "--base-model", "tiny-llama"]) == 0
    assert import_cli.main([str(source), str(tmp_path / "imported"), "--base-model", "tiny-llama"]) == 0
