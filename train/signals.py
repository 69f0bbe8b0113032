"""Stop signals: what SIGTERM, SIGINT and SIGHUP do to a training run.

Slurm, systemd, a terminal's Ctrl-C and a closed terminal may signal the whole process group;
the loader's workers ignore these signals (`dlpipe.loading.loader`) and the main process decides:

- during start-up (`startup_guard`), a stop signal ends the command with one line and exit
  code 128 + the signal's number: there is nothing to checkpoint yet;
- while training (`StopSignals`), the first one asks the trainer to stop after the step in
  progress, checkpoint and exit 0; a second Ctrl-C outside a checkpoint write stops at once;
  no signal ever abandons a checkpoint being written (`StopSignals.protect`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["STOP_SIGNALS", "Interrupted", "StopSignals", "startup_guard"]

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


@contextlib.contextmanager
def startup_guard() -> Iterator[None]:
    """Turn every stop signal into `Interrupted` while the block runs (handlers restored)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopSignals:
    """The training loop's handlers: a stop request, acted on at the next step boundary.

    Args:
        on_stop: called (in the main thread) with the signal's name on each stop signal.
    """

    def __init__(self, on_stop: Callable[[str], None]) -> None:
        self.on_stop = on_stop
        self.name: str | None = None  # the first stop signal's name
        self.saving = 0  # > 0 while a checkpoint is written
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

    def _handle(self, signum: int, frame: Any) -> None:
        if self.name is not None and signum == signal.SIGINT and not self.saving:
            raise Interrupted(signum)  # a second Ctrl-C: stop now
        self.name = self.name or signal.Signals(signum).name
        self.on_stop(self.name)
