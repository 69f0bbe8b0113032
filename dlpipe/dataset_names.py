"""The names dlpipe gives what it writes into a dataset folder, and the shard formats it knows.

Plain data, importing nothing of dlpipe but its errors: the manifest parser, the unfinished-folder
message and the output owner (`dlpipe.formats.output`) all read these names, and none of them
needs the format modules (lmdb, h5py) for it. Each format module's `ShardFormat` entry must agree
with `SHARD_SUFFIXES` and `FORMAT_VERSIONS` (checked when it is made).
"""

from __future__ import annotations

import re

from dlpipe.errors import ManifestError

__all__ = [
    "BENCH_CONFIG_NAME",
    "CONVERT_CONFIG_NAME",
    "DUPLICATES_NAME",
    "ERRORS_NAME",
    "FORMAT_VERSIONS",
    "INTENT_SUFFIX",
    "JOURNAL_DIR",
    "JOURNAL_PLAN_NAME",
    "KEYS_NAME",
    "MANIFEST_NAME",
    "PROFILES_NAME",
    "SHARD_FILE_RE",
    "SHARD_SUFFIXES",
    "TMP_PREFIX",
    "check_format",
]

MANIFEST_NAME = "dlpipe.json"
PROFILES_NAME = "dlpipe-profiles.json"  # loader settings bench-loader measured on this data
ERRORS_NAME = "errors.jsonl"
KEYS_NAME = "keys.jsonl"
DUPLICATES_NAME = "duplicates.jsonl"
CONVERT_CONFIG_NAME = "convert.toml"  # the options dlpipe convert made the dataset with
BENCH_CONFIG_NAME = "dlpipe-profiles.bench-loader.toml"  # the options bench-loader measured
JOURNAL_DIR = ".dlpipe-journal"
JOURNAL_PLAN_NAME = "plan.json"  # in JOURNAL_DIR: what the interrupted run followed
INTENT_SUFFIX = ".intent"
TMP_PREFIX = ".dlpipe-tmp-"

SHARD_SUFFIXES = {"wds": ".tar", "lmdb": ".lmdb", "hdf5": ".h5"}
"""Format name -> the suffix of its shard files (``{split}-{n:06d}{suffix}``)."""
FORMAT_VERSIONS = {"wds": 1, "lmdb": 1, "hdf5": 1}
"""Format name -> the format version this dlpipe writes and reads."""
SHARD_FILE_RE = re.compile(
    rf"[A-Za-z0-9_]+-\d{{6}}({'|'.join(re.escape(s) for s in SHARD_SUFFIXES.values())})"
)
"""A plain shard file name of a known format, as dlpipe names them."""


def check_format(name: str, version: int | None = None) -> None:
    """Refuse a format name dlpipe does not know, or (from a manifest) another `version`.

    Raises:
        ManifestError: naming the formats dlpipe reads, or the version it reads.
    """
    if name not in FORMAT_VERSIONS:
        raise ManifestError(
            f"format {name!r} is unknown; dlpipe reads {', '.join(sorted(FORMAT_VERSIONS))}"
        )
    if version is not None and version != FORMAT_VERSIONS[name]:
        raise ManifestError(
            f"format {name!r} version {version} is not the version {FORMAT_VERSIONS[name]} this "
            "dlpipe reads; upgrade dlpipe or re-convert the dataset"
        )
