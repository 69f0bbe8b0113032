"""A loopback S3 API for tests and benchmarks: a proxy in front of the moto server (the
``s3_env`` fixture of conftest) that injects faults, delays and a bandwidth cap, and the fsspec
options that reach it."""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

STALL_S = 3.0  # a stalled answer takes longer than the client's read timeout (1 s)
PACE_BYTES = 64 << 10  # a capped link sends bodies in pieces of this size


class FaultProxy:
    """A loopback HTTP proxy in front of the S3 server: counts GETs per object key and plays
    the faults scripted for a key, one per GET: ``ok``, ``500``, ``stall`` (no answer until
    the client gave up), ``cut`` (half the body, then the connection closed), ``hang`` (half
    the body, then nothing until `release` is set), ``slow`` (a pause, then the answer).

    Every request also waits `delay_s`, and with `bytes_per_s` all answers' bodies share one
    link of that bandwidth (as a node's link is shared by its connections)."""

    def __init__(
        self, upstream: str, *, delay_s: float = 0.0, bytes_per_s: float | None = None
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.delay_s, self.bytes_per_s = delay_s, bytes_per_s
        self._link_lock, self._link_free_at = threading.Lock(), 0.0
        self.gets: Counter[str] = Counter()
        self.faults: dict[str, list[str]] = {}
        self.release = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def next_fault(self, method: str, key: str) -> str:
        if method != "GET":
            return "ok"
        self.gets[key] += 1
        script = self.faults.get(key, [])
        return script.pop(0) if script else "ok"

    def pace(self, size: int) -> None:
        """Wait for `size` bytes' turn on the capped link (no cap: at once)."""
        if self.bytes_per_s is None:
            return
        with self._link_lock:
            start = max(time.monotonic(), self._link_free_at)
            self._link_free_at = done_at = start + size / self.bytes_per_s
        time.sleep(max(0.0, done_at - time.monotonic()))

    def forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        sent = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection")}
        conn.request(method, path, body=body or None, headers=sent)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        return answer.status, answer.getheaders(), data


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            key = unquote(urlsplit(self.path).path.lstrip("/"))
            fault = proxy.next_fault(self.command, key)
            time.sleep(proxy.delay_s)
            if fault == "500":
                return self._answer(500, [], b"<Error><Code>InternalError</Code></Error>")
            if fault == "stall":
                time.sleep(STALL_S)
                self.close_connection = True
                return None
            if fault == "slow":
                time.sleep(0.5)
            status, headers, data = proxy.forward(self.command, self.path, self.headers, body)
            if fault in ("cut", "hang"):
                self._answer(status, headers, data, send=len(data) // 2)
                if fault == "hang":
                    proxy.release.wait()
                self.close_connection = True
                return None
            return self._answer(status, headers, data)

        def _answer(self, status: int, headers: Any, data: bytes, send: int | None = None) -> None:
            self.send_response(status)
            head = self.command == "HEAD"  # keeps the object's Content-Length
            dropped = ("transfer-encoding", "connection") + (() if head else ("content-length",))
            for name, value in headers:
                if name.lower() not in dropped:
                    self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                body = data[:send]
                for start in range(0, len(body), PACE_BYTES):
                    proxy.pace(len(body[start : start + PACE_BYTES]))
                    self.wfile.write(body[start : start + PACE_BYTES])
                self.wfile.flush()

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

    return Handler


@pytest.fixture(scope="module")
def proxy(s3_env: dict[str, str]) -> Iterator[FaultProxy]:
    running = FaultProxy(s3_env["AWS_ENDPOINT_URL"])
    yield running
    running.release.set()
    running.server.shutdown()


def proxy_options(proxy: FaultProxy) -> dict[str, Any]:
    """fsspec options that reach the S3 server through the proxy, with short timeouts."""
    return {
        "endpoint_url": proxy.url,
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {
            "read_timeout": 1,
            "connect_timeout": 1,
            "retries": {"max_attempts": 1},
        },
    }
