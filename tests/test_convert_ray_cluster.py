"""``dlpipe convert --engine ray`` on a real two-node Ray cluster on this machine.

The cluster is started as a user would start one: ``ray start --head`` and a second
``ray start --address`` with its own CPUs and resources. Each ``ray start`` runs in its own
session, so teardown ends exactly the processes it started (by process group), never another
Ray on the machine. Ray maps 127.0.0.1 to this host's own address; nothing leaves the machine.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port
from PIL import Image

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # a throw-away local cluster: no token to hand around
    "RAY_ADDRESS": "",
    # the first shards go to both nodes: neither node's worker is started before the other's
    # (no head start for the head node), and a worker goes back after each shard, so each
    # next shard is placed by the engine's SPREAD strategy (not run on the last free worker)
    "RAY_prestart_worker_first_driver": "0",
    "RAY_worker_lease_timeout_milliseconds": "0",
}
_SHARDS = 6
_NODE_LINE = re.compile(r"shard (\S+) written on Ray node ([0-9a-f]+)")


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _stop(groups: list[int]) -> None:
    """End every process of the given process groups (SIGTERM, then SIGKILL)."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = []
        for group in groups:
            try:
                os.killpg(group, sig)
                alive.append(group)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while alive and time.monotonic() < deadline:
            alive = [g for g in alive if _group_alive(g)]
            time.sleep(0.2)
        if not alive:
            return


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _start(args: list[str], env: dict[str, str], groups: list[int]) -> None:
    """``ray start ...`` in a new session (its daemons keep that process group)."""
    proc = subprocess.Popen(
        [_ray(), "start", *args, "--disable-usage-stats"],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    groups.append(proc.pid)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """(address, environment) of a head node and a second node, one CPU each."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit
    env = {**os.environ, **_RAY_ENV}
    port = free_port()
    groups: list[int] = []
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--temp-dir", temp]
    try:
        _start(
            ["--head", "--port", str(port), "--include-dashboard=false", *common,
             "--resources", json.dumps({"node_a": 1})],
            env, groups,
        )  # fmt: skip
        _start(
            ["--address", f"127.0.0.1:{port}", *common, "--resources", json.dumps({"node_b": 1})],
            env,
            groups,
        )
        yield f"127.0.0.1:{port}", env
    finally:
        _stop(groups)
        assert not any(_group_alive(g) for g in groups), "a Ray process outlived the test"
        subprocess.run(["rm", "-rf", temp], check=False)


def _raw(root: Path) -> tuple[Path, int]:
    """(an ImageFolder of large PNGs, the --shard-size that gives about 6 shards).

    Each image takes tens of milliseconds to decode and shrink, so a shard takes about a
    second: far longer than the difference between two nodes' worker start-ups.
    """
    png = io.BytesIO()
    Image.new("RGB", (1500, 1500), (30, 160, 90)).save(png, "PNG")
    per_class = 30
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            (root / cls / f"{i}.png").write_bytes(png.getvalue())
    return root, len(png.getvalue()) * 2 * per_class // _SHARDS


def _convert(raw: Path, out: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """``dlpipe convert`` in a subprocess with dlpipe's info log on stderr."""
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "from dlpipe.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = ["convert", str(raw), "--to", "wds", "--out", str(out), "--max-side", "64"]
    return subprocess.run(
        [sys.executable, "-c", code, *args, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_two_node_cluster_writes_what_the_local_engine_writes(cluster, tmp_path) -> None:
    address, env = cluster
    raw, shard_bytes = _raw(tmp_path / "raw")
    ray_out, local_out = tmp_path / "ray", tmp_path / "local"
    sized = ("--shard-size", str(shard_bytes))
    done = _convert(raw, ray_out, env, *sized, "--engine", "ray", "--ray-address", address)
    assert done.returncode == 0, done.stderr[-3000:]
    nodes = dict(_NODE_LINE.findall(done.stderr))  # shard -> the node that wrote it
    shards = sorted(n for n in os.listdir(ray_out) if n.endswith(".tar"))
    assert sorted(nodes) == shards and len(shards) >= _SHARDS - 1, done.stderr[-3000:]
    assert len(set(nodes.values())) == 2, nodes  # both nodes wrote shards
    done = _convert(raw, local_out, env, *sized, "--engine", "local", "--workers", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(os.listdir(local_out))
    assert names == sorted(os.listdir(ray_out)) and "dlpipe.json" in names
    for name in names:  # every shard and the manifest, byte for byte (no field differs)
        assert (local_out / name).read_bytes() == (ray_out / name).read_bytes(), name
