"""`Trainer`: epochs of optimizer steps over a prepared dataset, exact evaluation, checkpoints.

    trainer = Trainer(config, console)      # joins torchrun's process group if there is one
    summary = trainer.fit()                 # resumes per config.run.resume, trains, evaluates
    trainer.close()

The checkpoint is the sum of the components' ``state_dict()``: model, optimizer, scheduler,
step runner (GradScaler, micro-batch backoff), every rank's loader position and RNG streams,
and the trainer's own counters (`resume` gathers, writes, chooses and restores it). Every
decision that needs all ranks (checkpoint, evaluate, stop early, stop on a signal) follows from
values all ranks share, so all take it together; `progress` words what the run prints.
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from dlpipe.errors import SplitTooSmallError
from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.loader import make_loader
from dlpipe.loading.profile import LoaderProfile
from dlpipe.options import config_toml, iter_options
from dlpipe.train import checkpoint as ckpt
from dlpipe.train import preflight, progress, resume, runfolder, sources
from dlpipe.train.config import TrainConfig, plan_batches
from dlpipe.train.counters import EarlyStopping, RunCounters
from dlpipe.train.distributed import DistributedError, init_distributed, watch_parent
from dlpipe.train.models import build_model
from dlpipe.train.optim import build_optimizer, build_scheduler
from dlpipe.train.progress import RunSummary
from dlpipe.train.reporting import RunLogger
from dlpipe.train.signals import StopSignals
from dlpipe.train.step import StepResult, StepRunner, TrainingError, resolve_precision
from dlpipe.train.tasks import Result, make_task

__all__ = ["RunSummary", "Trainer", "train_loader_config"]


class Trainer:
    """One training run; `close` it (it holds loader workers, the run-folder lock, the logs,
    and from `fit` on the stop-signal handlers, `dlpipe.train.signals.StopSignals`).

    Args:
        config: the run's configuration (resolved and validated here).
        console: where rank 0 prints progress.
        show_config: print the resolved configuration first.
        warn: prints a ``warning:`` line (default: to stderr; rank 0 only).
    """

    def __init__(
        self,
        config: TrainConfig,
        console: Console,
        *,
        show_config: bool = True,
        warn: Any = None,
    ) -> None:
        self._resources = contextlib.ExitStack()
        self.train_loader: Any = None
        self.val_loader: Any = None
        self._next_pass: Any = None  # the next epoch's batches, begun at the end of this one
        self.loader_source = ""  # where the train loader's settings came from (its line)
        self._advised = False  # the input-bound advice is printed once a run
        self.logger: RunLogger | None = None
        try:
            self._build(config, console, show_config, warn)
        except BaseException:
            self.close()
            raise

    def _build(self, config: TrainConfig, console: Console, show_config: bool, warn: Any) -> None:
        self.show_config = show_config
        self.config, self.manifest = preflight.resolve(config)
        self.dist = init_distributed(self.config.run.dist_timeout_s)
        watch_parent()
        self.console = console if self.dist.is_main else Console(quiet=True)
        self.warn = warn or (lambda text: print(f"warning: {text}", file=sys.stderr))
        d, m, o, r = self.config.parts()
        self.run_dir = r.out
        self.classes = list(self.manifest.classes)
        self.task = make_task(m.task, self.manifest, label_smoothing=o.label_smoothing)
        self.dist.on_main(
            "taking the run folder",
            lambda: runfolder.take_run_folder(self.config, self.console, self._resources),
        )
        self.plan = plan_batches(r.batch_size, self.dist.world_size, r.micro_batch)
        self.precision = resolve_precision(r.precision, self.dist.device)
        random.seed(r.seed)
        np.random.seed(r.seed)
        torch.manual_seed(r.seed)
        model = build_model(  # before the loaders: a wrong model fails before any tuning
            m.name, len(self.classes), task=m.task, image_size=d.loader.image_size
        ).to(self.dist.device)
        self.train_loader = self._loader(d.train_split, "train")
        self.val_loader = self._val_loader()
        if m.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.optimizer = build_optimizer(model, o)
        batches = len(self.train_loader)  # exactly what this rank yields per epoch, any format
        if batches == 0:
            n_train = self.manifest.split(d.train_split).samples
            raise SplitTooSmallError(
                f"split {d.train_split!r} has {n_train} samples, fewer than one micro-batch "
                f"({self.plan.micro_batch}) per rank; lower --batch-size or --micro-batch"
            )
        self.steps_per_epoch = math.ceil(batches / self.plan.accumulation)
        self.scheduler = build_scheduler(
            self.optimizer,
            warmup_steps=round(o.warmup_epochs * self.steps_per_epoch),
            total_steps=r.epochs * self.steps_per_epoch,
        )
        self.forward_model = self._wrap(model)
        self.runner = StepRunner(
            self.forward_model,
            self.optimizer,
            self.scheduler,
            self.dist,
            self.precision,
            clip_grad=o.clip_grad,
            task=self.task,
            channels_last=m.channels_last,
            on_backoff=self._backed_off,
        )
        self.counters = RunCounters()
        self.early_stop = EarlyStopping(r.early_stop_patience)
        self.signals = StopSignals(self._stop_requested)
        self.phase = "step 1"  # what runs now, for messages
        self.logger = RunLogger(
            self.run_dir,
            enabled=self.dist.is_main,
            classes=self.classes,
            wandb_project=r.wandb,
            config=self.config.to_dict(),
        )
        self.parts = resume.RunParts(
            model=model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            runner=self.runner,
            counters=self.counters,
            early_stop=self.early_stop,
            train_loader=self.train_loader,
            dist=self.dist,
            plan=self.plan,
            classes=self.classes,
            config=self.config,
        )

    # ---- setup ---------------------------------------------------------------------------

    def _loader(self, split: str, transform: str) -> Any:
        """A loader of `split`: the train loader on the profile `_train_profile` chooses (and
        says why, `loader_source`), the val loader on the nearest saved one, if any."""
        d = self.config.data
        config = train_loader_config(self.config, self.plan.micro_batch, transform)
        config = sources.split_config(config, transform)
        profile: LoaderProfile | str | None = "auto"
        if transform == "train":
            profile, self.loader_source = self._train_profile(config)
        loader = make_loader(
            sources.loader_path(d.path),
            split,
            config,
            workers=d.workers.chosen(),
            profile=profile,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        return loader if len(d.path) == 1 else sources.MixtureBatches(loader, rank=self.dist.rank)

    def _train_profile(self, config: LoaderConfig) -> tuple[LoaderProfile | str | None, str]:
        """The train loader's profile (None: the defaults) and where it came from: the nearest
        saved one; else a few seconds' tune now (``--tune auto``, one process only: under
        ``--nproc-per-node`` the launcher tuned before it started the ranks); else the
        defaults. A ``--num-workers`` given is the user's choice: no tune."""
        from dlpipe.loading.tune import training_profile

        d = self.config.data
        if d.workers.num_workers is not None:
            return "auto", f"given: --num-workers {d.workers.num_workers}"
        ranks = self.dist.world_size > 1
        why_not = "--tune off" if d.tune == "off" else _RANKS_DO_NOT_TUNE
        path, config = sources.profile_target(d.path, config)  # a mixture's: its first dataset's
        profile, why = training_profile(
            path,
            d.train_split,
            config,
            tune=d.tune == "auto" and not ranks,
            why_not=why_not,
            device=self.dist.device.type,
            decode=d.workers.chosen().get("decode"),
            announce=lambda text: self.console.print(escape(text)),
        )
        flags = {spec.name: spec.flag for spec, _ in iter_options(d.workers)}
        given = d.workers.chosen().items()
        return profile, why + "".join(f"; {flags[name]} {value} given" for name, value in given)

    def _val_loader(self) -> Any:
        warn = self.warn if self.dist.is_main else (lambda text: None)
        split = preflight.val_split(self.config, self.manifest, warn)
        return None if split is None else self._loader(split, "eval")

    def _wrap(self, model: nn.Module) -> nn.Module:
        wrapped = self.dist.wrap(model)
        if self.config.model.compile:
            wrapped = cast(nn.Module, torch.compile(wrapped))
        return wrapped

    # ---- the run -------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        """Resume if asked, train to the end (or a stop), evaluate each epoch; collective."""
        self._announce()
        resume.resume(self.parts, self.console, self._log(), self.manifest)
        r = self.config.run
        if self.counters.epoch >= r.epochs:
            self.console.print(
                f"the run in {escape(self.run_dir)} is already complete ({r.epochs} epochs)"
            )
            return self._summary("resumed_complete", None)
        self.signals.install()
        path = None
        try:
            while self.counters.epoch < r.epochs:
                stopped = self._train_epoch()
                if stopped:
                    path = self._save(stopped)
                    self._explain_stop(stopped, path)
                    return self._summary(stopped, path)
                if self.counters.epoch + 1 < r.epochs:
                    # the workers start on the next epoch's first batches now, while this one
                    # is evaluated and checkpointed (its loader state: that pass, none drawn)
                    self._next_pass = iter(self.train_loader)
                result = self._evaluate()
                early = self._end_epoch(result)
                path = self._save("epoch", best=self._is_best(result))
                if early:
                    self.console.print(
                        f"early stop: {self.task.stop_on} has not improved for "
                        f"{self.early_stop.stale_epochs} epochs"
                    )
                    return self._summary("early_stop", path)
            return self._summary("completed", path)
        finally:
            self.signals.settle()  # the outcome is decided: later signals are only noted

    def _train_epoch(self) -> str | None:
        """Steps until the epoch's data ends; returns why it stopped early, if it did."""
        r = self.config.run
        self.forward_model.train()
        batches, self._next_pass = self._next_pass or iter(self.train_loader), None
        while True:
            if r.max_steps is not None and self.counters.step >= r.max_steps:
                return "max_steps"
            start = time.perf_counter()
            taken = _take(batches, self.plan.accumulation)
            fetched = time.perf_counter()
            if not taken:
                return None
            self.phase = f"step {self.counters.step + 1}"
            result = self.runner.run(taken)
            if result.stop:
                self.signals.commit()  # every rank checkpoints now: a second signal waits
            self.counters.step += 1
            self.counters.stats.add(result, fetched - start, time.perf_counter() - start)
            self._after_step(result)
            if result.stop:
                return "signal"
            every = r.checkpoint_every_steps
            if every and self.counters.step % every == 0:
                self._save("interval")

    def _after_step(self, result: StepResult) -> None:
        r = self.config.run
        finite = math.isfinite(result.loss) and (
            result.grad_norm is None or math.isfinite(result.grad_norm)
        )
        self.counters.skipped_steps += result.skipped
        bad = not finite or result.skipped
        self.counters.bad_steps = self.counters.bad_steps + 1 if bad else 0
        if self.counters.step % r.log_every_steps == 0 or self.counters.step == 1:
            self._log().step(
                self.counters.step,
                {
                    "loss": result.loss,
                    **result.parts,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "grad_norm": math.nan if result.grad_norm is None else result.grad_norm,
                    "samples": result.samples,
                },
            )
        if self.counters.bad_steps >= r.max_nonfinite_steps:
            latest = ckpt.list_checkpoints(self.run_dir)
            where = f"the last good checkpoint is {latest[0]}" if latest else "no checkpoint yet"
            raise TrainingError(
                f"the loss or gradient norm was not finite for {self.counters.bad_steps} steps "
                f"in a row (up to step {self.counters.step}, lr "
                f"{self.optimizer.param_groups[0]['lr']:.3g}); "
                f"{where}. Lower --lr, set --clip-grad, or use --precision bf16 or fp32"
            )

    # ---- evaluation and the end of an epoch ----------------------------------------------

    def _evaluate(self) -> Result | None:
        """Every val sample exactly once over all ranks (`StepRunner.evaluate`)."""
        if self.val_loader is None:
            return None
        self.phase = "evaluation"
        evaluator = self.task.evaluator(self.dist.device, keep_pictures=self.dist.is_main)
        return self.runner.evaluate(self.model, self.val_loader, evaluator)

    def _end_epoch(self, result: Result | None) -> bool:
        """Report the epoch, update early stopping; returns True to stop early."""
        lr = self.optimizer.param_groups[0]["lr"]
        values = progress.epoch_values(self.counters.stats, lr)
        number = self.counters.epoch + 1  # epochs are numbered from 1, as the console says
        mixed = sources.epoch_source_samples(self.train_loader, self.dist)  # None: one dataset
        self._log().epoch(number, self.counters.step, values, result, source_samples=mixed)
        record = {"epoch": number, **values}
        if result is not None:
            record.update(self.task.history(result))
        self.counters.history.append(record)
        self._print_epoch(record, values["data_wait_after_first"], mixed)
        self.counters.epoch += 1
        self.counters.stats = progress.EpochStats()
        return result is not None and self.early_stop.update(self.task.stop_value(result))

    def _is_best(self, result: Result | None) -> bool:
        """Whether `result` beats the best score so far (top-1, mAP or mIoU: the task's)."""
        best = self.counters.best_top1
        if result is None or (best is not None and self.task.score(result) <= best):
            return False
        self.counters.best_top1 = self.task.score(result)
        return True

    def _print_epoch(self, record: dict[str, Any], wait: float, mixed: list[int] | None) -> None:
        line = progress.epoch_line(record, self.config.run.epochs, self.counters.step)
        self.console.print(line + escape(sources.source_samples_text(self.config.data.path, mixed)))
        d = self.config.data
        cuda = self.dist.device.type == "cuda"
        micro, size, scale = self.plan.micro_batch, d.loader.image_size, d.loader.min_crop_scale
        advice = progress.input_verdict(wait, d.path[0], micro, size, scale, cuda)
        if advice and not self._advised:  # later epochs' lines still show their data wait
            self.console.print(f"  {escape(advice)}")
            self._advised = True

    # ---- checkpoints (`resume`) ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The shared part of a checkpoint (every rank's own part is gathered in `_save`)."""
        return resume.shared_state(self.parts)

    def load_state_dict(self, state: dict[str, Any], path: str = "the checkpoint") -> None:
        """Restore a whole checkpoint, on the same or another world size (`resume.restore`)."""
        resume.restore(self.parts, state, path)

    def _save(self, reason: str, *, best: bool = False) -> str:
        """Collective (`resume.save`). A stop signal meanwhile only asks to stop: the
        checkpoint is always finished."""
        with self.signals.protect():
            self.phase = f"the checkpoint of step {self.counters.step}"
            return resume.save(self.parts, self._log(), reason, best=best, phase=self.phase)

    def _log(self) -> RunLogger:
        assert self.logger is not None
        return self.logger

    # ---- signals, messages ---------------------------------------------------------------

    def _stop_requested(self, name: str) -> None:
        self.runner.stop_requested = True
        if not self.signals.saving and self.dist.failed_elsewhere():
            # torchrun stops this rank because another one failed (and printed why): no
            # collective can complete any more, so there is no checkpoint to wait for
            raise DistributedError(
                f"rank {self.dist.rank}: stopped by {name} because another rank failed"
            )

    def _explain_stop(self, why: str, path: str) -> None:
        resume_command = runfolder.resume_command(self.run_dir, self.dist.world_size)
        step, max_steps = self.counters.step, self.config.run.max_steps
        self.console.print(progress.stop_line(why, self.signals.name, max_steps, step, path))
        self.console.print(f"resume with: {escape(resume_command)}")
        self._log().event("stop", reason=why, step=step, path=path)

    def _backed_off(self, micro_batch: int) -> None:
        accumulation = self.plan.accumulation * self.runner.splits
        global_batch = self.plan.batch_size
        self.console.print(
            progress.backoff_line(self.phase, micro_batch, accumulation, global_batch)
        )
        step = self.counters.step + 1
        self._log().event(
            "oom_backoff", step=step, micro_batch=micro_batch, accumulation=accumulation
        )

    def _announce(self) -> None:
        d = self.config.data
        text = config_toml(self.config)
        if self.dist.is_main:  # what the printed resume command reads
            runfolder.write_resume_config(self.config)
        total = self.config.run.epochs * self.steps_per_epoch
        self._log().event(
            "schedule",
            steps_per_epoch=self.steps_per_epoch,
            total_steps=total,
            first_epoch=1,  # "epoch" lines from here on count from 1 (older runs' from 0)
        )
        params = sum(t.numel() for t in self.model.parameters())
        if self.show_config:
            self.console.print(text.rstrip(), markup=False)
        self.console.print(progress.plan_line(self.plan, self.steps_per_epoch))
        self.console.print(
            f"{self.task.name} model {escape(self.config.model.name)} ({params:,} parameters, "
            f"{len(self.classes)} classes) on {self.dist.device}, precision "
            f"{self.precision.name}; data {escape(sources.described(d.path, d.loader))} "
            f"({self.manifest.format}); run folder {escape(self.run_dir)}"
        )
        line = f"{self.train_loader.settings.line()} ({self.loader_source})"
        self.console.print(f"train loader {escape(line)}")

    def _summary(self, stopped: str, path: str | None) -> RunSummary:
        return progress.run_summary(self.run_dir, self.counters, stopped, path)

    def close(self) -> None:
        """End the loader workers, close the logs, release the run folder and the process
        group, and put back the stop-signal handlers; safe after a failed start and more
        than once."""
        signals = getattr(self, "signals", None)
        if signals is not None:
            signals.restore()
        for loader in (self.train_loader, self.val_loader):
            close = getattr(loader, "close", None)
            if close is not None:
                close()
        self.train_loader = self.val_loader = None
        if self.logger is not None:
            self.logger.close()
        self._resources.close()
        dist = getattr(self, "dist", None)
        if dist is not None:
            dist.close()


_RANKS_DO_NOT_TUNE = (
    "no saved profile fits, and ranks do not tune (dlpipe train --nproc-per-node tunes once "
    "before it starts them; or run dlpipe bench-loader)"
)


def train_loader_config(config: TrainConfig, micro_batch: int, transform: str) -> LoaderConfig:
    """The `LoaderConfig` of a run's loaders (`transform` ``"train"`` or ``"eval"``): the
    one its profiles are keyed by, here and in the ``--nproc-per-node`` launcher. The run's
    ``[data.loader]`` with what the trainer sets: the micro-batch, the transform, the seed."""
    loader = config.data.loader
    return loader.replace(batch_size=micro_batch, transform=transform, seed=config.run.seed)


def _take(batches: Iterator[Any], count: int) -> list[Any]:
    taken = []
    for batch in batches:
        taken.append(batch)
        if len(taken) == count:
            break
    return taken
