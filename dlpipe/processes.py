"""Child processes that leave stop signals to their parent and do not outlive it.

Ctrl-C, Slurm, systemd and a closed terminal signal a whole process group; the main process
decides what happens (the trainer checkpoints first, convert prints the resume command), so
its workers must not die of, or print a traceback for, a signal meant for it. And a parent
killed with SIGKILL (the OOM killer, ``kill -9``) runs no cleanup, so each child must notice
by itself. The loader's workers, convert's pool workers and torchrun with its ranks share
these pieces.

An error a DataLoader worker raised comes back wrapped (torch re-raises it in the main process
as the same class holding "Caught X in DataLoader worker process N" and the worker's
traceback); `original_message` gives back its own one-line message.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator

__all__ = [
    "STOP_SIGNALS",
    "die_with_parent",
    "original_message",
    "stop_signals_blocked",
    "watch_parent",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# torch.utils.data's ExceptionWrapper.reraise: "Caught {type} {where}.\nOriginal {traceback}"
_WRAPPED = re.compile(r"Caught \w+ in [^\n]*\.\nOriginal Traceback \(most recent call last\):\n")


@contextlib.contextmanager
def stop_signals_blocked(
    signals: Iterable[int] = STOP_SIGNALS, start_method: str | None = None
) -> Iterator[None]:
    """Block `signals` in this thread while child processes start.

    A child inherits the signal mask (fork and spawn alike), so a signal sent to the group
    while it is still starting, or importing, before it can ignore the signal, stays pending
    in it instead of killing it; this process gets any that came meanwhile when the block ends.

    Unless the children are forked (`start_method`), multiprocessing's resource tracker is
    started first: its start *unblocks* SIGINT and SIGTERM, which would undo the block for
    every child spawned after it.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    if start_method != "fork":
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def die_with_parent(signum: int) -> None:
    """Ask Linux to send this process `signum` when its parent dies (elsewhere: nothing;
    `watch_parent` is the portable backstop)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl: the watcher thread still notices


def watch_parent(parent_pid: int, on_death: Callable[[], None], every_s: float) -> threading.Thread:
    """A daemon thread that calls `on_death` once the parent `parent_pid` is gone (this process
    was re-parented), checking every `every_s` seconds."""

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        on_death()

    thread = threading.Thread(target=poll, name="dlpipe-parent-watch", daemon=True)
    thread.start()
    return thread


def original_message(exc: BaseException) -> str:
    """`exc`'s own message, also when a DataLoader worker (process or pin-memory thread)
    raised it: then the last line(s) of the worker's traceback, after the class's name."""
    text = str(exc)
    if not _WRAPPED.match(text):
        return text
    cls = type(exc)
    for name in (f"{cls.__module__}.{cls.__qualname__}: ", f"{cls.__qualname__}: "):
        where = text.rfind("\n" + name)
        if where >= 0:
            return text[where + 1 + len(name) :].strip()
    return text.strip().splitlines()[-1]
