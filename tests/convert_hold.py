"""Hold a ``dlpipe convert`` child process mid-run, on a machine of any speed.

A test that signals or kills a conversion "while it runs" must not race it: on a fast or an
idle machine the conversion may finish first, on a loaded one the signal may come before
anything was written. With ``DLPIPE_TEST_HOLD`` set (`converters/executors.py`), each process
that runs shard tasks (the main process with ``--workers 1``, else each worker) stops before
its second task and announces itself with a file named by its pid; the test acts on exactly
that state, then releases it: a ``release`` file that also lets through every process that
reaches its hold later (a worker still holding would keep the pool's shutdown waiting).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from dlpipe.converters.executors import TEST_HOLD_ENV

HANG_S = 600  # only a bound on a hang: a conversion of a few hundred tiny images


class ConvertHold:
    """The hold folder of one conversion: `env` for its child, `wait` for it, `release` it."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.folder = folder

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, TEST_HOLD_ENV: str(self.folder)}

    def held(self) -> list[int]:
        """The pids of the processes holding now."""
        return sorted(int(p.name) for p in self.folder.iterdir() if p.name.isdigit())

    def wait(self, proc: subprocess.Popen, count: int = 1) -> list[int]:
        """Wait until `count` processes hold; the conversion must not have ended first."""
        deadline = time.monotonic() + HANG_S
        while len(self.held()) < count:
            assert proc.poll() is None, f"the conversion ended (exit {proc.returncode}) unheld"
            assert time.monotonic() < deadline, "no process reached the hold"
            time.sleep(0.01)
        return self.held()

    def release(self) -> None:
        (self.folder / "release").touch()

    def kill_after_first_shard(self, command: list[str]) -> None:
        """Run `command` (a ``dlpipe convert``) held, and kill -9 its whole session once its
        first shard is journalled and its second not started."""
        proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        try:
            self.wait(proc)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
