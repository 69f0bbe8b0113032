"""Where datasets live: local paths and fsspec URLs (``s3://``, ``gs://``, ``memory://`` ...).

Local paths go through `os` directly; anything with a protocol goes through fsspec. Files that
matter are published atomically: locally by temp name + fsync + `os.replace`; on object storage
by uploading the finished file in one put (an object appears whole or not at all).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from typing import IO, Any

from dlpipe.errors import DlpipeError

__all__ = [
    "LOCK_NAME",
    "DiskSpaceError",
    "NotRegularFileError",
    "OutputLockedError",
    "atomic_write_bytes",
    "atomic_write_jsonl",
    "existing_ancestor",
    "exists",
    "file_kind",
    "is_inside",
    "is_url",
    "is_within",
    "join",
    "listdir",
    "local_path",
    "makedirs",
    "new_output_paths",
    "on_system_disk",
    "open_read",
    "open_regular",
    "output_lock",
    "publish_file",
    "read_bytes",
    "remove",
    "remove_left_empty",
    "require_free_space",
    "size",
    "staging_dir",
    "sync_dir",
    "user_cache",
]

LOCK_NAME = ".dlpipe-lock"
"""The lock file a writer holds in a local output folder; kept after the run (tiny, hidden)."""


class OutputLockedError(DlpipeError, OSError):
    """Another dlpipe process is writing the same output folder."""


class DiskSpaceError(DlpipeError, OSError):
    """The output filesystem has less free space than the conversion needs."""


class NotRegularFileError(DlpipeError, OSError):
    """A path that must be a regular file is something else; `kind` says what (``a FIFO``)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.path, self.kind = path, kind


def file_kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words (``a FIFO``, ``a character device``, ...)."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, *, follow_links: bool = True) -> IO[bytes]:
    """Open a local `path` for reading only if it is a regular file (and, unless
    `follow_links`, not a symbolic link), so untrusted paths can neither hang nor read forever.

    ``O_NONBLOCK`` keeps a FIFO from hanging the open, ``O_NOFOLLOW`` refuses a link even if
    one was swapped in after a check, and the kind is checked on the open descriptor.

    Raises:
        NotRegularFileError: `path` is a FIFO, device, socket, folder (or link).
        OSError: it cannot be opened (missing, a dangling or looping link, ...).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if not follow_links and os.path.islink(path):
            raise NotRegularFileError(path, "a symbolic link") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(path, file_kind(mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def is_url(path: str) -> bool:
    """True for ``proto://...`` other than ``file://``."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """`path` as a local filesystem path (``file://`` stripped); for local paths only."""
    assert not is_url(path), path
    return path[len("file://") :] if path.startswith("file://") else path


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def join(base: str, name: str) -> str:
    """Join a folder and a plain file name, for paths and URLs alike."""
    if is_url(base):
        return base.rstrip("/") + "/" + name
    return os.path.join(local_path(base), name)


def exists(path: str) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return bool(fs.exists(p))
    return os.path.exists(local_path(path))


def listdir(path: str) -> list[str]:
    """Names in a folder (empty when it does not exist)."""
    if is_url(path):
        fs, p = _fs(path)
        if not fs.exists(p):
            return []
        return sorted(os.path.basename(str(e).rstrip("/")) for e in fs.ls(p, detail=False))
    p = local_path(path)
    return sorted(os.listdir(p)) if os.path.isdir(p) else []


def size(path: str) -> int:
    """Size in bytes; `FileNotFoundError` when it is not there."""
    if is_url(path):
        fs, p = _fs(path)
        if not fs.exists(p):
            raise FileNotFoundError(path)
        return int(fs.size(p))
    return os.path.getsize(local_path(path))


def remove(path: str) -> None:
    """Delete one file."""
    if is_url(path):
        fs, p = _fs(path)
        fs.rm_file(p)
    else:
        os.remove(local_path(path))


def makedirs(path: str) -> None:
    if is_url(path):
        fs, p = _fs(path)
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(local_path(path), exist_ok=True)


def new_output_paths(out: str) -> list[str]:
    """What `output_lock` will create for a local `out` that is not there yet: its lock file
    and each missing folder, deepest first ([] for a URL; only the lock file for an existing
    folder without one)."""
    if is_url(out):
        return []
    folder = os.path.abspath(local_path(out))
    lock = os.path.join(folder, LOCK_NAME)
    paths, probe = ([] if os.path.lexists(lock) else [lock]), folder
    while not os.path.lexists(probe):
        paths.append(probe)
        probe = os.path.dirname(probe)
    return paths


def remove_left_empty(paths: Sequence[str]) -> None:
    """Remove what a run created (`new_output_paths`, taken before the run) and left unused:
    the lock file when it is empty and alone in its folder, then each folder that is empty, in
    order. A refusal before anything was written leaves nothing it created; anything else in
    a folder keeps it, and everything after it in `paths` (its parents)."""
    for path in paths:
        try:
            if os.path.basename(path) == LOCK_NAME:
                info = os.lstat(path)
                alone = os.listdir(os.path.dirname(path)) == [LOCK_NAME]
                if not (alone and stat.S_ISREG(info.st_mode) and info.st_size == 0):
                    return  # data beside it, or held by another writer (its pid inside)
                os.remove(path)
            else:
                os.rmdir(path)
        except OSError:  # not empty, or gone: keep it and its parents
            return


def read_bytes(path: str) -> bytes:
    """The whole file; `FileNotFoundError` when it is not there."""
    if is_url(path):
        fs, p = _fs(path)
        if not fs.exists(p):
            raise FileNotFoundError(path)
        return bytes(fs.cat_file(p))
    with open(local_path(path), "rb") as f:
        return f.read()


def open_read(path: str) -> IO[bytes]:
    """A binary file object for reading, seekable where the filesystem allows."""
    if is_url(path):
        fs, p = _fs(path)
        return fs.open(p, "rb")
    return open(local_path(path), "rb")


def existing_ancestor(path: str) -> str:
    """The nearest folder of a local `path` that exists already (its filesystem's)."""
    probe = os.path.abspath(local_path(path))
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe


def is_inside(real: str, folder: str) -> bool:
    """True when the real path `real` is the real path `folder` or lies below it."""
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def is_within(path: str, folder: str) -> bool:
    """True when local `path` is strictly inside `folder`, comparing real paths (links resolved)."""
    real, base = (os.path.realpath(local_path(p)) for p in (path, folder))
    return real != base and is_inside(real, base)


def require_free_space(out: str, needed_bytes: int) -> None:
    """Refuse when the filesystem of a local `out` has less than `needed_bytes` free.

    Raises:
        DiskSpaceError: naming both figures and the fix (no-op for URLs).
    """
    if is_url(out):
        return
    free = shutil.disk_usage(existing_ancestor(out)).free
    if needed_bytes > free:
        raise DiskSpaceError(
            f"{out}: the conversion needs about {needed_bytes / 1e9:.2f} GB but "
            f"{free / 1e9:.2f} GB is free there; free space, or point --out (or "
            "DLPIPE_DATA_DIR) at a bigger disk"
        )


def on_system_disk(path: str) -> bool:
    """True when a local `path` lands on the filesystem that holds ``/``."""
    if is_url(path):
        return False
    return os.stat(existing_ancestor(path)).st_dev == os.stat("/").st_dev


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(folder: str) -> None:
    """Make the renames into a local folder durable (no-op for URLs)."""
    if not is_url(folder):
        _fsync_dir(os.path.abspath(local_path(folder)))


def publish_file(tmp_path: str, dest: str, *, sync_folder: bool = True) -> None:
    """Move a finished local temp file to `dest` (path or URL) so it appears whole or not at all.

    Locally the file's data is fsynced, then renamed; with `sync_folder` the folder is fsynced
    too, so the rename itself survives a power cut. Writers of many files (shards) pass
    ``sync_folder=False`` and call `sync_dir` once before the manifest, which is written durably.
    """
    if is_url(dest):
        fs, p = _fs(dest)
        fs.put_file(tmp_path, p)
        os.remove(tmp_path)
        return
    dest = local_path(dest)
    with open(tmp_path, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp_path, dest)
    if sync_folder:
        _fsync_dir(os.path.dirname(os.path.abspath(dest)))


def atomic_write_bytes(dest: str, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to `dest` atomically (temp name, then rename).

    `durable=False` skips the fsyncs, for records whose loss only costs redoing work (the
    conversion journal): the file still appears whole or not at all.
    """
    near = None if is_url(dest) else os.path.dirname(os.path.abspath(local_path(dest)))
    with staging_dir(near) as tmp:
        tmp_path = os.path.join(tmp, "." + os.path.basename(dest) + ".tmp")
        with open(tmp_path, "wb") as f:
            f.write(data)
        if durable or is_url(dest):
            publish_file(tmp_path, dest)
        else:
            os.replace(tmp_path, local_path(dest))


_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def atomic_write_jsonl(dest: str, records: list[dict[str, Any]]) -> None:
    """Write one JSON object per line to `dest`, atomically (see `atomic_write_bytes`).

    Lines are UTF-8; a record holding text that is not valid Unicode (a non-UTF-8 file name
    decoded with surrogate escapes) is written with ASCII escapes instead, so the file always
    parses. The characters besides ``\\n`` that ``str.splitlines`` breaks lines at (NEL,
    U+2028, U+2029; JSON leaves them raw in strings) are written escaped, so a line is a line
    to every reader.
    """
    lines = []
    for record in records:
        text = json.dumps(record, sort_keys=True, ensure_ascii=False)
        try:
            lines.append(text.translate(_LINE_BREAKS).encode())
        except UnicodeEncodeError:
            lines.append(json.dumps(record, sort_keys=True).encode())
    atomic_write_bytes(dest, b"".join(line + b"\n" for line in lines))


@contextlib.contextmanager
def staging_dir(near: str | None) -> Iterator[str]:
    """A private temp folder for files being written, removed on exit.

    With `near` (a local output folder) it is made inside that folder, so publishing is a rename
    on the same filesystem; otherwise (object storage) in the system temp dir.
    """
    parent = local_path(near) if near else None
    if parent:
        os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".dlpipe-tmp-", dir=parent) as tmp:
        yield tmp


@contextlib.contextmanager
def output_lock(out: str) -> Iterator[None]:
    """Hold the exclusive writer lock of a local output folder (created if needed).

    The lock is ``fcntl.flock`` on ``<out>/.dlpipe-lock``, so it is released by the kernel when
    its holder dies (kill -9 leaves no stale lock). The holder's pid is in the file while it
    runs, for the message a second writer gets. The file stays after the run, empty: unlinking it
    would let a third writer lock a fresh file while a second still waits on the old one. On
    object storage (fsspec URLs) there is no lock: one writer per URL is the caller's job.

    Raises:
        OutputLockedError: another process holds the lock (its pid is named when known), or the
            lock file is not a plain file.
    """
    if is_url(out):
        yield
        return
    import fcntl

    makedirs(out)
    fd = _open_lock_file(out)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLockedError(
                f"{out} is being written by another dlpipe process ({_holder(fd)}); wait for "
                "it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a finished folder's lock file is empty: the same run to run
    finally:
        os.close(fd)  # closing the last descriptor releases the flock


def _open_lock_file(out: str) -> int:
    path = os.path.join(local_path(out), LOCK_NAME)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o644)  # O_NONBLOCK: a FIFO does not hang
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
        fd = -1
    if fd < 0 or not _is_regular(fd):
        if fd >= 0:
            os.close(fd)
        raise OutputLockedError(
            f"{path} is not a plain file (a link, folder or device); dlpipe keeps its writer lock "
            "there: remove it, or choose another --out"
        )
    return fd


def read_at(fd: int, offset: int, size: int) -> bytes:
    """Up to `size` bytes at `offset` of the regular file `fd` (fewer only where the file
    ends), leaving its position alone: one read, more only where the kernel returns less (a
    signal, over 2 GiB).

    Raises:
        OSError: the read failed.
    """
    parts = []
    while size > 0 and (part := os.pread(fd, size, offset)):
        parts.append(part)
        offset, size = offset + len(part), size - len(part)
    return b"".join(parts)


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _holder(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return f"pid {text}" if text.isdigit() else "pid unknown"


def user_cache(*parts: str) -> str:
    """A path in dlpipe's user cache: ``$XDG_CACHE_HOME/dlpipe/...``, else ``~/.cache/dlpipe``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dlpipe", *parts)
