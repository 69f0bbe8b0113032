"""Measure the input pipeline and search its worker settings: what ``dlpipe bench-loader`` runs.

The tuner measures one `LoaderConfig` (the batches a trainer will ask for: batch size,
transform, image size, crop scale) and searches only the `WorkerSettings`, so the profile it
saves is keyed by exactly that config and found again by the loader that uses it.

1. **Stages** (`dlpipe.loading.tune_stages`), on one process: read the samples' bytes, then +
   decode, + transform, + collate. The per-sample cost each stage adds names the bottleneck. The
   decode is the loader's own: for the train recipe the box is drawn first and the JPEG decoded
   at the DCT scale the box allows, only the box's region where TurboJPEG 3 is installed
   (`ImageTransform.decode_for_crop`), then cropped (``crop_flip``).
2. **Search** (`dlpipe.loading.tune_search`): each trial builds `make_loader` with one setting,
   times its first batch (the workers' start-up, which each epoch pays again) and measures
   samples/s after a warm-up, in windows, until two windows agree within 5 % (or the trial's
   time is up), and the CPU per sample over those windows (this process's threads and its
   workers). The workers are hill-climbed on a ladder (`_worker_counts`: 0, 2, 4, 8, ...
   doubling to the core count, the core count, then x1.5 up to ``max_workers``; one worker does
   the main process's work plus the IPC, so it is left out) from the core count, the likeliest
   winner, outwards (`_climb`); then the thread engine's thread count the same way (1, 2, 4,
   ...: `dlpipe.loading.threads`); then ``prefetch_factor`` for the faster of the two, then
   ``pin_memory`` and GPU decode (``decode="cuda"``: the batch decoded and cropped on the GPU)
   when a GPU is the target: a handful of trials, not the grid. All within ``budget_s``
   (`_Budget`): each climb ends early when its share is spent. The winner's engine is saved with
   it, so ``make_loader`` runs what was measured fastest.
3. **RAM budget** (the search's too): worker memory (proportional set size, measured; until a
   trial has measured it, a worker is guessed as large as this process, which it forks from) is
   scaled to the next worker count; a trial that would not fit in 80 % of the available memory
   is skipped and says so (threads share the loading process's memory and are never skipped).

What the report says about the figures is `dlpipe.loading.verdicts`. This module joins the
steps: `bench_loader` (stages, search, verdict: a `BenchReport`) and `save_winner`.

``dlpipe train`` with no saved profile that may serve its loader (`nearest_profile`) runs the
same search, short (`tune_now`: no stage table, a budget of `QUICK_TUNE_S` seconds: each
engine's rung at the core count, then its neighbours while the time lasts, plus pinned memory
and GPU decode on a GPU), on its own first batches, and saves the winner for the next run
(`training_profile`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dlpipe._version import __version__
from dlpipe.errors import SplitTooSmallError
from dlpipe.loading.config import LoaderConfig, recipe_task
from dlpipe.loading.dataset import open_dataset
from dlpipe.loading.profile import (
    LoaderProfile,
    ProfileSaveError,
    loader_key,
    machine_key,
    nearest_profile,
    save_profile,
)
from dlpipe.loading.tune_search import Trial, _Budget, search
from dlpipe.loading.tune_stages import BenchConfig, StageRates, measure_stages
from dlpipe.loading.verdicts import crop_verdict, decode_verdict, verdict
from dlpipe.machine import usable_cpus
from dlpipe.manifest import read_manifest

__all__ = [
    "BenchReport",
    "QuickTune",
    "bench_loader",
    "save_winner",
    "training_profile",
    "tune_now",
]

log = logging.getLogger("dlpipe")


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
