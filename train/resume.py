"""A run's checkpoints: what one holds, how every rank's part is gathered and written, which one
a run resumes from and how it is restored, on the same or another world size.

    parts = RunParts(model, optimizer, scheduler, runner, counters, early_stop, ...)
    path = save(parts, logger, "epoch", best=True)   # collective; rank 0 writes
    resume(parts, console, logger, manifest)         # collective; per config.run.resume

A checkpoint is `shared_state` (model, optimizer, scheduler, step runner, counters, early
stopping, and what the run was: world size, global batch, classes, config) plus ``ranks``, every
rank's loader position and RNG streams, and ``reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from dlpipe.loading.state import StateMismatchError
from dlpipe.manifest import Manifest
from dlpipe.train import checkpoint as ckpt
from dlpipe.train import preflight, runfolder
from dlpipe.train.config import BatchPlan, TrainConfig
from dlpipe.train.counters import EarlyStopping, RunCounters
from dlpipe.train.distributed import Distributed
from dlpipe.train.models import unwrap
from dlpipe.train.reporting import RunLogger
from dlpipe.train.step import StepRunner

__all__ = ["RunParts", "restore", "resume", "save", "shared_state"]


@dataclass(frozen=True)
class RunParts:
    """The objects a checkpoint is made of, and what it records about the run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    runner: StepRunner
    counters: RunCounters
    early_stop: EarlyStopping
    train_loader: Any
    dist: Distributed
    plan: BatchPlan
    classes: list[str]
    config: TrainConfig


def shared_state(parts: RunParts) -> dict[str, Any]:
    """The shared part of a checkpoint (every rank's own part is gathered in `save`)."""
    return {
        "step": parts.counters.step,
        "epoch": parts.counters.epoch,
        "model": ckpt.strip_prefixes(unwrap(parts.model).state_dict()),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "runner": parts.runner.state_dict(),
        "trainer": parts.counters.state_dict(),
        "early_stop": parts.early_stop.state_dict(),
        "world_size": parts.dist.world_size,
        "global_batch": parts.plan.batch_size,
        "classes": parts.classes,
        "config": parts.config.to_dict(),
    }


def restore(parts: RunParts, state: dict[str, Any], path: str = "the checkpoint") -> None:
    """Restore a whole checkpoint (`save`'s, every rank's part in ``ranks``), on the same or,
    for lmdb and hdf5, another world size (`preflight.check_checkpoint` first).

    On the same world size each rank takes its own loader position and RNG streams. On another
    one the loader position is the run's global one (every saved rank holds it: samples
    consumed over all ranks), and each rank's RNG streams are seeded afresh from (seed, step,
    rank): the saved ranks are not this run's, and augmentation does not use them (it is
    seeded per sample by seed, epoch and index).

    A checkpoint is untrusted input: its own fields were checked when it was loaded
    (`checkpoint.check_fields`), each part's are checked here before training starts (the
    optimizer's and the schedule's values, then each plain part by its `load_state_dict`,
    the loader's epoch against the trainer's, the RNG streams as they are set), and one that
    does not fit is a `CheckpointError` naming the file, the field, the value and the rule.
    """
    ckpt.check_fields(state, path)  # (again: a caller may pass a state it loaded itself)
    ranks = state["ranks"]
    same_ranks = len(ranks) == parts.dist.world_size
    index = parts.dist.rank if same_ranks else 0
    mine = ranks[index]
    ckpt.check_optimizer_values(state, path, parts.optimizer, parts.scheduler)
    plain = [
        ("runner", parts.runner, state["runner"]),
        ("trainer", parts.counters, state["trainer"]),
        ("early_stop", parts.early_stop, state["early_stop"]),
        (f"ranks[{index}].loader", parts.train_loader, mine["loader"]),
    ]
    for name, part, saved in plain:
        try:
            part.load_state_dict(saved)
        except StateMismatchError as exc:
            raise ckpt.CheckpointError(_refused(path, name, exc.problem)) from None
    _check_same_epoch(parts, path, f"ranks[{index}].loader")
    unwrap(parts.model).load_state_dict(ckpt.strip_prefixes(state["model"]))
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if same_ranks:
        ckpt.set_rng_state(mine["rng"], path, f"ranks[{index}].rng")
    else:
        ckpt.reseed_rng(parts.config.run.seed, parts.counters.step, parts.dist.rank)


_DATA_FIX = (
    "resume on the dataset, split and seed it was trained with, from an earlier checkpoint "
    "with --resume PATH, or start afresh in another --out"
)


def _refused(path: str, name: str, problem: str) -> str:
    if name.endswith(".loader"):
        return f"checkpoint {path} cannot continue this run's data ({name}): {problem}; {_DATA_FIX}"
    return f"checkpoint {path} cannot be resumed ({name}): {problem}; {ckpt.FIX}"


def _check_same_epoch(parts: RunParts, path: str, name: str) -> None:
    """The loader's epoch is the trainer's: the pass a checkpoint holds is the epoch in
    progress (or the next one, begun, when the trainer counted the last one finished)."""
    order = getattr(parts.train_loader, "order", None)
    epoch = getattr(order, "epoch", parts.counters.epoch)
    if epoch != parts.counters.epoch:
        problem = (
            f"the saved loader state has epoch={epoch}: it must be the trainer's "
            f"epoch={parts.counters.epoch}"
        )
        raise ckpt.CheckpointError(_refused(path, name, problem))


def save(parts: RunParts, logger: RunLogger, reason: str, *, best: bool, phase: str) -> str:
    """Collective: gather every rank's loader and RNG state (all-gather), rank 0 writes, all
    wait for it (barrier); returns the checkpoint's path. ``phase`` names it in messages."""
    run_dir, step = parts.config.run.out, parts.counters.step
    mine = {"loader": parts.train_loader.state_dict(), "rng": ckpt.rng_state()}
    ranks = parts.dist.all_gather(mine, what=f"gathering {phase}")
    path = ckpt.step_path(run_dir, step)
    if parts.dist.is_main:
        state = {**shared_state(parts), "ranks": ranks, "reason": reason}
        path = ckpt.save_checkpoint(run_dir, state, best=best)
        ckpt.prune_checkpoints(run_dir, parts.config.run.keep_last, newest=path)
        logger.event("checkpoint", step=step, path=path, reason=reason)
    parts.dist.barrier(what=f"waiting for rank 0 to write {phase}")
    return path


def resume(parts: RunParts, console: Console, logger: RunLogger, manifest: Manifest) -> None:
    """Load the checkpoint --resume names (auto: the newest that loads); collective."""
    path, state = parts.dist.on_main(
        "choosing the checkpoint to resume from",
        lambda: runfolder.choose_checkpoint(parts.config, console),
        share=lambda found: (found[0], None),  # the path: each rank loads its own copy
    )
    if path is None:
        return
    state = state if state is not None else ckpt.load_checkpoint(path)
    world_size = parts.dist.world_size
    model = unwrap(parts.model)
    preflight.check_checkpoint(
        state, path, model, parts.optimizer, parts.config, manifest, world_size
    )
    saved_ranks = int(state["world_size"])
    restore(parts, state, path)
    del state  # a copy of every weight
    if parts.dist.is_main:
        runfolder.set_aside_newer(parts.config, parts.counters.step, console)
    c = parts.counters
    moved = ""
    if saved_ranks != world_size:
        moved = f", saved by {saved_ranks} ranks, now on {world_size}"
    console.print(f"resumed from {escape(path)} (step {c.step}, epoch {c.epoch + 1}{moved})")
    logger.event("resume", step=c.step, epoch=c.epoch + 1, path=path, saved_world_size=saved_ranks)
