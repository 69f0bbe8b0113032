"""The shard formats, one module each, and their registry.

A prepared dataset's reader is chosen from the ``format`` its manifest names, never from file
extensions. Add a format by writing one module with a `ShardFormat`, registering it here, and
naming its shard suffix and version in `dlpipe.dataset_names`, where the manifest parser reads
them without importing any format module (or lmdb and h5py).
"""

from __future__ import annotations

from dlpipe.dataset_names import check_format
from dlpipe.errors import UnsupportedStorageError
from dlpipe.formats.base import (
    SampleCountError,
    ShardDiskFullError,
    ShardFormat,
    ShardReader,
    UnsafeShardError,
    write_shard,
)
from dlpipe.formats.hdf5 import HDF5
from dlpipe.formats.lmdb import LMDB
from dlpipe.formats.wds import WDS

__all__ = [
    "FORMATS",
    "SampleCountError",
    "ShardDiskFullError",
    "ShardFormat",
    "ShardReader",
    "UnsafeShardError",
    "get_format",
    "require_storage",
    "write_shard",
]

FORMATS: dict[str, ShardFormat] = {fmt.name: fmt for fmt in (WDS, LMDB, HDF5)}


def get_format(name: str, version: int | None = None) -> ShardFormat:
    """The registered format called `name`; checks `version` when given (from a manifest)."""
    check_format(name, version)
    return FORMATS[name]


def require_storage(fmt: ShardFormat, path: str) -> None:
    """Refuse a URL for a format that needs a local filesystem, saying what to do instead."""
    from dlpipe.storage import is_url

    if is_url(path) and not fmt.supports_urls:
        raise UnsupportedStorageError(
            f"{path}: the {fmt.name} format needs a local filesystem (it memory-maps its "
            "files), so it cannot live on object storage. Copy the dataset to a local disk, "
            "or convert to --to wds or --to hdf5, which stream from URLs"
        )
