"""``dlpipe demo``: the whole system on the embedded shapes dataset, with no network.

It generates the raw ImageFolder, converts it to every format with ``dlpipe convert``'s engine
and verifies each, tunes the loader with ``dlpipe bench-loader``'s search (saving the profile),
trains a small torchvision model with ``dlpipe train``'s trainer, and prints a summary: the
conversion throughput per format, the tuned loader settings and verdict, the final validation
top-1, and where the metrics, confusion matrix, TensorBoard logs and checkpoints are.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlpipe.converters.engine import ConvertConfig, convert
from dlpipe.errors import OutputExistsError
from dlpipe.formats import FORMATS
from dlpipe.inspection import describe_dataset, format_bytes
from dlpipe.synthetic import SHAPE_CLASSES, split_samples, write_imagefolder
from dlpipe.verify import verify_dataset

__all__ = ["DemoConfig", "default_demo_dir", "run_demo"]

_MARKER = ".dlpipe-demo"
TRAIN_FORMAT = "lmdb"  # the one the demo tunes and trains on; every format would do


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: str
    per_class: int = 400
    seed: int = 0
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    epochs: int = 12  # 0: convert and verify only
    model: str = "resnet18"
    image_size: int = 40
    batch_size: int = 64
    tune_budget_s: float = 20.0


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
    """Run the demo; returns the process exit code (0 when every step succeeded)."""
    out = config.out
    _prepare(out)
    console.print(f"dlpipe demo → {escape(os.path.abspath(out))}")
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
    ok = True
    for name in FORMATS:
        folder = os.path.join(config.out, f"shapes-{name}")
        result = convert(ConvertConfig(raw=raw, to=name, out=folder, workers=config.workers))
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
    from dlpipe.loading.tune import BenchConfig, bench_loader, save_winner

    bench = BenchConfig(
        path=data,
        batch_size=config.batch_size,
        image_size=config.image_size,
        budget_s=config.tune_budget_s,
        max_workers=max(2, config.workers),
    )
    report = bench_loader(bench)
    saved = save_winner(report)
    best = report.best
    assert best is not None
    console.print(
        f"3/4 tuned the loader (dlpipe bench-loader): num_workers={best.num_workers} "
        f"prefetch_factor={best.prefetch_factor} pin_memory={best.pin_memory}, "
        f"{best.samples_per_s:.0f} samples/s; saved to {escape(str(saved))}"
    )
    return report


def _train(config: DemoConfig, data: str, console: Console) -> Any:
    from dlpipe.train.config import load_config
    from dlpipe.train.trainer import Trainer

    train_config = load_config(
        None,
        {
            # the shapes fill a third of the image: crops keep at least half of it
            "data": {"path": data, "image_size": config.image_size, "min_crop_scale": 0.5},
            "model": {"name": config.model},
            "optim": {
                "optimizer": "adamw",
                "lr": 3e-3,
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
        f"  loader:           num_workers={best.num_workers}, prefetch_factor="
        f"{best.prefetch_factor}, pin_memory={best.pin_memory}: {best.samples_per_s:.0f} "
        "samples/s",
        f"  verdict:          {tuned.advice}",
        f"  val top-1:        {accuracy} after {trained.epochs_done} epochs",
        f"  metrics:          {os.path.join(run, 'metrics.jsonl')}",
        f"  confusion matrix: {os.path.join(run, 'confusion.png')}",
        f"  TensorBoard:      tensorboard --logdir {os.path.join(run, 'tensorboard')}",
        f"  checkpoints:      {os.path.join(run, 'checkpoints')}",
        f"  next:             dlpipe train {data} --model resnet50, or convert your own data",
    ]
    return "\n".join(lines)
