"""infer.py serve against a client that is careless or hostile, over a real local server (the tiny chat model): one
request cannot take the server over (caps on answers, prompt characters and body bytes, refused before the work, the
key checked from the headers first); a client that leaves stops its decoding, streamed or not; malformed HTTP is
answered 4xx, never a dropped connection; an unknown model is 404; a host beyond this machine needs a key. Last, a
seeded, bounded fuzz of the HTTP API (hypothesis)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import psutil
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from selfspec import api
from selfspec.tools import cli, serve
from selfspec.tools.cli_parsers import build_serve_parser
from selfspec.tools.serve.session import never

USER = [{"role": "user", "content": "write a short story about the sea"}]
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
AT_ONCE = 10.0
"""seconds a refusal "at once" may take: measured 0.0001-0.006 s for the 401, 413 and 2,560-answer refusals and
0.16-0.18 s for a 10 MB content (sent and parsed) on the 2-core machine; issue 61 asked for under a second. The work they
replace took 85 s (tokenizing a 50 MB content) or more than 90 s (2,560 answers): a bound this generous still fails
it, and holds on a busy machine (that a body is not read is shown by the status and the RSS bound, not the clock)."""


@pytest.fixture(scope="module")
def model(model_dir):
    return api.load(str(model_dir), draft="ngram")


class Served:
    """A server on 127.0.0.1 (any free port) over ``session``, stopped by ``close``."""

    def __init__(self, session: serve.Session, **kwargs):
        self.session = session
        self.srv = serve.make_server(session, port=0, verbose=False, **kwargs)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.port = self.srv.server_address[1]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture(scope="module")
def server(model):
    s = Served(serve.Session(model, "tiny"))
    yield s.port
    s.close()


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data)


def raw(port: int, data: bytes, timeout: float = 30) -> tuple[int, dict | None]:
    """Send ``data`` as it is and read the one answer: (status, its JSON error object or None)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(data)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        body = resp.read()
    finally:
        sock.close()
    return resp.status, (json.loads(body).get("error") if body.startswith(b"{") else None)


def served(port: int) -> bool:
    """Whether a well-formed request is answered."""
    status, reply = post(port, "/v1/completions", {"prompt": "the sea", "max_tokens": 1}, headers=AUTH)
    return status == 200 and reply["usage"]["completion_tokens"] == 1


# ------------------------------------------------------------------------ case 1: one request takes the server over
def test_a_request_may_not_ask_for_more_answers_than_the_cap(server, model):
    """20 prompts x n=128 (2,560 answers) is refused at once naming the cap; up to the cap is served."""
    t0 = time.monotonic()
    status, reply = post(server, "/v1/completions", {"prompt": ["Tell me a story"] * 20, "n": 128, "max_tokens": 16},
                         timeout=10)
    assert time.monotonic() - t0 < AT_ONCE
    assert status == 400 and reply["error"]["param"] == "n"
    assert reply["error"]["message"] == ("'n': 20 prompt(s) x n=128 ask for 2,560 answers, more than the 64 this "
                                         "server decodes for one request (infer.py serve --max-choices): split the "
                                         "request")
    small = Served(serve.Session(model, "tiny", max_choices=4))
    try:
        status, reply = post(small.port, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
        assert status == 200 and len(reply["choices"]) == 4
        status, reply = post(small.port, "/v1/chat/completions", {"messages": USER, "n": 5, "max_tokens": 2})
        assert status == 400 and "ask for 5 answers, more than the 4" in reply["error"]["message"]
    finally:
        small.close()


class RecordingSession(serve.Session):
    """Records, per answer, how many new tokens its decoding had produced when it ended (None: stopped before)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished: list[int | None] = []

    def _decode(self, r, index=0, gone=never):
        n = len(self.finished)
        self.finished.append(None)
        for piece in super()._decode(r, index, gone):
            if piece.end is not None:
                self.finished[n] = piece.end["usage"]["completion_tokens"]
            yield piece


@pytest.mark.parametrize("max_batch,n", [(1, 1), (8, 1), (8, 3)])
def test_a_client_that_goes_away_stops_its_whole_request_too(model, max_batch, n):
    """A whole (not streamed) request, one answer or several: its client leaves once decoding has begun; every answer
    begun stops at its next step (not 600 tokens later), one not yet begun never starts, and the next request is
    served."""
    session = RecordingSession(model, "tiny", max_batch=max_batch)
    s = Served(session)
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        body = json.dumps({"messages": USER, "max_tokens": 600, "n": n}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        for _ in range(1000):  # until its decoding has begun
            if len(session.finished) >= 1:
                break
            time.sleep(0.01)
        sock.close()
        status, reply = post(s.port, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
        if max_batch == 1:
            assert session.finished == [None, 4], "the abandoned request was decoded to its end"
        else:
            # each answer decodes on a thread of its own; one whose thread had not begun when the client left is
            # never started (Executor.map cancels it: on a loaded machine, e.g. CI's), the others leave the batch
            def started() -> int:  # answers of the abandoned request begun
                return session.finished.count(None)

            for _ in range(600):
                if session.batcher.abandoned == started() and session.batcher.decoding == 0:
                    break
                time.sleep(0.05)
            assert 1 <= started() <= n and session.batcher.abandoned == started()
            assert session.batcher.decoding == 0 and 600 not in session.finished
    finally:
        s.close()


# ------------------------------------------------------------------------- case 2: size caps, the key from headers
def big_post(port: int, size: int, headers: dict, expect: bool = False) -> tuple[int, float, dict]:
    """POST a body of ``size`` bytes, sent in 64 KiB pieces from a thread (never held whole); (status, seconds from
    the headers to the answer, error object)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "x", "Content-Type": "application/json",
                                                 "Content-Length": size, **headers}.items())
    if expect:
        head += "Expect: 100-continue\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode())
    t0 = time.monotonic()

    def send() -> None:
        piece, sent = b'{"messages": [{"role": "user", "content": "' + b"x" * 65536, 0
        try:
            while sent < size:
                sock.sendall(piece[: size - sent])
                sent += len(piece)
        except OSError:  # the server closed its side
            pass

    sender = threading.Thread(target=send, daemon=True)
    if not expect:
        sender.start()
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    seconds = time.monotonic() - t0
    error = json.loads(resp.read())["error"]
    sock.close()
    if not expect:
        sender.join(timeout=30)
    return resp.status, seconds, error


def test_a_huge_body_is_refused_unread_the_key_first_and_memory_stays_where_it_was(model):
    """50 MB without the key: 401; with it: 413; asked with Expect: 100-continue: 413 before a byte is sent; 2,560
    answers: 400; each at once (AT_ONCE), and the server's memory (RSS, sampled throughout) grows by less than 20 MB.
    A content over the prompt-character cap (under the body cap): 400 at once, before tokenizing."""
    s = Served(serve.Session(model, "tiny", api_key=KEY))
    process, peak, sampling = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.005)

    try:
        assert served(s.port)  # warmed up
        before = process.memory_info().rss
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        status, seconds, error = big_post(s.port, 50 * 2**20, {})
        assert (status, error["type"]) == (401, "invalid_api_key") and seconds < AT_ONCE
        status, seconds, error = big_post(s.port, 50 * 2**20, AUTH)
        assert status == 413 and seconds < AT_ONCE
        assert error["message"] == ("the request body has 52,428,800 bytes, more than the 16,777,216 this server "
                                    "reads (infer.py serve --max-body-bytes)")
        status, seconds, error = big_post(s.port, 50 * 2**20, AUTH, expect=True)
        assert status == 413 and seconds < AT_ONCE
        t0 = time.monotonic()
        status, _ = post(s.port, "/v1/completions", {"prompt": ["Tell me a story"] * 20, "n": 128, "max_tokens": 16},
                         headers=AUTH, timeout=10)
        assert time.monotonic() - t0 < AT_ONCE and status == 400
        sampling.set()
        sampler.join()
        assert peak[0] - before < 20 * 2**20, f"RSS grew by {(peak[0] - before) / 2**20:.0f} MB"
        t0 = time.monotonic()  # a body under the cap whose prompt could never fit: refused before tokenizing
        status, reply = post(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10**7}]},
                             headers=AUTH, timeout=10)
        assert time.monotonic() - t0 < AT_ONCE and status == 400 and reply["error"]["param"] == "messages"
        assert reply["error"]["message"] == (f"'messages': 10,000,000 characters, more than the "
                                             f"{s.session.max_prompt_chars:,} this server takes in one prompt "
                                             "(infer.py serve --max-prompt-chars): shorten it")
        assert served(s.port)
    finally:
        sampling.set()
        s.close()


def test_the_prompt_character_cap_is_the_longest_prompt_the_context_could_hold(model):
    """By default a prompt may have the context's tokens x the longest token's characters; one character more is
    refused, in chat, completions and /tokenize alike; the cap can be set."""
    session = serve.Session(model, "tiny")
    longest = max(len(t) for t in model.tokenizer.get_vocab())
    assert session.max_prompt_chars == model.target.max_length * longest == 1024 * 13
    s = Served(serve.Session(model, "tiny", max_prompt_chars=10))
    try:
        for path, body, param in [("/v1/completions", {"prompt": "x" * 11}, "prompt"),
                                  ("/v1/completions", {"prompt": ["hi", "x" * 11]}, "prompt[1]"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 6},
                                                                         {"role": "user", "content": "y" * 5}]},
                                   "messages"),
                                  ("/tokenize", {"prompt": "x" * 11}, "prompt")]:
            status, reply = post(s.port, path, body)
            assert status == 400 and reply["error"]["param"] == param, (path, reply)
            assert "11 characters, more than the 10 this server takes in one prompt" in reply["error"]["message"]
        status, reply = post(s.port, "/v1/completions", {"prompt": "x" * 10, "max_tokens": 1})
        assert status == 200
    finally:
        s.close()
    with pytest.raises(ValueError, match="max_choices must be an int >= 1, found 0"):
        serve.Session(model, "tiny", max_choices=0)


# ---------------------------------------------------------------------------------- case 3: a host beyond loopback
def test_serving_beyond_this_machine_needs_a_key_or_insecure(model_dir, capsys):
    """--host 0.0.0.0 without a key is refused in one line before the model loads (exit 2); a key or --insecure
    lets it start; loopback names need neither. The caps and --insecure are in --help."""
    assert cli.main(["serve", "--model", str(model_dir), "--host", "0.0.0.0", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --host 0.0.0.0 opens the server beyond this machine, and no API key is set: anyone who can "
                   "reach it could use it. Set --api-key KEY (or SELFSPEC_API_KEY), or pass --insecure to serve "
                   "without one (behind your own gateway)\n")
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="opens the server beyond this machine"):
            serve.check_exposure(host, None)
        serve.check_exposure(host, "key")
        serve.check_exposure(host, None, insecure=True)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        serve.check_exposure(host, None)
    text = " ".join(build_serve_parser().format_help().split())
    for flag in ("--insecure", "--max-choices MAX_CHOICES", "--max-prompt-chars MAX_PROMPT_CHARS",
                 "--max-body-bytes MAX_BODY_BYTES"):
        assert flag in text


# ------------------------------------------------------------------------------------- case 4: malformed HTTP
def request(body: bytes, length: str | None = "right", extra: str = "", path: str = "/v1/chat/completions") -> bytes:
    """A POST as bytes; length: its Content-Length header ("right": the body's, None: none)."""
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
    if length is not None:
        head += f"Content-Length: {len(body) if length == 'right' else length}\r\n"
    return head.encode() + b"\r\n" + body


MALFORMED = [
    (request(b"{}", "abc"), 400, "Content-Length: expected one whole number of bytes, found 'abc'"),
    (request(b"{}", "1e12"), 400, "Content-Length: expected one whole number of bytes, found '1e12'"),
    (request(b"{}", "-1"), 400, "Content-Length: expected one whole number of bytes, found '-1'"),
    (request(b"{}", "2", "Content-Length: 3\r\n"), 400, "Content-Length: expected one whole number of bytes"),
    (request(b"{}", "1000000000000"), 413, "the request body has 1,000,000,000,000 bytes, more than the"),
    (request(b"[" * 100_000), 400, "the request body is not JSON this server reads: it is nested too deeply"),
    (request(b'{"messages": "\xff\xfe"}'), 400, "the request body is not JSON: 'utf-8' codec can't decode"),
    (request(b'{"messages": [{"role": "user", "content": "hi \\udc80"}]}'), 400,
     "'messages[0].content': expected UTF-8 text, found the byte 0x80 at byte 3 (after 'hi '), which is not UTF-8: "
     "give the text as UTF-8"),
    (request(b'{"prompt": "\\ud800"}', path="/v1/completions"), 400,
     "'prompt': expected Unicode text, found a lone surrogate '\\ud800' at character 0, which no UTF-8 text holds"),
    (request(b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud800"]}'), 400,
     "'stop[1]': expected Unicode text, found a lone surrogate '\\ud800' at character 0, which no UTF-8 text holds"),
    (request(b'{"prompt": "hi", "stop": "\\udcff", "stream": true}', path="/v1/completions"), 400,
     "'stop': expected UTF-8 text, found the byte 0xff at byte 0, which is not UTF-8"),
    (request(b'{"prompt": "\\ud800"}', path="/tokenize"), 400, "'prompt': expected Unicode text"),
    (request(b"2\r\n{}\r\n0\r\n\r\n", None, "Transfer-Encoding: chunked\r\n"), 411,
     "a body sent with Transfer-Encoding is not read"),
    (b"PUT /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 405, "method PUT is not served"),
]


@pytest.mark.parametrize("data,status,message", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_requests_are_answered_4xx_and_the_next_is_served(server, data, status, message):
    got, error = raw(server, data)
    assert got == status and message in error["message"], error
    assert served(server)


# ------------------------------------------------------------------------------------------- case 5: model names
def test_a_model_the_server_does_not_serve_is_404(server):
    for path, body in [("/v1/chat/completions", {"model": "gpt-4", "messages": USER, "max_tokens": 1}),
                       ("/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 1, "stream": True}),
                       ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
                       ("/detokenize", {"model": "gpt-4", "tokens": [5]})]:
        status, reply = post(server, path, body)
        assert status == 404, path
        assert reply["error"] == {"message": "the model 'gpt-4' does not exist: this server serves 'tiny' (GET "
                                             "/v1/models); send that name, or none",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    status, reply = post(server, "/v1/chat/completions", {"model": 5, "messages": USER})
    assert status == 400 and reply["error"]["message"] == "'model': expected a string, found 5"
    for body in ({"model": "tiny"}, {"model": None}, {}):
        status, _ = post(server, "/v1/chat/completions", {**body, "messages": USER, "max_tokens": 1})
        assert status == 200, body


# ------------------------------------------------------------------------------------------------------ the fuzz
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=4), max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
                                 "content": st.text(max_size=20)})
FIELDS = {  # the API's fields: values it takes, more often than random JSON
    "model": st.sampled_from(["tiny", "other"]), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 400), max_size=6) | st.lists(st.text(max_size=5)),
    "max_tokens": st.integers(-1, 3), "temperature": st.floats(-1, 3), "top_p": st.floats(0, 1.5),
    "n": st.integers(0, 3), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "stream": st.booleans(), "logprobs": st.booleans() | st.integers(-1, 25), "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(), "seed": st.integers(-2**64, 2**64), "min_tokens": st.integers(-1, 3),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "-1", "x", "99999"]), st.floats(-200, 200), max_size=2),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "tools": st.just([]),
    "suffix": st.sampled_from(["", "x"]), "bogus": st.just(1),
}
BODY = st.fixed_dictionaries({}, optional={k: v | JSON if k not in ("messages", "prompt") else v
                                           for k, v in FIELDS.items()})
@st.composite
def http_requests(draw) -> bytes:
    """A request as bytes: a path and method, a body (JSON of the API's fields, random JSON, random bytes, text in
    another encoding), its Content-Length right, wrong-shaped or absent, the key or not."""
    method, path = draw(st.sampled_from([("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
                                         ("GET", "/nowhere"), ("POST", "/v1/embeddings"), ("DELETE", "/v1/models")]))
    kind = draw(st.sampled_from(["fields"] * 4 + ["json", "bytes", "utf-16", "nested"]))
    if kind == "fields":
        body = json.dumps(draw(BODY)).encode()
    elif kind == "json":
        body = json.dumps(draw(JSON)).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=64))
    elif kind == "utf-16":
        body = json.dumps(draw(BODY), ensure_ascii=False).encode(draw(st.sampled_from(["utf-16", "latin-1", "utf-32"])),
                                                                 errors="replace")
    else:
        body = b"[" * draw(st.integers(500, 50_000))
    length = draw(st.sampled_from(["right"] * 6 + ["absent", "word", "huge", "negative"]))
    headers = {"right": f"Content-Length: {len(body)}\r\n", "absent": "", "word": "Content-Length: many\r\n",
               "huge": "Content-Length: 99999999999\r\n", "negative": f"Content-Length: -{len(body)}\r\n"}[length]
    if length == "absent":
        body = b""
    key = draw(st.sampled_from([KEY] * 6 + ["wrong", None]))
    if key is not None:
        headers += f"Authorization: Bearer {key}\r\n"
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + (body if method != "GET" else b"")


@pytest.fixture(scope="module")
def keyed(model):
    s = Served(serve.Session(model, "tiny", api_key=KEY, default_max_tokens=2, max_choices=4))
    yield s.port
    s.close()


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=http_requests())
def test_fuzzed_requests_always_get_an_answer_never_a_5xx_and_the_next_is_served(keyed, data):
    """Random bodies, headers, sizes and encodings: every request gets an HTTP answer (no dropped connection), 200 or
    a 4xx with OpenAI's error object, never a 5xx; a well-formed request is served after each."""
    status, error = raw(keyed, data)
    event(f"HTTP {status}")  # pytest --hypothesis-show-statistics: how the answers spread
    assert status == 200 or (400 <= status < 500 and error is not None and error["message"]), (status, error)
    assert served(keyed)
