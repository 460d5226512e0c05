"""Spec-Bench in one run: selfspec drafts and the peers transformers ships, per dtype, against plain ``generate``.

    1. validate   the question file, every method and every draft checkpoint (config.json only)   — no model yet
    2. load       one target per dtype, all up front; one runner per method on each
    3. warm up    every method in every dtype on the first turn of the first question (not in any answer; its seconds
                  go to the manifest's segment, "warmup_s": a compiled target compiles there)
    4. answer     question by question, every dtype and method in turn: every turn, the conversation so far under
                  the chat template (turn 2 sees the same method's turn-1 answer); greedy, or sampled with a seed
                  per turn (``temperature`` > 0); with repeats > 1 the wall time is the median
    5. report     one Spec-Bench answer file per method and dtype, a summary table (markdown + JSON), a PNG;
                  all rewritten after every question, so a long run can be read as it goes

Every answer is logged to out_dir as soon as it exists (``bench_log``): ``resume=True`` (``--resume``) continues an
interrupted run where it stopped, with the same options, and redoes nothing.

Methods: ``plain`` (``model.generate``), ``pld`` / ``pld:N`` (``prompt_lookup_num_tokens=N``, default 10),
``aee`` / ``aee:E`` (``assistant_early_exit=E``, default half the layers), ``assisted:<dir or Hub id>``
(``assistant_model=``: transformers' assisted generation with a separate draft model, its own heuristics for how
many tokens to draft), ``none`` (selfspec's loop without a draft), ``ngram`` / ``ngram:...``, ``model:<dir>`` (the
same draft model in selfspec's loop), and draft checkpoint directories or Hub ids. For the transformers methods
``accept_lengths`` are the tokens each ``generate`` step handed its streamer (plain: all 1s). ``llamacpp:plain`` and
``llamacpp:MODE+DRAFT.gguf,...`` run the same turns in llama.cpp's ``llama-server`` on ``llama_model`` (a GGUF of the
target): ``selfspec.tools.llamacpp``; llama.cpp reports its drafts' totals only, so their answers hold decoding steps
and no accept_lengths.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from selfspec import registry

from selfspec.tools import llamacpp, specbench
from selfspec.api import Result, SpecModel
from selfspec.base_check import check_drafts, target_info
from selfspec.core.files import atomic_write
from selfspec.tools.bench_log import BenchLog
from selfspec.tools.llamacpp import LlamaRunner
from selfspec.core.drafter import NoDrafter
from selfspec.core.models import DEFAULT_MODEL, check_device, load_model, parse_dtype
from selfspec.core import typed
from selfspec.core.request import GenerationOptions
from selfspec.tools.plots import plot_summary
from selfspec.tools.specbench import Answer, Question
from selfspec.core.target import Target
from selfspec.tuned import this_cpu

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[1] / "data" / "spec_bench_mt_bench.jsonl"
"""Spec-Bench's 80 MT-bench questions, shipped with selfspec (selfspec/data/NOTICE.md)."""
HF_METHODS = ("plain", "pld", "aee")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class BenchConfig:
    questions: Path = DEFAULT_QUESTIONS
    """a Spec-Bench question file (question_id, category, turns)."""
    out_dir: Path = Path("outputs/bench")
    methods: tuple[str, ...] = ("plain", "pld", "aee", "ngram")
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    model: str = DEFAULT_MODEL
    revision: str | None = None
    """Hub revision of ``model``."""
    draft_revision: str | None = None
    """Hub revision of every draft checkpoint named by a Hub id."""
    limit: int | None = None
    """answer only the first N questions."""
    per_category: int | None = None
    """answer only the first N questions of each category (a balanced subset)."""
    skip_per_category: int = 0
    """skip the first K questions of each category (before per_category): questions a choice was not tuned on."""
    repeats: int = 1
    """time each turn this many times; the median is reported."""
    warmup_tokens: int = 32
    device: str = "cpu"
    allow_other_base: bool = False
    progress: bool = True
    resume: bool = False
    """continue the run logged in out_dir (bench_log); without it an out_dir holding a run is refused."""
    options: GenerationOptions = GenerationOptions(max_new_tokens=192, seed=0)
    """what every method, plain decoding included, decodes every turn with (``bench_options`` makes it from the
    flags): max_new_tokens; temperature 0 greedy (answers comparable token for token with plain decoding's), > 0
    sampling (with top_p, top_k, min_p), every turn of every method seeded with seed + 1000 * question_id + turn (a
    seed of None counts as 0); the repetition penalty, stop strings and min_new_tokens (None: the model's generation
    config's, as its generate; stop (): none)."""
    compile: bool = False
    """compile each dtype's target (``selfspec.core.compiled``): every method, plain decoding included, runs the same
    compiled forward."""
    compile_both: bool = False
    """with ``compile``: each dtype's target twice, uncompiled and compiled (its runs named ``<dtype>-compiled``), every
    method on both, side by side in one run."""
    llama_model: str | None = None
    """the target as a GGUF file for the ``llamacpp:`` methods (it may hold ``{dtype}``: f32, bf16, f16 per dtype)."""
    llama_server: str | None = None
    """llama.cpp's llama-server binary; None: $LLAMA_SERVER, else llama-server on PATH."""

    def __post_init__(self) -> None:
        typed.check(self)
        if self.options.seed is None:
            object.__setattr__(self, "options", self.options.replace(seed=0))
        if self.repeats < 1 or self.warmup_tokens < 0:
            raise ValueError(f"repeats must be >= 1 and warmup_tokens >= 0, found {self.repeats}, {self.warmup_tokens}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, found {self.limit}")
        if self.per_category is not None and self.per_category < 1:
            raise ValueError(f"per_category must be >= 1, found {self.per_category}")
        if self.skip_per_category < 0:
            raise ValueError(f"skip_per_category must be >= 0, found {self.skip_per_category}")
        if self.compile_both and not self.compile:
            raise ValueError("compile_both compares a compiled target with an uncompiled one: it needs compile=True")
        if not self.methods or not self.dtypes:
            raise ValueError("expected at least one method and one dtype")
        check_device(self.device)
        o = self.options
        llamacpp.check_bench(self.methods, self.llama_model, o.sampled, o.repetition_penalty, o.stop, o.min_new_tokens)

    @property
    def max_new_tokens(self) -> int:
        return self.options.max_new_tokens

    @property
    def limits(self) -> dict[str, Any]:
        """The stop strings and min_new_tokens every method is given (an empty dict: the generation config's)."""
        o = self.options
        return {k: v for k, v in (("stop", o.stop), ("min_new_tokens", o.min_new_tokens)) if v is not None}

    @property
    def sampling(self) -> dict[str, Any] | None:
        """The sampling arguments when sampling (temperature > 0), else None (greedy)."""
        o = self.options
        if not o.sampled:
            return None
        out = {"temperature": o.temperature, "top_p": o.top_p, "top_k": o.top_k, "seed": o.seed}
        return {**out, "min_p": o.min_p} if o.min_p else out  # manifests from before min_p stay resumable

    def turn_options(self, max_new_tokens: int) -> GenerationOptions:
        """What every method decodes each turn with (the seed is each turn's own, ``turn_seed``): greedy, only the
        repetition penalty and the limits of ``options``."""
        o = self.options
        if o.sampled:
            return o.replace(max_new_tokens=max_new_tokens)
        return GenerationOptions(max_new_tokens=max_new_tokens, repetition_penalty=o.repetition_penalty, **self.limits)


def bench_options(max_new_tokens: int, **flags: Any) -> GenerationOptions:
    """The bench's decoding flags (temperature, top_p, top_k, min_p, seed, repetition_penalty, stop, min_new_tokens)
    -> ``BenchConfig.options``; their ranges are said as the bench has always said them, then ``GenerationOptions``
    checks them all."""
    o = GenerationOptions(max_new_tokens=max_new_tokens)
    t, top_p, top_k, min_p = (flags.get(k, getattr(o, k)) for k in ("temperature", "top_p", "top_k", "min_p"))
    if t < 0 or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1:
        raise ValueError(f"expected temperature >= 0, 0 < top_p <= 1, top_k >= 0 and 0 <= min_p <= 1, found "
                         f"temperature {t}, top_p {top_p}, top_k {top_k}, min_p {min_p}")
    if (penalty := flags.get("repetition_penalty")) is not None and not penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), found {penalty}")
    if (least := flags.get("min_new_tokens")) is not None and not 0 <= least <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be between 0 and max_new_tokens ({max_new_tokens}), found {least}")
    return o.replace(**flags)


@dataclass(frozen=True)
class Method:
    label: str
    """the name in file names and tables."""
    hf_kwargs: dict[str, Any] | None = None
    """for transformers methods: extra ``model.generate`` arguments (plain: {})."""
    draft: registry.DraftSpec | None = None
    """for selfspec methods: the parsed --draft, with its tree ('DRAFT@TREE', e.g. 'runs/heads@dynamic:32'; None:
    its own)."""
    assistant: registry.DraftSpec | None = None
    """for transformers' assisted generation: the draft model (``model:...``) loaded as ``assistant_model`` in each
    dtype."""
    llama: llamacpp.LlamaMethod | None = None
    """for llama.cpp's methods (``llamacpp:...``): what its llama-server runs."""


def _option(spec: str, name: str) -> int | None:
    """'pld:12' -> 12, 'pld' -> None."""
    if spec == name:
        return None
    value = spec[len(name) + 1:]
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"method {spec!r}: expected {name} or {name}:N with a positive integer N")
    return int(value)


def parse_methods(specs: tuple[str, ...], num_layers: int, revision: str | None = None,
                  dtypes: Sequence[str] = ("float32",)) -> list[Method]:
    """Parse every method, reading draft checkpoints' config.json (no weights); 'plain' always comes first.
    num_layers: the target's layer count (aee exits at half of it unless told otherwise); dtypes: the run's, whose
    files a llama.cpp method's ``{dtype}`` paths must name."""
    methods: list[Method] = []
    for spec in specs:
        if spec == "plain":
            methods.append(Method("plain", hf_kwargs={}))
        elif spec == "pld" or spec.startswith("pld:"):
            n = _option(spec, "pld") or 10
            methods.append(Method(spec, hf_kwargs={"prompt_lookup_num_tokens": n}))
        elif spec == "aee" or spec.startswith("aee:"):
            exit_layer = _option(spec, "aee") or max(num_layers // 2, 1)
            if exit_layer >= num_layers:
                raise ValueError(f"method {spec!r}: the exit layer must be below the target's {num_layers} layers")
            methods.append(Method(spec, hf_kwargs={"assistant_early_exit": exit_layer}))
        elif spec.startswith("assisted:"):
            draft = registry.parse_draft_model(spec[len("assisted:"):], revision)
            methods.append(Method(f"assisted:{draft.label}", hf_kwargs={}, assistant=draft))
        elif llamacpp.is_method(spec):
            llama = llamacpp.parse_method(spec, dtypes)
            methods.append(Method(llama.label, llama=llama))
        else:
            methods.append(draft_method(spec, revision))
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two methods share a name: {labels}; give checkpoint directories distinct names")
    if "plain" not in labels:
        methods.insert(0, Method("plain", hf_kwargs={}))  # every speed-up is measured against it
    return sorted(methods, key=lambda m: m.label != "plain")


def draft_method(spec: str, revision: str | None = None) -> Method:
    """A selfspec draft as a bench method: 'DRAFT' or 'DRAFT@TREE' (the same draft with another tree), validated and
    labelled (config.json read, no weights)."""
    try:  # a bad draft or tree, or a tree the draft cannot take, fails here, before any model loads
        draft = registry.parse_draft_at(spec, revision=revision)
    except (ValueError, FileNotFoundError) as err:
        raise type(err)(f"method {spec!r}: {err} (a method is plain, pld[:N], aee[:E], or a draft as infer.py --draft "
                        f"takes it, with @TREE for another --tree)") from None
    return Method(draft.label, draft=draft)


def with_assistant(method: Method, target: Target) -> Method:
    """``method`` ready to run on ``target``: an assisted-generation method with its draft model loaded in the
    target's dtype and device, checked as ``--draft model:`` checks it (the same tokenizer), as ``assistant_model``."""
    if method.assistant is None:
        return method
    assistant = registry.build_drafter(method.assistant, target).model
    return replace(method, hf_kwargs={**(method.hf_kwargs or {}), "assistant_model": assistant})


def _runner(method: Method, target: Target, tokenizer: Any, model_name: str,
            repetition_penalty: float | None = None, tree_spec: str | None = None) -> SpecModel:
    """tree_spec: the --tree to decode with, if not the method's own (what its 'auto' stands for in this run)."""
    drafter = NoDrafter() if method.draft is None else registry.build(method.draft, target, model_name, tree_spec)
    return SpecModel(target, tokenizer, drafter, name=model_name, repetition_penalty=repetition_penalty)


Runner = SpecModel | LlamaRunner
"""what runs a method: selfspec's model with the method's drafter, or a llama-server (``llamacpp.LlamaRunner``)."""


def _run_once(runner: Runner, method: Method, ids: torch.Tensor, options: GenerationOptions) -> Result:
    """One answer to one turn, with this turn's options (its seed, when sampling)."""
    if method.hf_kwargs is not None:
        return runner.generate_plain(ids, options, **method.hf_kwargs)
    return runner.generate(ids, options)


def turn_seed(seed: int, question_id: int | str, turn: int) -> int:
    """The sampling seed of one turn: the same for every method and every repeat, different across turns. A question
    id that is not an int (Spec-Bench files may use strings, which ``specbench`` accepts) counts as its CRC-32."""
    number = question_id if isinstance(question_id, int) else zlib.crc32(str(question_id).encode())
    return seed + 1000 * number + turn


def answer_question(runner: Runner, method: Method, question: Question, options: GenerationOptions,
                    repeats: int = 1) -> Answer:
    """Every turn with the conversation so far; the answer text (special tokens removed, stripped) goes into the
    next turn's prompt, as Spec-Bench does. ``options``: what every turn decodes with (``BenchConfig.options``); a
    sampled turn is seeded with ``turn_seed``, so repeats draw the same tokens."""
    answer = Answer(question_id=question.question_id, category=question.category)
    messages: list[dict[str, str]] = []
    for index, turn in enumerate(question.turns):
        messages.append({"role": "user", "content": turn})
        ids = runner.encode(messages)
        turn_options = options.replace(seed=turn_seed(options.seed, question.question_id, index)) \
            if options.sampled else options
        results = [_run_once(runner, method, ids, turn_options) for _ in range(repeats)]
        first = results[0]
        if any(r.tokens != first.tokens for r in results[1:]):
            what = "sampled outputs with the same seed" if options.sampled else "greedy outputs"
            raise RuntimeError(f"{method.label} gave different {what} across repeats on question "
                               f"{question.question_id}: decoding is not deterministic on this machine")
        text = first.text.strip()
        answer.turns.append(text)
        answer.token_ids.append(first.tokens)
        answer.new_tokens.append(first.stats.new_tokens)
        answer.wall_time.append(statistics.median(r.stats.seconds for r in results))
        answer.accept_lengths.extend(first.stats.accept_lengths)
        answer.decoding_steps.append(first.stats.steps)
        if first.stats.draft_seconds is not None:  # selfspec's loop measures its drafter; transformers' does not
            answer.draft_time.append(statistics.median(r.stats.draft_seconds for r in results))
        if isinstance(first.stats, llamacpp.LlamaStats):  # llama.cpp: its drafts' totals, not each step's
            answer.draft_tokens.append(first.stats.drafted)
            answer.draft_accepted.append(first.stats.accepted)
        messages.append({"role": "assistant", "content": text})
    return answer


def _machine() -> dict[str, Any]:
    return {**this_cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _manifest(cfg: BenchConfig, questions: list[Question], methods: list[Method], dtypes: list[str],
              llama_server: Path | None = None) -> dict[str, Any]:
    """What a run measures: a resumed run must measure the same (bench_log refuses otherwise). llama_server: the
    binary the llama.cpp methods run (None: the run has none)."""
    manifest = {"model": cfg.model, "questions": str(cfg.questions), "question_ids": [q.question_id for q in questions],
                "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "methods": [m.label for m in methods],
                "dtypes": dtypes}
    if cfg.sampling is not None:  # greedy runs keep the manifest they always had (their logs stay resumable)
        manifest["sampling"] = cfg.sampling
    manifest.update({k: v for k, v in (("revision", cfg.revision), ("draft_revision", cfg.draft_revision),
                                       ("repetition_penalty", cfg.options.repetition_penalty)) if v is not None})
    if cfg.compile:  # uncompiled runs keep the manifest they always had
        manifest["compile"] = "both" if cfg.compile_both else True
    manifest.update({k: list(v) if k == "stop" else v for k, v in cfg.limits.items()})
    if llama_server is not None:  # runs without llama.cpp keep the manifest they always had
        manifest.update(llama_model=cfg.llama_model, llama_server=str(llama_server))
    return manifest


def _report(out: Path, log: BenchLog, questions: list[Question], methods: list[Method], dtypes: list[str],
            model_id: str) -> specbench.Summary | None:
    """Answer files, summary.md / .json and the PNG over the questions every method has answered in every dtype."""
    complete = [q for q in questions if all(log.has(m.label, d, q.question_id) for m, d in rows(methods, dtypes))]
    if not complete:
        return None
    runs = {(m.label, d): [log.done[(m.label, d, q.question_id)] for q in complete] for m, d in rows(methods, dtypes)}
    for (label, dname), answers in runs.items():
        atomic_write(out / f"{model_id}-{label.replace(':', '-')}-{dname}.jsonl", specbench.answer_lines(answers, model_id))
    meta = {**log.manifest, "n_questions": len(complete), "of_questions": len(questions)}  # machines: in segments
    summary = specbench.summarize(runs, meta=meta, references=llamacpp.references([m.label for m in methods]))
    atomic_write(out / "summary.md", specbench.to_markdown(summary))
    atomic_write(out / "summary.json", json.dumps(summary.to_json(), indent=1))
    plot_summary(summary, out / "summary.png")
    return summary


def _code() -> dict[str, Any]:
    """Which selfspec measured: the package version and, in a git checkout, the commit (and whether files differ
    from it), so a run resumed across days shows whether every segment ran the same code."""
    try:
        code: dict[str, Any] = {"selfspec": version("selfspec")}
    except PackageNotFoundError:
        code = {"selfspec": None}
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return code
    if head.returncode == 0:
        code.update(commit=head.stdout.strip(), modified=bool(dirty.stdout.strip()))
    return code


COMPILED = "-compiled"
"""the suffix of a compiled target's rows in a run that has both (``BenchConfig.compile_both``)."""


def dtype_of(target: str) -> str:
    """'bfloat16-compiled' -> 'bfloat16': a row's dtype name."""
    return target.removesuffix(COMPILED)


def runs_on(method: Method, target: str) -> bool:
    """Whether ``method`` has rows on ``target``: a llama.cpp method runs its own llama-server, which compiling
    selfspec's target does not change, so with ``compile_both`` it runs once, beside the uncompiled target."""
    return method.llama is None or target == dtype_of(target)


def rows(methods: list[Method], targets: list[str]) -> list[tuple[Method, str]]:
    """Every (method, target) the run answers with, target by target in order, methods in order within each."""
    return [(m, d) for d in targets for m in methods if runs_on(m, d)]


def _load(cfg: BenchConfig, methods: list[Method], dtypes: list[str], log: BenchLog, llama_server: Path | None,
          servers: contextlib.ExitStack) -> tuple[dict[str, dict[str, Runner]], dict[str, dict[str, Method]]]:
    """Step 2: one target per name in ``dtypes`` ('bfloat16-compiled': a compiled one), shared by every method of it
    -> (runners, methods as they run), per name and method label. A llama.cpp method gets its own llama-server,
    entered in ``servers`` (stopped when it closes), encoding prompts with plain decoding's runner."""
    runners: dict[str, dict[str, Runner]] = {}
    calls: dict[str, dict[str, Method]] = {}  # per dtype: each method as it runs (an assistant model loaded in it)
    for dname in dtypes:
        base = dtype_of(dname)
        model, tokenizer = load_model(cfg.model, dtype=parse_dtype(base), revision=cfg.revision, device=cfg.device,
                                      compile=dname != base or (cfg.compile and not cfg.compile_both))
        target = Target(model)
        runners[dname] = {}
        calls[dname] = {m.label: with_assistant(m, target) for m in methods}
        for m in methods:  # plain first (parse_methods): a llama.cpp method encodes with it
            if not runs_on(m, dname):
                continue
            if m.llama is not None:
                runners[dname][m.label] = servers.enter_context(llamacpp.serve(
                    m.llama, base, llama_server, cfg.llama_model, runners[dname]["plain"], cfg.max_new_tokens))
                continue
            # DRAFT@auto: tune-tree's choice when the run first met it, kept for the whole run
            tree = None if m.draft is None or m.draft.tree != "auto" else log.auto_tree(
                m.label, dname, lambda: registry.resolve_tree("auto", m.draft, target, cfg.model).spec)
            runners[dname][m.label] = _runner(m, target, tokenizer, cfg.model, cfg.options.repetition_penalty, tree)
    return runners, calls


def _answer(cfg: BenchConfig, questions: list[Question], methods: list[Method], dtypes: list[str], log: BenchLog,
            runners: dict[str, dict[str, Runner]], calls: dict[str, dict[str, Method]],
            model_id: str) -> specbench.Summary | None:
    """Step 4: questions outside, every dtype and method inside, so that load on the machine hits them alike and a run
    resumed on another day still compares each question's answers side by side; each answer is logged at once, the
    report rewritten after each question -> the last summary written (None: nothing was left to answer)."""
    out = Path(cfg.out_dir)
    todo = [q for q in questions if not all(log.has(m.label, d, q.question_id) for m, d in rows(methods, dtypes))]
    bar = tqdm(todo, desc="bench", disable=not cfg.progress, unit="question", initial=len(questions) - len(todo),
               total=len(questions))
    started, summary = time.perf_counter(), None
    for n, q in enumerate(bar, start=len(questions) - len(todo) + 1):
        for m, dname in rows(methods, dtypes):
            if not log.has(m.label, dname, q.question_id):
                log.add(m.label, dname, answer_question(runners[dname][m.label], calls[dname][m.label], q,
                                                        cfg.turn_options(cfg.max_new_tokens), cfg.repeats))
        summary = _report(out, log, questions, methods, dtypes, model_id)  # partial results readable at any time
        if not cfg.progress:  # a line per question instead of a bar (logs of runs under nohup)
            minutes = (time.perf_counter() - started) / 60
            print(f"bench: question {q.question_id} ({q.category}) answered, {n}/{len(questions)}; {minutes:.1f} min "
                  f"in this segment", file=sys.stderr, flush=True)
    return summary


def run_bench(cfg: BenchConfig) -> specbench.Summary:
    # 1. validate everything a run needs, and the log of the run it may resume, before any model is loaded
    questions = specbench.load_questions(cfg.questions, cfg.limit, cfg.per_category, cfg.skip_per_category)
    dtypes = [DTYPE_NAMES[d] for d in dict.fromkeys(parse_dtype(d) for d in cfg.dtypes)]
    methods = parse_methods(cfg.methods, target_info(cfg.model, cfg.revision).num_layers, cfg.draft_revision, dtypes)
    targets = [v for d in dtypes for v in ((d, d + COMPILED) if cfg.compile_both else (d,))]  # what the rows name
    check_drafts(cfg.model, [m.draft for m in methods if m.draft is not None], cfg.revision,
                 allow_other_base=cfg.allow_other_base)
    llama_server, segment = None, {**_machine(), **_code()}
    if any(m.llama is not None for m in methods):  # the binary runs and the target GGUF of every dtype is there
        llamacpp.check_model(cfg.llama_model, dtypes)
        llama_server = llamacpp.find_server(cfg.llama_server)
        segment["llama_server_version"] = llamacpp.server_version(llama_server)
    model_id = Path(cfg.model.rstrip("/")).name
    out = Path(cfg.out_dir)
    log = BenchLog.open(out, _manifest(cfg, questions, methods, dtypes, llama_server), segment, resume=cfg.resume)

    with contextlib.ExitStack() as servers:  # every llama-server stopped on the way out, an error or Ctrl-C included
        # 2. one target per dtype (two with compile_both), all loaded up front, shared by its methods
        runners, calls = _load(cfg, methods, targets, log, llama_server, servers)
        # 3. warm-up (every resumed segment too: a fresh process is cold)
        if cfg.warmup_tokens:
            warm = Question(questions[0].question_id, questions[0].category, questions[0].turns[:1])
            for m, dname in rows(methods, targets):
                began = time.perf_counter()
                answer_question(runners[dname][m.label], calls[dname][m.label], warm,
                                cfg.turn_options(cfg.warmup_tokens))
                log.warmed_up(m.label, dname, time.perf_counter() - began)
        # 4. answer, question by question, every answer logged as it exists
        summary = _answer(cfg, questions, methods, targets, log, runners, calls, model_id)

    # 5. report (already written after the last question; a resumed run with nothing left writes it here)
    if summary is None:
        summary = _report(out, log, questions, methods, targets, model_id)
    return summary
