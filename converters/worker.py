"""One shard of a conversion: load its planned items, check images, write the shard.

`write_task` runs in a worker process (local pool or Ray task) and returns a `TaskResult`
that the engine journals. It is a pure function of its arguments, so any engine, and any
retry after a crash, writes the same bytes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlpipe.annotations import AnnotationError, fit_annotations
from dlpipe.codecs import stable_message
from dlpipe.converters.audit import Fingerprint
from dlpipe.converters.images import ImagePolicy, PreparedImage, image_dhash, prepare_image
from dlpipe.converters.plan import ShardTask
from dlpipe.converters.source import Item, SampleError, Source
from dlpipe.errors import DlpipeError
from dlpipe.formats import get_format, write_shard
from dlpipe.formats.owned import record_shard_intent
from dlpipe.manifest import ShardInfo
from dlpipe.sample import Sample

__all__ = [
    "OutputFullError",
    "TaskResult",
    "WorkerConfig",
    "audit_task",
    "image_reader",
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
    fingerprints: list[tuple[Any, ...]] = field(default_factory=list)
    """(key, size of the image file, dhash of the image) of each written sample: a
    `dlpipe.converters.audit.Fingerprint` less its split, for the duplicate audit (which reads
    again, through `image_reader`, only the files of a group that could be exact copies)."""


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
                result.fingerprints.append(_fingerprint(item.key, data, image_dhash(data)))
        except SampleError:
            continue
    return result


def image_reader(source: Source, tasks: Sequence[ShardTask]) -> Callable[[Fingerprint], bytes]:
    """What the duplicate audit reads a candidate's image file with (`find_duplicates`'s
    `read`): the bytes `source` gives for the planned item of that split and key, read with
    the same checks as the shard tasks' reads.

    Raises (when called):
        SampleError: the file cannot be read any more.
    """
    items = {(task.split, item.key): item for task in tasks for item in task.items}
    return lambda fingerprint: source.load(items[fingerprint.split, fingerprint.key])["image"]


def _fingerprint(key: str, data: bytes, dhash: int) -> tuple[Any, ...]:
    return key, len(data), dhash


class _EmptyShard(Exception):
    pass


def _samples(
    source: Source, task: ShardTask, config: WorkerConfig, result: TaskResult
) -> Iterator[Sample]:
    produced = 0
    for item in task.items:
        try:
            sample = _sample(source.load(item), item, config, result)
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
    fields: dict[str, bytes], item: Item, config: WorkerConfig, result: TaskResult
) -> Sample:
    """The stored sample: the image checked (and re-encoded when asked), its annotations
    checked against it and following a resize."""
    sample: Sample = {"__key__": item.key}
    data = fields.get("image")
    if data is not None:
        image = prepare_image(data, config.image, item.origin)
        result.reencoded += image.reencoded
        if len(fields) > 1:  # annotations
            fields = _fitted(fields, image, item.origin, config)
        fields = {config.image.field if n == "image" else n: v for n, v in fields.items()}
        fields[config.image.field] = image.data
        result.fingerprints.append(_fingerprint(item.key, data, image.dhash))
    for name, value in fields.items():
        sample[name] = value
        result.payload_bytes += len(value)
    return sample


def _fitted(
    fields: dict[str, bytes], image: PreparedImage, origin: str, config: WorkerConfig
) -> dict[str, bytes]:
    try:
        return fit_annotations(fields, image.size_in, image.size_out, config.num_classes)
    except AnnotationError as exc:
        raise SampleError(f"{origin}: {exc}") from None
