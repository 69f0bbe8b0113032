"""Benchmark: ``dlpipe train``'s time per step against a minimal hand-written loop, on CPU.

The same model, data and steps go through both contenders, in one process and one run:

a. **hand-written loop**: ``dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(
   batch_size=32, image_size=64, seed=0), workers=1)`` (the call the trainer makes),
   ``torchvision.models.get_model("resnet18", weights=None, num_classes=8)``,
   ``torch.optim.SGD`` with dlpipe's settings (lr 0.1 x 32/256, momentum 0.9, weight decay
   1e-4 on weights, none on biases and norms), and per batch: ``x = dlpipe.normalize(
   images)``, ``loss = F.cross_entropy(model(x), labels)``, ``zero_grad()``, ``backward()``,
   ``step()``, ``loss.item()`` (the trainer reads the loss every step too, so the minimal
   loop pays for it as well);
b. **dlpipe train**: ``dlpipe.cli.main(["train", DATA, "--model", "resnet18", "--epochs", "1",
   "--batch-size", "32", "--image-size", "64", "--num-workers", "1", "--lr", "0.0125",
   "--warmup-epochs", "0", "--log-every", "1", "--val-split", "", "--precision", "fp32",
   "--resume", "none", "--out", RUN])`` in-process (the console output is captured).

Data: ``dlpipe.synthetic`` shapes (8 classes, JPEGs of 64-128 px) written once to lmdb with
``dlpipe.DatasetWriter``, exactly one epoch of ``warm-up + measured`` steps (so the trainer
writes its epoch record, with ``data_wait``, without ``--max-steps``).

Per-step time: each contender stamps ``time.time()`` after every step (dlpipe: the ``time``
of each ``step`` line of ``metrics.jsonl``, hence ``--log-every 1``; the loop: after
``loss.item()``); the figure is (stamp of step K+M - stamp of step K) / M, so process
start-up, model build, worker start and the first K steps are left out, and the checkpoint
at the end of the epoch comes after the window. Rounds alternate (loop, dlpipe, loop, ...),
10 of each, 10 + 30 steps a run (many short runs: runs differ more than steps do); the
report gives the median and the min over rounds, and overhead = dlpipe / loop - 1 on the
medians. Goal: <= 3 % per step. Both use the same ``torch.set_num_threads`` (default:
torch's, one per core).

The machine may be shared: before each run the benchmark waits (at most ``--max-wait`` s)
until other processes use at most 3 % of the CPUs (1 s samples of ``/proc/stat``), and it
measures the share they used during the run (all CPU time less this process's and its loader
workers'); a run during which they used more is run again (at most ``--retries`` times),
and left out if it stays so. The decision depends only on the other processes, never on the
result.

Whole runs of the same contender differ by several per cent on a small shared machine, so
two finer checks follow. Step by step: three models (same init) take turns one step at a
time on the same batches held in memory: the loop's step, a second copy of it (the control,
which shows the resolution) and dlpipe's own ``StepRunner.run``, 60 steps each. Alone: the
work the trainer's step does that the loop does not (gradient norm, the agreement tensor's
``.tolist()``, the scheduler, one metrics line), timed call by call.

Run from the repository root, in the venv where dlpipe is installed (~3-4 min on 2 cores)::

    python benchmarks/train_overhead.py             # writes results/train_overhead.{json,md}
    python benchmarks/train_overhead.py --quick     # 5 + 20 steps, 1 round: *_quick.*
    python benchmarks/train_overhead.py --rounds 20 --steps 50 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import generated_line, log, met, write_results  # sibling script
from machine import machine_info as shared_machine_info

import dlpipe
from dlpipe.cli import main as dlpipe_main
from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.loader import make_loader
from dlpipe.loading.transforms import normalize
from dlpipe.synthetic import SHAPE_CLASSES, synthetic_samples

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODEL = "resnet18"
IMAGE_SIZE = 64
BATCH = 32
WORKERS = 1
LR = 0.1 * BATCH / 256  # dlpipe's default for SGD, given explicitly to both
MOMENTUM = 0.9  # dlpipe's default
WEIGHT_DECAY = 1e-4  # dlpipe's default for SGD
GOAL_OVERHEAD_PCT = 3.0
QUIET_SHARE = 0.03  # other processes' CPU share that counts as quiet (a 1 s burst matters)
HAND, DLPIPE = "hand-written loop", "dlpipe train"

Snapshot = tuple[tuple[int, int] | None, float]  # see `cpu_snapshot`


# ----------------------------------------------------------------------------------- data


def make_dataset(path: str, samples: int) -> float:
    """``samples`` synthetic shapes in an lmdb train split; returns the seconds it took."""
    start = time.perf_counter()
    with dlpipe.DatasetWriter(out=path, format="lmdb", classes=SHAPE_CLASSES) as writer:
        for sample in synthetic_samples(samples, seed=0):
            writer.write("train", sample)
    return time.perf_counter() - start


def make_train_loader(path: str) -> Any:
    config = LoaderConfig(batch_size=BATCH, transform="train", image_size=IMAGE_SIZE, seed=0)
    return make_loader(path, "train", config, workers=WORKERS, rank=0, world_size=1)


# ----------------------------------------------------------------------------------- contenders


def sgd(model: torch.nn.Module) -> torch.optim.SGD:
    """dlpipe's SGD settings: no weight decay on biases and normalisation weights."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": no_decay},
    ]
    return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, weight_decay=0.0)


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(MODEL, weights=None, num_classes=len(SHAPE_CLASSES))


def hand_step(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The minimal correct training step, with its own SGD; returns the loss."""
    opt = sgd(model)

    def step(images: torch.Tensor, labels: torch.Tensor) -> float:
        x = normalize(images)
        loss = F.cross_entropy(model(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def run_hand(path: str) -> dict[str, Any]:
    """The minimal correct loop over one epoch; a time.time() stamp after every step."""
    started = time.perf_counter()
    torch.manual_seed(0)
    loader = make_train_loader(path)
    step = hand_step(new_model().train())
    stamps, waits, losses = [], [], []
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        batch = next(batches, None)
        waits.append(time.perf_counter() - t0)
        if batch is None:
            break
        losses.append(step(*batch))
        stamps.append(time.time())
    del batches, loader
    return {"stamps": stamps, "waits": waits[:-1], "losses": losses, "wall_s": _since(started)}


def run_dlpipe(path: str, run_dir: str) -> dict[str, Any]:
    """``dlpipe train`` in-process for one epoch; stamps from its metrics.jsonl step lines."""
    argv = ["train", path, "--model", MODEL, "--epochs", "1", "--batch-size", str(BATCH)]
    argv += ["--image-size", str(IMAGE_SIZE), "--num-workers", str(WORKERS), "--lr", str(LR)]
    argv += ["--warmup-epochs", "0", "--log-every", "1", "--val-split", "", "--seed", "0"]
    argv += ["--precision", "fp32", "--resume", "none", "--out", run_dir]
    started = time.perf_counter()
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        code = dlpipe_main(argv)
    wall_s = _since(started)
    if code != 0:
        raise RuntimeError(f"dlpipe {' '.join(argv)} exited {code}:\n{console.getvalue()}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), "a step was not logged"
    epoch = next((r for r in records if r["event"] == "epoch"), None)
    return {
        "stamps": [r["time"] for r in steps],
        "losses": [r["loss"] for r in steps],
        "epoch": epoch,
        "wall_s": wall_s,
    }


def _since(start: float) -> float:
    return time.perf_counter() - start


def measure(run: dict[str, Any], warmup: int, steps: int) -> dict[str, Any]:
    """Per-step seconds between the stamps of step `warmup` and step `warmup + steps`."""
    stamps = run.pop("stamps")
    if len(stamps) < warmup + steps:
        raise RuntimeError(f"only {len(stamps)} steps ran; {warmup + steps} were needed")
    window = stamps[warmup - 1 : warmup + steps]
    durations = [b - a for a, b in itertools.pairwise(window)]
    out = {
        "step_ms": [round(1e3 * d, 2) for d in durations],
        "step_s": (window[-1] - window[0]) / steps,
        "median_step_s": statistics.median(durations),
        "max_step_s": max(durations),
        "loss_first": run["losses"][0],
        "loss_last": run["losses"][-1],
        **{k: v for k, v in run.items() if k not in ("losses", "waits")},
    }
    if "waits" in run:  # the wait for batches warmup+1 .. warmup+steps
        out["data_wait"] = sum(run["waits"][warmup : warmup + steps]) / (out["step_s"] * steps)
    return out


def run_rounds(path: str, work: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Alternate the contenders; a run that other processes contended is run again, and left
    out if it stays contended (all of a contender's runs are used if none was quiet)."""
    rows = []
    for index in range(args.rounds):
        for name in (HAND, DLPIPE):
            for attempt in range(args.retries + 1):
                row = run_once(path, work, name, (index, attempt), args)
                row["used"] = (row["others_during"] or 0.0) <= QUIET_SHARE
                rows.append(row)
                again = "run again" if attempt < args.retries else "left out"
                log(
                    f"  round {index + 1} {name:<18} {1e3 * row['step_s']:7.1f} ms/step (median "
                    f"step {1e3 * row['median_step_s']:.1f} ms, run {row['wall_s']:.1f} s, "
                    f"others' CPU {_pct(row['others_during'])})"
                    + ("" if row["used"] else f": contended, {again}")
                )
                if row["used"]:
                    break
    for name in (HAND, DLPIPE):
        mine = [r for r in rows if r["contender"] == name]
        if not any(r["used"] for r in mine):
            for r in mine:
                r["used"] = True
    return rows


def run_once(
    path: str, work: str, name: str, where: tuple[int, int], args: argparse.Namespace
) -> dict[str, Any]:
    """One run of one contender, after waiting for a quiet machine; its row of numbers."""
    gc.collect()
    others_before, waited_s = wait_for_quiet(args.max_wait)
    before = cpu_snapshot()
    if name == HAND:
        run = run_hand(path)
    else:
        run = run_dlpipe(path, os.path.join(work, "run-{}-{}".format(*where)))
    gc.collect()  # a finished run's objects (and loader workers) go before the snapshot
    row: dict[str, Any] = {"round": where[0] + 1, "attempt": where[1] + 1, "contender": name}
    row.update(others_before=others_before, waited_s=waited_s)
    row["others_during"] = others_share(before, cpu_snapshot())
    row.update(measure(run, args.warmup, args.steps))
    return row


# ----------------------------------------------------------------------------------- the machine


def cpu_snapshot() -> Snapshot:
    """((busy, total) jiffies of all CPUs from /proc/stat, or None off Linux), and the CPU s
    of this process and its children (loader workers; reaped, running or zombie)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user .. steal
        jiffies: tuple[int, int] | None = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    except OSError:
        jiffies = None
    t = os.times()
    return jiffies, t.user + t.system + t.children_user + t.children_system + _unreaped_s()


def _unreaped_s() -> float:
    """CPU s of children not reaped yet (os.times counts a child once it is waited for)."""
    ticks = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # reaped in between
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def others_share(before: Snapshot, after: Snapshot) -> float | None:
    """The share of all CPUs that other processes used between two `cpu_snapshot`s."""
    (jiffies0, own0), (jiffies1, own1) = before, after
    if jiffies0 is None or jiffies1 is None or jiffies1[1] == jiffies0[1]:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy_s = (jiffies1[0] - jiffies0[0]) / hz - (own1 - own0)
    return max(0.0, busy_s / ((jiffies1[1] - jiffies0[1]) / hz))


def wait_for_quiet(max_wait_s: float) -> tuple[float | None, float]:
    """Wait (1 s samples, at most `max_wait_s`) until other processes use <= QUIET_SHARE of
    the CPUs; returns the last share seen and the seconds waited."""
    start = time.perf_counter()
    while True:
        before = cpu_snapshot()
        time.sleep(1.0)
        share = others_share(before, cpu_snapshot())
        waited = time.perf_counter() - start
        if share is None or share <= QUIET_SHARE or waited >= max_wait_s:
            return share, waited


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


# ----------------------------------------------------------------------------------- step by step


def runner_step(model: torch.nn.Module, steps: int) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """dlpipe's own step (`StepRunner.run`) as `dlpipe train` builds it for this run."""
    from dlpipe.train.config import OptimConfig
    from dlpipe.train.distributed import init_distributed
    from dlpipe.train.optim import build_optimizer, build_scheduler
    from dlpipe.train.step import StepRunner, resolve_precision

    opt = build_optimizer(model, OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY))
    scheduler = build_scheduler(opt, warmup_steps=0, total_steps=steps)
    dist = init_distributed()
    runner = StepRunner(model, opt, scheduler, dist, resolve_precision("fp32", dist.device))
    return lambda images, labels: runner.run([(images, labels)])


def interleaved_steps(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Median seconds per step of the loop's step, a second copy of it (the control) and
    dlpipe's `StepRunner.run`, taking turns step by step on the same batches in memory, so
    drift and neighbours hit all three alike. Contended attempts are given up and rerun."""
    loader = make_train_loader(path)
    batches = list(itertools.islice(iter(loader), 4))
    del loader
    for attempt in range(args.retries + 1):
        wait_for_quiet(args.max_wait)
        result = _take_turns(batches, args.interleaved_steps, give_up=attempt < args.retries)
        if result is not None:
            return {**result, "attempts": attempt + 1}
        log("  step by step: contended, run again")
    raise AssertionError("the last attempt is never given up")


def _take_turns(batches: list[Any], steps: int, give_up: bool) -> dict[str, Any] | None:
    contenders = {
        "loop step": hand_step(new_model().train()),
        "loop step, second copy (control)": hand_step(new_model().train()),
        "dlpipe `StepRunner.run`": runner_step(new_model().train(), steps + 3),
    }
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    before = cpu_snapshot()
    for i in range(steps + 3):  # 3 warm-up turns
        images, labels = batches[i % len(batches)]
        for name in names[i % 3 :] + names[: i % 3]:  # each goes first in turn
            start = time.perf_counter()
            contenders[name](images, labels)
            if i >= 3:
                times[name].append(time.perf_counter() - start)
        if give_up and i % 10 == 9 and (others_share(before, cpu_snapshot()) or 0) > QUIET_SHARE:
            return None
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    log("  step by step: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in medians.items()))
    return {
        "median_s": medians,
        "steps": steps,
        "others_during": others_share(before, cpu_snapshot()),
    }


# ----------------------------------------------------------------------------------- components


def _per_call_s(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def component_costs(work: str, repeats: int) -> dict[str, float]:
    """Seconds per call of what dlpipe's step does beyond the hand loop, each alone."""
    from dlpipe.train.optim import build_scheduler
    from dlpipe.train.reporting import RunLogger

    model = new_model()
    opt = sgd(model)
    images = torch.randint(0, 256, (BATCH, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8)
    labels = torch.arange(BATCH) % len(SHAPE_CLASSES)
    loss = F.cross_entropy(model(normalize(images)), labels, reduction="sum")
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    scheduler = build_scheduler(opt, warmup_steps=0, total_steps=1 << 30)
    loss_sum = torch.zeros((), dtype=torch.float64)

    def agreement() -> None:  # what StepRunner does with one rank (the all-reduce is a no-op)
        loss_sum.zero_()
        loss_sum.add_(loss.detach())
        _ = loss / BATCH
        torch.tensor([float(loss_sum), BATCH, 0.0, 0.0], dtype=torch.float64).tolist()

    values = {"loss": 1.0, "lr": LR, "grad_norm": 1.0, "samples": BATCH}
    with RunLogger(
        os.path.join(work, "logger"), enabled=True, classes=list(SHAPE_CLASSES)
    ) as logger:
        step = iter(range(1, 1 << 30))
        costs = {
            "gradient norm: `float(get_total_norm(grads))`": _per_call_s(
                lambda: float(torch.nn.utils.get_total_norm(grads)), repeats
            ),
            "loss sum, `/ count`, agreement tensor `.tolist()`": _per_call_s(agreement, repeats),
            "`scheduler.step()` (LambdaLR, cosine)": _per_call_s(scheduler.step, repeats),
            "`RunLogger.step` (metrics.jsonl line + 4 TensorBoard scalars)": _per_call_s(
                lambda: logger.step(next(step), values), repeats
            ),
        }
    return costs


# ----------------------------------------------------------------------------------- report


def summarise(
    all_rows: list[dict[str, Any]], interleaved: dict[str, Any], costs: dict[str, float]
) -> dict[str, Any]:
    rows = [r for r in all_rows if r["used"]]
    per: dict[str, dict[str, Any]] = {}
    for name in (HAND, DLPIPE):
        mine = [r for r in rows if r["contender"] == name]
        steps = [r["step_s"] for r in mine]
        per[name] = {
            "step_s_median": statistics.median(steps),
            "step_s_min": min(steps),
            "median_step_s_median": statistics.median(r["median_step_s"] for r in mine),
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
            "runs": len(steps),
            "spread_pct": 100 * (max(steps) / min(steps) - 1),
        }
    hand, dl = per[HAND], per[DLPIPE]
    overhead = 100 * (dl["step_s_median"] / hand["step_s_median"] - 1)
    epochs = [r["epoch"] for r in rows if r["contender"] == DLPIPE and r.get("epoch")]
    others = [r["others_during"] for r in rows if r["others_during"] is not None]
    step_s = {(r["round"], r["contender"]): r["step_s"] for r in rows}
    paired = [
        step_s[i, DLPIPE] / step_s[i, HAND]
        for i, name in step_s
        if name == HAND and (i, DLPIPE) in step_s
    ]
    return {
        "per_contender": per,
        "overhead_pct": overhead,
        "overhead_pct_min": 100 * (dl["step_s_min"] / hand["step_s_min"] - 1),
        "overhead_pct_median_step": 100
        * (dl["median_step_s_median"] / hand["median_step_s_median"] - 1),
        "overhead_pct_paired": 100 * (statistics.median(paired) - 1) if paired else None,
        "rounds_paired": len(paired),
        "goal_pct": GOAL_OVERHEAD_PCT,
        "met": overhead <= GOAL_OVERHEAD_PCT,
        "dlpipe_data_wait": statistics.median(e["data_wait"] for e in epochs) if epochs else None,
        "hand_data_wait": statistics.median(r["data_wait"] for r in rows if "data_wait" in r),
        "runs_contended": sum(1 for r in all_rows if not r["used"]),
        "others_during_max": max(others) if others else None,
        "others_during_median": statistics.median(others) if others else None,
        "interleaved_pct": {
            name: 100 * (seconds / next(iter(interleaved["median_s"].values())) - 1)
            for name, seconds in interleaved["median_s"].items()
        },
        "components_s": costs,
        "components_total_s": sum(costs.values()),
    }


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    per = s["per_contender"]
    first = {r["contender"]: r["loss_first"] for r in result["rows"] if r["used"]}
    lines = [
        "# `dlpipe train` against a minimal hand-written training loop (CPU)",
        "",
        generated_line(result),
        "",
        *_setup(result),
        "",
        "| contender | ms/step (median of rounds) | ms/step (min) | median single step ms "
        "| run s incl. start-up (median) | loss at step 1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in (HAND, DLPIPE):
        p = per[name]
        lines.append(
            f"| {name} | {1e3 * p['step_s_median']:.1f} | {1e3 * p['step_s_min']:.1f} "
            f"| {1e3 * p['median_step_s_median']:.1f} | {p['wall_s_median']:.1f} "
            f"| {first[name]:.4f} |"
        )
    lines += ["", *_findings(s), "", *_interleaved(result), "", *_components(result)]
    lines += ["", *_rounds(result["rows"])]
    return "\n".join(lines) + "\n"


def _setup(result: dict[str, Any]) -> list[str]:
    m, cfg = result["machine"], result["config"]
    return [
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"no GPU used, Python {m['python']}, torch {m['torch']}, torchvision {m['torchvision']}, "
        f"dlpipe {m['dlpipe']}; `torch.set_num_threads({cfg['threads']})` for both.",
        "",
        f"Same for both: {cfg['samples']} synthetic shapes JPEGs (`dlpipe.synthetic`, 64-128 px) "
        f"in lmdb (written in {result['dataset_s']:.1f} s), one epoch of {cfg['warmup']} + "
        f"{cfg['steps']} steps; `dlpipe.make_loader(..., LoaderConfig(batch_size={BATCH}, "
        f"image_size={IMAGE_SIZE}, seed=0), workers={WORKERS})` (train transform, uint8, "
        "`dlpipe.normalize`); "
        f"`{MODEL}` from torchvision, {len(SHAPE_CLASSES)} classes, random init (seed 0), fp32; "
        f"SGD lr {LR:g}, momentum {MOMENTUM}, weight decay {WEIGHT_DECAY:g} (not on biases "
        f"and norms); cross-entropy. The loop also calls `loss.item()` each step, as dlpipe "
        f"does. `dlpipe train` runs in-process through `dlpipe.cli.main` with `--log-every 1` "
        f'(so every step is stamped; the default is 20), `--val-split ""`, `--warmup-epochs '
        f"0` (its cosine schedule still runs; the loop keeps lr constant).",
        "",
        f"Per-step time = (stamp of step {cfg['warmup'] + cfg['steps']} - stamp of step "
        f"{cfg['warmup']}) / {cfg['steps']}: wall clock, start-up and the first {cfg['warmup']} "
        f"steps left out. {cfg['rounds']} round(s), alternating loop, dlpipe; before each run "
        f"the benchmark waits (up to {cfg['max_wait_s']:g} s) until other processes use at most "
        f"{100 * QUIET_SHARE:.0f} % of the CPUs, runs again (up to {cfg['retries']} times) a "
        "run during which they used more, and leaves it out if it stays contended; the figures "
        "are from the runs marked used below.",
    ]


def _findings(s: dict[str, Any]) -> list[str]:
    per = s["per_contender"]
    dl_wait = s["dlpipe_data_wait"]
    dl_wait_text = (
        f"dlpipe's epoch record `data_wait` {100 * dl_wait:.1f} % (whole epoch, first batch "
        "included)"
        if dl_wait is not None
        else "dlpipe wrote no epoch record"
    )
    lines = [
        f"- Overhead per step, dlpipe / loop - 1 on the medians: **{s['overhead_pct']:+.1f} %** "
        f"(goal <= {s['goal_pct']:g} %): {met(s['met'])}. On the minima "
        f"{s['overhead_pct_min']:+.1f} %; on the median single step "
        f"{s['overhead_pct_median_step']:+.1f} %"
        + (
            f"; median of the {s['rounds_paired']} complete rounds' own ratios "
            f"{s['overhead_pct_paired']:+.1f} %."
            if s["overhead_pct_paired"] is not None
            else "."
        ),
        f"- Data wait: {dl_wait_text}; the loop waited {100 * s['hand_data_wait']:.1f} % of "
        "its measured steps for batches.",
    ]
    if per[HAND]["runs"] > 1:
        lines.append(
            f"- Noise: runs of the same contender differ by up to {per[HAND]['spread_pct']:.1f} %"
            f" (loop) and {per[DLPIPE]['spread_pct']:.1f} % (dlpipe), slowest over fastest; an "
            "overhead smaller than that is not resolved by one run of each."
        )
    busiest = s["others_during_max"]
    if busiest is not None:
        lines.append(
            f"- Other processes used up to {_pct(busiest)} of the CPUs during a used run "
            f"(median {_pct(s['others_during_median'])}); {s['runs_contended']} contended "
            "run(s) were left out"
            + (
                "; some used runs were still contended, so those are slower and noisier than "
                "this machine alone would be."
                if busiest > QUIET_SHARE
                else "."
            )
        )
    return lines


def _interleaved(result: dict[str, Any]) -> list[str]:
    it, pct = result["interleaved"], result["summary"]["interleaved_pct"]
    lines = [
        "## dlpipe's step function against the loop's, step by step",
        "",
        f"Three models (same init), each with its own optimizer, take turns one step at a time "
        f"({it['steps']} steps each after 3 warm-up turns, the first to go rotating) on the "
        f"same 4 batches held in memory: no loader, no logging, and slow drift of the machine "
        f"hits all three alike. The second copy of the loop measures the resolution. Other "
        f"processes used {_pct(it['others_during'])} of the CPUs meanwhile (attempt "
        f"{it['attempts']}; a contended attempt is given up and run again).",
        "",
        "| step | median ms | vs loop step |",
        "|---|---:|---:|",
    ]
    for name, seconds in it["median_s"].items():
        lines.append(f"| {name} | {1e3 * seconds:.1f} | {pct[name]:+.1f} % |")
    return lines


def _components(result: dict[str, Any]) -> list[str]:
    s, cfg = result["summary"], result["config"]
    hand_s = s["per_contender"][HAND]["step_s_median"]
    lines = [
        "## What dlpipe's step does beyond the loop, each timed alone",
        "",
        f"Median of {cfg['component_repeats']} calls, on {MODEL}'s gradients after one "
        "backward pass. One process, so the trainer's all-reduce is a no-op; what is left of "
        "the agreement is the `float(loss_sum)` and `.tolist()` reads.",
        "",
        "| work per step | ms | % of a loop step |",
        "|---|---:|---:|",
    ]
    for name, seconds in s["components_s"].items():
        lines.append(f"| {name} | {1e3 * seconds:.3f} | {100 * seconds / hand_s:.2f} |")
    total = s["components_total_s"]
    lines.append(f"| **total** | {1e3 * total:.3f} | {100 * total / hand_s:.2f} |")
    return lines


def _rounds(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Every round",
        "",
        "| round | contender | ms/step | median step ms | slowest step ms | data wait "
        "| loss first → last | run s | others' CPU before / during | used |",
        "|---:|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r in rows:
        wait = r["epoch"]["data_wait"] if r.get("epoch") else r.get("data_wait")
        lines.append(
            f"| {r['round']} | {r['contender']} | {1e3 * r['step_s']:.1f} "
            f"| {1e3 * r['median_step_s']:.1f} | {1e3 * r['max_step_s']:.0f} "
            f"| {'-' if wait is None else f'{100 * wait:.1f} %'} "
            f"| {r['loss_first']:.3f} → {r['loss_last']:.3f} | {r['wall_s']:.1f} "
            f"| {_pct(r['others_before'])} / {_pct(r['others_during'])} "
            f"| {'yes' if r['used'] else 'no: contended'} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="5 + 20 steps, 1 round")
    parser.add_argument("--rounds", type=int, help="rounds of each contender (default 10)")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 30)")
    parser.add_argument("--warmup", type=int, help="steps before the window (default 10)")
    parser.add_argument("--threads", type=int, help="torch threads for both (default torch's)")
    parser.add_argument(
        "--max-wait", type=float, default=30.0, help="s to wait for a quiet machine per run"
    )
    parser.add_argument("--retries", type=int, default=3, help="reruns of a contended run")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    args.threads = args.threads or torch.get_num_threads()
    args.rounds = args.rounds or (1 if args.quick else 10)
    args.steps = args.steps or (20 if args.quick else 30)
    args.warmup = args.warmup or (5 if args.quick else 10)
    args.component_repeats = 10 if args.quick else 30
    args.interleaved_steps = 10 if args.quick else 60
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    # one epoch of exactly warmup + steps batches: drop_last cuts the rest (< 8 < BATCH)
    samples = math.ceil((args.warmup + args.steps) * BATCH / len(SHAPE_CLASSES))
    samples *= len(SHAPE_CLASSES)
    work = tempfile.mkdtemp(prefix="dlpipe-bench-train-")
    try:
        path = os.path.join(work, "shapes-lmdb")
        dataset_s = make_dataset(path, samples)
        log(f"dataset: {samples} samples in {dataset_s:.1f} s; {torch.get_num_threads()} threads")
        rows = run_rounds(path, work, args)
        interleaved = interleaved_steps(path, args)
        costs = component_costs(work, args.component_repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = "train_overhead_quick" if args.quick else "train_overhead"
    command = "python benchmarks/train_overhead.py" + (" " + " ".join(argv) if argv else "")
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "model": MODEL,
            "image_size": IMAGE_SIZE,
            "batch_size": BATCH,
            "num_workers": WORKERS,
            "lr": LR,
            "samples": samples,
            "warmup": args.warmup,
            "steps": args.steps,
            "rounds": args.rounds,
            "threads": args.threads,
            "max_wait_s": args.max_wait,
            "retries": args.retries,
            "component_repeats": args.component_repeats,
            "interleaved_steps": args.interleaved_steps,
            "quick": args.quick,
            "command": command,
            "json_name": f"{stem}.json",
        },
        "machine": shared_machine_info(
            torch=torch.__version__, torchvision=torchvision.__version__, dlpipe=dlpipe.__version__
        ),
        "dataset_s": dataset_s,
        "rows": rows,
        "interleaved": interleaved,
        "summary": summarise(rows, interleaved, costs),
        "total_s": time.perf_counter() - started,
    }
    write_results(args.out, stem, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
