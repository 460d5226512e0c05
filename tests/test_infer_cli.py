"""python infer.py: --help, a streamed prompt with statistics, --compare, the interactive chat, Ctrl-C, bad input."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_chat_model
from selfspec import api
from selfspec.tools import cli

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}


def infer(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "infer.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout)


def args(model_dir, *extra: str):
    return cli.build_parser().parse_args(["--model", str(model_dir), "--max-new-tokens", "20", *extra])


def test_help_explains_every_option():
    result = infer("--help")
    assert result.returncode == 0
    for option in ("--model", "--draft", "--tree", "--prompt", "--temperature", "--top-p", "--top-k", "--seed",
                   "--repetition-penalty", "--min-p", "--stop", "--system", "--min-new-tokens", "--max-new-tokens", "--dtype",
                   "--presence-penalty", "--frequency-penalty",
                   "--compare", "chain:K", ".gguf", "interactive", "bench", "costs"):
        assert option in result.stdout, option


def test_prompt_streams_text_then_statistics(model_dir):
    expected = api.load(str(model_dir), draft="ngram").generate("hello café", max_new_tokens=20)
    result = infer("--model", str(model_dir), "--prompt", "hello café", "--max-new-tokens", "20")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"
    stats = [line for line in result.stderr.splitlines() if line.startswith("[selfspec ngram]")]
    assert len(stats) == 1
    assert "20 new tokens in" in stats[0] and "tokens/s" in stats[0] and "mean accepted tokens per step" in stats[0]


def test_compare_reports_speedup_and_identical(model_dir):
    out, err = io.StringIO(), io.StringIO()
    assert cli.run_decode(args(model_dir, "--prompt", "the quick brown fox", "--compare"), out, err) == 0
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("[selfspec ngram] 20 new tokens")
    assert lines[1].startswith("[plain generate] 20 new tokens")
    assert lines[2].startswith("[compare] speed-up ") and lines[2].endswith("x; outputs identical")


def test_stop_min_new_tokens_and_min_p_reach_both_decodings(model_dir):
    """--stop ends the reply after the token that completes the string, in selfspec and in the plain decoding of
    --compare alike; --stop '' is none (not the generation config's); --min-new-tokens and --min-p reach the API."""
    m = api.load(str(model_dir), draft="ngram")
    prompt = "write a short story about the sea"
    full = m.generate(prompt, max_new_tokens=30)
    stop = tiny_chat_model.spanning_stop(m.tokenizer, full.tokens, start=4)
    expected = m.generate(prompt, max_new_tokens=30, stop=stop)
    assert len(expected.tokens) < 30
    out, err = io.StringIO(), io.StringIO()
    assert cli.run_decode(args(model_dir, "--prompt", prompt, "--max-new-tokens", "30", "--compare", "--stop", stop,
                               "--stop", "never said"), out, err) == 0
    assert out.getvalue() == expected.text + "\n"
    assert err.getvalue().splitlines()[2].endswith("x; outputs identical")
    a = args(model_dir, "--stop", "", "--min-new-tokens", "7", "--min-p", "0.1", "--presence-penalty", "0.5",
             "--frequency-penalty", "-0.25")
    options = cli._decoding(a)
    assert options == options.replace(stop=(), min_new_tokens=7, min_p=0.1, presence_penalty=0.5,
                                      frequency_penalty=-0.25)
    assert cli._decoding(args(model_dir)).stop is None  # the generation config's


def test_stop_strings_read_the_escapes_a_shell_passes_on():
    """--stop '\\n\\n' (what `--stop "\\n\\n"` gives in bash) is a blank line; \\\\ is one backslash."""
    assert cli.stop_strings(["\\n\\n", "a\\tb\\r", "x\\\\n", "", "café\\q"]) == ["\n\n", "a\tb\r", "x\\n", "café\\q"]
    assert cli.stop_strings([""]) == [] and cli.stop_strings(None) is None


def test_a_system_message_opens_the_conversation(model_dir):
    m = api.load(str(model_dir), draft="ngram")
    system = {"role": "system", "content": "answer like a pirate"}
    expected = m.generate([system, {"role": "user", "content": "hello café"}], max_new_tokens=20).text
    assert expected != m.generate("hello café", max_new_tokens=20).text  # the system message changes this answer
    out, err = io.StringIO(), io.StringIO()
    assert cli.run_decode(args(model_dir, "--prompt", "hello café", "--system", system["content"]), out, err) == 0
    assert out.getvalue() == expected + "\n"
    turns = iter(["hello café", ""])
    out = io.StringIO()
    assert cli.run_decode(args(model_dir, "--system", system["content"]), out, err, read=lambda p: next(turns)) == 0
    assert out.getvalue() == f"assistant> {expected}\n"
    err = io.StringIO()
    assert cli.run_decode(args(model_dir, "--prompt", "hi", "--system", "x", "--no-chat"), out, err) == 2
    assert "--system is a message of the chat template: drop --no-chat" in err.getvalue()


def test_interactive_chat_keeps_the_conversation(model_dir):
    turns = iter(["hello café", "and the sea?", ""])
    out, err = io.StringIO(), io.StringIO()
    assert cli.run_decode(args(model_dir), out, err, read=lambda prompt: next(turns)) == 0
    m = api.load(str(model_dir), draft="ngram")
    first = m.generate("hello café", max_new_tokens=20).text
    second = m.generate([{"role": "user", "content": "hello café"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "and the sea?"}], max_new_tokens=20).text
    assert out.getvalue() == f"assistant> {first}\nassistant> {second}\n"
    assert sum(line.startswith("[selfspec ngram]") for line in err.getvalue().splitlines()) == 2


def test_medusa_checkpoint_through_the_entry_point(model_dir, tmp_path):
    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    out, err = io.StringIO(), io.StringIO()
    code = cli.run_decode(args(model_dir, "--prompt", "hello café", "--draft", str(heads), "--tree", "full:2,1",
                               "--compare"), out, err)
    assert code == 0, err.getvalue()
    assert err.getvalue().splitlines()[-1].endswith("outputs identical")
    assert type(api.load(str(model_dir), draft=str(heads)).drafter).__name__ == "MedusaDrafter"


def test_costs_subcommand(model_dir, capsys):
    assert cli.main(["costs", "--model", str(model_dir), "--sizes", "1,4", "--context", "8", "--repeats", "2",
                     "--dtype", "fp32,bf16", "--loop-prompts", "2", "--loop-tokens", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert rows == ["tree nodes", "1", "4"] * 2
    overhead = [line for line in out.splitlines() if line.startswith("loop with --draft ngram over 2 prompts")]
    assert len(overhead) == 2 and all("% overhead" in line for line in overhead)


def test_costs_measures_the_loop_with_a_drafts_own_tree_or_another(model_dir, tmp_path, capsys, monkeypatch):
    from selfspec import registry

    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    trees, build = [], registry.build_drafter
    monkeypatch.setattr(registry, "build_drafter", lambda spec, target, tree=None: trees.append(tree) or
                        build(spec, target, tree))
    for draft in (str(heads), f"{heads}@chain:2"):
        assert cli.main(["costs", "--model", str(model_dir), "--sizes", "1", "--context", "8", "--repeats", "1",
                         "--loop-prompts", "1", "--loop-tokens", "8", "--loop-draft", draft, "--no-progress"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert any(x.startswith(f"loop with --draft {draft} over 1 prompts") for x in lines)
    assert trees == [None, registry.parse_tree("chain:2")]  # the checkpoint's own tree, then the one asked for
    assert cli.main(["costs", "--model", str(model_dir), "--loop-draft", f"{heads}@chain:x"]) == 2
    assert "chain" in capsys.readouterr().err and len(trees) == 2  # a bad tree fails before the model loads


class InterruptAfter(io.StringIO):
    def __init__(self, pieces: int):
        super().__init__()
        self.left = pieces

    def write(self, text: str) -> int:
        if self.left == 0:
            raise KeyboardInterrupt
        self.left -= 1
        return super().write(text)


class InterruptOnce(io.StringIO):
    """Ctrl-C once, at the write after ``pieces`` writes."""
    def __init__(self, pieces: int):
        super().__init__()
        self.left = pieces

    def write(self, text: str) -> int:
        self.left -= 1
        if self.left == -1:
            raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_prints_what_was_generated_and_exits_130(model_dir):
    out, err = InterruptAfter(3), io.StringIO()
    assert cli.run_decode(args(model_dir, "--prompt", "hello café"), out, err) == cli.INTERRUPTED == 130
    assert "interrupted:" in err.getvalue() and "new tokens in" in err.getvalue()


def test_ctrl_c_in_the_chat_stops_the_reply_and_the_chat_goes_on(model_dir, monkeypatch):
    """Ctrl-C during a reply stops it (what was generated of it stays in the conversation) and asks for the next
    turn; Ctrl-C at the prompt ends the chat (exit 0)."""
    seen = []
    real = api.SpecModel.stream
    monkeypatch.setattr(api.SpecModel, "stream", lambda self, prompt, **kw: seen.append(list(prompt)) or
                        real(self, prompt, **kw))
    turns = iter(["hello café", "and again"])

    def read(prompt: str) -> str:
        text = next(turns, None)
        if text is None:
            raise KeyboardInterrupt
        return text

    out, err = InterruptOnce(2), io.StringIO()  # "assistant> ", one piece, then Ctrl-C
    assert cli.run_decode(args(model_dir), out, err, read=read) == 0
    assert err.getvalue().count("interrupted:") == 1 and "Ctrl-C during a reply stops it" in err.getvalue()
    first_reply = out.getvalue().split("assistant> ")[1]  # the one piece shown before Ctrl-C
    assert len(seen) == 2 and seen[1][1]["role"] == "assistant" and seen[1][1]["content"].startswith(first_reply)
    assert out.getvalue().count("assistant> ") == 2


def test_bad_draft_is_one_clear_line_before_loading(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["--model", str(model_dir), "--prompt", "hi", "--draft", str(tmp_path / "heads")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: draft checkpoint directory") and err.count("\n") == 1
    assert cli.main(["--model", str(model_dir), "--prompt", "hi", "--draft", "ngram", "--tree", "star"]) == 2
    assert "unknown --tree 'star'" in capsys.readouterr().err


@pytest.mark.smollm2
def test_default_model_prompt():
    result = infer("--prompt", "Hi", "--max-new-tokens", "16", timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert any(line.startswith("[selfspec ngram]") and "new tokens in" in line for line in result.stderr.splitlines())


@pytest.mark.parametrize("argv, message", [
    (["bench", "--draft", "runs/heads"], "unrecognized arguments: --draft runs/heads"),  # not --draft-revision
    (["--temp", "0.5"], "unrecognized arguments: --temp 0.5"),  # not --temperature
    (["costs", "--sizes", "0,x"], "argument --sizes: expected comma-separated integers >= 1, found '0,x'"),
    (["costs", "--repeats", "0"], "argument --repeats: expected an integer >= 1, found '0'"),
    (["costs", "--context", "-5"], "argument --context: expected an integer >= 1, found '-5'"),
    (["tune-tree", "--draft", "ngram", "--budgets", "8,x"],
     "argument --budgets: expected comma-separated integers >= 1, found '8,x'"),
    (["tune-tree", "--draft", "ngram", "--depth", "3"], "unrecognized arguments: --depth 3"),  # --depths tunes it
    (["sweep-exit", "--layers", "4,a"], "argument --layers: expected comma-separated integers >= 1, found '4,a'"),
    (["serve", "--port", "99999"], "argument --port: expected an integer from 0 to 65535, found '99999'"),
    (["serve", "--temperature", "-1"], "argument --temperature: expected a number from 0.0 to 2.0, found '-1'"),
    (["serve", "--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, found '0'"),
])
def test_options_are_whole_and_numbers_are_checked_by_name(capsys, argv, message):
    """An abbreviated option is not taken for a longer one (bench --draft is no --draft-revision); a bad number names
    its option; all before anything loads (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_before_loading_the_model(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model does not exist: had serve loaded it first, that would be the error
        assert cli.main(["serve", "--port", str(port), "--model", "/nonexistent/model"]) == 2
    assert (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another --port (0: any free "
            f"port) or --host") in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused_with_the_chat_template_too(model_dir, prompt, capsys):
    """With the chat template an empty message would still make a prompt (the template's own tokens) and be
    answered; it is refused as an empty prompt is without it."""
    for system in ([], ["--system", "be brief"]):
        assert cli.main(["--model", str(model_dir), "--prompt", prompt, *system]) == 2
        assert f"error: the prompt is empty: expected a message with text, found {prompt!r}" in capsys.readouterr().err
    m = api.load(str(model_dir), draft="ngram")
    with pytest.raises(ValueError, match="the prompt is empty"):
        m.generate(prompt)
    assert m.generate([{"role": "user", "content": "hi"}], max_new_tokens=2).tokens  # a conversation is not a str
