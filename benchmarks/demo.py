"""Benchmark: ``dlpipe demo`` end to end, as a user runs it, against its goals, per task.

For each task asked for, it runs ``dlpipe demo --task TASK --out <fresh temp folder>`` as a
process (generate the images, convert to every format and verify, tune the loader, train the
task's small model from scratch, summary) and reports the wall-clock time and the CPU-seconds
of the whole command (the process and its children), the time of each stage (from the demo's
own lines), and the final validation score from the run's ``metrics.jsonl``: top-1
(classification: 3,200 shape images, ``shapes_cnn``), COCO mAP@.5 (detection: 1,000 scenes of
1-4 shapes in COCO's layout, ``shapes_detector``) or mIoU (segmentation: the same scenes in
Pascal VOC's layout, ``shapes_segmenter``). Goals (the loading-room and task issues): at most
3 minutes on a 2-core CPU, and at least 90 % val top-1, 0.5 mAP@.5, 0.5 mIoU. On a shared
machine the wall clock includes waiting for the CPUs, so the CPU-seconds / usable cores are
reported beside it, with the 5-minute load average. A task not run keeps its rows from the
previous ``demo.json``. The scores are also asserted by slow tests; the time is only measured
here.

Run from the repository root, in the venv where dlpipe is installed::

    python benchmarks/demo.py                        # every task: results/demo.{json,md}
    python benchmarks/demo.py --tasks detection      # one task; the others' rows kept
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dlpipe.demo_tasks import DEMO_TASKS
from dlpipe.machine import usable_cpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dlpipe_executable, generated_line, log, met, write_results  # siblings
from machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL_S = 180.0
GOALS = {"classification": 0.90, "detection": 0.5, "segmentation": 0.5}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_demo(task: str, out: Path) -> dict[str, Any]:
    """One ``dlpipe demo --task TASK`` process, timed; its stages and last epoch's score."""
    start, cpu_before = time.perf_counter(), _children_cpu_s()
    stages: dict[str, float] = {}
    proc = subprocess.Popen(
        [dlpipe_executable(), "demo", "--task", task, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.match(r"^(\d)/4 ", line):
            stages[line.strip()[:60]] = time.perf_counter() - start
        log(line.rstrip())
    code = proc.wait()
    total = time.perf_counter() - start
    cpu_s = _children_cpu_s() - cpu_before
    load_5min = os.getloadavg()[1]  # other processes' share of the CPUs meanwhile
    if code != 0:
        raise RuntimeError(f"dlpipe demo --task {task} failed ({code}):\n{proc.stderr.read()}")  # type: ignore[union-attr]
    epochs = [
        json.loads(line)
        for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
        if '"event": "epoch"' in line
    ]
    metric = DEMO_TASKS[task].metric
    return {
        "total_s": total,
        "cpu_s": cpu_s,
        "load_5min": load_5min,
        "cpus": usable_cpus(),
        "stage_done_at_s": stages,
        "epochs": len(epochs),
        "metric": metric,
        "score": epochs[-1][metric],
        "scores": [e[metric] for e in epochs],
        "samples_per_s": [e["samples_per_s"] for e in epochs],
        "data_wait": [e["data_wait"] for e in epochs],
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),  # torch's threads, when set
    }


def _score(task: str, value: float) -> str:
    return f"{value:.3f}" if task == "detection" else f"{100 * value:.1f} %"


def _task_rows(task: str, r: dict[str, Any]) -> list[str]:
    goal, label = GOALS[task], DEMO_TASKS[task].metric_label
    per_core = r["cpu_s"] / r["cpus"]
    lines = [
        f"## `dlpipe demo --task {task}`",
        "",
        f"Run on {r['timestamp']}.",
        "",
        "| measure | value | goal | verdict |",
        "|---|---:|---:|---|",
        f"| wall-clock, whole command | {r['total_s']:.0f} s | <= {GOAL_S:.0f} s | "
        f"{met(r['total_s'] <= GOAL_S)} |",
        f"| CPU-seconds / {r['cpus']} cores (the time on an idle machine) | "
        f"{per_core:.0f} s ({r['cpu_s']:.0f} CPU-s) | <= {GOAL_S:.0f} s | "
        f"{met(per_core <= GOAL_S)} |",
        f"| {label} after {r['epochs']} epochs | {_score(task, r['score'])} | "
        f">= {_score(task, goal)} | {met(r['score'] >= goal)} |",
        "",
        "| stage (line the demo printed) | done at |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {at:.0f} s |" for name, at in r["stage_done_at_s"].items()]
    scores = ", ".join(_score(task, x) for x in r["scores"])
    per_epoch = f"{label} per epoch: {scores}. " if len(r["scores"]) == r["epochs"] else ""
    rates = ", ".join(f"{x:.0f}" for x in r["samples_per_s"])
    waits = ", ".join(f"{100 * x:.0f} %" for x in r["data_wait"])
    lines += [
        "",
        f"{per_epoch}Training samples/s per epoch: {rates}; share of step "
        f"time waiting for data: {waits}. 5-minute load average at the end: "
        f"{r['load_5min']:.1f} (above the core count, other processes shared the CPUs and the "
        "wall clock waited for them)."
        + (
            f" Run with OMP_NUM_THREADS={r['omp_num_threads']} (one torch thread: on a loaded "
            "machine two threads wait for each other's turn on the cores)."
            if r.get("omp_num_threads")
            else ""
        ),
        "",
    ]
    return lines


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# `dlpipe demo` end to end",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpu_count']} CPUs, torch {m['torch']}.",
        "",
    ]
    for task, r in result["demos"].items():
        lines += _task_rows(task, r)
    return "\n".join(lines)


def _previous() -> dict[str, dict[str, Any]]:
    """The rows of the last ``demo.json`` (an older file's one ``demo`` is classification)."""
    path = RESULTS_DIR / "demo.json"
    if not path.is_file():
        return {}
    old = json.loads(path.read_text())
    demos = old.get("demos") or {"classification": old["demo"]}
    for row in demos.values():
        row.setdefault("timestamp", old["timestamp"])
        row.setdefault("metric", "top1")
        row.setdefault("score", row.get("top1"))
        row.setdefault("scores", [row["score"]])
    return dict(demos)


def _command() -> str:
    """The command line that made the results, with the torch thread count when set."""
    threads = os.environ.get("OMP_NUM_THREADS")
    return " ".join([*([f"OMP_NUM_THREADS={threads}"] if threads else []), "python",
                     "benchmarks/demo.py", *sys.argv[1:]])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=tuple(DEMO_TASKS), default=list(DEMO_TASKS))
    args = parser.parse_args()
    demos = _previous()
    start = time.perf_counter()
    for task in args.tasks:
        with tempfile.TemporaryDirectory(prefix="dlpipe-demo-bench-") as tmp:
            demos[task] = run_demo(task, Path(tmp) / "demo")
        demos[task]["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"command": _command(), "json_name": "demo.json"},
        "machine": machine_info(torch=torch.__version__),
        "demos": {task: demos[task] for task in DEMO_TASKS if task in demos},
        "total_s": time.perf_counter() - start,
    }
    write_results(RESULTS_DIR, "demo", result, markdown)


if __name__ == "__main__":
    main()
