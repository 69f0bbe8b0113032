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

__all__ = ["available_memory", "cpu_seconds", "proportional_set_size", "usable_cpus"]


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
