"""Benchmark: opening a prepared dataset scales with shards, not samples.

Builds once (cached under ``--work``, default ``/tmp/dlpipe-bench-open/``) two datasets per
format (lmdb and wds) of tiny samples (an 8-byte ``bin`` field and a ``cls``), written with
``dlpipe.DatasetWriter``:

- **10k shards**: 10,000 shards of one sample each (a ~2 MB ``dlpipe.json``);
- **1M samples**: 1,000,000 samples in 100 shards of 10,000.

For each it measures, in a fresh child process with torch and ``dlpipe.loading.loader`` (and
so torchvision) already imported (each figure the median of ``--repeats`` children, default
3):

- ``manifest_s``: ``dlpipe.read_manifest`` alone, the floor for any open;
- ``open_s``: ``dlpipe.open_dataset(path, "train")``;
- ``first_batch_s``: ``dlpipe.make_loader(path, "train", config=LoaderConfig(batch_size=64,
  transform=None), workers=WorkerSettings(num_workers=0))`` and its first batch (the open,
  the sampler's permutation of the whole split, the first shard opened and read).

Goals (issue 12): ``open_s`` < 0.5 s at 10,000 shards; ``first_batch_s`` < 1 s at 1 M samples.

Run from the repository root in the venv (a first run spends ~4 min writing the datasets)::

    python benchmarks/open_dataset.py     # writes benchmarks/results/open_dataset.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import log, met, write_results

import dlpipe

SHAPES = {"10k shards": (10_000, 1), "1M samples": (1_000_000, 10_000)}
FORMATS = ("lmdb", "wds")
GOALS = {"open_s": ("10k shards", 0.5), "first_batch_s": ("1M samples", 1.0)}

_CHILD = """
import json, sys, time
import torch
import dlpipe
import dlpipe.loading.loader  # torchvision's import is not the dataset's cost
path, what = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if what == "manifest_s":
    dlpipe.read_manifest(path)
elif what == "open_s":
    dlpipe.open_dataset(path, "train")
else:
    config = dlpipe.LoaderConfig(batch_size=64, transform=None)
    workers = dlpipe.WorkerSettings(num_workers=0)
    next(iter(dlpipe.make_loader(path, "train", config=config, workers=workers)))
print(json.dumps(time.perf_counter() - start))
"""


def build(path: Path, fmt: str, samples: int, per_shard: int) -> float:
    """Write the dataset unless a finished one is there; returns the seconds spent."""
    if (path / "dlpipe.json").exists():
        return 0.0
    start = time.perf_counter()
    limits = dlpipe.ShardLimits(max_shard_samples=per_shard)
    with dlpipe.DatasetWriter(
        out=str(path), format=fmt, classes=("a", "b"), limits=limits, overwrite=True
    ) as writer:
        for i in range(samples):
            writer.write("train", {"__key__": f"s{i:08d}", "cls": b"%d" % (i % 2), "bin": b"x" * 8})
    return time.perf_counter() - start


def measure(path: Path, what: str, repeats: int) -> float:
    """The median seconds of `what` over `repeats` fresh children."""
    times = []
    for _ in range(repeats):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), what],
            capture_output=True,
            text=True,
            check=True,
        )
        times.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Opening a dataset: shards, not samples",
        "",
        "| dataset | format | shards | samples | manifest | read_manifest | open_dataset "
        "| first batch (0 workers) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['dataset']} | {row['format']} | {row['shards']:,} | {row['samples']:,} "
            f"| {row['manifest_bytes'] / 1e6:.1f} MB | {row['manifest_s']:.3f} s "
            f"| {row['open_s']:.3f} s | {row['first_batch_s']:.3f} s |"
        )
    lines += ["", "Goals:", ""]
    for name, (dataset, limit) in GOALS.items():
        worst = max(r[name] for r in result["rows"] if r["dataset"] == dataset)
        lines.append(f"- {name} at {dataset} < {limit} s: {worst:.3f} s, {met(worst < limit)}")
    cfg = result["config"]
    lines += [
        "",
        f"Each figure is the median of {cfg['repeats']} fresh processes with torch and "
        f"torchvision already imported, on {cfg['cpus']} usable CPUs (shared with other "
        f"work); generated {result['timestamp']} by `python benchmarks/open_dataset.py`, "
        "raw numbers in `open_dataset.json`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/dlpipe-bench-open")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    from dlpipe.machine import usable_cpus

    rows = []
    for name, (samples, per_shard) in SHAPES.items():
        for fmt in FORMATS:
            path = Path(args.work) / f"{name.replace(' ', '-')}-{fmt}"
            built = build(path, fmt, samples, per_shard)
            log(f"{name} {fmt}: " + (f"built in {built:.0f} s" if built else "cached"))
            row: dict[str, Any] = {"dataset": name, "format": fmt, "samples": samples}
            row["shards"] = -(-samples // per_shard)
            row["manifest_bytes"] = os.path.getsize(path / "dlpipe.json")
            for what in ("manifest_s", "open_s", "first_batch_s"):
                row[what] = measure(path, what, args.repeats)
            log(f"  {row}")
            rows.append(row)
    result = {
        "config": {"repeats": args.repeats, "cpus": usable_cpus(), "work": args.work},
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    write_results(Path(args.out), "open_dataset", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
