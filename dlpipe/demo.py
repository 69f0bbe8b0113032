"""``dlpipe demo``: the whole system on embedded shapes data, with no network.

A recipe over public entry points, wired next to the CLI. For its task (``--task``,
`dlpipe.demo_tasks`) it generates the raw data (classification: an ImageFolder of shape
images; detection: scenes of 1-4 shapes in COCO's layout; segmentation: the same scenes in
Pascal VOC's segmentation layout, so the real ``coco`` and ``voc-seg`` sources read them),
converts it to every format (`dlpipe.convert`) and verifies each (`dlpipe.verify_dataset`),
tunes the loader (``dlpipe bench-loader``'s search, saving the profile) for exactly the loader
the training runs, trains the task's small model from scratch with ``dlpipe train``'s trainer
(whose loader line names that profile), and prints a summary: the conversion throughput per
format, the tuned loader settings and verdict, the final validation score (top-1, COCO
mAP@.5 or mIoU), and where the metrics, the picture (confusion matrix, or predictions beside
the truth), TensorBoard logs and checkpoints are. The loading room and the trainer are
imported inside the functions that use them, so importing this module imports neither.

With the defaults on 2 CPU cores (``benchmarks/results/demo.md``): classification takes about
a minute (about half of it training) and reaches about 95 % val top-1; detection and
segmentation take the times their `DemoTask` states.
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

from dlpipe.demo_tasks import DEMO_TASKS, SCENE_SIZE, DemoTask, demo_task
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
from dlpipe.synthetic_tasks import write_coco, write_voc_segmentation
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
_TASK_OPTIONS = ("per_class", "epochs", "model", "image_size", "batch_size", "lr")
CONFIG_NAME = "demo.toml"  # the resolved config, in the demo folder (``--config`` reads it)
TRAIN_FORMAT = "lmdb"  # the one the demo tunes and trains on; every format would do
DEMO_TIME = DEMO_TASKS["classification"].time  # the whole default demo on 2 CPU cores
# the shapes fill a third of the image: crops keep at least half of it (tuned and trained so)
MIN_CROP_SCALE = 0.5
VAL_EVERY = 5  # every fifth image (scene) is a val one, as `split_samples` splits


def _task_defaults(option_name: str) -> str:
    """The tasks' defaults of a `DemoConfig` option, for its help."""
    return ", ".join(f"{getattr(t, option_name)} {t.name}" for t in DEMO_TASKS.values())


@dataclass(frozen=True, kw_only=True)
class DemoConfig(Checked):
    """What ``dlpipe demo`` runs (its flags, ``--config`` keys and the resolved `CONFIG_NAME`).
    The options left unset take the task's measured recipe (`dlpipe.demo_tasks.DEMO_TASKS`):
    classification trains `shapes_cnn` at 40 px for 8 epochs, AdamW at 5e-3, to about 95 % val
    top-1 (seeds 0 and 1) in about `DEMO_TIME` on 2 CPU cores."""

    task: str = option(
        "what the demo trains: shape classes, boxes around shapes (COCO's layout) or their "
        "pixels (Pascal VOC's)",
        default="classification",
        choices=tuple(DEMO_TASKS),
    )
    out: str = option(
        "folder for the demo (default: $DLPIPE_DATA_DIR/dlpipe-demo or ./dlpipe-demo)",
        default="",
        metavar="DIR",
    )
    per_class: int | None = option(
        "images per class, 8 classes (detection, segmentation: 8 x this many scenes of 1-4 "
        "shapes; default: the task's: " + _task_defaults("per_class") + ")",
        default=None,
        parse=positive_int,
    )
    seed: int = option("seeds the images, the split and the training", default=0)
    workers: int = option(
        "conversion worker processes (default: every usable core)",
        default_factory=usable_cpus,
        parse=positive_int,
    )
    epochs: int | None = option(
        "training epochs, 0 converts and verifies only (default: the task's: "
        + _task_defaults("epochs")
        + ")",
        default=None,
        parse=non_negative_int,
    )
    model: str | None = option(
        "model to train: a torchvision name or package.module:function (default: the task's: "
        + _task_defaults("model")
        + ")",
        default=None,
    )
    image_size: int | None = option(
        "the side of the training images (default: the task's: "
        + _task_defaults("image_size")
        + ")",
        default=None,
        parse=positive_int,
    )
    batch_size: int | None = option(
        "samples per training step (default: the task's: " + _task_defaults("batch_size") + ")",
        default=None,
        parse=positive_int,
    )
    lr: float | None = option(
        "the learning rate, AdamW (default: the task's: " + _task_defaults("lr") + ")",
        default=None,
        parse=positive_float,
    )
    tune_budget_s: float = option(
        "seconds for the loader search", default=6.0, parse=positive_float
    )

    def resolved(self) -> DemoConfig:
        """A copy with the folder and every option left unset filled in from the task."""
        task = demo_task(self.task)
        unset = {f: getattr(task, f) for f in _TASK_OPTIONS if getattr(self, f) is None}
        return dataclasses.replace(self, out=self.out or default_demo_dir(), **unset)


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
    """Run the demo of ``config.task`` (in `default_demo_dir` when ``config.out`` is empty) and
    write its resolved config there as `CONFIG_NAME`; returns the process exit code (0 when
    every step succeeded)."""
    config = config.resolved()
    task, out = demo_task(config.task), config.out
    _prepare(out)
    write_config_file(os.path.join(out, CONFIG_NAME), config)
    console.print(
        f"dlpipe demo → {escape(os.path.abspath(out))} (about {task.time} on 2 CPU "
        "cores with the defaults; --epochs 0 converts and verifies only)"
    )
    raw, train_samples = _generate(config, console)
    conversions, ok = _convert_all(config, raw, console)
    console.print(conversions)
    if not ok or config.epochs == 0:
        inspect = os.path.join(out, f"{task.dataset}-wds")
        console.print(f"inspect any of them: dlpipe inspect {escape(inspect)}")
        return 0 if ok else 1
    data = os.path.join(out, f"{task.dataset}-{TRAIN_FORMAT}")
    assert config.batch_size is not None  # resolved
    if train_samples < 2 * config.batch_size:  # a tiny demo (--per-class): smaller batches
        config = dataclasses.replace(config, batch_size=max(1, train_samples // 2))
    # the search needs less time on a small dataset (it reads it over and over)
    budget = min(config.tune_budget_s, max(3.0, train_samples / 100))
    config = dataclasses.replace(config, tune_budget_s=budget)
    tuned = _tune(config, data, console)
    trained = _train(config, data, console)
    console.print(_summary(task, data, tuned, trained), highlight=False, markup=False)
    return 0


def _generate(config: DemoConfig, console: Console) -> tuple[str, int]:
    """The raw dataset of the task under ``out/raw``; returns its folder and train count."""
    start = time.perf_counter()
    raw = os.path.join(config.out, "raw")
    assert config.per_class is not None  # resolved
    images = config.per_class * len(SHAPE_CLASSES)
    if config.task == "classification":
        counts = write_imagefolder(raw, split_samples(config.per_class, seed=config.seed))
        what, train = f"JPEGs of {len(SHAPE_CLASSES)} shape classes", counts["train"]
    else:
        val = images // VAL_EVERY
        train = images - val
        write = write_coco if config.task == "detection" else write_voc_segmentation
        write(raw, train, val, seed=config.seed, size=SCENE_SIZE)
        layout = "COCO's" if config.task == "detection" else "Pascal VOC's segmentation"
        what = f"{SCENE_SIZE} px scenes of 1-4 shapes in {layout} layout"
        counts = {"train": train, "val": val}
    console.print(
        f"1/4 generated {sum(counts.values())} {what} "
        f"({counts['train']} train, {counts['val']} val) in {time.perf_counter() - start:.1f} s"
    )
    return raw, train


def _convert_all(config: DemoConfig, raw: str, console: Console) -> tuple[Table, bool]:
    table = Table(
        "format", "folder", "samples", "shards", "size", "samples/s", "verified", title="convert"
    )
    from dlpipe.converters.engine import convert  # dlpipe.convert; the recipe wires the rooms

    ok, prefix = True, demo_task(config.task).dataset
    for name in FORMATS:
        folder = os.path.join(config.out, f"{prefix}-{name}")
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


def _loader_config(config: DemoConfig) -> Any:
    """The training loader's config, as the trainer makes it (so it finds the tuned profile)."""
    from dlpipe.loading.config import LoaderConfig

    assert config.batch_size is not None and config.image_size is not None  # resolved
    loader = LoaderConfig(
        batch_size=config.batch_size, image_size=config.image_size, seed=config.seed
    )
    if config.task == "classification":
        loader = dataclasses.replace(loader, min_crop_scale=MIN_CROP_SCALE)
    return loader


def _tune(config: DemoConfig, data: str, console: Console) -> Any:
    from dlpipe.loading.tune import bench_loader, save_winner
    from dlpipe.loading.tune_stages import BenchConfig

    bench = BenchConfig(
        path=data,
        loader=_loader_config(config),
        budget_s=config.tune_budget_s,
        max_workers=max(2, config.workers),
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

    classify = config.task == "classification"
    loader: dict[str, Any] = {"image_size": config.image_size}
    optim: dict[str, Any] = {"optimizer": "adamw", "lr": config.lr, "warmup_epochs": 1.0}
    if classify:  # the shapes fill a third of the image; the classes are easy to overfit
        loader["min_crop_scale"] = MIN_CROP_SCALE
        optim["label_smoothing"] = 0.1
    train_config = load_config(
        None,
        {
            "data": {"path": data, **loader},
            "model": {"task": config.task, "name": config.model},
            "optim": optim,
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
    console.print(
        f"4/4 training {escape(str(config.model))} for {config.epochs} epochs (dlpipe train)"
    )
    trainer = Trainer(train_config, console, show_config=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _summary(task: DemoTask, data: str, tuned: Any, trained: Any) -> str:
    """Plain lines (paths stay whole, to copy and paste)."""
    run, best = trained.run_dir, tuned.best
    score = (trained.last_val or {}).get(task.metric)
    shown = "-" if score is None else f"{100 * score:.1f}%"
    if score is not None and task.metric == "map_50":  # COCO's mAP reads as a fraction
        shown = f"{score:.3f}"
    picture = f"{task.picture}:"
    lines = [
        "dlpipe demo: summary",
        f"  loader:           {best.settings.engine}, num_workers={best.settings.num_workers}, "
        f"prefetch_factor={best.settings.prefetch_factor}, pin_memory="
        f"{best.settings.pin_memory}: {best.samples_per_s:.0f} "
        "samples/s",
        f"  verdict:          {tuned.advice}",
        f"  {task.metric_label + ':':<17} {shown} after {trained.epochs_done} epochs",
        f"  metrics:          {os.path.join(run, 'metrics.jsonl')}",
        f"  {picture:<17} {os.path.join(run, task.picture_file)}",
        f"  TensorBoard:      tensorboard --logdir {os.path.join(run, 'tensorboard')}",
        f"  checkpoints:      {os.path.join(run, 'checkpoints')}",
        f"  next:             dlpipe train {data} --model {task.next_model}, or convert your "
        "own data",
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
        "on 2 CPU cores; --task detection or segmentation: boxes or masks, a few minutes)",
    )
