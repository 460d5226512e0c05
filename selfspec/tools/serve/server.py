"""The HTTP side: a request handler that routes each endpoint, answers errors as OpenAI does (a JSON ``error``
object; 400 names the field at fault), checks the API key and streams chunks as server-sent events, and
``make_server``, the threading server around it.

What one client can cost the server is bounded before anything is read or decoded: the key is checked from the
headers, a body over ``max_body_bytes`` is answered 413 unread, a malformed ``Content-Length`` 400; a body that is not
JSON, not UTF-8 or nested past Python's recursion limit is answered 400; and a request whose client goes away, streamed
or not, stops decoding at its next step (``Handler.gone``).

What a slow client can hold is bounded too: each request must arrive whole (request line, headers, body) within
``read_timeout`` of the moment the server begins to wait for it, however its bytes trickle in (``Deadline``): its
headers or body late, it is answered 408 and closed; no request line in that time (an idle keep-alive connection, or
half a line), it is closed. At most ``max_connections`` connections are served at once, a thread each; one more is
answered 503 at once, from the accepting thread (``connections``)."""

from __future__ import annotations

import hmac
import io
import ipaddress
import itertools
import json
import math
import re
import select
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable

from selfspec.tools.serve.connections import MAX_CONNECTIONS, READ_TIMEOUT_S, Deadline, Server
from selfspec.tools.serve.protocol import RequestError
from selfspec.tools.serve.responses import chunks, complete
from selfspec.tools.serve.session import ClientGone, Session
from selfspec.tools.serve.tokenizer_endpoints import detokenize, tokenize, tokenizer_info

MAX_BODY_BYTES = 16 * 2**20
"""the default cap on a request body (16 MiB): room for a batch of prompts that fill a long context, as text or as
token ids; a larger body is answered 413 before it is read."""

LINGER_S = 5.0
"""after answering a request whose body was left unread, how long its bytes are read and dropped (never kept) so
that the client, still sending, reads the answer instead of a reset connection."""


class Handler(BaseHTTPRequestHandler):
    session: Session  # set on the subclass make_server builds
    max_body_bytes: int = MAX_BODY_BYTES  # make_server sets the server's own
    read_timeout: float = READ_TIMEOUT_S  # make_server sets the server's own
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # http.server's own reader: it would hold the socket open after the connection closes
        self.arriving = Deadline(self.connection)
        self.rfile = io.BufferedReader(self.arriving)  # type: ignore[assignment] - what http.server reads requests from

    def handle_one_request(self) -> None:
        """One request, to be read whole within read_timeout (no request line by then: http.server closes the
        connection; headers or body late: 408, ``parse_request`` and ``do_POST``)."""
        self.arriving.start(self.read_timeout)
        super().handle_one_request()

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if format.startswith("Request timed out") and not self.arriving.received:
            return  # an idle keep-alive connection, closed: nothing to report
        super().log_error(format, *args)

    def parse_request(self) -> bool:
        try:
            parsed = super().parse_request()
        except TimeoutError:
            self._late("headers")
            return False
        if parsed and self.command != "POST":  # nothing more to read: answers are written without the deadline
            self._read()
        return parsed

    def _read(self) -> None:
        """The request has been read: what follows (writing its answer) has no deadline."""
        self.arriving.deadline = None
        self.connection.settimeout(None)

    def _late(self, part: str) -> None:
        self._read()
        self.close_connection = True
        self._error(408, f"the request's {part} did not arrive within {self.read_timeout:g} s of its start: send a "
                    "request whole (infer.py serve --read-timeout sets the time)", kind="request_timeout")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if getattr(self.server, "verbose", True):
            super().log_message(format, *args)

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    def _refuse_unread(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        """Answer before the body is read, then close the connection: what the client still sends is read and
        dropped for up to LINGER_S, so that it sees this answer rather than a reset."""
        self.close_connection = True
        self._error(status, message, kind=kind)
        self.wfile.flush()
        try:
            self.connection.shutdown(socket.SHUT_WR)
            end = time.monotonic() + LINGER_S
            while (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(65536):
                    break
        except OSError:  # the client closed, reset, or the time is up
            pass

    def _key_error(self) -> str | None:
        """None if the session asks for no key or the request's headers bring it; else why not."""
        key = self.session.api_key
        if key is None or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
            return None
        return ("missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the server was "
                "started with (--api-key)")

    def _body_error(self) -> tuple[int, str] | None:
        """(status, why) if the body cannot be read as announced: a chunked body, a malformed or too large
        Content-Length; else None."""
        if self.headers.get("Transfer-Encoding") is not None:
            return 411, ("a body sent with Transfer-Encoding is not read: send it whole, with a Content-Length header")
        lengths = self.headers.get_all("Content-Length") or []
        if len(set(lengths)) > 1 or not all(re.fullmatch(r"[0-9]{1,20}", v.strip()) for v in lengths):
            return 400, (f"Content-Length: expected one whole number of bytes, found {', '.join(lengths)!r:.80}")
        length = int(lengths[0]) if lengths else 0
        if length > self.max_body_bytes:
            return 413, (f"the request body has {length:,} bytes, more than the {self.max_body_bytes:,} this server "
                         "reads (infer.py serve --max-body-bytes)")
        return None

    def gone(self) -> bool:
        """Whether the client has gone away: its connection is readable, and at its end (or reset). Asked at every
        step of its request's decoding, from the decoding's thread; data waiting there (a next request) is not read."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            if not poller.poll(0):
                return False
            return not self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except (OSError, ValueError):  # reset, or the socket is closed
            return True

    def handle_expect_100(self) -> bool:
        """A client that asks before sending its body (``Expect: 100-continue``, curl's way with large bodies) is told
        401, 411, 400 or 413 instead of being asked to send it."""
        refusal = self._refusal() if self.command == "POST" else None
        if refusal is None:
            return super().handle_expect_100()
        self.close_connection = True
        self._error(*refusal[:2], kind=refusal[2])
        return False

    def _refusal(self) -> tuple[int, str, str] | None:
        """Why a POST is refused from its headers alone: the key first, then its body's announced size."""
        if (why := self._key_error()) is not None:
            return 401, why, "invalid_api_key"
        if (problem := self._body_error()) is not None:
            return *problem, "invalid_request_error"
        return None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path.rstrip("/")
        if path == "/health":  # open, for load balancers and scripts that wait for the server
            self._json(200, {"status": "ok", "model": self.session.name})
        elif (why := self._key_error()) is not None:
            self._error(401, why, kind="invalid_api_key")
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.session.name, "object": "model", "created": 0,
                                                         "owned_by": "selfspec"}]})
        elif path == "/tokenizer_info":
            self._json(200, tokenizer_info(self.session))
        else:
            self._error(404, f"no such endpoint: GET {self.path} (expected /v1/models, /tokenizer_info or /health)",
                        kind="not_found")

    def _not_allowed(self) -> None:
        self._refuse_unread(405, f"method {self.command} is not served: expected GET (/v1/models, /health, "
                            "/tokenizer_info) or POST (/v1/chat/completions, /v1/completions, /tokenize, /detokenize)")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 - http.server's names

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        refusal = self._refusal()  # from the headers alone: nothing of the body is read yet
        if refusal is not None:
            self._refuse_unread(refusal[0], refusal[1], kind=refusal[2])
            return
        try:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        except TimeoutError:
            self._late("body")
            return
        self._read()
        path = self.path.rstrip("/")
        tools = {"/tokenize": tokenize, "/detokenize": detokenize}
        if path not in ("/v1/chat/completions", "/v1/completions", *tools):
            self._error(404, f"no such endpoint: POST {self.path} (expected /v1/chat/completions, /v1/completions, "
                        "/tokenize or /detokenize)", kind="not_found")
            return
        try:
            body = json.loads(raw or b"null")
        except RecursionError:
            self._error(400, "the request body is not JSON this server reads: it is nested too deeply")
            return
        except (ValueError, UnicodeDecodeError) as err:
            self._error(400, f"the request body is not JSON: {err}")
            return
        try:
            self._answer(body, path, tools.get(path))
        except ClientGone:  # nobody to answer; its decoding has stopped
            self.close_connection = True
        except (BrokenPipeError, ConnectionResetError):  # the client went away while the answer was written
            self.close_connection = True

    def _answer(self, body: Any, path: str, tool: Callable[[Session, Any], dict] | None) -> None:
        """A tokenizer endpoint's answer, or a completion: whole, or streamed as server-sent events; a bad request
        answered 400 (404: another model)."""
        try:
            if tool is not None:
                self._json(200, tool(self.session, body))
                return
            r = self.session.parse(body, chat=path.endswith("chat/completions"))
            if not r.stream:
                self._json(200, complete(self.session, r, self.gone))
                return
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = chunks(self.session, r, include_usage, self.gone)
            first = next(events)  # errors of the request (empty or too-long prompt) come before any byte is sent
        except RequestError as err:
            self._error(err.status, str(err), err.param, code=err.code)
            return
        except RecursionError:
            self._error(400, "the request is nested too deeply")
            return
        except (ValueError, TypeError) as err:  # selfspec's own checks: empty prompt, prompt too long, ...
            self._error(400, str(err))
            return
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            raise
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
        except (BrokenPipeError, ConnectionResetError, ClientGone):  # the client went away: stop decoding
            events.close()


def make_server(session: Session | None, host: str = "127.0.0.1", port: int = 8000, verbose: bool = True,
                max_body_bytes: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT_S,
                max_connections: int = MAX_CONNECTIONS) -> Server:
    """A threading HTTP server for ``session`` (port 0: any free port; ``server.server_address`` says which), bound
    at once. session None: set ``server.RequestHandlerClass.session`` before serving (infer.py serve binds the address
    before it loads the model). max_body_bytes: a larger request body is answered 413 unread. read_timeout: seconds a
    request has to arrive whole. max_connections: the most connections served at once (one more: 503)."""
    for name, value in (("max_body_bytes", max_body_bytes), ("max_connections", max_connections)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, found {value!r}")
    if isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float)) or not 0 < read_timeout < math.inf:
        raise ValueError(f"read_timeout must be a number of seconds > 0, found {read_timeout!r}")
    handler = type("SelfspecHandler", (Handler,), {"session": session, "max_body_bytes": max_body_bytes,
                                                   "read_timeout": float(read_timeout)})
    return Server((host, port), handler, max_connections, verbose)


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this machine only: every address it names is a loopback one ("" and 0.0.0.0 name
    every interface). A name that does not resolve counts as loopback: binding to it fails anyway, saying so."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return True
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to serve beyond this machine without an API key, unless the user says so (``--insecure``)."""
    if not api_key and not insecure and not is_loopback(host):
        raise ValueError(f"--host {host or repr(host)} opens the server beyond this machine, and no API key is set: "
                         "anyone who can reach it could use it. Set --api-key KEY (or SELFSPEC_API_KEY), or pass "
                         "--insecure to serve without one (behind your own gateway)")
