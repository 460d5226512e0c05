"""``infer.py fit-policy``: a draft policy (selfspec/drafts/policy.py) fitted on an ``infer.py bench`` run's logged answers.

    1. read the run: its questions, and every arm's answers in one dtype (an arm is a --draft string, found in the
       log under the label the bench gives it)
    2. split the questions: every K-th is held out of fitting and written as a question file, so that a later bench
       can compare the policy with each fixed arm side by side on questions it never saw
    3. per training request (a question's turn): the prompt as plain decoding saw it (the conversation so far, with
       plain decoding's earlier answers), one prefill -> features; each arm's measured tokens/s on that turn
    4. λ by leave-one-out realised speed, the fit, the policy saved with what was measured

    python infer.py fit-policy --bench-dir runs/matrix --dtype bf16 --out runs/policy-bf16 \\
        --arms ngram,runs/eagle_head@auto,ngram+runs/eagle_head+skip_after=3@auto
    python infer.py bench --questions runs/policy-bf16/heldout_questions.jsonl --dtype bf16 \\
        --methods plain,ngram,runs/eagle_head@auto,ngram+runs/eagle_head+skip_after=3@auto,runs/policy-bf16

Shapes: R training requests, A arms, F features.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, TextIO

import torch
from tqdm import tqdm

from selfspec import registry
from selfspec.api import SpecModel
from selfspec.base_check import check_drafts
from selfspec.tools import specbench
from selfspec.tools.bench import DTYPE_NAMES, draft_method
from selfspec.core.drafter import NoDrafter
from selfspec.tools.bench_log import LOG, MANIFEST, read_answers
from selfspec.core.models import DEFAULT_MODEL, load_model, parse_dtype
from selfspec.drafts.policy import Policy, fit_ridge, prompt_features, select_lambda
from selfspec.tools.specbench import Answer, Question
from selfspec.core.target import Target

HELD_OUT = "heldout_questions.jsonl"
LAMBDAS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)
"""ridge penalties tried, in units of the feature count F (the scale of K's diagonal)."""


@dataclass(frozen=True)
class Request:
    question: Question
    turn: int
    speeds: tuple[float, ...]
    """[A] tokens/s of each arm on this turn."""


def split(questions: Sequence[Question], every: int) -> tuple[list[Question], list[Question]]:
    """(training, held out): every ``every``-th question held out (0: none); in file order, so categories stay
    balanced in both when the file lists each category's questions together (MT-bench does)."""
    if every < 0 or every == 1:
        raise ValueError(f"--hold-out must be 0 (fit on every question) or >= 2 (hold out every K-th), found {every}")
    if every == 0:
        return list(questions), []
    held = [q for i, q in enumerate(questions) if i % every == every - 1]
    return [q for i, q in enumerate(questions) if i % every != every - 1], held


def requests(questions: Sequence[Question], answers: dict[tuple[str, str, object], Answer], labels: Sequence[str],
             dtype: str) -> list[Request]:
    """One Request per (question, turn), from the arms' logged answers; a missing answer fails naming it."""
    out = []
    for q in questions:
        arm_answers = []
        for label in labels:
            a = answers.get((label, dtype, q.question_id))
            if a is None:
                raise ValueError(f"the bench log has no {dtype} answer of {label!r} to question {q.question_id}: fit on "
                                 "a run that answered every training question with every arm")
            arm_answers.append(a)
        for t in range(len(q.turns)):
            out.append(Request(q, t, tuple(a.new_tokens[t] / a.wall_time[t] for a in arm_answers)))
    return out


def run_cli(argv: Sequence[str], out: TextIO) -> int:
    a = build_parser().parse_args(argv)
    # 1. the run and the arms, checked before any model loads
    run_dir = Path(a.bench_dir)
    if not (run_dir / MANIFEST).is_file() or not (run_dir / LOG).is_file():
        raise FileNotFoundError(f"{run_dir} holds no bench run ({MANIFEST} and {LOG}): pass the --out-dir of an "
                                "infer.py bench run that answered with every arm")
    manifest = json.loads((run_dir / MANIFEST).read_text())
    dtype = DTYPE_NAMES[parse_dtype(a.dtype)]
    if dtype not in manifest["dtypes"]:
        raise ValueError(f"the run measured {manifest['dtypes']}, not {dtype}: pass one of those as --dtype")
    if a.model.rstrip("/") != manifest["model"].rstrip("/"):
        raise ValueError(f"the run measured {manifest['model']}, but --model is {a.model}: pass the run's model")
    if manifest.get("draft_revision"):
        raise ValueError(f"the run read its Hub drafts at revision {manifest['draft_revision']}; a policy names its "
                         "arms as --draft strings, which load at their default revision: run the bench without "
                         "--draft-revision (on local copies of the drafts) to fit a policy")
    revision = manifest.get("revision")  # the model's Hub revision the run measured
    arms = registry.split_drafts(a.arms)
    if len(set(arms)) != len(arms) or len(arms) < 2:
        raise ValueError(f"--arms needs at least two distinct drafts, found {list(arms)}")
    methods = [draft_method(arm) for arm in arms]
    labels = [m.label for m in methods]
    missing = [x for x in labels if x not in manifest["methods"]]
    if missing:
        raise ValueError(f"the run has no answers labelled {missing}; it measured {manifest['methods']}")
    questions = {q.question_id: q for q in specbench.load_questions(manifest["questions"])}
    ordered = [questions[i] for i in manifest["question_ids"]]
    train, held = split(ordered, a.hold_out)
    check_drafts(a.model, [m.draft for m in methods], revision)  # arms for another model: refused before it loads
    answers = read_answers(run_dir)
    reqs = requests(train, answers, labels, dtype)

    # 2. features: one prefill per training request, with plain decoding's earlier answers as the conversation
    model, tokenizer = load_model(a.model, dtype=parse_dtype(a.dtype), revision=revision, device=a.device)
    target = Target(model)
    encoder = SpecModel(target, tokenizer, NoDrafter(), a.model)
    rows = []
    for r in tqdm(reqs, desc="prefill", unit="request", disable=a.no_progress):
        messages = []
        for t in range(r.turn + 1):
            messages.append({"role": "user", "content": r.question.turns[t]})
            if t < r.turn:
                messages.append({"role": "assistant", "content": answers[("plain", dtype, r.question.question_id)].turns[t]})
        ids = encoder.encode(messages).to(target.device)
        rows.append(prompt_features(target.prefill(ids, target.new_cache()).hidden))
    x = torch.stack(rows)  # [R, F]
    y = torch.tensor([[math.log(s) for s in r.speeds] for r in reqs], dtype=torch.float64)  # [R, A]

    # 3. λ by leave-one-out realised speed, then the fit on every training request
    f = x.shape[1]
    sel = select_lambda(x, y, [lam * f for lam in LAMBDAS])
    policy = Policy(arms=tuple(arms), ridge=fit_ridge(x, y, sel.lam), base_model=a.model,
                    hidden_size=target.hidden_size, vocab_size=target.vocab_size, dtype=dtype,
                    measured={"bench_dir": str(run_dir), "lambda": sel.lam, "fixed": sel.fixed,
                              "fixed_arm": arms[sel.fixed], "loo_speedup_over_fixed": math.exp(sel.loo_gain[sel.lam]),
                              "oracle_speedup_over_fixed": math.exp(sel.oracle_gain), "requests": len(reqs),
                              "train_question_ids": [q.question_id for q in train],
                              "held_out_question_ids": [q.question_id for q in held]})
    dest = policy.save_pretrained(a.out)
    if held:
        lines = [json.dumps({"question_id": q.question_id, "category": q.category, "turns": list(q.turns)}) for q in held]
        (dest / HELD_OUT).write_text("\n".join(lines) + "\n")

    # 4. what was measured
    out.write(f"{len(reqs)} training requests ({len(train)} questions x turns), {len(held)} questions held out; arms "
              f"(geometric-mean tokens/s over the requests):\n")
    for i, arm in enumerate(arms):
        out.write(f"  {i}  {arm}: {math.exp(float(y[:, i].mean())):.1f}{'  <- best fixed arm' if i == sel.fixed else ''}\n")
    out.write("leave-one-out speed-up of the policy over the best fixed arm, per ridge penalty:\n")
    for lam, gain in sel.loo_gain.items():
        out.write(f"  λ = {lam / f:g}·F: {math.exp(gain):.3f}x{'  <- chosen' if lam == sel.lam else ''}\n")
    out.write(f"an oracle picking each request's fastest arm: {math.exp(sel.oracle_gain):.3f}x (no policy can do "
              f"better on these requests)\nsaved {dest}" + (f"; held-out questions in {dest / HELD_OUT}" if held else "")
              + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False,
        prog="infer.py fit-policy",
        description="Fit a per-request draft policy: from an infer.py bench run that answered with every arm, learn "
                    "which arm decodes a request fastest from the target's hidden states over its prompt. The saved "
                    "directory is a --draft (and a bench method).")
    p.add_argument("--bench-dir", required=True, type=Path, help="the --out-dir of the infer.py bench run to learn from")
    p.add_argument("--arms", required=True,
                   help="comma-separated --draft strings the policy chooses between (DRAFT@TREE allowed), each "
                        "measured in that run, e.g. ngram,runs/eagle_head@auto")
    p.add_argument("--dtype", default="bf16", help="the run's dtype to learn from; speeds (and choices) hold in it")
    p.add_argument("--out", required=True, type=Path, help="the policy directory to write")
    p.add_argument("--hold-out", type=int, default=2,
                   help="hold every K-th question of the run out of fitting and write them to "
                        f"OUT/{HELD_OUT} for a side-by-side bench (default 2: half; 0: fit on all)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the run's model (default: the built-in SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    return p
