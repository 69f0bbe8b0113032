"""Checks a training run passes before it starts: the dataset, the model, the run folder and
the checkpoint to resume from.

The trainer runs them on every rank (each gets the same answer, so all ranks fail together and
none waits for a rank that already gave up); ``--nproc-per-node`` runs them once in the
launcher first, so bad input is one ``error:`` line before torchrun starts.

    manifest = check_dataset(config)          # DatasetError: no image field, < 2 classes, ...
    val = val_split(config, manifest, warn)   # None (and a warning) when "val" is missing
    check_run_folder(config)                  # RunFolderError: --resume none on another run
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import Optimizer

from dlpipe.codecs import IMAGE_EXTENSIONS
from dlpipe.errors import DlpipeError
from dlpipe.formats import get_format
from dlpipe.manifest import Manifest, read_manifest
from dlpipe.train import checkpoint as ckpt
from dlpipe.train.config import TrainConfig

__all__ = [
    "DatasetError",
    "RunFolderError",
    "check_checkpoint",
    "check_dataset",
    "check_run_folder",
    "preflight",
    "val_split",
]


class DatasetError(DlpipeError, ValueError):
    """The dataset cannot train an image classifier (no image or label field, one class)."""


class RunFolderError(DlpipeError, ValueError):
    """The run folder holds another run that this one would mix with."""


def check_dataset(config: TrainConfig) -> Manifest:
    """The dataset's manifest, once it is known to hold labelled images and the train split."""
    d = config.data
    manifest = read_manifest(d.path)
    fields = list(manifest.fields)
    if not any(name.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS for name in fields):
        raise DatasetError(
            f"{d.path} has no image field (fields: {', '.join(fields)}); dlpipe train trains "
            f"image classifiers: convert a dataset with a {'/'.join(sorted(IMAGE_EXTENSIONS))} "
            "field"
        )
    if manifest.task not in (None, "classification"):
        raise DatasetError(
            f"{d.path} is a {manifest.task} dataset (its manifest's task; fields: "
            f"{', '.join(fields)}); dlpipe train trains image classifiers: read its samples with "
            "dlpipe.open_dataset, or convert a dataset with class labels"
        )
    if "cls" not in manifest.fields:
        raise DatasetError(
            f"{d.path} has no cls (label) field (fields: {', '.join(fields)}); convert with "
            "labels: ImageFolder sub-folders or a label column"
        )
    if len(manifest.classes) < 2:
        raise DatasetError(
            f"{d.path} lists {len(manifest.classes)} classes; training a classifier needs at "
            "least 2 (convert with labels: ImageFolder sub-folders or a label column)"
        )
    if d.train_split not in manifest.splits:
        raise DatasetError(
            f"{d.path} has no split {d.train_split!r} (splits: {', '.join(manifest.splits)}); "
            "set --train-split to one of them"
        )
    for split, flag in ((d.train_split, "--train-split"), (d.val_split, "--val-split")):
        if split in manifest.splits and "cls" not in manifest.fields_of(split):
            labelled = [s for s in manifest.splits if "cls" in manifest.fields_of(s)]
            raise DatasetError(
                f"{d.path}: split {split!r} has no cls (label) field, it is unlabelled; set "
                f"{flag} to a labelled split ({', '.join(labelled) or 'none'})"
            )
    return manifest


def val_split(config: TrainConfig, manifest: Manifest, warn: Callable[[str], None]) -> str | None:
    """The split to validate on, or None; a missing default ``val`` is a warning, not an error.

    Raises:
        DatasetError: a --val-split given by name is missing, or early stopping needs one.
    """
    split, d = config.data.val_split, config.data
    if not split or split in manifest.splits:
        return split or None
    splits = ", ".join(manifest.splits)
    if split != "val" or config.run.early_stop_patience:
        need = " (--early-stop-patience needs one)" if config.run.early_stop_patience else ""
        raise DatasetError(
            f"{d.path} has no split {split!r}{need} (splits: {splits}); set --val-split to "
            "one of them"
        )
    warn(
        f"{d.path} has no split 'val' (splits: {splits}); training without validation: no "
        'top-1, best.pt or early stopping (set --val-split to a split, or "" to say so)'
    )
    return None


def check_run_folder(config: TrainConfig) -> None:
    """Refuse ``--resume none`` in a run folder that already holds another run's checkpoints."""
    r = config.run
    if r.resume != "none":
        return
    existing = ckpt.list_checkpoints(r.out)
    if existing:
        raise RunFolderError(
            f"run folder {r.out} already holds checkpoints of an earlier run (newest "
            f"{os.path.basename(existing[0])}); --resume none would mix the two runs: "
            "continue it with --resume auto, or start afresh with another --out"
        )


def check_checkpoint(
    state: dict[str, Any],
    path: str,
    model: nn.Module,
    optimizer: Optimizer,
    config: TrainConfig,
    manifest: Manifest,
    world_size: int,
) -> None:
    """Refuse a checkpoint this run cannot continue exactly: another model or optimizer,
    dataset classes or global batch, or another world size on a streaming dataset (naming
    the first mismatch). Another world size on lmdb or hdf5 resumes (elastic)."""
    ckpt.check_resumable(
        state,
        path,
        list(manifest.classes),
        world_size=world_size,
        global_batch=config.run.batch_size,
        elastic=get_format(manifest.format).random_access,
    )
    ckpt.check_same_model(state, path, ckpt.strip_prefixes(model.state_dict()))
    ckpt.check_same_optimizer(state, path, config.optim.optimizer, optimizer)


def preflight(config: TrainConfig, world_size: int, warn: Callable[[str], None]) -> None:
    """Every check a launcher can make before it starts `world_size` ranks (`config`
    resolved): the values, the dataset, the run folder, the model factory (built once on the
    CPU) and the checkpoint a resume would load (memory-mapped, not read whole)."""
    from dlpipe.train.models import build_model
    from dlpipe.train.optim import build_optimizer

    config.validate()
    manifest = check_dataset(config)
    val_split(config, manifest, warn)
    check_run_folder(config)
    model = build_model(config.model.name, len(manifest.classes))
    found = _resume_target(config)
    if found is not None:
        path, state = found
        optimizer = build_optimizer(model, config.optim)
        check_checkpoint(state, path, model, optimizer, config, manifest, world_size)


def _resume_target(config: TrainConfig) -> tuple[str, dict[str, Any]] | None:
    r = config.run
    if r.resume == "none":
        return None
    if r.resume != "auto":
        return r.resume, ckpt.load_checkpoint(r.resume, mmap=True)
    newest = ckpt.newest_checkpoint(r.out, mmap=True)
    return None if newest is None else (newest[0], newest[1])
