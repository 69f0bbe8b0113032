"""The run folder of one training run: taken with a lock, the resume point chosen, the
config that resumes it written, the command that resumes it printed.

    take_run_folder(config, console, resources)   # rank 0, before anything is written
    path, state = choose_checkpoint(config, console)
    write_resume_config(config)                   # RUN/config.toml: resume auto, no max_steps
    resume_command(run_dir, world_size)           # "dlpipe train --config RUN/config.toml"

One run per folder: the folder's writer lock (`dlpipe.storage.output_lock`) is held for the
whole run, ``--resume none`` on a folder that holds checkpoints is refused
(`preflight.check_run_folder`), and resuming sets aside checkpoints newer than the resume
point (`checkpoint.set_aside_newer`), so two runs never mix their checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from typing import Any

from rich.console import Console
from rich.markup import escape

from dlpipe import storage
from dlpipe.options import config_toml
from dlpipe.train import checkpoint as ckpt
from dlpipe.train import preflight
from dlpipe.train.config import TrainConfig

__all__ = [
    "CONFIG_NAME",
    "choose_checkpoint",
    "resume_command",
    "set_aside_newer",
    "take_run_folder",
    "write_resume_config",
]

CONFIG_NAME = "config.toml"


def take_run_folder(config: TrainConfig, console: Console, resources: contextlib.ExitStack) -> None:
    """Refuse a second run in the folder, hold its lock (in `resources`), remove the temp
    files of a checkpoint write that was killed."""
    run_dir = config.run.out
    preflight.check_run_folder(config)
    resources.enter_context(storage.output_lock(run_dir))
    for path in ckpt.remove_temp_files(run_dir):
        console.print(f"removed {escape(path)}: a checkpoint write that was killed")


def choose_checkpoint(
    config: TrainConfig, console: Console
) -> tuple[str | None, dict[str, Any] | None]:
    """The checkpoint ``--resume`` names (auto: the newest that loads) and its state.

    Raises:
        CheckpointError: the named one does not load, or every one in the folder is broken.
    """
    choice = config.run.resume
    if choice == "none":
        return None, None
    if choice != "auto":
        return choice, ckpt.load_checkpoint(choice)
    newest = ckpt.newest_checkpoint(config.run.out)
    if newest is None:
        return None, None
    for problem in newest[2]:
        console.print(f"[yellow]skipped[/yellow] {escape(problem)}")
    return newest[0], newest[1]


def set_aside_newer(config: TrainConfig, step: int, console: Console) -> None:
    """After resuming at `step`: the newer checkpoints leave the timeline (renamed, named)."""
    suffix = ".broken" if config.run.resume == "auto" else ".superseded"
    for moved in ckpt.set_aside_newer(config.run.out, step, suffix):
        console.print(
            f"set aside {escape(moved)}: newer than the checkpoint resumed from, so no longer "
            "part of this run (nothing was deleted)"
        )


def write_resume_config(config: TrainConfig) -> None:
    """``RUN/config.toml``: this run's config with ``resume = "auto"`` and no ``max_steps``."""
    os.makedirs(config.run.out, exist_ok=True)
    text = config_toml(config.for_resume()).encode()
    storage.atomic_write_bytes(os.path.join(config.run.out, CONFIG_NAME), text)


def resume_command(run_dir: str, world_size: int) -> str:
    """The command that continues the run in `run_dir` (quoted for a POSIX shell)."""
    command = f"dlpipe train --config {shlex.quote(os.path.join(run_dir, CONFIG_NAME))}"
    if world_size > 1:
        command += f" --nproc-per-node {world_size}"
    return command
