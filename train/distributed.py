"""The process group: set up from torchrun's variables, NCCL on GPUs, gloo on CPUs.

Every helper here is a collective: all ranks call it, in the same order, and get the same
answer. A single process (no torchrun) gets the same helpers as no-ops, so the trainer has one
code path and no ``if rank == 0:`` around work that needs every rank.

A collective that waits longer than ``--dist-timeout`` (a rank hung, crashed or was killed)
raises `DistributedError` naming this rank and what it waited for. Under torchrun each rank
watches its parent (`watch_parent`): a launcher or torchrun killed with -9 leaves no rank
training on as an orphan; the ranks checkpoint and exit as on SIGTERM.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
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
    "init_distributed",
    "run_torchrun_child",
    "watch_parent",
]

DEFAULT_TIMEOUT_S = 600.0
PARENT_POLL_S = 0.5
T = TypeVar("T")


class DistributedError(DlpipeError, RuntimeError):
    """A collective failed or timed out: another rank hung, crashed or was killed."""


def collective_failed(
    rank: int, what: str, timeout_s: float, exc: BaseException
) -> DistributedError:
    """The error a rank raises when `what` (a collective) failed or outwaited the timeout."""
    return DistributedError(
        f"rank {rank}: {what} failed after waiting up to --dist-timeout {timeout_s:g} s for the "
        f"other ranks ({type(exc).__name__}: {str(exc)[:200]}); a rank hung, crashed or was "
        "killed (its own output names why). Resume with the printed command; raise "
        "--dist-timeout if a step or checkpoint legitimately takes longer"
    )


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float = DEFAULT_TIMEOUT_S

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
        try:
            return call()
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if isinstance(exc, DistributedError):
                raise
            raise collective_failed(self.rank, what, self.timeout_s, exc) from None

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
        what = "averaging BatchNorm buffers before evaluation"
        for buffer in model.buffers():
            if buffer.is_floating_point():
                self.all_reduce_(buffer, what=what)
                buffer.div_(self.world_size)
            else:
                self.guarded(what, functools.partial(dist.broadcast, buffer, src=0))

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
    """torchrun's main, in a process that gets SIGTERM when the launcher dies (kill -9, a
    closed terminal): torchrun then stops the ranks, which checkpoint and exit."""
    processes.die_with_parent(signal.SIGTERM)
    if os.getppid() != launcher_pid:  # the launcher died before the line above
        sys.exit(143)
    import runpy

    sys.argv = ["torchrun", *argv]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
