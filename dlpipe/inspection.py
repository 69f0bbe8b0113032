"""`describe_dataset`: what ``dlpipe inspect`` shows, as plain data and as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dlpipe.manifest import read_manifest

__all__ = ["describe_dataset", "format_bytes", "print_description"]


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KB"`` (powers of 1000, as disks are sold)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def describe_dataset(path: str) -> dict[str, Any]:
    """Format, splits with counts and sizes, fields, classes with per-split counts."""
    manifest = read_manifest(path)
    splits = {
        name: {
            "samples": info.samples,
            "shards": len(info.shards),
            "bytes": info.bytes,
            "class_counts": list(info.class_counts) if info.class_counts is not None else None,
        }
        for name, info in manifest.splits.items()
    }
    return {
        "path": path,
        "format": manifest.format,
        "format_version": manifest.format_version,
        "dlpipe_version": manifest.dlpipe_version,
        "samples": sum(s["samples"] for s in splits.values()),
        "bytes": sum(s["bytes"] for s in splits.values()),
        "fields": manifest.fields,
        "classes": list(manifest.classes),
        "splits": splits,
        "options": manifest.options,
        "source": manifest.source,
    }


def print_description(info: dict[str, Any], console: Console) -> None:
    """`describe_dataset`'s result as a header line and tables (dataset text printed escaped)."""
    console.print(
        f"[bold]{_text(info['path'])}[/bold]: {_text(info['format'])} "
        f"v{_text(info['format_version'])}, {info['samples']} samples, "
        f"{format_bytes(info['bytes'])} (written by dlpipe {_text(info['dlpipe_version'])})"
    )
    fields = ", ".join(f"{_text(k)} ({_text(v)})" for k, v in info["fields"].items())
    console.print(f"fields: {fields}")
    splits = Table("split", "samples", "shards", "size", "avg/sample", title="splits")
    for name, s in info["splits"].items():
        avg = s["bytes"] / s["samples"] if s["samples"] else 0
        splits.add_row(
            _text(name),
            str(s["samples"]),
            str(s["shards"]),
            format_bytes(s["bytes"]),
            format_bytes(avg),
        )
    console.print(splits)
    if info["classes"]:
        console.print(_classes_table(info))


def _classes_table(info: dict[str, Any]) -> Table:
    names = list(info["splits"])
    table = Table("label", "class", *map(_text, names), title=f"{len(info['classes'])} classes")
    counts = [info["splits"][n]["class_counts"] for n in names]
    for label, cls in enumerate(info["classes"]):
        table.add_row(str(label), _text(cls), *(_count(c, label) for c in counts))
    return table


def _count(counts: Any, label: int) -> str:
    """One class's count, or "-" where the manifest has none (or too few: never IndexError)."""
    if isinstance(counts, (list, tuple)) and label < len(counts):
        return str(counts[label])
    return "-"


def _text(value: Any) -> str:
    """Dataset text (paths, names) as literal text, never rich markup."""
    return escape(str(value))
