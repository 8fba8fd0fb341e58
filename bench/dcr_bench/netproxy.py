"""A streaming HTTP reverse proxy on 127.0.0.1 with an aggregate bandwidth cap per direction."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Hop-by-hop headers, plus Expect: the handler answers "100 Continue" itself, and the upstream
# request always carries a Content-Length.
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
PIECE = 256 << 10  # bodies move in pieces of this size, each paced by the link


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


class ThrottledProxy:
    """``ThrottledProxy(upstream_url, bandwidth)``; clients connect to ``.url``. Use ``with`` or ``close``.

    ``bandwidth`` (bytes/s, None for no cap) applies to request bodies (uplink) and to response
    bodies (downlink) separately, summed over all connections, like a full-duplex network link."""

    def __init__(self, upstream: str, bandwidth: float | None = None):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.up, self.down = Link(bandwidth), Link(bandwidth)
        self.requests = 0
        self.kinds: dict[str, int] = {}  # requests by what they touch (``request_kind``)
        self._count_lock = threading.Lock()
        handler = _handler_for(self)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
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
        return {"requests": self.requests, "bytes_up": self.up.bytes, "bytes_down": self.down.bytes}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ThrottledProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _handler_for(proxy: ThrottledProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes: with Nagle's algorithm on, the peer's delayed
        # ACK would hold each request for about 40 ms, a cost of this proxy, not of the link it models.
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:
            pass

        def _dechunked(self) -> bytes:
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()

        def _send_body(self, conn: http.client.HTTPConnection) -> None:
            """Forward the request body upstream, paced by the uplink."""
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = self._dechunked()  # rare (streaming uploads); buffered, then paced as one body
                conn.putheader("Content-Length", str(len(body)))
                conn.endheaders()
                for i in range(0, len(body), PIECE):
                    proxy.up.send(len(body[i:i + PIECE]))
                    conn.send(body[i:i + PIECE])
                return
            left = int(self.headers.get("Content-Length") or 0)
            if left or "Content-Length" in self.headers:
                conn.putheader("Content-Length", str(left))
            conn.endheaders()
            while left:
                piece = self.rfile.read(min(PIECE, left))
                if not piece:
                    raise ConnectionError("client closed the connection mid-body")
                left -= len(piece)
                proxy.up.send(len(piece))
                conn.send(piece)

        def _handle(self) -> None:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=300)
            try:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as for the client side
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        conn.putheader(k, v)
                self._send_body(conn)
                resp = conn.getresponse()
                self._relay(resp)
            except (BrokenPipeError, ConnectionResetError):
                # A client that stops reading early (e.g. an abandoned read-ahead) is not an error.
                self.close_connection = True
                return
            finally:
                conn.close()
            with proxy._count_lock:
                proxy.requests += 1
                kind = request_kind(self.command, self.path)
                proxy.kinds[kind] = proxy.kinds.get(kind, 0) + 1

        def _relay(self, resp: http.client.HTTPResponse) -> None:
            """Send the upstream response back, its body paced by the downlink."""
            length = resp.getheader("Content-Length")
            no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
            data = None
            if not no_body and length is None:
                data = resp.read()  # an upstream chunked body: buffered so the client gets a length
                length = str(len(data))
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            if length is not None:
                self.send_header("Content-Length", length)
            self.end_headers()
            if no_body:
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
