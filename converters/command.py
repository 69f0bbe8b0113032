"""``dlpipe convert``: its arguments, its progress bar and its closing summary."""

from __future__ import annotations

import argparse
import os
import re

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dlpipe import storage
from dlpipe.cli import Interrupted, int_in_range, non_negative_int, positive_int
from dlpipe.converters.engine import (
    ERRORS_NAME,
    ConvertConfig,
    ConvertResult,
    convert,
)
from dlpipe.converters.plan import Plan
from dlpipe.converters.sources import SOURCE_KINDS
from dlpipe.converters.worker import TaskResult
from dlpipe.formats import FORMATS
from dlpipe.inspection import format_bytes

__all__ = ["add_convert_parser", "parse_size", "run_convert"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_size(text: str) -> int:
    """``"256MB"`` → 256000000; ``"64MiB"``, ``"1.5GB"``, ``"500000"`` (bytes) also work."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes with an optional unit, e.g. 256MB or 64MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="turn raw data into verified shards with a manifest")
    p.add_argument(
        "raw",
        help="raw data: a folder (class folders, key.ext files, CIFAR/MNIST "
        "files) or a table (CSV/TSV/JSONL/Parquet)",
    )
    p.add_argument("--to", required=True, choices=sorted(FORMATS), help="shard format")
    p.add_argument(
        "--out",
        help="output folder or URL (default: $DLPIPE_DATA_DIR/<name>-<fmt>, "
        "else <raw>-<fmt> beside the raw data)",
    )
    p.add_argument("--source", default="auto", choices=["auto", *SOURCE_KINDS])
    p.add_argument("--image-col", help="table column holding image paths or bytes")
    p.add_argument(
        "--label-col",
        help="table column holding labels (names or integers); none: the table has no labels",
    )
    p.add_argument(
        "--image-root",
        metavar="DIR",
        help="folder a table's image paths are looked up in after the table's own folder "
        "(default: the one sub-folder beside the table that holds them)",
    )
    p.add_argument(
        "--keep-empty-classes",
        action="store_true",
        help="keep class folders without images as classes with no samples (else refused)",
    )
    p.add_argument(
        "--shard-size",
        type=parse_size,
        help="target bytes per shard (e.g. 256MB; "
        "default: about 64 shards per split, 1 MiB to 256 MiB each)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="worker processes (default: all cores)",
    )
    p.add_argument(
        "--max-side",
        type=int_in_range(8),
        help="re-encode images whose longer side exceeds N (at least 8)",
    )
    p.add_argument(
        "--quality",
        type=int_in_range(1, 100),
        default=95,
        help="JPEG/WebP quality when re-encoding (1..100)",
    )
    p.add_argument(
        "--val-fraction",
        type=_fraction,
        help="move this fraction of each class to a val split (when there is none)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seeds the shuffle and the val split"
    )
    p.add_argument(
        "--on-error",
        choices=["skip", "fail"],
        default="skip",
        help=f"a bad sample is skipped and listed in {ERRORS_NAME}, or stops the run",
    )
    p.add_argument("--resume", action="store_true", help="finish an interrupted conversion")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset in --out")
    p.add_argument("--engine", choices=["local", "ray"], default="local")
    p.add_argument("--ray-address", help="Ray cluster address (default: start or find one)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace, console: Console) -> int:
    config = ConvertConfig(
        raw=args.raw,
        to=args.to,
        out=args.out,
        source=args.source,
        image_col=args.image_col,
        label_col=args.label_col,
        image_root=args.image_root,
        keep_empty_classes=args.keep_empty_classes,
        shard_bytes=args.shard_size,
        workers=args.workers,
        max_side=args.max_side,
        quality=args.quality,
        val_fraction=args.val_fraction,
        seed=args.seed,
        on_error=args.on_error,
        resume=args.resume,
        overwrite=args.overwrite,
        engine=args.engine,
        ray_address=args.ray_address,
    )
    out = config.output()
    console.print(
        f"dlpipe convert {escape(config.raw)} → {escape(out)} ({config.to}, engine {config.engine})"
    )
    if storage.on_system_disk(out):
        console.print(
            f"[yellow]warning[/yellow]: {escape(out)} is on the system disk (the one holding /); "
            "put datasets on a data disk with --out or DLPIPE_DATA_DIR"
        )
    try:
        result = _convert_with_progress(config, console)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; finish with: {config.command('--resume')}") from None
    _summary(result, console)
    return 0


def _convert_with_progress(config: ConvertConfig, console: Console) -> ConvertResult:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} samples"),
        TextColumn("{task.fields[samples_per_s]:.0f} samples/s {task.fields[mb_per_s]:.1f} MB/s"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as progress:
        bar = progress.add_task("converting", total=None, samples_per_s=0.0, mb_per_s=0.0, mb=0.0)

        def start(plan: Plan) -> None:
            progress.update(bar, total=sum(len(t.items) for t in plan.tasks))

        def advance(result: TaskResult) -> None:
            task = progress.tasks[bar]
            elapsed = max(task.elapsed or 0.0, 1e-3)
            mb = task.fields["mb"] + result.payload_bytes / 1e6
            written = result.info.samples if result.info else 0
            done = task.completed + written + len(result.skipped)
            progress.update(
                bar, completed=done, mb=mb, mb_per_s=mb / elapsed, samples_per_s=done / elapsed
            )

        return convert(config, on_start=start, on_progress=advance)


def _summary(result: ConvertResult, console: Console) -> None:
    table = Table("split", "samples", "shards", "size", title=f"wrote {escape(result.out)}")
    for name, split in result.manifest.splits.items():
        table.add_row(
            escape(name), str(split.samples), str(len(split.shards)), format_bytes(split.bytes)
        )
    console.print(table)
    written = sum(s.samples for s in result.manifest.splits.values())
    rate = written / result.seconds if result.seconds else 0.0
    console.print(
        f"{written} samples in {result.seconds:.1f} s ({rate:.0f} samples/s, "
        f"{result.payload_bytes / 1e6 / max(result.seconds, 1e-9):.1f} MB/s)"
        + (f"; resumed {result.resumed_shards} finished shards" if result.resumed_shards else "")
        + (f"; re-encoded {result.reencoded} images" if result.reencoded else "")
    )
    if result.skipped:
        console.print(
            f"[yellow]skipped {len(result.skipped)} samples[/yellow] (listed in "
            f"{escape(os.path.join(result.out, ERRORS_NAME))}), "
            f"e.g. {escape(str(result.skipped[0]['error']))}"
        )
    else:
        console.print("skipped 0 samples")
