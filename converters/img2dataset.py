"""img2dataset's per-shard metadata, for the ``webdataset`` source
(`dlpipe.converters.wds_source`).

Each ``NNNNN.parquet`` with a ``status`` column, else ``NNNNN_stats.json``, gives its tar's
status counts (``success``, ``failed_to_download``, ...); a tar holding another number of samples
than its metadata's successes, or metadata of successes without its tar, is refused.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlpipe.converters.source import (
    SampleError,
    SourceError,
    display_path,
    file_stamp,
    open_regular,
    read_file,
)
from dlpipe.converters.wds_tars import Tar, Walk, most_common

__all__ = ["MAX_META_BYTES", "Sidecars"]

MAX_META_BYTES = 256 << 20  # a sidecar Parquet or stats file (img2dataset's: a few MB)
_IMG2DATASET_COUNTS = {"successes": "success", "failed_to_download": "failed_to_download",
                       "failed_to_resize": "failed_to_resize"}  # fmt: skip


def _stats_counts(path: str, folder: str) -> Counter[str] | None:
    """img2dataset's ``NNNNN_stats.json``: status → count; None when it is not one."""
    try:
        stats = json.loads(read_file(path, folder, max_bytes=MAX_META_BYTES).decode("utf-8"))
    except (SampleError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise SourceError(
            f"{display_path(path)}: cannot be read as JSON ({exc}); restore it or remove it"
        ) from exc
    if not isinstance(stats, dict) or "successes" not in stats:
        return None
    counts: Counter[str] = Counter()
    for name, status in _IMG2DATASET_COUNTS.items():
        value = stats.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SourceError(
                f"{display_path(path)}: {name!r} is {value!r}, not a count; img2dataset writes "
                f"{', '.join(_IMG2DATASET_COUNTS)} as integers (restore it or remove it)"
            )
        counts[status] += value
    return counts


def _parquet_statuses(path: str, folder: str) -> Counter[str] | None:
    """img2dataset's ``NNNNN.parquet``: status → rows; None when it has no ``status`` column."""
    try:
        with open_regular(path, folder) as f:
            if file_stamp(f)[0] > MAX_META_BYTES:
                raise SourceError(f"{display_path(path)}: over {MAX_META_BYTES} bytes")
            if "status" not in pq.read_schema(f).names:
                return None
            f.seek(0)
            column = pq.read_table(f, columns=["status"]).column("status")
    except SampleError as exc:
        raise SourceError(f"{exc}; restore it or remove it") from exc
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(
            f"{display_path(path)}: cannot be read as Parquet ({exc}); restore it or remove it"
        ) from exc
    return Counter(str(status) for status in column.to_pylist())


@dataclass
class Sidecars:
    """img2dataset's per-shard metadata: tar path → status counts, and how many files."""

    counts: dict[str, Counter[str]] = field(default_factory=dict)
    used: int = 0

    @classmethod
    def read(cls, files: list[str], tars: set[str], folder: str) -> Sidecars:
        """Each ``NNNNN.parquet`` with a status column, else ``NNNNN_stats.json``."""
        found = cls()
        for path in sorted(files):  # NNNNN.parquet sorts before NNNNN_stats.json
            if path.endswith(".parquet"):
                base, counts = path[: -len(".parquet")], _parquet_statuses(path, folder)
            elif path.endswith("_stats.json"):
                base = path[: -len("_stats.json")]
                read = base + ".tar" in found.counts  # from its parquet
                counts = found.counts[base + ".tar"] if read else _stats_counts(path, folder)
            else:
                continue
            if counts is None:
                continue
            found.used += 1
            if base + ".tar" in tars:
                found.counts.setdefault(base + ".tar", counts)
            elif counts["success"]:
                raise SourceError(
                    f"{display_path(path)} lists {counts['success']} downloaded images but "
                    f"{display_path(base)}.tar is missing: restore it, or remove its metadata "
                    "to convert without it"
                )
        return found

    def check(self, walks: list[tuple[Tar, Walk]]) -> None:
        """Each whole tar holds as many samples as its metadata's successes."""
        for tar, walk in walks:
            counts = self.counts.get(tar.path)
            held = sum(s.status in (None, "success") for s in walk.samples)
            if counts is None or walk.damage is not None or held == counts["success"]:
                continue
            raise SourceError(
                f"{display_path(tar.path)} holds {held} samples but its img2dataset metadata "
                f"lists {counts['success']} successes: the tar is incomplete; download the shard "
                "again, or remove its .parquet and _stats.json to convert the tar as it is"
            )

    def report(self, not_success: int) -> dict[str, Any]:
        if not self.counts:
            return {}
        total: Counter[str] = Counter()
        for counts in self.counts.values():
            total.update(counts)
        return {"img2dataset": {**most_common(total), "not_success_in_tars": not_success}}
