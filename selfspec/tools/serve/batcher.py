"""Continuous batching for the server: one worker thread decodes every running request in one batch
(``selfspec.core.batch.Batch``), one target forward a step for all of them.

    a request     steps(job, gone) -> queued at once; its Steps as the batch accepts them (closing early, or gone()
                  turning true: it leaves)
    the worker    1. take what arrived; block only while nothing decodes
                  2. drop the sequences whose readers stopped or whose clients went away (their slots free at once)
                  3. admit waiting requests, in order of arrival, while fewer than max_batch decode (prefill each)
                  4. one step of the whole batch; hand each sequence its Step; a finished one leaves

A request beyond ``max_batch`` waits in line, it is not refused. One thread, not the requests' own: torch runs slower
in a fresh thread for its first requests (docs/benchmarks/log.md, "Stop strings and infer.py serve").
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from typing import Callable, Iterator

from selfspec.api import SpecModel
from selfspec.core.batch import Batch, Job
from selfspec.core.drafter import check_batchable
from selfspec.core.generate import Step


class ClientGone(Exception):
    """The client of a request went away (its connection closed): its decoding stopped, nobody reads an answer."""


class _Ticket:
    """One request in the batcher: its Steps come back through ``out``; ``cancelled`` when its reader stopped,
    ``gone()`` when its client went away."""

    def __init__(self, key: int, job: Job, gone: Callable[[], bool] | None = None):
        self.key, self.job, self.gone = key, job, gone
        self.out: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def left(self) -> bool:
        """Whether the request leaves now (its reader gets ClientGone if its client went away)."""
        if self.cancelled.is_set():
            self.end()
            return True
        if self.gone is not None and self.gone():
            self.end(ClientGone())
            return True
        return False

    def end(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.out.put(("error", error))
        self.out.put(("end", None))


class Receipt(Iterator[Step]):
    """A queued request's Steps, as the worker hands them over; ``close`` (or the end) lets it go."""

    def __init__(self, ticket: _Ticket):
        self._ticket = ticket

    def __next__(self) -> Step:
        kind, value = self._ticket.out.get()
        if kind == "error":
            self.close()
            raise value
        if kind == "end":
            self.close()
            raise StopIteration
        return value

    def close(self) -> None:
        self._ticket.cancelled.set()


class Batcher:
    """The worker that decodes the server's requests together, at most ``max_batch`` at a time, their trees cut to
    ``node_budget`` nodes a step in all (``Batch``)."""

    def __init__(self, model: SpecModel, max_batch: int, node_budget: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, found {max_batch!r}")
        check_batchable(model.drafter, "serve it one request at a time (--max-batch 1)")
        self.model, self.max_batch, self.node_budget = model, max_batch, node_budget
        self._arrivals: queue.Queue[_Ticket] = queue.Queue()
        self._keys = itertools.count()
        self.most = 0
        """the most sequences that have decoded together so far."""
        self.abandoned = 0
        """sequences that left before their end because their clients went away."""
        self.decoding = 0
        """sequences decoding now."""
        threading.Thread(target=self._work, daemon=True, name="selfspec-decode").start()

    def steps(self, job: Job, gone: Callable[[], bool] | None = None) -> "Receipt":
        """Queue one request (``SpecModel.job``) at once -> its Steps as the batch accepts them. Closing the iterator
        early, or ``gone()`` turning true (the client went away; asked before every step), makes the request leave
        the batch at the next step."""
        ticket = _Ticket(next(self._keys), job, gone)
        self._arrivals.put(ticket)
        return Receipt(ticket)

    def _work(self) -> None:
        batch, running, waiting = Batch(self.model.target, self.node_budget), {}, deque()
        while True:
            # 1. what arrived (waiting for it only while nothing decodes)
            if not running and not waiting:
                waiting.append(self._arrivals.get())
            while not self._arrivals.empty():
                waiting.append(self._arrivals.get_nowait())
            # 2. the sequences whose readers stopped or whose clients went away leave now
            for key in [k for k, t in running.items() if t.left()]:
                batch.remove(key)
                running.pop(key)
                self.abandoned += 1
            # 3. admit in order of arrival while there is room
            while waiting and len(running) < self.max_batch:
                ticket = waiting.popleft()
                if ticket.left():
                    self.abandoned += 1
                    continue
                try:
                    step, done = batch.add(ticket.key, ticket.job)
                except Exception as err:  # noqa: BLE001 - the request's own error, raised on its thread
                    ticket.end(err)
                    continue
                ticket.out.put(("item", step))
                if done:
                    ticket.end()
                else:
                    running[ticket.key] = ticket
            self.most, self.decoding = max(self.most, len(running)), len(running)
            if not running:
                continue
            # 4. one step for every sequence
            try:
                results = batch.step()
            except Exception as err:  # noqa: BLE001 - every sequence of the failed step gets the error
                for ticket in running.values():
                    ticket.end(err)
                batch, running = Batch(self.model.target, self.node_budget), {}
                continue
            for key, step, done in results:
                running[key].out.put(("item", step))
                if done:
                    running.pop(key).end()
            self.decoding = len(running)
