"""A counting, fault-injecting HTTP reverse proxy on 127.0.0.1, put in front of a storage server.

Every request a client makes to the object store passes through it, so tests can count requests
and response bytes at the wire (nothing in the client can bypass it) and inject faults: HTTP 5xx,
throttling (503 SlowDown), connection resets, stalls past the client's timeout, truncated
bodies, and a bandwidth cap.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


class _Server(ThreadingHTTPServer):
    # The standard library's listen backlog is 5: a burst of parallel connections while this
    # process is busy elsewhere would have its SYNs dropped, and each client would wait a second
    # to send it again (a delay of the proxy's making, not of the store's).
    request_queue_size = 128


class Proxy:
    """``Proxy(upstream_url)``; ``.url`` is where clients connect. Use ``with`` or call ``close``."""

    def __init__(self, upstream: str, port: int = 0):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # method -> count
        self.bytes_out: Counter = Counter()  # method -> response body bytes sent to clients
        self.log: list[tuple[str, str, int, int]] = []  # (method, path, status, body bytes)
        # -> None | "503" | "500" | "reset" | "stall" (answer after stall_seconds) | "truncate" (half a GET body)
        self.fault: Callable[[str, str], str | None] | None = None
        self.stall_seconds = 3.0
        self.bandwidth: float | None = None  # bytes/s cap on response bodies
        self.connections: set[socket.socket] = set()  # open client connections (keep-alive)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                body = self._body()
                method, path = self.command, self.path
                fault = proxy.fault(method, path) if proxy.fault else None
                if fault == "reset":
                    with proxy.lock:
                        proxy.log.append((method, path, 0, 0))
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault in ("500", "503", "403"):
                    code = {"500": b"InternalError", "503": b"SlowDown", "403": b"AccessDenied"}[fault]
                    msg = b"<Error><Code>" + code + b"</Code><Message>injected</Message></Error>"
                    with proxy.lock:
                        proxy.log.append((method, path, int(fault), 0))
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if body or "Content-Length" in self.headers or self.headers.get("Transfer-Encoding"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(method, path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if proxy.bandwidth and data:
                    time.sleep(len(data) / proxy.bandwidth)
                if fault == "stall":  # answer only after the client's read timeout
                    time.sleep(proxy.stall_seconds)
                truncate = fault == "truncate" and method == "GET" and len(data) > 1
                # Logged before a byte of the response goes out: a client that has read it may act on
                # it (and a test may then read the log) before this thread gets past its writes.
                with proxy.lock:
                    if truncate:
                        proxy.log.append((method, path, -1, len(data) // 2))
                    else:
                        proxy.requests[method] += 1
                        if method != "HEAD":
                            proxy.bytes_out[method] += len(data)
                        proxy.log.append((method, path, resp.status, len(data)))
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if truncate:
                    self.wfile.write(data[: len(data) // 2])  # half the promised body, then hang up
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                elif method != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = _Server(("127.0.0.1", port), Handler)  # port 0: any free one
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reset_counts(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes_out.clear()
            self.log.clear()

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
