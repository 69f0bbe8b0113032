"""Which files of an output folder are dlpipe's, and the clean-up that follows from it.

Never delete what dlpipe did not write: the proof is the manifest's shard list and the journal
(an intent is recorded before each shard appears, by whichever process writes it), never a
file-name pattern. `prepare_output` empties a folder for a new dataset from that proof alone;
the folder's owner (`dlpipe.formats.output.DatasetOutput`) calls it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence

from dlpipe import storage
from dlpipe.dataset_names import (
    BENCH_CONFIG_NAME,
    CONVERT_CONFIG_NAME,
    DUPLICATES_NAME,
    ERRORS_NAME,
    INTENT_SUFFIX,
    JOURNAL_DIR,
    KEYS_NAME,
    MANIFEST_NAME,
    PROFILES_NAME,
    SHARD_FILE_RE,
    TMP_PREFIX,
)
from dlpipe.errors import DlpipeError, OutputExistsError
from dlpipe.manifest import read_manifest

__all__ = [
    "clash_message",
    "dataset_entries",
    "is_dlpipe_name",
    "owned_shards",
    "prepare_output",
    "record_shard_intent",
    "remove_journal",
    "remove_staging",
]

_REPLACED = (
    MANIFEST_NAME,
    PROFILES_NAME,
    ERRORS_NAME,
    KEYS_NAME,
    DUPLICATES_NAME,
    CONVERT_CONFIG_NAME,
    BENCH_CONFIG_NAME,
)  # the files beside the shards that an --overwrite removes
_FIXED_NAMES = frozenset({*_REPLACED, JOURNAL_DIR, storage.LOCK_NAME})


def dataset_entries(out: str) -> list[str]:
    """Names in `out` that make it non-empty: all but the writer lock and temp folders."""
    return [
        n for n in storage.listdir(out) if n != storage.LOCK_NAME and not n.startswith(TMP_PREFIX)
    ]


def is_dlpipe_name(name: str) -> bool:
    """True for the fixed names dlpipe writes beside shards (never a user's file name)."""
    return name in _FIXED_NAMES or name.startswith(TMP_PREFIX)


def record_shard_intent(out: str, name: str) -> None:
    """Note in the journal that dlpipe is about to publish shard `name` into `out`.

    Written before the shard appears (by whichever process writes it), so a writer killed at
    any point leaves proof of which shard files are dlpipe's: ``--overwrite`` deletes from that
    proof, never by a name pattern.
    """
    folder = storage.join(out, JOURNAL_DIR)
    storage.makedirs(folder)
    path = storage.join(folder, name + INTENT_SUFFIX)
    if not storage.is_url(path):
        # an empty file appears whole or not at all: no temp folder (an rmdir costs ms on a
        # filesystem mounted with discard), no rename; a link in its place is not followed
        flags = (
            os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        with contextlib.suppress(OSError):
            os.close(os.open(storage.local_path(path), flags, 0o644))
            return
    storage.atomic_write_bytes(path, b"", durable=False)


def owned_shards(out: str) -> tuple[set[str], str | None]:
    """Shard files dlpipe can prove it wrote in `out`, and why the manifest could not be read.

    The proof is the existing manifest's shard list and the journal's records (finished shards
    and intents); only plain shard names (``split-NNNNNN.suffix``) count.
    """
    names: set[str] = set()
    unreadable = None
    if storage.exists(storage.join(out, MANIFEST_NAME)):
        try:
            manifest = read_manifest(out)
            names.update(s.name for split in manifest.splits.values() for s in split.shards)
        except (DlpipeError, OSError, ValueError, RecursionError) as exc:
            unreadable = str(exc).split("; ")[0]  # the reason; the reader's fix is not ours
    for entry in storage.listdir(storage.join(out, JOURNAL_DIR)):
        stem, suffix = os.path.splitext(entry)
        if suffix in (INTENT_SUFFIX, ".json"):
            names.add(stem)
    return {n for n in names if SHARD_FILE_RE.fullmatch(n)}, unreadable


def prepare_output(out: str, overwrite: bool, planned: Sequence[str] = ()) -> None:
    """Make `out` ready for a new dataset: refuse existing data unless `overwrite`.

    With `overwrite`, only what dlpipe can prove it wrote is deleted: the shards the existing
    manifest or journal lists, and dlpipe's fixed names (manifest, errors/keys lists, loader
    profiles, journal, temp folders). The manifest goes first, so an interrupted overwrite
    never looks complete, and the shards to delete are noted in the journal before it goes,
    so a kill half-way leaves them provable. A user's file is never deleted; one that bears
    a name in `planned` (a shard this run will write) is refused before anything is deleted.

    Raises:
        OutputExistsError: `out` holds data and not `overwrite`; or a file there that dlpipe
            cannot prove is its own would be replaced (nothing is deleted then).
    """
    names = dataset_entries(out)
    if names and not overwrite:
        raise OutputExistsError(
            f"{out} already holds {len(names)} entries ({_some(names)}); choose an empty "
            "output folder, or pass overwrite=True (--overwrite) to replace the dataset there"
        )
    storage.makedirs(out)
    if not names:
        return
    owned, unreadable = owned_shards(out)
    _refuse_foreign(out, names, owned, unreadable, planned)
    doomed = sorted(owned.intersection(names))
    for name in doomed:
        record_shard_intent(out, name)
    for name in (*_REPLACED, *doomed):
        if name in names:
            storage.remove(storage.join(out, name))
    remove_staging(out)
    remove_journal(out)


def _refuse_foreign(
    out: str, names: list[str], owned: set[str], unreadable: str | None, planned: Sequence[str]
) -> None:
    foreign = [n for n in names if not is_dlpipe_name(n) and n not in owned]
    shard_like = [n for n in foreign if SHARD_FILE_RE.fullmatch(n)]
    if unreadable is not None and shard_like:
        raise OutputExistsError(
            f"{out}: the old manifest cannot be read ({unreadable}), so --overwrite cannot tell "
            f"which files there dlpipe wrote; nothing was deleted, and {len(shard_like)} "
            f"shard-named files remain ({_some(shard_like)}): delete the old dataset's files "
            "yourself, or choose another --out"
        )
    clashes = [n for n in planned if n in foreign]
    if clashes:
        raise OutputExistsError(clash_message(out, clashes))


def clash_message(out: str, clashes: Sequence[str]) -> str:
    """Why a file in `out` named like a shard this run writes is refused, and what to do."""
    return (
        f"{out} holds {_some(clashes)}, not written by dlpipe (no manifest or journal there "
        "lists it), under the name of a shard this conversion writes; nothing was deleted: "
        "move it away, or choose another --out"
    )


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def remove_journal(out: str) -> None:
    """Delete the conversion journal folder of `out` (local path or URL), if any."""
    folder = storage.join(out, JOURNAL_DIR)
    if not storage.is_url(folder):
        shutil.rmtree(storage.local_path(folder), ignore_errors=True)
        return
    for name in storage.listdir(folder):
        storage.remove(storage.join(folder, name))


def remove_staging(out: str) -> None:
    """Delete temp folders an interrupted writer left in a local `out` (never a finished file)."""
    if storage.is_url(out):
        return
    for name in storage.listdir(out):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(storage.join(out, name), ignore_errors=True)
