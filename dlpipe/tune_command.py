"""``dlpipe bench-loader``: measure, search, say what limits the pipeline, save the winner.

The flags that say what the batches are (``--batch-size``, ``--transform``, ``--image-size``,
``--min-crop-scale``) make one `LoaderConfig`, the one ``dlpipe train`` builds from the same
values, so the saved profile is found by the training run it was measured for; a run with
another batch or image size uses it too, as the nearest (`dlpipe.loading.profile`), and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from rich.box import SIMPLE_HEAD
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlpipe.cli import non_negative_int, positive_float, positive_int, printable
from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.profile import ProfileSaveError

if TYPE_CHECKING:  # the tuner imports torch: only when the command runs
    from dlpipe.loading.tune import BenchReport, Trial

__all__ = ["add_bench_parser", "crop_scale", "run_bench_loader"]


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-loader", help="measure the input pipeline and tune its workers")
    p.add_argument("data", help="dataset folder or URL")
    p.add_argument("--split", default="train")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument(
        "--transform",
        choices=["auto", "train", "eval"],
        default="auto",
        help="auto: train for the train split, else eval",
    )
    p.add_argument("--image-size", type=positive_int, default=224)
    p.add_argument(
        "--min-crop-scale",
        type=crop_scale,
        default=0.08,
        help="smallest train crop's area share, as dlpipe train's --min-crop-scale (0.08)",
    )
    p.add_argument(
        "--budget", type=positive_float, default=60.0, help="seconds for the whole search"
    )
    p.add_argument(
        "--max-workers", type=non_negative_int, help="largest num_workers tried (2x cores)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where batches go (cuda also tries pin_memory and decoding on the GPU)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", help="write a PNG of samples/s per trial here")
    p.add_argument("--no-save", action="store_true", help="do not save the winning profile")
    p.set_defaults(handler=run_bench_loader)


def crop_scale(text: str) -> float:
    """An argparse type: a share of the image area in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is not an area share in (0, 1]")
    return value


def run_bench_loader(args: argparse.Namespace, console: Console) -> int:
    from dlpipe.loading.tune import BenchConfig, bench_loader, save_winner

    loader = LoaderConfig(
        batch_size=args.batch_size,
        transform=args.transform,
        image_size=args.image_size,
        min_crop_scale=args.min_crop_scale,
    )
    config = BenchConfig(
        path=args.data,
        split=args.split,
        loader=loader,
        budget_s=args.budget,
        max_workers=args.max_workers,
        device=args.device,
    )
    quiet = args.json

    def show(trial: Trial) -> None:
        if not quiet:
            what = (
                escape(trial.skipped) if trial.skipped else f"{trial.samples_per_s:.0f} samples/s"
            )
            console.print(
                f"  {trial.engine}={trial.num_workers} decode={trial.decode} "
                f"prefetch={trial.prefetch_factor} "
                f"pin={trial.pin_memory}: {what}"
            )

    report = bench_loader(config, on_trial=show)
    saved, failure = None, None
    if not args.no_save:
        try:
            saved = save_winner(report)
        except ProfileSaveError as exc:  # the measurements are still shown, then the error
            failure = str(exc)
    if quiet:
        print(json.dumps({**report.to_json(), "saved": saved}, indent=2))
    else:
        _print(report, console, saved)
    if args.plot:
        try:
            _plot(report, args.plot)
        except (OSError, ValueError) as exc:  # a bad --plot path must not hide the results
            failure = failure or f"could not write the plot {args.plot}: {exc}; fix --plot"
    if failure is not None:
        print(f"error: {printable(str(failure))}", file=sys.stderr)
        return 1
    return 0


def _print(report: BenchReport, console: Console, saved: str | None) -> None:
    stages = Table("stage (one process)", "samples/s", title="pipeline stages")
    s = report.stages
    for name, rate in (
        ("read", s.read),
        ("+ decode", s.decode),
        ("+ transform", s.transform),
        ("+ collate", s.collate),
    ):
        stages.add_row(name, f"{rate:.0f}")
    console.print(stages)
    gpu = any(t.pin_memory or t.decode != "cpu" for t in report.trials)  # --device cuda
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
            t.engine,
            str(t.num_workers),
            str(t.prefetch_factor),
            *([str(t.pin_memory), t.decode] if gpu else []),
            shown + mark,
            f"{t.cpu_us_per_sample:,.0f} us" if measured else "-",
            f"{t.first_batch_s:.2f} s" if measured else "-",
            "-" if t.engine == "threads" else f"{t.worker_rss_bytes / 1e6:.0f} MB",
        )
    console.print(trials)
    best = report.best
    assert best is not None
    console.print(f"chosen: {best.settings().line()} ({best.samples_per_s:.0f} samples/s)")
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
        label = f"{t.engine[0]}{t.num_workers} p{t.prefetch_factor}"  # p2: processes, t2: threads
        draw.text((x, height - 35), label, fill="black")
        draw.text((x, height - 55 - h), f"{t.samples_per_s:.0f}", fill="black")
    draw.text(
        (10, 10), f"samples/s per trial: {os.path.basename(report.config.path)}", fill="black"
    )
    image.save(path)
