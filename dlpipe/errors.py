"""The errors dlpipe raises for bad input.

Every error a user can meet is one of these, and its message names the thing, the value, the
rule that was broken and the fix. Each also subclasses the built-in error a caller would catch
without knowing dlpipe (`ValueError`, `FileNotFoundError`).
"""

from __future__ import annotations

__all__ = [
    "DlpipeError",
    "FieldDecodeError",
    "InvalidFieldError",
    "InvalidKeyError",
    "ManifestError",
    "ManifestNotFoundError",
    "OutputExistsError",
    "ShardCorruptError",
    "ShardCountError",
    "SplitTooSmallError",
    "UnsafeMemberError",
    "UnsupportedStorageError",
]


class DlpipeError(Exception):
    """Base of every error dlpipe raises on purpose."""


class InvalidKeyError(DlpipeError, ValueError):
    """A sample key breaks the key rule (see `dlpipe.sample`)."""


class InvalidFieldError(DlpipeError, ValueError):
    """A field name or field value breaks the sample model."""


class FieldDecodeError(DlpipeError, ValueError):
    """A stored field could not be decoded by the codec its extension names."""


class ManifestNotFoundError(DlpipeError, FileNotFoundError):
    """The folder holds no `dlpipe.json`: not a dataset, or an unfinished conversion."""


class ManifestError(DlpipeError, ValueError):
    """`dlpipe.json` exists but is malformed or of an unknown version."""


class ShardCorruptError(DlpipeError, ValueError):
    """A shard is truncated, structurally broken or holds values that are not ours."""


class UnsafeMemberError(ShardCorruptError):
    """A tar member would escape the dataset folder (`..`, absolute path, link, device)."""


class UnsupportedStorageError(DlpipeError, ValueError):
    """The format cannot live where it was asked to (e.g. LMDB on object storage)."""


class ShardCountError(DlpipeError, ValueError):
    """Fewer shards than the readers that must share them."""


class OutputExistsError(DlpipeError, FileExistsError):
    """The output folder already holds data and overwriting was not asked for."""


class SplitTooSmallError(DlpipeError, ValueError):
    """A split holds fewer samples than one batch (per rank) needs."""
