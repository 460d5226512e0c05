"""Spec-Bench's file formats, and the numbers its evaluation scripts compute from them.

Questions (one JSON object per line): ``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``.
Answers (one per line, in question order): ``{"question_id", "category", "model_id", "choices": [{"index": 0,
"turns": [str], "new_tokens": [int], "wall_time": [float], "accept_lengths": [int], "decoding_steps": [int]}]}``;
``evaluation/speed.py`` reads choices[0]'s new_tokens, wall_time and accept_lengths, ``evaluation/equal.py`` compares
choices[0]["turns"] line by line.

The metrics follow speed.py: tokens/s is the mean over questions of sum(new_tokens) / sum(wall_time); the speed-up is
the ratio of two such means; mean accepted tokens is the mean of all accept_lengths. An answer that knows only its
totals (llama.cpp's: ``accept_lengths`` empty, ``draft_tokens`` / ``draft_accepted`` per turn) counts as
sum(new_tokens) over sum(decoding_steps) in that mean (what the mean of its accept lengths would be).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any, Sequence


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]


@dataclass
class Answer:
    """One method's answer to every turn of one question (token ids kept in memory for the identity check)."""

    question_id: int | str
    category: str
    turns: list[str] = field(default_factory=list)
    new_tokens: list[int] = field(default_factory=list)
    wall_time: list[float] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    decoding_steps: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    draft_time: list[float] = field(default_factory=list)
    """per turn, the seconds of wall_time spent in the drafter's ``draft`` (selfspec's methods; empty for
    transformers' own)."""
    draft_tokens: list[int] = field(default_factory=list)
    """per turn, the draft tokens the target verified, where only totals are known (llama.cpp's; then accept_lengths
    is empty and decoding_steps counts the target's forwards); empty otherwise."""
    draft_accepted: list[int] = field(default_factory=list)
    """per turn, of draft_tokens, the ones the target accepted (llama.cpp's); empty otherwise."""

    @property
    def accepted_and_steps(self) -> tuple[int, int]:
        """(tokens gained, target forwards) over every turn: from accept_lengths, or from the totals where only they
        are known (no per-step lengths)."""
        if self.accept_lengths or not self.draft_tokens:
            return sum(self.accept_lengths), len(self.accept_lengths)
        return sum(self.new_tokens), sum(self.decoding_steps)

    @property
    def draft_ms_per_step(self) -> float | None:
        """Drafting time per drafting step (each turn's prefill drafts nothing), in ms; None where not measured."""
        if not self.draft_time:
            return None
        return 1000 * sum(self.draft_time) / max(sum(s - 1 for s in self.decoding_steps), 1)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / sum(self.wall_time)

    def record(self, model_id: str) -> dict[str, Any]:
        """The Spec-Bench answer line."""
        choice = {"index": 0, "turns": self.turns, "decoding_steps": self.decoding_steps, "new_tokens": self.new_tokens,
                  "wall_time": self.wall_time, "accept_lengths": self.accept_lengths}
        if self.draft_time:
            choice["draft_time"] = self.draft_time
        if self.draft_tokens:
            choice.update(draft_tokens=self.draft_tokens, draft_accepted=self.draft_accepted)
        return {"question_id": self.question_id, "category": self.category, "model_id": model_id, "choices": [choice]}


def load_questions(path: str | Path, limit: int | None = None, per_category: int | None = None,
                   skip_per_category: int = 0) -> list[Question]:
    """Read and validate a Spec-Bench question file; any malformed line fails with its line number.

    skip_per_category drops the first K questions of each category (those a choice was tuned or looked at on, say);
    per_category then keeps the first N of each category left (a balanced subset, in file order); limit then keeps
    the first N questions of what is left.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist: pass --questions PATH to a Spec-Bench question "
                                f"file (one JSON object per line with question_id, category, turns)")
    out: list[Question] = []
    seen: set[Any] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where} is not JSON ({err}); expected a Spec-Bench question per line") from err
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object with question_id, category, turns; found {type(obj).__name__}")
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise ValueError(f"{where} is not a Spec-Bench question: missing {missing} (has {sorted(obj)})")
        qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
        if not isinstance(qid, (int, str)) or isinstance(qid, bool):
            raise ValueError(f"{where}: question_id must be an integer or string, found {qid!r}")
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: category must be a non-empty string, found {category!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{where}: turns must be a non-empty list of non-empty strings, found {str(turns)[:80]}")
        if qid in seen:
            raise ValueError(f"{where}: question_id {qid!r} appears twice")
        seen.add(qid)
        out.append(Question(question_id=qid, category=category, turns=tuple(turns)))
    if not out:
        raise ValueError(f"{path} holds no questions")
    if per_category is not None or skip_per_category:
        taken: dict[str, int] = {}
        balanced = []
        for q in out:
            taken[q.category] = taken.get(q.category, 0) + 1
            if skip_per_category < taken[q.category] <= skip_per_category + (per_category or len(out)):
                balanced.append(q)
        out = balanced
        if not out:
            raise ValueError(f"{path}: no question is left after skipping the first {skip_per_category} of each "
                             "category")
    return out[:limit] if limit is not None else out


def answer_lines(answers: Sequence[Answer], model_id: str) -> str:
    """A Spec-Bench answer file's text: one line per answer, in question order."""
    return "".join(json.dumps(a.record(model_id), ensure_ascii=False) + "\n" for a in answers)


def first_difference(a: Answer, b: Answer) -> tuple[int, int] | None:
    """(turn, token index) where two answers' token ids first differ, or None when identical."""
    for turn, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            index = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return turn, index
    if len(a.token_ids) != len(b.token_ids):
        return min(len(a.token_ids), len(b.token_ids)), 0
    return None


@dataclass(frozen=True)
class Row:
    method: str
    dtype: str
    category: str
    """a category name or 'overall'."""
    questions: int
    mean_accepted: float
    tokens_per_s: float
    speedup: float
    """over plain decoding in the same dtype (or the method's reference, ``Summary.references``)."""
    speedup_vs_fastest_plain: float
    """over the fastest plain decoding of any dtype in the run."""
    identical: int | None
    """questions whose every turn is token-identical to plain decoding's (or the reference's) in the same dtype (None:
    a sampled run, whose answers are draws, not comparable token for token)."""
    draft_ms: float | None = None
    """the drafter's time per drafting step, in ms, over these questions (None: not measured, transformers' methods)."""


@dataclass
class Summary:
    rows: list[Row]
    fastest_plain: str
    """the dtype whose plain decoding was fastest overall."""
    differences: dict[str, list[dict[str, Any]]]
    """'method/dtype' -> [{question_id, category, identical, first_difference: {turn, token} | None}] (empty for a
    sampled run)."""
    accept_lengths: dict[str, list[int]]
    """'method/dtype' -> every accept length of the run (for the histogram)."""
    meta: dict[str, Any] = field(default_factory=dict)
    references: dict[str, str] = field(default_factory=dict)
    """method -> the method its speed-up and identical columns compare with, where not plain decoding (llama.cpp's
    methods: llamacpp:plain); the vs-fastest-plain column compares with plain decoding for every method."""

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "fastest_plain": self.fastest_plain, "rows": [r.__dict__ for r in self.rows],
                "differences": self.differences, "references": self.references}


def _speed(answers: Sequence[Answer]) -> float:
    return mean(a.tokens_per_s for a in answers)


def _mean_accepted(answers: Sequence[Answer]) -> float:
    """Tokens gained per target forward over ``answers``: the mean of all their accept lengths, an answer with totals
    only counting as its tokens over its steps (``Answer.accepted_and_steps``)."""
    tokens, steps = (sum(x) for x in zip(*(a.accepted_and_steps for a in answers)))
    return tokens / max(steps, 1)


def _draft_ms(answers: Sequence[Answer]) -> float | None:
    """Drafting ms per drafting step over ``answers`` (None unless every answer measured it)."""
    if not answers or not all(a.draft_time for a in answers):
        return None
    steps = sum(s - 1 for a in answers for s in a.decoding_steps)
    return 1000 * sum(t for a in answers for t in a.draft_time) / max(steps, 1)


def _differences(answers: Sequence[Answer], base: Sequence[Answer]) -> list[dict[str, Any]]:
    """Per question: whether every turn is token-identical to ``base``'s answer, and where it first differs."""
    diffs = []
    for a, b in zip(answers, base, strict=True):
        diff = first_difference(a, b)
        diffs.append({"question_id": a.question_id, "category": a.category, "identical": diff is None,
                      "first_difference": None if diff is None else {"turn": diff[0], "token": diff[1]}})
    return diffs


def summarize(runs: dict[tuple[str, str], list[Answer]], plain: str = "plain", meta: dict[str, Any] | None = None,
              references: dict[str, str] | None = None) -> Summary:
    """runs: (method, dtype) -> answers in question order. Every dtype needs a run of the ``plain`` method. A run
    whose meta names its ``sampling`` is not compared with plain decoding token for token. references: method -> the
    method its speed-up and identical columns compare with instead of ``plain`` (in the same dtype; llama.cpp's methods
    with llamacpp:plain)."""
    references = references or {}
    greedy = (meta or {}).get("sampling") is None
    dtypes = list(dict.fromkeys(d for _, d in runs))
    missing = [d for d in dtypes if (plain, d) not in runs]
    if missing:
        raise ValueError(f"speed-ups need a {plain!r} run in every dtype; missing for {missing}")
    fastest = max(dtypes, key=lambda d: _speed(runs[(plain, d)]))
    rows: list[Row] = []
    differences: dict[str, list[dict[str, Any]]] = {}
    for (method, dtype), answers in runs.items():
        base = runs[(references.get(method, plain), dtype)]
        diffs = _differences(answers, base) if greedy else None  # sampled answers are draws: not compared
        if diffs is not None:
            differences[f"{method}/{dtype}"] = diffs
        categories = list(dict.fromkeys(a.category for a in answers))
        for category in [*categories, "overall"]:
            pick = [i for i, a in enumerate(answers) if category in ("overall", a.category)]
            mine, theirs = [answers[i] for i in pick], [base[i] for i in pick]
            fastest_base = [runs[(plain, fastest)][i] for i in pick]
            rows.append(Row(
                method=method, dtype=dtype, category=category, questions=len(pick),
                mean_accepted=_mean_accepted(mine), tokens_per_s=_speed(mine),
                speedup=_speed(mine) / _speed(theirs), speedup_vs_fastest_plain=_speed(mine) / _speed(fastest_base),
                identical=None if diffs is None else sum(diffs[i]["identical"] for i in pick),
                draft_ms=_draft_ms(mine),
            ))
    accept = {f"{m}/{d}": [n for a in answers for n in a.accept_lengths] for (m, d), answers in runs.items()}
    return Summary(rows=rows, fastest_plain=fastest, differences=differences, accept_lengths=accept, meta=meta or {},
                   references=references)


HEADER = ["| method | dtype | mean accepted tokens | tokens/s | speed-up | vs fastest plain | identical | draft ms/step |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
SAMPLED_HEADER = ["| method | dtype | mean accepted tokens | tokens/s | speed-up | vs fastest plain | draft ms/step |",
                  "|---|---|---:|---:|---:|---:|---:|"]


def _line(r: Row, identical: bool = True) -> str:
    draft = "—" if r.draft_ms is None else f"{r.draft_ms:.1f}"
    return (f"| {r.method} | {r.dtype} | {r.mean_accepted:.2f} | {r.tokens_per_s:.1f} | {r.speedup:.2f}x | "
            f"{r.speedup_vs_fastest_plain:.2f}x |" + (f" {r.identical}/{r.questions} |" if identical else "")
            + f" {draft} |")


def to_markdown(summary: Summary) -> str:
    """The overall table, one table per category, and where answers differ from plain decoding (greedy runs; sampled
    answers are draws, compared with plain decoding's only in distribution, by the test suite)."""
    sampling = summary.meta.get("sampling")
    greedy = sampling is None
    header = HEADER if greedy else SAMPLED_HEADER
    intro = (f"Speed-ups are over plain `generate` in the same dtype, and over the fastest plain decoding of this run "
             f"({summary.fastest_plain}). ")
    intro += "Draft ms/step: the drafter's own time per drafting step (selfspec's methods; — for transformers'). "
    if greedy:
        intro += "Greedy. Identical: questions whose every turn is token-identical to plain decoding's."
    else:
        min_p = f", min-p {sampling['min_p']}" if sampling.get("min_p") else ""
        intro += (f"Sampled (temperature {sampling['temperature']}, top-p {sampling['top_p']}, top-k "
                  f"{sampling['top_k']}{min_p}; every method's turn seeded alike from seed {sampling['seed']}): lossless "
                  f"sampling draws from the target's own distribution, not the same tokens as plain sampling, so "
                  f"answers are not compared token for token.")
    given = [f"{name} {summary.meta[key]!r}" for key, name in (("repetition_penalty", "repetition penalty"),
             ("stop", "stop strings"), ("min_new_tokens", "min_new_tokens")) if key in summary.meta]
    if given:
        intro += " Every method, plain decoding included, with " + ", ".join(given) + "."
    auto = summary.meta.get("auto_trees") or {}
    if auto:
        intro += (" `@auto`: the tree `infer.py tune-tree` had chosen for this machine when the run started (kept on "
                  "resume): " + "; ".join(f"{label} {tree} ({dtype})" for label, trees in auto.items()
                                          for dtype, tree in trees.items()) + ".")
    rows = lambda category: (_line(r, greedy) for r in summary.rows if r.category == category)  # noqa: E731
    lines = [intro, "", "### overall", "", *header, *rows("overall")]
    for reference in dict.fromkeys(summary.references.values()):
        named = ", ".join(m for m, r in summary.references.items() if r == reference)
        lines += ["", f"Speed-up{' and identical' if greedy else ''} of {named}: against {reference} in the same dtype "
                      f"(its own plain decoding, its lossless reference), not plain `generate`; vs fastest plain: "
                      f"against plain `generate`."]
    for category in dict.fromkeys(r.category for r in summary.rows if r.category != "overall"):
        lines += ["", f"### {category}", "", *header, *rows(category)]
    if not greedy:
        return "\n".join(lines) + "\n"
    lines += ["", "### answers that differ from plain decoding", "", "(question: turn, first differing token index)", ""]
    for key, diffs in summary.differences.items():
        if key.startswith("plain/"):
            continue
        bad = [d for d in diffs if not d["identical"]]
        where = ", ".join(f"q{d['question_id']}: turn {d['first_difference']['turn'] + 1}, token "
                          f"{d['first_difference']['token']}" for d in bad)
        reference = summary.references.get(key.rpartition("/")[0])
        lines.append(f"- {key}: {len(diffs) - len(bad)}/{len(diffs)} identical"
                     + (f" to {reference}" if reference else "") + (f"; {where}" if bad else ""))
    return "\n".join(lines) + "\n"
