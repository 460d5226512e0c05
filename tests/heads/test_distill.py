"""Self-distillation on a tiny random Llama with SmolLM2's tokenizer: replies are the target's own, the output is a
saved dataset with a messages column, and an interrupted run resumes to exactly what an uninterrupted one writes."""

from __future__ import annotations

import copy
import dataclasses
import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from heads.distill import main
from heads.training.data import DataConfig, build_datasets
from heads.training.distill import DistillConfig, distill
from selfspec.core.models import DEFAULT_MODEL, resolve
from conftest import tiny_model

CONVERSATIONS = [
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Bonjour !"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Red."}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3."}],
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL)[0])


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", vocab=len(tok))


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return DataConfig(source=str(path), exclude_questions=None)


def greedy_reply(model, tok, messages, max_new_tokens):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    out = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
    return tok.decode(out, skip_special_tokens=True).strip()


def test_greedy_distillation_writes_the_targets_replies_and_resumes(model, tok, source, tmp_path):
    cfg = DistillConfig(max_new_tokens=4, batch_size=2, shard_size=1)
    out = tmp_path / "out"
    assert distill(model, tok, source, out, cfg, max_shards=2) is None  # "killed" after two shards
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard-00000", "shard-00001"]
    assert distill(model, tok, source, out, cfg) == out  # resumed: only the third shard is generated
    result = datasets.load_from_disk(str(out))
    assert list(result["source_index"]) == [0, 1, 2] and not (out / "shards").exists()
    got = list(result["messages"])
    # user turns and the system message kept; each reply is the target's own greedy continuation of its own history
    assert [[m["role"] for m in c] for c in got] == [[m["role"] for m in c] for c in CONVERSATIONS]
    assert [[m["content"] for m in c if m["role"] != "assistant"] for c in got] == [
        [m["content"] for m in c if m["role"] != "assistant"] for c in CONVERSATIONS]
    for conv in got:
        for i, m in enumerate(conv):
            if m["role"] == "assistant":
                assert m["content"] == greedy_reply(model, tok, conv[:i], 4)
    # usable as a training source as it is
    train, _ = build_datasets(DataConfig(source=str(out), eval_fraction=0.0, exclude_questions=None, pack=False), tok)
    assert len(train) >= 1
    assert distill(model, tok, source, out, cfg) == out  # finished: returned as is


def test_sampled_resumed_run_equals_uninterrupted_run(model, tok, source, tmp_path):
    cfg = DistillConfig(max_new_tokens=5, batch_size=3, shard_size=2, do_sample=True, temperature=1.0, seed=7)
    whole = distill(model, tok, source, tmp_path / "whole", cfg)
    assert distill(model, tok, source, tmp_path / "parts", cfg, max_shards=1) is None
    parts = distill(model, tok, source, tmp_path / "parts", cfg)
    whole_messages = list(datasets.load_from_disk(str(whole))["messages"])
    assert list(datasets.load_from_disk(str(parts))["messages"]) == whole_messages
    other_seed = distill(model, tok, source, tmp_path / "other", dataclasses.replace(cfg, seed=8))
    assert list(datasets.load_from_disk(str(other_seed))["messages"]) != whole_messages  # it really samples


def test_a_shards_prompts_are_batched_by_length_turn_by_turn(model, tok):
    """Each generate call gets prompts of neighbouring lengths (the shortest first), every reply still lands in its own
    conversation (equal to answering it alone), and progress counts each reply as its batch is answered."""
    from heads.training.distill import regenerate

    convs = [[{"role": "user", "content": "x" * n}, {"role": "assistant", "content": "-"}] for n in (40, 1, 30, 2, 20, 3)]
    convs[1] += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "-"}]  # two turns
    calls, finished = [], []
    generate = model.generate

    def recording(input_ids, attention_mask, **kwargs):
        calls.append(attention_mask.sum(-1).tolist())  # prompt lengths of this call
        return generate(input_ids, attention_mask=attention_mask, **kwargs)

    cfg = DistillConfig(max_new_tokens=3, batch_size=2)
    model.generate = recording
    try:
        got = regenerate(model, tok, convs, cfg, progress=finished.append)
    finally:
        del model.generate
    first_turn = sorted(len(tok(tok.apply_chat_template(c[:1], tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]) for c in convs)
    assert [n for call in calls[:3] for n in call] == first_turn  # by length: 3 calls of 2
    assert len(calls) == 4 and len(calls[3]) == 1  # the second turn of the one two-turn conversation
    assert finished == [2, 2, 2, 1]  # 7 replies: 3 calls of 2, then the second turn
    for conv, out in zip(convs, got):
        for i, m in enumerate(out):
            if m["role"] == "assistant":
                assert m["content"] == greedy_reply(model, tok, out[:i], 3)
    assert [m["content"] for m in got[1] if m["role"] == "user"] == ["x", "and then?"]


def test_a_conversation_whose_prompt_grows_too_long_ends_there_and_its_turns_count_as_done(model, tok):
    from heads.training.distill import regenerate

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "-"},
            {"role": "user", "content": "y" * 60}, {"role": "assistant", "content": "-"},
            {"role": "user", "content": "z"}, {"role": "assistant", "content": "-"}]
    first = len(tok(tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False)["input_ids"])
    finished = []
    [got] = regenerate(model, tok, [conv], DistillConfig(max_new_tokens=2, max_prompt_length=first + 10),
                       progress=finished.append)
    assert [m["role"] for m in got] == ["user", "assistant"] and got[0]["content"] == "hi"
    assert finished == [1, 2]  # the first reply; then the long turn and the one after it, never answered


def test_resuming_with_other_settings_is_refused(model, tok, source, tmp_path):
    distill(model, tok, source, tmp_path / "out", DistillConfig(max_new_tokens=2, shard_size=1), max_shards=1)
    with pytest.raises(ValueError, match=r"other settings \(\['config'\] differ\)"):
        distill(model, tok, source, tmp_path / "out", DistillConfig(max_new_tokens=3, shard_size=1))
    # the target at another Hub revision, or in another dtype, writes other replies: not mixed into one dataset
    with pytest.raises(ValueError, match=r"other settings \(\['revision'\] differ\)"):
        distill(model, tok, source, tmp_path / "out", DistillConfig(max_new_tokens=2, shard_size=1), revision="v2")
    with pytest.raises(ValueError, match=r"other settings \(\['dtype'\] differ\)"):
        distill(copy.deepcopy(model).to(torch.bfloat16), tok, source, tmp_path / "out",
                DistillConfig(max_new_tokens=2, shard_size=1))


def test_cli_help_explains(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--revision", "--source", "--out", "--max-conversations", "--do-sample", "--max-shards"):
        assert flag in text
    assert "Resumable" in text


def test_cli_runs_and_resumes(model, tok, source, tmp_path, capsys):
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    argv = ["--model", str(tmp_path / "target"), "--source", source.source, "--out", str(tmp_path / "out"),
            "--max-new-tokens", "3", "--shard-size", "2", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv + ["--max-shards", "1"]) == 0
        assert "rerun to resume" in capsys.readouterr().out
        assert main(argv) == 0
        assert capsys.readouterr().out.endswith(f"distilled dataset: {tmp_path / 'out'}\n")
    finally:
        torch.set_num_threads(threads)  # --threads sets it process-wide
    assert len(datasets.load_from_disk(str(tmp_path / "out"))) == 3


@pytest.mark.parametrize("argv, message", [
    (["--max-conversations", "0"], "python -m heads.distill: error: argument --max-conversations: expected an "
                                   "integer >= 1, found '0'"),
    (["--batch-size", "0"], "python -m heads.distill: error: argument --batch-size: expected an integer >= 1, "
                            "found '0'"),
    (["--shard-size", "-1"], "python -m heads.distill: error: argument --shard-size: expected an integer >= 1, "
                             "found '-1'"),
    (["--dtype", "fp13"], "python -m heads.distill: error: argument --dtype: unknown dtype 'fp13': expected one of "
                          "['bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32']"),
    (["--do-sample", "--temperature", "0"], "python -m heads.distill: error: argument --temperature: expected a "
                                            "number > 0, found 0.0"),
])
def test_cli_refuses_bad_numbers_naming_the_flag(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "x", "--out", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == message


def test_cli_mistakes_are_one_error_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import heads.distill

    monkeypatch.setattr(heads.distill, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    out = ["--model", "x", "--out", str(tmp_path / "out")]
    cases = {
        ("--temperature", "0.5"): "--temperature 0.5: sampling only, but without --do-sample the replies are "
                                  "greedy and it would be ignored; add --do-sample, or drop it",
        ("--top-k", "5", "--top-p", "0.9"): "--top-p 0.9 --top-k 5: sampling only, but without --do-sample the replies "
                                            "are greedy and they would be ignored; add --do-sample, or drop them",
        ("--source", str(tmp_path / "nope.jsonl")): f"--source {tmp_path / 'nope.jsonl'}: no such file or directory; "
            "expected 'sharegpt', a .json/.jsonl/.parquet file, a save_to_disk directory or a Hub dataset id",
    }
    for argv, message in cases.items():
        assert main([*out, *argv]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_the_block_recipes_data_section_trains_on_a_distilled_directory(model, tok, source, tmp_path):
    """Issue 62's regenerated data: a distillation run killed after one shard and resumed is what
    configs/block_cond_smollm2.yaml's data.source points to, and its rows are the target's replies, trained."""
    from pathlib import Path

    from heads.training.recipe import load_config

    out = tmp_path / "distilled"
    cfg = DistillConfig(max_new_tokens=4, batch_size=3, shard_size=2)
    assert distill(model, tok, source, out, cfg, max_shards=1) is None  # killed after one shard
    assert distill(model, tok, source, out, cfg) == out  # resumed
    recipe = load_config(Path(__file__).resolve().parents[2] / "configs/block_cond_smollm2.yaml",
                         [f"data.source={out}", "data.eval_fraction=0.0", "data.max_conversations=null"])
    assert recipe.data.source == str(out)
    train, _ = build_datasets(recipe.data, tok)
    assert len(train) == 1  # the three conversations packed into one row of at most 512 tokens
    trained = [t for t, label in zip(train[0]["input_ids"], train[0]["labels"]) if label != -100]
    replies = [m["content"] for c in datasets.load_from_disk(str(out))["messages"] for m in c if m["role"] == "assistant"]
    assert tok.decode(trained).count("<|im_end|>") == len(replies) == 4
