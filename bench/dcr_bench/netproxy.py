"""A counting, fault-injecting, bandwidth-capped HTTP reverse proxy on 127.0.0.1, put in front of a
storage server: the one the benchmarks and the tests use.

Every request a client makes to the object store passes through it, so callers count requests and
bytes at the wire (nothing in the client can bypass it), cap the link (a rate per direction shared
by every connection, like a full-duplex network link between regions) and inject faults: HTTP 500,
503 (SlowDown: throttling) and 403, connection resets, answers stalled past the client's timeout,
and GET bodies cut off half-way. Bodies stream through in pieces, each paced by its link.
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Hop-by-hop headers, plus Expect: the handler answers "100 Continue" itself (the standard library's
# handler does, for HTTP/1.1), and the upstream request always carries a Content-Length.
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
PIECE = 256 << 10  # bodies move in pieces of this size, each paced by the link
FAULTS = ("500", "503", "403", "reset", "stall", "truncate")
_ERROR_CODES = {"500": b"InternalError", "503": b"SlowDown", "403": b"AccessDenied"}


class Link:
    """One direction of a shared link: every connection's bytes queue for the same ``rate`` (bytes/s)."""

    def __init__(self, rate: float | None = None, burst: int = PIECE):
        self.rate = rate
        self.burst = burst
        self.bytes = 0
        self._lock = threading.Lock()
        self._free_at = 0.0

    def send(self, n: int) -> None:
        """Block until ``n`` bytes have had their turn on the link."""
        with self._lock:
            self.bytes += n
            if not self.rate:
                return
            now = time.monotonic()
            # A token bucket of ``burst`` bytes: the time spent reading the next piece overlaps
            # with the link instead of adding to it, so a busy link runs at ``rate``, not below.
            self._free_at = max(self._free_at, now - self.burst / self.rate) + n / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


def request_kind(method: str, path: str) -> str:
    """What an S3 request touches, by DCR's layout (``storage.layout``): ``METHOD object-kind``."""
    p = urlsplit(path)
    if "list-type" in p.query or "prefix=" in p.query or p.path.endswith("/") and method == "GET":
        return f"{method} list"
    parts = p.path.split("/")
    last = parts[-1]
    if "%25packs" in parts or "%packs" in parts:
        kind = "pack"
    elif "c" in parts and "data.zarr" in parts:
        kind = "chunk"
    elif last == "zarr.json":
        kind = "zarr.json"
    elif last in ("manifest.json", "commit.json", "building.json"):
        kind = last
    elif "stream" in parts:
        kind = "stream index"
    elif "leases" in parts:
        kind = "lease"
    elif "receivers" in parts:
        kind = "receiver record"
    else:
        kind = "other"
    return f"{method} {kind}"


class _Server(ThreadingHTTPServer):
    # The standard library's listen backlog is 5: a burst of parallel connections while this
    # process is busy elsewhere would have its SYNs dropped, and each client would wait a second
    # to send it again (a delay of the proxy's making, not of the store's).
    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that hung up (on a stalled answer, an abandoned read-ahead): expected here
        super().handle_error(request, client_address)


class Proxy:
    """``Proxy(upstream_url, bandwidth=None)``; clients connect to ``.url``. Use ``with`` or ``close``.

    ``bandwidth`` (bytes/s, None for no cap) applies to request bodies (uplink) and to response
    bodies (downlink) separately, summed over all connections. ``fault``, when set, is called with
    each request's method and path (query included), under the proxy's lock (so it may keep counts),
    and answers None or one of ``FAULTS``: "500", "503", "403" (an S3 error document with that
    status), "reset" (the connection dropped with RST after the request, before any response),
    "stall" (the answer held back ``stall_seconds``), "truncate" (half a GET's body, then the
    connection closed; on other methods, no fault).

    Counted: ``requests`` and ``bytes_out`` (response body bytes) by method, and ``kinds``
    (``request_kind``), for the requests that went through unharmed (stalled ones included);
    ``outcomes`` ("ok" or the fault) for every request; ``log``: (method, path, status, body bytes)
    per request, status 0 for a reset and -1 for a truncated body (the bytes sent). A request is
    logged before a byte of its answer goes out: a client that has read it may act on it (and a test
    may then read the log) before the proxy's thread gets past its writes."""

    def __init__(self, upstream: str, bandwidth: float | None = None, port: int = 0):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.up, self.down = Link(bandwidth), Link(bandwidth)
        self.lock = threading.Lock()
        self.fault: Callable[[str, str], str | None] | None = None
        self.stall_seconds = 3.0
        self.requests: Counter = Counter()
        self.bytes_out: Counter = Counter()
        self.kinds: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.log: list[tuple[str, str, int, int]] = []
        self.connections: set[socket.socket] = set()  # open client connections (keep-alive)
        self.server = _Server(("127.0.0.1", port), _handler_for(self))  # port 0: any free one
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def bandwidth(self) -> float | None:
        return self.up.rate

    @bandwidth.setter
    def bandwidth(self, rate: float | None) -> None:
        self.up.rate = self.down.rate = rate

    def counts(self) -> dict:
        """Requests that went through, and body bytes each way."""
        with self.lock:
            return {"requests": sum(self.requests.values()), "bytes_up": self.up.bytes, "bytes_down": self.down.bytes}

    def reset_counts(self) -> None:
        with self.lock:
            for c in (self.requests, self.bytes_out, self.kinds, self.outcomes):
                c.clear()
            self.log.clear()
            self.up.bytes = self.down.bytes = 0

    def close(self) -> None:
        """Stop listening and drop every open client connection: from here on the endpoint refuses
        connections, as a server that went away does."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            conns = list(self.connections)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handler_for(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: with Nagle's algorithm on, the peer's delayed
        # ACK would hold each request for about 40 ms, a cost of this proxy, not of the link it models.
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            with proxy.lock:
                proxy.connections.add(self.connection)

        def finish(self) -> None:
            with proxy.lock:
                proxy.connections.discard(self.connection)
            super().finish()

        def _body_pieces(self) -> Iterator[bytes]:
            """The request body in pieces, each paced by the uplink."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = bytearray()  # rare (streaming uploads): gathered, then paced as one body
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    body += self.rfile.read(size)
                    self.rfile.readline()
                for i in range(0, len(body), PIECE):
                    proxy.up.send(len(body[i:i + PIECE]))
                    yield bytes(body[i:i + PIECE])
                return
            left = int(self.headers.get("Content-Length") or 0)
            while left:
                piece = self.rfile.read(min(PIECE, left))
                if not piece:
                    raise ConnectionError("client closed the connection mid-body")
                left -= len(piece)
                proxy.up.send(len(piece))
                yield piece

        def _body_length(self) -> int | None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                return None
            return int(self.headers.get("Content-Length") or 0)

        def _handle(self) -> None:
            method, path = self.command, self.path
            with proxy.lock:
                fault = proxy.fault(method, path) if proxy.fault else None
                if fault == "truncate" and method != "GET":
                    fault = None
                proxy.outcomes[fault or "ok"] += 1
            try:
                if fault in ("reset", *_ERROR_CODES):
                    for _ in self._body_pieces():  # the request arrives whole; the fault answers it
                        pass
                    self._inject(method, path, fault)
                else:
                    self._forward(method, path, fault)
            except (BrokenPipeError, ConnectionResetError):
                # A client that stops reading early (an abandoned read-ahead, a timeout) is not an error.
                self.close_connection = True

        def _inject(self, method: str, path: str, fault: str) -> None:
            with proxy.lock:
                proxy.log.append((method, path, 0 if fault == "reset" else int(fault), 0))
            if fault == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.connection.close()
                self.close_connection = True
                return
            msg = b"<Error><Code>" + _ERROR_CODES[fault] + b"</Code><Message>injected</Message></Error>"
            self.send_response(int(fault))
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)

        def _forward(self, method: str, path: str, fault: str | None) -> None:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=300)
            try:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as for the client side
                conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                pieces = self._body_pieces()
                length = self._body_length()
                if length is None:
                    body = b"".join(pieces)
                    pieces, length = iter([body]), len(body)
                if length or "Content-Length" in self.headers or self.headers.get("Transfer-Encoding"):
                    conn.putheader("Content-Length", str(length))
                conn.endheaders()
                for piece in pieces:
                    conn.send(piece)
                resp = conn.getresponse()
                if fault == "stall":  # answer only after the client's read timeout
                    time.sleep(proxy.stall_seconds)
                self._relay(method, path, resp, truncate=fault == "truncate")
            finally:
                conn.close()

        def _relay(self, method: str, path: str, resp: http.client.HTTPResponse, truncate: bool) -> None:
            """Send the upstream response back, its body paced by the downlink."""
            length = resp.getheader("Content-Length")
            no_body = method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            data = None
            if not no_body and (length is None or truncate):
                data = resp.read()  # a chunked body (buffered so the client gets a length), or one to cut
                length = str(len(data))
            truncate = truncate and data is not None and len(data) > 1
            size = int(length or 0)
            with proxy.lock:
                if truncate:
                    proxy.log.append((method, path, -1, size // 2))
                else:
                    proxy.requests[method] += 1
                    proxy.kinds[request_kind(method, path)] += 1
                    if not no_body:
                        proxy.bytes_out[method] += size
                    proxy.log.append((method, path, resp.status, 0 if no_body else size))
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            if no_body:
                return
            if truncate:
                half = data[: len(data) // 2]
                proxy.down.send(len(half))
                self.wfile.write(half)  # half the promised body, then hang up
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            if data is not None:
                for i in range(0, len(data), PIECE):
                    proxy.down.send(len(data[i:i + PIECE]))
                    self.wfile.write(data[i:i + PIECE])
                return
            while True:
                piece = resp.read(PIECE)
                if not piece:
                    break
                proxy.down.send(len(piece))
                self.wfile.write(piece)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler
