"""Measure the input pipeline and search its worker settings: what ``dlpipe bench-loader`` runs.

The tuner measures one `LoaderConfig` (the batches a trainer will ask for: batch size,
transform, image size, crop scale) and searches only the `WorkerSettings`, so the profile it
saves is keyed by exactly that config and found again by the loader that uses it.

1. **Stages**, on one process: read the samples' bytes, then + decode, + transform,
   + collate. The per-sample cost each stage adds names the bottleneck. The decode is the
   loader's own: for the train recipe the box is drawn first and the JPEG decoded at the DCT
   scale the box allows, only the box's region where TurboJPEG 3 is installed
   (`ImageTransform.decode_for_crop`), then cropped (``crop_flip``).
2. **Search**: each trial builds `make_loader` with one setting, times its first batch (the
   workers' start-up, which each epoch pays again) and measures samples/s after a warm-up, in
   windows, until two windows agree within 5 % (or the trial's time is up), and the CPU per
   sample over those windows (this process's threads and its workers). The workers are
   hill-climbed on a ladder (`_worker_counts`: 0, 2, 4, 8, ... doubling to the core count,
   the core count, then x1.5 up to ``max_workers``; one worker does the main process's work
   plus the IPC, so it is left out) from the core count, the likeliest winner, outwards
   (`_climb`); then the thread engine's thread count the same way (1, 2, 4, ...:
   `dlpipe.loading.threads`); then ``prefetch_factor`` for the faster of the two, then
   ``pin_memory`` and GPU decode (``decode="cuda"``: the batch decoded and cropped on the
   GPU) when a GPU is the target: a handful of trials, not the grid.
   All within ``budget_s`` (`_Budget`): each climb ends early when its share is spent.
   The winner's engine is saved with it, so ``make_loader`` runs what was measured fastest.
3. **RAM budget**: worker memory (proportional set size, measured; until a trial has
   measured it, a worker is guessed as large as this process, which it forks from) is scaled
   to the next worker count; a trial that would not fit in 80 % of the available memory is
   skipped and says so (threads share the loading process's memory and are never skipped).

What the report says about the figures is `dlpipe.loading.verdicts`.

``dlpipe train`` with no saved profile that may serve its loader (`nearest_profile`) runs the
same search, short (`tune_now`: no stage table, a budget of `QUICK_TUNE_S` seconds: each
engine's rung at the core count, then its neighbours while the time lasts, plus pinned memory
and GPU decode on a GPU), on its own first batches, and saves the winner for the next run
(`training_profile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlpipe._version import __version__
from dlpipe.errors import SplitTooSmallError
from dlpipe.jpeg_seek import restart_layout
from dlpipe.loading.config import LoaderConfig, LoaderConfigError, WorkerSettings, recipe_task
from dlpipe.loading.dataset import MapDataset, StreamDataset, open_dataset
from dlpipe.loading.profile import (
    LoaderProfile,
    ProfileSaveError,
    loader_key,
    machine_key,
    nearest_profile,
    save_profile,
)
from dlpipe.loading.task_collate import task_collate
from dlpipe.loading.task_transforms import TaskTransform
from dlpipe.loading.threads import one_torch_thread
from dlpipe.loading.transforms import ImageTransform, decode_rgb, image_field
from dlpipe.loading.verdicts import crop_verdict, decode_verdict, verdict
from dlpipe.loading.views import collate as collate_batch
from dlpipe.machine import (
    available_memory,
    cpu_seconds,
    proportional_set_size,
    usable_cpus,
    worker_limit,
)
from dlpipe.manifest import read_manifest

__all__ = [
    "BenchConfig",
    "BenchReport",
    "QuickTune",
    "StageRates",
    "Trial",
    "bench_loader",
    "save_winner",
    "training_profile",
    "tune_now",
]

_MEMORY_SHARE = 0.8
log = logging.getLogger("dlpipe")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``bench-loader`` measures and how long it may search.

    Attributes:
        path, split: the dataset and split.
        loader: the loader config measured (resolved here for `split` and the dataset's
            task, read from its manifest); its transform must be a recipe of the task
            (``"auto"``, ``"train"``, ``"eval"``, a detection policy).
        budget_s: seconds for the whole search.
        max_workers: the largest ``num_workers`` tried (default: 2 x the usable cores).
        device: ``"cuda"`` also tries ``pin_memory`` (and, for classification, GPU decode).
        task: the task whose recipes the dataset has (`recipe_task`), set from its manifest.
    """

    path: str
    split: str = "train"
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    budget_s: float = 60.0
    max_workers: int | None = None
    device: str = "cpu"
    task: str = field(init=False, default="classification")

    def __post_init__(self) -> None:
        task = recipe_task(read_manifest(self.path).task)
        resolved = self.loader.resolved(self.split, task)
        if not isinstance(resolved.transform, str):
            raise LoaderConfigError(
                f"transform={self.loader.transform!r}: bench-loader measures the recipes "
                "only; pass transform 'auto', 'train', 'eval' or another recipe of the task"
            )
        object.__setattr__(self, "loader", resolved)
        object.__setattr__(self, "task", task)

    def worker_limit(self) -> int:
        return self.max_workers if self.max_workers is not None else 2 * usable_cpus()


@dataclass(frozen=True)
class StageRates:
    """Samples/s on one process after each stage, and the read rate in MB/s."""

    read: float
    decode: float
    transform: float
    collate: float
    read_mb_per_s: float
    crop_decode: bool = False  # the train recipe's crop-aware decode was measured
    recipe: str = ""  # ``detection ssd``, ``segmentation train``: a task recipe measured
    seekable_share: float = 0.0  # of the measured images: seekable JPEGs (`dlpipe.jpeg_seek`)

    def costs(self) -> dict[str, float]:
        """Seconds per sample each stage adds."""
        steps = [
            ("read", self.read),
            ("decode", self.decode),
            ("transform", self.transform),
            ("collate", self.collate),
        ]
        costs, before = {}, 0.0
        for name, rate in steps:
            total = 1.0 / rate
            costs[name] = max(total - before, 0.0)
            before = total
        return costs


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


@dataclass
class BenchReport:
    config: BenchConfig
    stages: StageRates
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    bottleneck: str = ""
    advice: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "stages": self.stages.__dict__,
            "trials": [t.to_json() for t in self.trials],
            "best": self.best.to_json() if self.best else None,
            "bottleneck": self.bottleneck,
            "advice": self.advice,
        }


def _clock(iterable: Iterator[Any], seconds: float, minimum: int) -> tuple[list[Any], float]:
    items, start = [], time.perf_counter()
    for item in iterable:
        items.append(item)
        if len(items) >= minimum and time.perf_counter() - start >= seconds:
            break
    return items, time.perf_counter() - start


def measure_stages(
    config: BenchConfig, seconds: float = 2.0, dataset: MapDataset | StreamDataset | None = None
) -> StageRates:
    """One process, stage by stage, on the first samples of the split (`dataset`, if it is
    open already), with the transform the loader builds from the config. A detection or
    segmentation recipe's decode includes its targets' (`TaskTransform.decode`), its
    transform is the joint ops on both."""
    from dlpipe.loading.loader import make_transform

    batch_size = config.loader.batch_size
    if dataset is None:
        dataset = open_dataset(config.path, config.split, rank=0, world_size=1)
    transform = make_transform(config.loader, dataset)
    samples, read_s = _clock(iter(dataset), seconds, minimum=batch_size)
    field_name = image_field(list(dataset.manifest.fields))
    nbytes = sum(len(s[field_name]) for s in samples)
    datas = [bytes(s[field_name]) for s in samples]
    with one_torch_thread():  # what a DataLoader worker gets
        if isinstance(transform, TaskTransform):
            times = _time_task_stages(transform, samples, batch_size)
        else:
            assert isinstance(transform, ImageTransform)  # BenchConfig admits recipes only
            times = _time_stages(transform, datas, batch_size)
    decode_s, transform_s, collate_s = times
    dataset.close()
    cumulative, rates = 0.0, []
    for step in (read_s, decode_s, transform_s, collate_s):
        cumulative += step
        rates.append(len(samples) / max(cumulative, 1e-9))
    read, decode, transform_rate, collate = rates
    return StageRates(
        read=read,
        decode=decode,
        transform=transform_rate,
        collate=collate,
        read_mb_per_s=nbytes / 1e6 / max(read_s, 1e-9),
        crop_decode=isinstance(transform, ImageTransform)
        and transform.recipe == "train"
        and transform.decode == "crop",
        recipe=f"{transform.spec.task} {transform.recipe}"
        if isinstance(transform, TaskTransform)
        else "",
        seekable_share=sum(restart_layout(d) is not None for d in datas) / max(len(datas), 1),
    )


def _time_stages(
    transform: ImageTransform, datas: list[bytes], batch_size: int
) -> tuple[float, float, float]:
    """Seconds to decode `datas`, transform the images and collate them in batches, each
    stage on the last one's output."""
    if transform.recipe == "train":  # the loader's own decode (DCT-scaled to the box), then crop
        generators = [transform.generator(0, i) for i in range(len(datas))]
        start = time.perf_counter()
        pairs = list(zip(datas, generators, strict=True))
        decoded = [transform.decode_for_crop(d, g) for d, g in pairs]
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        crops = [transform.crop_flip(*d, g) for d, g in zip(decoded, generators, strict=True)]
        transform_s = time.perf_counter() - start
    else:
        start = time.perf_counter()
        images = [decode_rgb(d) for d in datas]
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        crops = [transform.ops()(image) for image in images]
        transform_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(crops) - batch_size + 1, batch_size):
        collate_batch(crops[i : i + batch_size])
    return decode_s, transform_s, time.perf_counter() - start


def _time_task_stages(
    transform: TaskTransform, samples: list[Any], batch_size: int
) -> tuple[float, float, float]:
    """Seconds to decode `samples`' images and targets, run the recipe's joint ops on them
    and collate them in batches (`task_collate`), each stage on the last one's output."""
    start = time.perf_counter()
    decoded = [transform.decode(s, i) for i, s in enumerate(samples)]
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    pairs = [transform.apply(*d, transform.rng_seed(0, i)) for i, d in enumerate(decoded)]
    transform_s = time.perf_counter() - start
    start = time.perf_counter()
    collate = task_collate(transform.spec.task)
    for i in range(0, len(pairs) - batch_size + 1, batch_size):
        collate(pairs[i : i + batch_size])
    return decode_s, transform_s, time.perf_counter() - start


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


def bench_loader(
    config: BenchConfig, on_trial: Callable[[Trial], None] | None = None
) -> BenchReport:
    """Stages, search, verdict (see the module docstring); saves nothing (the CLI does)."""
    dataset = open_dataset(config.path, config.split, rank=0, world_size=1)  # its one read
    samples = len(dataset)
    if samples < config.loader.batch_size:
        raise SplitTooSmallError(
            f"{config.path} split {config.split!r} has {samples} samples, fewer than one batch "
            f"of {config.loader.batch_size}; lower --batch-size"
        )
    budget = _Budget(config.budget_s)
    stages = measure_stages(config, min(max(config.budget_s / 20, 1.0), 5.0), dataset)
    report = BenchReport(config=config, stages=stages)
    report.trials = search(config, on_trial, budget)
    measured = [t for t in report.trials if not t.skipped]
    report.best = max(measured, key=lambda t: t.samples_per_s)
    report.bottleneck, report.advice = verdict(
        stages, report.best, usable_cpus(), config.loader.image_size
    )
    report.advice += decode_verdict(report.trials) + crop_verdict(stages.recipe)
    return report


def save_winner(report: BenchReport) -> str:
    """Save the best trial as the loader profile `make_loader` finds; returns where.

    Raises:
        ProfileSaveError: neither the dataset folder nor the user cache could be written.
    """
    best, cfg = report.best, report.config
    assert best is not None
    profile = LoaderProfile(
        settings=best.settings,
        samples_per_s=best.samples_per_s,
        machine=machine_key(),
        loader=loader_key(cfg.split, cfg.loader, cfg.task),
        created_by=__version__,
    )
    return save_profile(cfg.path, profile)


# --- the short tune of `dlpipe train`, when no saved profile fits -----------------------------

QUICK_TUNE_S = 4.0  # the search's budget: a trial an engine at least, each ~0.5 s measuring


@dataclass(frozen=True)
class QuickTune:
    """What `tune_now` measured and where it saved it.

    Attributes:
        profile: the fastest settings measured, as a profile of this machine and loader.
        trials: the settings measured.
        seconds: how long the tune took, workers' start-up included.
        saved: the profiles file written, or None when none could be (a warning says why).
    """

    profile: LoaderProfile
    trials: int
    seconds: float
    saved: str | None


@contextlib.contextmanager
def _random_streams_kept() -> Iterator[None]:
    """Leave the caller's random streams (Python's, NumPy's, torch's CPU generator) as they
    were: each trial's DataLoader draws its workers' base seed from torch's, and a trainer's
    model initialisation must not depend on whether (or for how many trials) it tuned."""
    python, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def tune_now(
    path: str,
    split: str,
    loader: LoaderConfig,
    *,
    budget_s: float | None = None,
    device: str = "cpu",
    max_workers: int | None = None,
) -> QuickTune:
    """``bench-loader``'s search (`search`), short: no stage table, a budget of a few seconds
    (default `QUICK_TUNE_S`: each engine's climb measures the rung at the core count, the
    likeliest winner, and its neighbours while its share lasts; pinned memory and GPU decode
    on a GPU; no prefetch rung once the time is spent), up to `max_workers` (default: the
    usable cores) workers, on the split's first batches.
    Saves the winner as
    the profile of this machine and `loader`, so the next run finds it; a profile that cannot
    be saved is a warning, and the settings still serve this run. The caller's random streams
    are left as they were.

    Raises:
        SplitTooSmallError: a pass over the split gives no batch.
        LoaderConfigError: `loader`'s transform is not an image transform.
    """
    cores = usable_cpus()
    bench = BenchConfig(
        path=path,
        split=split,
        loader=loader,
        budget_s=QUICK_TUNE_S if budget_s is None else budget_s,
        max_workers=cores if max_workers is None else max_workers,
        device=device,
    )
    start = time.perf_counter()
    with _random_streams_kept():
        trials = [t for t in search(bench) if not t.skipped]
    best = max(trials, key=lambda t: t.samples_per_s)
    profile = LoaderProfile(
        settings=best.settings,
        samples_per_s=best.samples_per_s,
        machine=machine_key(),
        loader=loader_key(split, bench.loader, bench.task),
        created_by=__version__,
    )
    try:
        saved: str | None = save_profile(path, profile)
    except ProfileSaveError as exc:
        log.warning("%s; the tuned settings serve this run only", exc)
        saved = None
    return QuickTune(profile, len(trials), time.perf_counter() - start, saved)


def training_profile(
    path: str,
    split: str,
    loader: LoaderConfig,
    *,
    tune: bool = True,
    why_not: str = "--tune off",
    device: str = "cpu",
    decode: str | None = None,
    max_workers: int | None = None,
    announce: Callable[[str], None] | None = None,
) -> tuple[LoaderProfile | None, str]:
    """The profile a training loader runs on, and where it came from, in the words of
    ``dlpipe train``'s loader line: the nearest saved profile of this machine
    (`nearest_profile`; ``profile measured at batch 64, 224 px on this machine; nearest to
    batch 256, 160 px``); else, with `tune`, a short tune now (`tune_now`, saved for the
    next run; `announce` is told first, as it takes a few seconds); else None, the
    defaults (``defaults: `` and `why_not`).

    Args:
        path, split, loader: the dataset, the split and the training loader's config.
        tune: tune when no saved profile fits; `why_not` says why not otherwise.
        device, max_workers: as `tune_now`'s.
        decode: ``"cpu"``/``"cuda"`` when the run asks for one: profiles measured decoding
            there are preferred.
    """
    task = recipe_task(read_manifest(path).task)
    choice = nearest_profile(path, split=split, config=loader, decode=decode, task=task)
    if choice is not None:
        return choice.profile, choice.reason()
    if not tune:
        return None, f"defaults: {why_not}"
    if announce is not None:
        announce(
            f"no saved loader profile for this dataset on this machine: tuning the loader on "
            f"the first batches (about {QUICK_TUNE_S:.0f} s; --tune off skips this)"
        )
    try:
        tuned = tune_now(path, split, loader, device=device, max_workers=max_workers)
    except SplitTooSmallError:
        return None, "defaults: the split is too small to tune on"
    where = f"saved to {tuned.saved}" if tuned.saved else "not saved (see the warning)"
    return tuned.profile, (
        f"tuned now on this run's first batches: {tuned.trials} trials in "
        f"{tuned.seconds:.1f} s, {where}"
    )
