"""Inputs that ended in a traceback now end in one line saying what to do (infer.py exits 2): a model whose weights
are a pickle holding more than tensors, a Hub --model that cannot be read while a --draft is checked against it, and
prompt bytes that are not UTF-8 (on the command line; in the chat, one such line is refused and the chat goes on).
(train.py with an output_dir that is a file: tests/heads/test_train_folder.py; prompt text that is not Unicode in the
server: tests/test_serve_limits.py.)"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_chat_model
from hub_server import HubServer, use_hub
from selfspec import api
from selfspec.tools import cli

ROOT = Path(__file__).resolve().parents[1]


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


# ------------------------------------------------------------------------------- prompt bytes that are not UTF-8
def infer(*args: str | bytes, stdin: bytes = b"", encoding: str = "utf-8") -> tuple[int, str, str]:
    """python infer.py with ``args`` as a shell passes them (bytes as they are) -> (exit code, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": encoding}
    done = subprocess.run([sys.executable, "infer.py", *args], cwd=ROOT, env=env, input=stdin, capture_output=True,
                          timeout=300)
    return done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_prompt_bytes_that_are_not_utf8_are_one_line_before_the_model_loads(model_dir):
    """A shell passes the bytes as they are; Python reads them with surrogateescape, which the tokenizer refused in
    its own words ('TextEncodeInput must be Union[...]'). Now: the byte and its offset, before anything loads."""
    code, _, err = infer("--model", str(model_dir), "--prompt", b"caf\xe9 au lait", "--max-new-tokens", "2")
    assert code == 2 and error_lines(err) == [
        "error: --prompt: expected UTF-8 text, found the byte 0xe9 at byte 3 (after 'caf'), which is not UTF-8: give "
        "the text as UTF-8"], err
    for flag, args in (("--prompt", ["--prompt", b"\xffbe brief", "--no-chat"]),
                       ("--system", ["--prompt", "hi", "--system", b"\xffbe brief"])):
        code, _, err = infer("--model", str(model_dir), *args)
        assert code == 2 and error_lines(err) == [
            f"error: {flag}: expected UTF-8 text, found the byte 0xff at byte 0, which is not UTF-8: give the text as "
            "UTF-8"], err


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8:surrogateescape"])
def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(model_dir, encoding):
    """Lines typed or piped into the chat: one that is not UTF-8 is refused in one line and left out of the
    conversation; the next is answered as if it had not been typed. Both ways Python may read stdin: strictly (a
    UTF-8 locale; it raised UnicodeDecodeError, which ended the chat) or with surrogateescape (the C locale; the
    tokenizer's message ended it)."""
    code, out, err = infer("--model", str(model_dir), "--max-new-tokens", "8", stdin=b"hello\ncaf\xe9\nthe sea\n\n",
                           encoding=encoding)
    assert code == 0, err
    assert error_lines(err) == [
        "error: this line: expected UTF-8 text, found the byte 0xe9 at byte 3 (after 'caf'), which is not UTF-8: give "
        "the text as UTF-8; the conversation goes on without it"]
    m = api.load(str(model_dir), draft="ngram")
    first = m.generate("hello", max_new_tokens=8).text
    second = m.generate([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "the sea"}], max_new_tokens=8).text
    assert out == f"you> assistant> {first}\nyou> you> assistant> {second}\nyou> "
    assert sum(line.startswith("[selfspec ngram]") for line in err.splitlines()) == 2


def test_the_api_refuses_text_that_is_not_utf8_where_it_encodes(model_dir):
    """selfspec.api: a prompt, a message or a stop string that UTF-8 cannot hold (a byte read with surrogateescape,
    or a lone surrogate) is a ValueError naming it, as text or chat, in generate, stream and generate_plain."""
    m = api.load(str(model_dir), draft="ngram")
    byte = "expected UTF-8 text, found the byte 0xe9 at byte 5 (after 'caf\u00e9'), which is not UTF-8: give the text as UTF-8"
    for call in (m.generate, m.stream, m.generate_plain):
        with pytest.raises(ValueError) as e:
            call("caf\u00e9\udce9", max_new_tokens=2, chat=False)
        assert str(e.value) == f"the prompt: {byte}"
        with pytest.raises(ValueError) as e:
            call([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "caf\u00e9\udce9"}],
                 max_new_tokens=2)
        assert str(e.value) == f"message 1's content: {byte}"
        with pytest.raises(ValueError) as e:
            call("hi", max_new_tokens=2, stop=["ok", "x\ud800"])
        assert str(e.value) == ("a stop string: expected Unicode text, found a lone surrogate '\\ud800' at character 1 "
                                "(after 'x'), which no UTF-8 text holds")
    assert m.encode("caf\u00e9", chat=False).tolist() == m.tokenizer("caf\u00e9").input_ids  # Unicode text is read
