"""Engines that run shard tasks: local worker processes, or Ray tasks on a cluster.

Both take the same tasks and yield `TaskResult`s as shards finish (in any order); the engine
orders them by the plan, so the output does not depend on which one ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from dlpipe import storage
from dlpipe.converters.plan import ShardTask
from dlpipe.converters.source import Source
from dlpipe.converters.worker import OutputFullError, TaskResult, WorkerConfig, write_task
from dlpipe.errors import DlpipeError
from dlpipe.processes import die_with_parent, stop_signals_blocked, watch_parent

__all__ = [
    "TEST_HOLD_ENV",
    "EngineError",
    "WorkerDiedError",
    "keep_freed_memory",
    "run_local",
    "run_ray",
    "worker_init",
]

log = logging.getLogger("dlpipe")

_FULL_BYTES = 1 << 20  # less free than this after a worker died: the disk filled up
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
TEST_HOLD_ENV = "DLPIPE_TEST_HOLD"
"""A test hook: the folder in which a process announces that it holds (see `_held_job`)."""
_tasks_started = 0  # by this process, while TEST_HOLD_ENV is set


class EngineError(DlpipeError, RuntimeError):
    """The engine cannot run (e.g. Ray is not installed or not reachable)."""


class WorkerDiedError(EngineError):
    """A worker process died (killed, out of memory, a crash) before its shard was finished."""


Job = Callable[[Source, ShardTask, WorkerConfig], TaskResult]
"""What runs each task: `write_task`, or `audit_task` (``--dedup``'s fingerprint pass)."""


def run_local(
    source: Source,
    tasks: Sequence[ShardTask],
    config: WorkerConfig,
    workers: int,
    job: Job = write_task,
) -> Iterator[TaskResult]:
    """Run `job` on each task in `workers` spawned processes (in this process when `workers`
    is 1)."""
    if workers <= 1 or len(tasks) <= 1:
        keep_freed_memory()
        for task in tasks:
            yield _held_job(job, source, task, config)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process with threads
    pool = ProcessPoolExecutor(
        max_workers=min(workers, len(tasks)),
        mp_context=context,
        initializer=worker_init,
        initargs=(os.getpid(),),
    )
    # the submits spawn the workers, which start with these blocked (see worker_init) and
    # without the caller's main script (see _main_script_left_out)
    with stop_signals_blocked(_STOP_SIGNALS, start_method="spawn"), _main_script_left_out():
        pending: set[Future[TaskResult]] = {
            pool.submit(_held_job, job, source, task, config) for task in tasks
        }
    with pool, _ctrl_c_deferred() as interrupted:
        try:
            while pending:
                done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
                if interrupted():
                    raise KeyboardInterrupt
        except BrokenProcessPool:
            _kill_workers(pool)
            raise _worker_died(config.out) from None
        finally:
            # the pool's own thread cancels what has not started: a future cancelled from
            # here races a worker crash in Python 3.11 (InvalidStateError, gh-107219)
            pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _main_script_left_out() -> Iterator[None]:
    """Spawn the workers without running the caller's main script in them.

    A spawned child imports its parent's ``__main__`` again, so that functions defined there
    can be unpickled; a shard task holds dlpipe's functions and objects only. Re-running the
    script cost each worker the whole CLI's imports (the ``dlpipe`` script, ~60 ms); a user's
    script without an ``if __name__ == "__main__":`` guard started the conversion over again
    in every worker (tracebacks from each, then "a worker process died"); a script read from
    stdin could not be found at all. While the submits spawn the workers, ``__main__`` is a
    bare module, which spawn leaves alone. Every worker is spawned here: the pool starts one
    per submit while none is idle, and all tasks are submitted at once.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = main


def _held_job(job: Job, source: Source, task: ShardTask, config: WorkerConfig) -> TaskResult:
    """`job`, after a test's hold point: nothing happens unless ``DLPIPE_TEST_HOLD`` is set.

    With ``DLPIPE_TEST_HOLD=<folder>``, the process that runs the tasks (the main one with one
    worker, else each worker process) creates ``<folder>/<its pid>`` before it starts its
    second task, and waits until ``<folder>/release`` exists. So a test interrupts or kills a
    conversion mid-run on a machine of any speed, then releases every hold, present and
    later (tests/convert_hold.py).
    """
    global _tasks_started
    folder = os.environ.get(TEST_HOLD_ENV)
    if folder:
        _tasks_started += 1
        if _tasks_started == 2:
            with open(os.path.join(folder, str(os.getpid())), "w"):
                pass
            while not os.path.exists(os.path.join(folder, "release")):
                time.sleep(0.01)
    return job(source, task, config)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """SIGKILL the workers left in a broken pool.

    A worker killed while it held the result queue's lock leaves the others blocked on that
    lock for ever; the pool's own clean-up only sends SIGTERM, which the workers ignore (see
    `worker_init`), and then waits for them, so its shutdown would hang.
    """
    processes = getattr(pool, "_processes", None) or {}
    for process in list(processes.values()):
        with contextlib.suppress(OSError, ValueError):
            process.kill()


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[Callable[[], bool]]:
    """Ctrl-C sets a flag that the wait loop turns into KeyboardInterrupt between waits.

    A KeyboardInterrupt raised inside ``concurrent.futures.wait`` can leave a future's lock
    held, and the pool's shutdown then hangs for ever (its thread blocks cancelling that
    future). Outside the main thread signals cannot be handled here: nothing is deferred.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield lambda: bool(caught)
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker_died(out: str) -> DlpipeError:
    if _nearly_full(out):  # a C library (HDF5) may crash on a full disk instead of raising
        return OutputFullError(
            f"{out}: the disk filled up while writing a shard (its worker process died)"
        )
    return WorkerDiedError(
        "a conversion worker process died (killed, or out of memory) before its shard was "
        "finished; the finished shards are kept"
    )


def _nearly_full(out: str) -> bool:
    if storage.is_url(out):
        return False
    try:
        return shutil.disk_usage(storage.existing_ancestor(out)).free < _FULL_BYTES
    except OSError:
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_KEPT_FREE_BYTES = 1 << 30
_MMAP_FROM_BYTES = 32 << 20  # glibc's largest: smaller blocks come from the heap


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for the process's next shard instead of giving it back.

    A shard's buffers (LMDB's dirty pages, freed at each commit; the HDF5 writer's blobs; the
    images read) are freed when the shard is done, and glibc hands the top of its heap back to
    the kernel, so every shard faulted its memory in afresh: LMDB spent more system time in
    page faults than writing (benchmarks/convert.py). Called once per converting process;
    False where the C library is not glibc (nothing changes there).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(_M_TRIM_THRESHOLD, _KEPT_FREE_BYTES)
    return bool(kept and mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM_BYTES))


def worker_init(parent_pid: int) -> None:
    """Set up a pool worker: it dies with its parent, and leaves signals to the parent.

    A parent killed with SIGKILL (the OOM killer) runs no cleanup, so each worker must notice
    by itself: on Linux the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``); elsewhere, and as
    a backstop, a daemon thread checks the parent pid every second. SIGINT and SIGTERM sent to
    the whole process group (Ctrl-C, Slurm) are ignored here: the main process decides, and
    the workers follow it when it exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked since the spawn: pending ones are dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)
    watch_parent(parent_pid, lambda: os._exit(1), every_s=1.0)
    keep_freed_memory()


def run_ray(
    source: Source,
    tasks: Sequence[ShardTask],
    config: WorkerConfig,
    address: str | None,
    job: Job = write_task,
) -> Iterator[TaskResult]:
    """Run `job` on each task as a Ray task (one CPU each) on the cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise EngineError(
            "--engine ray needs Ray: pip install 'dlpipe[ray]' (or use --engine local)"
        ) from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        except ConnectionError as exc:
            raise EngineError(f"cannot reach the Ray cluster at {address!r}: {exc}") from exc
    # SPREAD: else Ray pipelines short shard tasks onto the first worker, the others idle
    remote = ray.remote(num_cpus=1, max_retries=2, scheduling_strategy="SPREAD")(
        _write_task_on_node
    )
    source_ref, config_ref = ray.put(source), ray.put(config)
    pending = [remote.remote(job, source_ref, task, config_ref) for task in tasks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield _ray_result(ray, ref, "written" if job is write_task else "fingerprinted")
    finally:
        for ref in pending:
            ray.cancel(ref)


def _write_task_on_node(
    job: Job, source: Source, task: ShardTask, config: WorkerConfig
) -> tuple[TaskResult, str]:
    """`job` in a Ray task, and the id of the Ray node that ran it."""
    import ray

    keep_freed_memory()
    return job(source, task, config), ray.get_runtime_context().get_node_id()


def _ray_result(ray: object, ref: object, done: str) -> TaskResult:
    try:
        got: tuple[TaskResult, str] = ray.get(ref)  # type: ignore[attr-defined]
    except Exception as exc:  # a RayTaskError wraps the worker's exception
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DlpipeError):
            raise cause from None
        raise
    result, node = got
    log.info("shard %s %s on Ray node %s", result.name, done, node)
    return result
