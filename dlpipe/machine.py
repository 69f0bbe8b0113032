"""Machine facts every room sizes itself by: usable CPUs, available memory, and the memory
a set of processes uses.

The CPU count is the process's affinity mask where the platform has one (a CPU-limited
container or ``taskset`` shows fewer cores than ``os.cpu_count()``), so "all cores but one"
never oversubscribes. `doctor`, the converter, the loader, the tuner and the profile key all
ask here.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import NamedTuple

__all__ = [
    "WorkerLimit",
    "available_memory",
    "cpu_seconds",
    "open_files_limit",
    "proportional_set_size",
    "usable_cpus",
    "worker_limit",
]

# What one loader worker costs, for `worker_limit`. Past these a worker count cannot run well
# (or at all): 4 per core is twice what `bench-loader` tries; a forked worker's own pages
# grow to tens of MB once it has decoded and queued batches (256 workers took 2 GB on 2
# cores before any batch); each worker holds a few pipes in the parent and each batch in
# flight a shared-memory descriptor.
WORKERS_PER_CPU = 4
WORKER_PROCESS_BYTES = 128 << 20
WORKER_THREAD_BYTES = 16 << 20
WORKER_FILES = 8
RESERVED_FILES = 64  # the trainer's own: shards, checkpoints, logs, CUDA


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes), or the physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def proportional_set_size(pids: list[int]) -> int:
    """The memory of processes `pids` in bytes: their proportional set size (shared library
    pages split between the processes sharing them, so N loader workers are not counted as N
    copies of torch). A process that is gone, or a platform without /proc, counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return total


def cpu_seconds() -> float:
    """CPU seconds so far of this process (all its threads) and of its live child processes
    (DataLoader workers are children while they run), from /proc; a platform without /proc
    counts this process alone."""
    total = time.process_time()
    if not os.path.isdir("/proc/self"):  # macOS, Windows: no per-process CPU times to read
        return total
    tick = os.sysconf("SC_CLK_TCK")
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended between the listing and the read, or no /proc
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def open_files_limit() -> int | None:
    """This process's soft limit on open file descriptors, or None where it is unlimited or
    unknown."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


class WorkerLimit(NamedTuple):
    """The most loader workers this machine can run, and what limits them (for a message)."""

    workers: int
    reason: str


def worker_limit(*, threads: bool = False) -> WorkerLimit:
    """The most loader workers (processes, or with `threads` the thread engine's threads)
    this machine can run now: `WORKERS_PER_CPU` per usable CPU, what the available memory
    holds at `WORKER_PROCESS_BYTES` (`WORKER_THREAD_BYTES`) each and, for processes, what the
    open-files limit leaves at `WORKER_FILES` each; the smallest wins, at least 1."""
    cpus = usable_cpus()
    limits = [(WORKERS_PER_CPU * cpus, f"{WORKERS_PER_CPU} per usable CPU, {cpus} CPUs")]
    per_worker = WORKER_THREAD_BYTES if threads else WORKER_PROCESS_BYTES
    memory = available_memory()
    limits.append(
        (memory // per_worker, f"{memory >> 20} MiB available at {per_worker >> 20} MiB each")
    )
    files = None if threads else open_files_limit()
    if files is not None:
        usable = files - RESERVED_FILES
        limits.append((usable // WORKER_FILES, f"open-files limit {files} (ulimit -n)"))
    count, reason = min(limits)
    return WorkerLimit(max(1, int(count)), reason)
