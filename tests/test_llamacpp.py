"""llama.cpp as a peer of ``infer.py bench`` (selfspec/tools/llamacpp.py): what a ``llamacpp:`` method means and the
flags its llama-server gets, its answers read from llama.cpp's own timings, its rows compared with llama.cpp's plain
decoding, and bad input refused before anything loads. Where llama-server and llama.cpp's source tree are found
($LLAMA_SERVER or PATH, $LLAMA_CPP_DIR), one bench run on a tiny model runs llama.cpp's methods beside selfspec's
(skipped, saying why, where they are not)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from selfspec.registry import split_drafts
from selfspec.tools import bench, cli, llamacpp, specbench

QUESTIONS = [{"question_id": 81, "category": "writing", "turns": ["Write about the sea.", "Now shorter."]},
             {"question_id": 101, "category": "reasoning", "turns": ["the quick brown fox", "and the dog?"]}]


def draft_gguf(path: Path, arch: str, markov: bool = False) -> Path:
    """A GGUF whose metadata names ``arch`` (what the method reads of a draft file)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("markov_w1.weight" if markov else "fc.weight", np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def drafts(tmp_path):
    for dtype in ("f32", "bf16"):
        draft_gguf(tmp_path / f"eagle3-{dtype}.gguf", "eagle3")
        draft_gguf(tmp_path / f"dflash-{dtype}.gguf", "dflash")
    draft_gguf(tmp_path / "dspark.gguf", "dflash", markov=True)
    draft_gguf(tmp_path / "small-lm.gguf", "llama")
    (tmp_path / "not.gguf").write_text("hello")
    return tmp_path


def test_methods_parse_into_labels_and_server_flags(drafts):
    plain = llamacpp.parse_method("llamacpp:plain")
    assert (plain.label, plain.server_args("float32")) == ("llamacpp:plain", [])
    mode = llamacpp.parse_method("llamacpp:ngram-mod,ngram-n=12,ngram-m=24")
    assert mode.label == "llamacpp:ngram-mod,ngram-n=12,ngram-m=24"
    assert mode.server_args("bfloat16") == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "12",
                                            "--spec-ngram-mod-n-max", "24"]
    spec = f"llamacpp:ngram-mod+{drafts}/eagle3-{{dtype}}.gguf,n=3,p-min=0.5"
    both = llamacpp.parse_method(spec, ("float32", "bfloat16"))
    assert both.label == "llamacpp:ngram-mod+eagle3-{dtype}.gguf,n=3,p-min=0.5"
    assert both.server_args("bfloat16") == ["--spec-type", "ngram-mod,draft-eagle3", "-md",
                                            f"{drafts}/eagle3-bf16.gguf", "--spec-draft-n-max", "3",
                                            "--spec-draft-p-min", "0.5"]
    assert llamacpp.parse_method(f"llamacpp:{drafts}/dflash-{{dtype}}.gguf").server_args("float32")[:2] == \
        ["--spec-type", "draft-dflash"]
    assert llamacpp.parse_method(f"llamacpp:{drafts}/dspark.gguf").server_args("float32")[1] == "draft-dspark"
    assert llamacpp.parse_method(f"llamacpp:{drafts}/small-lm.gguf").server_args("float32")[1] == "draft-simple"
    # in a --methods list, a llama.cpp method keeps its options (keys with '-' too)
    listed = f"plain,llamacpp:ngram-mod,ngram-n=4,ngram-min=2,llamacpp:{drafts}/eagle3-f32.gguf,n=2,p-min=0.2,ngram"
    assert llamacpp.join_options(split_drafts(listed)) == (
        "plain", "llamacpp:ngram-mod,ngram-n=4,ngram-min=2", f"llamacpp:{drafts}/eagle3-f32.gguf,n=2,p-min=0.2",
        "ngram")


@pytest.mark.parametrize("spec, message", [
    ("llamacpp:", "expected llamacpp:plain, or llamacpp:PART"),
    ("llamacpp:plain,n=3", "llamacpp:plain takes no options"),
    ("llamacpp:ngram-modd", "found 'ngram-modd'"),
    ("llamacpp:ngram-mod+ngram-mod", "mode ngram-mod is named twice"),
    ("llamacpp:ngram-mod,n=3", "n sets a draft GGUF's drafting, and the method has none"),
    ("llamacpp:ngram-cache,ngram-n=3", "ngram-n applies to ngram-mod, ngram-simple, ngram-map-k, ngram-map-k4v"),
    ("llamacpp:ngram-mod,ngram-n=x", "ngram-n expects a whole number in 1..1024, found 'x'"),
    ("llamacpp:ngram-mod,ngram-min=9,ngram-m=4", "expected ngram-min <= ngram-m, found 9 > 4"),
    ("llamacpp:ngram-mod,depth=3", "expected options key=value with key among"),
    ("llamacpp:DIR/not.gguf", "expected a GGUF file (starting with b'GGUF')"),
    ("llamacpp:DIR/missing.gguf", "expected a GGUF file, found nothing"),
    ("llamacpp:DIR/eagle3-{dtype}.gguf+DIR/dflash-f32.gguf", "expected at most one draft GGUF, found 2"),
    ("llamacpp:DIR/eagle3-{dtype}.gguf,p-min=2", "p-min expects a number in 0.0..1.0, found '2'"),
])
def test_bad_methods_say_what_was_expected(drafts, spec, message):
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        llamacpp.parse_method(spec.replace("DIR", str(drafts)), ("float32",))
    assert message in str(err.value)


def test_a_dtype_without_its_draft_file_fails_at_parse(drafts):
    with pytest.raises(FileNotFoundError, match="found nothing at .*eagle3-f16.gguf"):
        llamacpp.parse_method(f"llamacpp:{drafts}/eagle3-{{dtype}}.gguf", ("float32", "float16"))


RESPONSE = {"tokens": [5, 6, 7, 8, 9, 2], "timings": {"prompt_ms": 10.0, "predicted_ms": 40.0, "draft_n": 6,
                                                     "draft_n_accepted": 3}}


def test_an_answer_is_read_from_llama_cpps_own_timings():
    result = llamacpp.to_result(RESPONSE, lambda ids: " ".join(map(str, ids)))
    assert result.tokens == [5, 6, 7, 8, 9, 2] and result.text == "5 6 7 8 9 2"
    assert result.stats.new_tokens == 6 and result.stats.seconds == pytest.approx(0.05)
    assert (result.stats.steps, result.stats.drafted, result.stats.accepted) == (3, 6, 3)  # 6 tokens, 3 of them drafts
    assert result.stats.accept_lengths == ()  # llama.cpp reports totals, not each step's
    plain = llamacpp.to_result({"tokens": [5, 6], "timings": {"prompt_ms": 1.0, "predicted_ms": 2.0}}, str)
    assert (plain.stats.steps, plain.stats.drafted) == (2, 0)
    with pytest.raises(llamacpp.ServerError, match="expected 'tokens' and 'timings' in its answer, found keys"):
        llamacpp.to_result({"content": "x"}, str)


def answer(qid: int, tokens: list[list[int]], seconds: float, steps: list[int] | None = None,
           drafted: list[int] | None = None, accepted: list[int] | None = None) -> specbench.Answer:
    lengths = [] if drafted else [1] * sum(len(t) for t in tokens)
    return specbench.Answer(qid, "writing", turns=["x"] * len(tokens), token_ids=tokens,
                            new_tokens=[len(t) for t in tokens], wall_time=[seconds] * len(tokens),
                            decoding_steps=steps or [len(t) for t in tokens], accept_lengths=lengths,
                            draft_tokens=drafted or [], draft_accepted=accepted or [])


def test_llama_cpp_rows_compare_with_llama_cpps_plain_decoding():
    runs = {("plain", "float32"): [answer(1, [[1, 2, 3, 4]], 1.0)],
            ("llamacpp:plain", "float32"): [answer(1, [[1, 2, 3, 5]], 0.25)],
            ("llamacpp:ngram-mod", "float32"): [answer(1, [[1, 2, 3, 5]], 0.125, [2], [4], [2])]}
    refs = llamacpp.references([m for m, _ in runs])
    assert refs == {"llamacpp:ngram-mod": "llamacpp:plain"}
    summary = specbench.summarize(runs, references=refs)
    rows = {r.method: r for r in summary.rows if r.category == "overall"}
    assert rows["llamacpp:plain"].identical == 0 and rows["llamacpp:plain"].speedup == pytest.approx(4.0)
    assert rows["llamacpp:ngram-mod"].identical == 1  # against llama.cpp's own plain decoding
    assert rows["llamacpp:ngram-mod"].speedup == pytest.approx(2.0)
    assert rows["llamacpp:ngram-mod"].speedup_vs_fastest_plain == pytest.approx(8.0)
    assert rows["llamacpp:ngram-mod"].mean_accepted == pytest.approx(2.0)  # 4 tokens over 2 target forwards
    text = specbench.to_markdown(summary)
    assert "Speed-up and identical of llamacpp:ngram-mod: against llamacpp:plain" in text
    assert "- llamacpp:ngram-mod/float32: 1/1 identical to llamacpp:plain" in text
    line = json.loads(specbench.answer_lines(runs[("llamacpp:ngram-mod", "float32")], "m"))
    assert line["choices"][0]["draft_tokens"] == [4] and line["choices"][0]["draft_accepted"] == [2]


def write_questions(path: Path) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.mark.parametrize("flags, message", [
    (["--methods", "plain,llamacpp:plain"], "expected the target as a GGUF file, --llama-model PATH"),
    (["--methods", "llamacpp:plain", "--llama-model", "M", "--temperature", "0.7"],
     "llama.cpp methods decode greedily with no repetition penalty, stop strings or min_new_tokens; found sampling"),
    (["--methods", "llamacpp:plain", "--llama-model", "M", "--stop", "\n\n"], "found stop strings"),
    (["--methods", "llamacpp:plain", "--llama-model", "DIR/missing-{dtype}.gguf", "--dtype", "fp32"],
     "--llama-model DIR/missing-{dtype}.gguf (float32): expected a GGUF file, found nothing"),
    (["--methods", "llamacpp:plain", "--llama-model", "DIR/eagle3-{dtype}.gguf", "--llama-server", "DIR/nothing"],
     "expected --llama-server PATH, $LLAMA_SERVER, or llama-server on PATH; found no executable"),
])
def test_bad_llama_cpp_runs_fail_before_any_model_loads(drafts, monkeypatch, capsys, model_dir, flags, message):
    monkeypatch.setattr(bench, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setenv("LLAMA_SERVER", str(drafts / "nothing"))
    questions = write_questions(drafts / "q.jsonl")
    argv = ["bench", "--model", str(model_dir), "--questions", str(questions), "--out-dir", str(drafts / "out")]
    flags = [f.replace("DIR", str(drafts)).replace("M", str(drafts / "eagle3-f32.gguf")) if f != "--methods" and
             "llamacpp" not in f else f for f in flags]
    assert cli.main([*argv, *flags]) == 2
    assert message.replace("DIR", str(drafts)) in capsys.readouterr().err
    assert not (drafts / "out").exists()


# ------------------------------------------------------------------------------------ with llama.cpp (skips without)
def test_llama_cpp_methods_run_beside_selfspecs_in_one_bench(tmp_path):
    """A tiny Llama (SmolLM2's tokenizer) converted by llama.cpp's converter; one bench run with selfspec's plain
    decoding (uncompiled and compiled: ``--compile both``), llama.cpp's plain decoding and its n-gram mode: answer
    files and rows for each, llama.cpp's methods once (compiling selfspec's target does not change them), llama.cpp's
    n-gram mode token-identical to llama.cpp's plain decoding."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "heads"))
    import test_gguf  # tests/heads: the tiny target and its GGUF

    from heads import gguf_export
    from selfspec.core.models import DEFAULT_MODEL, resolve

    root = os.environ.get(gguf_export.CONVERTER_ENV)
    if not root or not (Path(root) / gguf_export.CONVERTER).is_file():
        pytest.skip(f"llama.cpp's source tree not found: set ${gguf_export.CONVERTER_ENV}")
    try:
        llamacpp.find_server()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    target_dir, _, _ = test_gguf.write_case("eagle3", tmp_path, tokenizer_from=Path(resolve(DEFAULT_MODEL)[0]))
    target = gguf_export.convert_model(target_dir, tmp_path / "target-f32.gguf", "f32", root)
    out = tmp_path / "out"
    assert cli.main(["bench", "--model", str(target_dir), "--questions", str(write_questions(tmp_path / "q.jsonl")),
                     "--out-dir", str(out), "--methods", "plain,llamacpp:plain,llamacpp:ngram-mod,ngram-n=2",
                     "--dtype", "fp32", "--llama-model", str(tmp_path / "target-{dtype}.gguf"), "--max-new-tokens",
                     "16", "--no-progress", "--compile", "both"]) == 0
    assert target.is_file()
    summary = json.loads((out / "summary.json").read_text())
    rows = {(r["method"], r["dtype"]): r for r in summary["rows"] if r["category"] == "overall"}
    assert set(rows) == {("plain", "float32"), ("plain", "float32-compiled"), ("llamacpp:plain", "float32"),
                         ("llamacpp:ngram-mod,ngram-n=2", "float32")}
    assert rows[("llamacpp:ngram-mod,ngram-n=2", "float32")]["identical"] == 2
    assert summary["references"] == {"llamacpp:ngram-mod,ngram-n=2": "llamacpp:plain"}
    lines = [json.loads(x) for x in (out / "target-llamacpp-plain-float32.jsonl").read_text().splitlines()]
    assert [x["question_id"] for x in lines] == [81, 101] and all(len(x["choices"][0]["turns"]) == 2 for x in lines)
    run = json.loads((out / "run.json").read_text())
    assert "llama_server_version" in run["segments"][0]
    assert set(run["segments"][0]["warmup_s"]["float32-compiled"]) == {"plain"}  # no llama-server warmed up twice
    assert not list(out.glob("*llamacpp*compiled*.jsonl"))


def test_the_cost_model_splits_a_step_into_verification_and_drafting(drafts):
    """selfspec.tools.llamacpp_costs: a draft's lengths expand into one configuration each; a step's time less
    llama-bench's verification of its 1 + drafted tokens is the drafting's cost; the prediction scales the target's
    part alone."""
    import argparse

    from selfspec.tools import llamacpp_costs as costs

    assert [label for label, _ in costs.expand(costs._join_lengths(
        ["ngram-mod", f"{drafts}/eagle3-f32.gguf", "n=1:3", "p-min=0.5"]))] == \
        ["ngram-mod", "eagle3-f32.gguf,p-min=0.5,n=1", "eagle3-f32.gguf,p-min=0.5,n=3"]
    verify = {1: 8.0, 2: 9.0, 4: 11.0}
    assert costs.interpolate(verify, 3) == 10.0 and costs.interpolate(verify, 8) == 22.0
    turn = lambda tokens, ms, drafted, accepted: {"tokens": tokens, "predicted_ms": ms,  # noqa: E731
                                                  "predicted_n": len(tokens), "draft_n": drafted,
                                                  "draft_n_accepted": accepted}
    plain = costs.Config("plain", [], [turn(list(range(11)), 80.0, 0, 0)])
    plain.turns[0]["top2"] = [[0.5, 0.45]] * 11
    # 10 decoded tokens in 4 steps (6 of them drafts accepted, of 12 drafted): 15 ms a step, 3 drafted a step
    draft = costs.Config("d", [], [turn([*range(5), 9, *range(6, 11)], 60.0, 12, 6)])
    result = costs.report([plain, draft], verify, argparse.Namespace(llama_model="m", questions=1, max_new_tokens=10,
                                                                      depth=256, threads=2, scale=[10]))
    row = result["rows"][1]
    assert (row["step_ms"], row["drafted_per_step"], row["tokens_per_step"]) == (15.0, 3.0, 2.5)
    assert row["draft_ms_per_step"] == 4.0  # 15 - verify(4 tokens) = 15 - 11
    assert row["tokens_per_step_to_pay"] == 15.0 / 8.0
    assert row["predicted_speedup"]["10"] == pytest.approx(10 * 8 * 2.5 / (10 * 11 + 4))
    assert result["rows"][0]["predicted_speedup"]["10"] == 1.0
    assert row["identical"] == 0 and row["differences"] == [{"prompt": 0, "token": 5, "plain_top2": [0.5, 0.45],
                                                              "near_tie": True}]
    assert "| d | " in costs.to_markdown(result)


def test_probabilities_count_only_where_they_follow_the_tokens():
    """llama.cpp may report a character split over byte tokens as one entry: from there on its list is not the
    tokens', and a difference there is not judged a near-tie or not."""
    from selfspec.tools import llamacpp_costs as costs

    step = lambda token, p: {"id": token, "top_logprobs": [{"logprob": np.log(p)}, {"logprob": np.log(1 - p)}]}  # noqa: E731
    aligned = costs.top2({"tokens": [5, 6], "completion_probabilities": [step(5, 0.5), step(6, 0.9)]})
    assert [[round(x, 6) for x in pair] for pair in aligned] == [[0.5, 0.5], [0.9, 0.1]]
    merged = costs.top2({"tokens": [5, 6, 7], "completion_probabilities": [step(5, 0.5), step(9, 0.9)]})
    assert merged[0] and merged[1:] == [[], []]
