"""`verify_dataset`: every shard against the manifest, and optionally every sample decoded.

Problems are collected, not raised: the report names each bad shard (and sample), so one broken
shard does not hide another. A prepared dataset is untrusted input, so:

- each shard must be a regular file inside the dataset folder (a symlink out of it, a FIFO or
  a device is a problem, never read), and is read no further than the manifest's byte count;
- its sample count is checked against the manifest (by reading every sample with ``decode``,
  else by the cheapest count the format allows), as are keys and labels with ``decode``;
- files that look like shards of the dataset's format but are not listed are reported (and
  left alone);
- shards are checked in a child process, so a crash in a C library (SIGBUS from a crafted LMDB
  page, an HDF5 abort) becomes a problem naming the shard; the next child goes on from the
  shard after it. (An in-memory fsspec URL, ``memory://``, lives in this process only and is
  checked here.)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from dlpipe import storage
from dlpipe.codecs import decode_sample
from dlpipe.dataset_names import JOURNAL_DIR
from dlpipe.errors import DlpipeError
from dlpipe.formats import ShardFormat, ShardReader, get_format, require_storage
from dlpipe.jpeg_seek import index_problem
from dlpipe.manifest import (
    MANIFEST_NAME,
    PROFILES_NAME,
    Manifest,
    ShardInfo,
    parse_manifest,
    read_manifest,
)
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["CheckerError", "Problem", "VerifyReport", "label_problem", "verify_dataset"]

SIDECARS = frozenset({MANIFEST_NAME, PROFILES_NAME, "errors.jsonl", "keys.jsonl"})
_LABEL_FIELD = "cls"
_CHILD = "from dlpipe.verify import _child_main; _child_main()"


class CheckerError(DlpipeError, RuntimeError):
    """The process that checks shards could not run at all (not a problem of one shard)."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the shard, the sample index when known, and what."""

    split: str
    shard: str
    message: str
    sample: int | None = None

    def __str__(self) -> str:
        where = f"{self.split}/{self.shard}" if self.split else self.shard
        if self.sample is not None:
            where += f" sample {self.sample}"
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
    path: str,
    *,
    decode: bool = False,
    on_shard: Callable[[str], None] | None = None,
    isolate: bool = True,
) -> VerifyReport:
    """Check every shard of the dataset at `path`, and the folder for unlisted shards.

    Args:
        path: the dataset folder (local path or fsspec URL).
        decode: also read every sample, decode every field by its codec and check its key and
            label.
        on_shard: called with each shard name once it is checked (for progress).
        isolate: check shards in a child process, so a reader that crashes the interpreter is
            reported as that shard's problem (the default; ``memory://`` URLs are always
            checked in this process).

    Raises:
        ManifestNotFoundError, ManifestError: there is no valid manifest to verify against.
        CheckerError: the child process that checks shards failed to start.
    """
    manifest = read_manifest(path)
    fmt = get_format(manifest.format, manifest.format_version)
    require_storage(fmt, path)
    report = VerifyReport(path=path)
    done = on_shard or (lambda name: None)
    if isolate and not path.startswith("memory://"):
        _check_in_children(path, manifest, decode, report, done)
    else:
        for split, shard in _shard_list(manifest):
            _record(report, *check_shard(path, manifest, split, shard, decode=decode))
            done(shard.name)
    report.problems.extend(unlisted_shards(path, manifest, fmt))
    return report


def check_shard(
    path: str, manifest: Manifest, split: str, shard: ShardInfo, *, decode: bool
) -> tuple[Problem | None, int]:
    """One shard's first problem (or None) and how many of its samples were decoded."""
    problem = _check_file(path, split, shard)
    if problem is not None:
        return problem, 0
    fmt = get_format(manifest.format, manifest.format_version)
    reader = fmt.reader(storage.join(path, shard.name), shard, list(manifest.fields_of(split)))
    try:
        if decode:
            return _decode_shard(reader, split, len(manifest.classes))
        return _count_problem(reader, split), 0
    finally:
        reader.close()


def label_problem(sample: Sample, num_classes: int) -> str | None:
    """What is wrong with a read sample's label, or None.

    With class names (`num_classes` > 0) the ``cls`` label must be a canonical decimal in
    ``0..num_classes - 1``. O(1) per sample. (The key rule, the fields and a canonical ``cls``
    are checked by every shard reader as it reads, in `ShardReader.make_sample`.)
    """
    label = sample.get(_LABEL_FIELD)
    if not num_classes or label is None:
        return None
    if isinstance(label, bytes) and _in_range(label, num_classes):
        return None
    shown = label[:24] if isinstance(label, bytes) else label
    return (
        f"sample {str(sample.get(KEY_FIELD))[:80]!r} has label cls={shown!r}, outside "
        f"0..{num_classes - 1} (the dataset has {num_classes} classes)"
    )


def _in_range(label: bytes, num_classes: int) -> bool:
    """A canonical decimal (no sign, no leading zero) below `num_classes`."""
    canonical = label.isdigit() and len(label) <= 19 and (label == b"0" or label[:1] != b"0")
    return canonical and int(label) < num_classes


def unlisted_shards(path: str, manifest: Manifest, fmt: ShardFormat) -> list[Problem]:
    """Files in the folder named like `fmt`'s shards that the manifest does not list (those
    an unfinished ``--append`` wrote, as its journal says, named so)."""
    listed = {s.name for info in manifest.splits.values() for s in info.shards}
    journal = {
        os.path.splitext(name)[0] for name in storage.listdir(storage.join(path, JOURNAL_DIR))
    }
    return [
        Problem("", name, _APPENDING if name in journal else _UNLISTED.format(fmt.name))
        for name in storage.listdir(path)
        if name.endswith(fmt.suffix)
        and name not in listed
        and name not in SIDECARS
        and not name.startswith(".")
    ]


_UNLISTED = (
    "is named like a {} shard but the manifest does not list it (left alone: move it out of "
    "the dataset folder, or re-run the conversion)"
)
_APPENDING = (
    "is a shard of an unfinished dlpipe convert --append (its journal names it; the manifest, "
    "still the version before, does not list it): finish the append with the same command and "
    "--resume, or a new --append removes it"
)


def _shard_list(manifest: Manifest) -> list[tuple[str, ShardInfo]]:
    return [(split, s) for split, info in manifest.splits.items() for s in info.shards]


def _record(report: VerifyReport, problem: Problem | None, decoded: int) -> None:
    report.shards_checked += 1
    report.samples_decoded += decoded
    if problem is not None:
        report.problems.append(problem)


def _check_file(path: str, split: str, shard: ShardInfo) -> Problem | None:
    target = storage.join(path, shard.name)
    refusal = None if storage.is_url(path) else _refuse_local(path, target)
    if refusal is not None:
        return Problem(split, shard.name, refusal)
    digest = hashlib.sha256()
    size = 0
    try:
        with storage.open_read(target) as f:
            while size <= shard.bytes and (chunk := f.read(min(1 << 20, shard.bytes + 1 - size))):
                digest.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        return Problem(split, shard.name, "missing (the manifest lists it)")
    if size != shard.bytes:
        more = "more than " if size > shard.bytes else ""
        return Problem(split, shard.name, f"{more}{size} bytes, the manifest says {shard.bytes}")
    if digest.hexdigest() != shard.sha256:
        return Problem(
            split, shard.name, f"sha256 {digest.hexdigest()} != manifest {shard.sha256} (corrupt)"
        )
    return None


def _refuse_local(folder: str, target: str) -> str | None:
    """Why a local shard file must not be read (a link out of the folder, not a regular file)."""
    real = os.path.realpath(storage.local_path(target))
    inside = os.path.realpath(storage.local_path(folder))
    if not storage.is_inside(real, inside):
        return (
            f"is a link to {real}, outside the dataset folder; dlpipe does not read outside "
            "it (copy the file in, or re-run the conversion)"
        )
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return None  # reported as missing when it is opened
    if not stat.S_ISREG(mode):
        return "is not a regular file (a FIFO, device or folder); a shard is a plain file"
    return None


def _decode_shard(reader: ShardReader, split: str, num_classes: int) -> tuple[Problem | None, int]:
    index = 0
    try:
        for sample in reader:
            decode_sample(sample)
            wrong = label_problem(sample, num_classes) or _index_problem(sample)
            if wrong is not None:
                return Problem(split, reader.info.name, wrong, index), index
            index += 1
    except DlpipeError as exc:
        return Problem(split, reader.info.name, str(exc), index), index
    if index != reader.info.samples:
        return _count_mismatch(split, reader.info, index), index
    return None, index


def _index_problem(sample: Sample) -> str | None:
    """What is wrong with the restart index of a seekable JPEG in the sample (`dlpipe.jpeg_seek`:
    a crop cut through it must decode to the whole decode's pixels), or None."""
    for name, value in sample.items():
        if name == KEY_FIELD or not isinstance(value, (bytes, bytearray, memoryview)):
            continue
        problem = index_problem(bytes(value))
        if problem is not None:
            return (
                f"sample {str(sample.get(KEY_FIELD))[:80]!r} field {name!r} is a seekable JPEG "
                f"whose restart index cannot be trusted: {problem}; re-convert the dataset "
                "with --seekable-jpeg (which rebuilds every index) or restore this shard from "
                "a good copy"
            )
    return None


def _count_problem(reader: ShardReader, split: str) -> Problem | None:
    try:
        count = reader.count_samples()
    except DlpipeError as exc:
        return Problem(split, reader.info.name, str(exc))
    return None if count == reader.info.samples else _count_mismatch(split, reader.info, count)


def _count_mismatch(split: str, info: ShardInfo, count: int) -> Problem:
    return Problem(split, info.name, f"holds {count} samples but the manifest says {info.samples}")


# --- shards checked in child processes -------------------------------------------------------


def _check_in_children(
    path: str,
    manifest: Manifest,
    decode: bool,
    report: VerifyReport,
    done: Callable[[str], None],
) -> None:
    shards = _shard_list(manifest)
    start = 0
    while start < len(shards):
        start = _run_child(path, manifest, decode, start, report, done)


def _run_child(
    path: str,
    manifest: Manifest,
    decode: bool,
    start: int,
    report: VerifyReport,
    done: Callable[[str], None],
) -> int:
    """Check shards from `start` on in one child; the index to go on from after it ends."""
    shards = _shard_list(manifest)
    job = {"path": path, "manifest": manifest.to_json(), "decode": decode, "start": start}
    with tempfile.TemporaryFile() as errors:
        current, code = _talk_to_child(job, errors, report, done)
        if current is None and code == 0:
            return len(shards)
        tail = _tail(errors)
    if current is None:
        raise CheckerError(
            f"the process that checks the shards of {path} failed (exit code {code}): {tail}"
        )
    split, shard = shards[current]
    _record(report, Problem(split, shard.name, _crash_message(code, tail)), 0)
    done(shard.name)
    return current + 1


def _talk_to_child(
    job: dict[str, Any], errors: IO[bytes], report: VerifyReport, done: Callable[[str], None]
) -> tuple[int | None, int]:
    """Run one child on `job`: (the shard it was checking when it ended, or None; exit code)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        env=_child_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    current = None
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        for line in proc.stdout:
            message = json.loads(line)
            if "start" in message:
                current = message["start"]
                continue
            problem = message["problem"]
            _record(report, Problem(**problem) if problem else None, message["decoded"])
            done(message["shard"])
            current = None
        return current, proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _child_env() -> dict[str, str]:
    """This environment, with the folder dlpipe is imported from first on the import path."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _tail(errors: IO[bytes]) -> str:
    errors.seek(0, os.SEEK_END)
    errors.seek(max(0, errors.tell() - 4096))
    lines = errors.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1][:300] if lines else "no message"


def _crash_message(code: int, tail: str) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"is corrupt: the reader crashed (signal {name}); re-convert the dataset or "
            "restore this shard from a good copy"
        )
    return (
        f"is corrupt or unreadable: the reader failed (exit code {code}: {tail}); re-convert "
        "the dataset or restore this shard from a good copy"
    )


def _child_main() -> None:
    """The child: check shards from the job's start on, reporting each one as JSON lines.

    Its stdout carries only the protocol (anything a library prints goes to stderr).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides, and kills this child
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    job = json.loads(sys.stdin.buffer.read())
    path = job["path"]
    manifest = parse_manifest(json.dumps(job["manifest"]).encode(), path)
    for index, (split, shard) in enumerate(_shard_list(manifest)):
        if index < job["start"]:
            continue
        print(json.dumps({"start": index}), file=out, flush=True)
        problem, decoded = check_shard(path, manifest, split, shard, decode=job["decode"])
        found = asdict(problem) if problem else None
        reply = {"shard": shard.name, "problem": found, "decoded": decoded}
        print(json.dumps(reply), file=out, flush=True)
