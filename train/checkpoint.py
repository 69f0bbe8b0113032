"""Checkpoints: complete, atomic, pickle-free to load, pruned only after the new one is whole.

A run folder keeps ``checkpoints/step-00001234.pt`` (the last ``keep_last``) and ``best.pt``
(a hard link to the one with the best validation top-1). Each file is written to a temp name in
the same folder, fsynced, then renamed, so a crash leaves the previous checkpoint intact and
never a truncated file under a real name. Every value is a tensor or plain data, so
``torch.load(path, weights_only=True)`` loads it; model state dicts carry no ``module.`` or
``_orig_mod.`` prefixes.

A run folder holds one run's timeline. On resume, step checkpoints newer than the one resumed
from (broken ones that did not load, or the abandoned end of a timeline an older checkpoint was
explicitly resumed from) are renamed ``*.pt.broken`` / ``*.pt.superseded``, never deleted and
never taken by a later ``--resume auto``; pruning keeps the checkpoint just written and the
newest whole ones before it. Temp files of a write that was killed are removed on the next
start (only dlpipe's own temp names).
"""

from __future__ import annotations

import math
import os
import random
import re
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.loading.state import (
    MAX_COUNT,
    StateMismatchError,
    is_int,
    mismatch,
    require_like,
    shown,
)

__all__ = [
    "CheckpointError",
    "check_fields",
    "check_optimizer_values",
    "check_resumable",
    "check_same_model",
    "check_same_optimizer",
    "checkpoint_dir",
    "list_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "prune_checkpoints",
    "remove_temp_files",
    "reseed_rng",
    "rng_state",
    "save_checkpoint",
    "set_aside_newer",
    "set_rng_state",
    "strip_prefixes",
]

FORMAT = "dlpipe-checkpoint"
VERSION = 2  # 2: the trainer's counters and early stopping as their own state dicts
BEST_NAME = "best.pt"
_STEP_FILE = re.compile(r"^step-(\d{8,})\.pt$")
_TEMP_FILE = re.compile(r"^(step-\d{8,}\.pt|\.best\.pt)\.tmp-\d+$")  # save_checkpoint's
REQUIRED_KEYS = (
    "step", "epoch", "model", "optimizer", "scheduler", "runner", "trainer", "early_stop",
    "world_size", "global_batch", "classes", "ranks",
)  # fmt: skip


# what a refused checkpoint's message advises: both work in the folder that refused it
# (`--resume none` there is refused: the folder holds this run's checkpoints)
FIX = "resume from an earlier checkpoint with --resume PATH, or start afresh in another --out"


class CheckpointError(DlpipeError, ValueError):
    """A checkpoint file is unreadable, truncated, or not a dlpipe checkpoint."""


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_path(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), f"step-{step:08d}.pt")


def save_checkpoint(run_dir: str, state: dict[str, Any], *, best: bool = False) -> str:
    """Write `state` as the checkpoint of its step (and as ``best.pt``); returns the path."""
    folder = checkpoint_dir(run_dir)
    os.makedirs(folder, exist_ok=True)
    dest = step_path(run_dir, int(state["step"]))
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        torch.save({"format": FORMAT, "version": VERSION, **state}, tmp)
        storage.publish_file(tmp, dest)
        if best:
            link = os.path.join(folder, f".{BEST_NAME}.tmp-{os.getpid()}")
            _link_or_copy(dest, link)
            storage.publish_file(link, os.path.join(folder, BEST_NAME))
    finally:
        for leftover in (tmp, os.path.join(folder, f".{BEST_NAME}.tmp-{os.getpid()}")):
            if os.path.exists(leftover):
                os.remove(leftover)
    return dest


def _link_or_copy(src: str, dest: str) -> None:
    try:
        os.link(src, dest)
    except OSError:  # a filesystem without hard links
        import shutil

        shutil.copyfile(src, dest)


def load_checkpoint(path: str, *, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` onto the CPU (`mmap`: tensors stay in the
    file, read only when touched, for a check that needs the keys and shapes)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # truncated zip, not a torch file, a pickled object
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}); "
            f"it may be truncated: {FIX}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dlpipe checkpoint (no format {FORMAT!r})")
    version = state.get("version")
    if version != VERSION:
        was = "an older" if isinstance(version, int) and version < VERSION else "another"
        raise CheckpointError(
            f"checkpoint {path} has version {version}, written by {was} dlpipe; this dlpipe "
            f"reads version {VERSION} only: finish that run with the dlpipe that wrote it, or "
            "start afresh in another --out"
        )
    check_fields(state, path)
    return state


def check_fields(state: Mapping[str, Any], path: str) -> None:
    """Refuse a checkpoint whose fields are not what ``dlpipe train`` writes, before anything
    reads them: counts are integers (``step`` and ``epoch`` 0 or more, the same as the
    trainer counters'; ``world_size`` and ``global_batch`` positive, the batch a multiple of
    the ranks), ``ranks`` one loader and RNG state per rank, the parts dicts, the model's
    weights tensors by name, the config's names strings. The parts' own fields are checked
    as they are restored (each component's ``load_state_dict``, `check_optimizer_values`).

    Raises:
        CheckpointError: naming the file, the field, its value and the rule.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} is not a dlpipe checkpoint: it holds a {type(state)}")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {', '.join(missing)}: it was not written whole by "
            f"dlpipe train; {FIX}"
        )
    try:
        for check in (_check_counts, _check_parts, _check_ranks, _check_config):
            check(state)
    except _Refused as refused:
        name, value, rule = refused.args
        raise CheckpointError(
            f"checkpoint {path} has {name}={shown(value)}: {rule}, which dlpipe train never "
            f"writes; {FIX}"
        ) from None


class _Refused(Exception):
    """(field, value, rule) of a checkpoint field `check_fields` refuses."""


def _check_counts(state: Mapping[str, Any]) -> None:
    for name, low in (("step", 0), ("epoch", 0), ("world_size", 1), ("global_batch", 1)):
        if not is_int(state[name]) or not low <= state[name] <= MAX_COUNT:
            raise _Refused(name, state[name], f"it must be an integer in {low}..2**62")
    world_size, global_batch = state["world_size"], state["global_batch"]
    if global_batch % world_size:
        raise _Refused("global_batch", global_batch, f"a multiple of world_size={world_size}")


def _check_parts(state: Mapping[str, Any]) -> None:
    for name in ("model", "optimizer", "scheduler", "runner", "trainer", "early_stop"):
        if not isinstance(state[name], Mapping):
            raise _Refused(name, state[name], "it must be a dict")
    for name in ("step", "epoch"):  # the trainer counters' own are what resumes
        if state["trainer"].get(name) != state[name]:
            own = shown(state["trainer"].get(name))
            raise _Refused(name, state[name], f"it must equal the trainer's {name}={own}")
    weights = state["model"]
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise _Refused("model", weights, "it must map parameter names to tensors")
    for name, tensor in weights.items():  # a NaN weight diverges the first step
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise _Refused(f"model[{shown(name)}]", tensor, "its values must be finite numbers")
    optimizer = state["optimizer"]
    groups = optimizer.get("param_groups")
    if not isinstance(optimizer.get("state"), Mapping) or not (
        isinstance(groups, list | tuple)
        and all(isinstance(g, Mapping) and _indices(g.get("params")) for g in groups)
    ):
        raise _Refused("optimizer", optimizer, "it must be a torch optimizer's state_dict")


def _check_ranks(state: Mapping[str, Any]) -> None:
    classes, ranks, world_size = state["classes"], state["ranks"], state["world_size"]
    if not isinstance(classes, list | tuple) or not all(isinstance(c, str) for c in classes):
        raise _Refused("classes", classes, "it must be a list of class names")
    if not isinstance(ranks, list | tuple) or len(ranks) != world_size:
        rule = f"it must be a list of one entry per rank (world_size={world_size})"
        raise _Refused("ranks", ranks, rule)
    for i, rank in enumerate(ranks):
        if not isinstance(rank, Mapping) or not all(
            isinstance(rank.get(key), Mapping) for key in ("loader", "rng")
        ):
            raise _Refused(f"ranks[{i}]", rank, "it must be a dict of a loader and an rng state")


def _check_config(state: Mapping[str, Any]) -> None:
    """What the messages read of the run's config (the model and optimizer names)."""
    config = state.get("config", {})
    if not isinstance(config, Mapping):
        raise _Refused("config", config, "it must be the run's config as a dict of sections")
    for section, key in (("model", "name"), ("optim", "optimizer")):
        part = config.get(section, {})
        if not isinstance(part, Mapping) or not isinstance(part.get(key, ""), str):
            raise _Refused(f"config.{section}", part, f"it must be a dict whose {key} is a name")
    if not isinstance(state.get("reason", ""), str):
        raise _Refused("reason", state["reason"], "it must be a word")


def _indices(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(is_int(i) and i >= 0 for i in value)


def check_same_model(state: Mapping[str, Any], path: str, model: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose model weights are not this model's, naming the first key."""
    saved = state["model"]
    for key, tensor in model.items():
        if key not in saved:
            problem = f"lacks {key!r}"
        elif tuple(saved[key].shape) != tuple(tensor.shape):
            problem = (
                f"holds {key!r} with shape {list(saved[key].shape)}, this model "
                f"{list(tensor.shape)}"
            )
        else:
            continue
        break
    else:
        extra = [key for key in saved if key not in model]
        if not extra:
            return
        problem = f"holds {extra[0]!r}, which this model does not have"
    was = state.get("config", {}).get("model", {}).get("name", "another model")
    raise CheckpointError(
        f"checkpoint {path} is of another model: it {problem}; it was trained with --model "
        f"{was}: resume with that model, or start afresh in another --out"
    )


def check_same_optimizer(
    state: Mapping[str, Any], path: str, name: str, optimizer: torch.optim.Optimizer
) -> None:
    """Refuse a checkpoint of another optimizer (kind or parameter groups)."""
    was = state.get("config", {}).get("optim", {}).get("optimizer")
    groups = state["optimizer"].get("param_groups", [])
    if was is not None and was != name:
        problem = f"is of --optimizer {was}, this run uses {name}"
    elif [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        saved = [len(g["params"]) for g in groups]
        now = [len(g["params"]) for g in optimizer.param_groups]
        problem = f"has parameter groups of {saved} parameters, this run {now}"
    else:
        return
    raise CheckpointError(
        f"checkpoint {path} {problem}; resume with the optimizer it was trained with "
        f"(--optimizer {was or name}), or start afresh in another --out"
    )


def check_optimizer_values(
    state: Mapping[str, Any],
    path: str,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Refuse optimizer and scheduler values this run's would fail on at a later step:
    each parameter's saved tensors have its shape and its numbers are finite; each group's
    hyperparameters and the scheduler's fields are of the kinds this run's are (finite,
    not negative) and name nothing else (torch's ``load_state_dict`` sets any key given).
    After `check_same_optimizer` (the same groups of the same sizes).

    Raises:
        CheckpointError: naming the file, the field, its value and the rule.
    """
    saved, now = state["optimizer"], optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    try:
        pairs = zip(saved["param_groups"], now["param_groups"], strict=False)  # (same count)
        for i, (group, own) in enumerate(pairs):
            field = f"optimizer.param_groups[{i}]"
            require_like(_hyper(group), _hyper(own), field, "optimizer", FIX, subset=True)
        for index, values in saved["state"].items():
            _check_param_state(index, values, params)
        require_like(state["scheduler"], scheduler.state_dict(), "scheduler", "LR scheduler",
                     FIX, subset=True)  # fmt: skip
    except StateMismatchError as exc:
        problem = f"checkpoint {path} cannot be resumed: {exc.problem}"
        raise CheckpointError(f"{problem}; {FIX}") from None


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _check_param_state(index: Any, values: Any, params: list[torch.Tensor]) -> None:
    """One parameter's optimizer state: tensors of its shape (or scalars), finite numbers."""
    name = f"optimizer.state[{shown(index)}]"
    if not is_int(index) or not 0 <= index < len(params) or not isinstance(values, Mapping):
        rule = f"it must be a dict for one of the {len(params)} parameters"
        raise mismatch("optimizer", name, values, rule, FIX)
    shape = tuple(params[index].shape)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            fits = value.dim() == 0 or tuple(value.shape) == shape
            fits = fits and (not value.is_floating_point() or bool(value.isfinite().all()))
        else:
            fits = value is None or (
                (is_int(value) or isinstance(value, float)) and math.isfinite(value)
            )
        if not fits:
            rule = f"it must be a finite tensor of the parameter's shape {list(shape)}"
            raise mismatch("optimizer", f"{name}.{key}", value, rule, FIX)


def check_resumable(
    state: Mapping[str, Any],
    path: str,
    classes: list[str],
    *,
    world_size: int,
    global_batch: int,
    elastic: bool,
) -> None:
    """Refuse a checkpoint this run cannot continue exactly.

    Args:
        state, path: the checkpoint.
        classes: the dataset's class names.
        world_size, global_batch: this run's ranks and samples per optimizer step.
        elastic: the dataset's order resumes on another world size (random-access formats:
            global step s holds the same samples on 1 or N ranks); a stream (wds) deals whole
            shards to ranks, so it resumes only on the same count.
    """
    if state["global_batch"] != global_batch:
        flags = f"--batch-size {state['global_batch']}"
        if state["global_batch"] % world_size:  # it divides over the ranks that saved it
            flags += f" --nproc-per-node {state['world_size']}"
        raise CheckpointError(
            f"checkpoint {path} was trained with a global batch of {state['global_batch']}, "
            f"this run has {global_batch}; the data position and the schedule resume exactly "
            f"only with the same global batch: resume with {flags}"
        )
    if state["world_size"] != world_size and not elastic:
        raise CheckpointError(
            f"checkpoint {path} was written by {state['world_size']} ranks, this run has "
            f"{world_size}; a streaming (wds) dataset deals whole shards to each rank, so "
            f"another rank count would read other samples: run with --nproc-per-node "
            f"{state['world_size']} (or convert to lmdb or hdf5, whose runs resume on any count)"
        )
    if list(state["classes"]) != list(classes):
        raise CheckpointError(
            f"checkpoint {path} was trained on classes {state['classes']}, the dataset has "
            f"{list(classes)}; point --out at a new run folder"
        )


def list_checkpoints(run_dir: str) -> list[str]:
    """The run's step checkpoints, newest first."""
    folder = checkpoint_dir(run_dir)
    if not os.path.isdir(folder):
        return []
    steps = [
        (int(m.group(1)), name) for name in os.listdir(folder) if (m := _STEP_FILE.match(name))
    ]
    return [os.path.join(folder, name) for _, name in sorted(steps, reverse=True)]


def newest_checkpoint(
    run_dir: str, *, mmap: bool = False
) -> tuple[str, dict[str, Any], list[str]] | None:
    """The newest checkpoint that loads, its state, and the newer ones that did not.

    Returns None when the run has no step checkpoint.

    Raises:
        CheckpointError: every checkpoint is broken (each one named): resuming from none of
            them would silently start the run again from step 0.
    """
    broken: list[str] = []
    paths = list_checkpoints(run_dir)
    for path in paths:
        try:
            return path, load_checkpoint(path, mmap=mmap), broken
        except CheckpointError as exc:
            broken.append(str(exc))
    if not paths:
        return None
    raise CheckpointError(
        f"none of the {len(paths)} checkpoints in {checkpoint_dir(run_dir)} loads, so the run "
        "cannot resume: " + " | ".join(broken) + ". Resume from a copy with --resume PATH, or "
        "start afresh in another --out"
    )


def set_aside_newer(run_dir: str, step: int, suffix: str) -> list[str]:
    """Rename the step checkpoints newer than `step` out of the run's timeline.

    `suffix` is ``.broken`` (they did not load) or ``.superseded`` (an older checkpoint was
    resumed from explicitly): a later ``--resume auto`` never takes them, and nothing is
    deleted. Returns the new names.
    """
    moved = []
    for path in list_checkpoints(run_dir):
        if _step_of(path) > step:
            os.replace(path, path + suffix)
            moved.append(path + suffix)
    return moved


def remove_temp_files(run_dir: str) -> list[str]:
    """Remove the temp files a killed `save_checkpoint` left (its own names only)."""
    folder = checkpoint_dir(run_dir)
    if not os.path.isdir(folder):
        return []
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if _TEMP_FILE.match(name) and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed.append(path)
    return removed


def looks_whole(path: str) -> bool:
    """A cheap check that a checkpoint file is a complete torch zip (its directory reads)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def prune_checkpoints(run_dir: str, keep_last: int, newest: str | None = None) -> list[str]:
    """Remove older step checkpoints, keeping `newest` and the whole ones just before it.

    `newest` (the one just written; default the highest step) always stays; of the older
    ones the ``keep_last - 1`` newest that `looks_whole` stay, broken ones never counting.
    Checkpoints with a higher step than `newest` are not this timeline's: they are left alone
    (`set_aside_newer` renames them on resume). ``best.pt`` stays.
    """
    paths = list_checkpoints(run_dir)
    if not paths:
        return []
    newest = newest or paths[0]
    older = [p for p in paths if _step_of(p) < _step_of(newest)]
    kept = [p for p in older if looks_whole(p)][: max(0, keep_last - 1)]
    removed = [p for p in older if p not in kept]
    for path in removed:
        os.remove(path)
    return removed


def _step_of(path: str) -> int:
    match = _STEP_FILE.match(os.path.basename(path))
    assert match is not None, path
    return int(match.group(1))


def strip_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop DDP's ``module.`` and torch.compile's ``_orig_mod.`` from parameter names."""
    out = {}
    for key, value in state_dict.items():
        while key.startswith(("module.", "_orig_mod.")):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def rng_state() -> dict[str, Any]:
    """Every RNG stream as tensors and plain data (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def reseed_rng(seed: int, step: int, rank: int) -> None:
    """Seed every RNG stream from (seed, step, rank): a run resumed on another world size
    has no saved stream for each rank (data augmentation does not use them: it is seeded per
    sample), so each rank gets a distinct stream that a repeat of the same resume repeats."""
    entropy = np.random.SeedSequence([seed, step, rank]).generate_state(2)
    value = int(entropy[0]) << 32 | int(entropy[1])
    random.seed(value)
    np.random.seed(int(entropy[0]))
    torch.manual_seed(value)


def set_rng_state(
    state: Mapping[str, Any], path: str = "the checkpoint", name: str = "rng"
) -> None:
    """Set every RNG stream from an `rng_state`; a state that does not set them all (checked
    by python, numpy and torch as they take it) leaves every stream as it was.

    Raises:
        CheckpointError: naming the file and the field `name` of `state`.
    """
    before = rng_state()
    try:
        _set_rng_state(state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError, AttributeError) as exc:
        _set_rng_state(before)
        raise CheckpointError(
            f"checkpoint {path} has {name}={shown(state)}, which does not set the random "
            f"streams ({type(exc).__name__}: {str(exc)[:200]}); {FIX}"
        ) from None


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    if not (is_int(pos) and 0 <= pos <= 624 and has_gauss in (0, 1) and keys.numel() == 624):
        raise ValueError("numpy's MT19937 state is 624 keys and a position in 0..624")
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
