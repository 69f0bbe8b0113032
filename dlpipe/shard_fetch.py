"""Downloading one shard into a local file, checked against its manifest entry.

A shard is read from its URL through fsspec (credentials, endpoints and the storage's own
retries as fsspec and s3fs take them: ``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, `storage_options`)
in bounded chunks, hashed as it arrives and written to a temp name; a download that is short,
long, of another sha256 or cut off is tried again after an exponential backoff, and after the
last attempt it is one `ShardFetchError` naming the shard, the URL and the fix. The caller
publishes the temp file only after `download_verified` returns, so a wrong byte is never read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from dlpipe.errors import DlpipeError
from dlpipe.manifest import ShardInfo

__all__ = [
    "CHUNK_BYTES",
    "CacheDiskFullError",
    "RetryPolicy",
    "ShardFetchError",
    "download_verified",
    "file_sha256",
    "open_url",
]

CHUNK_BYTES = 8 << 20
"""One read from storage (one ranged GET on object storage)."""

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class ShardFetchError(DlpipeError, OSError):
    """A shard could not be downloaded whole and matching its manifest entry."""


class CacheDiskFullError(DlpipeError, OSError):
    """The cache folder's disk filled up during a download (the partial file is removed)."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a failed shard download is tried again.

    Attempt *k* (from 1) that fails waits ``min(first_backoff_s * 2**(k-1), max_backoff_s)``
    before the next; after `attempts` tries the error is raised.
    """

    attempts: int = 4
    first_backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(
                f"RetryPolicy({self.attempts}, {self.first_backoff_s}, {self.max_backoff_s}): "
                "attempts must be at least 1 and the backoffs at least 0"
            )

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (from 1)."""
        return float(min(self.first_backoff_s * 2 ** (attempt - 1), self.max_backoff_s))


def open_url(url: str, storage_options: Mapping[str, Any] | None = None) -> IO[bytes]:
    """`url` opened for streaming reads with no read-ahead cache (each read one request).

    `dlpipe.storage.open_read` takes no fsspec options; the cache needs them (timeouts, retries
    of s3fs's client), so it opens URLs here.
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    return fs.open(path, "rb", block_size=CHUNK_BYTES, cache_type="none")


def file_sha256(path: str) -> str:
    """The sha256 (hex) of a local file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _copy_checked(source: IO[bytes], part_path: str, shard: ShardInfo) -> str | None:
    """Copy at most ``shard.bytes + 1`` bytes of `source` to `part_path`; None when they are
    the shard's, else what is wrong with them, in words."""
    digest, written = hashlib.sha256(), 0
    with open(part_path, "wb") as out:
        while written <= shard.bytes:
            chunk = source.read(min(CHUNK_BYTES, shard.bytes + 1 - written))
            if not chunk:
                break
            digest.update(chunk)
            out.write(chunk)
            written += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    if written != shard.bytes:
        more = "more than" if written > shard.bytes else f"{written} bytes, not"
        return f"it held {more} the manifest's {shard.bytes} bytes"
    if digest.hexdigest() != shard.sha256:
        return f"its sha256 is {digest.hexdigest()}, not the manifest's {shard.sha256}"
    return None


def _one_attempt(url: str, part_path: str, shard: ShardInfo, options: Mapping[str, Any]) -> str:
    """One download; '' when it is the shard, else the reason it is not (the part removed).

    Raises:
        CacheDiskFullError: the local disk filled up (the partial file removed).
    """
    try:
        with open_url(url, options) as source:
            wrong = _copy_checked(source, part_path, shard)
    except OSError as exc:
        _remove_quietly(part_path)
        if exc.errno in _DISK_FULL:
            raise CacheDiskFullError(
                f"{os.path.dirname(part_path)}: the disk filled up while downloading shard "
                f"{shard.name!r} ({shard.bytes} bytes); free space there, lower cache_limit, "
                "or point cache_dir at a bigger disk"
            ) from None
        return f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # botocore/aiohttp errors are not OSErrors
        _remove_quietly(part_path)
        return f"{type(exc).__name__}: {exc}"
    if wrong:
        _remove_quietly(part_path)
    return wrong or ""


def download_verified(
    url: str,
    part_path: str,
    shard: ShardInfo,
    *,
    retry: RetryPolicy,
    storage_options: Mapping[str, Any] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Download `url` to `part_path` until it is `shard` byte for byte (size and sha256).

    Raises:
        ShardFetchError: every attempt failed or gave other bytes (nothing left at `part_path`).
        CacheDiskFullError: the local disk filled up (nothing left at `part_path`).
    """
    reason = ""
    for attempt in range(1, retry.attempts + 1):
        reason = _one_attempt(url, part_path, shard, storage_options or {})
        if not reason:
            return
        if attempt < retry.attempts:
            sleep(retry.backoff_s(attempt))
    raise ShardFetchError(
        f"shard {shard.name!r} at {url} could not be downloaded intact in {retry.attempts} "
        f"attempts (last: {reason}); check that the storage is reachable and that the dataset "
        f"there is the one its manifest describes (`dlpipe verify {url.rsplit('/', 1)[0]}`)"
    )


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
