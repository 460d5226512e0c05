"""Checkpoints: strict and exact save -> load round trips, clear errors for every way a checkpoint can be wrong."""

from __future__ import annotations

import importlib.metadata
import json
import tomllib
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from conftest import tiny_model
from safetensors.torch import load_file, save_file

import heads.checkpoints.files as ckpt
from heads.medusa.card import model_card
from heads.medusa.config import MedusaConfig
from heads.medusa.model import MedusaHeads

RECIPE = {"data": {"source": "sharegpt", "max_length": 512}, "lr": 1e-3}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def trained(model, seed: int = 0, **kwargs) -> MedusaHeads:
    """Heads with random (non-zero) weights everywhere, as if trained."""
    kwargs = {"num_heads": 3, "num_layers": 2, "lora_rank": 4, **kwargs}
    heads = MedusaHeads(MedusaConfig.for_model(model, base_model="tiny-llama", **kwargs), model.lm_head)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


@pytest.mark.parametrize("projection", ["shared", "own", "lora"])
def test_round_trip_is_exact(llama, tmp_path, projection):
    heads = trained(llama, projection=projection, tree=[[0], [1], [0, 0]], head_accuracy=[[0.5, 0.2]] * 3, recipe=RECIPE)
    heads.save_pretrained(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left behind
    stored = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert stored["draft_type"] == "medusa" and stored["selfspec_version"] == ckpt.selfspec_version()
    assert {k: v for k, v in stored.items() if k != "selfspec_version"} == heads.config.to_dict()

    loaded = MedusaHeads.from_pretrained(tmp_path / "ck", llama)
    assert loaded.config == heads.config
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    x = torch.randn(4, 32)
    assert torch.equal(loaded(x), heads(x))
    assert loaded.lm_head is llama.lm_head


def test_bf16_heads_come_back_in_bf16(llama, tmp_path):
    heads = trained(llama).to(torch.bfloat16)
    heads.save_pretrained(tmp_path / "ck")
    loaded = MedusaHeads.from_pretrained(str(tmp_path / "ck"), llama)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert all(torch.equal(heads.state_dict()[k], v) for k, v in loaded.state_dict().items())


def test_saving_over_a_directory_replaces_the_checkpoint_and_keeps_other_files(llama, tmp_path):
    target = tmp_path / "ck"
    trained(llama, seed=0, num_heads=2).save_pretrained(target)
    (target / "notes.txt").write_text("mine")
    second = trained(llama, seed=1, num_heads=4)
    second.save_pretrained(target)
    assert (target / "notes.txt").read_text() == "mine"
    loaded = MedusaHeads.from_pretrained(target, llama)
    assert loaded.config.num_heads == 4
    assert all(torch.equal(second.state_dict()[k], v) for k, v in loaded.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_mismatched_base_is_refused(llama, tmp_path):
    trained(llama).save_pretrained(tmp_path / "ck")
    wide = tiny_model("llama", hidden_size=64)
    with pytest.raises(ValueError, match="heads were trained for hidden size 32, this model has 64.*belong on tiny-llama"):
        MedusaHeads.from_pretrained(tmp_path / "ck", wide)
    other_vocab = tiny_model("llama", vocab=128)
    with pytest.raises(ValueError, match="heads were trained for vocab size 96, this model has 128"):
        MedusaHeads.from_pretrained(tmp_path / "ck", other_vocab)


@pytest.fixture
def saved(llama, tmp_path) -> Path:
    return trained(llama, projection="lora").save_pretrained(tmp_path / "ck")


def test_truncated_safetensors_is_refused(llama, saved):
    file = saved / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors is corrupt or truncated"):
        MedusaHeads.from_pretrained(saved, llama)


def test_changed_bytes_inside_safetensors_are_refused(llama, saved):
    file = saved / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0xFF  # a byte of tensor data: the header still parses
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors is corrupt: its tensors do not match the sha256"):
        MedusaHeads.from_pretrained(saved, llama)


def test_garbage_safetensors_header_is_refused(llama, saved):
    (saved / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        MedusaHeads.from_pretrained(saved, llama)


def _rewrite(saved: Path, change) -> None:
    tensors = load_file(str(saved / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(saved / "model.safetensors"), metadata={"format": "pt"})  # no checksum: a foreign writer


def test_unexpected_tensor_is_refused(llama, saved):
    _rewrite(saved, lambda t: t.update({"heads.0.blocks.0.extra": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['heads.0.blocks.0.extra'\]"):
        MedusaHeads.from_pretrained(saved, llama)


def test_missing_tensor_is_refused(llama, saved):
    _rewrite(saved, lambda t: t.pop("heads.2.proj.lora_B.default.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['heads.2.proj.lora_B.default.weight'\]"):
        MedusaHeads.from_pretrained(saved, llama)


def test_config_that_disagrees_with_the_weights_is_refused(llama, saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "num_heads": 2}))
    with pytest.raises(ValueError, match="holds 3 heads but config.json says num_heads=2"):
        MedusaHeads.from_pretrained(saved, llama)
    (saved / "config.json").write_text(json.dumps({**config, "lora_rank": 8}))
    with pytest.raises(ValueError, match=r"tensor heads.0.proj.lora_A.default.weight has shape \[4, 32\], config.json implies \[8, 32\]"):
        MedusaHeads.from_pretrained(saved, llama)


def test_bad_config_json_is_refused(llama, saved):
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match=r"unknown MedusaConfig keys \['medusa_num_layers'\]"):
        MedusaHeads.from_pretrained(saved, llama)
    (saved / "config.json").write_text(json.dumps({**config, "draft_type": "eagle"}))
    with pytest.raises(ValueError, match=f"{saved} holds a selfspec eagle checkpoint, not Medusa heads \\(draft_type 'medusa'\\); expected Medusa heads"):
        MedusaHeads.from_pretrained(saved, llama)
    (saved / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "vocab_size"}))
    with pytest.raises(ValueError) as missing:  # the message names the file it read
        MedusaHeads.from_pretrained(saved, llama)
    assert str(missing.value) == f"{saved / 'config.json'}: MedusaConfig is missing required keys ['vocab_size']"
    (saved / "model.safetensors").unlink()
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="has config.json but no model.safetensors"):
        MedusaHeads.from_pretrained(saved, llama)


def test_hub_ids_go_through_snapshot_download(llama, saved, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(saved)

    monkeypatch.setattr(ckpt, "snapshot_download", fake_snapshot_download)
    loaded = MedusaHeads.from_pretrained("someone/tiny-heads", llama, revision="v1")
    assert loaded.config.num_heads == 3
    assert calls == [("someone/tiny-heads", {"revision": "v1", "allow_patterns": ["config.json", "model.safetensors", "README.md"]})]


def test_missing_hub_repo_offline_says_what_failed(llama, monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match="'nobody/no-heads' is not a local directory and could not be fetched"):
        MedusaHeads.from_pretrained("nobody/no-heads", llama)


# push_to_hub / push_folder (dry run, private repos, branches, failures) are tested over HTTP against a local
# Hub-compatible server in tests/heads/test_hub.py.


def test_model_card_metadata_accuracy_tree_and_usage(llama, tmp_path):
    acc = [[0.6, 0.2], [0.4, 0.1], [0.2, 0.1]]
    heads = trained(llama, tree=[[0], [1], [0, 0]], head_accuracy=acc, recipe=RECIPE, mean_accepted=1.9)
    text = (heads.save_pretrained(tmp_path / "ck") / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta == {"base_model": "tiny-llama", "library_name": "selfspec", "tags": ["speculative-decoding", "medusa"],
                    "datasets": ["anon8231489123/ShareGPT_Vicuna_unfiltered"]}
    assert "| head | rank 0 | rank 1 | top-1 | top-2 |" in body and "| 1 | 0.600 | 0.200 | 0.600 | 0.800 |" in body
    assert "3 draft nodes, depth 2" in body and "`[[0], [1], [0, 0]]`" in body
    assert "Expected accepted tokens per step (from the measured accuracy): 2.04." in body  # 1 + .6 + .2 + .6 * .4
    assert "Measured mean accepted tokens per step: 1.90." in body
    assert f'load_drafter("{tmp_path / "ck"}", target)' in body


def test_base_model_is_named_without_a_local_path(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "models" / "my-base")
    model.config._name_or_path = str(tmp_path / "models" / "my-base")
    assert MedusaConfig.for_model(model).base_model == "my-base"
    assert MedusaConfig.for_model(model, base_model="org/my-base").base_model == "org/my-base"


def test_model_card_names_the_builtin_default_by_its_hub_id():
    config = MedusaConfig(base_model="smollm2-135m-instruct", base_revision=None, hidden_size=576, vocab_size=49152)
    meta = yaml.safe_load(model_card(config, "me/heads").split("---\n")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and "datasets" not in meta
    assert 'load_model("smollm2-135m-instruct")' in model_card(config, "me/heads")


def test_checkpoint_directory_gets_the_default_permissions(llama, tmp_path):
    directory = trained(llama).save_pretrained(tmp_path / "ck")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert directory.stat().st_mode == fresh.stat().st_mode


def test_recipe_must_be_json(llama):
    with pytest.raises(ValueError, match="recipe must be JSON-serialisable"):
        MedusaConfig.for_model(llama, recipe={"output_dir": Path("/x")})


def test_version_from_a_source_checkout_that_was_not_installed(llama, tmp_path, monkeypatch):
    # code run from a checkout on PYTHONPATH has no package metadata: saving must still work (it once crashed at the
    # very end of a training run), recording pyproject.toml's version marked as a source build
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    expected = tomllib.loads((Path(ckpt.__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert ckpt.selfspec_version() == expected + "+source"
    trained(llama).save_pretrained(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["selfspec_version"] == expected + "+source"
