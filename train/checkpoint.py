"""Checkpoints: complete, atomic, pickle-free to load, pruned only after the new one is whole.

A run folder keeps ``checkpoints/step-00001234.pt`` (the last ``keep_last``) and ``best.pt``
(a hard link to the one with the best validation top-1). Each file is written to a temp name in
the same folder, fsynced, then renamed, so a crash leaves the previous checkpoint intact and
never a truncated file under a real name. Every value is a tensor or plain data, so
``torch.load(path, weights_only=True)`` loads it; model state dicts carry no ``module.`` or
``_orig_mod.`` prefixes.
"""

from __future__ import annotations

import os
import random
import re
from typing import Any

import numpy as np
import torch

from dlpipe import storage
from dlpipe.errors import DlpipeError

__all__ = [
    "CheckpointError",
    "check_resumable",
    "checkpoint_dir",
    "list_checkpoints",
    "load_checkpoint",
    "newest_checkpoint",
    "prune_checkpoints",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "strip_prefixes",
]

FORMAT = "dlpipe-checkpoint"
VERSION = 1
BEST_NAME = "best.pt"
_STEP_FILE = re.compile(r"^step-(\d{8,})\.pt$")


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


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True`` onto the CPU."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # truncated zip, not a torch file, a pickled object
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}); "
            "it may be truncated: resume from an earlier one, or --resume none"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dlpipe checkpoint (no format {FORMAT!r})")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has version {state.get('version')}, this dlpipe reads {VERSION}"
        )
    return state


def check_resumable(state: dict[str, Any], path: str, world_size: int, classes: list[str]) -> None:
    """Refuse a checkpoint this run cannot continue exactly."""
    if state["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {path} was written by {state['world_size']} ranks, this run has "
            f"{world_size}; resuming the data order exactly needs the same count: run with "
            f"--nproc-per-node {state['world_size']} (or --resume none)"
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


def newest_checkpoint(run_dir: str) -> tuple[str, dict[str, Any], list[str]] | None:
    """The newest checkpoint that loads, its state, and the newer ones that did not."""
    broken: list[str] = []
    for path in list_checkpoints(run_dir):
        try:
            return path, load_checkpoint(path), broken
        except CheckpointError as exc:
            broken.append(str(exc))
    return None


def prune_checkpoints(run_dir: str, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` step checkpoints (``best.pt`` stays)."""
    removed = list_checkpoints(run_dir)[keep_last:]
    for path in removed:
        os.remove(path)
    return removed


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


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
