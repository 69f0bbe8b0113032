"""`UrlTree`: a raw folder at an fsspec URL (``s3://bucket/shards``), listed like `RawTree`.

Only the ``webdataset`` source reads raw data from a URL: its tars are read by byte ranges,
so nothing is downloaded whole. A listing holds the folder's files (with their sizes) and
sub-folders, hidden and OS names left out as `RawTree` leaves them; there are no links or
devices in object storage, so nothing is skipped. Credentials, endpoints and retries are
fsspec's (``AWS_*`` variables, ``~/.aws``, ``AWS_ENDPOINT_URL``).
"""

from __future__ import annotations

import zlib
from typing import Any

from dlpipe import storage
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SourceError, is_ignored_name

__all__ = ["UrlTree"]


def _fs(url: str) -> tuple[Any, str]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise SourceError(
            f"{url}: cannot be opened ({exc}); install the fsspec backend for it "
            "(pip install 'dlpipe[s3]' for s3://)"
        ) from None
    return fs, path


class UrlTree:
    """Lists folders under a URL (module docstring)."""

    def __init__(self, root: str) -> None:
        self.folder = root.rstrip("/")
        self.skipped: dict[str, str] = {}

    def listing(self, folder: str) -> list[RawEntry]:
        """The files and sub-folders of `folder` (a URL), sorted by name.

        Raises:
            SourceError: it cannot be listed (missing, no access, no network).
        """
        fs, path = _fs(folder)
        try:
            found = fs.ls(path, detail=True)
        except (OSError, ValueError) as exc:  # FileNotFoundError, PermissionError, ...
            raise SourceError(
                f"{folder}: cannot be listed ({type(exc).__name__}: {exc}); check the URL and "
                "the credentials"
            ) from None
        entries = []
        for info in found:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if is_ignored_name(name) or str(info["name"]).rstrip("/") == path.rstrip("/"):
                continue
            url = storage.join(folder, name)
            is_dir = info.get("type") == "directory"
            size = 0 if is_dir else int(info.get("size") or 0)
            entries.append(RawEntry(name, url, is_dir, size, (0, zlib.crc32(url.encode()))))
        return sorted(entries, key=lambda e: e.name)

    def report(self) -> dict[str, Any]:
        """No entry is ever skipped: object storage holds no links or devices."""
        return {"skipped_entries": 0, "skipped_examples": []}
