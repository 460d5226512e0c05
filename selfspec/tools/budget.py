"""The hardware-aware tree budget: the node budget and depth that maximise expected tokens per second on this machine.

    1. verify cost  median time of one tree verification against tree size for this target, dtype and machine
                    (``costs.verify_costs``), measured once and cached on disk
    2. acceptance   greedy decoding of calibration prompts at the largest budget, once per depth, recording every
                    step's draft with its node scores and the path the target accepted. A budget-N tree is the N
                    best-scored nodes of the same candidates (EAGLE-2's rerank), so its accepted length at each
                    recorded step is exact: the part of the recorded accepted path inside those N nodes, plus the bonus
    3. choose       expected tokens/s (N, d) = accepted(N, d) / (r · verify_ms(N + 1 nodes) + other_ms(d)), where
                    other_ms is the measured rest of a step at depth d (drafting, acceptance, cache commit) and r this
                    run's verifications over the cached curve's (the curve's shape, this run's level); the maximum is
                    cached per (draft, target, dtype, machine) in ``selfspec/tuned.py``'s store and ``--tree auto``
                    uses it, unless the calibration's own verifications ran much slower than the cached curve says (a
                    busy machine: the choice would fit the load, not the machine that decodes later)

It needs a drafter that grows its tree by score under a budget and a depth and reports the scores (``Draft.scores``):
EAGLE heads, and Medusa heads with a dynamic tree. Nothing is guessed: accepted lengths come from the target's own verdicts on this machine's dtype.

Inside a merge (``--draft ngram+HEADS``) a part's budget and the merge's ``skip_after`` and ``skip_match`` are tuned on
the same kind of recording, every part drafting: ``selfspec.tools.merge_budget``.

Prompt lookup (``--draft ngram``, ``tune_lookup``) has no scores, but its trie under ``max_nodes`` is the first
``max_nodes`` nodes it inserts: one decode at the largest depth and node count records each step's text, and every
(depth, max_nodes) is replayed by drafting again on that text (a fraction of a millisecond), its accepted length the
recorded accepted tokens its trie holds, its cost the verify of the trie's own size.

Shapes: N tree nodes.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
from tqdm import tqdm

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftState, NoDrafter
from selfspec.core.generate import generate
from selfspec.core.tree import DynamicTree, cut_logp
from selfspec.drafts.ngram import NGramDrafter
from selfspec.tools.costs import verify_costs
from selfspec.tuned import cache_file, machine_key, write_json

log = logging.getLogger(__name__)
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
TIMING = "rounds, greedy head rows"
"""how the cached verify costs were timed (``costs.verify_costs``: every size once per round, the LM head as greedy
decoding runs it, ``head_rows``); a curve cached with another timing is measured again."""
BUSY = 2.0
"""calibration verifications this many times slower than the cached curve predicts: the machine is busy, don't cache."""


# ------------------------------------------------------------------------------------------------ 1. verify cost
MONOTONE_FROM = 8
"""from this many nodes up a verify's work only grows with the tree (below it kernel choices can make a 2-node fp32
verify dearer than a 4-node one)."""
SLACK = 1.15
TRIES = 3


def cost_anomalies(curve: dict[int, float]) -> list[tuple[int, int]]:
    """Pairs (n, m) of tree sizes, MONOTONE_FROM <= n < m, where verifying m nodes was timed more than SLACK times
    cheaper than verifying n: the curve was disturbed while it was timed (an example: docs/benchmarks/log.md,
    'A cached cost curve out of order')."""
    sizes = sorted(n for n in curve if n >= MONOTONE_FROM)
    return [(n, m) for i, n in enumerate(sizes) for m in sizes[i + 1:] if curve[n] > SLACK * curve[m]]


def cached_verify_costs(target, model_id: str, refresh: bool = False, context: int = 256,
                        repeats: int = 10, progress: bool = False) -> dict[int, float]:
    """{nodes: median verify ms} for SIZES on this machine, read from the cache or measured once and stored. A curve
    with ``cost_anomalies`` is timed again (up to TRIES times), read from the cache or not."""
    key = machine_key(target, model_id)
    path = cache_file("verify", key)
    if path.is_file() and not refresh:
        data = json.loads(path.read_text())
        if data.get("key") == key and data.get("timing") == TIMING:  # curves timed size by size are measured again
            curve = {int(n): ms for n, ms in data["median_ms"].items()}
            if not cost_anomalies(curve):
                return curve
    for _ in range(TRIES):
        rows = verify_costs(target, sizes=SIZES, context=context, repeats=repeats, progress=progress)
        curve = {r.nodes: r.median_ms for r in rows}
        odd = cost_anomalies(curve)
        if not odd:
            break
    else:
        n, m = odd[0]
        log.warning(f"the verify costs stayed out of order after {TRIES} timings ({n} nodes {curve[n]:.1f} ms, {m} "
                    f"nodes {curve[m]:.1f} ms): something else is using this machine's cores; tune on a quiet machine")
    write_json(path, {"key": key, "context": context, "timing": TIMING, "median_ms": curve})
    return curve


def interpolate(curve: dict[int, float], nodes: int) -> float:
    """Verify ms at ``nodes``, linear between measured sizes (and beyond the largest, along its last segment)."""
    sizes = sorted(curve)
    if nodes in curve:
        return curve[nodes]
    lo = max([s for s in sizes if s < nodes], default=sizes[0])
    hi = min([s for s in sizes if s > nodes], default=None)
    if hi is None:
        lo, hi = sizes[-2], sizes[-1]
    return curve[lo] + (curve[hi] - curve[lo]) * (nodes - lo) / (hi - lo)


# ------------------------------------------------------------------------------------------------- 2. acceptance
class _Recorder:
    """Wraps a drafter; keeps each step's node scores and accepted path, and the loop's time outside the verify."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.steps: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []  # scores, depths, path

    def draft(self, state: DraftState) -> Draft:
        draft = self.inner.draft(state)
        if draft.scores is None:
            raise TypeError(f"{type(self.inner).__name__} does not report node scores (Draft.scores): budget tuning "
                            "needs a drafter that grows its tree by score (an EAGLE head)")
        return draft

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        self.steps.append((draft.scores, draft.tree.depths, acceptance.path))
        self.inner.update(draft, acceptance)


def kept_nodes(scores: torch.Tensor, depths: Sequence[int], budget: int, depth: int,
               min_logp: float = -math.inf) -> list[int]:
    """The nodes a draft keeps under ``dynamic:budget,depth=depth`` (and ``min_prob`` = exp(min_logp)): its ``budget``
    best-scored nodes of depth <= ``depth``, none scoring below ``min_logp``. (Ties by depth, then index: the
    drafter's own order.) A node never scores above its parent, so the kept nodes hold their ancestors."""
    nodes = [i for i in range(1, len(depths)) if depths[i] <= depth and float(scores[i]) >= min_logp]
    return sorted(nodes, key=lambda i: (-float(scores[i]), depths[i], i))[:budget]


def accepted_at(scores: torch.Tensor, depths: Sequence[int], path: Sequence[int], budget: int, depth: int,
                min_logp: float = -math.inf) -> int:
    """Tokens a step gains with the nodes ``kept_nodes`` keeps of this draft: the accepted path's nodes among them,
    plus the target's bonus token."""
    best = set(kept_nodes(scores, depths, budget, depth, min_logp))
    gained = 0
    for i in path[1:]:
        if i not in best:
            break
        gained += 1
    return gained + 1


TokenPath = tuple[int, ...]
"""a tree node as the tokens from the root (excluded) down to it: the root is (), its children (t,)."""


def token_paths(draft: Draft) -> list[TokenPath]:
    """Every node of ``draft`` as its token path, in node order. Shapes: N nodes -> N paths."""
    return _paths(draft.tree.parents, draft.tokens.tolist())


def _paths(parents: Sequence[int], ids: Sequence[int]) -> list[TokenPath]:
    paths: list[TokenPath] = [()]
    for i in range(1, len(ids)):
        paths.append(paths[parents[i]] + (ids[i],))
    return paths


def held(tokens: TokenPath, paths: set[TokenPath] | frozenset[TokenPath]) -> int:
    """How many of ``tokens`` from the start form a path of the trie ``paths``."""
    n = 0
    while n < len(tokens) and tokens[:n + 1] in paths:
        n += 1
    return n


class _LookupRecorder:
    """Wraps prompt lookup; keeps each step's text so far [T] and the tokens the step added (accepted drafts, bonus)."""

    def __init__(self, inner: NGramDrafter):
        self.inner = inner
        self.steps: list[tuple[torch.Tensor, TokenPath]] = []
        self._tokens: torch.Tensor | None = None

    def draft(self, state: DraftState) -> Draft:
        self._tokens = state.tokens
        return self.inner.draft(state)

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        accepted = tuple(int(draft.tokens[i]) for i in acceptance.path[1:]) + (acceptance.bonus,)
        self.steps.append((self._tokens, accepted))


def lookup_at(tokens: torch.Tensor, accepted: TokenPath, lookup: NGramDrafter) -> tuple[int, int]:
    """A recorded step replayed with prompt lookup at other options: the tokens it gains and the nodes it verifies,
    the root included. tokens [T]; accepted: the recorded step's accepted drafts and bonus, the target's next tokens.

    The trie gains the known next tokens it holds, plus a bonus. A smaller trie is not always inside the recorded one
    (shorter continuations leave room for more of them), so it can hold the recorded bonus too: then it gains at least
    len(accepted) + 1, and what the target says after that is not recorded (counted as the bonus)."""
    trie = lookup.trie(tokens)
    return held(accepted, set(_paths(trie.parents, trie.tokens)[1:])) + 1, len(trie)


@dataclass(frozen=True)
class Choice:
    depth: int
    budget: int
    accepted: float
    """mean tokens per decoding step (bonus included, prefill excluded)."""
    step_ms: float
    """predicted ms per step: verify of budget + 1 nodes (in a merge: of each step's merged tree) + the measured rest
    of a step at this depth."""
    nodes: float | None = None
    """in a merge, or for prompt lookup: the tree's mean size with its root (a tuned head alone: budget + 1)."""
    resting: float = 0.0
    """in a merge: the share of steps the tuned part sits out (skip_after, skip_match)."""
    min_prob: float = 0.0
    """the adaptive length: no node of cumulative draft probability below it (0: none left out)."""

    @property
    def tree(self) -> DynamicTree:
        """What --tree auto stands for when this choice is the best."""
        return DynamicTree(self.budget, depth=self.depth, min_prob=self.min_prob)

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.accepted / self.step_ms


@dataclass(frozen=True)
class Tuning:
    best: Choice
    plain_ms: float
    """the verify of a single node: one plain decoding step (the cached curve's, at this run's level)."""
    table: list[Choice]
    verify_ratio: float = 1.0
    """median over the calibration steps of measured verify time / the cached curve's at the same tree size: about 1
    (or below: calibration contexts are shorter than the curve's) on a machine as quiet as when the curve was measured."""

    @property
    def busy(self) -> bool:
        return self.verify_ratio > BUSY


class Recorder(Protocol):
    """What a calibration decodes through (``_Recorder``, ``_LookupRecorder``, ``merge_budget._MergedRecorder``): a
    drafter's two calls, keeping each step's draft and verdict in ``steps``."""

    steps: list

    def draft(self, state: DraftState) -> Draft: ...

    def update(self, draft: Draft, acceptance: Acceptance) -> None: ...


def record_decodes(target, make_recorder: Callable[[int], Recorder], prompts: Sequence[torch.Tensor],
                   curve: dict[int, float], depths: Sequence[int], max_new_tokens: int, progress: bool):
    """One greedy decode of every prompt per depth through the recorder ``make_recorder(depth)``. Returns, per depth,
    (depth, the recorded steps, median ms of a step outside the verify), and the median over all steps of measured
    verify ms / the curve's at the same size."""
    generate(target, NoDrafter(), prompts[0], 2)  # warm-up
    recorded, ratios = [], []
    bar = tqdm(total=len(depths) * len(prompts), desc="calibrating", unit="decode", disable=not progress, leave=False)
    for d in depths:
        recorder = make_recorder(d)
        other = []
        for prompt in prompts:
            bar.set_postfix_str(f"depth {d}")
            out = generate(target, recorder, prompt, max_new_tokens)
            bar.update()
            other += [s.other_s for s in out.steps[1:]]
            ratios += [1000 * s.verify_s / interpolate(curve, s.tree_size) for s in out.steps[1:]]
        recorded.append((d, recorder.steps, 1000 * statistics.median(other)))
    bar.close()
    return recorded, statistics.median(ratios or [1.0])


MIN_PROBS = (0.0, 0.01, 0.02, 0.05, 0.1)
"""the adaptive length's cuts tune-tree tries by default (0: none): a node below the cut is left out, so a step's tree
follows the draft's confidence, each step's verify costing its own size."""


def tune(target, make_drafter: Callable[[int, int], Drafter], prompts: Sequence[torch.Tensor], curve: dict[int, float],
         depths: Sequence[int], budgets: Sequence[int], max_new_tokens: int = 64, progress: bool = False,
         min_probs: Sequence[float] = (0.0,)) -> Tuning:
    """Record one greedy decode per depth at the largest budget; predict tokens/s for every (depth, budget, min_prob):
    each recorded step cut to that tree (``kept_nodes``), its gain the accepted path inside it, its verify the cost of
    its own size.

    The cached curve gives the verify cost's shape against tree size; its level is this run's: the curve is scaled by
    ``verify_ratio`` (this run's verifications over the curve's), so the verify and the drafting cost in a prediction
    come from the same run. A curve measured while the machine was busier or slower than now (or on longer contexts)
    would otherwise overstate verification against drafting and favour deeper trees than are fastest now."""
    big = max(budgets)
    recorded, ratio = record_decodes(target, lambda d: _Recorder(make_drafter(d, big)), prompts, curve, depths,
                                     max_new_tokens, progress)
    table = []
    for d, records, other_ms in recorded:
        for n in budgets:
            for p in min_probs:
                table.append(_choice(records, n, d, p, curve, ratio, other_ms))
    best = max(table, key=lambda c: c.tokens_per_s)
    return Tuning(best=best, plain_ms=ratio * curve[1], table=table, verify_ratio=ratio)


def _choice(records: Sequence, budget: int, depth: int, min_prob: float, curve: dict[int, float], ratio: float,
            other_ms: float) -> Choice:
    """The recorded steps of one depth replayed as ``dynamic:budget,depth=depth,min_prob=min_prob``: each step verifies
    the nodes it keeps (at most ``budget``; fewer where the draft had fewer candidates or ``min_prob`` cuts), and the
    root. ``nodes`` is their mean, None for a tree of one size (``budget`` + 1 at every step)."""
    min_logp, k = cut_logp(min_prob), max(len(records), 1)
    sizes = [len(kept_nodes(scores, dep, budget, depth, min_logp)) + 1 for scores, dep, _ in records]
    gains = [accepted_at(scores, dep, path, budget, depth, min_logp) for scores, dep, path in records]
    fixed = min_prob == 0 and all(n == budget + 1 for n in sizes)
    return Choice(depth=depth, budget=budget, accepted=sum(gains) / k,
                  step_ms=ratio * sum(interpolate(curve, n) for n in sizes) / k + other_ms,
                  nodes=None if fixed else sum(sizes) / k, min_prob=min_prob)


def tune_lookup(target, lookup: NGramDrafter, prompts: Sequence[torch.Tensor], curve: dict[int, float],
                depths: Sequence[int], budgets: Sequence[int], max_new_tokens: int = 64,
                progress: bool = False) -> Tuning:
    """``tune`` for prompt lookup: its depth and ``max_nodes`` (a Choice's budget), its other options as in ``lookup``.
    One greedy decode at the largest depth and node count records each step's text; every (depth, max_nodes) is
    replayed on it (``lookup_at``), its step's cost the verify of its own trie's size plus the recording's rest of a
    step (prompt lookup's drafting costs little whatever its size)."""
    def sized(d: int, n: int) -> NGramDrafter:
        return NGramDrafter(lookup.max_ngram, lookup.min_ngram, depth=d, max_nodes=n, max_matches=lookup.max_matches,
                            copy_depth=None if lookup.copy_depth is None else max(lookup.copy_depth, d))

    big = sized(max(depths), max(budgets))
    [(_, records, other_ms)], ratio = record_decodes(target, lambda d: _LookupRecorder(big), prompts, curve,
                                                      [max(depths)], max_new_tokens, progress)
    table = []
    for d in depths:
        for n in budgets:
            cuts = [lookup_at(tokens, accepted, sized(d, n)) for tokens, accepted in records]
            k = max(len(cuts), 1)
            verify = sum(interpolate(curve, nodes) for _, nodes in cuts) / k
            table.append(Choice(depth=d, budget=n, accepted=sum(g for g, _ in cuts) / k,
                                step_ms=ratio * verify + other_ms, nodes=sum(nodes for _, nodes in cuts) / k))
    return Tuning(best=max(table, key=lambda c: c.tokens_per_s), plain_ms=ratio * curve[1], table=table,
                  verify_ratio=ratio)


def format_tuning(t: Tuning) -> str:
    """One row per (depth, budget): with several min_prob tried, the fastest of them (its cut in its own column)."""
    plain = 1000 / t.plain_ms
    cuts = any(c.min_prob > 0 for c in t.table)
    sized = cuts or t.best.nodes is not None  # trees of varying size: a merge, prompt lookup, an adaptive length
    rows: dict[tuple[int, int], Choice] = {}
    for c in t.table:
        key = (c.depth, c.budget)
        if key not in rows or c.tokens_per_s > rows[key].tokens_per_s:
            rows[key] = c
    lines = ["| depth | budget |" + (" min_prob |" if cuts else "") + (" mean tree nodes |" if sized else "") +
             " mean accepted | predicted ms / step | predicted tokens/s | vs one-token step |",
             "|---:|---:|" + ("---:|" if cuts else "") + ("---:|" if sized else "") + "---:|---:|---:|---:|"]
    for key in sorted(rows):
        c = rows[key]
        mark = " **best**" if c == t.best else ""
        cut = f" {c.min_prob:g} |" if cuts else ""
        nodes = f" {c.nodes if c.nodes is not None else c.budget + 1:.1f} |" if sized else ""
        lines.append(f"| {c.depth} | {c.budget} |{cut}{nodes} {c.accepted:.2f} | {c.step_ms:.1f} | "
                     f"{c.tokens_per_s:.1f}{mark} | {c.tokens_per_s / plain:.2f}× |")
    if t.best.tokens_per_s < plain:
        lines += ["", f"warning: no tree is predicted to beat one-token decoding here (best {t.best.tokens_per_s:.1f} "
                      f"against {plain:.1f} tokens/s): on this machine and dtype, verifying several tokens costs more "
                      f"than this draft gets accepted. Try another --dtype (wide verification is nearly free where "
                      f"decoding is memory-bound, e.g. bf16 on CPUs with AMX), or decode with another draft or none "
                      f"(--draft none)"]
    return "\n".join(lines)
