"""``dlpipe train``: parse → build → run → close.

Flags override the ``--config`` TOML file, which overrides the defaults (`dlpipe.train.config`).
``--nproc-per-node N`` re-launches the same command under ``torchrun`` on this machine; under
torchrun (or a cluster's launcher that sets RANK/WORLD_SIZE) each process is one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

from rich.console import Console

__all__ = ["add_train_parser", "run_train"]


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` subcommand: a flag per `TrainConfig` option (`dlpipe.options`), the
    ``--config`` file and ``--nproc-per-node``."""
    from dlpipe.options import add_config_flag, add_options
    from dlpipe.train.config import TrainConfig

    p = sub.add_parser(
        "train", help="train an image classifier, detector or segmenter on a prepared dataset"
    )
    add_options(p, TrainConfig)
    add_config_flag(p)
    p.add_argument("--nproc-per-node", type=int, help="launch N processes with torchrun")
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace, console: Console) -> int:
    """``dlpipe train``: 0 when the run ends or stops with a checkpoint, 2 for bad input, 1
    when training failed, 128 + the signal's number when a stop signal came before any
    checkpoint could be written."""
    from dlpipe.train.signals import Interrupted, startup_guard

    # a rank, or the `dlpipe` process itself (not a caller's): its stop signals are its own
    owns_process = "LOCAL_RANK" in os.environ or getattr(args, "argv", None) == sys.argv[1:]
    try:
        with startup_guard(owns_process=owns_process) as guard:
            from dlpipe.options import given_options
            from dlpipe.train.config import TrainConfig, load_config

            config = load_config(args.config, given_options(args, TrainConfig))
            if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
                return _preflight_and_launch(config, args, guard, console)
            return _train_here(config, console, guard)
    except Interrupted as stop:
        return _interrupted(stop.name, stop.exit_code)
    except KeyboardInterrupt:
        return _interrupted("SIGINT", 130)


def _interrupted(name: str, code: int, report: bool | None = None) -> int:
    if os.environ.get("RANK", "0") == "0" if report is None else report:
        print(
            f"error: stopped by {name} before the next checkpoint; run the same command again "
            "to resume from the last one (or to start, if there is none)",
            file=sys.stderr,
        )
    return code


def _train_here(config: Any, console: Console, guard: Any) -> int:
    from dlpipe.train.trainer import Trainer

    quiet = os.environ.get("DLPIPE_TRAIN_PREFLIGHT") == "1"  # the launcher warned already
    trainer = None
    try:
        trainer = Trainer(config, console, warn=(lambda text: None) if quiet else None)
        summary = trainer.fit()
    except BaseException as exc:
        code = _failed(exc, trainer)  # reported before `close` lets the other ranks fail
        if code is None:
            raise
        return code
    finally:
        guard.settle()  # the outcome is decided: a stop signal now changes nothing
        if trainer is not None:
            trainer.close()
    if summary.stopped in ("completed", "early_stop") and summary.last_val:
        _print_summary(summary, trainer.console)
    return 0


def _failed(exc: BaseException, trainer: Any) -> int | None:
    """Print the run's one ``error:`` line if this rank is the first to fail (rank 0 where
    that cannot be known), and return the exit code; None for an error that is not dlpipe's.

    A DataLoader worker's error is printed as its own message, not torch's wrapping of it;
    a rank whose collective failed because a second Ctrl-C stopped the others at once was
    stopped by that Ctrl-C too."""
    from dlpipe.errors import DlpipeError
    from dlpipe.processes import original_message
    from dlpipe.text import printable
    from dlpipe.train.distributed import DistributedError
    from dlpipe.train.signals import Interrupted
    from dlpipe.train.step import TrainingError

    main_rank = os.environ.get("RANK", "0") == "0"
    dist = getattr(trainer, "dist", None)
    stopped = getattr(getattr(trainer, "signals", None), "interrupted", None)
    if isinstance(exc, DistributedError) and stopped is not None:
        exc = stopped
    if isinstance(exc, KeyboardInterrupt):
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        first, code = (
            (main_rank, stop.exit_code) if dist is None else dist.report(stop.exit_code, main_rank)
        )
        return _interrupted(stop.name, code, first)
    if isinstance(exc, DistributedError):  # it names this rank, what it waited for and who
        code, default = 1, True
    elif isinstance(exc, TrainingError):  # the run itself failed (diverged, out of memory)
        code, default = 1, main_rank
    elif isinstance(exc, DlpipeError | OSError):  # bad input; the OS's word (as dlpipe.cli)
        code, default = 2, main_rank
    else:
        return None
    first, code = (default, code) if dist is None else dist.report(code, default)
    if first:
        print(f"error: {printable(original_message(exc))}", file=sys.stderr)
    return code


def _warn(text: str) -> None:
    from dlpipe.text import printable

    print(f"warning: {printable(text)}", file=sys.stderr)


def _preflight_and_launch(
    config: Any, args: argparse.Namespace, guard: Any, console: Console
) -> int:
    """Check everything once here (one ``error:`` line for bad input), tune the loader if no
    saved profile fits (`_tune_for_ranks`), then start torchrun."""
    from dlpipe.train.preflight import preflight

    if args.nproc_per_node < 1:
        from dlpipe.train.config import ConfigError

        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} must be a positive integer")
    resolved = preflight(config, args.nproc_per_node, _warn)
    _tune_for_ranks(resolved, args.nproc_per_node, console)
    return _launch(args.nproc_per_node, args.argv, guard)


def _tune_for_ranks(config: Any, nproc: int, console: Console) -> None:
    """``--tune auto`` under ``--nproc-per-node``: the ranks do not tune (N processes
    measuring at once would measure each other, and each would save its own winner); the
    launcher does, once, before it starts them: a rank's micro-batch, up to its share of the
    cores (all of them / `nproc` workers: the ranks share the machine), CPU decode only (CUDA
    started here would hold GPU 0 for the whole run). It saves the profile, which the ranks
    then find. Nothing to do when a saved profile fits, with ``--tune off`` or a
    ``--num-workers`` given."""
    from rich.markup import escape

    from dlpipe.loading.profile import nearest_profile
    from dlpipe.loading.tune import training_profile
    from dlpipe.machine import usable_cpus
    from dlpipe.train.config import plan_batches
    from dlpipe.train.sources import profile_target
    from dlpipe.train.trainer import train_loader_config

    d, r = config.data, config.run
    if d.tune == "off" or d.workers.num_workers is not None:
        return
    plan = plan_batches(r.batch_size, nproc, r.micro_batch)
    path, loader = profile_target(d.path, train_loader_config(config, plan.micro_batch, "train"))
    decode = d.workers.chosen().get("decode")
    if nearest_profile(path, split=d.train_split, config=loader, decode=decode) is not None:
        return  # each rank finds it and says which
    _, why = training_profile(
        path,
        d.train_split,
        loader,
        decode=decode,
        max_workers=max(1, usable_cpus() // nproc),
        announce=lambda text: console.print(escape(text)),
    )
    console.print(f"loader for each of the {nproc} ranks: {escape(why)}")


def _print_summary(summary: Any, console: Console) -> None:
    from rich.markup import escape

    last = summary.last_val
    scores = [f"{label} {last[key]:{form}}" for key, label, form in _SUMMARY_SCORES if key in last]
    if scores:
        console.print(
            f"done: {', '.join(scores)} after {summary.epochs_done} epochs ({summary.steps} steps)"
        )
    run = summary.run_dir
    picture = (
        ("confusion matrix", "confusion.png")
        if "top1" in last
        else ("predictions", "predictions.png")
    )
    console.print(
        escape(
            f"metrics {os.path.join(run, 'metrics.jsonl')}, TensorBoard "
            f"{os.path.join(run, 'tensorboard')}, {picture[0]} "
            f"{os.path.join(run, picture[1])}, checkpoints {os.path.join(run, 'checkpoints')}"
        )
    )


_SUMMARY_SCORES = (
    ("top1", "val top-1", ".2%"),
    ("map", "val mAP", ".3f"),
    ("map_50", "mAP@.5", ".3f"),
    ("miou", "val mIoU", ".2%"),
)


def _launch(nproc: int, argv: list[str], guard: Any) -> int:
    """Run this same command under torchrun with `nproc` processes; pass stop signals on to
    the ranks; return torchrun's exit code (the first failed rank's)."""
    argv = _without_nproc(argv)
    torchrun = ["--standalone", f"--nproc-per-node={nproc}", "-m", "dlpipe", *argv]
    # torchrun gets SIGTERM when this process dies (kill -9, the OOM killer) and each rank
    # watches torchrun (`watch_parent`), so no rank trains on as an orphan
    command = [sys.executable, "-c", _TORCHRUN_CHILD, str(os.getpid()), *torchrun]
    # torchrun runs in its own session, so a terminal's Ctrl-C or hang-up reaches only this
    # process, which passes each signal on to the ranks themselves: they finish the step,
    # checkpoint and exit 0 (or, during start-up, exit 128 + that signal), and torchrun ends
    # with them (signalled itself, it would tear the ranks down and fail).
    # OMP_NUM_THREADS=1 is what torchrun sets anyway, without its banner.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "DLPIPE_TRAIN_PREFLIGHT": "1"}
    ranks = _Ranks(nproc)
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, ranks.forward) for s in stops}
    try:
        ranks.torchrun = subprocess.Popen(command, start_new_session=True, env=env)
        while ranks.torchrun.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ranks.torchrun.wait(timeout=0.1)
            ranks.deliver()
        code = ranks.torchrun.returncode
    finally:
        guard.settle()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if ranks.stopped_torchrun is not None and code != 0:  # no rank was there to say it
        stop = signal.Signals(ranks.stopped_torchrun)
        return _interrupted(stop.name, 128 + stop)
    if code < 0:  # torchrun itself was killed: nobody printed why
        name = signal.Signals(-code).name
        print(
            f"error: torchrun was killed by {name}; run the same command to resume", file=sys.stderr
        )
        return 1
    return code


class _Ranks:
    """The launcher's view of torchrun's ranks: stop signals wait until all `nproc` ranks
    exist (they start with stop signals blocked, so a signal they get while they import is
    acted on as soon as they can), then go to each rank, not to torchrun: signalled, it
    fails the run, and after the ranks ended it has nothing to stop. Only a second signal
    before any rank exists stops torchrun itself."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.torchrun: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []
        self.started = False
        self.stopped_torchrun: int | None = None

    def forward(self, signum: int, frame: Any) -> None:
        self.pending.append(signum)
        self.deliver()

    def deliver(self) -> None:
        if not self.pending or self.torchrun is None:
            return
        pids = _children(self.torchrun.pid)
        self.started = self.started or len(pids) >= self.nproc
        if not self.started and not pids and len(self.pending) > 1:
            self.stopped_torchrun = self.pending[-1]
            pids = [self.torchrun.pid]
        elif not self.started:
            return
        sent, self.pending = self.pending, []
        for signum in sent:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)


_TORCHRUN_CHILD = (
    "import sys; from dlpipe.train.distributed import run_torchrun_child; "
    "run_torchrun_child(int(sys.argv[1]), sys.argv[2:])"
)


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc; empty where that is not available)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out
