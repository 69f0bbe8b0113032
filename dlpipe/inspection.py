"""`describe_dataset`: what ``dlpipe inspect`` shows, as plain data and as rich tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from dlpipe.dataset_names import DUPLICATES_NAME
from dlpipe.manifest import read_manifest
from dlpipe.text import shown

__all__ = [
    "describe_dataset",
    "duplicates_line",
    "format_bytes",
    "print_description",
    "source_lines",
]


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
        "task": manifest.task,
        "field_schemas": manifest.field_schemas,
        "class_ids": list(manifest.class_ids) if manifest.class_ids is not None else None,
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
    if info.get("task"):
        console.print(f"task: {_text(info['task'])}")
    for name, schema in (info.get("field_schemas") or {}).items():
        console.print(f"  {_text(name)}: {_text(', '.join(f'{k}={v}' for k, v in schema.items()))}")
    source = info.get("source") or {}
    for line in source_lines(source):
        console.print(line)
    audit = duplicates_line(source.get("duplicates"))
    if audit:
        console.print(audit)
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
    ids = info.get("class_ids")
    if ids is not None:
        table.add_column("id")
    for label, cls in enumerate(info["classes"]):
        own = (_text(ids[label]),) if ids is not None and label < len(ids) else ()
        table.add_row(str(label), _text(cls), *(_count(c, label) for c in counts), *own)
    return table


def _count(counts: Any, label: int) -> str:
    """One class's count, or "-" where the manifest has none (or too few: never IndexError)."""
    if isinstance(counts, (list, tuple)) and label < len(counts):
        return str(counts[label])
    return "-"


def _text(value: Any) -> str:
    """Dataset text (paths, names) as literal text: never rich markup, no control character
    (`dlpipe.text.shown`; the manifest keeps the names as they are)."""
    return shown(value)


def source_lines(account: Any) -> list[str]:
    """What was read and why, and what was not used, as printable lines (escaped: a manifest
    is untrusted text, and a malformed entry is left out, never an error)."""
    if not isinstance(account, dict):
        return []
    lines = []
    if "kind" in account:
        why = f": {account['layout']}" if account.get("layout") else ""
        lines.append(f"source: {_text(account['kind'])}{_text(why)}")
    archives = account.get("archives")
    if isinstance(archives, dict) and isinstance(archives.get("read"), list) and archives["read"]:
        read = [_text(str(a)) for a in archives["read"]]
        names = ", ".join(read[:3]) + (f" and {len(read) - 3} more" if len(read) > 3 else "")
        skipped = _count_of(archives.get("skipped_members"))
        left = f"; {skipped} members skipped" if skipped else ""
        members = _count_of(archives.get("members"))
        lines.append(f"archives: read in place: {names} ({members} files{left})")
    unused = account.get("unused")
    if isinstance(unused, dict) and any(_count_of(n) for n in unused.values()):
        counts = ", ".join(f"{_count_of(n)} {_text(k)}" for k, n in unused.items() if _count_of(n))
        lines.append(f"not used: {counts}")
    return lines


def duplicates_line(report: Any) -> str | None:
    """The duplicate audit's line (`dlpipe.converters.audit`), or None when none was run."""
    if not isinstance(report, dict):
        return None
    exact, near, groups, leaking, dropped, audited = (
        _count_of(report.get(k))
        for k in ("exact", "near", "groups", "leaking", "dropped", "audited")
    )
    if not groups:
        return f"duplicates: none among {audited} images"
    found = f"{exact} exact and {near} near duplicates"
    leak = f", [yellow]{leaking} groups across splits (leakage)[/yellow]" if leaking else ""
    if dropped:
        return f"duplicates: {found}{leak}; --dedup left out {dropped} copies"
    return f"duplicates: {found}{leak} (listed in {DUPLICATES_NAME}; --dedup drops them)"


def _count_of(value: Any) -> int:
    """A count from untrusted JSON: a non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
