"""Benchmark: how should dlpipe's HDF5 shards store variable-length byte fields (JPEG bytes)?

Two layouts of one field of ``n`` samples in one HDF5 file are compared:

- ``blob`` (what ``dlpipe/formats/hdf5.py`` writes): a contiguous 1-D ``uint8`` dataset holding
  every sample's bytes back to back, plus a contiguous ``uint64`` dataset ``<name>.offsets`` of
  ``n + 1`` entries, so sample ``i`` is ``data[off[i]:off[i + 1]]``. Both datasets are created
  with ``track_times=False``, as the shard writer does.
- ``vlen``: one dataset of dtype ``h5py.vlen_dtype(np.uint8)``, one element per sample
  (``track_times=False`` too).

Two corpora: ``small`` = ``dlpipe.synthetic.synthetic_samples`` JPEGs (64-128 px, ~4 KB each)
and ``large`` = seeded smooth-plus-grain RGB images of ~400x350 px encoded as JPEG quality 90
(~100 KB each, the size of ImageNet files).

For every (corpus, layout) pair, in one run, each measurement gets one unmeasured warm-up run
and then the median of ``--repeats`` (default 5) timed runs:

1. ``write``: build and write one shard file (open, create datasets, close; the blob layout's
   time includes concatenating the bytes and computing the offsets, as the shard writer does).
   Reported as MB/s of raw payload. The file is not fsync'ed, so this is the cost of getting the
   data into the page cache.
2. ``size overhead``: file size on disk relative to the raw payload bytes.
3. ``random``: every sample read once, singly, in a seeded random order, through h5py with the
   file opened once (blob: offsets read once into numpy at open, then
   ``data[lo:hi].tobytes()``; vlen: ``ds[i].tobytes()``). Reported as samples/s; the open (and
   for blob the offsets read) is timed separately and recorded as ``open_s``.
4. ``sequential``: every sample read in batches of 256 consecutive samples (blob: one slice read
   per batch, then cut into per-sample ``bytes`` in memory; vlen: ``ds[i:i + 256]``, then
   ``.tobytes()`` per element). Reported as samples/s.

Nothing is dropped from the page cache: the files are freshly written into a temporary
directory and stay cached, so the read figures measure the warm-cache CPU cost of each layout
(h5py/HDF5 call overhead, copies, heap lookups), which is what matters once a shard is in the
page cache; they are not cold-disk figures. Every read is checked against the original bytes
once, outside the timed runs.

Run from the repository root::

    python benchmarks/hdf5_layout.py           # full run (~1 min), writes
                                               # benchmarks/results/hdf5_layout.{json,md}
    python benchmarks/hdf5_layout.py --quick   # smaller corpora, writes hdf5_layout_quick.*

The JSON file holds every raw timing plus the machine info (CPU count, Python, numpy, h5py and
HDF5 versions); the Markdown file holds the summary table and the verdict.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from PIL import Image

from dlpipe.synthetic import synthetic_samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info as shared_machine_info  # a sibling script, not a package

LAYOUTS = ("blob", "vlen")
BATCH = 256
FIELD = "jpg"
SEED = 0
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------------- corpora


def small_corpus(count: int) -> list[bytes]:
    """dlpipe's synthetic demo JPEGs: 64-128 px, ~4 KB each."""
    out = []
    for sample in synthetic_samples(count, seed=SEED):
        data = sample[FIELD]
        assert isinstance(data, bytes)
        out.append(data)
    return out


def large_jpeg(rng: np.random.Generator) -> bytes:
    """A ~400x350 px image (smooth colour field plus grain), JPEG quality 90: ~100 KB."""
    width, height = int(rng.integers(360, 441)), int(rng.integers(320, 381))
    grid = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    base = Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC)
    grain = rng.normal(0.0, 40.0, size=(height, width, 3)).astype(np.float32)
    pixels = np.clip(np.asarray(base, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def large_corpus(count: int) -> list[bytes]:
    return [large_jpeg(np.random.default_rng([SEED, 1, i])) for i in range(count)]


# ----------------------------------------------------------------------------------- writers


def write_blob(path: str, samples: Sequence[bytes]) -> None:
    """The layout of ``dlpipe/formats/hdf5.py``: contiguous uint8 blob + uint64 offsets."""
    blob = bytearray()
    offsets = [0]
    for data in samples:
        blob += data
        offsets.append(len(blob))
    with h5py.File(path, "w", track_order=False) as f:
        ds = f.create_dataset(
            FIELD, data=np.frombuffer(bytes(blob), dtype=np.uint8), track_times=False
        )
        ds.attrs["layout"] = "blob"
        f.create_dataset(
            f"{FIELD}.offsets", data=np.asarray(offsets, dtype=np.uint64), track_times=False
        )


def write_vlen(path: str, samples: Sequence[bytes]) -> None:
    """One ``vlen_dtype(uint8)`` dataset, one element per sample."""
    elements = np.empty(len(samples), dtype=object)
    for i, data in enumerate(samples):
        elements[i] = np.frombuffer(data, dtype=np.uint8)
    with h5py.File(path, "w", track_order=False) as f:
        ds = f.create_dataset(
            FIELD,
            shape=(len(samples),),
            dtype=h5py.vlen_dtype(np.uint8),
            track_times=False,
        )
        ds[...] = elements
        ds.attrs["layout"] = "vlen"


WRITERS: dict[str, Callable[[str, Sequence[bytes]], None]] = {
    "blob": write_blob,
    "vlen": write_vlen,
}


# ----------------------------------------------------------------------------------- readers


class OpenShard:
    """A shard file opened once; for blob the offsets are read into numpy at open."""

    def __init__(self, path: str, layout: str) -> None:
        self.layout = layout
        self.file = h5py.File(path, "r")
        self.ds = self.file[FIELD]
        self.offsets = (
            self.file[f"{FIELD}.offsets"][:].astype(np.int64) if layout == "blob" else None
        )
        self.n = len(self.offsets) - 1 if self.offsets is not None else self.ds.shape[0]

    def close(self) -> None:
        self.file.close()

    def get(self, i: int) -> bytes:
        if self.offsets is not None:
            return self.ds[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()
        return self.ds[i].tobytes()

    def batch(self, start: int, stop: int) -> list[bytes]:
        if self.offsets is not None:
            off = self.offsets
            base = int(off[start])
            data = self.ds[base : int(off[stop])].tobytes()
            return [data[int(off[i]) - base : int(off[i + 1]) - base] for i in range(start, stop)]
        return [element.tobytes() for element in self.ds[start:stop]]


def read_random(shard: OpenShard, order: np.ndarray) -> int:
    total = 0
    for i in order.tolist():
        total += len(shard.get(i))
    return total


def read_sequential(shard: OpenShard) -> int:
    total = 0
    for start in range(0, shard.n, BATCH):
        for data in shard.batch(start, min(start + BATCH, shard.n)):
            total += len(data)
    return total


# ----------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """One unmeasured warm-up call, then `repeats` timed calls (seconds each)."""
    fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def verify(path: str, layout: str, samples: Sequence[bytes]) -> None:
    shard = OpenShard(path, layout)
    try:
        assert shard.n == len(samples), (layout, shard.n, len(samples))
        for i in (0, len(samples) // 2, len(samples) - 1):
            assert shard.get(i) == samples[i], (layout, "get", i)
        got = [b for s in range(0, shard.n, BATCH) for b in shard.batch(s, min(s + BATCH, shard.n))]
        assert got == list(samples), (layout, "sequential")
    finally:
        shard.close()


def bench_layout(
    tmp: str, corpus: str, layout: str, samples: Sequence[bytes], repeats: int
) -> dict[str, Any]:
    path = os.path.join(tmp, f"{corpus}-{layout}.h5")
    payload = sum(len(s) for s in samples)
    writer = WRITERS[layout]
    write_s = timed(lambda: writer(path, samples), repeats)
    file_bytes = os.path.getsize(path)
    verify(path, layout, samples)

    order = np.random.default_rng([SEED, 2]).permutation(len(samples))
    open_s: list[float] = []
    random_s: list[float] = []
    sequential_s: list[float] = []
    for rep in range(repeats + 1):  # rep 0 is the warm-up
        gc.collect()
        t0 = time.perf_counter()
        shard = OpenShard(path, layout)
        t1 = time.perf_counter()
        try:
            assert read_random(shard, order) == payload
            t2 = time.perf_counter()
            gc.collect()
            t3 = time.perf_counter()
            assert read_sequential(shard) == payload
            t4 = time.perf_counter()
        finally:
            shard.close()
        if rep:
            open_s.append(t1 - t0)
            random_s.append(t2 - t1)
            sequential_s.append(t4 - t3)

    n = len(samples)
    return {
        "corpus": corpus,
        "layout": layout,
        "samples": n,
        "payload_bytes": payload,
        "file_bytes": file_bytes,
        "size_overhead_pct": 100.0 * (file_bytes - payload) / payload,
        "write_s": write_s,
        "open_s": open_s,
        "random_s": random_s,
        "sequential_s": sequential_s,
        "write_MBps": payload / 1e6 / statistics.median(write_s),
        "random_samples_per_s": n / statistics.median(random_s),
        "sequential_samples_per_s": n / statistics.median(sequential_s),
    }


# ----------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    return shared_machine_info(h5py=h5py.version.version, hdf5=h5py.version.hdf5_version)


METRICS = (
    ("random_samples_per_s", "random reads"),
    ("sequential_samples_per_s", "sequential reads"),
    ("write_MBps", "writes"),
)


def verdict(rows: list[dict[str, Any]]) -> str:
    """One line: which layout wins, and by what factor per metric (range over corpora)."""
    by_key = {(r["corpus"], r["layout"]): r for r in rows}
    corpora = sorted({r["corpus"] for r in rows}, key=[r["corpus"] for r in rows].index)
    parts = []
    wins = {layout: 0 for layout in LAYOUTS}
    for metric, label in METRICS:
        ratios = [
            by_key[(c, "blob")][metric] / by_key[(c, "vlen")][metric] for c in corpora
        ]  # > 1: blob faster
        if all(r >= 1 for r in ratios):
            wins["blob"] += 1
            parts.append(f"{label} {_range(ratios)} faster")
        elif all(r <= 1 for r in ratios):
            wins["vlen"] += 1
            parts.append(f"{label} {_range([1 / r for r in ratios])} slower")
        else:
            parts.append(f"{label} mixed (blob/vlen {_range(ratios)})")
    sizes = ", ".join(
        f"{c} {by_key[(c, 'blob')]['size_overhead_pct']:.2f}% vs "
        f"{by_key[(c, 'vlen')]['size_overhead_pct']:.2f}%"
        for c in corpora
    )
    reads_blob = all(
        by_key[(c, "blob")][m] >= by_key[(c, "vlen")][m]
        for c in corpora
        for m in ("random_samples_per_s", "sequential_samples_per_s")
    )
    reads_vlen = all(
        by_key[(c, "blob")][m] <= by_key[(c, "vlen")][m]
        for c in corpora
        for m in ("random_samples_per_s", "sequential_samples_per_s")
    )
    winner = "blob" if reads_blob else "vlen" if reads_vlen else "neither (mixed)"
    return (
        f"**Winner: {winner}.** blob vs vlen: {'; '.join(parts)}; "
        f"size overhead {sizes} (blob vs vlen)."
    )


def _range(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if hi - lo < 0.05 else f"{lo:.2f}-{hi:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    cfg = result["config"]
    lines = [
        "# HDF5 layout for variable-length byte fields: blob + offsets vs vlen",
        "",
        f"Generated by `python benchmarks/hdf5_layout.py{' --quick' if cfg['quick'] else ''}` "
        f"on {result['timestamp']}; raw numbers in `{cfg['json_name']}`.",
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), "
        f"{m['processor']}, Python {m['python']}, numpy {m['numpy']}, h5py {m['h5py']}, "
        f"HDF5 {m['hdf5']}.",
        "",
        f"Median of {cfg['repeats']} repeats after one warm-up. Random = every sample read "
        f"singly in a seeded random order; sequential = batches of {BATCH} consecutive samples. "
        "Page cache not dropped: read rates are warm-cache CPU cost, which is what matters "
        "once a shard is in page cache; writes are not fsync'ed.",
        "",
        "| corpus | layout | samples | mean KB | write MB/s | size overhead % "
        "| random samples/s | sequential samples/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['corpus']} | {r['layout']} | {r['samples']} "
            f"| {r['payload_bytes'] / r['samples'] / 1000:.1f} "
            f"| {r['write_MBps']:.0f} | {r['size_overhead_pct']:.2f} "
            f"| {r['random_samples_per_s']:,.0f} | {r['sequential_samples_per_s']:,.0f} |"
        )
    lines += ["", result["verdict"], ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="smaller corpora (smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    small_n, large_n = (800, 120) if args.quick else (4000, 600)
    stem = "hdf5_layout_quick" if args.quick else "hdf5_layout"
    started = time.perf_counter()

    t0 = time.perf_counter()
    corpora = {"small": small_corpus(small_n), "large": large_corpus(large_n)}
    corpus_s = time.perf_counter() - t0
    print(f"corpora built in {corpus_s:.1f}s", file=sys.stderr)

    rows = []
    with tempfile.TemporaryDirectory(prefix="dlpipe-hdf5-bench-") as tmp:
        for corpus, samples in corpora.items():
            for layout in LAYOUTS:
                row = bench_layout(tmp, corpus, layout, samples, args.repeats)
                rows.append(row)
                print(
                    f"{corpus:5s} {layout}: write {row['write_MBps']:.0f} MB/s, "
                    f"overhead {row['size_overhead_pct']:.2f}%, "
                    f"random {row['random_samples_per_s']:,.0f}/s, "
                    f"sequential {row['sequential_samples_per_s']:,.0f}/s",
                    file=sys.stderr,
                )

    result: dict[str, Any] = {
        "benchmark": "hdf5_layout",
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "repeats": args.repeats,
            "warmup_runs": 1,
            "batch": BATCH,
            "seed": SEED,
            "field": FIELD,
            "page_cache_dropped": False,
            "fsync_on_write": False,
            "json_name": f"{stem}.json",
            "corpora": {
                "small": f"dlpipe.synthetic.synthetic_samples({small_n}, seed={SEED})",
                "large": f"{large_n} smooth+grain RGB ~400x350 JPEG q90, "
                f"np.random.default_rng([{SEED}, 1, i])",
            },
        },
        "corpus_build_s": corpus_s,
        "rows": rows,
    }
    result["verdict"] = verdict(rows)
    result["total_s"] = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    print(f"total {result['total_s']:.1f}s; wrote {args.out / stem}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
