"""infer.py sweep-exit and search-skip on a tiny chat model: the sweep measures plain decoding and early exit at each
requested layer (and a trained exit head) in one run; the search writes a layer-skip checkpoint that --draft loads and
that decodes token-identically to plain greedy decoding."""

from __future__ import annotations

import json

import pytest

from conftest import reference
from transformers import AutoTokenizer

from heads.exit_head.model import ExitHead, ExitHeadConfig
from selfspec import registry
from selfspec.tools import cli
from selfspec.api import SpecModel
from selfspec.drafts.layerskip import LayerSkipDrafter
from selfspec.core.models import load_model
from selfspec.core.target import Target


def test_sweep_measures_plain_early_exit_per_layer_and_exit_heads(model_dir, tmp_path, capsys):
    model, _ = load_model(str(model_dir))
    ExitHead(ExitHeadConfig.for_model(model, 1, base_model="model")).save_pretrained(tmp_path / "exit1")
    assert cli.main(["sweep-exit", "--model", str(model_dir), "--dtype", "float32", "--layers", "1",
                     "--exit-heads", str(tmp_path / "exit1"), "--prompts", "2", "--max-new-tokens", "6",
                     "--out", str(tmp_path / "sweep")]) == 0
    out, err = capsys.readouterr()
    assert "sweep-exit" in err and "/3 [" in err  # a progress bar over plain, each exit layer and each exit head
    rows = [line.split("|")[1:3] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [[c.strip() for c in r] for r in rows] == [
        ["exit layer", "draft"], ["—", "plain"], ["1", "early-exit"], ["1", str(tmp_path / "exit1")]]
    stored = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["exit_layer"] for r in stored] == [1, 1]
    assert all(r["mean_accepted"] >= 1.0 for r in stored)
    # every row's speed-up is its own speed over the one plain run measured beside it (the figures are consistent)
    assert len({r["plain_tokens_per_s"] for r in stored}) == 1
    assert all(r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"]) for r in stored)


def test_sweep_refuses_an_exit_layer_outside_the_model(model_dir, capsys):
    assert cli.main(["sweep-exit", "--model", str(model_dir), "--layers", "9"]) == 2
    assert "exit layer must be in 1.." in capsys.readouterr().err


def test_search_writes_a_layer_skip_draft_that_decodes_losslessly(model_dir, tmp_path, capsys):
    out_dir = tmp_path / "skip"
    assert cli.main(["search-skip", "--model", str(model_dir), "--dtype", "float32", "--prompts", "2",
                     "--max-new-tokens", "6", "--per-round", "0", "--patience", "1", "--out", str(out_dir)]) == 0
    printed = capsys.readouterr()
    assert f"saved to {out_dir}" in printed.out
    assert "search-skip" in printed.err and "trial" in printed.err and "best skip" in printed.err  # progress
    config = json.loads((out_dir / "config.json").read_text())
    assert config["skip_layers"] and config["measured"]["trials"] >= 1
    model, tokenizer = load_model(str(model_dir))
    target = Target(model)
    spec = SpecModel(target, tokenizer, registry.build_drafter(registry.parse_draft(str(out_dir)), target))
    assert isinstance(spec.drafter, LayerSkipDrafter)
    ids = spec.encode("hello there")
    assert spec.generate(ids, max_new_tokens=10).tokens == reference(model, ids, 10)


def test_calibration_prompts_come_from_a_file_of_the_users_own(model_dir, tmp_path, monkeypatch, capsys):
    """--prompts-file: a text file (one prompt per line) or a .jsonl of "prompt" / Spec-Bench "turns" rows; the sweep
    decodes exactly those prompts, all of them unless --prompts says how many; a missing, blank or malformed file, or
    more prompts than it holds, is refused before any model loads."""
    from selfspec.tools import calibrate

    text = tmp_path / "mine.txt"
    text.write_text("Copy this list: a, b, c.\n\n  Repeat after me: hello world.  \n")
    rows = tmp_path / "mine.jsonl"
    chat = [{"role": "user", "content": "List a, b."}, {"role": "assistant", "content": "a, b"},
            {"role": "user", "content": "Again, reversed."}]
    rows.write_text(json.dumps({"question_id": 1, "turns": ["Summarise: the cat sat.", "Shorter."]}) + "\n"
                    + json.dumps({"prompt": "Name three colours."}) + "\n" + json.dumps({"messages": chat}) + "\n")
    assert calibrate.read_prompts(str(text)) == ["Copy this list: a, b, c.", "Repeat after me: hello world."]
    assert calibrate.read_prompts(str(rows)) == ["Summarise: the cat sat.", "Name three colours.", chat]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    [ids] = calibrate.calibration_inputs(tokenizer, 1, [chat])  # a chat's messages: the whole conversation so far
    whole = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ids) == whole and "a, b" in whole

    seen = []
    real = calibrate.calibration_inputs
    monkeypatch.setattr(calibrate, "calibration_inputs", lambda tok, n, texts: seen.append(list(texts[:n])) or
                        real(tok, n, texts))
    common = ["sweep-exit", "--model", str(model_dir), "--dtype", "float32", "--layers", "1", "--max-new-tokens", "4"]
    assert cli.main([*common, "--prompts-file", str(rows)]) == 0
    assert seen[-1] == ["Summarise: the cat sat.", "Name three colours.", chat]
    assert f"3 calibration prompts from {rows} x 4 tokens" in capsys.readouterr().out
    assert cli.main([*common, "--prompts-file", str(text), "--prompts", "1"]) == 0
    assert seen[-1] == ["Copy this list: a, b, c."]
    assert cli.main([*common, "--prompts", "1"]) == 0
    assert seen[-1] == [calibrate.CALIBRATION_PROMPTS[0]]
    capsys.readouterr()

    loaded = []
    monkeypatch.setattr(calibrate, "load_model", lambda *a, **k: loaded.append(a))
    blank, bad = tmp_path / "blank.txt", tmp_path / "bad.jsonl"
    blank.write_text("\n  \n")
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"question": "no prompt here"}) + "\n")
    answered = tmp_path / "answered.jsonl"  # a chat that ends with the assistant: nothing left to answer
    answered.write_text(json.dumps({"messages": chat[:2]}) + "\n")
    for args, message in (([str(tmp_path / "none.txt")], "does not exist: expected a text file, one prompt per line"),
                          ([str(blank)], "holds no prompts (every line is blank)"),
                          ([str(bad)], 'line 2: expected a non-empty "prompt" string, "turns" list of strings or '
                                       '"messages" list'),
                          ([str(answered)], 'line 1: expected "messages" as a list of {"role", "content"} strings '
                                            'ending with a "user" turn (the one to answer), found [{"role": "user"'),
                          ([str(text), "--prompts", "3"], f"--prompts must be in 1..2 (the prompts {text} holds), "
                                                          "found 3")):
        assert cli.main([*common, "--prompts-file", *args]) == 2
        assert message in capsys.readouterr().err
    assert not loaded
