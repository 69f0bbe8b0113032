"""Benchmark: a remote dataset read through `make_loader` and its shard cache, against local disk.

A moto S3 server on loopback holds a wds dataset of ``--shards`` shards of ``--shard-mb`` MB
(samples of 64 KB of random bytes), reached through the tests' loopback proxy
(``tests/s3_faults.py``) that adds ``--delay-ms`` (default 20 ms) to every request and caps the
bytes it sends at ``--bandwidth-mbps`` MB/s in all (one pipe shared by every connection, as a
node's link is).
Every loader is ``dlpipe.make_loader(path, "train", LoaderConfig(batch_size=64,
transform=work))`` with ``--workers`` worker processes, shuffled (shards and blocks, per
epoch), where ``work`` hashes each sample with sha256 (the stand-in for decoding). Measured in
one run:

- **local disk**: the dataset's folder on this machine;
- **full cache**: the S3 URL with ``cache_limit`` as large as the dataset: from epoch 2 on it
  reads only cached shards (goal: at least 0.9x local disk's samples/s). The two loaders run
  their epochs alternately (1 + `WARM_ROUNDS` each), so a busy machine slows both alike, and
  their later epochs' medians are compared;
- **quarter cache**: ``cache_limit`` a quarter of the dataset, evicting by next use (Belady,
  dlpipe's rule) and, for comparison, by least recent use (LRU).

Figures: each epoch's samples/s, and per epoch the shards downloaded (counted at the proxy:
one GET per download, shards being under 8 MB), the hit rate: the share of the readers'
``ShardCache.get`` calls whose shard was on disk, verified, when the call asked for it (the
read waited for no download; a prefetched shard that landed in time is a hit), counted in
every worker, and the downloads per read (the epoch's downloads over those calls: eviction
alone, as a prefetched shard is a download). Run from the repository root in the venv::

    python benchmarks/shard_cache.py     # writes benchmarks/results/shard_cache.{json,md}
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import add_link_arguments, generated_line, log, met, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_faults import FaultProxy  # the tests' loopback S3 proxy

import dlpipe
from dlpipe.loading import remote
from dlpipe.machine import usable_cpus
from dlpipe.shard_cache import BELADY, LRU, ShardCache

SAMPLE_BYTES = 64 << 10
BATCH = 64
WARM_ROUNDS = 9  # warm epochs of the local and the full-cache loader, alternating


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


class GetLog:
    """Every worker's `ShardCache.get` calls, hit or not, appended to one file (the workers
    fork from this process after `install`, so they log too)."""

    def __init__(self, path: Path) -> None:
        self.path, self._get = path, ShardCache.get

    def install(self) -> None:
        log_path, get = str(self.path), self._get

        def logged(cache: ShardCache, name: str) -> str:
            hits = cache.stats().hits
            local = get(cache, name)
            with open(log_path, "a") as f:
                f.write(f"{int(cache.stats().hits > hits)}\n")
            return local

        ShardCache.get = logged  # type: ignore[method-assign]

    def uninstall(self) -> None:
        ShardCache.get = self._get  # type: ignore[method-assign]

    def counts(self) -> tuple[int, int]:
        """(gets, hits) so far."""
        lines = self.path.read_text().split() if self.path.exists() else []
        return len(lines), sum(int(x) for x in lines)


def work(sample: dict[str, Any]) -> int:
    """A reader's work on one sample: hash its bytes (the stand-in for decoding)."""
    return hashlib.sha256(sample["bin"]).digest()[0]


def write_dataset(out: Path, shards: int, shard_mb: float) -> Path:
    """A wds dataset of `shards` shards of about `shard_mb` MB of random 64 KB samples."""
    per_shard = max(1, int(shard_mb * 1e6) // SAMPLE_BYTES)
    rng, limits = random.Random(0), dlpipe.ShardLimits(max_shard_samples=per_shard)
    with dlpipe.DatasetWriter(out=str(out), format="wds", limits=limits) as writer:
        for i in range(shards * per_shard):
            sample = {"__key__": f"s{i:07d}", "bin": rng.randbytes(SAMPLE_BYTES), "cls": b"0"}
            writer.write("train", sample)
    return out


def upload(port: int, folder: Path, prefix: str = "data") -> str:
    """Every file under `folder` (`data_files`) copied to ``s3://bench/<prefix>``, its
    sub-folders kept; the URL."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", key="k", secret="s")
    if not fs.exists("bench"):
        fs.mkdir("bench")
    for path in data_files(folder):
        fs.put_file(str(path), f"bench/{prefix}/{path.relative_to(folder)}")
    return f"s3://bench/{prefix}"


def data_files(folder: Path) -> list[Path]:
    """The files under `folder`, none in or named as a hidden one (``.dlpipe-journal``)."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file())
    return [p for p in paths if not any(n.startswith(".") for n in p.relative_to(folder).parts)]


class LoaderRun:
    """One loader, measured epoch by epoch: samples/s, the shards each epoch downloaded and
    (with `gets`) its `ShardCache.get` calls and their hit rate."""

    def __init__(
        self, path: str, workers: int, link: FaultProxy | None, gets: GetLog, **cache: Any
    ) -> None:
        config = dlpipe.LoaderConfig(batch_size=BATCH, transform=work, **cache)
        settings = dlpipe.WorkerSettings(num_workers=workers)
        self.loader = dlpipe.make_loader(path, "train", config, workers=settings, profile=None)
        self.link, self.gets = link, gets
        self.row: dict[str, list[Any]] = {"samples_per_s": [], "downloads": []}
        self.row |= {"hit_rate": [], "gets": []}

    def epoch(self) -> None:
        before, (calls, hits) = _shard_gets(self.link), self.gets.counts()
        start, samples = time.perf_counter(), 0
        for batch in self.loader:
            samples += len(batch)
        self.row["samples_per_s"].append(samples / (time.perf_counter() - start))
        self.row["downloads"].append(_shard_gets(self.link) - before)
        calls_now, hits_now = self.gets.counts()
        self.row["gets"].append(calls_now - calls)
        self.row["hit_rate"].append((hits_now - hits) / max(calls_now - calls, 1))

    def close(self) -> dict[str, Any]:
        self.loader.close()
        return self.row


def _shard_gets(link: FaultProxy | None) -> int:
    return 0 if link is None else sum(n for k, n in link.gets.items() if k.endswith(".tar"))


def measure(args: argparse.Namespace, port: int, folder: Path) -> dict[str, Any]:
    url = upload(port, folder)
    manifest = dlpipe.read_manifest(str(folder))
    shards = manifest.split("train").shards
    total = sum(s.bytes for s in shards)
    os.environ.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    link = FaultProxy(
        f"http://127.0.0.1:{port}",
        delay_s=args.delay_ms / 1000,
        bytes_per_s=args.bandwidth_mbps * 1e6,
    )
    os.environ["AWS_ENDPOINT_URL"] = link.url
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dlpipe-bench-cache-") as cache_dir:
        gets = GetLog(Path(cache_dir) / "gets.log")
        gets.install()  # before any worker forks
        try:
            log("local disk and full cache, epochs alternating")
            local = LoaderRun(str(folder), args.workers, None, gets)
            full = LoaderRun(url, args.workers, link, gets, cache_dir=cache_dir, cache_limit=total)
            for _ in range(1 + WARM_ROUNDS):  # drift on a shared machine hits both alike
                local.epoch()
                full.epoch()
            runs["local disk"], runs["full cache"] = local.close(), full.close()
            runs["full cache"] |= {"limit_mb": total / 1e6, "policy": BELADY}
            for name, policy in (("quarter cache, belady", BELADY), ("quarter cache, lru", LRU)):
                log(f"{name}: limit {total // 4 / 1e6:.0f} MB")
                remote.POLICY = policy  # the workers fork after this: they evict by it too
                limited = {"cache_dir": f"{cache_dir}/{policy}", "cache_limit": total // 4}
                run = LoaderRun(url, args.workers, link, gets, **limited)
                run.epoch()
                run.epoch()
                runs[name] = run.close() | {"limit_mb": total / 4e6, "policy": policy}
        finally:
            gets.uninstall()
    remote.POLICY = BELADY
    link.server.shutdown()
    return {
        "config": {
            "command": "python benchmarks/shard_cache.py",
            "json_name": "shard_cache.json",
            "format": "wds",
            "shards": len(shards),
            "dataset_mb": total / 1e6,
            "samples": manifest.split("train").samples,
            "sample_kb": SAMPLE_BYTES >> 10,
            "batch_size": BATCH,
            "workers": args.workers,
            "delay_ms": args.delay_ms,
            "bandwidth_mbps": args.bandwidth_mbps,
            "cpus": usable_cpus(),
            "python": sys.version.split()[0],
            "pid": os.getpid(),
        },
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs": runs,
    }


def markdown(result: dict[str, Any]) -> str:
    cfg, runs = result["config"], result["runs"]
    local_rates = runs["local disk"]["samples_per_s"][1:]
    local = statistics.median(local_rates)
    lines = [
        "# Shard cache: a remote dataset read through make_loader, against local disk",
        "",
        f"A {cfg['format']} dataset of {cfg['shards']} shards ({cfg['dataset_mb']:.0f} MB, "
        f"{cfg['samples']} samples of {cfg['sample_kb']} KB, each hashed by the transform), "
        f"batch {cfg['batch_size']}, {cfg['workers']} workers, shuffled; S3 (moto) behind "
        f"{cfg['delay_ms']:.0f} ms per request and {cfg['bandwidth_mbps']:.0f} MB/s in all.",
        "",
        "| loader | cache limit | epoch 1 samples/s | later epochs samples/s (median)"
        " | vs local disk | epoch 2: shards read, downloaded | epoch 2 hit rate"
        " | epoch 2 downloads per read |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in runs.items():
        rates, limit = row["samples_per_s"], row.get("limit_mb")
        warm = statistics.median(rates[1:])
        shown = "-" if limit is None else f"{limit:.0f} MB"
        got = "-" if limit is None else f"{row['gets'][1]}, {row['downloads'][1]}"
        hit = "-" if limit is None else f"{row['hit_rate'][1]:.1%}"
        per_read = "-" if limit is None else f"{_per_read(row):.2f}"
        lines.append(
            f"| {name} | {shown} | {rates[0]:.0f} | {warm:.0f} | {warm / local:.2f}x "
            f"| {got} | {hit} | {per_read} |"
        )
    full, belady, lru = (
        runs[k] for k in ("full cache", "quarter cache, belady", "quarter cache, lru")
    )
    ratio = statistics.median(full["samples_per_s"][1:]) / local
    lines += [
        "",
        "Goals:",
        "",
        f"- full-size cache, later epochs at least 0.9x local disk's: {ratio:.2f}x, "
        f"{met(ratio >= 0.9)}",
        f"- quarter-size cache, Belady against LRU in epoch 2: {belady['downloads'][1]} vs "
        f"{lru['downloads'][1]} shards downloaded "
        f"({met(belady['downloads'][1] < lru['downloads'][1])}: fewer), "
        f"{belady['samples_per_s'][1]:.0f} vs {lru['samples_per_s'][1]:.0f} samples/s, hit rate "
        f"{belady['hit_rate'][1]:.1%} vs {lru['hit_rate'][1]:.1%} "
        f"({met(belady['hit_rate'][1] > lru['hit_rate'][1])}: higher), downloads per read "
        f"{_per_read(belady):.2f} vs {_per_read(lru):.2f} (LRU evicts shards another worker "
        "prefetched before they are read, and fetches them again)",
        "- hit rate: the reads that found their shard on disk, verified, when they asked for "
        "it (a prefetched shard that landed in time is a hit); downloads per read: the "
        "epoch's downloads over its reads (a prefetched shard is a download)",
        f"- the local disk's later epochs ranged {min(local_rates):.0f} to "
        f"{max(local_rates):.0f} samples/s on this shared machine: the ratio is as noisy",
        "",
        f"On {cfg['cpus']} usable CPUs (shared with other work). {generated_line(result)}",
        "",
    ]
    return "\n".join(lines)


def _per_read(row: dict[str, Any]) -> float:
    """Epoch 2's downloads over its shard reads."""
    return row["downloads"][1] / max(row["gets"][1], 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_link_arguments(parser, shards=64)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    server, port = start_moto()
    try:
        with tempfile.TemporaryDirectory(prefix="dlpipe-bench-local-") as local:
            folder = write_dataset(Path(local) / "data", args.shards, args.shard_mb)
            result = measure(args, port, folder)
    finally:
        server.terminate()
        server.wait(timeout=10)
    result["total_s"] = time.perf_counter() - started
    write_results(Path(args.out), "shard_cache", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
