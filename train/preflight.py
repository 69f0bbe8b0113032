"""Checks a training run passes before it starts: the dataset, the model, the run folder and
the checkpoint to resume from.

The trainer runs them on every rank (each gets the same answer, so all ranks fail together and
none waits for a rank that already gave up); ``--nproc-per-node`` runs them once in the
launcher first, so bad input is one ``error:`` line before torchrun starts.

    config, manifest = resolve(config)        # DatasetError: no image field, < 2 classes, ...
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
from dlpipe.loading.targets import TargetSpec
from dlpipe.manifest import Manifest, read_manifest
from dlpipe.train import checkpoint as ckpt
from dlpipe.train import sources
from dlpipe.train.config import TASKS, TrainConfig

__all__ = [
    "DatasetError",
    "RunFolderError",
    "check_checkpoint",
    "check_dataset",
    "check_run_folder",
    "preflight",
    "resolve",
    "val_split",
]


class DatasetError(DlpipeError, ValueError):
    """The dataset cannot train the run's task (no image or label field, one class, another
    task's annotations)."""


class RunFolderError(DlpipeError, ValueError):
    """The run folder holds another run that this one would mix with."""


def resolve(config: TrainConfig) -> tuple[TrainConfig, Manifest]:
    """`config` checked and resolved for its dataset (``--task auto``: the manifest's task),
    and the dataset's manifest, once it can train that task (`check_dataset`)."""
    config.validate()
    manifest = check_dataset(config)
    resolved = config.resolved(manifest.task)
    resolved.validate()
    return resolved, manifest


def check_dataset(config: TrainConfig) -> Manifest:
    """The dataset's manifest, once it is known to hold images, the annotations of the run's
    task (``--task``, or the manifest's) and the train split; of several, each is checked so,
    then the mixture and its options (`sources.check_sources`), and the first's manifest is
    the run's (its classes and task are the mixture's)."""
    manifests = [_check_one(sources.single(config, path)) for path in config.data.path]
    sources.check_sources(config)
    return manifests[0]


def _check_one(config: TrainConfig) -> Manifest:
    """`check_dataset` of a config of one dataset."""
    d = config.data
    manifest = read_manifest(d.path[0])
    fields = list(manifest.fields)
    if not any(name.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS for name in fields):
        raise DatasetError(
            f"{d.path[0]} has no image field (fields: {', '.join(fields)}); dlpipe train trains "
            f"image models: convert a dataset with a {'/'.join(sorted(IMAGE_EXTENSIONS))} "
            "field"
        )
    task = _check_task(config, manifest)
    if task != "classification":
        _check_task_dataset(config, manifest, task)
        return manifest
    _check_labels(config, manifest)
    return manifest


def _check_task(config: TrainConfig, manifest: Manifest) -> str:
    """The run's task, once the dataset's is the same (one ``error:`` naming both)."""
    d, asked = config.data, config.model.task
    has = manifest.task if manifest.task in TASKS else "classification"
    assert has is not None
    if asked in ("auto", has):
        return has
    if manifest.task in (None, "classification"):
        what = "a classification dataset (class labels, no task of its own in its manifest)"
    else:
        what = f"a {manifest.task} dataset (its manifest's task)"
    raise DatasetError(
        f"--task {asked}: {d.path[0]} is {what}; train it with --task {has} (or leave --task "
        f"unset), or give a {asked} dataset"
    )


def _check_task_dataset(config: TrainConfig, manifest: Manifest, task: str) -> None:
    """A detection or segmentation dataset: its annotation field, classes and train split."""
    d = config.data
    try:
        spec = TargetSpec.from_manifest(manifest, task)
    except ValueError as exc:
        raise DatasetError(f"{d.path[0]}: {exc}") from None
    if config.model.name.startswith("maskrcnn") and not spec.instance_masks:
        raise DatasetError(
            f"--model {config.model.name} learns instance masks, and {d.path[0]} has none (no "
            "masks.json field): convert COCO with --instance-masks, or give a box detector "
            "such as fasterrcnn_mobilenet_v3_large_fpn"
        )
    if not manifest.classes:
        raise DatasetError(
            f"{d.path[0]} lists no classes; a {task} model needs at least 1: convert it again "
            "from its annotations"
        )
    _check_train_split(config, manifest)


def _check_train_split(config: TrainConfig, manifest: Manifest) -> None:
    d = config.data
    if d.train_split not in manifest.splits:
        raise DatasetError(
            f"{d.path[0]} has no split {d.train_split!r} (splits: {', '.join(manifest.splits)}); "
            "set --train-split to one of them"
        )


def _check_labels(config: TrainConfig, manifest: Manifest) -> None:
    """A classification dataset: a cls field in the train and val splits, 2 classes or more."""
    d, fields = config.data, list(manifest.fields)
    if "cls" not in manifest.fields:
        raise DatasetError(
            f"{d.path[0]} has no cls (label) field (fields: {', '.join(fields)}); convert with "
            "labels: ImageFolder sub-folders or a label column"
        )
    if len(manifest.classes) < 2:
        raise DatasetError(
            f"{d.path[0]} lists {len(manifest.classes)} classes; training a classifier needs at "
            "least 2 (convert with labels: ImageFolder sub-folders or a label column)"
        )
    _check_train_split(config, manifest)
    for split, flag in ((d.train_split, "--train-split"), (d.val_split, "--val-split")):
        if split in manifest.splits and "cls" not in manifest.fields_of(split):
            labelled = [s for s in manifest.splits if "cls" in manifest.fields_of(s)]
            raise DatasetError(
                f"{d.path[0]}: split {split!r} has no cls (label) field, it is unlabelled; set "
                f"{flag} to a labelled split ({', '.join(labelled) or 'none'})"
            )


def val_split(config: TrainConfig, manifest: Manifest, warn: Callable[[str], None]) -> str | None:
    """The split to validate on, or None; a missing default ``val`` is a warning, not an error.
    Several datasets validate on that split of each, mixed by size (`sources.split_config`),
    or on none when one lacks the default ``val``.

    Raises:
        DatasetError: a --val-split given by name is missing, or early stopping needs one.
    """
    paths = config.data.path
    if len(paths) == 1:
        return _val_split_of(config, manifest, warn)
    splits = [_val_split_of(sources.single(config, p), read_manifest(p), warn) for p in paths]
    return None if None in splits else splits[0]


def _val_split_of(
    config: TrainConfig, manifest: Manifest, warn: Callable[[str], None]
) -> str | None:
    """`val_split` of a config of one dataset."""
    split, d = config.data.val_split, config.data
    if not split or split in manifest.splits:
        return split or None
    splits = ", ".join(manifest.splits)
    if split != "val" or config.run.early_stop_patience:
        need = " (--early-stop-patience needs one)" if config.run.early_stop_patience else ""
        raise DatasetError(
            f"{d.path[0]} has no split {split!r}{need} (splits: {splits}); set --val-split to "
            "one of them"
        )
    warn(
        f"{d.path[0]} has no split 'val' (splits: {splits}); training without validation: no "
        'scores, best.pt or early stopping (set --val-split to a split, or "" to say so)'
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
    dataset classes, class map or global batch, or another world size on a streaming dataset
    (naming the first mismatch). Another world size on lmdb or hdf5 resumes (elastic)."""
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
    sources.check_same_class_map(state, path, config)


def preflight(config: TrainConfig, world_size: int, warn: Callable[[str], None]) -> TrainConfig:
    """Every check a launcher can make before it starts `world_size` ranks: the values, the
    dataset, the run folder, the model factory (built once on the CPU) and the checkpoint a
    resume would load (memory-mapped, not read whole); returns `config` resolved (`resolve`)."""
    from dlpipe.train.models import build_model
    from dlpipe.train.optim import build_optimizer

    config, manifest = resolve(config)
    val_split(config, manifest, warn)
    check_run_folder(config)
    m = config.model
    model = build_model(
        m.name, len(manifest.classes), task=m.task, image_size=config.data.loader.image_size
    )
    found = _resume_target(config)
    if found is not None:
        path, state = found
        optimizer = build_optimizer(model, config.optim)
        check_checkpoint(state, path, model, optimizer, config, manifest, world_size)
    return config


def _resume_target(config: TrainConfig) -> tuple[str, dict[str, Any]] | None:
    r = config.run
    if r.resume == "none":
        return None
    if r.resume != "auto":
        return r.resume, ckpt.load_checkpoint(r.resume, mmap=True)
    newest = ckpt.newest_checkpoint(r.out, mmap=True)
    return None if newest is None else (newest[0], newest[1])
