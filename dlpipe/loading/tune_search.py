"""``bench-loader``'s search: worker settings hill-climbed within a time and memory budget.

`search` measures one `Trial` a setting (`run_trial`: the first batch, then windows of
samples/s until two agree, and the CPU per sample), climbing the worker ladder
(`_worker_counts`, `_climb`) for processes then threads, then prefetch, pinned memory and GPU
decode, within the time `_Budget` and the memory share `_MEMORY_SHARE`. The whole tuner is
described in `dlpipe.loading.tune`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dlpipe.errors import SplitTooSmallError
from dlpipe.loading.config import WorkerSettings
from dlpipe.loading.tune_stages import BenchConfig
from dlpipe.machine import (
    available_memory,
    cpu_seconds,
    proportional_set_size,
    usable_cpus,
    worker_limit,
)

__all__ = ["Trial", "run_trial", "search"]

_MEMORY_SHARE = 0.8


@dataclass
class Trial:
    """One worker setting the search measured, and what it measured.

    Attributes:
        settings: the `WorkerSettings` measured (the loader's own, field for field).
        samples_per_s: the throughput after the warm-up.
        worker_rss_bytes: the worker processes' memory (their proportional set size).
        skipped: why the setting was not measured (it would not fit), or None.
        first_batch_s: from ``iter()`` to the first batch: the workers' start-up.
        cpu_us_per_sample: this process's threads and its workers, while measured.
    """

    settings: WorkerSettings
    samples_per_s: float = 0.0
    worker_rss_bytes: int = 0
    skipped: str | None = None
    first_batch_s: float = 0.0
    cpu_us_per_sample: float = 0.0

    def describe(self) -> str:
        """``2 workers``, ``1 worker``, ``2 threads`` or ``the main process``."""
        count = self.settings.num_workers
        if self.settings.engine == "threads":
            return f"{count} thread{'s' * (count != 1)}"
        if count == 0:
            return "the main process"
        return f"{count} worker{'s' * (count != 1)}"

    def to_json(self) -> dict[str, Any]:
        """The settings' fields and the measurements, in one flat object."""
        measured = {k: v for k, v in dataclasses.asdict(self).items() if k != "settings"}
        return {**dataclasses.asdict(self.settings), **measured}


def _worker_rss() -> int:
    """The workers' memory (their proportional set size)."""
    children = multiprocessing.active_children()
    return proportional_set_size([child.pid for child in children if child.pid is not None])


def _batches(loader: Any) -> Iterator[Any]:
    while True:  # small datasets: keep going, epoch after epoch
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if count == 0:  # e.g. every wds reader's share is below one batch
            raise SplitTooSmallError(
                f"a pass over split {loader.dataset!r} gave no full batch; lower --batch-size"
            )


def run_trial(config: BenchConfig, trial: Trial, seconds: float) -> Trial:
    """Measure one setting: warm up, then windows until the rate is stable."""
    from dlpipe.loading.loader import make_loader

    with warnings.catch_warnings():  # more workers than cores is what a search tries
        warnings.filterwarnings(
            "ignore", message=".*(num_workers|worker processes).*", category=UserWarning
        )
        loader = make_loader(
            config.path, config.split, config=config.loader, workers=trial.settings
        )
        try:
            _measure(_batches(loader), trial, seconds)
        finally:
            loader.close()  # its workers end now, so they do not slow the next trial down
    return trial


def _measure(batches: Iterator[Any], trial: Trial, seconds: float) -> None:
    start = time.perf_counter()
    next(batches)
    trial.first_batch_s = time.perf_counter() - start
    # warm-up: every worker process started and the first prefetch; threads share each
    # batch, so one more batch warms them all (W + 1 batches of 256 at a GIL-bound 450
    # samples/s on 16 threads was 10 s a trial)
    warm_up = trial.settings.num_workers + 1 if trial.settings.engine == "processes" else 2
    for _ in range(max(2, warm_up) - 1):
        next(batches)
    trial.worker_rss_bytes = _worker_rss()
    deadline, window = time.perf_counter() + seconds, max(seconds / 4, 0.3)
    rates: list[float] = []
    samples, cpu = 0, cpu_seconds()
    while time.perf_counter() < deadline:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < window:
            images, _ = next(batches)
            count += len(images)
        if isinstance(images, torch.Tensor) and images.is_cuda:
            torch.cuda.synchronize()  # a GPU-decoded batch is done when its kernels are
        rates.append(count / (time.perf_counter() - start))
        samples += count
        if len(rates) >= 2 and abs(rates[-1] - rates[-2]) <= 0.05 * max(rates[-2], 1e-9):
            break
    trial.cpu_us_per_sample = (cpu_seconds() - cpu) / max(samples, 1) * 1e6
    trial.samples_per_s = rates[-1] if len(rates) < 2 else (rates[-1] + rates[-2]) / 2
    trial.worker_rss_bytes = max(trial.worker_rss_bytes, _worker_rss())


def _own_memory() -> int:
    """This process's memory (proportional set size): the guess at a worker's until one is
    measured."""
    return proportional_set_size([os.getpid()])


def _worker_counts(limit: int, cores: int) -> list[int]:
    """The ladder: 0, 1, 2, doubling up to the core count, the core count, then x1.5 and
    `limit` itself (2 cores, limit 4: 0-4; 16 cores, limit 32: 0, 1, 2, 4, 8, 16, 24, 32)."""
    counts, n = [0, 1, 2], 4
    while n < cores:
        counts.append(n)
        n *= 2
    n = max(cores, 3)
    while n < limit:
        counts.append(n)
        n = max(n * 3 // 2, n + 1)
    counts.append(limit)
    return sorted({c for c in counts if c <= limit})


class _Budget:
    """The search's time. Each trial measures for an equal share of the time left over the
    trials that may still run, half of it (the other half pays for starting the workers and
    the warm-up), 0.5 to 10 s. Each engine's climb gets the share of the time left that its
    ladder is of the trials left, so both engines are measured; once a share is spent its
    climb stops, so a machine with many cores (a long ladder) searches within the budget,
    having measured the core count first."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def window(self, trials_left: int) -> float:
        left = self.deadline - time.perf_counter()
        return min(max(left / max(trials_left, 1) / 2, 0.5), 10.0)

    def spent(self) -> bool:
        return time.perf_counter() >= self.deadline

    def share(self, trials: int, of: int) -> _Budget:
        """The part of the time left for `trials` of the `of` trials that may still run."""
        left = max(self.deadline - time.perf_counter(), 0.0)
        return _Budget(left * trials / max(of, 1))


_PREFETCHES = (4, 8)


def search(
    config: BenchConfig,
    on_trial: Callable[[Trial], None] | None = None,
    budget: _Budget | None = None,
) -> list[Trial]:
    """Hill-climb worker processes, then threads (the thread engine), then prefetch for the
    faster, then pin_memory and GPU decode, within `budget` (default: ``budget_s`` from now);
    returns every trial made."""
    trials: list[Trial] = []
    budget = budget or _Budget(config.budget_s)
    memory = available_memory() * _MEMORY_SHARE
    per_worker: float | None = None  # measured; until then a worker is guessed as large as
    guess = float(_own_memory())  # this process, which it starts as a fork of
    cores = usable_cpus()
    limit = config.worker_limit()
    counts = _worker_counts(limit, cores)
    gpu = config.device == "cuda" and torch.cuda.is_available()
    gpu_decode = gpu and config.task == "classification"  # the GPU decodes its recipes only
    last = len(_PREFETCHES) + gpu + gpu_decode  # the trials after the climbs

    def run(trial: Trial, seconds: float) -> Trial:
        nonlocal per_worker
        each = guess if per_worker is None else per_worker
        workers, processes = trial.settings.num_workers, trial.settings.engine == "processes"
        needed = each * workers if processes else 0.0
        most = worker_limit(threads=not processes)
        if workers > most.workers:  # the loader would refuse it
            trial.skipped = f"more workers than this machine can run ({most.reason})"
        elif needed > memory:
            trial.skipped = (
                f"needs ~{needed / 1e9:.1f} GB of worker memory, {memory / 1e9:.1f} GB fit"
            )
        else:
            run_trial(config, trial, seconds)
            if workers and processes:
                measured = trial.worker_rss_bytes / workers
                per_worker = max(per_worker or 0.0, measured)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        return trial

    # one worker process does no more than the main process alone, plus the IPC: left out
    # unless it is the most workers allowed
    ladder = [
        Trial(WorkerSettings(num_workers=n, prefetch_factor=2 if n else None))
        for n in counts
        if n != 1 or limit == 1
    ]
    threads = [Trial(WorkerSettings(num_workers=n, engine="threads")) for n in counts if n]
    share = budget.share(len(ladder), len(ladder) + len(threads) + last)
    best = _climb(run, ladder, cores, share)
    if threads:  # none with --max-workers 0
        share = budget.share(len(threads), len(threads) + last)
        fastest_thread = _climb(run, threads, cores, share)
        if fastest_thread.samples_per_s > best.samples_per_s:
            best = fastest_thread
    if best.settings.num_workers:
        for k, prefetch in enumerate(_PREFETCHES):
            if budget.spent():
                break
            trial = Trial(best.settings.replace(prefetch_factor=prefetch))
            run(trial, budget.window(last - k))
            if trial.skipped or trial.samples_per_s <= best.samples_per_s * 1.02:
                break
            best = trial
    if gpu:  # run even when the time is spent: what decides CPU against GPU decode
        pinned = best.settings.replace(pin_memory=True)
        run(Trial(pinned), budget.window(1 + gpu_decode))
        if gpu_decode:
            run(Trial(pinned.replace(decode="cuda")), budget.window(1))
    return trials


def _climb(
    run: Callable[[Trial, float], Trial], ladder: list[Trial], cores: int, budget: _Budget
) -> Trial:
    """Hill-climb `ladder` (one engine, its worker counts in order) from the rung nearest the
    core count, and return the best trial: measure the best rung's unmeasured neighbours (the
    one above first) and move to the faster, until neither is faster; a start that does not
    fit in memory moves down until one does. Then refine: a count halfway between the best
    and each of its measured neighbours (the faster side first), where one lies between them
    and neither is 0 workers. Each trial but the first checks `budget` (this climb's share)."""
    measured: dict[int, Trial] = {}  # by rung

    def measure(rung: int) -> Trial:
        measured[rung] = run(ladder[rung], budget.window(len(ladder) - len(measured)))
        return measured[rung]

    def rate(rung: int) -> float:
        return -1.0 if measured[rung].skipped else measured[rung].samples_per_s

    def workers(rung: int) -> int:
        return ladder[rung].settings.num_workers

    best = min(range(len(ladder)), key=lambda i: (abs(workers(i) - cores), -i))
    while measure(best).skipped:  # fewer workers may fit (the smallest rung always does)
        best -= 1
    while True:
        fresh = [i for i in (best + 1, best - 1) if 0 <= i < len(ladder) and i not in measured]
        for rung in fresh:
            if not budget.spent():
                measure(rung)
        faster = [i for i in fresh if i in measured and rate(i) > rate(best)]
        if not faster:
            break
        best = max(faster, key=rate)
    winner = measured[best]
    fine = sorted(i for i in measured if not measured[i].skipped)
    at = fine.index(best)
    sides = sorted(fine[max(at - 1, 0) : at] + fine[at + 1 : at + 2], key=rate, reverse=True)
    counts = {t.settings.num_workers for t in measured.values()}
    for side in sides:
        middle = (workers(side) + workers(best)) // 2
        if budget.spent() or middle in counts or workers(side) == 0:
            continue
        window = budget.window(len(ladder) - len(measured))
        trial = run(Trial(winner.settings.replace(num_workers=middle, prefetch_factor=2)), window)
        if not trial.skipped and trial.samples_per_s > winner.samples_per_s:
            winner = trial
    return winner
