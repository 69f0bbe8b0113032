"""Benchmark: dlpipe's shard cache against LitData's and Mosaic streaming's caches, same endpoint.

One run writes the same samples (64 KB of random bytes and an int label each, ``--shards`` x
about ``--shard-mb`` MB) in each tool's own format with about the same shard (chunk) size:

- **dlpipe**: a wds dataset through ``dlpipe.DatasetWriter`` (``max_shard_samples``);
- **LitData**: ``litdata.optimize(..., chunk_bytes=<shard bytes>)``;
- **Mosaic streaming**: ``streaming.MDSWriter(size_limit=<shard bytes>)``,

uploads each to one moto S3 server on loopback, and reads it through the tests' loopback proxy
(``tests/s3_faults.py``: ``--delay-ms`` per request, ``--bandwidth-mbps`` MB/s shared by all
connections), counting at the proxy every GET and every body byte it sends. Each tool reads
with its own loader and its own cache, limited first to the dataset's size, then to a quarter
of it, ``--workers`` worker processes, batch 64, shuffled, two epochs; every sample is hashed
with sha256 in the workers (the stand-in for decoding):

- dlpipe: ``make_loader(url, "train", LoaderConfig(cache_dir=..., cache_limit=...))``;
- LitData: ``StreamingDataset(url, cache_dir=..., max_cache_size=..., shuffle=True)`` and
  ``StreamingDataLoader``;
- Mosaic: ``StreamingDataset(remote=url, local=..., cache_limit=..., shuffle=True)`` and a torch
  ``DataLoader``.

Figures: samples/s of each epoch (epoch 2 is the one compared) and the GETs and MB each epoch
downloaded. The peers run in a venv of their own (they pin their own dependencies); dlpipe runs
in this one. Install them beside it, then run from the repository root in dlpipe's venv::

    python3 -m venv PEERS && PEERS/bin/pip install litdata mosaicml-streaming torch==2.14.1
    python benchmarks/shard_cache_peers.py --peer-python PEERS/bin/python
    # writes benchmarks/results/shard_cache_peers.{json,md}

Without ``--peer-python`` only dlpipe is measured. A run takes about 8 minutes on 2 CPUs, most
of it Mosaic's quarter-size cache downloading the dataset again and again and LitData's
quarter-size cache waiting 120 s before it gives up (``--peers`` picks fewer peers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from subprocess import PIPE
from typing import Any

from common import add_link_arguments, generated_line, log, write_results

SAMPLE_BYTES = 64 << 10
BATCH = 64
EPOCHS = 2
PEERS = ("litdata", "mosaic")
PEER_PACKAGES = {"litdata": "litdata", "mosaic": "mosaicml-streaming"}


def samples(count: int) -> Iterator[tuple[int, bytes, int]]:
    """The benchmark's samples, the same for every tool: (index, 64 KB of bytes, label)."""
    rng = random.Random(0)
    for i in range(count):
        yield i, rng.randbytes(SAMPLE_BYTES), i % 10


def digest(data: bytes) -> int:
    """A reader's work on one sample: hash its bytes (the stand-in for decoding)."""
    return hashlib.sha256(data).digest()[0]


# --- the peers' side: runs in the peers' venv, imports only their packages and torch ---------


def write_peer(tool: str, out: str, count: int, shard_bytes: int) -> None:
    """The samples in `tool`'s own format, in folder `out`, chunks of about `shard_bytes`."""
    if tool == "litdata":
        import litdata

        litdata.optimize(
            fn=_litdata_sample,
            inputs=list(range(count)),
            output_dir=out,
            chunk_bytes=shard_bytes,
            num_workers=1,
            mode="overwrite",
        )
        return
    from streaming import MDSWriter

    columns = {"x": "bytes", "y": "int"}
    with MDSWriter(out=out, columns=columns, size_limit=shard_bytes) as writer:
        for _, data, label in samples(count):
            writer.write({"x": data, "y": label})


_LITDATA_SAMPLES: dict[int, tuple[bytes, int]] = {}


def _litdata_sample(index: int) -> dict[str, Any]:
    if not _LITDATA_SAMPLES:  # once per optimize worker: the same bytes as the other tools
        count = int(os.environ["PEER_SAMPLES"])
        _LITDATA_SAMPLES.update((i, (data, label)) for i, data, label in samples(count))
    data, label = _LITDATA_SAMPLES[index]
    return {"x": data, "y": label}


def peer_loader(tool: str, url: str, cache_dir: str, limit: int, workers: int) -> Any:
    """`tool`'s own streaming loader over `url`, its cache in `cache_dir` limited to `limit`."""
    if tool == "litdata":
        import litdata
        from litdata.streaming import downloader

        # LitData downloads chunks with obstore, which refuses a plain-http endpoint unless told
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

        class Hashed(litdata.StreamingDataset):
            def __getitem__(self, index: Any) -> tuple[int, int]:
                sample = super().__getitem__(index)
                return digest(sample["x"]), sample["y"]

        dataset = Hashed(url, cache_dir=cache_dir, max_cache_size=limit, shuffle=True, seed=0)
        return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    class MdsHashed(StreamingDataset):
        def __getitem__(self, index: int) -> tuple[int, int]:
            sample = super().__getitem__(index)
            return digest(sample["x"]), sample["y"]

    dataset = MdsHashed(
        remote=url, local=cache_dir, cache_limit=limit, shuffle=True, shuffle_seed=0,
        batch_size=BATCH,
    )  # fmt: skip
    return DataLoader(dataset, batch_size=BATCH, num_workers=workers)


def read_peer(tool: str, url: str, cache_dir: str, limit: int, workers: int) -> None:
    """`EPOCHS` epochs of `tool`'s loader; after each, one JSON line on stdout, then wait for a
    line on stdin (the parent reads the proxy's counters in between)."""
    loader = peer_loader(tool, url, cache_dir, limit, workers)
    for epoch in range(EPOCHS):
        start, count = time.perf_counter(), 0
        for hashes, _labels in loader:
            count += len(hashes)
        seconds = time.perf_counter() - start
        print(json.dumps({"epoch": epoch, "samples": count, "seconds": seconds}), flush=True)
        sys.stdin.readline()


def peer_versions() -> dict[str, str]:
    """The peers' package versions and torch's, as installed in this venv."""
    from importlib.metadata import version

    names = [*PEER_PACKAGES.values(), "torch", "boto3"]
    return {name: version(name) for name in names}


# --- dlpipe's side: the server, the proxy, the datasets, dlpipe's loader ---------------------


def byte_counting_proxy(upstream: str, delay_s: float, bytes_per_s: float) -> Any:
    """The tests' `FaultProxy`, also counting the body bytes it sends (``sent``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3_faults import FaultProxy  # the tests' loopback S3 proxy

    class ByteCountingProxy(FaultProxy):
        def __init__(self) -> None:
            super().__init__(upstream, delay_s=delay_s, bytes_per_s=bytes_per_s)
            self.sent, self._count_lock = 0, threading.Lock()

        def pace(self, size: int) -> None:
            with self._count_lock:
                self.sent += size
            super().pace(size)

    return ByteCountingProxy()


class Link:
    """The proxy's counters, read at epoch boundaries: GETs and bytes since the last read."""

    def __init__(self, proxy: Any) -> None:
        self.proxy, self._gets, self._bytes = proxy, 0, 0

    def take(self) -> tuple[int, int]:
        gets, sent = sum(self.proxy.gets.values()), self.proxy.sent
        taken = (gets - self._gets, sent - self._bytes)
        self._gets, self._bytes = gets, sent
        return taken


def dlpipe_epochs(url: str, cache_dir: str, limit: int, workers: int, link: Link) -> list[dict]:
    """`EPOCHS` epochs of dlpipe's loader over `url` with its cache limited to `limit`."""
    from dlpipe.loading.config import LoaderConfig, WorkerSettings
    from dlpipe.loading.loader import make_loader

    def work(sample: dict[str, Any]) -> int:
        return digest(sample["bin"])

    config = LoaderConfig(
        batch_size=BATCH, transform=work, drop_last=False, cache_dir=cache_dir, cache_limit=limit
    )  # every sample, as the peers' loaders read them
    settings = WorkerSettings(num_workers=workers)
    loader = make_loader(url, "train", config, workers=settings, profile=None)
    epochs = []
    link.take()
    try:
        for _ in range(EPOCHS):
            start, count = time.perf_counter(), 0
            for batch in loader:
                count += len(batch)
            epochs.append(_epoch(count, time.perf_counter() - start, link))
    finally:
        loader.close()
    return epochs


def peer_epochs(
    python: str, tool: str, url: str, cache_dir: str, limit: int, args: argparse.Namespace,
    link: Link,
) -> list[dict]:  # fmt: skip
    """`EPOCHS` epochs of `tool`'s loader, run by `python` (the peers' venv)."""
    cmd = [python, __file__, "--peer-read", tool, "--url", url, "--cache-dir", cache_dir]
    cmd += ["--limit", str(limit), "--workers", str(args.workers)]
    link.take()
    errors = Path(cache_dir + ".stderr")
    errors.parent.mkdir(parents=True, exist_ok=True)
    with errors.open("w") as stderr:
        return _talk(subprocess.Popen(cmd, stdin=PIPE, stdout=PIPE, stderr=stderr, text=True), link)


def _talk(proc: subprocess.Popen[str], link: Link) -> list[dict]:
    """A peer reader's epochs; its error's last line if it fails."""
    assert proc.stdin is not None and proc.stdout is not None
    epochs = []
    for _ in range(EPOCHS):
        line = proc.stdout.readline()
        if not line:
            break
        seen = json.loads(line)
        epochs.append(_epoch(seen["samples"], seen["seconds"], link))
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.stdin.close()
    if proc.wait(timeout=120) != 0 or len(epochs) < EPOCHS:
        assert isinstance(proc.args, list)
        errors = proc.args[proc.args.index("--cache-dir") + 1] + ".stderr"
        lines = Path(errors).read_text()
        last = [line for line in lines.splitlines() if "Error" in line][-1:]
        message = " ".join(last).replace(str(Path(errors).parent), "CACHE")
        raise RuntimeError(f"exit status {proc.returncode}: {message}")
    return epochs


def _epoch(count: int, seconds: float, link: Link) -> dict[str, Any]:
    gets, sent = link.take()
    return {"samples": count, "samples_per_s": count / seconds, "gets": gets, "mb": sent / 1e6}


def write_dlpipe(out: Path, count: int, per_shard: int) -> None:
    import dlpipe

    limits = dlpipe.ShardLimits(max_shard_samples=per_shard)
    with dlpipe.DatasetWriter(out=str(out), format="wds", limits=limits) as writer:
        for i, data, label in samples(count):
            sample = {"__key__": f"s{i:07d}", "bin": data, "cls": str(label).encode()}
            writer.write("train", sample)


def upload(port: int, folder: Path, prefix: str) -> tuple[str, int]:
    """`folder` copied to ``s3://bench/<prefix>`` (`shard_cache.upload`); the URL and the
    bytes of its data files (every file but the index/manifest)."""
    from shard_cache import data_files
    from shard_cache import upload as copy_up

    data = [p for p in data_files(folder) if p.suffix in (".tar", ".bin", ".mds")]
    data_bytes = sum(p.stat().st_size for p in data)
    return copy_up(port, folder, prefix), data_bytes


def prepare(args: argparse.Namespace, port: int, work: Path) -> dict[str, dict[str, Any]]:
    """Each tool's dataset written and uploaded: its URL and data bytes per tool."""
    per_shard = max(1, int(args.shard_mb * 1e6) // SAMPLE_BYTES)
    count, shard_bytes = args.shards * per_shard, per_shard * SAMPLE_BYTES + 4096
    datasets = {}
    log(f"writing {count} samples: dlpipe wds, {per_shard} samples a shard")
    write_dlpipe(work / "dlpipe", count, per_shard)
    url, size = upload(port, work / "dlpipe", "dlpipe")
    datasets["dlpipe"] = {"url": url, "bytes": size, "writer": "DatasetWriter(format='wds')"}
    for tool in args.peers if args.peer_python else ():
        log(f"writing {count} samples: {tool}, chunks of {shard_bytes} bytes")
        cmd = [args.peer_python, __file__, "--peer-write", tool, "--out-dir", str(work / tool)]
        cmd += ["--samples", str(count), "--shard-bytes", str(shard_bytes)]
        subprocess.run(cmd, check=True, env=os.environ | {"PEER_SAMPLES": str(count)})
        url, size = upload(port, work / tool, tool)
        datasets[tool] = {"url": url, "bytes": size, "chunk_bytes": shard_bytes}
    return datasets


def measure(args: argparse.Namespace, port: int, work: Path) -> dict[str, Any]:
    datasets = prepare(args, port, work)
    proxy = byte_counting_proxy(
        f"http://127.0.0.1:{port}", args.delay_ms / 1000, args.bandwidth_mbps * 1e6
    )
    link = Link(proxy)
    os.environ.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1")
    os.environ.update(AWS_ENDPOINT_URL=proxy.url, S3_ENDPOINT_URL=proxy.url, AWS_ALLOW_HTTP="true")
    runs: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for share, label in ((1, "full"), (4, "quarter")):
        for tool, dataset in datasets.items():
            limit = dataset["bytes"] // share
            name = f"{tool}, {label} cache"
            log(f"{name}: limit {limit / 1e6:.0f} MB")
            cache_dir = str(work / "cache" / f"{tool}-{label}")
            try:
                if tool == "dlpipe":
                    epochs = dlpipe_epochs(dataset["url"], cache_dir, limit, args.workers, link)
                else:
                    epochs = peer_epochs(
                        args.peer_python, tool, dataset["url"], cache_dir, limit, args, link
                    )
            except Exception as error:  # a peer that fails is reported, not fatal
                errors[name] = f"{type(error).__name__}: {error}"
                log(f"{name} failed: {errors[name]}")
                continue
            runs[name] = {"tool": tool, "limit_mb": limit / 1e6, "epochs": epochs}
    proxy.server.shutdown()
    return {"datasets": datasets, "runs": runs, "errors": errors}


def versions(args: argparse.Namespace) -> dict[str, str]:
    from importlib.metadata import version

    found = {name: version(name) for name in ("dlpipe", "torch", "moto", "s3fs")}
    if args.peer_python:
        cmd = [args.peer_python, __file__, "--peer-versions"]
        peers = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
        found |= {f"{name} (peers' venv)": v for name, v in peers.items()}
    return found


def markdown(result: dict[str, Any]) -> str:
    cfg, runs = result["config"], result["runs"]
    lines = [
        "# Shard cache against LitData and Mosaic streaming: same data, endpoint, cache size",
        "",
        f"{cfg['samples']} samples of {cfg['sample_kb']} KB (random bytes, an int label) in "
        f"each tool's format, shards (chunks) of about {cfg['shard_mb']:.1f} MB; one moto S3 "
        f"server behind {cfg['delay_ms']:.0f} ms per request and {cfg['bandwidth_mbps']:.0f} "
        f"MB/s in all; batch {cfg['batch_size']}, {cfg['workers']} workers, shuffled, each "
        "sample hashed (sha256) in the workers; GETs and bytes counted at the proxy.",
        "",
        "| loader | cache limit | epoch 1 samples/s | epoch 2 samples/s | epoch 1 GETs, MB "
        "| epoch 2 GETs, MB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in runs.items():
        one, two = row["epochs"]
        lines.append(
            f"| {name} | {row['limit_mb']:.0f} MB | {one['samples_per_s']:.0f} "
            f"| {two['samples_per_s']:.0f} | {one['gets']}, {one['mb']:.0f} "
            f"| {two['gets']}, {two['mb']:.0f} |"
        )
    lines += ["", *verdicts(runs)]
    for name, error in result["errors"].items():
        lines.append(f"- {name}: **failed**: {error}")
    lines += ["", *PEER_NOTES]
    load = cfg["load_before"], cfg["load_after"]
    lines += [
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in cfg["versions"].items()) + ".",
        "",
        f"On {cfg['cpus']} usable CPUs shared with other work (load average "
        f"{load[0][0]:.2f} before, {load[1][0]:.2f} after): compare within this run only. "
        f"{generated_line(result)}",
        "",
    ]
    return "\n".join(lines)


PEER_NOTES = [
    "Each peer runs with its defaults but for the cache limit, shuffling and the endpoint:",
    "",
    "- LitData reads chunks with obstore, which refuses a plain-http endpoint unless its client "
    "options allow it (the benchmark sets ``allow_http``); it pre-downloads up to "
    "``max_pre_download=2`` chunks a worker and warns when ``max_cache_size`` is under 25 GB. "
    "With a cache of the dataset's size it still downloaded part of the dataset again in "
    "epoch 2 (see the table); with a quarter-size cache a worker waited for a chunk that never "
    "came and stopped after 120 s (``ChunkWaitTimeoutError``; the same at 12 and 32 shards).",
    "- Mosaic's default shuffle (``py1e``, blocks of 262144 samples, more than this dataset) "
    "draws every batch from shards all over the dataset, so a cache smaller than the dataset "
    "evicts shards still needed and downloads them again and again.",
    "- dlpipe prefetches in its known read order and evicts the shard needed furthest ahead.",
]


def verdicts(runs: dict[str, dict[str, Any]]) -> list[str]:
    """One line per cache size: dlpipe's epoch 2 against each peer's."""
    lines = []
    for label in ("full", "quarter"):
        ours = runs.get(f"dlpipe, {label} cache")
        for tool in PEERS:
            theirs = runs.get(f"{tool}, {label} cache")
            if ours is None or theirs is None:
                continue
            a, b = ours["epochs"][1], theirs["epochs"][1]
            lines.append(
                f"- {label} cache, epoch 2, dlpipe against {tool}: "
                f"{a['samples_per_s'] / b['samples_per_s']:.2f}x the samples/s, "
                f"{a['mb']:.0f} MB against {b['mb']:.0f} MB downloaded"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_link_arguments(parser, shards=32)
    parser.add_argument("--peer-python", help="the python of a venv with litdata and streaming")
    parser.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    peer = parser.add_argument_group("the peers' side (run by the benchmark itself)")
    peer.add_argument("--peer-write", choices=PEERS)
    peer.add_argument("--peer-read", choices=PEERS)
    peer.add_argument("--peer-versions", action="store_true")
    for flag in ("--out-dir", "--url", "--cache-dir"):
        peer.add_argument(flag)
    for flag in ("--samples", "--shard-bytes", "--limit"):
        peer.add_argument(flag, type=int)
    args = parser.parse_args(argv)
    if args.peer_write:
        write_peer(args.peer_write, args.out_dir, args.samples, args.shard_bytes)
    elif args.peer_read:
        read_peer(args.peer_read, args.url, args.cache_dir, args.limit, args.workers)
    elif args.peer_versions:
        print(json.dumps(peer_versions()))
    else:
        run(args)
    return 0


def run(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info
    from shard_cache import start_moto

    from dlpipe.machine import usable_cpus

    started, load_before = time.perf_counter(), os.getloadavg()
    server, port = start_moto()
    try:
        with tempfile.TemporaryDirectory(prefix="dlpipe-bench-peers-") as work:
            result = measure(args, port, Path(work))
    finally:
        server.terminate()
        server.wait(timeout=10)
    per_shard = max(1, int(args.shard_mb * 1e6) // SAMPLE_BYTES)
    result["config"] = {
        "command": "python benchmarks/shard_cache_peers.py --peer-python PEERS/bin/python",
        "json_name": "shard_cache_peers.json",
        "samples": args.shards * per_shard,
        "sample_kb": SAMPLE_BYTES >> 10,
        "shards": args.shards,
        "shard_mb": per_shard * SAMPLE_BYTES / 1e6,
        "batch_size": BATCH,
        "epochs": EPOCHS,
        "workers": args.workers,
        "delay_ms": args.delay_ms,
        "bandwidth_mbps": args.bandwidth_mbps,
        "cpus": usable_cpus(),
        "machine": machine_info(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "versions": versions(args),
        "python": sys.version.split()[0],
    }
    result["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result["total_s"] = time.perf_counter() - started
    write_results(Path(args.out), "shard_cache_peers", result, markdown)


if __name__ == "__main__":
    sys.exit(main())
