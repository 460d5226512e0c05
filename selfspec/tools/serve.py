"""An OpenAI-compatible HTTP endpoint over one SpecModel: ``python infer.py serve``.

    POST /v1/chat/completions   {"messages": [...], "max_tokens": 64, "stream": true, ...}
    POST /v1/completions        {"prompt": "...", ...}                  (plain text, no chat template)
    GET  /v1/models             the one model served
    GET  /health
    POST /tokenize, /detokenize, GET /tokenizer_info    vLLM's tokenizer endpoints (lm-eval's tokenizer_backend=remote)

Clients of OpenAI's API (its Python client, chat UIs, evaluation harnesses) talk to it unchanged; every answer is
decoded speculatively and losslessly, and says how (``usage.selfspec``: steps and mean accepted tokens per step).

Requests are decoded one at a time (selfspec decodes at batch size 1); others wait in line. Sampling fields are
OpenAI's (``temperature``, ``top_p``, ``seed``, ``stop``, ``max_tokens`` / ``max_completion_tokens``) and the common
extensions of OpenAI-compatible servers (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``); a request
without ``temperature`` decodes with the server's (``--temperature``, default 0: greedy, token-identical to
``generate``). As in OpenAI's API a stop string ends the answer and is not part of it.

Log-probabilities as OpenAI reports them (chat: ``logprobs: true`` and ``top_logprobs``; completions: ``logprobs: k``
and ``echo`` for the prompt's own, what evaluation harnesses score multiple-choice questions with): the target's own,
before sampling and penalties (``selfspec.core.logprobs``), with each token's own ``bytes`` (a piece of a character split
across tokens included, ``selfspec.tools.token_bytes``). A completion's ``prompt`` may be text, token ids, or a list of
either (one choice per prompt, decoded in turn); ``n`` answers each (decoded in turn). ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` apply as OpenAI applies them. Fields the server cannot honour (tools,
structured output, suffixes) and unknown fields are refused with a 400 that names them, as OpenAI refuses unknown
arguments.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator, NamedTuple

from selfspec.api import SpecModel
from selfspec.core.logprobs import MAX_TOP, TokenLogprob
from selfspec.core.request import GenerationOptions
from selfspec.tools.token_bytes import token_bytes, token_text

CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "seed", "stop", "stream", "stream_options", "repetition_penalty", "min_tokens", "n", "logprobs",
               "top_logprobs", "frequency_penalty", "presence_penalty", "user", "logit_bias", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"}
COMPLETION_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                    "response_format", "parallel_tool_calls"}) | {"prompt", "echo", "suffix"}
NEUTRAL = {"tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
           "parallel_tool_calls": (None, False, True), "suffix": (None, "")}
"""fields selfspec cannot honour, with the values that ask for nothing (accepted, as clients send them by default)."""


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), with the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Request:
    """A validated request: the prompts, and the options ``SpecModel.stream`` decodes each answer with."""

    prompts: tuple[Any, ...]
    """chat messages (one), or texts / token-id lists fed without the chat template (one choice each)."""
    stream: bool
    max_new_tokens: int | None
    """None: the server's default, capped to the room the context leaves after the prompt."""
    options: GenerationOptions
    """temperature, top_p, top_k, min_p, seed, penalties, logit bias, min_new_tokens, stop (None: the model's own),
    logprobs and chat; its max_new_tokens is set per answer (``max_new_tokens`` above, or the room the context
    leaves)."""
    stops: tuple[str, ...]
    """the stop strings, cut from the answer's text."""
    echo: bool = False
    """a completion's text and log-probabilities start with the prompt's."""
    n: int = 1
    """answers per prompt (choice i answers prompt i // n; with a seed, answer j of a prompt samples with seed + j)."""

    @property
    def chat(self) -> bool:
        """a chat completion (the chat template applied), else a text completion."""
        return self.options.chat

    @property
    def logprobs(self) -> int | None:
        """report each answer token's log-probability with this many alternatives (None: none)."""
        return self.options.logprobs


def _number(body: dict, key: str, kind: type, default: Any, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (kind is float or float(value).is_integer())
    if not ok:
        raise RequestError(f"'{key}': expected {'an integer' if kind is int else 'a number'}, found {value!r}", key)
    value = kind(value)
    if (low is not None and value < low) or (high is not None and value > high):
        expected = f"a value in [{low}, {high}]" if high is not None else f"a value >= {low}"
        raise RequestError(f"'{key}': expected {expected}, found {value}", key)
    return value


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""the message roles OpenAI's chat API takes; the model's chat template decides what each becomes."""


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages': expected a non-empty list of {role, content} objects, found "
                           f"{messages!r:.80}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"'messages[{i}]': expected an object with 'role' and 'content', found {m!r:.80}",
                               "messages")
        if m["role"] not in ROLES:
            raise RequestError(f"'messages[{i}].role': expected one of {', '.join(ROLES)} (OpenAI's), found "
                               f"{m['role']!r:.40}", "messages")
        content = m["content"]
        if isinstance(content, list):  # content parts: text only
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                raise RequestError(f"'messages[{i}].content': only text parts are supported, found "
                                   f"{sorted(map(str, kinds))}", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RequestError(f"'messages[{i}].content': expected a string, found {content!r:.80}", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def parse_request(body: Any, chat: bool, default_temperature: float = 0.0) -> Request:
    """A JSON body -> Request; raises RequestError naming the field at fault."""
    if not isinstance(body, dict):
        raise RequestError(f"expected a JSON object, found {type(body).__name__}")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)} (this endpoint takes "
                           f"{', '.join(sorted(known))})", unknown[0])
    for key, neutral in NEUTRAL.items():
        if key in body and key in known and body[key] not in neutral:
            raise RequestError(f"'{key}': selfspec serves text without tools, structured output or suffixes; expected "
                               f"{neutral[0]!r}, found {body[key]!r:.80}", key)
    if chat:
        prompts: tuple[Any, ...] = (_messages(body),)
        if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
            raise RequestError("'top_logprobs': needs 'logprobs': true", "top_logprobs")
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise RequestError(f"'logprobs': expected true or false, found {body['logprobs']!r:.80}", "logprobs")
        logprobs = _number(body, "top_logprobs", int, 0, 0, MAX_TOP) if body.get("logprobs") else None
    else:
        prompts = _prompts(body.get("prompt"))
        logprobs = _number(body, "logprobs", int, None, 0, MAX_TOP)
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(f"'echo': expected true or false, found {echo!r:.80}", "echo")
    stop = body.get("stop")
    stops = tuple(stop) if isinstance(stop, list) else () if stop is None else (stop,)  # a wrong type fails below
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop': expected a non-empty string or a list of them, found {stop!r:.80}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream': expected true or false, found {stream!r}", "stream")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    decoding: dict[str, Any] = dict(
        temperature=_number(body, "temperature", float, default_temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", int, 0, -1),
        min_p=_number(body, "min_p", float, 0.0, 0.0, 1.0),
        seed=_number(body, "seed", int, None, -2**63, 2**63 - 1),  # what torch's generators take
        repetition_penalty=_number(body, "repetition_penalty", float, None, 0.0),
        min_new_tokens=_number(body, "min_tokens", int, None, 0),
        presence_penalty=_number(body, "presence_penalty", float, 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        stop=list(stops) if stop is not None else None,  # none given: the model's own (its generation config's)
    )
    if decoding["top_k"] < 0:  # vLLM's "-1 = off"
        decoding["top_k"] = 0
    if decoding["top_p"] == 0.0:
        raise RequestError("'top_p': expected a value in (0, 1], found 0.0", "top_p")
    options = GenerationOptions(chat=chat, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                                **decoding)
    return Request(prompts=prompts, stream=stream, options=options, stops=stops,
                   max_new_tokens=_number(body, key, int, None, 1), echo=echo,
                   n=_number(body, "n", int, 1, 1, 128))


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]}."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(f"'logit_bias': expected an object mapping token ids to biases, found {bias!r:.80}",
                           "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) or isinstance(value, bool) or \
                not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"'logit_bias': expected token ids (as strings) mapped to biases in [-100, 100], found "
                               f"{key!r}: {value!r}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _prompts(prompt: Any) -> tuple[Any, ...]:
    """A completion's ``prompt`` as OpenAI takes it: text, token ids, or a non-empty list of either."""
    def one(p: Any) -> bool:
        return isinstance(p, str) or (isinstance(p, list) and bool(p) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in p))

    if one(prompt):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return tuple(prompt)
    raise RequestError("'prompt': expected a string, a list of token ids, or a non-empty list of either, found "
                       f"{prompt!r:.80}", "prompt")


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


class _Job:
    """One request's decoding, run on the session's worker thread; its items come back through a queue."""

    def __init__(self, items: Iterator):
        self.items, self.out, self.cancelled = items, queue.Queue(), threading.Event()

    def run(self) -> None:
        try:
            for item in self.items:
                if self.cancelled.is_set():  # the client went away: stop after the step in flight
                    break
                self.out.put(("item", item))
        except BaseException as err:  # noqa: BLE001 - handed to the request's thread, which raises it
            self.out.put(("error", err))
        finally:
            self.items.close()
            self.out.put(("end", None))


class Session:
    """The served model and the line requests wait in: one worker thread decodes every request, in turn.

    One thread, not the request's own: torch runs slower in a fresh thread for its first requests (measured:
    docs/BENCHMARKS.md, "Stop strings and infer.py serve"), and ThreadingHTTPServer gives every request a fresh
    thread."""

    def __init__(self, model: SpecModel, name: str, default_temperature: float = 0.0, default_max_tokens: int = 256,
                 api_key: str | None = None):
        """api_key: requests must send ``Authorization: Bearer <api_key>`` (None: no check)."""
        self.model, self.name, self.api_key = model, name, api_key
        self.default_temperature, self.default_max_tokens = default_temperature, default_max_tokens
        self._jobs: queue.Queue[_Job] = queue.Queue()  # batch size 1: one request decodes at a time
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
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

    def parse(self, body: Any, chat: bool) -> Request:
        r = parse_request(body, chat, self.default_temperature)
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

    def pieces(self, r: Request, index: int = 0) -> Iterator[Piece]:
        """Answer ``index`` of ``r`` (to prompt index // r.n), as Pieces: text as the target accepts it, with stop
        strings cut (text that could begin one is held back until it cannot), then Piece("", ..., end) with
        finish_reason and usage. Decoded on the worker thread, after the requests before it; closing this iterator early stops the
        decoding."""
        job = _Job(self._decode(r, index))
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

    def _decode(self, r: Request, index: int = 0) -> Iterator[Piece]:
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
        scoring = r.logprobs is not None
        stream = self.model.stream(ids, options.replace(max_new_tokens=limit))
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


def _envelope(session: Session, chat: bool) -> dict:
    """The fields every response object of one answer shares (a new id per answer)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": session.name}


def _logprobs(session: Session, r: Request, tokens: tuple[Scored, ...] | list[Scored]) -> dict | None:
    """OpenAI's logprobs object for these tokens: chat's ``content`` list, or the completions API's parallel lists
    (whose ``top_logprobs`` hold the k likeliest tokens and the chosen one, as OpenAI's do)."""
    if r.logprobs is None:
        return None
    text = session.token_text
    if r.chat:
        def entry(token: int, logprob: float) -> dict:
            return {"token": text(token), "logprob": logprob, "bytes": session.token_bytes(token)}

        return {"content": [{**entry(s.token, s.logprob.logprob),
                             "top_logprobs": [entry(i, v) for i, v in s.logprob.top]}
                            for s in tokens if s.logprob is not None], "refusal": None}
    return {"tokens": [text(s.token) for s in tokens],
            "token_logprobs": [None if s.logprob is None else s.logprob.logprob for s in tokens],
            "top_logprobs": [None if s.logprob is None else
                             {**{text(i): v for i, v in s.logprob.top}, text(s.token): s.logprob.logprob}
                             for s in tokens],
            "text_offset": [s.offset for s in tokens]}


def _usage(finals: list[dict], n: int = 1) -> dict:
    """One request's usage: its answers' added up (one answer: its own), each prompt counted once, as OpenAI counts
    it, however many (n) answers it has (answer i answers prompt i // n)."""
    if len(finals) == 1:
        return finals[0]["usage"]
    prompt = sum(f["usage"]["prompt_tokens"] for f in finals[::n])
    new = sum(f["usage"]["completion_tokens"] for f in finals)
    usage = {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}
    steps = sum(f["usage"]["selfspec"]["steps"] for f in finals)
    seconds = sum(f["usage"]["selfspec"]["seconds"] for f in finals)
    usage["selfspec"] = {"steps": steps, "mean_accepted_tokens": round(new / max(steps, 1), 4),
                         "seconds": round(seconds, 4), "tokens_per_s": round(new / seconds, 2) if seconds else 0.0}
    return usage


def complete(session: Session, r: Request) -> dict:
    """The whole answer (n choices per prompt) as one OpenAI response object."""
    choices, finals = [], []
    for index in range(len(r.prompts) * r.n):
        parts, tokens, final = [], [], {}
        for piece in session.pieces(r, index):
            parts.append(piece.text)
            tokens.extend(piece.tokens)
            final = piece.end or final
        text = "".join(parts)
        choice: dict[str, Any] = {"index": index, "finish_reason": final["finish_reason"],
                                  "logprobs": _logprobs(session, r, tokens)}
        choice.update({"message": {"role": "assistant", "content": text}} if r.chat else {"text": text})
        choices.append(choice)
        finals.append(final)
    return {**_envelope(session, r.chat), "choices": choices, "usage": _usage(finals, r.n)}


def chunks(session: Session, r: Request, include_usage: bool = False) -> Iterator[dict]:
    """The answer as OpenAI stream chunks (the first carries the role, the last of each choice its finish reason)."""
    kind = "chat.completion.chunk" if r.chat else "text_completion"
    head = {**_envelope(session, r.chat), "object": kind}

    def chunk(index: int, text: str | None, finish: str | None, tokens: tuple[Scored, ...] = (),
              role: bool = False) -> dict:
        lps = _logprobs(session, r, tokens) if tokens else None
        if r.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}]}
        return {**head, "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": lps}]}

    finals = []
    for index in range(len(r.prompts) * r.n):
        pieces = session.pieces(r, index)
        try:
            first = next(pieces)  # the request's own errors (an empty or too long prompt) come before the first chunk
            if r.chat:
                yield chunk(index, None, None, role=True)
            for piece in itertools.chain([first], pieces):
                if piece.end is None:
                    yield chunk(index, piece.text, None, piece.tokens)
                else:
                    yield chunk(index, None, piece.end["finish_reason"])
                    finals.append(piece.end)
        finally:
            pieces.close()  # a client that went away: decoding stops here and the next request's turn comes
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(finals, r.n)}


def tokenize(session: Session, body: Any) -> dict:
    """vLLM's ``POST /tokenize``: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
    "add_generation_prompt": true} -> the token ids the model would read."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise RequestError("expected a JSON object with 'prompt' (text) or 'messages' (chat messages)")
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    if unknown:
        raise RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    flags = {k: body.get(k) for k in ("add_special_tokens", "add_generation_prompt")}
    for key, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"'{key}': expected true or false, found {value!r:.80}", key)
    tokenizer = session.model.tokenizer
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise RequestError(f"'prompt': expected a string, found {body['prompt']!r:.80}", "prompt")
        special = flags["add_special_tokens"] is not False
        ids = tokenizer(body["prompt"], add_special_tokens=special).input_ids
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError(f"the tokenizer of {session.name} has no chat template: send 'prompt'", "messages")
        text = tokenizer.apply_chat_template(_messages(body), tokenize=False,
                                             add_generation_prompt=flags["add_generation_prompt"] is not False)
        ids = tokenizer(text, add_special_tokens=bool(flags["add_special_tokens"])).input_ids
    return {"count": len(ids), "max_model_len": session.model.target.max_length, "tokens": ids, "token_strs": None}


def detokenize(session: Session, body: Any) -> dict:
    """vLLM's ``POST /detokenize``: {"tokens": [...]} -> {"prompt": their text} (special tokens kept)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = session.model.target.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in tokens):
        raise RequestError(f"'tokens': expected a list of token ids, found {tokens!r:.80}", "tokens")
    bad = [i for i in tokens if not 0 <= i < vocab]
    if bad:
        raise RequestError(f"'tokens': token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})", "tokens")
    return {"prompt": session.model.tokenizer.decode(tokens, clean_up_tokenization_spaces=False)}


def tokenizer_info(session: Session) -> dict:
    """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does (lm-evaluation-harness's
    ``tokenizer_backend=remote`` reads it)."""
    tokenizer = session.model.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": session.model.target.max_length}


class Handler(BaseHTTPRequestHandler):
    session: Session  # set on the subclass make_server builds
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if getattr(self.server, "verbose", True):
            super().log_message(format, *args)

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": None}})

    def _authorised(self) -> bool:
        """True if the session asks for no key or the request brings it; else answers 401."""
        key = self.session.api_key
        if key is None or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
            return True
        self._error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the "
                    "server was started with (--api-key)", kind="invalid_api_key")
        return False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/health":  # open, for load balancers and scripts that wait for the server
            self._json(200, {"status": "ok", "model": self.session.name})
        elif not self._authorised():
            return
        elif self.path.rstrip("/") == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.session.name, "object": "model", "created": 0,
                                                         "owned_by": "selfspec"}]})
        elif self.path.rstrip("/") == "/tokenizer_info":
            self._json(200, tokenizer_info(self.session))
        else:
            self._error(404, f"no such endpoint: GET {self.path} (expected /v1/models, /tokenizer_info or /health)",
                        kind="not_found")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)  # read first: an answer before the body is read can reset the connection
        if not self._authorised():
            return
        path = self.path.rstrip("/")
        tools = {"/tokenize": tokenize, "/detokenize": detokenize}
        if path not in ("/v1/chat/completions", "/v1/completions", *tools):
            self._error(404, f"no such endpoint: POST {self.path} (expected /v1/chat/completions, /v1/completions, "
                        "/tokenize or /detokenize)", kind="not_found")
            return
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as err:
            self._error(400, f"the request body is not JSON: {err}")
            return
        try:
            if path in tools:
                self._json(200, tools[path](self.session, body))
                return
            r = self.session.parse(body, chat=path.endswith("chat/completions"))
            if not r.stream:
                self._json(200, complete(self.session, r))
                return
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = chunks(self.session, r, include_usage)
            first = next(events)  # errors of the request (empty or too-long prompt) come before any byte is sent
        except RequestError as err:
            self._error(400, str(err), err.param)
            return
        except (ValueError, TypeError) as err:  # selfspec's own checks: empty prompt, prompt too long, ...
            self._error(400, str(err))
            return
        except Exception as err:  # noqa: BLE001 - the client gets the reason; the server goes on
            self._error(500, f"{type(err).__name__}: {err}", kind="server_error")
            raise
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for event in itertools.chain([first], events):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client went away: stop decoding, free the line
            events.close()


def make_server(session: Session | None, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = True) -> ThreadingHTTPServer:
    """A threading HTTP server for ``session`` (port 0: any free port; ``server.server_address`` says which), bound
    at once. session None: set ``server.RequestHandlerClass.session`` before serving (infer.py serve binds the address
    before it loads the model)."""
    handler = type("SelfspecHandler", (Handler,), {"session": session})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.verbose = verbose  # type: ignore[attr-defined]
    return server
