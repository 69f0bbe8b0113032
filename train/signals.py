"""Stop signals: what SIGTERM, SIGINT and SIGHUP do to a training run.

Slurm, systemd, a terminal's Ctrl-C and a closed terminal may signal the whole process group;
the loader's workers ignore these signals (`dlpipe.loading.loader`) and the main process decides:

- during start-up (`startup_guard`), a stop signal ends the command with one line and exit
  code 128 + the signal's number: there is nothing to checkpoint yet. A rank that torchrun
  started with stop signals blocked (`dlpipe.train.distributed.run_torchrun_child`) gets any
  that came while it imported here, as the same one line;
- while training (`StopSignals`), the first one asks the trainer to stop after the step in
  progress, checkpoint and exit 0; a second Ctrl-C stops at once, unless the ranks already
  agreed to checkpoint (`StopSignals.commit`) or a checkpoint is being written
  (`StopSignals.protect`): no signal ever abandons a checkpoint;
- once the run's outcome is decided (`settle`: it finished, stopped with a checkpoint or
  failed), later stop signals are only noted: they cannot turn a finished run into a killed one.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["STOP_SIGNALS", "Interrupted", "StartupGuard", "StopSignals", "startup_guard"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal ended the command before (or instead of) a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StartupGuard:
    """Turns every stop signal into `Interrupted` until `settle`, then only notes them.

    Entering installs the handlers and unblocks the stop signals (a pending one is raised
    at once); leaving restores the previous handlers or, when the command owns its process
    and its outcome is settled, ignores stop signals for the little that is left of it.

    Args:
        owns_process: the command is this process's whole life (a CLI process, a rank).
    """

    def __init__(self, *, owns_process: bool = False) -> None:
        self.owns_process = owns_process
        self.settled = False
        self.late: str | None = None  # a stop signal that came after `settle`
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StartupGuard:
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            if hasattr(signal, "pthread_sigmask"):
                signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def settle(self) -> None:
        """The outcome is decided: from now on stop signals are only noted."""
        self.settled = True

    def _restore(self) -> None:
        ignore = self.settled and self.owns_process
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if ignore else handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.settled:
            self.late = signal.Signals(signum).name
            return
        self.settled = True  # this signal decides the outcome; another cannot change it
        raise Interrupted(signum)


def startup_guard(*, owns_process: bool = False) -> StartupGuard:
    """A `StartupGuard` (a context manager; see there)."""
    return StartupGuard(owns_process=owns_process)


class StopSignals:
    """The training loop's handlers: a stop request, acted on at the next step boundary.

    Args:
        on_stop: called (in the main thread) with the first signal's name on each stop
            signal before the run settles; it may raise to end the run at once.
    """

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self.on_stop = on_stop
        self.name: str | None = None  # the first stop signal's name
        self.saving = 0  # > 0 while a checkpoint is written
        self.committed = False  # the ranks agreed to checkpoint and stop
        self.settled = False  # the run's outcome is decided
        self.interrupted: Interrupted | None = None  # a second Ctrl-C that stopped at once
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @contextlib.contextmanager
    def protect(self) -> Iterator[None]:
        """A checkpoint write: signals meanwhile only ask to stop, the write finishes."""
        self.saving += 1
        try:
            yield
        finally:
            self.saving -= 1

    def commit(self) -> None:
        """The ranks agreed to stop after this step: what is left (the checkpoint, the exit)
        is not abandoned for a second signal."""
        self.committed = True

    def settle(self) -> None:
        """The run's outcome is decided (finished, stopped with a checkpoint, failed): later
        stop signals are only noted."""
        self.settled = True

    def _handle(self, signum: int, frame: Any) -> None:
        second = self.name is not None
        self.name = self.name or signal.Signals(signum).name
        if self.settled:
            return
        if second and signum == signal.SIGINT and not (self.saving or self.committed):
            self.interrupted = Interrupted(signum)
            self.settled = True  # stopping now is the outcome: a third one changes nothing
            raise self.interrupted  # a second Ctrl-C: stop now
        self.on_stop(self.name)
