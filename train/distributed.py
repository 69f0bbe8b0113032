"""The process group: set up from torchrun's variables, NCCL on GPUs, gloo on CPUs.

Every helper here is a collective: all ranks call it, in the same order, and get the same
answer. A single process (no torchrun) gets the same helpers as no-ops, so the trainer has one
code path and no ``if rank == 0:`` around work that needs every rank.

A collective that waits longer than ``--dist-timeout`` (a rank hung, crashed or was killed)
raises `DistributedError` naming this rank, what it waited for and the ranks that never
reached it: each rank notes in torchrun's store (`RankNotes`) which collective it entered last.
The first rank to fail claims the report there, so a failed run prints one ``error:`` line,
and the others, stopped by torchrun, end quietly (`Distributed.failed_elsewhere`).

Under torchrun each rank watches its parent (`watch_parent`): a launcher or torchrun killed
with -9 leaves no rank training on as an orphan; the ranks checkpoint and exit as on SIGTERM.
`run_torchrun_child` is torchrun as ``--nproc-per-node`` runs it: ranks start with stop
signals blocked (pending until the rank can handle them), and the run ends with the exit code
of the rank that failed first, without torchrun's traceback.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlpipe import processes
from dlpipe.errors import DlpipeError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Distributed",
    "DistributedError",
    "RankNotes",
    "init_distributed",
    "run_torchrun_child",
    "watch_parent",
]

DEFAULT_TIMEOUT_S = 600.0
PARENT_POLL_S = 0.5
REPORT_WAIT_S = 5.0  # how long a failed rank waits for the first one's exit code
T = TypeVar("T")


class DistributedError(DlpipeError, RuntimeError):
    """A collective failed or timed out: another rank hung, crashed or was killed."""


def collective_failed(
    rank: int, what: str, timeout_s: float, exc: BaseException, who: str = ""
) -> DistributedError:
    """The error a rank raises when `what` (a collective) failed or outwaited the timeout;
    `who` names the ranks that did not reach it, when they are known."""
    cause = " ".join(str(exc).split())[:200]
    return DistributedError(
        f"rank {rank}: {what} failed after waiting up to --dist-timeout {timeout_s:g} s for the "
        f"other ranks{': ' + who if who else ''} ({type(exc).__name__}: {cause}); a rank hung, "
        "crashed or was killed (its own output names why). Resume with the printed command; "
        "raise --dist-timeout if a step or checkpoint legitimately takes longer"
    )


class RankNotes:
    """What the ranks tell each other outside the process group, in torchrun's key-value
    store (which outlives any rank): the collective each entered last, and whether one
    already failed. Every call is best effort: without the store it answers "unknown".

    Args:
        store: a ``torch.distributed.Store`` client (None: no notes).
        rank, world_size: this rank and the run's.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.entered = 0  # collectives this rank entered

    def enter(self, what: str) -> None:
        """Note that this rank enters its next collective, `what`."""
        self.entered += 1
        self._call(lambda: self.store.set(f"at/{self.rank}", f"{self.entered}\t{what}"))

    def missing(self) -> str:
        """The ranks that did not reach this rank's current collective ("" if unknown)."""
        behind = []
        for other in range(self.world_size):
            if other == self.rank:
                continue
            note = self._call(functools.partial(self._read, f"at/{other}"))
            if self.store is None:
                return ""
            entered, _, what = (note or "0\tnone").partition("\t")
            if int(entered) < self.entered:
                behind.append(
                    f"rank {other} never reached it (the last collective it entered: {what})"
                )
        return "; ".join(behind)

    def report(self, code: int) -> tuple[bool | None, int]:
        """Claim the run's report: (True, `code`) for the first rank to fail, which prints
        the run's one error line; (False, the first rank's code) for the others, so every
        rank exits alike; (None, `code`) when the store cannot tell."""
        count = self._call(lambda: self.store.add("failed", 1))
        if count is None:
            return None, code
        if count == 1:
            self._call(lambda: self.store.set("code", str(code)))
            return True, code
        shared = self._call(self._first_code)
        return False, code if shared is None else int(shared)

    def _first_code(self) -> str:
        self.store.wait(["code"], datetime.timedelta(seconds=REPORT_WAIT_S))
        return bytes(self.store.get("code")).decode()

    def failed_elsewhere(self) -> bool:
        """Whether some rank already failed (claimed the report)."""
        return bool(self._call(lambda: self.store.check(["failed"])))

    def _read(self, key: str) -> str:
        if not self.store.check([key]):
            return ""
        return bytes(self.store.get(key)).decode()

    def _call(self, call: Callable[[], T]) -> T | None:
        if self.store is None:
            return None
        try:
            return call()
        except Exception:  # the store is gone (torchrun ended): no notes from here on
            self.store = None
            return None


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S
    notes: RankNotes = field(default_factory=lambda: RankNotes(None, 0, 1), repr=False)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def guarded(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, with a failed or timed-out collective named as `DistributedError`."""
        if not self.enabled:
            return call()
        self.notes.enter(what)
        try:
            return call()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if isinstance(exc, DistributedError):
                raise
            who = self.notes.missing()
            raise collective_failed(self.rank, what, self.timeout_s, exc, who) from None

    def report(self, code: int, default: bool) -> tuple[bool, int]:
        """Whether this rank prints the run's one error line, and the exit code every rank
        uses: the first rank to fail prints, and its code is the run's (`default` and `code`
        when that cannot be known: one process, no store)."""
        if not self.enabled:
            return True, code
        first, code = self.notes.report(code)
        return default if first is None else first, code

    def failed_elsewhere(self) -> bool:
        """Whether another rank already failed: torchrun is stopping this one."""
        return self.enabled and self.notes.failed_elsewhere()

    def all_reduce_(self, *tensors: torch.Tensor, what: str = "an all-reduce") -> None:
        """Sum each tensor over the ranks, in place."""
        if self.enabled:
            for tensor in tensors:
                self.guarded(what, functools.partial(dist.all_reduce, tensor, dist.ReduceOp.SUM))

    def all_gather(self, obj: Any, what: str = "an all-gather") -> list[Any]:
        """Every rank's `obj`, in rank order (small, picklable, over the process group only)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self.guarded(what, lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast(self, obj: Any, what: str = "a broadcast from rank 0") -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        self.guarded(what, lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def barrier(self, what: str = "a barrier") -> None:
        if self.enabled:
            self.guarded(what, dist.barrier)

    def on_main(
        self, what: str, work: Callable[[], T], share: Callable[[T], Any] | None = None
    ) -> Any:
        """`work()` on rank 0 only. Rank 0 gets its result, the others ``share(result)`` (the
        result itself by default); an error of rank 0 is raised on every rank, so no rank waits
        for one that gave up."""
        result: Any = None
        failure: BaseException | None = None
        if self.is_main:
            try:
                result = work()
            except (DlpipeError, OSError) as exc:
                failure = exc
        if self.enabled:
            ok = self.is_main and failure is None
            shared = (share or _same)(result) if ok else None
            message = None if failure is None else (type(failure), str(failure))
            shared, message = self.broadcast((shared, message), what=what)
            if message is not None and failure is None:
                failure = message[0](message[1])
            if not self.is_main and failure is None:
                result = shared
        if failure is not None:
            raise failure
        return result

    def average_buffers(self, model: nn.Module) -> None:
        """Make BatchNorm statistics (and other buffers) equal on all ranks before eval/save.

        Float buffers are averaged (timm's ``--dist-bn reduce``), others taken from rank 0.
        """
        if not self.enabled:
            return
        self.guarded("averaging BatchNorm buffers before evaluation", lambda: _average(model))

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around `model` when there are several ranks (the model itself otherwise)."""
        if not self.enabled:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        # no buffer broadcast in forward: a rank that backs off after an out-of-memory error
        # must not leave the others waiting in it; buffers are averaged before eval instead
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        if "forward_sync_buffers" in params:  # the newer name of the option
            return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)
        return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _same(value: Any) -> Any:
    return value


def _average(model: nn.Module) -> None:
    world_size = dist.get_world_size()
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, dist.ReduceOp.SUM)
            buffer.div_(world_size)
        else:
            dist.broadcast(buffer, src=0)


def _notes_store(timeout_s: float) -> Any:
    """A client of the store the process group was set up through (torchrun's, which
    outlives the ranks), keyed per torchrun attempt; None without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        client = dist.TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=min(timeout_s, 30.0)),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dlpipe/{attempt}/", client)


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> Distributed:
    """Join the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK), or run as one process.

    Args:
        timeout_s: how long any collective (the start-up rendezvous too) waits for the other
            ranks before `DistributedError`.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = Distributed(rank, world_size, local_rank, device, timeout_s)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        group.guarded(
            "joining the process group (the start-up rendezvous)",
            lambda: dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if device.type == "cuda" else None,
            ),
        )
    if world_size > 1:
        group.notes = RankNotes(_notes_store(timeout_s), rank, world_size)
    return group


def watch_parent(signum: int = signal.SIGTERM) -> threading.Thread | None:
    """Under torchrun, send this process `signum` once if its parent (torchrun) goes away.

    A daemon thread polls the parent pid: a rank whose torchrun was killed with -9 is
    re-parented, gets the signal and checkpoints and exits as on a pre-emption, instead of
    training on as an orphan. Returns the thread, or None outside torchrun.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return processes.watch_parent(
        os.getppid(), lambda: os.kill(os.getpid(), signum), every_s=PARENT_POLL_S
    )


def run_torchrun_child(launcher_pid: int, argv: list[str]) -> None:
    """torchrun's main as ``--nproc-per-node`` runs it, in a process that gets SIGTERM when
    the launcher dies (kill -9, a closed terminal): torchrun then stops the ranks, which
    checkpoint and exit.

    The ranks start with stop signals blocked, so one sent while a rank imports waits until
    it can handle it (`dlpipe.train.signals.startup_guard`). The ranks print their own
    ``error:`` line, so torchrun's failure logs and traceback are left out: this process
    exits with the code of the rank that failed first (one line of its own only when that
    rank was killed by a signal, which printed nothing).
    """
    processes.die_with_parent(signal.SIGTERM)
    if os.getppid() != launcher_pid:  # the launcher died before the line above
        sys.exit(143)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    _start_ranks_with_stop_signals_blocked()
    sys.argv = ["torchrun", *argv]
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        sys.exit(_first_failure_code(exc))
    except SignalException as exc:  # torchrun itself was signalled; it stopped the ranks
        sys.exit(128 + int(exc.sigval))


def _first_failure_code(exc: Any) -> int:
    """The exit code of the rank that failed first; 1, with one line, if a signal killed it."""
    rank, failure = exc.get_first_failure()
    if failure.exitcode >= 0:
        return int(failure.exitcode)
    name = signal.Signals(-failure.exitcode).name
    print(
        f"error: rank {rank} (pid {failure.pid}) was killed by {name} (out of memory, or "
        "killed by hand?); the other ranks were stopped. Resume with the same command",
        file=sys.stderr,
    )
    return 1


def _start_ranks_with_stop_signals_blocked() -> None:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handlers,
    )

    popen = getattr(handlers.SubprocessHandler, "_popen", None)
    if popen is None:  # another torch: ranks start as torchrun starts them
        return

    def blocked_popen(self: Any, args: tuple[Any, ...], env: dict[str, str]) -> Any:
        with processes.stop_signals_blocked(start_method="fork"):  # fork + exec: no tracker
            return popen(self, args, env)

    handlers.SubprocessHandler._popen = blocked_popen  # type: ignore[method-assign]
