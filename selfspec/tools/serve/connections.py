"""What a connection to ``infer.py serve`` may hold: a request must arrive whole before a deadline (``Deadline``: a
client that trickles its bytes, a slowloris, is cut off at it, not at a timeout each byte restarts), and the server
serves at most ``max_connections`` connections at once, a thread each (``Server``: one more is answered 503 from the
accepting thread)."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

READ_TIMEOUT_S = 30.0
"""the default time a client has to send one whole request (request line, headers and body), from the moment the server
begins to wait for it: 16 MiB (the default body cap) at 0.5 MB/s."""

MAX_CONNECTIONS = 64
"""the default cap on connections served at once (each holds a thread, whether its request decodes, waits in line or
is still arriving): 8 requests decoding in a batch (--max-batch's default) and 56 waiting."""


class Deadline(io.RawIOBase):
    """A connection's bytes, read before a deadline: each read waits only for the time left, so a client that trickles
    its bytes (a slowloris) is cut off at the deadline, not at a timeout that every new byte restarts."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock
        self.deadline: float | None = None
        """time.monotonic() by which the bytes must have come; None: no limit (the request has been read)."""
        self.received = 0
        """bytes received since the deadline was set."""

    def start(self, seconds: float) -> None:
        """The next request's bytes must all have come in ``seconds``."""
        self.deadline, self.received = time.monotonic() + seconds, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive in time")
            self.sock.settimeout(left)
        n = self.sock.recv_into(buffer)
        self.received += n
        return n


class Server(ThreadingHTTPServer):
    """http.server's threading server, serving at most ``max_connections`` connections at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int, verbose: bool):
        super().__init__(address, handler)
        self.max_connections, self.verbose = max_connections, verbose
        self.serving = 0
        """connections being served now (a thread each)."""
        self.lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            full = self.serving >= self.max_connections
            self.serving += not full
        if full:
            self.refuse_busy(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else will give its place back
            self.done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.done()

    def done(self) -> None:
        with self.lock:
            self.serving -= 1

    def refuse_busy(self, request: socket.socket) -> None:
        """503 from the accepting thread, without waiting on the client: what it has sent so far is dropped (unread
        bytes at close would reset the connection before it reads the answer)."""
        data = json.dumps({"error": {"message": f"the server is serving {self.max_connections} connections, as many "
                                     "as it takes (infer.py serve --max-connections): retry later",
                                     "type": "server_busy", "param": None, "code": None}}).encode()
        try:
            request.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                request.recv(65536)
            request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        except OSError:  # the client has gone, or its buffer is full: it is closed either way
            pass
        self.shutdown_request(request)
