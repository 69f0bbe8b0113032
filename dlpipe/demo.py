"""``dlpipe demo``: the whole system on the embedded shapes dataset, with no network.

A recipe over public entry points, wired next to the CLI: it generates the raw ImageFolder,
converts it to every format (`dlpipe.convert`) and verifies each (`dlpipe.verify_dataset`),
tunes the loader (``dlpipe bench-loader``'s search, saving the profile) for exactly the loader
the training runs, trains `shapes_cnn` with ``dlpipe train``'s trainer (whose loader line names
that profile), and prints a summary: the conversion throughput per format,
the tuned loader settings and verdict, the final validation top-1, and where the metrics,
confusion matrix, TensorBoard logs and checkpoints are. The loading room and the trainer are
imported inside the functions that use them, so importing this module imports neither.

It takes about a minute on 2 CPU cores (about half of it training) and reaches about 95 % val top-1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlpipe.errors import OutputExistsError
from dlpipe.formats import FORMATS
from dlpipe.inspection import describe_dataset, format_bytes
from dlpipe.machine import usable_cpus
from dlpipe.options import (
    Checked,
    add_config_command,
    non_negative_int,
    option,
    positive_float,
    positive_int,
    write_config_file,
)
from dlpipe.synthetic import SHAPE_CLASSES, split_samples, write_imagefolder
from dlpipe.verify import verify_dataset

__all__ = [
    "CONFIG_NAME",
    "DEMO_TIME",
    "DemoConfig",
    "add_demo_parser",
    "default_demo_dir",
    "run_demo",
    "shapes_cnn",
]

_MARKER = ".dlpipe-demo"
CONFIG_NAME = "demo.toml"  # the resolved config, in the demo folder (``--config`` reads it)
TRAIN_FORMAT = "lmdb"  # the one the demo tunes and trains on; every format would do
DEMO_TIME = "1 minute"  # the whole default demo on 2 CPU cores (benchmarks/demo.py: 49 s)
# the shapes fill a third of the image: crops keep at least half of it (tuned and trained so)
MIN_CROP_SCALE = 0.5


@dataclass(frozen=True, kw_only=True)
class DemoConfig(Checked):
    """What ``dlpipe demo`` runs (its flags, ``--config`` keys and the resolved `CONFIG_NAME`).
    The defaults are the measured recipe: 8 epochs of `shapes_cnn` at 40 px, AdamW at 5e-3,
    give about 95 % val top-1 (seeds 0 and 1) in about `DEMO_TIME` on 2 CPU cores."""

    out: str = option(
        "folder for the demo (default: $DLPIPE_DATA_DIR/dlpipe-demo or ./dlpipe-demo)",
        default="",
        metavar="DIR",
    )
    per_class: int = option("images per class (8 classes)", default=400, parse=positive_int)
    seed: int = option("seeds the images, the split and the training", default=0)
    workers: int = option(
        "conversion worker processes (default: every usable core)",
        default_factory=usable_cpus,
        parse=positive_int,
    )
    epochs: int = option(
        "training epochs (0 converts and verifies only)", default=8, parse=non_negative_int
    )
    model: str = option(
        "model to train: a torchvision name or package.module:function",
        default="dlpipe.demo:shapes_cnn",
    )
    image_size: int = option("the side of the training crops", default=40, parse=positive_int)
    batch_size: int = option("samples per training step", default=64, parse=positive_int)
    lr: float = option("the learning rate (AdamW)", default=5e-3, parse=positive_float)
    tune_budget_s: float = option(
        "seconds for the loader search", default=6.0, parse=positive_float
    )


def shapes_cnn(num_classes: int) -> Any:
    """The demo's model: four 3x3 conv-BN-ReLU stages (24-192 channels, 0.2 M parameters).

    At the demo's 40 px it costs a fifth of ResNet-18's step on a CPU (whose stem shrinks a
    40 px image to 10 px before its first block) and learns the shapes in fewer epochs.
    """
    from torch import nn

    layers: list[nn.Module] = []
    channels = 3
    for width in (24, 48, 96, 192):
        if channels != 3:
            layers.append(nn.MaxPool2d(2))
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)]
        layers.append(nn.ReLU(inplace=True))
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def default_demo_dir() -> str:
    """``$DLPIPE_DATA_DIR/dlpipe-demo`` when the variable is set, else ``./dlpipe-demo``."""
    return os.path.join(os.environ.get("DLPIPE_DATA_DIR", "."), "dlpipe-demo")


def _prepare(out: str) -> None:
    """Reuse a folder an earlier demo made; refuse any other non-empty folder."""
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.exists(os.path.join(out, _MARKER)):
            raise OutputExistsError(
                f"{out} is not empty and was not made by dlpipe demo; "
                "choose another folder with --out"
            )
        shutil.rmtree(out)
    os.makedirs(out)
    open(os.path.join(out, _MARKER), "w").close()


def run_demo(config: DemoConfig, console: Console) -> int:
    """Run the demo (in `default_demo_dir` when ``config.out`` is empty) and write its resolved
    config there as `CONFIG_NAME`; returns the process exit code (0 when every step succeeded)."""
    config = dataclasses.replace(config, out=config.out or default_demo_dir())
    out = config.out
    _prepare(out)
    write_config_file(os.path.join(out, CONFIG_NAME), config)
    console.print(
        f"dlpipe demo → {escape(os.path.abspath(out))} (about {DEMO_TIME} on 2 CPU "
        "cores with the defaults; --epochs 0 converts and verifies only)"
    )
    raw, train_samples = _generate(config, console)
    conversions, ok = _convert_all(config, raw, console)
    console.print(conversions)
    if not ok or config.epochs == 0:
        console.print(
            f"inspect any of them: dlpipe inspect {escape(os.path.join(out, 'shapes-wds'))}"
        )
        return 0 if ok else 1
    data = os.path.join(out, f"shapes-{TRAIN_FORMAT}")
    if train_samples < 2 * config.batch_size:  # a tiny demo (--per-class): smaller batches
        config = dataclasses.replace(config, batch_size=max(1, train_samples // 2))
    # the search needs less time on a small dataset (it reads it over and over)
    budget = min(config.tune_budget_s, max(3.0, train_samples / 100))
    config = dataclasses.replace(config, tune_budget_s=budget)
    tuned = _tune(config, data, console)
    trained = _train(config, data, console)
    console.print(_summary(data, tuned, trained), highlight=False, markup=False)
    return 0


def _generate(config: DemoConfig, console: Console) -> tuple[str, int]:
    start = time.perf_counter()
    pairs = list(split_samples(config.per_class, seed=config.seed))
    raw = os.path.join(config.out, "raw")
    counts = write_imagefolder(raw, pairs)
    console.print(
        f"1/4 generated {sum(counts.values())} JPEGs of {len(SHAPE_CLASSES)} shape classes "
        f"({counts['train']} train, {counts['val']} val) in {time.perf_counter() - start:.1f} s"
    )
    return raw, counts["train"]


def _convert_all(config: DemoConfig, raw: str, console: Console) -> tuple[Table, bool]:
    table = Table(
        "format", "folder", "samples", "shards", "size", "samples/s", "verified", title="convert"
    )
    from dlpipe.converters.engine import convert  # dlpipe.convert; the recipe wires the rooms

    ok = True
    for name in FORMATS:
        folder = os.path.join(config.out, f"shapes-{name}")
        result = convert(raw, to=name, out=folder, workers=config.workers)
        rate = sum(s.samples for s in result.manifest.splits.values()) / result.seconds
        report = verify_dataset(folder, decode=True)
        ok &= report.ok
        info = describe_dataset(folder)
        table.add_row(
            name,
            os.path.basename(folder),
            str(info["samples"]),
            str(sum(s["shards"] for s in info["splits"].values())),
            format_bytes(info["bytes"]),
            f"{rate:.0f}",
            "ok" if report.ok else f"{len(report.problems)} problems",
        )
        for problem in report.problems:
            console.print(f"[red]{escape(str(problem))}[/red]")
    console.print("2/4 converted to every format (dlpipe convert) and verified every shard")
    return table, ok


def _tune(config: DemoConfig, data: str, console: Console) -> Any:
    from dlpipe.loading.config import LoaderConfig
    from dlpipe.loading.tune import BenchConfig, bench_loader, save_winner

    # the loader the training runs (`_train`), so the trainer finds this very profile
    loader = LoaderConfig(
        batch_size=config.batch_size,
        image_size=config.image_size,
        min_crop_scale=MIN_CROP_SCALE,
        seed=config.seed,
    )
    bench = BenchConfig(
        path=data, loader=loader, budget_s=config.tune_budget_s, max_workers=max(2, config.workers)
    )
    report = bench_loader(bench)
    saved = save_winner(report)
    best = report.best
    assert best is not None
    console.print(
        f"3/4 tuned the loader (dlpipe bench-loader): {best.settings.engine} "
        f"num_workers={best.settings.num_workers} "
        f"prefetch_factor={best.settings.prefetch_factor} pin_memory={best.settings.pin_memory}, "
        f"{best.samples_per_s:.0f} samples/s; saved to {escape(str(saved))}"
    )
    return report


def _train(config: DemoConfig, data: str, console: Console) -> Any:
    from dlpipe.train.config import load_config
    from dlpipe.train.trainer import Trainer

    train_config = load_config(
        None,
        {
            "data": {
                "path": data,
                "image_size": config.image_size,
                "min_crop_scale": MIN_CROP_SCALE,
            },
            "model": {"name": config.model},
            "optim": {
                "optimizer": "adamw",
                "lr": config.lr,
                "warmup_epochs": 1.0,
                "label_smoothing": 0.1,
            },
            "run": {
                "epochs": config.epochs,
                "batch_size": config.batch_size,
                "out": os.path.join(config.out, "run"),
                "resume": "none",
                "seed": config.seed,
                "log_every_steps": 10,
            },
        },
    )
    console.print(f"4/4 training {escape(config.model)} for {config.epochs} epochs (dlpipe train)")
    trainer = Trainer(train_config, console, show_config=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _summary(data: str, tuned: Any, trained: Any) -> str:
    """Plain lines (paths stay whole, to copy and paste)."""
    run, best = trained.run_dir, tuned.best
    top1 = (trained.last_val or {}).get("top1")
    accuracy = f"{100 * top1:.1f}%" if top1 is not None else "-"
    lines = [
        "dlpipe demo: summary",
        f"  loader:           {best.settings.engine}, num_workers={best.settings.num_workers}, "
        f"prefetch_factor={best.settings.prefetch_factor}, pin_memory="
        f"{best.settings.pin_memory}: {best.samples_per_s:.0f} "
        "samples/s",
        f"  verdict:          {tuned.advice}",
        f"  val top-1:        {accuracy} after {trained.epochs_done} epochs",
        f"  metrics:          {os.path.join(run, 'metrics.jsonl')}",
        f"  confusion matrix: {os.path.join(run, 'confusion.png')}",
        f"  TensorBoard:      tensorboard --logdir {os.path.join(run, 'tensorboard')}",
        f"  checkpoints:      {os.path.join(run, 'checkpoints')}",
        f"  next:             dlpipe train {data} --model resnet18, or convert your own data",
    ]
    return "\n".join(lines)


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    """``dlpipe demo``: one argument per `DemoConfig` option, and ``--config FILE``."""
    add_config_command(
        sub,
        "demo",
        DemoConfig,
        run_demo,
        help=f"run dlpipe end to end on the embedded shapes dataset (about {DEMO_TIME} "
        "on 2 CPU cores)",
    )
