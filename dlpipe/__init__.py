"""dlpipe: raw training data to verified shards to a training GPU, nothing hand-tuned between.

The public API is re-exported here; see the README for a tour.
"""

from typing import TYPE_CHECKING

from dlpipe._version import __version__
from dlpipe.codecs import (
    ImageTooLargeError,
    PixelLimitError,
    decode_field,
    decode_sample,
    encode_field,
    field_type,
    set_max_image_pixels,
)
from dlpipe.errors import (
    DlpipeError,
    FieldDecodeError,
    InvalidFieldError,
    InvalidKeyError,
    ManifestError,
    ManifestNotFoundError,
    OutputExistsError,
    ShardCorruptError,
    ShardCountError,
    SplitTooSmallError,
    UnsafeMemberError,
    UnsupportedStorageError,
)
from dlpipe.manifest import Manifest, ShardInfo, SplitInfo, read_manifest
from dlpipe.sample import Sample, check_key, escape_key, make_key, unescape_key

if TYPE_CHECKING:  # the core's lazy names below, typed as when they were imported here
    from dlpipe.formats import (
        FORMATS,
        SampleCountError,
        ShardDiskFullError,
        UnsafeShardError,
        get_format,
        write_shard,
    )
    from dlpipe.formats.writer import DatasetWriter, ShardLimits
    from dlpipe.inspection import describe_dataset
    from dlpipe.loading.profile import (
        LoaderProfile,
        ProfileError,
        ProfileSaveError,
        find_profile,
        save_profile,
    )
    from dlpipe.verify import CheckerError, Problem, VerifyReport, verify_dataset

# these import torch, the converters or the shard formats (lmdb, h5py): only on first use, so
# the CLI and converters start fast, the core imports neither the loading room nor the
# converters, and reading a manifest imports no format
_LAZY = {
    "FORMATS": "dlpipe.formats",
    "SampleCountError": "dlpipe.formats",
    "ShardDiskFullError": "dlpipe.formats",
    "UnsafeShardError": "dlpipe.formats",
    "get_format": "dlpipe.formats",
    "write_shard": "dlpipe.formats",
    "DatasetWriter": "dlpipe.formats.writer",
    "ShardLimits": "dlpipe.formats.writer",
    "describe_dataset": "dlpipe.inspection",
    "CheckerError": "dlpipe.verify",
    "Problem": "dlpipe.verify",
    "VerifyReport": "dlpipe.verify",
    "verify_dataset": "dlpipe.verify",
    "ConvertConfig": "dlpipe.converters.config",
    "convert": "dlpipe.converters.engine",
    "DatasetChangedError": "dlpipe.loading.dataset",
    "MapDataset": "dlpipe.loading.dataset",
    "StreamDataset": "dlpipe.loading.dataset",
    "open_dataset": "dlpipe.loading.dataset",
    "EpochSampler": "dlpipe.loading.order",
    "LoaderArgumentError": "dlpipe.loading.config",
    "LoaderConfig": "dlpipe.loading.config",
    "LoaderConfigError": "dlpipe.loading.config",
    "WorkerSettings": "dlpipe.loading.config",
    "make_loader": "dlpipe.loading.loader",
    "LoaderProfile": "dlpipe.loading.profile",
    "ProfileError": "dlpipe.loading.profile",
    "ProfileSaveError": "dlpipe.loading.profile",
    "find_profile": "dlpipe.loading.profile",
    "save_profile": "dlpipe.loading.profile",
    "normalize": "dlpipe.loading.transforms",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dlpipe' has no attribute {name!r}")


__all__ = [
    "FORMATS",
    "CheckerError",
    "ConvertConfig",
    "DatasetChangedError",
    "DatasetWriter",
    "DlpipeError",
    "EpochSampler",
    "FieldDecodeError",
    "ImageTooLargeError",
    "InvalidFieldError",
    "InvalidKeyError",
    "LoaderArgumentError",
    "LoaderConfig",
    "LoaderConfigError",
    "LoaderProfile",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "MapDataset",
    "OutputExistsError",
    "PixelLimitError",
    "Problem",
    "ProfileError",
    "ProfileSaveError",
    "Sample",
    "SampleCountError",
    "ShardCorruptError",
    "ShardCountError",
    "ShardDiskFullError",
    "ShardInfo",
    "ShardLimits",
    "SplitInfo",
    "SplitTooSmallError",
    "StreamDataset",
    "UnsafeMemberError",
    "UnsafeShardError",
    "UnsupportedStorageError",
    "VerifyReport",
    "WorkerSettings",
    "__version__",
    "check_key",
    "convert",
    "decode_field",
    "decode_sample",
    "describe_dataset",
    "encode_field",
    "escape_key",
    "field_type",
    "find_profile",
    "get_format",
    "make_key",
    "make_loader",
    "normalize",
    "open_dataset",
    "read_manifest",
    "save_profile",
    "set_max_image_pixels",
    "unescape_key",
    "verify_dataset",
    "write_shard",
]
