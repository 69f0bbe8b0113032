"""Benchmark: what mixing two datasets costs per sample, against one dataset of the same size.

Writes ``--samples`` synthetic JPEG samples (``dlpipe.synthetic``, 64-128 px shapes) once as one
lmdb dataset and once as two lmdb datasets of half each (the same bytes), under ``--work``
(default ``/tmp/dlpipe-bench-mixing/``). Then, in one run, alternating the two in every round
(the order of the pair flips each round), it reads whole epochs of:

- **one dataset**: ``make_loader(one, "train", config)``;
- **mixture**: ``make_loader([a, b], "train", config.replace(weights=(0.5, 0.5)))``,

with 0 workers (all the work in this process, so the figure is the CPU cost of a sample, not a
worker count's) for two pipelines: the train transform at 224 px (decode, crop, flip: what a
run reads) and raw samples (``transform=None``: the read alone, where a mixture's fixed cost
per sample shows most). Each figure is the median samples/s of ``--rounds`` epochs; the
overhead is ``1 - mixture / one``. The mixture's epoch order (the shares, the interleaving and
the per-source permutations, drawn once per epoch in the main process) is timed on its own.

Goal (issue 28): mixing costs at most 3 % per sample in the train pipeline.

Run from the repository root in the venv::

    python benchmarks/mixing.py     # writes benchmarks/results/mixing.{json,md}
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import log, met, write_results

import dlpipe
from dlpipe.loading.mixing import MixSampler
from dlpipe.synthetic import SHAPE_CLASSES, synthetic_samples

GOAL = 0.03  # the train pipeline's overhead per sample
PIPELINES = {"train 224 px": {"transform": "train", "image_size": 224}, "raw": {"transform": None}}


def build(folder: Path, samples: int) -> tuple[str, list[str]]:
    """The one dataset and the two halves (written once, kept under `folder`)."""
    parts = {"one": (0, samples), "a": (0, samples // 2), "b": (samples // 2, samples)}
    for name, (start, stop) in parts.items():
        path = folder / name
        if (path / "dlpipe.json").exists():
            continue
        log(f"writing {name}: {stop - start} samples")
        with dlpipe.DatasetWriter(
            out=str(path), format="lmdb", classes=SHAPE_CLASSES, overwrite=True
        ) as writer:
            for sample in synthetic_samples(stop - start, start=start):
                writer.write("train", sample)
    return str(folder / "one"), [str(folder / "a"), str(folder / "b")]


def epoch_rates(loader: Any) -> tuple[float, float]:
    """Samples per second and per CPU-second of this process, of one epoch of `loader`."""
    start, cpu, count = time.perf_counter(), time.process_time(), 0
    for batch in loader:
        count += len(batch) if isinstance(batch[0], dict) else len(batch[0])  # raw: dicts
    return count / (time.perf_counter() - start), count / (time.process_time() - cpu)


def measure(one: str, halves: list[str], pipeline: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Median samples/s of each loader over `rounds` epochs, the two alternating."""
    config = dlpipe.LoaderConfig(batch_size=64, seed=1, **pipeline)
    workers = dlpipe.WorkerSettings(num_workers=0)
    loaders = {
        "one": dlpipe.make_loader(one, "train", config, workers=workers, profile=None),
        "mixture": dlpipe.make_loader(
            halves, "train", config.replace(weights=(0.5, 0.5)), workers=workers, profile=None
        ),
    }
    for loader in loaders.values():  # a first epoch warms the page cache and the readers
        epoch_rates(loader)
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    for round_ in range(rounds):
        names = list(loaders) if round_ % 2 == 0 else list(reversed(loaders))
        for name in names:
            rates[name].append(epoch_rates(loaders[name]))
    wall = {name: statistics.median(r[0] for r in values) for name, values in rates.items()}
    cpu = {name: statistics.median(r[1] for r in values) for name, values in rates.items()}
    return {
        "samples_per_s": wall,
        "samples_per_cpu_s": cpu,
        "rounds": rates,
        "overhead": 1 - cpu["mixture"] / cpu["one"],
        "overhead_wall": 1 - wall["mixture"] / wall["one"],
    }


def order_seconds(halves: list[str]) -> float:
    """Seconds to draw one epoch's mixture order (median of 5), in the main process."""
    loader = dlpipe.make_loader(halves, "train", dlpipe.LoaderConfig(weights=(0.5, 0.5)))
    sampler = loader.order
    assert isinstance(sampler, MixSampler)
    times = []
    for _ in range(5):
        sampler.next_epoch()  # (draws the last epoch's order, for its draws at the end)
        start = time.perf_counter()
        sampler.indices(sampler.epoch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# Mixing two datasets: the cost per sample",
        "",
        f"{cfg['samples']:,} synthetic JPEG samples as one lmdb dataset and as two of half each "
        "(the same bytes), read in whole epochs with 0 workers (the CPU cost of a sample), the "
        "two loaders alternating each round; median of "
        f"{cfg['rounds']} epochs each. The overhead is judged per CPU-second of this "
        "process (the machine is shared: wall-clock rates move with the other work).",
        "",
        "| pipeline | one dataset | mixture 0.5/0.5 | overhead per sample (CPU) "
        "| samples/s: one, mixture | overhead (wall) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["pipelines"].items():
        cpu, wall = row["samples_per_cpu_s"], row["samples_per_s"]
        lines.append(
            f"| {name} | {cpu['one']:,.0f} per CPU-s | {cpu['mixture']:,.0f} per CPU-s "
            f"| {100 * row['overhead']:+.1f} % | {wall['one']:,.0f}, {wall['mixture']:,.0f} "
            f"| {100 * row['overhead_wall']:+.1f} % |"
        )
    train = result["pipelines"]["train 224 px"]["overhead"]
    lines += [
        "",
        f"The mixture's epoch order ({cfg['samples']:,} positions: shares, interleaving, "
        f"permutations) takes {1000 * result['order_s']:.1f} ms per epoch in the main process.",
        "",
        f"Goal: at most {100 * GOAL:.0f} % per sample in the train pipeline: "
        f"{100 * train:+.1f} %, {met(train <= GOAL)}.",
        "",
        f"On {cfg['cpus']} usable CPUs (shared with other work); generated {result['timestamp']} "
        f"by `{cfg['command']}` in {result['total_s']:.0f} s, raw numbers in `mixing.json`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", default="/tmp/dlpipe-bench-mixing")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    began = time.perf_counter()
    one, halves = build(Path(args.work) / str(args.samples), args.samples)
    pipelines = {}
    for name, pipeline in PIPELINES.items():
        log(f"measuring {name}")
        pipelines[name] = measure(one, halves, pipeline, args.rounds)
    result = {
        "config": {
            "samples": args.samples,
            "rounds": args.rounds,
            "cpus": len(os.sched_getaffinity(0)),
            "command": "python benchmarks/mixing.py " + " ".join(argv or sys.argv[1:]),
        },
        "pipelines": pipelines,
        "order_s": order_seconds(halves),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    result["total_s"] = time.perf_counter() - began
    write_results(Path(args.out), "mixing", result, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
