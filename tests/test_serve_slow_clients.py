"""infer.py serve against clients that are slow on purpose or by accident, over a real local server (the tiny chat
model) and raw sockets: a request that does not arrive whole within --read-timeout (half a request line, half its
headers, half its body, or every byte of it trickled so that no single read ever waits long) is cut off at that
deadline, answered 408 where its headers or body were late, while other clients are served; connections beyond
--max-connections are answered 503 at once, and served again once one closes."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import pytest

from conftest import read_all
from selfspec import api
from selfspec.tools import serve
from selfspec.tools.cli_parsers import build_serve_parser

READ = 1.0
"""the servers' read timeout here, in seconds."""
LATE = READ + 9.0
"""a generous bound on when a cut-off connection must be closed: measured 1.00-1.02 s for READ = 1 on the 2-core
machine; without the deadline it is never closed (a trickle of 1 byte / 0.1 s never waits 1 s on one read)."""

BODY = json.dumps({"prompt": "the sea", "max_tokens": 1}).encode()
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
HEADERS_END = REQUEST.index(b"\r\n\r\n") + 4


@pytest.fixture(scope="module")
def model(model_dir):
    return api.load(str(model_dir), draft="ngram")


@pytest.fixture(scope="module")
def port(model):
    srv = serve.make_server(serve.Session(model, "tiny"), port=0, verbose=False, read_timeout=READ)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def answer(port: int, data: bytes = REQUEST) -> bytes:
    """Send ``data`` whole and read until the server closes the connection (or 60 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)  # not shut for writing: the server takes a half-closed client for one that has gone
        return read_all(sock)


def served(port: int) -> bool:
    reply = answer(port)
    return reply.startswith(b"HTTP/1.1 200 ") and b'"completion_tokens": 1' in reply


@pytest.mark.parametrize("part,answered", [
    ("nothing", None),  # an idle connection: closed, nothing to answer
    ("half the request line", None),
    ("half the headers", "headers"),
    ("the headers and half the body", "body"),
])
def test_a_request_that_stops_arriving_is_cut_off_at_the_read_timeout(port, part, answered):
    """The client sends part of a request and waits: its connection is closed at the read timeout (408 if its
    headers or body were late, with Connection: close); meanwhile and afterwards, other clients are served."""
    cut = {"nothing": 0, "half the request line": 15, "half the headers": HEADERS_END // 2,
           "the headers and half the body": HEADERS_END + len(BODY) // 2}[part]
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        t0 = time.monotonic()
        sock.sendall(REQUEST[:cut])
        assert served(port)  # on another connection, while this one hangs
        reply = read_all(sock)
        seconds = time.monotonic() - t0
    finally:
        sock.close()
    assert 0.9 * READ <= seconds < LATE, seconds
    if answered is None:
        assert reply == b""
    else:
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
        assert json.loads(body)["error"] == {
            "message": f"the request's {answered} did not arrive within 1 s of its start: send a request whole "
                       "(infer.py serve --read-timeout sets the time)",
            "type": "request_timeout", "param": None, "code": None}
    assert served(port)


def test_a_trickled_request_is_cut_off_at_the_deadline_not_at_each_byte(port):
    """A slowloris: every byte of a well-formed request, one each 0.1 s (about 15 s in all). No single read waits a
    second, so a timeout that each byte restarts never fires; the deadline of the whole request does."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    stopped = threading.Event()

    def trickle() -> None:
        try:
            for byte in REQUEST:
                if stopped.is_set():
                    return
                sock.send(bytes([byte]))
                time.sleep(0.1)
        except OSError:  # the server has closed it
            pass

    sender = threading.Thread(target=trickle, daemon=True)
    t0 = time.monotonic()
    sender.start()
    try:
        reply = read_all(sock)
        seconds = time.monotonic() - t0
    finally:
        stopped.set()
        sender.join(timeout=30)
        sock.close()
    assert len(REQUEST) * 0.1 > 10 * READ  # the whole trickle would take far longer than the cut-off
    assert 0.9 * READ <= seconds < LATE, seconds
    assert reply == b""  # cut off in its request line (about 10 of its 31 bytes by then): nothing to answer
    assert served(port)


def test_a_request_that_arrives_in_time_across_several_reads_is_served(port):
    """The deadline bounds the whole request, not the number of reads: a request sent in three pieces 0.2 s apart
    (within the second) is answered 200."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        for piece in (REQUEST[:20], REQUEST[20:HEADERS_END + 3], REQUEST[HEADERS_END + 3:]):
            sock.sendall(piece)
            time.sleep(0.2)
        assert read_all(sock).startswith(b"HTTP/1.1 200 ")


def test_connections_beyond_the_cap_are_answered_503_at_once(model):
    """--max-connections 3: three open connections (idle), a fourth is answered 503 without waiting; one closed,
    the next is served."""
    srv = serve.make_server(serve.Session(model, "tiny"), port=0, verbose=False, read_timeout=60, max_connections=3)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(3)]
    try:
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the three have been taken in
        assert idle[0].recv(65536).startswith(b"HTTP/1.1 200 ")
        for _ in range(50):  # the server takes connections in order: wait until it has the other two
            if srv.serving == 3:
                break
            time.sleep(0.1)
        head, _, body = answer(port).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["message"] == ("the server is serving 3 connections, as many as it takes "
                                                        "(infer.py serve --max-connections): retry later")
        idle.pop().close()
        for _ in range(50):  # its thread notices the close and gives its place back
            if srv.serving == 2:
                break
            time.sleep(0.1)
        assert served(port)
    finally:
        for sock in idle:
            sock.close()
        srv.shutdown()
        srv.server_close()


def test_the_read_timeout_and_the_connection_cap_are_flags_and_checked(model):
    text = " ".join(build_serve_parser().format_help().split())
    assert "--read-timeout SECONDS" in text and "--max-connections MAX_CONNECTIONS" in text
    a = build_serve_parser().parse_args([])
    assert (a.read_timeout, a.max_connections) == (30.0, 64)
    session = serve.Session(model, "tiny")
    for bad in (0, -1.0, math.nan, math.inf, True, "5"):
        with pytest.raises(ValueError, match=f"read_timeout must be a number of seconds > 0, found {bad!r}"):
            serve.make_server(session, port=0, read_timeout=bad)
    with pytest.raises(ValueError, match="max_connections must be an int >= 1, found 0"):
        serve.make_server(session, port=0, max_connections=0)
