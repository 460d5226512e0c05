"""Several drafters as one: their trees merged into one trie, verified in one forward.

A trained head and prompt lookup fail on different steps: the head guesses generic continuations, the n-gram trie
copies spans of the prompt and of the answer so far (names, code, quoted text), which the head rarely ranks first.
Verifying both in one tree accepts what either would have, for one target forward; where wide verification is cheap
(bf16 on a CPU with AMX, GPUs) a merged tree costs little more than either part's (docs/benchmarks/log.md, "What a step
costs").

    1. draft   every drafter drafts from the same state
    2. merge   their trees become one trie: a node is one token under one parent, so a path two drafters share is
               verified once; nodes keep the order they came in (the first drafter's first), siblings ranked in that
               order, which the acceptance rules follow
    3. update  every drafter hears the verdict on its own draft, in its own node indices; with ``skip_unpaid``
               the step's tokens, and the tokens it would have added without each later drafter, are kept for
               the next draft, which times the step and files both (``merge_cost.observe``)

Optionally a costly drafter sits out the steps where a cheap one listed before it is copying a span: judged from the
previous step (``skip_after``: the cheap one had that many tokens accepted) or from this one (``skip_match``: its draft
continues a match of that many of the text's last tokens, ``Draft.copying``), which needs no step of delay: a copy is
caught at its first step, and the costly drafter is back the step the copy ends. Or it sits out where it is measured
not to pay for itself (``skip_unpaid``: the tokens it adds against the time it adds, per match length, while decoding;
selfspec/drafts/merge_cost.py).

The merged draft is deterministic (q = None): a draft node is treated as a point mass on its token, which keeps
sampling lossless whatever drew the candidates (``accept.sample_accept``). Drafters that verify with their own
target (``Drafter.verifier``: early exit reuses the early layers it ran while drafting) cannot be merged.

Shapes: N nodes of the merged tree, N_k nodes of drafter k's tree.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Sequence

import torch

from selfspec.core.accept import Acceptance
from selfspec.core.drafter import Draft, Drafter, DraftState, LayerStates
from selfspec.core.tree import TokenTrie
from selfspec.drafts import merge_cost


def merge_drafts(drafts: Sequence[Draft]) -> Draft:
    """One trie of every draft's nodes, in the order given. All drafts must share the root token."""
    root = int(drafts[0].tokens[0])
    for k, d in enumerate(drafts):
        if int(d.tokens[0]) != root:
            raise ValueError(f"drafts to merge must share the root token: draft 0 has {root}, draft {k} has "
                             f"{int(d.tokens[0])}")
    trie = TokenTrie(root)
    for d in drafts:
        to_merged = [0] * len(d.tree)  # draft d's node i -> its node in the trie
        ids = d.tokens.tolist()  # [N_k]
        for i in range(1, len(d.tree)):
            to_merged[i] = trie.add(to_merged[d.tree.parents[i]], ids[i])
    return Draft(tree=trie.tree(),
                 tokens=torch.tensor(trie.tokens, dtype=drafts[0].tokens.dtype, device=drafts[0].tokens.device))


def restrict(accepted: Sequence[int], own: Draft) -> Acceptance:
    """The verdict on a merged tree as one of its drafts saw it. accepted: the tokens the step added (the accepted
    drafts, then the bonus). Returns the longest prefix of them that is a path of ``own``'s tree, in its node indices,
    and the target's token after that prefix. Token paths, not node indices: the loop may have cut the merged tree."""
    children = own.tree.children
    ids = own.tokens.tolist()  # [N_k]
    path = [0]
    for tok in accepted[:-1]:
        nxt = next((c for c in children[path[-1]] if ids[c] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
    return Acceptance(path=tuple(path), bonus=accepted[len(path) - 1])


REPLAYED_OPTIONS = ("skip_after", "skip_match")
"""the merge options ``sits_out`` reads (the previous step's verdicts, this step's drafts): what tune-tree replays and
keys its tuning by. ``skip_unpaid`` is measured while decoding, never replayed."""


def sits_out(k: int, accepted: Sequence[int], copying: Sequence[int | None], skip_after: int | None,
             skip_match: int | None) -> bool:
    """Whether part k of a merge sits out this step. accepted: each part's own tokens accepted at the previous step;
    copying: this step's ``Draft.copying`` of the parts before k, None for a part that sat out. The rule
    ``MergedDrafter`` decodes with and ``selfspec.tools.merge_budget.merged_run`` replays."""
    if skip_after is not None and any(a >= skip_after for a in accepted[:k]):
        return True
    return skip_match is not None and any(c is not None and c >= skip_match for c in copying[:k])


class MergedDrafter(Drafter):
    """``--draft A+B``: the drafts of A and B (and more) verified as one tree.

    skip_after: a drafter sits out a step while an earlier one (in the order given) had at least this many of its own
    tokens accepted at the previous step: when prompt lookup is copying a span, a head's guesses rarely add to it and
    its drafting time is saved (None: every drafter drafts every step). A drafter that sat out is handed the target's
    hidden states of every position committed since it last drafted, so a head with its own cache stays in step.

    skip_match: a drafter sits out a step where an earlier one's draft this step continues a match of at least this
    many of the text's last tokens (prompt lookup's ``Draft.copying``; None: never). On MT-bench a 2-token match's copy
    is accepted for 1.5 tokens a step and a head adds 0.2 to it, less than its drafting and its nodes cost
    (docs/benchmarks/log.md §33).

    skip_unpaid = P: a drafter after the first sits out the steps where, at this match length of the earlier ones,
    steps with it have added fewer tokens per second than steps without it, measured while decoding (``merge_cost``;
    every P-th such step it drafts anyway, to measure again; None: never). clock: what times a step (the time from
    one ``draft`` call to the next)."""

    def __init__(self, drafters: Sequence[Drafter], skip_after: int | None = None, skip_match: int | None = None,
                 skip_unpaid: int | None = None, clock: Callable[[], float] = time.perf_counter):
        if len(drafters) < 2:
            raise ValueError(f"merging needs at least two drafters, found {len(drafters)}")
        for name, value in (("skip_after", skip_after), ("skip_match", skip_match), ("skip_unpaid", skip_unpaid)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), found {value}")
        for d in drafters:
            if d.verifier() is not None:
                raise ValueError(f"{type(d).__name__} verifies its drafts with its own target (it reuses the work it "
                                 "did while drafting), so it cannot share a tree with other drafters; use it alone")
        self.drafters, self.skip_after, self.skip_match = list(drafters), skip_after, skip_match
        self.part_drafts: list[Draft | None] = []  # this step's draft of each drafter, None where it sat out
        self.part_seconds: list[float] = []  # this step's time in each drafter (its draft and its update)
        self._accepted = [0] * len(self.drafters)  # each drafter's own tokens accepted at the previous step
        # (new_hidden [A_j, D], new_states or None) held for drafters that sat out
        self._pending: list[list[tuple[torch.Tensor, LayerStates | None]]] = [[] for _ in self.drafters]
        self.skipped = [0] * len(self.drafters)  # steps each drafter sat out
        self.skip_unpaid, self.clock = skip_unpaid, clock
        # skip_unpaid: each drafter's tallies, one per bucket (the first drafter's stay empty: it always drafts)
        self.tallies = [[merge_cost.Tally() for _ in range(merge_cost.BUCKETS)] for _ in self.drafters]
        self._step: tuple[float, list[int], list[bool]] | None = None  # this step's start, buckets, who drafted
        self._tokens: tuple[int, list[int]] | None = None  # this step's tokens, and each part's tokens without it

    @property
    def batchable(self) -> bool:  # type: ignore[override]
        return all(d.batchable for d in self.drafters)

    def draft(self, state: DraftState) -> Draft:
        now = self.clock()
        if state.starts_request:
            self._accepted, self._pending = [0] * len(self.drafters), [[] for _ in self.drafters]
            self._step = self._tokens = None  # no step of another request is timed into this one
        self._observe(now)
        # 1. draft: each drafter, unless an earlier one is copying a span, or it does not pay for itself here
        self.part_drafts, self.part_seconds = [], [0.0] * len(self.drafters)
        buckets = [0] * len(self.drafters)  # skip_unpaid: each drafter's bucket this step
        for k, d in enumerate(self.drafters):
            copying = [None if p is None else p.copying for p in self.part_drafts]  # the parts before k
            if self.skip_unpaid is not None:
                buckets[k] = merge_cost.bucket(copying)
            if sits_out(k, self._accepted, copying, self.skip_after, self.skip_match) or not self._pays(k, buckets[k]):
                if state.new_hidden is not None:
                    self._pending[k].append((state.new_hidden, state.new_states))
                self.part_drafts.append(None)
                self.skipped[k] += 1
                continue
            own = state
            if self._pending[k] and state.new_hidden is not None:
                held = self._pending[k] + [(state.new_hidden, state.new_states)]
                states = None if any(s is None for _, s in held) else sum((s for _, s in held[1:]), held[0][1])
                own = replace(state, new_hidden=torch.cat([h for h, _ in held]), new_states=states)  # [A, D]
                self._pending[k] = []
            t0 = time.perf_counter()
            self.part_drafts.append(d.draft(own))
            self.part_seconds[k] += time.perf_counter() - t0
        if self.skip_unpaid is not None:
            self._step = (now, buckets, [p is not None for p in self.part_drafts])
        # 2. merge
        return merge_drafts([d for d in self.part_drafts if d is not None])

    def _pays(self, k: int, b: int) -> bool:
        """skip_unpaid's choice for drafter k at this step (bucket b); True without skip_unpaid and for the first."""
        if self.skip_unpaid is None or k == 0:
            return True
        tally = self.tallies[k][b]
        drafts = merge_cost.drafts(tally, self.skip_unpaid)
        merge_cost.chose(tally, drafts)
        return drafts

    def _observe(self, now: float) -> None:
        """skip_unpaid: the step in flight is over (``now``): its time and tokens go to each later drafter's bucket."""
        if self.skip_unpaid is None or self._step is None or self._tokens is None:
            return
        start, buckets, drafted = self._step
        tokens, without = self._tokens
        for k in range(1, len(self.drafters)):
            merge_cost.observe(self.tallies[k][buckets[k]], drafted[k], now - start, tokens, without[k])
        self._step = self._tokens = None

    def update(self, draft: Draft, acceptance: Acceptance) -> None:
        # 3. each drafter that drafted hears the verdict on its own draft
        drafts = acceptance.drafts if acceptance.drafts is not None else draft.tokens[list(acceptance.path[1:])].tolist()
        accepted = list(drafts) + [acceptance.bonus]  # the drafts were read with the path (accept.read)
        for k, (d, own) in enumerate(zip(self.drafters, self.part_drafts)):
            if own is None:
                self._accepted[k] = 0
                continue
            t0 = time.perf_counter()
            verdict = restrict(accepted, own)
            self._accepted[k] = verdict.num_accepted_drafts
            d.update(own, verdict)
            self.part_seconds[k] += time.perf_counter() - t0
        if self.skip_unpaid is not None:
            # the tokens the step would have added without drafter k: the most any other drafter's tree holds, + bonus
            drafted = [k for k, own in enumerate(self.part_drafts) if own is not None]
            self._tokens = (len(accepted), [1 + max((self._accepted[j] for j in drafted if j != k), default=0)
                                            for k in range(len(self.drafters))])
