"""Whether a costly part of a merge pays for itself, measured while decoding (``--draft A+B+skip_unpaid=P``).

A merged step with a trained part drafting adds the tokens the target accepts, and without it would have added the
tokens the verdict restricted to the other parts holds (``merge.restrict``: exact for greedy decoding, since every
path of a merged trie is a path of one part's tree). It costs that part's drafting and its nodes' verify: the time
from one step's draft to the next, with the part drafting and without. Both depend on the text (in code prompt lookup
copies what a head would guess, in prose a head adds a token a step) and on the machine (a wide verify is nearly free
on a GPU, not on this CPU), so both are measured while decoding, per **bucket**: the longest match of the earlier
parts' drafts this step (``Draft.copying``: 0, 1, 2, 3 or more). In a bucket the part drafts while

    mean tokens with it / mean seconds with it  >=  mean tokens without it / mean seconds without it

(the tokens without it are the same steps' counterfactual, the seconds without it those of the steps it sat out).

Measuring needs both kinds of steps: a bucket's first ``WARM`` steps draft and its next ``COLD`` sit out; then while
the part is unpaid every ``period``-th step drafts anyway (its gain is measured again), and while it pays every
(``REST_EVERY`` x ``period``)-th step sits out (a step without it is timed again). Means are running means for a
bucket's first 1 / ``ALPHA`` steps, exponential (weight ``ALPHA``) after: they follow the text from one request to the
next. The output does not depend on any of this: which parts draft changes what a step costs, never the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

BUCKETS = 4
"""match lengths told apart: 0, 1, 2, and 3 or more (prompt lookup's default ``max_ngram`` is 3)."""
WARM = 3
"""a bucket's first steps, the part drafting: its gain measured before it can sit out."""
COLD = 2
"""a bucket's next steps, the part sitting out: a step without it timed."""
REST_EVERY = 4
"""while the part pays, every (REST_EVERY x period)-th step of the bucket sits out, to time a step without it again."""
ALPHA = 0.1
"""the weight of a new step in a bucket's means once it has 1 / ALPHA of them."""


@dataclass
class Tally:
    """One bucket of one part: what its steps measured, and the gate's recent choices."""

    on: int = 0
    """steps the part drafted."""
    tokens: float = 0.0
    """mean tokens a step added, the part drafting."""
    without: float = 0.0
    """mean tokens the same steps would have added without it."""
    on_seconds: float = 0.0
    """mean seconds of a step, the part drafting."""
    off: int = 0
    """steps the part sat out."""
    off_seconds: float = 0.0
    """mean seconds of a step, the part sitting out."""
    run: int = 0
    """the gate's choices in a row that followed the means (a probe ends a run)."""


def bucket(copying: list[int | None]) -> int:
    """The bucket of a step: the longest match of the earlier parts that drafted (None: a part that sat out)."""
    return min(max((c for c in copying if c is not None), default=0), BUCKETS - 1)


def pays(t: Tally) -> bool:
    """Whether steps with the part drafting have added more tokens per second than steps without it."""
    return t.tokens * t.off_seconds >= t.without * t.on_seconds


def drafts(t: Tally, period: int) -> bool:
    """The gate's choice for the next step of this bucket: warm-up, then the means, with a probe the other way every
    ``period`` steps while unpaid and every ``REST_EVERY x period`` steps while paid."""
    if t.on < WARM:
        return True
    if t.off < COLD:
        return False
    if pays(t):
        return t.run + 1 < REST_EVERY * period
    return t.run + 1 >= period


def chose(t: Tally, drafted: bool) -> None:
    """Count the gate's choice: a choice against the means (a probe, or the end of the warm-up) starts a new run."""
    follows = t.on >= WARM and t.off >= COLD and drafted == pays(t)
    t.run = t.run + 1 if follows else 0


def observe(t: Tally, drafted: bool, seconds: float, tokens: int = 0, without: int = 0) -> None:
    """Add one finished step of this bucket: the part drafted (the tokens it added, and would have without it) or
    sat out (for whatever reason: this gate, ``skip_after``, ``skip_match``)."""
    if drafted:
        t.on += 1
        w = max(1 / t.on, ALPHA)
        t.tokens += w * (tokens - t.tokens)
        t.without += w * (without - t.without)
        t.on_seconds += w * (seconds - t.on_seconds)
    else:
        t.off += 1
        w = max(1 / t.off, ALPHA)
        t.off_seconds += w * (seconds - t.off_seconds)
