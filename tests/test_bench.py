"""infer.py bench on a tiny model: Spec-Bench answer files exactly as evaluation/speed.py and equal.py read them, the
summary table, the plot, and bad input refused before any model is loaded."""

from __future__ import annotations

import json
import re
import statistics
import zlib
from pathlib import Path

import pytest

import tiny_chat_model
from selfspec import Tree, api
from selfspec.tools import bench, cli, specbench

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write about the sea.", "Now say it again, shorter."]},
    {"question_id": 101, "category": "reasoning", "turns": ["the quick brown fox", "and the lazy dog?"]},
    {"question_id": 121, "category": "coding", "turns": ["Hello, how are you today?", "Thank you."]},
]
METHODS = ("plain", "pld", "ngram", "heads")  # "heads": untrained Medusa heads, a checkpoint directory
DTYPES = ("float32", "bfloat16")
MAX_NEW = 12


def write_questions(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """One bench run through the command line (plain, prompt lookup, selfspec n-gram; fp32 and bf16)."""
    tmp = tmp_path_factory.mktemp("bench")
    questions = write_questions(tmp / "q.jsonl", QUESTIONS)
    heads = tiny_chat_model.build_heads(model_dir, tmp / "heads")
    out = tmp / "out"
    code = cli.main(["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(out),
                     "--methods", ",".join([*METHODS[:-1], str(heads)]), "--dtype", "fp32,bf16", "--max-new-tokens", str(MAX_NEW),
                     "--repeats", "2", "--warmup-tokens", "4", "--no-progress"])
    assert code == 0
    return out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answer_files_have_spec_bench_format(run):
    summary = {(r["method"], r["dtype"]): r for r in json.loads((run / "summary.json").read_text())["rows"]
               if r["category"] == "overall"}
    for method in METHODS:
        for dtype in DTYPES:
            rows = read_jsonl(run / f"model-{method}-{dtype}.jsonl")
            speeds = []
            assert [r["question_id"] for r in rows] == [q["question_id"] for q in QUESTIONS]
            assert [r["category"] for r in rows] == [q["category"] for q in QUESTIONS]
            for r in rows:
                assert isinstance(r["choices"], list) and len(r["choices"]) == 1
                c = r["choices"][0]
                assert c["index"] == 0
                assert len(c["turns"]) == len(c["new_tokens"]) == len(c["wall_time"]) == 2
                assert all(isinstance(t, str) for t in c["turns"])
                assert all(type(n) is int and 1 <= n <= MAX_NEW for n in c["new_tokens"])
                assert all(type(t) is float for t in c["wall_time"])
                # a turn's drafting is part of its wall time (both medians over the same repeats)
                assert all(d < t for d, t in zip(c.get("draft_time", []), c["wall_time"], strict=False))
                assert all(type(a) is int and a >= 1 for a in c["accept_lengths"])
                assert sum(c["accept_lengths"]) == sum(c["new_tokens"])
                assert sum(c["decoding_steps"]) == len(c["accept_lengths"])
                if method == "plain":
                    assert set(c["accept_lengths"]) == {1}
                speeds.append(sum(c["new_tokens"]) / sum(c["wall_time"]))  # what speed.py computes per question
            # speed.py's tokens/s (the mean over questions) and mean accepted length, read off the files alone, are
            # exactly the summary's
            assert summary[(method, dtype)]["tokens_per_s"] == statistics.mean(speeds)
            assert summary[(method, dtype)]["mean_accepted"] == statistics.mean(
                n for r in rows for n in r["choices"][0]["accept_lengths"])


def test_lossless_methods_equal_plain_as_equal_py_sees_it(run):
    """equal.py compares str(choices[0]['turns']) line by line: fp32 answers must match plain decoding's."""
    def lines(method):
        return [str(r["choices"][0]["turns"]) for r in read_jsonl(run / f"model-{method}-float32.jsonl")]

    assert lines("ngram") == lines("plain") == lines("pld") == lines("heads")


def test_second_turn_sees_the_same_methods_first_answer(run, model_dir):
    m = api.load(str(model_dir), draft="none")
    row = read_jsonl(run / "model-plain-float32.jsonl")[0]
    first, second = row["choices"][0]["turns"]
    q = QUESTIONS[0]["turns"]
    assert m.generate_plain(q[0], max_new_tokens=MAX_NEW).text.strip() == first
    messages = [{"role": "user", "content": q[0]}, {"role": "assistant", "content": first},
                {"role": "user", "content": q[1]}]
    assert m.generate_plain(messages, max_new_tokens=MAX_NEW).text.strip() == second


def test_summary_table_json_and_plot(run):
    summary = json.loads((run / "summary.json").read_text())
    rows = summary["rows"]
    assert {(r["method"], r["dtype"]) for r in rows} == {(m, d) for m in METHODS for d in DTYPES}
    assert {r["category"] for r in rows} == {"writing", "reasoning", "coding", "overall"}
    assert summary["fastest_plain"] in DTYPES
    for r in rows:
        if r["method"] == "plain":
            assert r["speedup"] == 1.0 and r["mean_accepted"] == 1.0
        if r["dtype"] == "float32":
            assert r["identical"] == r["questions"]  # lossless in fp32
        if r["dtype"] == summary["fastest_plain"]:
            assert r["speedup_vs_fastest_plain"] == pytest.approx(r["speedup"])
    assert summary["meta"]["n_questions"] == 3 and summary["meta"]["repeats"] == 2
    diffs = summary["differences"]["ngram/float32"]
    assert [d["identical"] for d in diffs] == [True] * 3 and diffs[0]["first_difference"] is None
    md = (run / "summary.md").read_text()
    assert "| method | dtype | mean accepted tokens | tokens/s | speed-up | vs fastest plain | identical |" in md
    assert all(f"### {c}" in md for c in ("overall", "writing", "reasoning", "coding"))
    assert md.count("| ngram | float32 |") == 4  # overall and each category
    assert "- ngram/float32: 3/3 identical" in md
    png = (run / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_picture_keeps_its_axes_with_many_long_method_names(tmp_path):
    """An issue-58 run names eight methods, llama.cpp's with ~80-character labels, in two dtypes: the legend wraps
    into as many columns as fit and the figure grows by its rows, so constrained layout keeps every panel (it warned
    'axes sizes collapsed to zero' and drew none before)."""
    import warnings

    from selfspec.tools.plots import plot_summary

    def ans(qid):
        return specbench.Answer(qid, "math", turns=["x"], new_tokens=[4], wall_time=[1.0], accept_lengths=[2, 2],
                                token_ids=[[1, 2, 3, 4]])

    methods = ["plain", "ngram:depth=6,max_nodes=8,copy_depth=12+block_head+skip_after=3@dynamic:12,depth=3,"
               "min_prob=0.05",
               "llamacpp:plain", "llamacpp:ngram-map-k,ngram-n=3,ngram-m=8",
               "llamacpp:eagle3-{dtype}.gguf,p-min=0.6,n=1",
               "llamacpp:ngram-map-k+eagle3-{dtype}.gguf,p-min=0.6,n=1,ngram-n=3,ngram-m=8",
               "llamacpp:dflash-{dtype}.gguf,p-min=0.6,n=2",
               "llamacpp:ngram-map-k+dflash-{dtype}.gguf,p-min=0.6,n=2,ngram-n=3,ngram-m=8"]
    runs = {(m, d): [ans(1), ans(2)] for d in ("bfloat16", "bfloat16-compiled") for m in methods
            if d == "bfloat16" or not m.startswith("llamacpp")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's collapsed-layout warning fails the test
        png = plot_summary(specbench.summarize(runs), tmp_path / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_reports_first_differences():
    def ans(tokens):
        return specbench.Answer(7, "math", turns=["x", "y"], new_tokens=[2, 2], wall_time=[1.0, 1.0],
                                accept_lengths=[1, 1, 1, 1], token_ids=tokens)

    runs = {("plain", "bfloat16"): [ans([[1, 2], [3, 4]])], ("ngram", "bfloat16"): [ans([[1, 2], [3, 5]])]}
    md = specbench.to_markdown(specbench.summarize(runs))
    assert "- ngram/bfloat16: 0/1 identical; q7: turn 2, token 1" in md


def test_summary_from_records_matches_speed_py():
    """Speed-up = mean per-question tok/s over the plain run's; first difference located per turn and token."""
    def ans(qid, cat, tokens, seconds, lengths):
        return specbench.Answer(qid, cat, turns=["x"], new_tokens=[len(tokens)], wall_time=[seconds],
                                accept_lengths=lengths, token_ids=[tokens])

    runs = {
        ("plain", "float32"): [ans(1, "a", [1, 2, 3, 4], 4.0, [1] * 4), ans(2, "b", [5, 6], 1.0, [1, 1])],
        ("fast", "float32"): [ans(1, "a", [1, 2, 3, 4], 1.0, [3, 1]), ans(2, "b", [5, 7], 1.0, [2])],
    }
    s = specbench.summarize(runs)
    overall = {r.method: r for r in s.rows if r.category == "overall"}
    assert overall["fast"].tokens_per_s == pytest.approx((4 / 1 + 2 / 1) / 2)
    assert overall["fast"].speedup == pytest.approx(3.0 / ((1 + 2) / 2))
    assert overall["fast"].mean_accepted == pytest.approx(6 / 3)
    assert overall["fast"].identical == 1
    assert s.differences["fast/float32"][1]["first_difference"] == {"turn": 0, "token": 1}
    with pytest.raises(ValueError, match="need a 'plain' run in every dtype; missing for \\['bfloat16'\\]"):
        specbench.summarize({**runs, ("fast", "bfloat16"): runs[("fast", "float32")]})


def test_the_shipped_mt_bench_file_is_valid():
    if not bench.DEFAULT_QUESTIONS.is_file():
        pytest.fail(f"the shipped question file {bench.DEFAULT_QUESTIONS} is missing")
    questions = specbench.load_questions(bench.DEFAULT_QUESTIONS)
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    assert {q.category for q in questions} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                "stem", "humanities"}
    assert len(specbench.load_questions(bench.DEFAULT_QUESTIONS, limit=12)) == 12
    balanced = specbench.load_questions(bench.DEFAULT_QUESTIONS, per_category=2)
    assert len(balanced) == 16 and all(sum(q.category == c for q in balanced) == 2 for c in {q.category for q in balanced})
    assert [q.question_id for q in balanced if q.category == "math"] == [q.question_id for q in questions if q.category == "math"][:2]
    later = specbench.load_questions(bench.DEFAULT_QUESTIONS, per_category=3, skip_per_category=2)
    math = [q.question_id for q in questions if q.category == "math"]
    assert [q.question_id for q in later if q.category == "math"] == math[2:5]
    assert len(later) == 24 and not {q.question_id for q in later} & {q.question_id for q in balanced}
    assert len(specbench.load_questions(bench.DEFAULT_QUESTIONS, skip_per_category=9)) == 8  # the last of each
    with pytest.raises(ValueError, match="no question is left after skipping the first 10 of each category"):
        specbench.load_questions(bench.DEFAULT_QUESTIONS, skip_per_category=10)


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "category": "x"}\n', r"q.jsonl:1 is not a Spec-Bench question: missing \['turns'\]"),
    ("not json\n", r"q.jsonl:1 is not JSON"),
    ('{"question_id": 1, "category": "x", "turns": "hi"}\n', "turns must be a non-empty list of non-empty strings"),
    ('{"question_id": 1, "category": "x", "turns": ["a"]}\n{"question_id": 1, "category": "x", "turns": ["b"]}\n',
     "q.jsonl:2: question_id 1 appears twice"),
    ("", "holds no questions"),
])
def test_bad_question_file_fails_before_any_model_loads(tmp_path, monkeypatch, capsys, model_dir, content, message):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "q.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        bench.run_bench(bench.BenchConfig(questions=tmp_path / "q.jsonl", model=str(model_dir), out_dir=tmp_path))


def test_missing_inputs_fail_before_any_model_loads(tmp_path, monkeypatch, capsys, model_dir):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    base = ["bench", "--model", str(model_dir), "--out-dir", str(tmp_path / "out")]
    assert cli.main(base + ["--questions", str(questions), "--methods", f"plain,{tmp_path / 'no-heads'}"]) == 2
    assert "draft checkpoint directory" in capsys.readouterr().err
    assert cli.main(base + ["--questions", str(tmp_path / "none.jsonl")]) == 2
    assert "question file" in capsys.readouterr().err
    assert cli.main(base + ["--questions", str(questions), "--methods", "plain,pld:x"]) == 2
    assert "expected pld or pld:N" in capsys.readouterr().err
    assert cli.main(base + ["--questions", str(questions), "--dtype", "fp8"]) == 2
    assert "unknown dtype 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_methods_parse():
    methods = bench.parse_methods(("ngram", "pld:4", "aee"), num_layers=30)
    assert [m.label for m in methods] == ["plain", "ngram", "pld:4", "aee"]  # plain is added and comes first
    assert methods[2].hf_kwargs == {"prompt_lookup_num_tokens": 4}
    assert methods[3].hf_kwargs == {"assistant_early_exit": 15}
    with pytest.raises(ValueError, match="exit layer must be below the target's 30 layers"):
        bench.parse_methods(("aee:30",), num_layers=30)
    with pytest.raises(ValueError, match="two methods share a name"):
        bench.parse_methods(("ngram", "ngram"), num_layers=30)
    merged = bench.parse_methods(("ngram:depth=6+ngram", "ngram:depth=4+ngram"), num_layers=30)  # options tell them apart
    assert [m.label for m in merged] == ["plain", "ngram:depth=6+ngram", "ngram:depth=4+ngram"]


def test_method_lists_keep_options_with_their_method():
    from selfspec.registry import split_drafts

    assert split_drafts("plain, ngram:depth=6,max_nodes=8,runs/h@dynamic:12,depth=3,runs/e+ngram:depth=6,max_nodes=8@auto,aee") \
        == ("plain", "ngram:depth=6,max_nodes=8", "runs/h@dynamic:12,depth=3", "runs/e+ngram:depth=6,max_nodes=8@auto",
            "aee")


def test_a_draft_can_run_with_another_tree_beside_its_own(model_dir, tmp_path):
    from selfspec.core.models import load_model
    from selfspec.core.target import Target
    from selfspec.core.tree import DynamicTree

    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    methods = bench.parse_methods((str(heads), f"{heads}@dynamic:8", f"{heads}@chain:2"), num_layers=2)
    assert [m.label for m in methods] == ["plain", "heads", "heads@dynamic:8", "heads@chain:2"]
    model, tokenizer = load_model(str(model_dir))
    target = Target(model)
    assert bench._runner(methods[2], target, tokenizer, "m").drafter.dynamic == DynamicTree(8)
    assert bench._runner(methods[3], target, tokenizer, "m").drafter.tree == Tree.chain(2)
    with pytest.raises(ValueError, match="bad --tree 'dynamic:x'"):
        bench.parse_methods((f"{heads}@dynamic:x",), num_layers=2)


def test_an_interrupted_run_resumes_where_it_stopped(model_dir, tmp_path, monkeypatch, capsys):
    """Killed after 3 of 6 answers (one torn log line on top): --resume redoes nothing logged, answers the rest, and
    its answer files equal an uninterrupted run's token for token; partial results were readable meanwhile."""
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", "plain,ngram",
            "--dtype", "fp32", "--max-new-tokens", "8", "--warmup-tokens", "0", "--no-progress"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "whole")]) == 0

    real, calls = bench.answer_question, []

    def dies_at_the_fourth(runner, method, question, *args):
        calls.append((method.label, question.question_id))
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(runner, method, question, *args)

    out = tmp_path / "cut"
    monkeypatch.setattr(bench, "answer_question", dies_at_the_fourth)
    assert cli.main([*argv, "--out-dir", str(out)]) == 130  # Ctrl-C: exit 130, saying how to resume
    assert "the same command with --resume continues where this stopped" in capsys.readouterr().err
    log = (out / "answers.jsonl").read_text().splitlines()
    assert [(json.loads(x)["method"], json.loads(x)["answer"]["question_id"]) for x in log] == calls[:3]
    partial = json.loads((out / "summary.json").read_text())
    assert partial["meta"]["n_questions"] == 1 and partial["meta"]["of_questions"] == 3
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "answers.jsonl", "a") as f:
        f.write('{"method": "ngram", "dtype": "float32", "answer": {"question_id": 1')  # a write cut short by the kill

    assert cli.main([*argv, "--out-dir", str(out)]) == 2  # no --resume: refused, nothing overwritten
    assert "already holds a bench run (3 answers logged): pass --resume" in capsys.readouterr().err
    calls.clear()
    assert cli.main([*argv, "--out-dir", str(out), "--resume"]) == 0
    assert calls == [("ngram", 101), ("plain", 121), ("ngram", 121)]
    err = capsys.readouterr().err  # --no-progress: a line per question, counted over the whole run
    assert "bench: question 101 (reasoning) answered, 2/3" in err and "question 121 (coding) answered, 3/3" in err
    for name in ("model-plain-float32.jsonl", "model-ngram-float32.jsonl"):
        assert [r["choices"][0]["turns"] for r in read_jsonl(out / name)] \
            == [r["choices"][0]["turns"] for r in read_jsonl(tmp_path / "whole" / name)]
    manifest = json.loads((out / "run.json").read_text())
    assert len(manifest["segments"]) == 2 and {"cpu", "date", "selfspec", "commit"} <= set(manifest["segments"][1])
    assert json.loads((out / "summary.json").read_text())["meta"]["n_questions"] == 3


def test_a_run_that_failed_before_its_first_answer_does_not_hold_its_out_dir(model_dir, tmp_path, monkeypatch, capsys):
    """A run that logged nothing (here ngram@auto on a machine where prompt lookup was never tuned) leaves its run.json,
    but the same --out-dir takes the next run without --resume: there is nothing in it to lose."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))  # no tuning cached
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--dtype", "fp32", "--max-new-tokens",
            "4", "--warmup-tokens", "0", "--no-progress", "--out-dir", str(tmp_path / "out")]
    for _ in range(2):  # the second time too: the tuning's error, not the out-dir's
        assert cli.main([*argv, "--methods", "plain,ngram@auto"]) == 2
        err = capsys.readouterr().err
        assert "tune-tree" in err and "already holds" not in err
    assert (tmp_path / "out" / "run.json").is_file()
    assert cli.main([*argv, "--methods", "plain,ngram"]) == 0
    assert json.loads((tmp_path / "out" / "run.json").read_text())["methods"] == ["plain", "ngram"]
    assert cli.main([*argv, "--methods", "plain,ngram"]) == 2  # now it holds answers
    assert "already holds a bench run (2 answers logged)" in capsys.readouterr().err


def test_draft_at_auto_keeps_the_tree_the_run_started_with_across_a_resume(model_dir, tmp_path, monkeypatch, capsys):
    """DRAFT@auto is resolved once per run and dtype and recorded in run.json: when tune-tree chooses another tree
    between two segments, the resumed segment still decodes with the first one (a run measures one thing); a new run
    takes the new choice. The summary says which tree @auto stood for."""
    from selfspec.tools import budget
    from selfspec.core.tree import DynamicTree

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(budget, "BUSY", float("inf"))  # cache the tuning even beside other work on the cores
    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    assert cli.main(["tune-tree", "--model", str(model_dir), "--draft", str(heads), "--dtype", "fp32", "--depths", "2",
                     "--budgets", "2,6", "--prompts", "2", "--max-new-tokens", "8", "--no-progress"]) == 0
    tuned = next((tmp_path / "cache").rglob("tree-*.json"))
    first = json.loads(tuned.read_text())["best"]
    first_tree = DynamicTree(first["budget"], depth=first["depth"], min_prob=first["min_prob"])
    first_spec = first_tree.spec
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", f"plain,{heads}@auto",
            "--dtype", "fp32", "--max-new-tokens", "8", "--warmup-tokens", "0", "--no-progress"]

    real, trees, died = bench.answer_question, [], []

    def dies_at_the_third(runner, method, question, *args):
        if method.label == "heads@auto":
            trees.append(runner.drafter.dynamic)
        if len(trees) == 2 and method.label == "heads@auto" and not died:  # once: at the second heads@auto answer
            died.append(True)
            raise KeyboardInterrupt
        return real(runner, method, question, *args)

    monkeypatch.setattr(bench, "answer_question", dies_at_the_third)
    out = tmp_path / "cut"
    assert cli.main([*argv, "--out-dir", str(out)]) == 130
    assert json.loads((out / "run.json").read_text())["auto_trees"] == {"heads@auto": {"float32": first_spec}}
    # tune-tree chooses another tree meanwhile
    other = {**first, "budget": first["budget"] + 3, "depth": 1}
    tuned.write_text(json.dumps({**json.loads(tuned.read_text()), "best": other}))
    assert cli.main([*argv, "--out-dir", str(out), "--resume"]) == 0
    assert set(trees) == {first_tree} and len(trees) == 4
    assert json.loads((out / "run.json").read_text())["auto_trees"] == {"heads@auto": {"float32": first_spec}}
    assert f"heads@auto {first_spec} (float32)" in (out / "summary.md").read_text()
    trees.clear()
    assert cli.main([*argv, "--out-dir", str(tmp_path / "new")]) == 0  # a new run: the new choice
    assert set(trees) == {DynamicTree(other["budget"], depth=1, min_prob=other["min_prob"])}
    capsys.readouterr()


def test_resume_refuses_a_run_that_measured_something_else(model_dir, tmp_path, monkeypatch, capsys):
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", "plain",
            "--dtype", "fp32", "--warmup-tokens", "0", "--no-progress", "--out-dir", str(tmp_path / "out")]
    assert cli.main([*argv, "--max-new-tokens", "4"]) == 0
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main([*argv, "--max-new-tokens", "8", "--resume"]) == 2
    assert "max_new_tokens: the run has 4, this command 8" in capsys.readouterr().err


def test_a_directory_with_results_but_no_run_log_is_not_overwritten(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(out)]
    for extra in ([], ["--resume"]):
        assert cli.main([*argv, *extra]) == 2
        assert "holds summary.json of a bench run but no run.json" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_a_sampled_run_seeds_every_turn_alike_and_reports_no_identity(model_dir, tmp_path, monkeypatch, capsys):
    """--temperature > 0: every method samples each turn with seed + 1000 x question id + turn (repeats draw the same
    tokens: the repeats check passes), the answers are exactly what generate / generate_plain give with that seed,
    they differ from greedy ones, and the summary compares speeds, not tokens; a resume that would sample otherwise
    is refused."""
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:2])
    heads = tiny_chat_model.build_heads(model_dir, tmp_path / "heads")
    out = tmp_path / "out"
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", f"plain,ngram,{heads}",
            "--dtype", "fp32", "--max-new-tokens", str(MAX_NEW), "--warmup-tokens", "4", "--no-progress",
            "--out-dir", str(out), "--temperature", "1.5", "--top-p", "0.95", "--min-p", "0.02", "--seed", "7"]
    assert cli.main([*argv, "--repeats", "2"]) == 0
    capsys.readouterr()

    m = api.load(str(model_dir), draft="ngram")
    h = api.load(str(model_dir), draft=str(heads))
    greedy_differs = False
    for q in QUESTIONS[:2]:
        got = {name: next(r for r in read_jsonl(out / f"model-{name}-float32.jsonl")
                          if r["question_id"] == q["question_id"])["choices"][0]
               for name in ("plain", "ngram", "heads")}
        for name, runner, call in (("plain", m, m.generate_plain), ("ngram", m, m.generate), ("heads", h, h.generate)):
            messages = []
            for turn, text in enumerate(q["turns"]):
                messages.append({"role": "user", "content": text})
                seed = bench.turn_seed(7, q["question_id"], turn)
                assert seed == 7 + 1000 * q["question_id"] + turn
                r = call(messages, max_new_tokens=MAX_NEW, temperature=1.5, top_p=0.95, min_p=0.02, seed=seed)
                assert r.text.strip() == got[name]["turns"][turn], (name, q["question_id"], turn)
                greedy_differs |= r.text.strip() != runner.generate_plain(messages, max_new_tokens=MAX_NEW).text.strip()
                messages.append({"role": "assistant", "content": got[name]["turns"][turn]})
    assert greedy_differs  # the run sampled

    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["sampling"] == {"temperature": 1.5, "top_p": 0.95, "top_k": 0, "seed": 7, "min_p": 0.02}
    assert summary["differences"] == {} and {r["identical"] for r in summary["rows"]} == {None}
    md = (out / "summary.md").read_text()
    assert "Sampled (temperature 1.5, top-p 0.95, top-k 0, min-p 0.02;" in md and "not compared token for token" in md
    assert "| method | dtype | mean accepted tokens | tokens/s | speed-up | vs fastest plain |" in md
    assert "identical" not in md.split("### overall")[1]

    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main([*argv[:-2], "--seed", "8", "--resume"]) == 2
    assert "sampling: the run has" in capsys.readouterr().err
    assert cli.main([*argv[:-8], "--resume"]) == 2  # greedy now
    assert "sampling: the run has {'temperature': 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "expected temperature >= 0, 0 < top_p <= 1, top_k >= 0 and 0 <= min_p <= 1, found "
                              "temperature -1.0"),
    (["--temperature", "1", "--min-p", "1.5"], "min_p 1.5"),
    (["--temperature", "1", "--top-p", "0"], "found temperature 1.0, top_p 0.0"),
    (["--temperature", "1", "--top-k", "-2"], "top_k -2"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0 (1.0 = off), found 0.0"),
])
def test_bad_sampling_arguments_fail_before_any_model_loads(tmp_path, monkeypatch, capsys, model_dir, flags, message):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(tmp_path / "out")]
    assert cli.main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_repetition_penalty_applies_to_every_method_plain_included(model_dir, tmp_path, capsys):
    """--repetition-penalty: selfspec's greedy answers still equal plain decoding's (which gets the same penalty),
    they differ from the answers without it, and the run records it (a resume without it is refused)."""
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", "plain,ngram", "--dtype",
            "fp32", "--max-new-tokens", "24", "--warmup-tokens", "0", "--no-progress"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "off")]) == 0
    assert cli.main([*argv, "--out-dir", str(tmp_path / "pen"), "--repetition-penalty", "1.5"]) == 0

    def turns(run, method):
        return [r["choices"][0]["turns"] for r in read_jsonl(tmp_path / run / f"model-{method}-float32.jsonl")]

    assert turns("pen", "ngram") == turns("pen", "plain") != turns("off", "plain")
    assert json.loads((tmp_path / "pen" / "summary.json").read_text())["meta"]["repetition_penalty"] == 1.5
    capsys.readouterr()
    assert cli.main([*argv, "--out-dir", str(tmp_path / "pen"), "--resume"]) == 2
    assert "repetition_penalty" in capsys.readouterr().err


def test_stop_strings_end_every_methods_turns_alike(model_dir, tmp_path, capsys):
    """--stop: every method's turn ends after the token that completes the stop string, plain decoding's included,
    and selfspec's greedy answers still equal plain decoding's; the run records the strings (a resume without them is
    refused) and its summary says so."""
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", "plain,pld,ngram",
            "--dtype", "fp32", "--max-new-tokens", "24", "--warmup-tokens", "0", "--no-progress"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "free")]) == 0

    def turns(run, method):
        return [r["choices"][0]["turns"] for r in read_jsonl(tmp_path / run / f"model-{method}-float32.jsonl")][0]

    free = turns("free", "plain")
    # the first word of three letters or more that the answers hold before their last characters
    t, word = next((t, m) for t, text in enumerate(free) for m in re.finditer("[A-Za-z]{3,}", text)
                   if m.end() < len(text) - 1)
    stop = word.group()[:2]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "stop"), "--stop", stop]) == 0
    stopped = turns("stop", "plain")
    assert stopped[:t] == free[:t] and stop not in "".join(free[:t])
    assert stop in stopped[t] and free[t].startswith(stopped[t]) and len(stopped[t]) < len(free[t])
    assert turns("stop", "ngram") == turns("stop", "pld") == stopped
    assert json.loads((tmp_path / "stop" / "summary.json").read_text())["meta"]["stop"] == [stop]
    assert f"with stop strings [{stop!r}]." in (tmp_path / "stop" / "summary.md").read_text()
    capsys.readouterr()
    assert cli.main([*argv, "--out-dir", str(tmp_path / "stop"), "--resume"]) == 2
    assert "stop" in capsys.readouterr().err


def test_min_new_tokens_holds_off_every_methods_end_alike(model_dir, tmp_path, caplog):
    """--min-new-tokens: a turn that ended early (the tiny model's first answer: 2 tokens) runs on to at least that
    many for every method, and selfspec's answers still equal plain decoding's; transformers' generate is not warned
    of a min_length beside it."""
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--methods", "plain,pld,ngram",
            "--dtype", "fp32", "--max-new-tokens", "24", "--warmup-tokens", "0", "--no-progress"]
    assert cli.main([*argv, "--out-dir", str(tmp_path / "free")]) == 0
    assert cli.main([*argv, "--out-dir", str(tmp_path / "min"), "--min-new-tokens", "6"]) == 0

    def answer(run, method):
        return read_jsonl(tmp_path / run / f"model-{method}-float32.jsonl")[0]["choices"][0]

    assert answer("free", "plain")["new_tokens"][0] < 6 <= answer("min", "plain")["new_tokens"][0]
    assert answer("min", "ngram")["turns"] == answer("min", "pld")["turns"] == answer("min", "plain")["turns"]
    assert json.loads((tmp_path / "min" / "summary.json").read_text())["meta"]["min_new_tokens"] == 6
    assert "with min_new_tokens 6." in (tmp_path / "min" / "summary.md").read_text()
    assert "seem to have been set" not in caplog.text


@pytest.mark.parametrize("flags, message", [
    (["--methods", "plain,foo"], "method 'foo': unknown --draft 'foo': expected 'none', 'ngram'"),
    (["--methods", "plain,ngram@chain:3"], "method 'ngram@chain:3': --tree does not apply to --draft ngram"),
    (["--methods", "plain,ngram:max_nodes=8@dynamic:16"],
     "method 'ngram:max_nodes=8@dynamic:16': --tree dynamic:16 sizes prompt lookup's trie, and --draft "
     "ngram:max_nodes=8 sets max_nodes too"),
    (["--methods", "plain,ngram@chain:x"], "method 'ngram@chain:x': bad --tree 'chain:x'"),
    (["--device", "bogus"], "unknown device 'bogus'"),
])
def test_bad_methods_and_devices_fail_before_any_model_loads(tmp_path, monkeypatch, capsys, model_dir, flags,
                                                              message):
    """A method's error names the method and what a method can be; a tree its draft cannot take fails with the
    specs alone."""
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(tmp_path / "out")]
    assert cli.main([*argv, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and ("(a method is plain, pld[:N], aee[:E], or a draft" in err) == ("method" in message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--min-new-tokens", "-1"], "min_new_tokens must be between 0 and max_new_tokens (8), found -1"),
    (["--min-new-tokens", "9"], "min_new_tokens must be between 0 and max_new_tokens (8), found 9"),
])
def test_bad_limits_fail_before_any_model_loads(tmp_path, monkeypatch, capsys, model_dir, flags, message):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    questions = write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(tmp_path / "out"),
            "--max-new-tokens", "8"]
    assert cli.main([*argv, *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_sampled_run_takes_string_question_ids(model_dir, tmp_path):
    """Spec-Bench files may name questions by strings (specbench reads them): a sampled run seeds each turn from the
    id's CRC-32 (the same for every method and repeat, different across questions and turns) and answers exactly what
    generate gives with that seed."""
    rows = [dict(q, question_id=f"mt_{q['question_id']}") for q in QUESTIONS[:2]]
    out = tmp_path / "out"
    argv = ["bench", "--model", str(model_dir), "--questions", str(write_questions(tmp_path / "q.jsonl", rows)),
            "--methods", "ngram", "--dtype", "fp32", "--max-new-tokens", str(MAX_NEW), "--warmup-tokens", "0",
            "--no-progress", "--out-dir", str(out), "--temperature", "1.5", "--seed", "7", "--repeats", "2"]
    assert cli.main(argv) == 0
    seeds = {(r["question_id"], t): bench.turn_seed(7, r["question_id"], t) for r in rows for t in range(2)}
    assert seeds[("mt_81", 1)] == 7 + 1000 * zlib.crc32(b"mt_81") + 1 and len(set(seeds.values())) == 4
    m = api.load(str(model_dir), draft="ngram")
    answers = {r["question_id"]: r["choices"][0]["turns"] for r in read_jsonl(out / "model-ngram-float32.jsonl")}
    for row in rows:
        messages = []
        for turn, text in enumerate(row["turns"]):
            messages.append({"role": "user", "content": text})
            r = m.generate(messages, max_new_tokens=MAX_NEW, temperature=1.5, seed=seeds[(row["question_id"], turn)])
            assert r.text.strip() == answers[row["question_id"]][turn]
            messages.append({"role": "assistant", "content": answers[row["question_id"]][turn]})


def test_the_drafters_own_time_per_step_is_recorded_for_selfspecs_methods(run):
    """Each selfspec method's answers record, per turn, the seconds its drafter spent drafting (Answer.draft_time,
    the median over repeats as wall_time is); summary rows give it per drafting step (the prefill drafts nothing)
    exactly as recomputed from the answer files, and transformers' methods, which do not measure it, give none."""
    summary = json.loads((run / "summary.json").read_text())
    for r in (r for r in summary["rows"] if r["category"] == "overall"):
        choices = [row["choices"][0] for row in read_jsonl(run / f"model-{r['method']}-{r['dtype']}.jsonl")]
        if r["method"] in ("plain", "pld"):
            assert r["draft_ms"] is None and all("draft_time" not in c for c in choices)
            continue
        assert all(len(c["draft_time"]) == len(c["turns"]) for c in choices)
        steps = sum(s - 1 for c in choices for s in c["decoding_steps"])
        assert r["draft_ms"] == 1000 * sum(t for c in choices for t in c["draft_time"]) / steps > 0
    md = (run / "summary.md").read_text()
    assert "| identical | draft ms/step |" in md and "| plain | float32 |" in md
    plain_row = next(line for line in md.splitlines() if line.startswith("| plain | float32 |"))
    assert plain_row.endswith("| — |")
