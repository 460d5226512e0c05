"""The speculative decoding loop over a batch: B sequences of different lengths decode together, one target forward a
step for all of them. A sequence joins at any step and leaves when it stops (continuous batching).

    add(key, job)  1. prefill   the new prompt alone, in a cache of its own -> its root token and first Step; its cache
                                joins the batch's as one more row
    step()         2. draft     each sequence's own drafter drafts a tree rooted at its last token
                   3. verify    every sequence's tree in one forward (``Target.verify_rows``): tokens [B, N], padded to
                                the largest tree; each node sees its own sequence's text and its own ancestors
                   4. accept    per sequence, the rules of batch size 1 (``generate.judge``: each node's scores processed
                                for its own text, then greedy, lossless sampling or typical acceptance); a batch all
                                greedy on unprocessed scores verifies without the LM head and runs it once, on every
                                row's tentative path (``head_rows``)
                   5. commit    each row keeps its own accepted path, moved to follow its text (``Target.commit_rows``)
                   6. update    each sequence's drafter hears what was kept
                   7. emit      per sequence, cut at EOS, a stop string and max_new_tokens (``generate.extend``); a
                                sequence that stops leaves the batch, its row dropped

A sequence decodes here exactly as ``selfspec.core.generate.stream`` decodes it alone (the same functions, per row):
greedy output is token-identical to ``model.generate``'s, sampling keeps the target's distribution
(tests/test_batch.py, tests/test_distribution.py). Drafters keep state per sequence: each job brings its own
(``selfspec.core.drafter.fork`` copies one, its weights shared); a drafter that runs the target's own layers on its
cache (``batchable`` False) cannot join.

Shapes: B sequences, T tokens of one sequence, N tree nodes (the largest tree of a step), V vocabulary, D hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Sequence

import torch

from selfspec.core import hf
from selfspec.core.drafter import Draft, Drafter, DraftState, LayerStates, check_batchable
from selfspec.core.generate import (Output, Step, check_request, extend, fit_draft, judge, prefill_step, root_token,
                                    scored, timed)
from selfspec.core.head_rows import rows_accept
from selfspec.core.request import Decoding, as_decoding
from selfspec.core.sampling import unprocessed
from selfspec.core.stopping import first_stop
from selfspec.core.target import Target


@dataclass(frozen=True, init=False)
class Job:
    """One sequence's request: its prompt, a drafter of its own, and what ``generate.stream`` would decode it with."""

    input_ids: torch.Tensor
    """[T] or [1, T] the prompt."""
    drafter: Drafter
    """this sequence's own drafter (``fork`` of a shared one): its state follows this sequence alone."""
    decoding: Decoding
    """the request bound to the model (``selfspec.core.request.Decoding``)."""

    def __init__(self, input_ids: torch.Tensor, drafter: Drafter, decoding: Decoding | int | None = None,
                 **keywords: Any):
        """decoding: a Decoding, or max_new_tokens with ``Decoding.of``'s keywords, as ``generate.stream`` takes
        them (``Job(ids, drafter, 64, sampling=..., eos_token_id=...)``)."""
        object.__setattr__(self, "input_ids", input_ids)
        object.__setattr__(self, "drafter", drafter)
        object.__setattr__(self, "decoding", as_decoding(decoding, keywords))


@dataclass
class _Live:
    """A sequence in the batch: its job and where it stands. Its cache row holds tokens[:-1]."""

    key: Hashable
    job: Job
    prompt_length: int
    tokens: torch.Tensor
    """[T] prompt and new tokens; tokens[-1] is the root of its next tree (not yet in the cache)."""
    produced: int
    hidden: torch.Tensor
    new_hidden: torch.Tensor
    new_states: LayerStates | None


class Batch:
    """The sequences decoding together on one target; ``add`` one, ``step`` them all, ``remove`` one."""

    def __init__(self, target: Target, node_budget: int | None = None):
        """node_budget: the most tree nodes one step verifies for the whole batch of two or more (``within_budget``:
        every root, then equal shares for the sequences that drafted). On a CPU a forward's cost grows with the nodes
        of every row together, so the trees that pay at batch size 1 cost more than they gain in a full batch. None:
        every tree whole."""
        if node_budget is not None and (isinstance(node_budget, bool) or not isinstance(node_budget, int)
                                        or node_budget < 1):
            raise ValueError(f"node_budget must be an int >= 1 (or None: no limit), found {node_budget!r}")
        self.target, self.node_budget = target, node_budget
        self.cache = hf.rows_cache(target.model)
        self.live: list[_Live] = []
        self._sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)

    def __len__(self) -> int:
        return len(self.live)

    @property
    def keys(self) -> list[Hashable]:
        return [s.key for s in self.live]

    @torch.inference_mode()
    def add(self, key: Hashable, job: Job) -> tuple[Step, bool]:
        """1. prefill ``job``'s prompt alone and let it join the batch -> (its first Step, whether it is already done:
        then it does not join). Refuses a request plain decoding could not serve either, and a drafter that cannot
        batch."""
        target, d = self.target, job.decoding
        check_request(target, job.input_ids, d.max_new_tokens)
        check_batchable(job.drafter)
        if key in self.keys:
            raise ValueError(f"a sequence with key {key!r} is already in the batch")
        prompt = job.input_ids.reshape(-1).to(target.device)
        cache = hf.rows_cache(target.model)
        t0 = time.perf_counter()
        pre = target.prefill(prompt, cache, every_logit=d.options.prompt_logprobs is not None)
        root = root_token(pre.logits[-1:], prompt, d)
        self._sync()
        tokens = torch.cat([prompt, prompt.new_tensor([root])])  # [T]
        step = prefill_step(pre, prompt, root, d.options, time.perf_counter() - t0)
        if d.max_new_tokens <= 1 or first_stop(d.stopping_criteria, tokens, 1, set(d.eos)) is not None:
            return step, True
        hf.join_rows(self.cache, cache)
        self.live.append(_Live(key=key, job=job, prompt_length=prompt.shape[0], tokens=tokens, produced=1,
                               hidden=pre.hidden[-1], new_hidden=pre.hidden,
                               new_states=None if pre.states is None else LayerStates.of(pre.states)))
        return step, False

    @torch.inference_mode()
    def remove(self, key: Hashable) -> None:
        """Let a sequence leave the batch before it is done (its client went away)."""
        self._leave({key})

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Step, bool]]:
        """One speculative step for every sequence -> (key, its Step, whether it is done) per sequence, in batch order;
        the sequences that are done have left the batch."""
        if not self.live:
            return []
        target, t_step = self.target, time.perf_counter()
        lengths = [s.tokens.shape[0] - 1 for s in self.live]
        start = hf.cache_length(self.cache)
        # 2. draft: each sequence its own tree, never deeper than its tokens still wanted or the context allows
        drafts, draft_s = [], []
        for s, length in zip(self.live, lengths):
            d = s.job.decoding
            state = DraftState(tokens=s.tokens, prompt_length=s.prompt_length, hidden=s.hidden, cache=None,
                               sampling=d.sampling, new_hidden=s.new_hidden, new_states=s.new_states,
                               generator=d.generator)
            proposed, seconds = timed(self._sync, s.job.drafter.draft, state)
            drafts.append(fit_draft(proposed, target, length, d.max_new_tokens - s.produced - 1))
            draft_s.append(seconds)
        if self.node_budget is not None and len(drafts) > 1:
            drafts = within_budget(drafts, self.node_budget)

        # 3. verify every sequence's tree in one forward (all greedy on unprocessed scores: without the LM head)
        head = target.plain_head() if all(self._unprocessed(s) for s in self.live) else None
        out, verify_s = timed(self._sync, target.verify_rows, [d.tree for d in drafts], [d.tokens for d in drafts],
                              self.cache, lengths, head is None)

        # 4. accept, per sequence (or, without the LM head, from every row's tentative path, head_rows)
        if head is None:
            accepted, path_logits = [], []
            for row, (s, d) in enumerate(zip(self.live, drafts)):
                accepted.append(judge(d, out.logits[row, : len(d.tree)], s.tokens, s.prompt_length, s.produced,
                                      s.job.decoding))
                path_logits.append(out.logits[row, list(accepted[-1].path)])  # [P, V]
        else:
            accepted, path_logits = rows_accept(drafts, out.hidden, *head)

        # 5. commit: each row keeps its root and accepted drafts, in order, right after its text
        target.commit_rows(self.cache, start, lengths, [a.path for a in accepted])

        # 6.-7. each drafter hears what was kept; each sequence emits, and leaves when it stops
        results, done = [], set()
        other_s = time.perf_counter() - t_step - verify_s
        for row, (s, d, acc) in enumerate(zip(self.live, drafts, accepted)):
            j = s.job.decoding
            s.job.drafter.update(d, acc)
            s.tokens, new, stop = extend(s.tokens, d, acc, j.max_new_tokens - s.produced, j.stopping_criteria, j.eos)
            s.produced += len(new)
            path = list(acc.path)
            s.hidden, s.new_hidden = out.hidden[row, path[-1]], out.hidden[row, path]  # [D], [A, D]
            s.new_states = None if out.states is None else LayerStates.of(tuple(h[row] for h in out.states), path)
            step = Step(tokens=tuple(new), tree_size=len(d.tree), verify_s=verify_s, other_s=other_s,
                        draft_s=draft_s[row],
                        logprobs=scored(path_logits[row][: len(new)], s.tokens[-len(new):], j.options.logprobs))
            finished = stop is not None or s.produced >= j.max_new_tokens
            if finished:
                done.add(s.key)
            results.append((s.key, step, finished))
        self._leave(done)
        return results

    @staticmethod
    def _unprocessed(s: "_Live") -> bool:
        """Whether this sequence's step is greedy on scores as the model gives them (``head_rows`` may decide it)."""
        d = s.job.decoding
        return d.sampling.greedy and unprocessed(d.sampling, d.processors) and s.produced >= d.min_new_tokens

    def _leave(self, keys: set[Hashable]) -> None:
        """Drop the sequences ``keys`` and their cache rows."""
        if not keys:
            return
        stay = [i for i, s in enumerate(self.live) if s.key not in keys]
        self.live = [self.live[i] for i in stay]
        if not self.live:
            self.cache = hf.rows_cache(self.target.model)
            return
        hf.select_rows(self.cache, stay, max(s.tokens.shape[0] - 1 for s in self.live))


def within_budget(drafts: list[Draft], budget: int) -> list[Draft]:
    """The drafts cut to ``budget`` nodes in all: every root stays; the nodes left over are shared equally among the
    drafts that drafted anything (a share a draft does not fill passes on to the others), each cut to its first
    nodes (``Draft.pruned``)."""
    sizes = [1] * len(drafts)
    left = budget - len(drafts)
    wanting = [i for i, d in enumerate(drafts) if len(d.tree) > 1]
    while left > 0 and wanting:
        share = max(1, left // len(wanting))
        for i in list(wanting):
            take = min(share, len(drafts[i].tree) - sizes[i], left)
            sizes[i], left = sizes[i] + take, left - take
            if sizes[i] == len(drafts[i].tree):
                wanting.remove(i)
            if left == 0:
                break
    return [d.pruned(n) for d, n in zip(drafts, sizes)]


def stream_batch(target: Target, jobs: Sequence[Job], max_batch: int | None = None,
                 node_budget: int | None = None) -> Iterator[tuple[int, Step, bool]]:
    """Decode ``jobs`` together -> (job index, Step, whether that sequence is done) as each sequence's tokens are
    accepted, each sequence's steps in order. At most ``max_batch`` sequences decode at once (None: all); the others wait in order and join as sequences
    finish, at the next step (continuous batching)."""
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise ValueError(f"max_batch must be an int >= 1 (or None: no limit), found {max_batch!r}")
    batch, waiting = Batch(target, node_budget), list(range(len(jobs)))[::-1]
    while waiting or len(batch):
        while waiting and (max_batch is None or len(batch) < max_batch):
            i = waiting.pop()
            step, done = batch.add(i, jobs[i])
            yield i, step, done
        yield from batch.step()  # type: ignore[misc]


def generate_batch(target: Target, jobs: Sequence[Job], max_batch: int | None = None) -> list[Output]:
    """Run ``stream_batch`` to the end -> one Output per job (its new tokens and steps)."""
    outs = [Output(prompt_length=j.input_ids.reshape(-1).shape[0]) for j in jobs]
    for i, step, _ in stream_batch(target, jobs, max_batch):
        outs[i].steps.append(step)
        outs[i].tokens.extend(step.tokens)
    return outs
