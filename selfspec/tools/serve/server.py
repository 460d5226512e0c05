"""The HTTP side: a request handler that routes each endpoint, answers errors as OpenAI does (a JSON ``error``
object; 400 names the field at fault), checks the API key and streams chunks as server-sent events, and
``make_server``, the threading server around it."""

from __future__ import annotations

import hmac
import itertools
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from selfspec.tools.serve.protocol import RequestError
from selfspec.tools.serve.responses import chunks, complete
from selfspec.tools.serve.session import Session
from selfspec.tools.serve.tokenizer_endpoints import detokenize, tokenize, tokenizer_info


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
