"""Benchmark: ``dlpipe.loading.tune.bench_loader``'s search against an exhaustive grid.

On the photo-like JPEG corpus from ``benchmarks/corpus.py`` (default 800 images, cached under
``/tmp/dlpipe-bench-corpus/``), converted once to one format (hdf5 by default) with
``dlpipe convert``, this times

1. the tuner: ``dlpipe.loading.tune.bench_loader(BenchConfig(path=path,
   loader=LoaderConfig(batch_size=64, image_size=224), budget_s=B))`` (stage measurement +
   hill-climb of worker processes, then threads, then prefetch, all within B seconds), and
2. the exhaustive grid: ``dlpipe.loading.tune_search.run_trial`` for every ``num_workers`` in 0..4 x
   ``prefetch_factor`` in {2, 4, 8} (prefetch only when workers > 0) on worker processes,
   and every thread count in 1..4 x the same prefetch on the thread engine (25 trials),
   each measured for `GRID_TRIAL_S` seconds,

and reports the tuner's choice and rate, the grid's best and rate, their ratio (also with the
tuner's choice as the grid measured it, so both sides of the ratio come from the same pass),
and the time ratio. Goal: >= 0.95x the grid's best in <= 25 % of its time.

Run from the repository root, in the venv where dlpipe is installed (~2 min on 2 cores)::

    python benchmarks/tune.py                 # writes benchmarks/results/tune.{json,md}
    python benchmarks/tune.py --quick         # 200 images, budget 10 s: tune_quick.*
    python benchmarks/tune.py --format lmdb --budget 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import convert_corpus, generated_line, log, met  # sibling script
from corpus import DEFAULT_CORPUS, cached_corpus  # siblings
from machine import machine_info as shared_machine_info

from dlpipe.loading.config import LoaderConfig, WorkerSettings
from dlpipe.loading.tune import bench_loader
from dlpipe.loading.tune_search import Trial, run_trial
from dlpipe.loading.tune_stages import BenchConfig

FORMATS = ("wds", "lmdb", "hdf5")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GRID_WORKERS = (0, 1, 2, 3, 4)
GRID_PREFETCH = (2, 4, 8)
GOAL_RATE = 0.95
GOAL_TIME = 0.25


GRID_TRIAL_S = 2.0  # each grid trial's measuring time (the tuner's share its budget)
SETTINGS = ("engine", "num_workers", "prefetch_factor", "pin_memory")


def settings(trial: Trial | dict[str, Any]) -> tuple[str, int, int | None]:
    d = trial if isinstance(trial, dict) else trial.to_json()
    return d["engine"], d["num_workers"], d["prefetch_factor"]


def run_tuner(config: BenchConfig) -> dict[str, Any]:
    start = time.perf_counter()
    report = bench_loader(config)
    seconds = time.perf_counter() - start
    assert report.best is not None
    log(
        f"  tuner: {seconds:.1f} s, {len(report.trials)} trials, best "
        f"workers={report.best.settings.num_workers} "
        f"prefetch={report.best.settings.prefetch_factor} "
        f"{report.best.samples_per_s:.0f} samples/s"
    )
    return {"seconds": seconds, "report": report.to_json(), "advice": report.advice}


def run_grid(config: BenchConfig, seconds: float) -> dict[str, Any]:
    start = time.perf_counter()
    trials = []
    grid = [("processes", w, p) for w in GRID_WORKERS for p in (GRID_PREFETCH if w else (None,))]
    grid += [("threads", w, p) for w in GRID_WORKERS if w for p in GRID_PREFETCH]
    for engine, workers, prefetch in grid:
        t0 = time.perf_counter()
        settings = WorkerSettings(num_workers=workers, prefetch_factor=prefetch, engine=engine)
        trial = run_trial(config, Trial(settings), seconds)
        row = {**trial.to_json(), "trial_s": time.perf_counter() - t0}
        trials.append(row)
        log(
            f"  grid {engine} workers={workers} prefetch={prefetch}: "
            f"{trial.samples_per_s:.0f} samples/s ({row['trial_s']:.1f} s)"
        )
    best = max(trials, key=lambda t: t["samples_per_s"])
    return {"seconds": time.perf_counter() - start, "trials": trials, "best": best}


def summarise(tuner: dict[str, Any], grid: dict[str, Any]) -> dict[str, Any]:
    chosen = tuner["report"]["best"]
    best = grid["best"]
    same = next(t for t in grid["trials"] if settings(t) == settings(chosen))
    rate_ratio = chosen["samples_per_s"] / best["samples_per_s"]
    same_pass_ratio = same["samples_per_s"] / best["samples_per_s"]
    time_ratio = tuner["seconds"] / grid["seconds"]
    return {
        "tuner_choice": {k: chosen[k] for k in SETTINGS},
        "tuner_rate": chosen["samples_per_s"],
        "tuner_s": tuner["seconds"],
        "tuner_trials": len(tuner["report"]["trials"]),
        "grid_best": {k: best[k] for k in SETTINGS},
        "grid_rate": best["samples_per_s"],
        "grid_s": grid["seconds"],
        "grid_trials": len(grid["trials"]),
        "grid_rate_of_tuner_choice": same["samples_per_s"],
        "rate_ratio": rate_ratio,
        "rate_ratio_same_pass": same_pass_ratio,
        "time_ratio": time_ratio,
        "rate_goal": GOAL_RATE,
        "time_goal": GOAL_TIME,
        "rate_met": rate_ratio >= GOAL_RATE,
        "rate_met_same_pass": same_pass_ratio >= GOAL_RATE,
        "time_met": time_ratio <= GOAL_TIME,
    }


def fmt_settings(d: dict[str, Any]) -> str:
    return f"{d['engine']}={d['num_workers']}, prefetch={d['prefetch_factor']}"


def markdown(result: dict[str, Any]) -> str:
    m, c, cfg, s = result["machine"], result["corpus"], result["config"], result["summary"]
    tuner, grid = result["tuner"], result["grid"]

    lines = [
        "# `dlpipe.loading.tune.bench_loader` against an exhaustive grid",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"no GPU used, Python {m['python']}, torch {m['torch']}, dlpipe {m['dlpipe']}.",
        "",
        f"Corpus (`benchmarks/corpus.py`, seed {c['seed']}): {c['images']} photo-like JPEGs, "
        f"{c['total_bytes'] / 1e6:.1f} MB, mean {c['mean_bytes'] / 1e3:.1f} KB"
        f"{' (reduced from the usual 1,500 to keep the run short)' if c['images'] < 1500 else ''}"
        f", converted to {cfg['format']} in {result['convert_s']:.1f} s. Batch 64, 224 px "
        f"train transform. Tuner budget {cfg['budget_s']:g} s (its trials share it); each "
        f"grid trial measures for {cfg['trial_s']:g} s. One run of each.",
        "",
        "| | settings | samples/s | trials | seconds |",
        "|---|---|---:|---:|---:|",
        f"| tuner (`bench_loader`) | {fmt_settings(s['tuner_choice'])} | {s['tuner_rate']:,.0f} "
        f"| {s['tuner_trials']} (+ stages) | {s['tuner_s']:.1f} |",
        f"| grid best (`run_trial` x {s['grid_trials']}) | {fmt_settings(s['grid_best'])} "
        f"| {s['grid_rate']:,.0f} | {s['grid_trials']} | {s['grid_s']:.1f} |",
        f"| grid's own measurement of the tuner's choice | {fmt_settings(s['tuner_choice'])} "
        f"| {s['grid_rate_of_tuner_choice']:,.0f} | - | - |",
        "",
        f"- Rate: tuner / grid best = **{s['rate_ratio']:.3f}x** (goal >= {s['rate_goal']}x): "
        f"{met(s['rate_met'])}; with the grid's own measurement of the tuner's choice "
        f"{s['rate_ratio_same_pass']:.3f}x: {met(s['rate_met_same_pass'])}.",
        f"- Time: tuner / grid = **{s['time_ratio']:.2f}** (goal <= {s['time_goal']:.2f}): "
        f"{met(s['time_met'])}.",
        f"- Tuner's advice: {tuner['advice']}",
        "",
        "## Tuner trials",
        "",
        "| engine | workers | prefetch | samples/s | CPU µs/sample | first batch s "
        "| worker PSS MB | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in tuner["report"]["trials"]:
        lines.append(
            f"| {t['engine']} | {t['num_workers']} | {t['prefetch_factor']} "
            f"| {t['samples_per_s']:,.0f} | {t['cpu_us_per_sample']:,.0f} "
            f"| {t['first_batch_s']:.2f} | {t['worker_rss_bytes'] / 1e6:.0f} "
            f"| {t['skipped'] or ''} |"
        )
    st = tuner["report"]["stages"]
    lines += [
        "",
        f"Stages (one process, samples/s after each): read {st['read']:,.0f}, decode "
        f"{st['decode']:,.0f}, transform {st['transform']:,.0f}, collate {st['collate']:,.0f}.",
        "",
        "## Grid trials",
        "",
        "| engine | workers | prefetch | samples/s | CPU µs/sample | trial s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in grid["trials"]:
        lines.append(
            f"| {t['engine']} | {t['num_workers']} | {t['prefetch_factor']} "
            f"| {t['samples_per_s']:,.0f} | {t['cpu_us_per_sample']:,.0f} | {t['trial_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, help="corpus size (default 800; --quick 200)")
    parser.add_argument("--quick", action="store_true", help="small corpus, budget 10 s")
    parser.add_argument("--budget", type=float, help="tuner budget_s (default 20; --quick 10)")
    parser.add_argument("--format", choices=FORMATS, default="hdf5", help="default hdf5")
    parser.add_argument("--corpus", help=f"corpus folder (default {DEFAULT_CORPUS}/<images>-s0)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    args.images = args.images or (200 if args.quick else 800)
    args.budget = args.budget or (10.0 if args.quick else 20.0)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    started = time.perf_counter()
    root, corpus = cached_corpus(args.corpus, args.images, args.seed)
    log(f"corpus {root} ({'reused' if corpus['reused'] else 'made'})")
    work = tempfile.mkdtemp(prefix="dlpipe-bench-tune-")
    try:
        path = os.path.join(work, args.format)
        convert_s = convert_corpus(root, args.format, path)
        loader = LoaderConfig(batch_size=64, image_size=224)
        config = BenchConfig(path=path, loader=loader, budget_s=args.budget)
        seconds = GRID_TRIAL_S
        tuner = run_tuner(config)
        grid = run_grid(config, seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from dlpipe import __version__ as dlpipe_version

    stem = "tune_quick" if args.quick else "tune"
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "images": args.images,
            "format": args.format,
            "budget_s": args.budget,
            "trial_s": seconds,
            "grid_workers": list(GRID_WORKERS),
            "grid_prefetch": list(GRID_PREFETCH),
            "quick": args.quick,
            "command": "python benchmarks/tune.py" + (" " + " ".join(argv) if argv else ""),
            "json_name": f"{stem}.json",
        },
        "machine": shared_machine_info(torch=torch.__version__, dlpipe=dlpipe_version),
        "corpus": {k: v for k, v in corpus.items() if k not in ("per_class", "reused")},
        "convert_s": convert_s,
        "tuner": tuner,
        "grid": grid,
        "summary": summarise(tuner, grid),
        "total_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
