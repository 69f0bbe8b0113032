"""``dlpipe convert``: its arguments, its progress bar and its closing summary."""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dlpipe import storage
from dlpipe.converters.engine import ConvertConfig, ConvertResult, convert
from dlpipe.converters.plan import Plan
from dlpipe.converters.worker import TaskResult
from dlpipe.dataset_names import DUPLICATES_NAME, ERRORS_NAME
from dlpipe.inspection import duplicates_line, format_bytes, source_lines
from dlpipe.options import add_config_command
from dlpipe.text import Interrupted, shown

__all__ = ["add_convert_parser", "run_convert"]


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    """``dlpipe convert``: one argument per `ConvertConfig` option, and ``--config FILE``."""
    help = "turn raw data into verified shards with a manifest"
    add_config_command(sub, "convert", ConvertConfig, run_convert, help=help)


def run_convert(config: ConvertConfig, console: Console) -> int:
    """Convert with a progress bar, print the summary."""
    out = config.output()
    console.print(
        f"dlpipe convert {shown(config.raw)} → {shown(out)} "
        f"({config.to}, engine {config.engine.kind})"
    )
    if storage.on_system_disk(out):
        console.print(
            f"[yellow]warning[/yellow]: {shown(out)} is on the system disk (the one holding /); "
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
            for line in source_lines(plan.source):
                console.print(line)
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
    manifest = result.manifest
    if result.discarded_shards:
        console.print(
            f"deleted {result.discarded_shards} shards of an unfinished append (never listed "
            "in the manifest) before appending"
        )
    added = manifest.version_records()[-1]
    title = f"wrote {shown(result.out)}"
    if manifest.version > 1:
        title = f"appended version {manifest.version} to {shown(result.out)}"
    table = Table("split", "samples", "shards", "size", title=title)
    for name, split in manifest.splits.items():
        part = added.splits.get(name)
        new = f" (+{part.samples})" if manifest.version > 1 and part is not None else ""
        table.add_row(
            shown(name), f"{split.samples}{new}", str(len(split.shards)), format_bytes(split.bytes)
        )
    console.print(table)
    written = sum(s.samples for s in added.splits.values())
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
            f"{shown(os.path.join(result.out, ERRORS_NAME))}), "
            f"e.g. {shown(str(result.skipped[0]['error']))}"
        )
    else:
        console.print("skipped 0 samples")
    source = added.source if manifest.version > 1 else manifest.source
    audit = duplicates_line(source.get("duplicates"))
    if audit:
        console.print(audit)
    _copies_line(source.get("duplicates"), console)


def _copies_line(report: object, console: Console) -> None:
    """With ``--append``: how many new samples are exact copies of the dataset's."""
    if not isinstance(report, dict):
        return
    copies = report.get("of_existing")
    if not isinstance(copies, int) or isinstance(copies, bool) or copies <= 0:
        return
    console.print(
        f"[yellow]{copies} new samples are exact copies of samples the dataset holds[/yellow] "
        f"(listed in {DUPLICATES_NAME}; "
        + ("--dedup left them out)" if report.get("dropped") else "--dedup leaves them out)")
    )
