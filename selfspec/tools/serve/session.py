"""The served model and how its requests are decoded (together, in one batch on one worker thread, ``batcher``; or with
``max_batch`` 1 or a draft that cannot batch, one at a time, the others waiting in line), and one answer decoded into
pieces of text: stop strings cut (text that could begin one held back), each token's log-probability placed where its
text starts. What one request may ask for is capped (``max_choices``, ``max_prompt_chars``), and a request whose
client went away (``gone``) stops at its next step."""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple

from selfspec.api import SpecModel
from selfspec.core.logprobs import TokenLogprob
from selfspec.core.request import GenerationOptions
from selfspec.core.text_stream import TextStream
from selfspec.tools.serve.batcher import Batcher, ClientGone
from selfspec.tools.serve.protocol import Request, RequestError, parse_request
from selfspec.tools.token_bytes import token_bytes, token_text


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The answer's text up to the first stop string (excluded, as OpenAI returns it) and whether one was found."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


class Scored(NamedTuple):
    """A token of a choice's text, where its text starts in it, and its log-probability (None: the prompt's first
    token, which nothing predicts)."""

    token: int
    offset: int
    logprob: TokenLogprob | None


class Piece(NamedTuple):
    """What one answer streams: text, the tokens whose text starts in it (when log-probabilities are asked for), and
    at the end, with empty text, the finish reason and usage."""

    text: str
    tokens: tuple[Scored, ...] = ()
    end: dict | None = None


def text_starts(decode: Callable[[list[int]], str], tokens: list[int], first: int = 0) -> list[int]:
    """Where the text of each of tokens[first:] starts in decode(tokens): the length of the text before it (a token
    inside a character split across tokens: where that character starts)."""
    starts, last = [], 0
    for i in range(first, len(tokens)):
        last = max(last, len(decode(tokens[:i]).rstrip("\ufffd")))
        starts.append(last)
    return starts


class _Ledger:
    """An answer's tokens with where their text starts (after ``base`` characters of echoed prompt), and how many of
    them have gone out."""

    def __init__(self, decode: Callable[[list[int]], str], base: int = 0):
        self.decode, self.base, self.scored, self.sent = decode, base, [], 0

    def add(self, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Record the tokens (and their log-probabilities) beyond those already recorded."""
        known = len(self.scored)
        for token, start, lp in zip(tokens[known:], text_starts(self.decode, tokens, known), logprobs[known:]):
            offset = max(self.base + start, self.scored[-1].offset if self.scored else self.base)
            self.scored.append(Scored(token, offset, lp))

    def take(self, upto: float) -> tuple[Scored, ...]:
        """The tokens not yet sent whose text starts before character ``upto`` of the answer."""
        end = self.sent
        while end < len(self.scored) and self.scored[end].offset < self.base + upto:
            end += 1
        out, self.sent = tuple(self.scored[self.sent:end]), end
        return out


Gone = Callable[[], bool]
"""whether a request's client has gone away; asked at every step of its decoding."""


def never() -> bool:
    return False


class _Job:
    """One request's decoding, run on the session's worker thread; its items come back through a queue."""

    def __init__(self, items: Iterator, gone: Gone = never):
        self.items, self.out, self.cancelled, self.gone = items, queue.Queue(), threading.Event(), gone

    def run(self) -> None:
        try:
            if self.gone():  # its client left while it waited in line: it never starts
                raise ClientGone()
            for item in self.items:
                if self.cancelled.is_set():  # the reader stopped: stop after the step in flight
                    break
                self.out.put(("item", item))
        except BaseException as err:  # noqa: BLE001 - handed to the request's thread, which raises it
            self.out.put(("error", err))
        finally:
            self.items.close()
            self.out.put(("end", None))


MAX_CHOICES = 64
"""the server's default cap on the answers one request asks for (its prompts x n): one request of 20 prompts x n=128
would otherwise hold the worker for 2,560 answers."""

BATCH_NODES = 8
"""the server's default node budget a step for a batch of two or more (``selfspec.core.batch.within_budget``): on the
2-core CPU a forward's cost grows with every row's nodes together, so a full batch of 8 decodes fastest with no drafts
at all, and smaller batches share what is left (docs/benchmarks/log.md, section 30)."""


class Session:
    """The served model and how its requests decode: up to ``max_batch`` together in one batch (``Batcher``: requests
    join the running batch at its next step, the rest wait in line), or, with max_batch 1 or a draft that cannot batch,
    one at a time on one worker thread, the others waiting in line.

    One worker thread, not the request's own: torch runs slower in a fresh thread for its first requests (measured:
    docs/benchmarks/log.md, "Stop strings and infer.py serve"), and ThreadingHTTPServer gives every request a fresh
    thread."""

    def __init__(self, model: SpecModel, name: str, default_temperature: float = 0.0, default_max_tokens: int = 256,
                 api_key: str | None = None, max_batch: int = 8, batch_nodes: int | None = BATCH_NODES,
                 max_choices: int = MAX_CHOICES, max_prompt_chars: int | None = None):
        """api_key: requests must send ``Authorization: Bearer <api_key>`` (None: no check). max_batch: the most
        requests that decode together (1: one at a time); batch_nodes: the most draft-tree nodes a step verifies for
        all of them together (``selfspec.core.batch.Batch``'s node_budget; None: every tree whole). max_choices: the
        most answers one request may ask for (its prompts x n); max_prompt_chars: the most characters of one prompt
        (a chat's: its messages' together), refused before it is tokenized (None: ``longest_prompt(model)``, the
        longest that could fit the context)."""
        for key, value in (("max_choices", max_choices), ("max_prompt_chars", max_prompt_chars)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be an int >= 1, found {value!r}")
        self.model, self.name, self.api_key = model, name, api_key
        self.default_temperature, self.default_max_tokens = default_temperature, default_max_tokens
        self.max_choices = max_choices
        self.max_prompt_chars = max_prompt_chars or longest_prompt(model)
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        self.batcher = Batcher(model, max_batch, batch_nodes) if max_batch > 1 and model.drafter.batchable else None
        if self.batcher is None:
            self._jobs: queue.Queue[_Job] = queue.Queue()  # one request decodes at a time
            threading.Thread(target=self._work, daemon=True, name="selfspec-decode").start()

    def _work(self) -> None:
        while True:
            self._jobs.get().run()

    def token_text(self, token: int) -> str:
        """The text a token adds (special tokens by name; SentencePiece's "▁b" is " b"), as log-probabilities name it."""
        if token not in self._texts:
            self._texts[token] = token_text(self.model.tokenizer, token)
        return self._texts[token]

    def token_bytes(self, token: int) -> list[int]:
        """The bytes a token adds (a piece of a character split across tokens: its own bytes, not U+FFFD's), as
        log-probabilities' ``bytes`` give them."""
        if token not in self._bytes:
            self._bytes[token] = list(token_bytes(self.model.tokenizer, token))
        return self._bytes[token]

    def warm_up(self) -> None:
        """Decode a few tokens on the worker, so that the first request does not pay for its first use."""
        for _ in self.pieces(Request(prompts=("Hello",), stream=False, max_new_tokens=8, stops=(),
                                     options=GenerationOptions(chat=False, stop=()))):
            pass

    def check_model(self, body: Any) -> None:
        """A request's ``model``, if it names one, must be the served model's name (404, as OpenAI and vLLM answer)."""
        name = body.get("model") if isinstance(body, dict) else None
        if name is None or name == self.name:
            return
        if not isinstance(name, str):
            raise RequestError(f"'model': expected a string, found {name!r:.80}", "model")
        raise RequestError(f"the model {name!r:.80} does not exist: this server serves {self.name!r} (GET /v1/models); "
                           "send that name, or none", "model", status=404, code="model_not_found")

    def check_prompt_chars(self, prompt: Any, param: str) -> None:
        """Refuse a text prompt (or a chat's messages together) longer than ``max_prompt_chars``, before tokenizing."""
        if isinstance(prompt, str):
            chars = len(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            chars = sum(len(m["content"]) for m in prompt)
        else:  # token ids: the context check refuses too many, at no cost
            return
        if chars > self.max_prompt_chars:
            raise RequestError(f"'{param}': {chars:,} characters, more than the {self.max_prompt_chars:,} this server "
                               "takes in one prompt (infer.py serve --max-prompt-chars): shorten it", param)

    def parse(self, body: Any, chat: bool) -> Request:
        self.check_model(body)
        r = parse_request(body, chat, self.default_temperature)
        if len(r.prompts) * r.n > self.max_choices:
            raise RequestError(f"'n': {len(r.prompts)} prompt(s) x n={r.n} ask for {len(r.prompts) * r.n:,} answers, "
                               f"more than the {self.max_choices} this server decodes for one request (infer.py serve "
                               "--max-choices): split the request", "n")
        for i, p in enumerate(r.prompts):
            self.check_prompt_chars(p, "messages" if chat else "prompt" if len(r.prompts) == 1 else f"prompt[{i}]")
        vocab = self.model.target.vocab_size
        for p in r.prompts:
            bad = [i for i in p if not 0 <= i < vocab] if isinstance(p, list) and not chat else []
            if bad:
                raise RequestError(f"'prompt': token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})",
                                   "prompt")
        bad = [k for k, _ in r.options.logit_bias if k >= vocab]
        if bad:
            raise RequestError(f"'logit_bias': token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})",
                               "logit_bias")
        if r.options.stop is None:  # the model's own stop strings (its generation config's) are cut as well
            r = dataclasses.replace(r, stops=self.model.stop_strings)
        return r

    def pieces(self, r: Request, index: int = 0, gone: Gone = never) -> Iterator[Piece]:
        """Answer ``index`` of ``r`` (to prompt index // r.n), as Pieces: text as the target accepts it, with stop
        strings cut (text that could begin one is held back until it cannot), then Piece("", ..., end) with
        finish_reason and usage. Decoded on the worker thread, after the requests before it; closing this iterator
        early stops the decoding, and so does ``gone()`` turning true (asked at every step, and before the decoding
        starts): then ClientGone is raised."""
        if self.batcher is not None:  # the text side here, the decoding on the batcher's worker
            answer = self._decode(r, index, gone)
            try:
                yield from answer
            finally:
                answer.close()
            return
        job = _Job(self._decode(r, index, gone), gone)
        self._jobs.put(job)
        try:
            while True:
                kind, value = job.out.get()
                if kind == "error":
                    raise value
                if kind == "end":
                    return
                yield value
        finally:
            job.cancelled.set()

    def _decode(self, r: Request, index: int = 0, gone: Gone = never) -> Iterator[Piece]:
        prompt, j = r.prompts[index // r.n], index % r.n
        options = r.options
        if j and options.seed is not None:  # the n answers to one prompt differ, and repeat with the seed
            options = options.replace(seed=options.seed + j)
        ids = self.model.encode(prompt, chat=r.chat)
        limit, room = r.max_new_tokens, self.model.target.max_length - int(ids.shape[0])
        if limit is not None and limit > room >= 1:  # named as the client sent it, not as generate calls it
            raise RequestError(f"'max_tokens': the prompt ({int(ids.shape[0])} tokens) + max_tokens ({limit}) exceeds "
                               f"the model's context of {self.model.target.max_length}; expected max_tokens <= {room}",
                               "max_tokens")
        if limit is None:  # as OpenAI-compatible servers do: no more than the context has room for
            limit = max(1, min(self.default_max_tokens, self.model.target.max_length - int(ids.shape[0])))
        options = options.replace(max_new_tokens=limit)
        if self.batcher is not None:
            stream = TextStream(self.batcher.steps(self.model.job(ids, options), gone), self.model.tokenizer)
        else:
            stream = self.model.stream(ids, options)
        try:
            yield from self._answer(r, prompt, ids, limit, stream, gone)
        finally:
            stream.cancel()

    def _answer(self, r: Request, prompt: Any, ids: Any, limit: int, stream: TextStream,
                gone: Gone = never) -> Iterator[Piece]:
        """The pieces of one answer from the stream of its decoding (ClientGone as soon as ``gone()``)."""
        scoring = r.logprobs is not None
        echo = (prompt if isinstance(prompt, str) else self.model.decode(ids.tolist())) if r.echo else ""
        ledger = _Ledger(self.model.decode, base=len(echo))  # the answer's text starts after the echoed prompt's

        def echoed() -> Piece:
            if not scoring:
                return Piece(echo)
            prompt_ids = ids.tolist()
            lps = [None, *stream.prompt_logprobs]  # nothing predicts the first
            return Piece(echo, tuple(map(Scored, prompt_ids, text_starts(self.model.decode, prompt_ids), lps)))

        hold = max((len(s) for s in r.stops), default=1) - 1
        sent, stopped, echo_due = 0, False, r.echo
        for _ in stream:
            if gone():  # the client went away: no further step
                raise ClientGone()
            if echo_due:  # the prompt goes first (its log-probabilities come with the prefill)
                yield echoed()
                echo_due = False
            text, stopped = cut_at_stop(stream.text, r.stops)
            upto = len(text) if stopped else max(len(text) - hold, sent)
            if scoring:
                ledger.add(stream.tokens, stream.logprobs)
            if upto > sent:
                yield Piece(text[sent:upto], ledger.take(upto) if scoring else ())
                sent = upto
            if stopped:
                break
        if echo_due:
            yield echoed()
        text, stopped = cut_at_stop(stream.text, r.stops)
        if scoring:
            ledger.add(stream.tokens, stream.logprobs)
        # a stop string's own tokens are dropped with its text; an end-of-sequence token (no text) is kept
        rest = ledger.take(len(text) if stopped else float("inf")) if scoring else ()
        if len(text) > sent or rest:
            yield Piece(text[sent:], rest)
        stats = stream.stats
        eos = bool(stream.tokens) and stream.tokens[-1] in self.model.eos_token_id
        finish = "stop" if stopped or eos or stats.new_tokens < limit else "length"
        usage = {"prompt_tokens": int(ids.shape[0]), "completion_tokens": stats.new_tokens,
                 "total_tokens": int(ids.shape[0]) + stats.new_tokens,
                 "selfspec": {"steps": stats.steps, "mean_accepted_tokens": round(stats.mean_accepted, 4),
                              "seconds": round(stats.seconds, 4), "tokens_per_s": round(stats.tokens_per_s, 2)}}
        yield Piece("", (), {"finish_reason": finish, "usage": usage})


def longest_prompt(model: SpecModel) -> int:
    """The most characters a prompt that fits ``model``'s context can have: its context x the characters of its
    longest token (a byte-level token's characters are bytes, each at least one character's worth). A longer prompt
    could only be refused after tokenizing it."""
    longest = max((len(t) for t in model.tokenizer.get_vocab()), default=1)
    return model.target.max_length * max(longest, 1)
