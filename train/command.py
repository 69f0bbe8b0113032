"""``dlpipe train``: parse → build → run → close.

Flags override the ``--config`` TOML file, which overrides the defaults (`dlpipe.train.config`).
``--nproc-per-node N`` re-launches the same command under ``torchrun`` on this machine; under
torchrun (or a cluster's launcher that sets RANK/WORLD_SIZE) each process is one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from typing import Any

from rich.console import Console

__all__ = ["add_train_parser", "config_flags", "run_train"]

# the flags whose name is not their config key's; every other key's flag is its name with dashes
_RENAMED = {
    ("data", "path"): "data",
    ("model", "name"): "model",
    ("run", "checkpoint_every_steps"): "checkpoint_every",
    ("run", "log_every_steps"): "log_every",
    ("run", "dist_timeout_s"): "dist_timeout",
}


def config_flags() -> dict[str, tuple[str, str]]:
    """Flag dest → (config section, key), for every `TrainConfig` field; every flag defaults
    to None ("not given"), so the defaults live in the config alone."""
    from dlpipe.train.config import TrainConfig

    flags, config = {}, TrainConfig()
    for section in dataclasses.fields(config):
        for key in dataclasses.fields(getattr(config, section.name)):
            flags[_RENAMED.get((section.name, key.name), key.name)] = (section.name, key.name)
    return flags


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    from dlpipe.loading.config import DECODE_DEVICES, ENGINES

    p = sub.add_parser("train", help="train an image classifier on a prepared dataset")
    p.add_argument("data", nargs="?", help="dataset folder or URL (or [data] path in --config)")
    p.add_argument("--config", help="TOML file with [data] [model] [optim] [run] sections")
    p.add_argument("--model", help="torchvision model name or package.module:function")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int, help="global batch per optimizer step (256)")
    p.add_argument("--micro-batch", type=int, help="per rank and forward pass (batch/ranks)")
    p.add_argument("--lr", type=float, help="peak learning rate (sgd 0.1 x batch/256)")
    p.add_argument("--optimizer", choices=["sgd", "adamw"])
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--warmup-epochs", type=float)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--image-size", type=int)
    p.add_argument("--min-crop-scale", type=float, help="smallest train crop's area share (0.08)")
    p.add_argument("--out", help="run folder (runs/{dataset}-{model})")
    p.add_argument("--resume", help="auto (newest valid checkpoint), none, or a .pt path")
    p.add_argument("--nproc-per-node", type=int, help="launch N processes with torchrun")
    p.add_argument("--compile", action="store_const", const=True, help="torch.compile the model")
    p.add_argument("--channels-last", action="store_const", const=True)
    p.add_argument("--clip-grad", type=float, help="max gradient norm")
    p.add_argument("--momentum", type=float, help="SGD momentum (0.9)")
    p.add_argument("--label-smoothing", type=float)
    p.add_argument("--early-stop-patience", type=int, help="epochs without val-loss gain")
    p.add_argument("--max-steps", type=int, help="stop (with a checkpoint) after N steps")
    p.add_argument("--seed", type=int)
    p.add_argument("--wandb", metavar="PROJECT", help="also log to Weights & Biases")
    p.add_argument("--train-split")
    p.add_argument("--val-split", help='split to validate on ("val"; "" for none)')
    p.add_argument("--num-workers", type=int, help="loader workers (bench-loader's choice)")
    p.add_argument(
        "--engine",
        choices=["auto", *ENGINES],
        help="loader workers as processes or as threads in this process (auto: the profile's)",
    )
    p.add_argument(
        "--decode",
        choices=["auto", *DECODE_DEVICES],
        help="where JPEGs are decoded: cuda decodes each batch on the GPU (auto: the profile's)",
    )
    p.add_argument("--keep-last", type=int, help="step checkpoints kept (2), plus best.pt")
    p.add_argument("--checkpoint-every", type=int, help="also checkpoint every N steps")
    p.add_argument("--log-every", type=int, help="log the step loss every N steps (20)")
    p.add_argument("--dist-timeout", type=float, help="seconds a rank waits for the others (600)")
    p.add_argument(
        "--max-nonfinite-steps",
        type=int,
        help="fail after N steps in a row with a non-finite loss (20)",
    )
    p.set_defaults(handler=run_train)


def overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The flags given on the command line, as config sections."""
    out: dict[str, dict[str, Any]] = {}
    for dest, (section, key) in config_flags().items():
        value = getattr(args, dest, None)
        if value is not None:
            out.setdefault(section, {})[key] = value
    return out


def run_train(args: argparse.Namespace, console: Console) -> int:
    """``dlpipe train``: 0 when the run ends or stops with a checkpoint, 2 for bad input, 1
    when training failed, 128 + the signal's number when a stop signal came before any
    checkpoint could be written."""
    from dlpipe.train.signals import Interrupted, startup_guard

    try:
        with startup_guard():
            from dlpipe.train.config import load_config

            config = load_config(args.config, overrides(args))
            if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
                return _preflight_and_launch(config, args)
            return _train_here(config, console)
    except Interrupted as stop:
        return _interrupted(stop.name, stop.exit_code)
    except KeyboardInterrupt:
        return _interrupted("SIGINT", 130)


def _interrupted(name: str, code: int) -> int:
    if os.environ.get("RANK", "0") == "0":
        print(
            f"error: stopped by {name} before the next checkpoint; run the same command again "
            "to resume from the last one (or to start, if there is none)",
            file=sys.stderr,
        )
    return code


def _train_here(config: Any, console: Console) -> int:
    from dlpipe.errors import DlpipeError
    from dlpipe.train.distributed import DistributedError
    from dlpipe.train.step import TrainingError
    from dlpipe.train.trainer import Trainer

    main_rank = os.environ.get("RANK", "0") == "0"
    quiet = os.environ.get("DLPIPE_TRAIN_PREFLIGHT") == "1"  # the launcher warned already
    try:
        trainer = Trainer(config, console, warn=(lambda text: None) if quiet else None)
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
    except DistributedError as exc:  # each rank names itself and what it waited for
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except TrainingError as exc:  # the run itself failed (diverged, out of memory)
        _error(exc, main_rank)
        return 1
    except DlpipeError as exc:
        if "LOCAL_RANK" not in os.environ:
            raise  # dlpipe.cli prints it, exit 2
        _error(exc, main_rank)  # under torchrun: one line from rank 0, not one per rank
        return 2
    if summary.stopped in ("completed", "early_stop") and summary.last_val:
        _print_summary(summary, trainer.console)
    return 0


def _warn(text: str) -> None:
    print(f"warning: {text}", file=sys.stderr)


def _error(exc: BaseException, main_rank: bool) -> None:
    if main_rank:
        print(f"error: {exc}", file=sys.stderr)


def _preflight_and_launch(config: Any, args: argparse.Namespace) -> int:
    """Check everything once here (one ``error:`` line for bad input), then start torchrun."""
    from dlpipe.train.preflight import preflight

    if args.nproc_per_node < 1:
        from dlpipe.train.config import ConfigError

        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} must be a positive integer")
    resolved = config.resolved()
    preflight(
        resolved, args.nproc_per_node, lambda text: print(f"warning: {text}", file=sys.stderr)
    )
    return _launch(args.nproc_per_node, args.argv)


def _print_summary(summary: Any, console: Console) -> None:
    from rich.markup import escape

    last = summary.last_val
    if "top1" in last:
        console.print(
            f"done: val top-1 {100 * last['top1']:.2f}% after {summary.epochs_done} epochs "
            f"({summary.steps} steps)"
        )
    run = summary.run_dir
    console.print(
        escape(
            f"metrics {os.path.join(run, 'metrics.jsonl')}, TensorBoard "
            f"{os.path.join(run, 'tensorboard')}, confusion matrix "
            f"{os.path.join(run, 'confusion.png')}, checkpoints {os.path.join(run, 'checkpoints')}"
        )
    )


def _launch(nproc: int, argv: list[str]) -> int:
    """Run this same command under torchrun with `nproc` processes; forward stop signals."""
    argv = _without_nproc(argv)
    torchrun = ["--standalone", f"--nproc-per-node={nproc}", "-m", "dlpipe", *argv]
    # torchrun gets SIGTERM when this process dies (kill -9, the OOM killer) and each rank
    # watches torchrun (`watch_parent`), so no rank trains on as an orphan
    command = [sys.executable, "-c", _TORCHRUN_CHILD, str(os.getpid()), *torchrun]
    # torchrun runs in its own session, so a terminal's Ctrl-C or hang-up reaches only this
    # process, which passes each signal to the ranks themselves (SIGHUP as SIGTERM): they
    # finish the step, checkpoint and exit 0, and torchrun ends normally (signalled itself, it
    # would tear the ranks down and fail)
    env = {**os.environ, "DLPIPE_TRAIN_PREFLIGHT": "1"}
    child = subprocess.Popen(command, start_new_session=True, env=env)

    def forward(signum: int, frame: Any) -> None:
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        for pid in _children(child.pid) or [child.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sent)

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in stops}
    try:
        return child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


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
