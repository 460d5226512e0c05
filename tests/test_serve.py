"""infer.py serve: OpenAI's HTTP API over a real local server (a tiny random chat model), answers equal to
selfspec.api's, streamed and whole; stop strings cut as OpenAI cuts them; bad requests refused with the field named;
requests decoded one at a time; a client that goes away frees the line."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tiny_chat_model
from conftest import read_all
from selfspec import api
from selfspec.tools import serve
from selfspec.tools.serve.session import never

ROOT = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "write a short story about the sea"}]


@pytest.fixture(scope="module")
def model(model_dir):
    return api.load(str(model_dir), draft="ngram")


@pytest.fixture(scope="module")
def server(model):
    srv = serve.make_server(serve.Session(model, "tiny"), port=0, verbose=False)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def post(port: int, path: str, body, raw: bool = False, headers: dict | None = None) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=body if raw else json.dumps(body),
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.getheader("Content-Type") == "text/event-stream":
        return resp.status, data
    return resp.status, json.loads(data)


def events(data: str) -> list:
    lines = [line[len("data: "):] for line in data.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_completion_is_selfspecs_answer(server, model):
    expected = model.generate(USER, max_new_tokens=24)
    status, body = post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 24})
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected.text}
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["prompt_tokens"] == model.encode(USER).shape[0] and usage["completion_tokens"] == 24
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    assert usage["selfspec"]["steps"] == expected.stats.steps
    assert usage["selfspec"]["mean_accepted_tokens"] == pytest.approx(expected.stats.mean_accepted, abs=1e-4)


def test_streamed_chunks_add_up_to_the_answer(server, model):
    expected = model.generate(USER, max_new_tokens=24).text
    status, data = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 24, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = events(data)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 3  # really streamed
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


def test_stop_strings_end_the_answer_and_are_cut_from_it(server, model):
    """OpenAI returns the text before the stop string; streamed text never shows a piece of it."""
    full = model.generate(USER, max_new_tokens=40)
    stop = tiny_chat_model.spanning_stop(model.tokenizer, full.tokens, start=4)
    before = full.text[: full.text.index(stop)]
    status, body = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 40, "stop": [stop, "zzzz"]})
    assert status == 200
    assert body["choices"][0]["message"]["content"] == before
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(model.generate(USER, max_new_tokens=40, stop=stop).tokens) < 40
    status, data = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 40, "stop": stop,
                                                         "stream": True})
    chunks = events(data)
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == before and chunks[-1]["choices"][0]["finish_reason"] == "stop"  # nothing retracted
    # the model's own stop strings (its generation config's) apply and are cut when a request names none
    saved, model.stop_strings = model.stop_strings, (stop,)
    try:
        session = serve.Session(model, "tiny")
        for given, text in (({}, before), ({"stop": None}, before), ({"stop": []}, full.text)):
            reply = serve.complete(session, session.parse({"messages": USER, "max_tokens": 40, **given}, chat=True))
            assert reply["choices"][0]["message"]["content"] == text, given
    finally:
        model.stop_strings = saved


def test_without_max_tokens_an_answer_fills_at_most_the_room_the_context_leaves(model):
    """The server's default (here 10**6) is capped at what the context holds after the prompt, as OpenAI-compatible
    servers do, instead of refusing the request."""
    session = serve.Session(model, "tiny", default_max_tokens=10 ** 6)
    n = 1
    while model.encode([{"role": "user", "content": "fox " * (n + 8)}]).shape[0] < model.target.max_length - 6:
        n += 8
    messages = [{"role": "user", "content": "fox " * n}]
    room = model.target.max_length - model.encode(messages).shape[0]
    assert 1 <= room <= 14
    reply = serve.complete(session, session.parse({"messages": messages}, chat=True))
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] <= model.target.max_length
    assert reply["usage"]["completion_tokens"] == room or reply["choices"][0]["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="exceeds the model's context"):  # asked for explicitly: refused
        serve.complete(session, session.parse({"messages": messages, "max_tokens": room + 1}, chat=True))


def test_completions_feed_the_prompt_without_the_chat_template(server, model):
    expected = model.generate("the quick brown fox", max_new_tokens=16, chat=False).text
    status, body = post(server, "/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 16})
    assert status == 200
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected
    status, data = post(server, "/v1/completions", {"prompt": ["the quick brown fox"], "max_tokens": 16,
                                                    "stream": True})
    assert "".join(c["choices"][0]["text"] for c in events(data)) == expected


def test_sampling_fields_reach_the_decoder(server, model):
    fields = dict(temperature=0.9, top_p=0.95, top_k=50, min_p=0.05, seed=7, repetition_penalty=1.1, min_tokens=3)
    expected = model.generate(USER, max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=50, min_p=0.05, seed=7,
                              repetition_penalty=1.1, min_new_tokens=3).text
    texts = [post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 20, **fields})[1] for _ in range(2)]
    assert [t["choices"][0]["message"]["content"] for t in texts] == [expected, expected]
    assert expected != model.generate(USER, max_new_tokens=20).text


@pytest.mark.parametrize("body, param, message", [
    ({"messages": USER, "foo": 1}, "foo", "unrecognized request argument(s): foo"),
    ({"messages": USER, "n": 0}, "n", "'n': expected a value in [1, 128], found 0"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools", "'tools': selfspec serves text without tools"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias", "'logit_bias': expected token ids (as strings)"),
    ({"messages": USER, "logit_bias": {"5": 101}}, "logit_bias", "biases in [-100, 100], found '5': 101"),
    ({"messages": USER, "logit_bias": {"99999": 1}}, "logit_bias", "'logit_bias': token id 99999 is outside"),
    ({"messages": USER, "logprobs": 1}, "logprobs", "'logprobs': expected true or false, found 1"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "'top_logprobs': needs 'logprobs': true"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "expected a value in [0, 20], found 21"),
    ({"messages": USER, "echo": True}, "echo", "unrecognized request argument(s): echo"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", "expected a value in [-2.0, 2.0], found 2.5"),
    ({"messages": []}, "messages", "'messages': expected a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages", "'messages[0]': expected an object with 'role' and 'content'"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     "'messages[0].role': expected one of system, developer, user, assistant, tool, function (OpenAI's), found 'wizard'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "only text parts"),
    ({"messages": USER, "temperature": "hot"}, "temperature", "'temperature': expected a number, found 'hot'"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "'max_tokens': expected a value >= 1, found 0"),
    ({"messages": USER, "stop": [""]}, "stop", "'stop': expected a non-empty string or a list of them"),
    ({"messages": USER, "stream": "yes"}, "stream", "'stream': expected true or false"),
    ({"messages": USER, "max_tokens": 10 ** 6}, "max_tokens", "'max_tokens': the prompt ("),
    ({"messages": USER, "max_tokens": 10 ** 6}, "max_tokens", "+ max_tokens (1000000) exceeds the model's context"),
    ({"messages": USER, "stop": 5}, "stop", "'stop': expected a non-empty string or a list of them, found 5"),
    ({"messages": USER, "seed": 2 ** 70}, "seed", "'seed': expected a value in [-9223372036854775808, "),
    ([1, 2], None, "expected a JSON object, found list"),
])
def test_bad_requests_are_refused_naming_the_field(server, body, param, message):
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 400
    assert message in reply["error"]["message"] and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"


def test_bad_json_unknown_paths_and_the_completion_prompt_are_refused(server):
    status, reply = post(server, "/v1/chat/completions", "{not json", raw=True)
    assert status == 400 and "the request body is not JSON" in reply["error"]["message"]
    status, reply = post(server, "/v1/embeddings", {"input": "x"})
    assert status == 404 and "expected /v1/chat/completions, /v1/completions" in reply["error"]["message"]
    status, reply = post(server, "/v1/completions", {"prompt": ""})
    assert status == 400 and "the prompt is empty" in reply["error"]["message"]
    status, reply = post(server, "/v1/completions", {"prompt": "hi", "messages": USER})
    assert status == 400 and reply["error"]["param"] == "messages"
    status, reply = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 6, "stream": True})
    assert status == 400 and "exceeds the model's context" in reply["error"]["message"]  # before any chunk is sent
    for body, param, message in [
        ({"prompt": [3, -5, 4]}, "prompt", "'prompt': token id -5 is outside this model's vocabulary (0.."),
        ({"prompt": [[3, 4], "x", 3]}, "prompt", "expected a string, a list of token ids, or a non-empty list"),
        ({"prompt": []}, "prompt", "expected a string, a list of token ids, or a non-empty list"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "'logprobs': expected a value in [0, 20], found 21"),
        ({"prompt": "hi", "logprobs": True}, "logprobs", "'logprobs': expected an integer, found True"),
        ({"prompt": "hi", "echo": "yes"}, "echo", "'echo': expected true or false, found 'yes'"),
    ]:
        status, reply = post(server, "/v1/completions", body)
        assert status == 400 and message in reply["error"]["message"] and reply["error"]["param"] == param, reply


def test_models_and_health(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=30)
    conn.request("GET", "/v1/models")
    assert json.loads(conn.getresponse().read())["data"][0]["id"] == "tiny"
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"  # the same kept-alive connection


def test_requests_at_once_are_decoded_one_at_a_time_with_the_same_answers(server, model):
    prompts = [[{"role": "user", "content": f"story number {i}"}] for i in range(4)]
    expected = [model.generate(p, max_new_tokens=16).text for p in prompts]
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        results[i] = post(server, "/v1/chat/completions", {"messages": prompts[i], "max_tokens": 16})[1][
            "choices"][0]["message"]["content"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [results.get(i) for i in range(4)] == expected


def test_requests_at_once_decode_together_and_beyond_max_batch_wait(model):
    """Requests queued together decode in one batch (answers identical to each decoded alone); beyond max_batch
    they wait and join as others finish."""
    prompts = [[{"role": "user", "content": f"story number {i}"}] for i in range(5)]
    session = serve.Session(model, "tiny", max_batch=3)
    jobs = [model.job(p, max_new_tokens=40 + 5 * i) for i, p in enumerate(prompts)]
    receipts = [session.batcher.steps(j) for j in jobs]  # all queued before the first step's result is read
    tokens = [[t for step in receipt for t in step.tokens] for receipt in receipts]
    assert tokens == [model.generate(p, max_new_tokens=40 + 5 * i).tokens for i, p in enumerate(prompts)]
    assert session.batcher.most == 3 and session.batcher.decoding == 0


class RecordingSession(serve.Session):
    """Records, per request, how many new tokens its decoding (on the worker) had produced when it ended (None: it
    was stopped before its end)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finished: list[int | None] = []
        self.threads: list[str] = []

    def _decode(self, r, index=0, gone=never):
        n = len(self.finished)
        self.finished.append(None)
        self.threads.append(threading.current_thread().name)
        for piece in super()._decode(r, index, gone):
            if piece.end is not None:
                self.finished[n] = piece.end["usage"]["completion_tokens"]
            yield piece


@pytest.mark.parametrize("max_batch", [1, 8])
def test_a_client_that_goes_away_mid_stream_frees_the_line(model, max_batch):
    """Decoding stops soon after the client is gone (not 600 tokens later), and the next request is served: one at a
    time (max_batch 1), or in a batch, where the abandoned sequence leaves the batch and frees its slot."""
    session = RecordingSession(model, "tiny", max_batch=max_batch)
    srv = serve.make_server(session, port=0, verbose=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        body = json.dumps({"messages": USER, "max_tokens": 600, "stream": True}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"data: " not in received:  # the headers, then the first chunk
            part = sock.recv(4096)
            assert part, "the server closed the stream before its first chunk"
            received += part
        sock.close()  # gone, 600 tokens from the end
        status, reply = post(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
        assert session.finished == [None, 4], "the abandoned request was decoded to its end"
        if max_batch == 1:
            assert session.threads == ["selfspec-decode"] * 2  # one worker decodes every request, not theirs
        else:  # the batcher's worker decodes; the abandoned sequence left the batch before its end
            for _ in range(600):
                if session.batcher.decoding == 0:
                    break
                time.sleep(0.05)
            assert session.batcher.abandoned == 1 and session.batcher.decoding == 0
    finally:
        srv.shutdown()
        srv.server_close()


def test_openais_own_client_gets_the_answers(server, model):
    """The client people use: chat (whole and streamed) and completions, as selfspec answers them."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0)
    expected = model.generate(USER, max_new_tokens=16)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16)
    assert r.choices[0].message.content == expected.text and r.usage.completion_tokens == 16
    assert r.usage.model_extra["selfspec"]["steps"] == expected.stats.steps
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    r = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=8)
    assert r.choices[0].text == model.generate("the quick brown fox", max_new_tokens=8, chat=False).text
    assert [m.id for m in client.models.list()] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, logprobs=True, top_logprobs=3)
    scored = model.generate(USER, max_new_tokens=8, logprobs=3).logprobs
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx([t.logprob for t in scored], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 for c in r.choices[0].logprobs.content)
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7, 8]], max_tokens=2, logprobs=2, echo=True)
    assert len(r.choices[0].logprobs.token_logprobs) == 6 and r.choices[0].logprobs.token_logprobs[0] is None
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, n=2)
    assert [c.message.content for c in r.choices] == [expected.text] * 2 and r.usage.completion_tokens == 32
    with pytest.raises(BadRequestError, match="'tools': selfspec serves text without tools"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])


def test_an_api_key_is_required_when_the_server_has_one(model):
    from openai import AuthenticationError, OpenAI

    srv = serve.make_server(serve.Session(model, "tiny", api_key="s3cret"), port=0, verbose=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    body = {"messages": USER, "max_tokens": 4}
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, reply = post(port, "/v1/chat/completions", body, headers=headers)
            assert status == 401 and reply["error"]["type"] == "invalid_api_key", headers
            assert "missing or wrong API key" in reply["error"]["message"]
        status, reply = post(port, "/v1/chat/completions", body, headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and reply["usage"]["completion_tokens"] == 4
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 401
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")  # open: scripts wait on it
        assert conn.getresponse().status == 200
        conn.close()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0).models.list()
    finally:
        srv.shutdown()
        srv.server_close()


def test_infer_py_serve_answers_over_http(model_dir, model):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen([sys.executable, "infer.py", "serve", "--model", str(model_dir), "--port", "0",
                             "--name", "tiny-served", "--quiet", "--read-timeout", "1.5", "--max-connections", "4"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "infer.py serve exited before serving"
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
        status, body = post(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 12})
        assert status == 200 and body["model"] == "tiny-served"
        assert body["choices"][0]["message"]["content"] == model.generate(USER, max_new_tokens=12).text
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # --read-timeout reached the server
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            reply = read_all(sock)  # headers and body may come in separate packets
            assert reply.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1.5 s" in reply
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b))


def test_chat_logprobs_are_the_targets_own_whole_and_streamed(server, model):
    """logprobs: true, top_logprobs: 2 -> one entry per answer token, OpenAI's shape, selfspec.api's values."""
    expected = model.generate(USER, max_new_tokens=24, logprobs=2)
    body = {"messages": USER, "max_tokens": 24, "logprobs": True, "top_logprobs": 2}
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    text = lambda i: model.tokenizer.decode([i], clean_up_tokenization_spaces=False)  # noqa: E731
    assert [c["token"] for c in content] == [text(t) for t in expected.tokens]
    assert _close([c["logprob"] for c in content], [t.logprob for t in expected.logprobs])
    # bytes: each token's own, so that joined they are the answer's (a piece of a split character is not U+FFFD's)
    joined = bytes(b for c in content for b in c["bytes"])
    assert joined.decode(errors="replace") == reply["choices"][0]["message"]["content"]
    assert any(c["token"] == "\ufffd" and c["bytes"] != [239, 191, 189] for c in content)
    assert [[a["token"] for a in c["top_logprobs"]] for c in content] == \
        [[text(i) for i, _ in t.top] for t in expected.logprobs]
    status, data = post(server, "/v1/chat/completions", {**body, "stream": True})
    chunks = events(data)
    streamed = [c for ch in chunks for c in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert streamed == content
    assert sum(bool((ch["choices"][0].get("logprobs") or {}).get("content")) for ch in chunks) > 3  # really streamed
    status, reply = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4})
    assert reply["choices"][0]["logprobs"] is None  # not asked for


def test_echo_and_logprobs_score_a_token_prompt_as_evaluation_harnesses_ask(server, model):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1. The response holds the
    prompt's tokens (the first without a log-probability) and then the answer's, with offsets into the echoed text."""
    ids = model.encode("the quick brown fox jumps over the lazy dog", chat=False).tolist()
    expected = model.generate(ids, max_new_tokens=1, logprobs=1, prompt_logprobs=1)
    status, reply = post(server, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True,
                                                      "temperature": 0, "seed": 1234})
    assert status == 200, reply
    (choice,) = reply["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert _close(lp["token_logprobs"][1:], [t.logprob for t in expected.prompt_logprobs + expected.logprobs])
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert value in top.values() and 1 <= len(top) <= 2  # the likeliest and the chosen token
    assert choice["text"] == model.decode(ids) + expected.text
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == len(model.decode(ids))
    for token, offset in zip(lp["tokens"], offsets):
        if token.isascii() and token.isprintable():
            assert choice["text"][offset:].startswith(token)


def test_several_prompts_get_one_choice_each(server, model):
    prompts = ["the quick brown fox", "hello café"]
    expected = [model.generate(p, max_new_tokens=8, chat=False) for p in prompts]
    status, reply = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 8})
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert [c["text"] for c in reply["choices"]] == [e.text for e in expected]
    assert reply["usage"]["completion_tokens"] == 16
    assert reply["usage"]["selfspec"]["steps"] == sum(e.stats.steps for e in expected)
    status, data = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 8, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    chunks = events(data)
    for i, e in enumerate(expected):
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i) \
            == e.text
    assert chunks[-1]["usage"]["completion_tokens"] == 16


def test_a_completions_several_choices_decode_together(model):
    """Six prompts in one completions request: with a batching session they decode in one batch, each answer as
    generate's."""
    session = serve.Session(model, "tiny", max_batch=8)
    srv = serve.make_server(session, port=0, verbose=False)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        prompts = [f"story number {i} is about" for i in range(6)]
        status, reply = post(srv.server_address[1], "/v1/completions", {"prompt": prompts, "max_tokens": 48})
        assert status == 200, reply
        assert [c["text"] for c in reply["choices"]] == [model.generate(p, max_new_tokens=48, chat=False).text
                                                          for p in prompts]
        assert session.batcher.most >= 2
    finally:
        srv.shutdown()
        srv.server_close()


def test_logprobs_stop_where_the_stop_string_cuts_the_text(server, model):
    full = model.generate(USER, max_new_tokens=40)
    stop = tiny_chat_model.spanning_stop(model.tokenizer, full.tokens, start=4)
    status, reply = post(server, "/v1/completions", {"prompt": model.encode(USER).tolist(), "max_tokens": 40,
                                                      "stop": stop, "logprobs": 0})
    text, lp = reply["choices"][0]["text"], reply["choices"][0]["logprobs"]
    assert text == full.text[: full.text.index(stop)]
    assert all(offset < len(text) for offset in lp["text_offset"])  # no token of the stop string is reported
    kept = len(lp["tokens"])
    assert model.decode(full.tokens[:kept]).startswith(text) and not model.decode(full.tokens[:kept - 1]).startswith(text)


def test_n_answers_penalties_and_logit_bias_reach_the_decoder(server, model):
    """n sampled answers with a seed: answer j samples with seed + j (each repeatable); presence / frequency penalties
    and logit_bias decode as selfspec.api decodes them."""
    kw = dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3)
    expected = [model.generate(USER, max_new_tokens=12, seed=7 + j, logit_bias={40: 5.0}, **kw).text for j in range(3)]
    status, reply = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 12, "n": 3, "seed": 7,
                                                          "logit_bias": {"40": 5}, **kw})
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in reply["choices"]] == expected and len(set(expected)) > 1
    assert reply["usage"]["completion_tokens"] == 36
    assert reply["usage"]["prompt_tokens"] == model.encode(USER).shape[0]  # once, as OpenAI counts it, not n times
    status, data = post(server, "/v1/completions", {"prompt": ["the quick", "hello"], "max_tokens": 6, "n": 2,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    chunks = events(data)
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(model.encode(p, chat=False).shape[0] for p in ("the quick", "hello"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    chunks = chunks[:-1]
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(4)]
    greedy = [model.generate(p, max_new_tokens=6, chat=False).text for p in ("the quick", "hello")]
    assert texts == [greedy[0], greedy[0], greedy[1], greedy[1]]


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def test_vllms_tokenizer_endpoints_tokenize_as_the_model_reads(server, model):
    """/tokenize, /detokenize and /tokenizer_info, as vLLM serves them (what lm-evaluation-harness's
    tokenizer_backend=remote calls): the ids selfspec decodes from, and back."""
    tok = model.tokenizer
    status, reply = post(server, "/tokenize", {"prompt": "hello café", "add_special_tokens": False})
    assert status == 200 and reply["tokens"] == tok("hello café", add_special_tokens=False).input_ids
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == model.target.max_length
    status, reply = post(server, "/tokenize", {"model": "tiny", "messages": USER})
    assert reply["tokens"] == model.encode(USER).tolist()
    ids = model.encode(USER).tolist()
    status, reply = post(server, "/detokenize", {"tokens": ids})
    assert status == 200 and reply["prompt"] == tok.decode(ids) and tok(reply["prompt"], add_special_tokens=False
                                                                        ).input_ids == ids
    status, info = get(server, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for path, body, param, message in [
        ("/tokenize", {}, None, "expected a JSON object with 'prompt' (text) or 'messages'"),
        ("/tokenize", {"prompt": "x", "messages": USER}, None, "'prompt' (text) or 'messages'"),
        ("/tokenize", {"prompt": 3}, "prompt", "'prompt': expected a string, found 3"),
        ("/tokenize", {"prompt": "x", "foo": 1}, "foo", "unrecognized request argument(s): foo"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens", "token id -1 is outside this model's vocabulary"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "'tokens': expected a list of token ids"),
    ]:
        status, reply = post(server, path, body)
        assert status == 400 and message in reply["error"]["message"] and reply["error"]["param"] == param, reply


def test_serve_load_measures_both_servers_with_the_same_answers(model_dir, tmp_path, capsys):
    """``infer.py serve-load``: every draft against the one-at-a-time and the batching server, and plain decoding
    also against transformers' generate on padded batches, each number of clients; greedy answers the same from all
    (fp32); a table and the JSON."""
    from selfspec.tools import load

    out = tmp_path / "load.json"
    assert load.main(["--model", str(model_dir), "--drafts", "none", "ngram", "--clients", "1,3", "--questions", "4",
                      "--max-new-tokens", "6", "--dtype", "fp32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    servers = {"none": ("one at a time", "batching", "transformers, padded"), "ngram": ("one at a time", "batching")}
    assert [(r["draft"], r["server"], r["clients"]) for r in rows] == [
        (d, s, c) for d in ("none", "ngram") for s in servers[d] for c in (1, 3)]
    assert all(r["requests"] == 4 and r["tokens"] > 4 and r["answers_as_one_at_a_time"] == 4 for r in rows)
    assert all(0 < r["p50_s"] <= r["p95_s"] for r in rows)
    for r in rows:  # one client: side by side, each server's time is the time its own requests took
        if r["clients"] == 1:
            assert r["seconds"] == pytest.approx(r["mean_s"] * r["requests"], abs=0.05)
    assert "| `ngram` | batching | 3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        load.main(["--clients", "0,2"])
    with pytest.raises(SystemExit):
        load.main(["--servers", "one,vllm"])
