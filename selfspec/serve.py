"""An OpenAI-compatible HTTP endpoint over one SpecModel: ``python infer.py serve``.

    POST /v1/chat/completions   {"messages": [...], "max_tokens": 64, "stream": true, ...}
    POST /v1/completions        {"prompt": "...", ...}                  (plain text, no chat template)
    GET  /v1/models             the one model served
    GET  /health

Clients of OpenAI's API (its Python client, chat UIs, evaluation harnesses) talk to it unchanged; every answer is
decoded speculatively and losslessly, and says how (``usage.selfspec``: steps and mean accepted tokens per step).

Requests are decoded one at a time (selfspec decodes at batch size 1); others wait in line. Sampling fields are
OpenAI's (``temperature``, ``top_p``, ``seed``, ``stop``, ``max_tokens`` / ``max_completion_tokens``) and the common
extensions of OpenAI-compatible servers (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``); a request
without ``temperature`` decodes with the server's (``--temperature``, default 0: greedy, token-identical to
``generate``). As in OpenAI's API a stop string ends the answer and is not part of it. Fields the server cannot honour
(``n`` > 1, ``logprobs``, non-zero frequency / presence penalties, tools) and unknown fields are refused with a 400
that names them, as OpenAI refuses unknown arguments.
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
from typing import Any, Iterator

from selfspec.api import SpecModel

CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "seed", "stop", "stream", "stream_options", "repetition_penalty", "min_tokens", "n", "logprobs",
               "top_logprobs", "frequency_penalty", "presence_penalty", "user", "logit_bias", "tools", "tool_choice",
               "response_format", "parallel_tool_calls"}
COMPLETION_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                    "response_format", "parallel_tool_calls"}) | {"prompt", "echo", "suffix"}
NEUTRAL = {"n": (1,), "logprobs": (False, None), "top_logprobs": (0, None), "frequency_penalty": (0, 0.0, None),
           "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}), "tools": (None, []),
           "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
           "parallel_tool_calls": (None, False, True), "echo": (False, None), "suffix": (None, "")}
"""fields selfspec cannot honour, with the values that ask for nothing (accepted, as clients send them by default)."""


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), with the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Request:
    """A validated request: the prompt and the decoding arguments of ``SpecModel.stream``."""

    prompt: Any
    """chat messages, or text fed without the chat template."""
    chat: bool
    stream: bool
    max_new_tokens: int | None
    """None: the server's default, capped to the room the context leaves after the prompt."""
    decoding: dict
    """temperature, top_p, top_k, min_p, seed, repetition_penalty, min_new_tokens, stop (for SpecModel.stream)."""
    stops: tuple[str, ...]
    """the stop strings, cut from the answer's text."""


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
            raise RequestError(f"'{key}': selfspec serves one answer per request, without log-probabilities, penalties "
                               f"other than repetition_penalty or tools; expected {neutral[0]!r}, found "
                               f"{body[key]!r:.80}", key)
    if chat:
        prompt: Any = _messages(body)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(f"'prompt': expected a string, found {prompt!r:.80}", "prompt")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop': expected a non-empty string or a list of them, found {stop!r:.80}", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream': expected true or false, found {stream!r}", "stream")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    decoding = dict(
        temperature=_number(body, "temperature", float, default_temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", int, 0, -1),
        min_p=_number(body, "min_p", float, 0.0, 0.0, 1.0),
        seed=_number(body, "seed", int, None),
        repetition_penalty=_number(body, "repetition_penalty", float, None, 0.0),
        min_new_tokens=_number(body, "min_tokens", int, None, 0),
        stop=list(stops) if stop is not None else None,  # none given: the model's own (its generation config's)
    )
    if decoding["top_k"] < 0:  # vLLM's "-1 = off"
        decoding["top_k"] = 0
    if decoding["top_p"] == 0.0:
        raise RequestError("'top_p': expected a value in (0, 1], found 0.0", "top_p")
    return Request(prompt=prompt, chat=chat, stream=stream, decoding=decoding, stops=stops,
                   max_new_tokens=_number(body, key, int, None, 1))


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The answer's text up to the first stop string (excluded, as OpenAI returns it) and whether one was found."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


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

    One thread, not the request's own: torch runs ~1.3x slower in a fresh thread for its first requests (measured
    here, BENCHMARKS §18), and ThreadingHTTPServer gives every request a fresh thread."""

    def __init__(self, model: SpecModel, name: str, default_temperature: float = 0.0, default_max_tokens: int = 256,
                 api_key: str | None = None):
        """api_key: requests must send ``Authorization: Bearer <api_key>`` (None: no check)."""
        self.model, self.name, self.api_key = model, name, api_key
        self.default_temperature, self.default_max_tokens = default_temperature, default_max_tokens
        self._jobs: queue.Queue[_Job] = queue.Queue()  # batch size 1: one request decodes at a time
        threading.Thread(target=self._work, daemon=True, name="selfspec-decode").start()

    def _work(self) -> None:
        while True:
            self._jobs.get().run()

    def warm_up(self) -> None:
        """Decode a few tokens on the worker, so that the first request does not pay for its first use."""
        for _ in self.pieces(Request(prompt="Hello", chat=False, stream=False, max_new_tokens=8, stops=(),
                                     decoding={"stop": []})):
            pass

    def parse(self, body: Any, chat: bool) -> Request:
        r = parse_request(body, chat, self.default_temperature)
        if r.decoding["stop"] is None:  # the model's own stop strings (its generation config's) are cut as well
            r = dataclasses.replace(r, stops=self.model.stop_strings)
        return r

    def pieces(self, r: Request) -> Iterator[tuple[str, dict | None]]:
        """(text, None) pieces as the target accepts them, with stop strings cut (text that could begin one is held
        back until it cannot), then ("", final) with finish_reason and usage. Decoded on the worker thread, after
        the requests before it; closing this iterator early stops the decoding."""
        job = _Job(self._decode(r))
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

    def _decode(self, r: Request) -> Iterator[tuple[str, dict | None]]:
        ids = self.model.encode(r.prompt, chat=r.chat)
        limit = r.max_new_tokens
        if limit is None:  # as OpenAI-compatible servers do: no more than the context has room for
            limit = max(1, min(self.default_max_tokens, self.model.target.max_length - int(ids.shape[0])))
        stream = self.model.stream(ids, max_new_tokens=limit, **r.decoding)
        hold = max((len(s) for s in r.stops), default=1) - 1
        sent, stopped = 0, False
        for _ in stream:
            text, stopped = cut_at_stop(stream.text, r.stops)
            upto = len(text) if stopped else max(len(text) - hold, sent)
            if upto > sent:
                yield text[sent:upto], None
                sent = upto
            if stopped:
                break
        text, stopped = cut_at_stop(stream.text, r.stops)
        if len(text) > sent:
            yield text[sent:], None
        stats = stream.stats
        eos = bool(stream.tokens) and stream.tokens[-1] in self.model.eos_token_id
        finish = "stop" if stopped or eos or stats.new_tokens < limit else "length"
        usage = {"prompt_tokens": int(ids.shape[0]), "completion_tokens": stats.new_tokens,
                 "total_tokens": int(ids.shape[0]) + stats.new_tokens,
                 "selfspec": {"steps": stats.steps, "mean_accepted_tokens": round(stats.mean_accepted, 4),
                              "seconds": round(stats.seconds, 4), "tokens_per_s": round(stats.tokens_per_s, 2)}}
        yield "", {"finish_reason": finish, "usage": usage}


def _envelope(session: Session, chat: bool) -> dict:
    """The fields every response object of one answer shares (a new id per answer)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": session.name}


def complete(session: Session, r: Request) -> dict:
    """The whole answer as one OpenAI response object."""
    parts, final = [], {}
    for text, end in session.pieces(r):
        parts.append(text)
        final = end or final
    text = "".join(parts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": final["finish_reason"], "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if r.chat else {"text": text})
    return {**_envelope(session, r.chat), "choices": [choice], "usage": final["usage"]}


def chunks(session: Session, r: Request, include_usage: bool = False) -> Iterator[dict]:
    """The answer as OpenAI stream chunks (the first carries the role, the last the finish reason)."""
    kind = "chat.completion.chunk" if r.chat else "text_completion"
    head = {**_envelope(session, r.chat), "object": kind}

    def chunk(text: str | None, finish: str | None, role: bool = False) -> dict:
        if r.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return {**head, "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    pieces = session.pieces(r)
    try:
        first = next(pieces)  # the request's own errors (an empty or too long prompt) come before the first chunk
        if r.chat:
            yield chunk(None, None, role=True)
        for text, end in itertools.chain([first], pieces):
            if end is None:
                yield chunk(text, None)
            else:
                yield chunk(None, end["finish_reason"])
                if include_usage:
                    yield {**head, "choices": [], "usage": end["usage"]}
    finally:
        pieces.close()  # a client that went away: decoding stops here and the next request's turn comes


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
        else:
            self._error(404, f"no such endpoint: GET {self.path} (expected /v1/models or /health)", kind="not_found")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)  # read first: an answer before the body is read can reset the connection
        if not self._authorised():
            return
        path = self.path.rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._error(404, f"no such endpoint: POST {self.path} (expected /v1/chat/completions or /v1/completions)",
                        kind="not_found")
            return
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as err:
            self._error(400, f"the request body is not JSON: {err}")
            return
        try:
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


def make_server(session: Session, host: str = "127.0.0.1", port: int = 8000,
                verbose: bool = True) -> ThreadingHTTPServer:
    """A threading HTTP server for ``session`` (port 0: any free port; ``server.server_address`` says which)."""
    handler = type("SelfspecHandler", (Handler,), {"session": session})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.verbose = verbose  # type: ignore[attr-defined]
    return server
