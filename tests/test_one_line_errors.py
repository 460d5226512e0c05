"""Inputs that ended in a traceback now end in one line saying what to do (infer.py exits 2): a model whose weights
are a pickle holding more than tensors, and a Hub --model that cannot be read while a --draft is checked against it.
(train.py with an output_dir that is a file: tests/heads/test_train_folder.py; prompt text that is not Unicode in the
server: tests/test_serve_limits.py.)"""

from __future__ import annotations

import datetime
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file

import tiny_chat_model
from hub_server import HubServer, use_hub
from selfspec.tools import cli


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


def test_a_pickled_model_holding_more_than_tensors_is_one_line(model_dir, tmp_path, capsys):
    """Refused by torch's weights-only loading (nothing runs), said in one line instead of its page of advice to pass
    weights_only=False."""
    model = tmp_path / "bin-model"
    shutil.copytree(model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save({**weights, "saved_on": datetime.date(2020, 1, 1)}, model / "pytorch_model.bin")
    assert cli.main(["--model", str(model), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert one_error_line(capsys) == (
        f"error: the weights of {model} could not be read safely: a pickled weights file (pytorch_model.bin) is "
        "loaded with weights_only=True and may hold tensors only, and this one holds more (Unsupported global: GLOBAL "
        "datetime.date was not an allowed global by default); convert it to safetensors where you trust its source, "
        "or use a model directory with model.safetensors")


def test_a_hub_model_that_cannot_be_read_beside_a_draft_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """The draft is checked against the --model's config before anything loads: a Hub out of reach (here: its host
    does not resolve), or a repo it does not hold, is one line, not huggingface_hub's traceback."""
    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    with HubServer() as hub:
        use_hub(monkeypatch, hub, tmp_path / "home")
        assert cli.main(["--model", "nobody/no-such-model", "--draft", str(heads), "--prompt", "hi"]) == 2
        line = one_error_line(capsys)
        assert line.startswith("error: could not read the config of 'nobody/no-such-model' from the Hub to check the "
                               "draft against it (")
        assert line.endswith("); expected a local transformers model directory, a .gguf file, a Hub id ('owner/name', "
                             "reachable or in the Hub cache) or the built-in 'smollm2-135m-instruct'"), line

        def no_dns(host, *args, **kwargs):
            raise socket.gaierror(-2, "Name or service not known")

        monkeypatch.setattr(socket, "getaddrinfo", no_dns)
        assert cli.main(["--model", "nobody/no-such-model", "--draft", str(heads), "--prompt", "hi"]) == 2
        assert one_error_line(capsys).startswith(
            "error: could not read the config of 'nobody/no-such-model' from the Hub to check the draft against it: it "
            "is not in the Hub cache, and the Hub (127.0.0.1) cannot be reached from this machine; expected ")


@pytest.fixture(autouse=True)
def _quiet_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
