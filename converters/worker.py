"""One shard of a conversion: load its planned items, check images, write the shard.

`write_task` runs in a worker process (local pool or Ray task) and returns a `TaskResult`
that the engine journals. It is a pure function of its arguments, so any engine, and any
retry after a crash, writes the same bytes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dlpipe.annotations import AnnotationError, fit_annotations
from dlpipe.codecs import stable_message
from dlpipe.converters.audit import file_digest
from dlpipe.converters.images import ImagePolicy, image_dhash, prepare_image
from dlpipe.converters.plan import ShardTask
from dlpipe.converters.source import SampleError, Source
from dlpipe.errors import DlpipeError
from dlpipe.formats import get_format, write_shard
from dlpipe.formats.writer import record_shard_intent
from dlpipe.manifest import ShardInfo
from dlpipe.sample import Sample

__all__ = [
    "OutputFullError",
    "TaskResult",
    "WorkerConfig",
    "audit_task",
    "is_disk_full",
    "write_task",
]


class OutputFullError(DlpipeError, OSError):
    """The output's filesystem filled up while writing (``errno`` is ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[type[OutputFullError], tuple[str]]:
        return type(self), (str(self.strerror),)  # crosses from a worker process intact


def is_disk_full(exc: BaseException) -> bool:
    """True for an out-of-space or over-quota error, however the library worded it."""
    if not isinstance(exc, OSError):
        return False
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every shard task needs besides its items."""

    out: str
    format: str
    image: ImagePolicy
    on_error: str = "skip"
    num_classes: int | None = None
    """The class count box labels are checked against (None: not checked)."""


@dataclass
class TaskResult:
    """What one finished shard task reports (and the journal stores)."""

    split: str
    name: str
    info: ShardInfo | None
    labels: list[int] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    reencoded: int = 0
    payload_bytes: int = 0
    fields: list[str] = field(default_factory=list)
    fingerprints: list[tuple[str, str, int]] = field(default_factory=list)
    """(key, sha256 of the image file, dhash of the image) of each written sample, for the
    duplicate audit (`dlpipe.converters.audit`)."""


def write_task(source: Source, task: ShardTask, config: WorkerConfig) -> TaskResult:
    """Write the shard `task` plans; per-sample failures are skipped or fatal by policy.

    Raises:
        SampleError: with ``on_error="fail"``, the first sample that cannot be converted.
    """
    result = TaskResult(split=task.split, name=task.name, info=None)
    samples = _samples(source, task, config, result)
    try:
        record_shard_intent(config.out, task.name)
        result.info = write_shard(get_format(config.format), config.out, task.name, samples)
    except _EmptyShard:
        result.info = None  # every sample was skipped: no shard, the skips are reported
    except OSError as exc:
        if isinstance(exc, OutputFullError) or not is_disk_full(exc):
            raise
        raise OutputFullError(
            f"{config.out}: the disk filled up while writing shard {task.name} "
            f"({os.strerror(errno.ENOSPC) if exc.errno else exc})"
        ) from None
    return result


def audit_task(source: Source, task: ShardTask, config: WorkerConfig) -> TaskResult:
    """The fingerprints of the task's images, nothing written (``--dedup``'s first pass).

    A sample that cannot be read is left out here; the writing pass reports it.
    """
    result = TaskResult(split=task.split, name=task.name, info=None)
    for item in task.items:
        try:
            data = source.load(item).get("image")
            if data is not None:
                result.fingerprints.append((item.key, file_digest(data), image_dhash(data)))
        except SampleError:
            continue
    return result


class _EmptyShard(Exception):
    pass


def _samples(
    source: Source, task: ShardTask, config: WorkerConfig, result: TaskResult
) -> Iterator[Sample]:
    produced = 0
    for item in task.items:
        try:
            sample = _sample(source.load(item), item.key, item.origin, config, result)
        except SampleError as exc:
            if config.on_error == "fail":
                raise SampleError(f"{exc} (use --on-error skip to skip such samples)") from exc
            message = stable_message(exc)  # the same text run to run
            result.skipped.append({"key": item.key, "origin": item.origin, "error": message})
            continue
        if item.label is not None:
            sample["cls"] = str(item.label).encode("ascii")
            result.labels.append(item.label)
        if not produced:
            result.fields = [name for name in sample if name != "__key__"]
        produced += 1
        yield sample
    if not produced:
        raise _EmptyShard


def _sample(
    fields: dict[str, bytes], key: str, origin: str, config: WorkerConfig, result: TaskResult
) -> Sample:
    """The stored sample: the image checked (and re-encoded when asked), its annotations
    checked against it and following a resize."""
    sample: Sample = {"__key__": key}
    if "image" in fields:
        image = prepare_image(fields["image"], config.image, origin)
        result.reencoded += image.reencoded
        fingerprint = (key, file_digest(fields["image"]), image.dhash)
        try:
            fields = fit_annotations(fields, image.size_in, image.size_out, config.num_classes)
        except AnnotationError as exc:
            raise SampleError(f"{origin}: {exc}") from None
        fields = {config.image.field if n == "image" else n: v for n, v in fields.items()}
        fields[config.image.field] = image.data
        result.fingerprints.append(fingerprint)  # a sample that is written
    for name, data in fields.items():
        sample[name] = data
        result.payload_bytes += len(data)
    return sample
