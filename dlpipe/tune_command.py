"""``dlpipe bench-loader``: measure, search, say what limits the pipeline, save the winner.

The flags that say what the batches are (``--batch-size``, ``--transform``, ``--image-size``,
``--base-size``, ``--min-crop-scale``) make one `LoaderConfig`, the one ``dlpipe train``
builds from the same values, so the saved profile is found by the training run it was measured
for; a run with another batch or image size uses it too, as the nearest
(`dlpipe.loading.profile`), and says so. On a detection or segmentation dataset the recipe is
its task's, and the stages include its targets' decode and the joint transform.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from rich.box import SIMPLE_HEAD
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlpipe.bench_config import CONFIG_SUFFIX, BenchLoaderConfig
from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.profile import ProfileSaveError
from dlpipe.options import add_config_command, write_config_file
from dlpipe.text import printable

if TYPE_CHECKING:  # the tuner imports torch: only when the command runs
    from dlpipe.loading.tune import BenchReport
    from dlpipe.loading.tune_search import Trial
    from dlpipe.loading.tune_stages import BenchConfig

log = logging.getLogger("dlpipe")

__all__ = ["add_bench_parser", "run_bench_loader"]


def _bench_config(options: BenchLoaderConfig) -> BenchConfig:
    """The tuner's config: what the batches are (one `LoaderConfig`, as ``dlpipe train``
    builds it from the same values) and how long to search."""
    from dlpipe.loading.tune_stages import BenchConfig

    loader = LoaderConfig(
        batch_size=options.batch_size,
        transform=options.transform,
        image_size=options.image_size,
        base_size=options.base_size,
        min_crop_scale=options.min_crop_scale,
    )
    return BenchConfig(
        path=options.data,
        split=options.split,
        loader=loader,
        budget_s=options.budget,
        max_workers=options.max_workers,
        device=options.device,
    )


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``dlpipe bench-loader``: one argument per `BenchLoaderConfig` option, and ``--config``."""
    help = "measure the input pipeline and tune its workers"
    add_config_command(sub, "bench-loader", BenchLoaderConfig, run_bench_loader, help=help)


def run_bench_loader(options: BenchLoaderConfig, console: Console) -> int:
    """Measure, search, print the report, save the winner and the resolved options."""
    from dlpipe.loading.tune import bench_loader, save_winner

    config = _bench_config(options)
    quiet = options.json

    def show(trial: Trial) -> None:
        if not quiet:
            what = (
                escape(trial.skipped) if trial.skipped else f"{trial.samples_per_s:.0f} samples/s"
            )
            console.print(
                f"  {trial.settings.engine}={trial.settings.num_workers} "
                f"decode={trial.settings.decode} prefetch={trial.settings.prefetch_factor} "
                f"pin={trial.settings.pin_memory}: {what}"
            )

    report = bench_loader(config, on_trial=show)
    saved, written, failure = None, None, None
    if options.save:
        try:
            saved = save_winner(report)
            written = _write_resolved(options, saved)
        except ProfileSaveError as exc:  # the measurements are still shown, then the error
            failure = str(exc)
    if quiet:
        print(json.dumps({**report.to_json(), "saved": saved, "config": written}, indent=2))
    else:
        _print(report, console, saved)
        if written:
            console.print(f"wrote the resolved options to {escape(written)} (read by --config)")
    if options.plot:
        try:
            _plot(report, options.plot)
        except (OSError, ValueError) as exc:  # a bad --plot path must not hide the results
            failure = failure or f"could not write the plot {options.plot}: {exc}; fix --plot"
    if failure is not None:
        print(f"error: {printable(str(failure))}", file=sys.stderr)
        return 1
    return 0


def _write_resolved(options: BenchLoaderConfig, saved: str) -> str | None:
    """`options` as TOML beside the saved profile (`CONFIG_SUFFIX`); None if that failed
    (the profile is saved: a warning, not an error)."""
    dest = saved.removesuffix(".json") + CONFIG_SUFFIX
    try:
        write_config_file(dest, options)
    except OSError as exc:
        log.warning("could not write the resolved options to %s: %s", dest, exc)
        return None
    return dest


def _print(report: BenchReport, console: Console, saved: str | None) -> None:
    stages = Table("stage (one process)", "samples/s", title="pipeline stages")
    s = report.stages
    for name, rate in (
        ("read", s.read),
        ("+ decode and targets" if s.recipe else "+ decode", s.decode),
        ("+ transform", s.transform),
        ("+ collate", s.collate),
    ):
        stages.add_row(name, f"{rate:.0f}")
    console.print(stages)
    # --device cuda
    gpu = any(t.settings.pin_memory or t.settings.decode != "cpu" for t in report.trials)
    columns = ["engine", "workers", "prefetch", *(["pin", "decode"] if gpu else [])]
    columns += ["samples/s", "CPU/sample", "first batch", "worker RSS"]
    trials = Table(
        title="trials", box=SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True
    )
    for column in columns:  # 76 columns wide without the GPU ones; a skip's reason may wrap
        trials.add_column(column, no_wrap=column != "samples/s")
    for t in report.trials:
        shown = escape(t.skipped) if t.skipped else f"{t.samples_per_s:.0f}"
        mark = " ←" if t is report.best else ""
        measured = not t.skipped
        trials.add_row(
            t.settings.engine,
            str(t.settings.num_workers),
            str(t.settings.prefetch_factor),
            *([str(t.settings.pin_memory), t.settings.decode] if gpu else []),
            shown + mark,
            f"{t.cpu_us_per_sample:,.0f} us" if measured else "-",
            f"{t.first_batch_s:.2f} s" if measured else "-",
            "-" if t.settings.engine == "threads" else f"{t.worker_rss_bytes / 1e6:.0f} MB",
        )
    console.print(trials)
    best = report.best
    assert best is not None
    console.print(f"chosen: {best.settings.line()} ({best.samples_per_s:.0f} samples/s)")
    console.print(f"verdict: {escape(report.advice)}")
    if saved:
        console.print(
            f"saved the profile to {escape(saved)}; dlpipe train and dlpipe.make_loader use "
            "it from now on, for this loader and (until they have their own) the nearest ones"
        )


def _plot(report: BenchReport, path: str) -> None:
    from PIL import Image, ImageDraw

    measured = [t for t in report.trials if not t.skipped]
    width, height, bar = 80 * len(measured) + 40, 320, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    top = max(t.samples_per_s for t in measured) or 1.0
    for i, t in enumerate(measured):
        x = 30 + 80 * i
        h = int((height - 80) * t.samples_per_s / top)
        colour = (40, 120, 200) if t is not report.best else (220, 110, 30)
        draw.rectangle((x, height - 40 - h, x + bar, height - 40), fill=colour)
        s = t.settings
        label = f"{s.engine[0]}{s.num_workers} p{s.prefetch_factor}"  # p2: processes, t2: threads
        draw.text((x, height - 35), label, fill="black")
        draw.text((x, height - 55 - h), f"{t.samples_per_s:.0f}", fill="black")
    draw.text(
        (10, 10), f"samples/s per trial: {os.path.basename(report.config.path)}", fill="black"
    )
    image.save(path)
