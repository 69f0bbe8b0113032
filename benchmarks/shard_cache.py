"""Benchmark: the order-aware shard cache reading from a slow S3 endpoint, against local disk.

A moto S3 server on loopback holds ``--shards`` shards of ``--shard-mb`` MB of random bytes,
reached through a small proxy in this script that adds ``--delay-ms`` (default 20 ms) to every
request and caps the bytes it sends at ``--bandwidth-mbps`` MB/s in all (one pipe shared by
every connection, as a node's link is). A reader takes the shards in two shuffled epochs
(planned at once, as a loader knows both orders) and, per shard, reads the file and hashes it
with sha256 (the stand-in for a reader's work). Measured in one run:

- **local disk**: the same shards read from a local folder in the same order;
- **full cache**: `ShardCache` with a limit as large as the dataset (the measured prefetch
  depth, 4 download threads): the second epoch reads only cached shards;
- **quarter cache**: a limit of a quarter of the dataset, by next use (Belady) and by LRU.

Figures: the second epoch's read rate (MB/s of shards; at full size and on local disk the
median of 3 reads of it) and its ratio to local disk (goal at full size: at least 0.9x), the
hit rate (a `get` that found its shard cached and not downloaded since its last use) of the
second epoch and of both, and the MB downloaded.

Run from the repository root in the venv::

    python benchmarks/shard_cache.py     # writes benchmarks/results/shard_cache.{json,md}
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from common import generated_line, log, met, write_results

from dlpipe.machine import usable_cpus
from dlpipe.manifest import ShardInfo
from dlpipe.shard_cache import BELADY, LRU, ShardCache

PACE_BYTES = 64 << 10


class SlowLink:
    """A loopback proxy to `upstream` adding `delay_s` per request and pacing all response
    bodies together at `bytes_per_s`."""

    def __init__(self, upstream_port: int, delay_s: float, bytes_per_s: float) -> None:
        self.upstream_port, self.delay_s, self.bytes_per_s = upstream_port, delay_s, bytes_per_s
        self._lock, self._free_at = threading.Lock(), 0.0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def pace(self, size: int) -> None:
        """Wait for `size` bytes' turn on the shared link."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + size / self.bytes_per_s
            done_at = self._free_at
        time.sleep(max(0.0, done_at - time.monotonic()))

    def forward(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        sent = {k: v for k, v in headers.items() if k.lower() not in ("host", "connection")}
        conn.request(method, path, body=body or None, headers=sent)
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        return answer.status, answer.getheaders(), data


def _handler(link: SlowLink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(link.delay_s)
            status, headers, data = link.forward(self.command, self.path, self.headers, body)
            self.send_response(status)
            head = self.command == "HEAD"
            dropped = ("transfer-encoding", "connection") + (() if head else ("content-length",))
            for name, value in headers:
                if name.lower() not in dropped:
                    self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for start in range(0, 0 if head else len(data), PACE_BYTES):
                chunk = data[start : start + PACE_BYTES]
                link.pace(len(chunk))
                self.wfile.write(chunk)

        do_GET = do_HEAD = do_PUT = do_POST = _any

    return Handler


def start_moto() -> tuple[subprocess.Popen[bytes], int]:
    """A moto S3 server on a free loopback port, once it accepts connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    exe = str(Path(sys.executable).parent / "moto_server")
    server = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, port
        except OSError:
            time.sleep(0.1)
    server.terminate()
    raise RuntimeError("moto_server did not start")


def upload(port: int, local: Path, count: int, size: int) -> list[ShardInfo]:
    """`count` random shards written to `local` and to ``s3://bench/shards``."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s")
    fs.mkdir("bench")
    rng, shards = random.Random(0), []
    for i in range(count):
        name, data = f"train-{i:06d}.tar", rng.randbytes(size)
        (local / name).write_bytes(data)
        fs.pipe_file(f"bench/shards/{name}", data)
        shards.append(ShardInfo(name, 1, size, hashlib.sha256(data).hexdigest()))
    return shards


def consume(path: str) -> int:
    """A reader's work on one shard: read it whole and hash it."""
    data = Path(path).read_bytes()
    hashlib.sha256(data).digest()
    return len(data)


def read_local(folder: Path, order: list[str]) -> float:
    """Seconds to consume the shards of `order` from `folder`."""
    start = time.perf_counter()
    for name in order:
        consume(str(folder / name))
    return time.perf_counter() - start


def read_cached(cache: ShardCache, order: list[str]) -> tuple[float, int, int]:
    """Seconds to consume `order` through `cache`, and the gets and hits it added."""
    before, start = cache.stats(), time.perf_counter()
    for name in order:
        consume(cache.get(name))
        cache.release(name)
    after = cache.stats()
    return time.perf_counter() - start, after.gets - before.gets, after.hits - before.hits


def run_cache(
    link: SlowLink,
    shards: list[ShardInfo],
    epochs: list[list[str]],
    limit: int,
    policy: Literal["belady", "lru"],
    passes: int,
) -> dict[str, Any]:
    """One cache's figures; the second epoch's rate is the median of `passes` reads of it (a
    cache as large as the dataset: every pass reads cached shards)."""
    options = {"endpoint_url": link.url, "key": "k", "secret": "s"}
    with (
        tempfile.TemporaryDirectory(prefix="dlpipe-bench-cache-") as folder,
        ShardCache(
            "s3://bench/shards", folder, limit, shards, policy=policy, storage_options=options
        ) as cache,
    ):
        cache.plan(epochs[0] + epochs[1] * passes)
        first_s, _, _ = read_cached(cache, epochs[0])
        second_s, gets, hits = read_cached(cache, epochs[1])
        stats = cache.stats()  # the hit rate and downloads of two epochs
        again = [read_cached(cache, epochs[1])[0] for _ in range(passes - 1)]
        second_s = statistics.median([second_s, *again])
    size = sum(s.bytes for s in shards)
    return {
        "policy": policy,
        "limit_mb": limit / 1e6,
        "epoch1_mb_per_s": size / first_s / 1e6,
        "epoch2_mb_per_s": size / second_s / 1e6,
        "epoch2_hit_rate": hits / gets,
        "hit_rate": stats.hit_rate,
        "downloaded_mb": stats.downloaded_bytes / 1e6,
        "evictions": stats.evictions,
    }


def markdown(result: dict[str, Any]) -> str:
    cfg, local = result["config"], result["local_mb_per_s"]
    lines = [
        "# Shard cache: a slow S3 endpoint, read through the order-aware cache",
        "",
        f"{cfg['shards']} shards of {cfg['shard_mb']} MB, two shuffled epochs; S3 (moto) behind "
        f"{cfg['delay_ms']} ms per request and {cfg['bandwidth_mbps']} MB/s in all; local disk "
        f"reads the same shards at {local:.0f} MB/s (each shard read and hashed).",
        "",
        "| cache | limit | epoch 2 MB/s | vs local disk | epoch 2 hit rate | hit rate (2 epochs)"
        " | MB downloaded |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["runs"].items():
        lines.append(
            f"| {name} | {row['limit_mb']:.0f} MB | {row['epoch2_mb_per_s']:.0f} | "
            f"{row['epoch2_mb_per_s'] / local:.2f}x | {row['epoch2_hit_rate']:.1%} | "
            f"{row['hit_rate']:.1%} | {row['downloaded_mb']:.0f} |"
        )
    full, belady, lru = (result["runs"][k] for k in ("full", "quarter belady", "quarter lru"))
    ratio = full["epoch2_mb_per_s"] / local
    lines += [
        "",
        "Goals:",
        "",
        f"- full-size cache, epoch 2 at least 0.9x local disk: {ratio:.2f}x, {met(ratio >= 0.9)}",
        f"- quarter-size cache, Belady's hit rate above LRU's: {belady['hit_rate']:.1%} vs "
        f"{lru['hit_rate']:.1%}, {met(belady['hit_rate'] > lru['hit_rate'])}",
        "",
        f"On {cfg['cpus']} usable CPUs (shared with other work). {generated_line(result)}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--shard-mb", type=float, default=4.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth-mbps", type=float, default=100.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    server, port = start_moto()
    try:
        result = measure(args, port)
    finally:
        server.terminate()
        server.wait(timeout=10)
    result["total_s"] = time.perf_counter() - started
    write_results(Path(args.out), "shard_cache", result, markdown)
    return 0


def measure(args: argparse.Namespace, port: int) -> dict[str, Any]:
    size = int(args.shard_mb * 1e6)
    with tempfile.TemporaryDirectory(prefix="dlpipe-bench-local-") as local:
        shards = upload(port, Path(local), args.shards, size)
        names, rng = [s.name for s in shards], random.Random(1)
        epochs = [rng.sample(names, len(names)), rng.sample(names, len(names))]
        read_local(Path(local), epochs[0])  # the page cache warm, as the cache's copy will be
        local_s = statistics.median(read_local(Path(local), epochs[1]) for _ in range(3))
    link = SlowLink(port, args.delay_ms / 1000, args.bandwidth_mbps * 1e6)
    total, runs = size * args.shards, {}
    for name, limit, policy, passes in (
        ("full", total, BELADY, 3),
        ("quarter belady", total // 4, BELADY, 1),
        ("quarter lru", total // 4, LRU, 1),
    ):
        log(f"{name}: limit {limit / 1e6:.0f} MB")
        runs[name] = run_cache(link, shards, epochs, limit, policy, passes)
    link.server.shutdown()
    return {
        "config": {
            "command": "python benchmarks/shard_cache.py",
            "json_name": "shard_cache.json",
            "shards": args.shards,
            "shard_mb": args.shard_mb,
            "delay_ms": args.delay_ms,
            "bandwidth_mbps": args.bandwidth_mbps,
            "cpus": usable_cpus(),
            "python": sys.version.split()[0],
            "pid": os.getpid(),
        },
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "local_mb_per_s": size * args.shards / local_s / 1e6,
        "runs": runs,
    }


if __name__ == "__main__":
    sys.exit(main())
