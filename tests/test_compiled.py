"""A compiled target (``selfspec.core.compiled``, infer.py --compile): torch.compile (inductor, real C++ kernels on this CPU)
really runs, greedy speculative decoding through it is token-identical to ``generate`` running the same compiled
forward, over trees, chains and plain steps whose sizes vary without recompiling each time; a machine without a C++
compiler is told so before anything loads; tuned trees and bench runs keep compiled and uncompiled apart."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from conftest import REPEATING, VOCAB, random_prompts, reference, tiny_model
from selfspec import NGramDrafter, Target, Tree
from selfspec.core.generate import generate
from selfspec.core.compiled import check_compilable, compile_forward, is_compiled
from selfspec.testing import OracleDrafter

NEW = 24


@pytest.fixture(scope="module")
def compiled_llama():
    torch._dynamo.reset()
    model = compile_forward(tiny_model("llama", vocab=VOCAB, initializer_range=REPEATING))
    yield model
    torch._dynamo.reset()


def test_compiled_decoding_is_token_identical_to_generate_with_the_same_forward(compiled_llama):
    from torch._dynamo.utils import counters

    counters.clear()
    target = Target(compiled_llama)
    prompts = random_prompts(8, VOCAB, seed=7, min_len=4, max_len=12)
    accepted, graphs = 0, []
    for i, prompt in enumerate(prompts):
        ref = reference(compiled_llama, prompt, NEW)  # plain greedy generate, through the compiled forward
        ngram = generate(target, NGramDrafter(), prompt, NEW)  # trees of varying size, chains, single steps
        assert ngram.tokens == ref, f"prompt {i}: prompt lookup through the compiled target left plain decoding"
        oracle = generate(target, OracleDrafter(Tree.full([2, 2]), VOCAB, ref), prompt, NEW)
        assert oracle.tokens == ref, f"prompt {i}: a 6-node tree through the compiled target left plain decoding"
        accepted += sum(len(s.tokens) for s in oracle.steps) - len(oracle.steps)
        graphs.append(counters["stats"]["unique_graphs"])
    assert accepted > NEW * len(prompts) // 2  # the oracle's drafts were accepted: trees really were verified
    # compiled, not silently eager; and once every kind of call has been seen (the first prompts), other prompt
    # lengths, cache lengths and tree sizes reuse the graphs instead of compiling new ones
    assert graphs[0] >= 1 and graphs[-1] == graphs[len(prompts) // 2], f"graphs after each prompt: {graphs}"
    assert is_compiled(compiled_llama)
    assert compile_forward(compiled_llama) is compiled_llama  # idempotent: not compiled twice


def test_compiled_forward_computes_what_the_uncompiled_one_does(compiled_llama):
    eager = tiny_model("llama", vocab=VOCAB, initializer_range=REPEATING)
    ids = torch.arange(10)[None] % VOCAB
    with torch.inference_mode():
        got, want = compiled_llama(ids).logits, eager(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_no_cpp_compiler_is_told_before_anything_loads():
    from torch._inductor import config

    from selfspec.core.models import load_model

    with config.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # a machine whose only C++ compiler is not there
        with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .*install g\+\+ or clang\+\+ .*without --compile"):
            check_compilable("cpu")
        with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler"):  # before any weights: the path is never read
            load_model("/nonexistent/model-dir", compile=True)
    check_compilable("cpu")  # this machine has one


def test_tuning_and_bench_runs_keep_compiled_targets_apart():
    from selfspec.tools.bench import BenchConfig, _manifest, parse_methods
    from selfspec.tuned import machine_key

    model = tiny_model("llama")
    plain_key = machine_key(Target(model), "tiny")
    assert "compiled" not in plain_key  # uncompiled keys as before: caches tuned earlier still apply
    assert machine_key(Target(compile_forward(tiny_model("llama"))), "tiny") == {**plain_key, "compiled": True}

    methods = parse_methods(("plain",), 2, None)
    args = ([], methods, ["float32"])
    assert "compile" not in _manifest(BenchConfig(), *args)
    assert _manifest(BenchConfig(compile=True), *args)["compile"] is True  # a resume must match (bench_log)


def test_selfspec_decoding_compiles_one_graph_for_every_step():
    """Prefill, chains, trees of every size, a lone root: the verify step has one form (a mask, 2+ nodes), the prefill
    runs uncompiled, and transformers' output-capture hooks are installed before compiling: no graph breaks, and after
    the first prompt no new graph, whatever the cache's length and layout (a view after a crop, or not); and the one
    graph is traced once (no restarted analysis: the modules' float attributes are constants)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    torch._dynamo.reset()
    counters.clear()
    compilation_time_metrics.clear()
    model = compile_forward(tiny_model("llama", vocab=VOCAB, initializer_range=REPEATING))
    target = Target(model)
    graphs, sizes = [], set()
    for prompt in random_prompts(6, VOCAB, seed=11, min_len=4, max_len=14):
        ref = reference(tiny_model("llama", vocab=VOCAB, initializer_range=REPEATING), prompt, NEW)  # uncompiled
        oracle = generate(target, OracleDrafter(Tree.full([3, 2]), VOCAB, ref), prompt, NEW)  # trees, mostly accepted
        ngram = generate(target, NGramDrafter(), prompt, NEW)  # chains, trees, lone roots
        assert oracle.tokens == ngram.tokens  # both lossless against the same compiled forward
        sizes |= {s.tree_size for s in oracle.steps + ngram.steps}
        graphs.append(counters["stats"]["unique_graphs"])
    assert {1, 2} <= sizes and len(sizes) > 8, f"tree sizes verified: {sorted(sizes)}"  # lone roots, chains, trees
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert graphs == [1] * len(graphs), f"graphs after each prompt: {graphs}"  # one, from the first step on
    attempts = sorted(k for k in compilation_time_metrics if k.startswith("compile_attempt_"))
    assert attempts == ["compile_attempt_0"], f"the graph's trace was restarted: {attempts}"
    torch._dynamo.reset()


def test_bench_compares_a_compiled_target_with_an_uncompiled_one_in_one_run(model_dir, tmp_path):
    """``bench --compile both``: every method on the uncompiled and on the compiled target side by side (rows
    'float32' and 'float32-compiled'), each warm-up's seconds in run.json, every fp32 answer plain decoding's."""
    import json

    from selfspec.api import GenerationOptions
    from selfspec.tools import bench

    torch._dynamo.reset()
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "writing", "turns": ["the quick brown fox", "again?"]}\n')
    with pytest.raises(ValueError, match="compile_both .* needs compile=True"):
        bench.BenchConfig(questions=questions, compile_both=True)
    summary = bench.run_bench(bench.BenchConfig(
        questions=questions, out_dir=tmp_path / "out", methods=("plain", "ngram"), dtypes=("float32",),
        model=str(model_dir), options=GenerationOptions(max_new_tokens=12), warmup_tokens=2, progress=False,
        compile=True, compile_both=True))
    assert {(r.method, r.dtype) for r in summary.rows} == {
        (m, d) for m in ("plain", "ngram") for d in ("float32", "float32-compiled")}
    answers = {d: [json.loads(line)["choices"][0]["turns"]
                   for line in (tmp_path / "out" / f"model-ngram-{d}.jsonl").read_text().splitlines()]
               for d in ("float32", "float32-compiled")}
    plain = (tmp_path / "out" / "model-plain-float32-compiled.jsonl").read_text().splitlines()
    assert answers["float32-compiled"] == [json.loads(line)["choices"][0]["turns"] for line in plain]
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["compile"] == "both" and set(run["segments"][-1]["warmup_s"]) == {"float32", "float32-compiled"}
    torch._dynamo.reset()


def test_batched_decoding_through_a_compiled_target_keeps_its_graphs(compiled_llama):
    """The batching server's loop (``generate_batch``: rows joining, finishing, trees padded per row) through a compiled
    target: every sequence's answer is plain decoding's through the same compiled forward, no graph breaks, and two
    batches of other prompts and lengths compile two graphs at most (rows' steps are kept in one form, as ``verify``'s)."""
    from torch._dynamo.utils import counters

    from selfspec.core.batch import Job, generate_batch

    target = Target(compiled_llama)
    batches = [random_prompts(4, VOCAB, seed=seed, min_len=4, max_len=14) for seed in (3, 4)]
    references = [[reference(compiled_llama, p, NEW) for p in prompts] for prompts in batches]  # generate's graphs
    graphs = []
    for seed, prompts, refs in zip((3, 4), batches, references):
        counters.clear()
        outs = generate_batch(target, [Job(p, NGramDrafter(), NEW - 2 * i) for i, p in enumerate(prompts)])
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert out.tokens == ref[:NEW - 2 * i], f"batch {seed}, row {i} left plain decoding"
        assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
        graphs.append(counters["stats"]["unique_graphs"])
    # two forms at most, a batch of several rows and of one (torch specialises a size of 1), whatever the prompts
    assert sum(graphs) <= 2, f"new graphs per batch: {graphs}"
