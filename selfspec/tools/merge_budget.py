"""The tree budget of one part of a merge (``--draft ngram+HEADS``), tuned with the other parts drafting beside it,
and the merge's ``skip_after`` and ``skip_match`` (``tune_merged``; the budget alone: ``selfspec.tools.budget``).

Inside a merge the head's budget is tuned with the other parts drafting beside it: at each recorded step, a budget-N
merged tree is the trie of the other parts' drafts and the head's N best-scored nodes, its accepted length the accepted
tokens that trie holds, its cost the verify of its own size. The head's best budget there can differ from its best
alone: prompt lookup's nodes already take verify time, and on the steps where it copies a span they already hold what
the head would add. The merge's rests are tuned on the same recording (made with every part drafting every step): the
steps are replayed in order, a part sitting out where the replayed previous step (``skip_after``) or an earlier part's
recorded match this step (``skip_match``) says it would, its nodes left out of that step's trie and its drafting time
off the step. A replayed step keeps its recorded position in the text, so a smaller tree's shorter accepts do not
shift the later steps; the prediction is exact step for step until the first step that accepts less than the
recording did.

Shapes: N_k the tuned part's tree nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftState
from selfspec.core.tree import cut_logp
from selfspec.drafts.merge import REPLAYED_OPTIONS, MergedDrafter, sits_out
from selfspec.tools.budget import (Choice, TokenPath, Tuning, held, interpolate, kept_nodes, record_decodes,
                                   token_paths)


@dataclass(frozen=True)
class MergedStep:
    """One recorded step of a merged draft, every part drafting: the tuned part's draft, the others', the tokens the
    step added, and what each part's drafting cost."""

    own: tuple[torch.Tensor, tuple[int, ...], list[TokenPath]]
    """the tuned part's node scores [N_k], depths and token paths."""
    others: tuple[frozenset[TokenPath], ...]
    """every node each other part drafted, in merge order."""
    accepted: TokenPath
    """the accepted drafts, then the target's bonus token."""
    tuned: int = 0
    """the tuned part's place in the merge (the others fill the other places, in order)."""
    starts: bool = False
    """the first drafted step of a request (no part has had tokens accepted yet)."""
    part_ms: tuple[float, ...] = ()
    """each part's drafting time this step (its draft and its update), in merge order."""
    copying: tuple[int, ...] = ()
    """each part's ``Draft.copying`` this step (prompt lookup's match length; 0 for other drafts), in merge order: what
    skip_match reads."""


class Cut(NamedTuple):
    """A recorded merged step replayed with the tuned part at a smaller budget and some parts sitting out."""

    gained: int
    """tokens the step gains: the accepted drafts the cut trie holds, plus the bonus."""
    nodes: int
    """nodes verified, the root included."""
    own: tuple[int, ...]
    """each part's own drafts among the accepted ones (0 for a part that sat out), in merge order: what skip_after
    reads at the next step."""
    resting: frozenset[int] = frozenset()
    """the parts that sat out (places in the merge)."""


def merged_at(step: MergedStep, budget: int, depth: int, resting: frozenset[int] = frozenset(),
              min_logp: float = -math.inf) -> Cut:
    """The step had the tuned part drafted only the nodes ``kept_nodes`` keeps (its ``budget`` best-scored nodes of
    depth <= ``depth``, none below ``min_logp``) and the parts in ``resting`` (places in the merge) sat out."""
    scores, depths, paths = step.own
    own = set()
    for i in kept_nodes(scores, depths, budget, depth, min_logp):
        own.update(paths[i][:j] for j in range(1, len(paths[i]) + 1))  # a trie holds each node's ancestors
    others = iter(step.others)
    parts = [own if k == step.tuned else next(others) for k in range(len(step.others) + 1)]
    parts = [None if k in resting else p for k, p in enumerate(parts)]
    trie = set().union(*(p for p in parts if p is not None))
    drafted = step.accepted[:-1]
    gained = held(drafted, trie)
    return Cut(gained + 1, len(trie) + 1, tuple(0 if p is None else held(drafted[:gained], p) for p in parts),
               resting)



Gate = tuple[int | None, int | None]
"""a merge's rests: (skip_after, skip_match), None where unset (``MergedDrafter``)."""
GATE_KEYS = REPLAYED_OPTIONS
"""a Gate's entries as a merged draft's options name them ('+skip_after=3+skip_match=2')."""


def merged_run(steps: Sequence[MergedStep], budget: int, depth: int, skip_after: int | None,
               min_logp: float = -math.inf, skip_match: int | None = None) -> list[Cut]:
    """The recorded steps replayed in order as a merge with ``skip_after`` and ``skip_match`` (``merge.sits_out``, the
    rule ``MergedDrafter`` decodes with; the accepted counts restart with each request)."""
    cuts: list[Cut] = []
    last: tuple[int, ...] = ()
    for step in steps:
        if step.starts or not last:
            last = (0,) * (len(step.others) + 1)
        copying = step.copying or (0,) * len(last)
        resting: set[int] = set()
        for k in range(len(last)):
            drafted = [None if j in resting else copying[j] for j in range(k)]
            if sits_out(k, last, drafted, skip_after, skip_match):
                resting.add(k)
        cuts.append(merged_at(step, budget, depth, frozenset(resting), min_logp))
        last = cuts[-1].own
    return cuts


class _MergedRecorder:
    """A merge of ``parts``, every part drafting every step, its part ``tuned`` recorded with its scores; keeps each
    step as a MergedStep."""

    def __init__(self, parts: Sequence[Drafter], tuned: int):
        self.merged, self.tuned = MergedDrafter(parts), tuned
        self.steps: list[MergedStep] = []
        self._starts = False

    def draft(self, state: DraftState) -> Draft:
        self._starts = state.starts_request
        draft = self.merged.draft(state)
        own = self.merged.part_drafts[self.tuned]
        if own.scores is None:
            raise TypeError(f"{type(self.merged.drafters[self.tuned]).__name__} does not report node scores "
                            "(Draft.scores): budget tuning needs a drafter that grows its tree by score")
        return draft

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        self.merged.update(draft, acceptance)
        own, parts = self.merged.part_drafts[self.tuned], self.merged.part_drafts
        self.steps.append(MergedStep(
            own=(own.scores, tuple(own.tree.depths), token_paths(own)),
            others=tuple(frozenset(token_paths(d)[1:]) for k, d in enumerate(parts) if k != self.tuned),
            accepted=tuple(int(draft.tokens[i]) for i in acceptance.path[1:]) + (acceptance.bonus,),
            tuned=self.tuned, starts=self._starts, part_ms=tuple(1000 * t for t in self.merged.part_seconds),
            copying=tuple(d.copying for d in parts)))


SKIPS = (1, 2, 3, 4, 6, None)
"""the skip_after values a merge is tuned for besides its own (None: every part drafts every step)."""
MATCHES = (2, 3, None)
"""the skip_match values a merge is tuned for besides its own, each with every skip_after of SKIPS."""
GATES: tuple[Gate, ...] = tuple((a, m) for m in MATCHES for a in SKIPS)


def tune_merged(target, make_parts: Callable[[int, int], Sequence[Drafter]], tuned: int,
                prompts: Sequence[torch.Tensor], curve: dict[int, float], depths: Sequence[int],
                budgets: Sequence[int], gates: Sequence[Gate] = GATES, max_new_tokens: int = 64,
                progress: bool = False, min_probs: Sequence[float] = (0.0,)) -> dict[Gate, Tuning]:
    """``tune`` for part ``tuned`` of a merge (``make_parts(depth, budget)``: the merge's drafters, in order, that part
    at this depth and budget), the other parts drafting beside it, for every gate (skip_after, skip_match) in
    ``gates``: one greedy decode per depth at the largest budget with every part drafting every step; the steps
    replayed in order for each gate (``merged_run``: which parts sit out, from the previous step's replayed verdict and
    this step's recorded matches), each merged tree cut to each smaller budget (and each ``min_probs`` cut), its verify
    cost at its own size, the drafting time of the parts that sat out taken off. Returns {gate: Tuning}."""
    big = max(budgets)
    recorded, ratio = record_decodes(target, lambda d: _MergedRecorder(make_parts(d, big), tuned), prompts, curve,
                                     depths, max_new_tokens, progress)
    tunings = {}
    for gate in gates:
        table = [merged_choice(records, n, d, gate, curve, ratio, other_ms, p)
                 for d, records, other_ms in recorded for n in budgets for p in min_probs]
        tunings[gate] = Tuning(best=max(table, key=lambda c: c.tokens_per_s), plain_ms=ratio * curve[1], table=table,
                               verify_ratio=ratio)
    return tunings


def merged_choice(steps: Sequence[MergedStep], budget: int, depth: int, gate: Gate,
                  curve: dict[int, float], ratio: float, other_ms: float, min_prob: float = 0.0) -> Choice:
    """The recorded steps of one depth replayed at this budget and gate (skip_after, skip_match; ``merged_run``): mean
    tokens per step, and a step's predicted ms: the verify of each replayed tree at its own size (the cached curve at
    this run's level, ``ratio``), plus the recording's median rest of a step (``other_ms``, every part drafting) less
    the mean drafting time of the parts that sat out."""
    cuts = merged_run(steps, budget, depth, gate[0], cut_logp(min_prob), skip_match=gate[1])
    k = max(len(cuts), 1)
    verify = sum(interpolate(curve, c.nodes) for c in cuts) / k
    saved = sum(step.part_ms[p] for step, c in zip(steps, cuts) for p in c.resting) / k
    tuned = steps[0].tuned if steps else 0
    return Choice(depth=depth, budget=budget, accepted=sum(c.gained for c in cuts) / k,
                  step_ms=ratio * verify + other_ms - saved, nodes=sum(c.nodes for c in cuts) / k,
                  resting=sum(tuned in c.resting for c in cuts) / k, min_prob=min_prob)


def format_skips(tunings: dict[Gate, Tuning], own: Gate) -> str:
    """One row per gate (skip_after, skip_match): its best tree and what it is predicted to give."""
    plain = 1000 / next(iter(tunings.values())).plain_ms
    lines = ["| skip_after | skip_match | best tree | merged tree nodes | tuned part sits out | mean accepted | predicted "
             "tokens/s | vs one-token step |", "|---|---|---|---:|---:|---:|---:|---:|"]
    fastest = max(t.best.tokens_per_s for t in tunings.values())

    def order(value: int | None) -> tuple[bool, int]:
        return value is None, value or 0

    for k, t in sorted(tunings.items(), key=lambda kt: (order(kt[0][1]), order(kt[0][0]))):
        c = t.best
        after, match = ("never" if v is None else str(v) for v in k)
        mark = " **best**" if c.tokens_per_s == fastest else ""
        lines.append(f"| {after} | {match}{' (this merge)' if k == own else ''} | {c.tree.spec} | {c.nodes:.1f} | "
                     f"{c.resting:.0%} | {c.accepted:.2f} | {c.tokens_per_s:.1f}{mark} | {c.tokens_per_s / plain:.2f}× |")
    return "\n".join(lines)
