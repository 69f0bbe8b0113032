"""``dlpipe demo``: the whole system on the embedded shapes dataset, with no network.

Today it generates the raw ImageFolder, converts it to every format with ``dlpipe convert``'s
engine, verifies each and shows what ``dlpipe inspect`` shows. It grows with the project until
it runs the whole pipeline.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from dlpipe.converters.engine import ConvertConfig, convert
from dlpipe.errors import OutputExistsError
from dlpipe.formats import FORMATS
from dlpipe.inspection import describe_dataset, format_bytes, print_description
from dlpipe.synthetic import SHAPE_CLASSES, split_samples, write_imagefolder
from dlpipe.verify import verify_dataset

__all__ = ["DemoConfig", "default_demo_dir", "run_demo"]

_MARKER = ".dlpipe-demo"


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: str
    per_class: int = 400
    seed: int = 0
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)


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
    """Run the demo; returns the process exit code (0 when every dataset verifies)."""
    out = config.out
    _prepare(out)
    console.print(f"dlpipe demo → {os.path.abspath(out)}")
    start = time.perf_counter()
    pairs = list(split_samples(config.per_class, seed=config.seed))
    raw = os.path.join(out, "raw")
    counts = write_imagefolder(raw, pairs)
    console.print(
        f"generated {sum(counts.values())} JPEGs of {len(SHAPE_CLASSES)} shape classes "
        f"({counts['train']} train, {counts['val']} val) in {time.perf_counter() - start:.1f} s"
    )
    summary = Table("format", "folder", "samples", "shards", "size", "samples/s", "verified")
    ok = True
    for name in FORMATS:
        folder = os.path.join(out, f"shapes-{name}")
        result = convert(ConvertConfig(raw=raw, to=name, out=folder, workers=config.workers))
        rate = sum(s.samples for s in result.manifest.splits.values()) / result.seconds
        report = verify_dataset(folder, decode=True)
        ok &= report.ok
        info = describe_dataset(folder)
        shards = sum(s["shards"] for s in info["splits"].values())
        summary.add_row(
            name,
            os.path.basename(folder),
            str(info["samples"]),
            str(shards),
            format_bytes(info["bytes"]),
            f"{rate:.0f}",
            "ok" if report.ok else f"{len(report.problems)} problems",
        )
        for problem in report.problems:
            console.print(f"[red]{problem}[/red]")
    print_description(describe_dataset(os.path.join(out, "shapes-lmdb")), console)
    console.print(summary)
    console.print(f"inspect any of them: dlpipe inspect {os.path.join(out, 'shapes-wds')}")
    return 0 if ok else 1
