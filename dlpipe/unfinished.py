"""What to tell a user whose dataset folder has no manifest: an unfinished conversion (and the
command that finishes it) or not a dataset at all.

The conversion journal (``.dlpipe-journal/plan.json``, what ``dlpipe convert`` keeps there through
the output folder's owner, ``dlpipe.formats.output``) records the raw folder, the format and the
option flags; the folder is untrusted, so the journal is read small and defensively, and only
flags from an allowlist, each value shell-quoted, go into the printed command.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from dlpipe import storage
from dlpipe.dataset_names import JOURNAL_DIR, JOURNAL_PLAN_NAME, MANIFEST_NAME, SHARD_SUFFIXES

__all__ = ["CONVERT_OPTION_FLAGS", "missing_message"]

_SHARD_FILE_RE = re.compile(r"[A-Za-z0-9_]+-\d{6}\.[a-z0-9]+")


def missing_message(folder: str) -> str:
    """The message of a `ManifestNotFoundError` for `folder`."""
    names = storage.listdir(folder)
    if any(_SHARD_FILE_RE.fullmatch(n) or n.startswith(".dlpipe-") for n in names):
        raw, fmt, args = _interrupted_run(folder, names)
        command = f"dlpipe convert {raw} --to {fmt} --out {shlex.quote(folder)}{args}"
        return (
            f"{folder} has no {MANIFEST_NAME}: it is an unfinished conversion (the manifest is "
            f"written last). Finish it with `{command} --resume` (the same raw folder and "
            "options as the interrupted run), or start again with --overwrite"
        )
    inside = [
        n for n in names if storage.exists(storage.join(storage.join(folder, n), MANIFEST_NAME))
    ]
    hint = f" Datasets inside it: {', '.join(inside)}." if inside else ""
    return (
        f"{folder} is not a dlpipe dataset: no {MANIFEST_NAME} there.{hint} Create one with "
        f"`dlpipe convert RAW --to wds|lmdb|hdf5 --out {shlex.quote(folder)}`"
    )


CONVERT_OPTION_FLAGS = {
    "source": "--source",
    "image_col": "--image-col",
    "label_col": "--label-col",
    "image_root": "--image-root",
    "key_col": "--key-col",
    "shard_bytes": "--shard-size",
    "max_side": "--max-side",
    "quality": "--quality",
    "seekable_jpeg": "--seekable-jpeg",
    "val_fraction": "--val-fraction",
    "seed": "--seed",
    "on_error": "--on-error",
    "dedup": "--dedup",
    "engine": "--engine",
    "ray_address": "--ray-address",
    "keep_empty_classes": "--keep-empty-classes",
    "label_from": "--label-from",
    "instance_masks": "--instance-masks",
}
"""`dlpipe convert`'s options that shape a conversion (option -> flag): the ones its printed
commands repeat, and the only ones a resume hint read from a journal may hold. The converters'
`ConvertConfig` takes these options' flags from here (a test checks both name the same
options); the core never imports the converters, so the list lives on this side."""
_SWITCHES = frozenset({"--keep-empty-classes", "--seekable-jpeg", "--instance-masks"})  # no value
_RESUME_FLAGS = {flag: int(flag not in _SWITCHES) for flag in CONVERT_OPTION_FLAGS.values()}


def _resume_args(recorded: Any) -> str:
    """The recorded option flags, quoted, as they go after ``--out``; "" when unusable."""
    if not isinstance(recorded, list) or len(recorded) > 2 * len(_RESUME_FLAGS):
        return ""
    words, position = [], 0
    while position < len(recorded):
        flag = recorded[position]
        if not isinstance(flag, str) or flag not in _RESUME_FLAGS:
            return ""
        values = recorded[position + 1 : position + 1 + _RESUME_FLAGS[flag]]
        if len(values) < _RESUME_FLAGS[flag] or not all(
            isinstance(v, str) and len(v) < 4096 for v in values
        ):
            return ""
        words += [flag, *values]
        position += 1 + _RESUME_FLAGS[flag]
    return "".join(f" {shlex.quote(w)}" for w in words)


def _interrupted_run(folder: str, names: list[str]) -> tuple[str, str, str]:
    """(raw folder, format, option flags) of the conversion that left `folder` unfinished, as
    far as known.

    From the journal's ``plan.json`` when it records them, else the format from the shard
    names the journal and the folder hold. Read defensively: the folder is untrusted.
    """
    journal = storage.join(folder, JOURNAL_DIR)
    plan = _small_json(storage.join(journal, JOURNAL_PLAN_NAME))
    raw = plan.get("raw") or plan.get("source")
    fmt = plan.get("format")
    if not isinstance(fmt, str) or fmt not in SHARD_SUFFIXES:
        shards = [n.removesuffix(".json") for n in storage.listdir(journal)] + names
        found = {f for f, suffix in SHARD_SUFFIXES.items() for n in shards if n.endswith(suffix)}
        fmt = found.pop() if len(found) == 1 else "|".join(sorted(SHARD_SUFFIXES))
    raw = shlex.quote(raw) if isinstance(raw, str) and raw else "RAW"
    return raw, fmt, _resume_args(plan.get("args"))


def _small_json(path: str) -> dict[str, Any]:
    """A small JSON object file, or {} when it is missing, too large or not an object."""
    try:
        if storage.size(path) > 1 << 16:
            return {}
        data = json.loads(storage.read_bytes(path))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}
