"""The thread engine: a loader's samples transformed on a pool of threads in its own process.

FFCV's way rather than torch's worker processes: nothing is forked or spawned, no batch crosses
a process boundary (a batch of 64 uint8 224 px images is 9.6 MB through shared memory with
workers), and the memory is one process's. It pays because the per-sample work runs without
the GIL: libjpeg-turbo (simplejpeg, ``torchvision.io``) and torch's crop and resize release it.

The order is the one 0 workers give, so resume, seeding and rank splitting are exactly the
0-worker loader's, batch for batch: the DataLoader runs in the calling process, the sampler or
the stream order draws there, the samples are read there (lmdb, hdf5 and tar reads are memory
copies), and only each sample's transform goes to the pool (`Deferred`). A batch is a
`PendingBatch` of futures until `ahead` resolves it, in order, ``depth`` batches behind the
submissions so the pool always has work queued. Threads get no signals (Python runs handlers
on the main thread), so a stop signal meant for the trainer reaches only the trainer. The
threads are daemons (`DaemonPool`): a transform that never returns cannot keep the interpreter
from exiting after ``loader.close()``, as ``ThreadPoolExecutor``'s joined threads would.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from dlpipe.loading.torch_private import pin_batch
from dlpipe.loading.views import Piece, apply_transform, collate
from dlpipe.sample import Sample

__all__ = [
    "DaemonPool",
    "Deferred",
    "PendingBatch",
    "ThreadEngine",
    "ahead",
    "collate_pending",
    "one_torch_thread",
]


class ThreadEngine:
    """One loader's pool of `threads` threads (made at the first submission, again after
    `close`), `depth` batches queued ahead, collated by `collate`, pinned when `pin`."""

    def __init__(
        self, threads: int, depth: int, pin: bool, collate: Callable[[list[Any]], Any] = collate
    ) -> None:
        self.threads, self.depth, self.pin, self.collate = threads, depth, pin, collate
        self._pool: DaemonPool | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = DaemonPool(self.threads, "dlpipe-loader", _one_torch_thread)
        return self._pool.submit(fn, *args)

    def deferred(self, transform: Callable[..., Any] | None) -> Deferred:
        """`transform` as the view's transform: each call queues it on the pool."""
        return Deferred(transform, self)

    def batches(self, pieces: Iterator[Piece]) -> Iterator[Piece]:
        """The DataLoader's pieces, their pending batches resolved in order."""
        return ahead(pieces, self.depth, self.pin, self.collate)

    def close(self) -> None:
        """Drop the queued transforms and let the threads end (a later pass starts anew)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class DaemonPool:
    """`threads` daemon threads running submitted calls in order, each after `initializer`.

    ``ThreadPoolExecutor`` would do, but the interpreter joins its threads at exit, so one
    transform that never returns (a hung network read, a deadlock in user code) would keep the
    process alive forever after the loader closed. The threads end after their current call on
    `shutdown`, or when the pool is collected. At interpreter exit (a loop left with ``break``
    and no ``close``) each pool is shut down and its threads get `EXIT_WAIT_S` in all to end
    their current calls (so do the threads of a pool shut down earlier, still finishing their
    last call): a daemon thread still inside a torch op when the interpreter
    finalizes aborts the process (``terminate called without an active exception``, exit code
    134); one that is still hung after the wait is abandoned.
    """

    def __init__(self, threads: int, name: str, initializer: Callable[[], None]) -> None:
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        for i in range(threads):  # the threads hold the queue, not the pool
            args = (self._work, initializer)
            thread = threading.Thread(target=_serve, args=args, name=f"{name}_{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
            _POOL_THREADS.add(thread)
        self._stop = weakref.finalize(self, _stop_threads, self._work, threads)
        _LIVE_POOLS.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._work.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Cancel the calls not started and let each thread end after its current one
        (without waiting for it)."""
        while True:
            try:
                work = self._work.get_nowait()
            except queue.Empty:
                break
            if work is not None:
                work[0].cancel()
        self._stop()


EXIT_WAIT_S = 10.0  # how long the pools' threads get at interpreter exit, in all
_LIVE_POOLS: weakref.WeakSet[DaemonPool] = weakref.WeakSet()
# every pool thread still running, its pool's included when that pool was shut down and
# collected while the thread finished its last call (a closed loader's): threading holds a
# running thread, so this set does until it ends
_POOL_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _end_pools_at_exit() -> None:
    """Shut every live pool down and wait (`EXIT_WAIT_S` in all) for every pool thread's
    current call, closed pools' threads included."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for pool in list(_LIVE_POOLS):
        pool.shutdown()
    for thread in list(_POOL_THREADS):
        thread.join(max(0.0, deadline - time.monotonic()))


def _stop_threads(work: queue.SimpleQueue[_Work | None], threads: int) -> None:
    for _ in range(threads):
        work.put(None)


def _serve(work_queue: queue.SimpleQueue[_Work | None], initializer: Callable[[], None]) -> None:
    """One pool thread: run calls until told to stop."""
    initializer()
    while (work := work_queue.get()) is not None:
        future, fn, args = work
        del work
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as exc:  # as ThreadPoolExecutor: the caller gets it
                future.set_exception(exc)
            else:
                future.set_result(result)
        del future, fn, args


def _one_torch_thread() -> None:
    """A loader thread's torch ops run on it alone, as in a DataLoader worker process: the
    pool's threads are the parallelism, and an OpenMP team per thread on top of them would
    oversubscribe the cores (2 threads x 2 OpenMP threads each on 2 cores; an alternating A/B
    gave 5 % more samples per CPU-second without the teams, within this machine's noise).
    OpenMP keeps the thread count per thread, so the caller's own torch ops keep theirs.

    torch sets a thread's count lazily from a process-wide value at the thread's first torch
    call (``at::init_num_threads``), which any thread's ``set_num_threads`` changes: a count set
    before that first call is overwritten by whatever another thread set meanwhile (the
    caller's count back after each batch: 2 here). ``get_num_threads`` makes that first call."""
    torch.get_num_threads()
    torch.set_num_threads(1)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The calling thread's torch ops on one thread for the block, its own count back after
    (also when the block raises): what the loader's share of each batch in the caller's
    thread, the tuner's stage table and one-core benchmark passes run under."""
    caller = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(caller)


class Deferred:
    """A transform queued on a `ThreadEngine`: calling it returns the future of its result."""

    seeded_by_position = True  # `apply_transform` passes the epoch and index on

    def __init__(self, transform: Callable[..., Any] | None, engine: ThreadEngine) -> None:
        self.transform, self.engine = transform, engine

    def __call__(self, sample: Sample, epoch: int = 0, index: int = 0) -> Future[Any]:
        return self.engine.submit(apply_transform, self.transform, sample, epoch, index)


class PendingBatch(NamedTuple):
    """A batch whose samples are still being transformed."""

    futures: list[Future[Any]]


def collate_pending(items: list[Future[Any]]) -> PendingBatch:
    """The collate function of a loader on the thread engine: collation waits for `ahead`."""
    return PendingBatch(list(items))


def _resolve(piece: Piece, collate: Callable[[list[Any]], Any], pin: bool) -> Piece:
    """A piece's pending batch collated, and pinned when `pin`."""
    pending: PendingBatch = piece.batch
    batch = collate([future.result() for future in pending.futures])
    return Piece(pin_batch(batch) if pin else batch, piece.runs)


def ahead(
    pieces: Iterator[Piece], depth: int, pin: bool, collate: Callable[[list[Any]], Any] = collate
) -> Iterator[Piece]:
    """`pieces` with their pending batches resolved in order by `collate`, drawn `depth`
    pieces ahead (their transforms already queued); batches pinned when `pin` (what torch's
    pin-memory thread does for worker batches)."""
    window: deque[Piece] = deque()
    for piece in pieces:
        window.append(piece)
        if len(window) > depth:
            yield _resolve(window.popleft(), collate, pin)
    while window:
        yield _resolve(window.popleft(), collate, pin)
