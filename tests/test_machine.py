"""CPU counts come from the affinity mask everywhere: a CPU-limited process never oversubscribes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs an affinity mask of at least 2 CPUs to restrict",
)

_CHILD = r"""
import json, os, sys
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
from dlpipe.doctor import Probe
from dlpipe.loading.profile import machine_key
from dlpipe.loading.tune_stages import BenchConfig
from dlpipe.machine import usable_cpus
import dlpipe
loader = dlpipe.make_loader(sys.argv[1], "train", dlpipe.LoaderConfig(batch_size=4), profile=None)
print(json.dumps({
    "usable": usable_cpus(),
    "cpu_count": os.cpu_count(),
    "doctor": Probe().cpu_count(),
    "profile_key": machine_key()["cpus"],
    "tuner_max_workers": BenchConfig(path=sys.argv[1]).worker_limit(),
    "loader_workers": loader.num_workers,
}))
"""


def test_one_allowed_cpu_is_one_cpu_for_every_room(make_dataset) -> None:
    path = make_dataset("lmdb")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, path], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["cpu_count"] >= 2  # the machine has more; the process may use one
    assert facts["usable"] == facts["doctor"] == facts["profile_key"] == 1
    assert facts["tuner_max_workers"] == 2
    assert facts["loader_workers"] == 1


def test_proportional_set_size_counts_live_processes_and_skips_gone_ones() -> None:
    import subprocess
    import sys

    from dlpipe.machine import proportional_set_size

    child = subprocess.Popen(  # alive until killed below, however slow the machine
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        alone = proportional_set_size([os.getpid()])
        both = proportional_set_size([os.getpid(), child.pid])
        assert alone > 1_000_000 and both > alone  # this process, then a Python beside it
    finally:
        child.kill()
        child.communicate()  # reaped, its stdin closed
    assert proportional_set_size([child.pid]) == 0  # gone: counts nothing
