"""`verify_dataset`: every shard's sha256 against the manifest, and optionally every sample decoded.

Problems are collected, not raised: the report names each bad shard (and sample), so one broken
shard does not hide another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from dlpipe import storage
from dlpipe.codecs import decode_sample
from dlpipe.errors import DlpipeError
from dlpipe.formats import get_format, require_storage
from dlpipe.manifest import Manifest, ShardInfo, read_manifest

__all__ = ["Problem", "VerifyReport", "verify_dataset"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the shard, the sample index when known, and what."""

    split: str
    shard: str
    message: str
    sample: int | None = None

    def __str__(self) -> str:
        where = f"{self.split}/{self.shard}" + (
            f" sample {self.sample}" if self.sample is not None else ""
        )
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    shards_checked: int = 0
    samples_decoded: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_dataset(
    path: str, *, decode: bool = False, on_shard: Callable[[str], None] | None = None
) -> VerifyReport:
    """Check every shard of the dataset at `path`.

    Args:
        path: the dataset folder (local path or fsspec URL).
        decode: also read every sample and decode every field by its codec.
        on_shard: called with each shard name once it is checked (for progress).

    Raises:
        ManifestNotFoundError, ManifestError: there is no valid manifest to verify against.
    """
    manifest = read_manifest(path)
    require_storage(get_format(manifest.format, manifest.format_version), path)
    report = VerifyReport(path=path)
    for split, info in manifest.splits.items():
        for shard in info.shards:
            problem = _check_file(path, split, shard)
            if problem is None and decode:
                problem = _decode_shard(path, manifest, split, shard, report)
            if problem is not None:
                report.problems.append(problem)
            report.shards_checked += 1
            if on_shard is not None:
                on_shard(shard.name)
    return report


def _check_file(path: str, split: str, shard: ShardInfo) -> Problem | None:
    digest = hashlib.sha256()
    size = 0
    try:
        with storage.open_read(storage.join(path, shard.name)) as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        return Problem(split, shard.name, "missing (the manifest lists it)")
    if size != shard.bytes:
        return Problem(split, shard.name, f"{size} bytes, the manifest says {shard.bytes}")
    if digest.hexdigest() != shard.sha256:
        return Problem(
            split, shard.name, f"sha256 {digest.hexdigest()} != manifest {shard.sha256} (corrupt)"
        )
    return None


def _decode_shard(
    path: str, manifest: Manifest, split: str, shard: ShardInfo, report: VerifyReport
) -> Problem | None:
    fmt = get_format(manifest.format, manifest.format_version)
    reader = fmt.reader(storage.join(path, shard.name), shard, list(manifest.fields))
    index = 0
    try:
        for sample in reader:
            decode_sample(sample)
            index += 1
            report.samples_decoded += 1
    except DlpipeError as exc:
        return Problem(split, shard.name, str(exc), index)
    finally:
        reader.close()
    return None
