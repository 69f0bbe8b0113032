"""The order-aware shard cache against a real S3 API (moto's server on loopback), reached
through a small fault-injecting proxy that counts each object's GETs."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3_faults
from s3_faults import FaultProxy, proxy_options

from dlpipe.manifest import ShardInfo
from dlpipe.shard_cache import (
    CacheDiskFullError,
    CacheFolderError,
    RetryPolicy,
    ShardCache,
    ShardCacheLimitError,
    ShardFetchError,
)
from dlpipe.shard_plan import ShardPlan
from dlpipe.shard_store import PART_PREFIX

proxy = s3_faults.proxy  # the fixture (module-scoped), shared with the loader's tests
FAST_RETRY = RetryPolicy(attempts=3, first_backoff_s=0.0)


@pytest.fixture
def remote(
    s3_env: dict[str, str], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, request: Any
) -> Callable[..., tuple[str, list[ShardInfo], dict[str, bytes]]]:
    """remote(count, size) -> (url root, shards, bytes by name): random shards uploaded to a
    fresh prefix of the S3 server (straight, not through the proxy)."""
    import s3fs

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    proxy.gets.clear()
    proxy.faults.clear()
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    if not fs.exists("shard-cache"):
        fs.mkdir("shard-cache")

    def make(count: int = 8, size: int = 4096) -> tuple[str, list[ShardInfo], dict[str, bytes]]:
        prefix = f"shard-cache/{request.node.name.replace('[', '-').rstrip(']')}"
        rng = random.Random(count * 7919 + size)
        data = {f"train-{i:06d}.tar": rng.randbytes(size) for i in range(count)}
        for name, blob in data.items():
            fs.pipe_file(f"{prefix}/{name}", blob)
        shards = [ShardInfo(n, 1, len(b), hashlib.sha256(b).hexdigest()) for n, b in data.items()]
        return f"s3://{prefix}", shards, data

    return make


def _cache(
    remote_root: str,
    folder: Path,
    limit: int,
    shards: list[ShardInfo],
    proxy: FaultProxy,
    **kw: Any,
) -> ShardCache:
    kw.setdefault("retry", FAST_RETRY)
    return ShardCache(
        remote_root, str(folder), limit, shards, storage_options=proxy_options(proxy), **kw
    )


def _read(cache: ShardCache, name: str) -> bytes:
    path = cache.get(name)
    try:
        return Path(path).read_bytes()
    finally:
        cache.release(name)


def _key(root: str, name: str) -> str:
    return root.removeprefix("s3://") + "/" + name


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def _ours_only(folder: Path) -> list[str]:
    """Files of the folder other than the cache's locks and index."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".dlpipe-lock."))


# --- reading, prefetch, restart ---------------------------------------------------------------


def test_every_shard_reads_as_stored_and_prefetch_follows_the_plan(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(8)
    order = [s.name for s in shards][::-1]
    with _cache(root, tmp_path, 10**9, shards, proxy, threads=1, prefetch=3) as cache:
        cache.plan(order)
        _wait_for(lambda: cache.stats().downloads == 3, "three prefetched shards")
        assert sorted(n for n in os.listdir(tmp_path) if n in data) == sorted(order[:3])
        assert all(_read(cache, name) == data[name] for name in order)
        assert cache.stats().downloads == 8 and cache.stats().gets == 8
    assert all(proxy.gets[_key(root, n)] == 1 for n in order), proxy.gets


def test_prefetch_takes_at_most_half_the_cache_limit(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(8)
    order = [s.name for s in shards]
    with _cache(root, tmp_path, 6 * 4096, shards, proxy, threads=2, prefetch=8) as cache:
        cache.plan(order)
        _wait_for(lambda: cache.stats().downloads == 3, "half the limit's worth of shards")
        assert sorted(n for n in os.listdir(tmp_path) if n in data) == order[:3]
        assert cache.stats().evictions == 0  # nothing needed sooner was evicted for them
        assert all(_read(cache, name) == data[name] for name in order)


def test_a_restart_on_a_warm_cache_downloads_nothing(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(6)
    order = [s.name for s in shards]
    with _cache(root, tmp_path, 10**9, shards, proxy) as cache:
        cache.plan(order)
        assert [_read(cache, n) for n in order] == [data[n] for n in order]
    proxy.gets.clear()
    with _cache(root, tmp_path, 10**9, shards, proxy) as again:
        again.plan(order)
        assert [_read(again, n) for n in order] == [data[n] for n in order]
        assert again.stats().downloads == 0 and again.stats().hit_rate == 1.0
    assert sum(proxy.gets.values()) == 0


def test_a_cached_shard_changed_on_disk_is_hashed_again_and_replaced(
    remote, proxy, tmp_path
) -> None:
    root, shards, data = remote(2)
    name = shards[0].name
    with _cache(root, tmp_path, 10**9, shards, proxy) as cache:
        _read(cache, name)
    (tmp_path / name).write_bytes(b"\0" * len(data[name]))  # same size, other bytes
    with _cache(root, tmp_path, 10**9, shards, proxy) as again:
        assert _read(again, name) == data[name] and again.stats().downloads == 1


def test_a_foreign_file_under_a_shard_name_is_refused_and_kept(remote, proxy, tmp_path) -> None:
    root, shards, _ = remote(2)
    (tmp_path / shards[0].name).write_bytes(b"mine")
    with pytest.raises(CacheFolderError, match="did not write") as caught:
        _cache(root, tmp_path, 10**9, shards, proxy)
    assert shards[0].name in str(caught.value) and "cache_dir" in str(caught.value)
    assert (tmp_path / shards[0].name).read_bytes() == b"mine"


def test_bad_arguments_are_named(remote, proxy, tmp_path) -> None:
    root, shards, _ = remote(2)
    with pytest.raises(ShardCacheLimitError, match="smaller than the largest shard"):
        _cache(root, tmp_path, 100, shards, proxy)
    with _cache(root, tmp_path, 10**9, shards, proxy) as cache:
        with pytest.raises(ValueError, match="'nope' is not in this dataset's manifest"):
            cache.plan(["nope"])
        with pytest.raises(ValueError, match="released more often"):
            cache.release(shards[0].name)
        with pytest.raises(ValueError, match="mine has position 2, outside the order's 2 uses"):
            cache.plan([shards[0].name, shards[1].name], mine=[0, 2])


# --- eviction ---------------------------------------------------------------------------------


def test_belady_beats_lru_with_a_quarter_size_cache(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(16)
    rng, names = random.Random(0), [s.name for s in shards]
    order = rng.sample(names, 16) + rng.sample(names, 16)  # two shuffled epochs
    rates = {}
    for policy in ("belady", "lru"):
        folder = tmp_path / policy
        with _cache(root, folder, 4 * 4096, shards, proxy, policy=policy, prefetch=0) as cache:
            cache.plan(order)
            assert all(_read(cache, name) == data[name] for name in order)
            rates[policy] = cache.stats()
    print(f"hit rate, 16 shards x 2 epochs, cache of 4: {rates}")
    assert rates["belady"].hit_rate > rates["lru"].hit_rate
    assert rates["belady"].downloads < rates["lru"].downloads


def test_workers_sharing_one_plan_keep_the_shards_each_other_reads_next(
    remote, proxy, tmp_path
) -> None:
    """Two readers of one folder plan the node's order (x reads a, c; y reads b, a): making
    room for c, x evicts b, which nobody reads again, not a, which y reads next and which x's
    own reads alone would call never needed."""
    root, shards, data = remote(3)
    a, b, c = (s.name for s in shards)
    order = [a, b, c, a]
    limit = 2 * 4096
    with (
        _cache(root, tmp_path, limit, shards, proxy, prefetch=0) as x,
        _cache(root, tmp_path, limit, shards, proxy, prefetch=0) as y,
    ):
        x.plan(order, mine=[0, 2])
        y.plan(order, mine=[1, 3])
        assert _read(x, a) == data[a] and _read(y, b) == data[b]
        assert _read(x, c) == data[c]
        assert sorted(n for n in os.listdir(tmp_path) if n in data) == [a, c]
        assert _read(y, a) == data[a] and y.stats().hits == 1
    assert proxy.gets[_key(root, a)] == 1, proxy.gets


def test_a_plan_moves_along_its_readers_own_uses_only() -> None:
    """Reading one use sample by sample, or a shard the other reader also uses next, moves
    the cursor past this reader's use only: the other's uses stay ahead, and the prefetch
    window lists this reader's shards."""
    plan = ShardPlan(["x", "y", "x", "z", "y"], mine=[0, 3])
    sizes = dict.fromkeys("xyz", 1)
    assert list(plan.window(5, 10, sizes)) == [(0, "x"), (3, "z")]
    plan.take("x")
    plan.take("x")  # the same use's next sample
    assert plan.cursor == 1 and plan.next_use("x") == 2 and plan.next_use("y") == 1
    plan.take("z")
    assert plan.cursor == 4 and plan.next_use("y") == 4 and plan.next_use("x") is None
    alone = ShardPlan(["x", "y", "x"])  # one reader: every use its own
    alone.take("x")
    alone.take("x")
    assert alone.cursor == 1 and alone.next_use("x") == 2


def test_a_shard_in_use_is_never_evicted_by_any_process(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(4)
    a, b, c, _ = (s.name for s in shards)
    with _cache(root, tmp_path, 2 * 4096, shards, proxy, prefetch=0) as reader:
        held = reader.get(a)  # read by another process of the node (its own lock)
        with _cache(root, tmp_path, 2 * 4096, shards, proxy, prefetch=0) as other:
            other.plan([b, c])  # `a` is never used again by this one
            assert _read(other, b) == data[b] and _read(other, c) == data[c]
            assert Path(held).read_bytes() == data[a]
            other.get(c)
            with pytest.raises(ShardCacheLimitError, match="beside the shards being read"):
                other.get(b)
        reader.release(a)


# --- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("faults", [["500", "500"], ["stall"], ["cut", "cut"]])
def test_failed_and_cut_downloads_are_retried(remote, proxy, tmp_path, faults) -> None:
    root, shards, data = remote(2, size=64 << 10)
    name = shards[0].name
    proxy.faults[_key(root, name)] = list(faults)
    with _cache(root, tmp_path, 10**9, shards, proxy, prefetch=0) as cache:
        assert _read(cache, name) == data[name]
    assert proxy.gets[_key(root, name)] > len(faults) - 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PART_PREFIX)]


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "always 500"])
def test_a_bad_shard_in_storage_is_one_named_error_and_nothing_is_kept(
    remote, proxy, tmp_path, damage
) -> None:
    import s3fs

    root, shards, data = remote(2)
    name = shards[0].name
    stored = data[name][:-10] if damage == "truncated" else data[name][:-1] + b"?"
    if damage == "always 500":
        proxy.faults[_key(root, name)] = ["500"] * 1000
    else:
        s3fs.S3FileSystem(skip_instance_cache=True).pipe_file(_key(root, name), stored)
    with _cache(root, tmp_path, 10**9, shards, proxy, prefetch=0) as cache:
        with pytest.raises(ShardFetchError) as caught:
            cache.get(name)
    message = str(caught.value)
    assert name in message and f"{root}/{name}" in message and "3 attempts" in message, message
    assert "dlpipe verify" in message
    assert name not in _ours_only(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(PART_PREFIX)]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path, leave_bytes: int) -> None:
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "filler").write_bytes(b"\0" * max(0, free - leave_bytes))


def test_a_full_disk_evicts_a_shard_not_needed_soon_then_one_named_error(
    remote, proxy, small_disk
) -> None:
    root, shards, data = remote(3, size=300 << 10)
    a, b, c = (s.name for s in shards)
    folder = small_disk / "cache"
    with _cache(root, folder, 10**9, shards, proxy, prefetch=0) as cache:
        assert _read(cache, a) == data[a]
        _fill(small_disk, leave_bytes=100 << 10)
        cache.plan([b, c])  # `a` is not needed again: evicted to make room
        assert _read(cache, b) == data[b] and not (folder / a).exists()
        held = cache.get(b)  # in use: nothing left to evict for `c`
        with pytest.raises(CacheDiskFullError) as caught:
            cache.get(c)
        assert str(folder) in str(caught.value) and "free space" in str(caught.value)
        assert Path(held).read_bytes() == data[b]
        cache.release(b)
    assert _ours_only(folder) == [".dlpipe-cache-index.json", ".dlpipe-cache-index.lock", b]


# --- several processes --------------------------------------------------------------------------

_CHILD = """
import hashlib, json, os, sys, time
import dlpipe.shard_fetch
from dlpipe.manifest import ShardInfo
from dlpipe.shard_cache import RetryPolicy, ShardCache
args = json.loads(sys.argv[1])
dlpipe.shard_fetch.CHUNK_BYTES = args["chunk"]
while not os.path.exists(args["go"]):
    time.sleep(0.01)
shards = [ShardInfo(**s) for s in args["shards"]]
with ShardCache(args["root"], args["cache"], 10**9, shards, prefetch=0,
                retry=RetryPolicy(attempts=1), storage_options=args["options"]) as cache:
    path = cache.get(args["name"])
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    print(json.dumps({"sha256": digest, "downloads": cache.stats().downloads}))
    cache.release(args["name"])
"""


def _child(
    root: str,
    folder: Path,
    shards: list[ShardInfo],
    name: str,
    proxy: FaultProxy,
    chunk: int = 8 << 20,
) -> subprocess.Popen[str]:
    args = {
        "root": root,
        "cache": str(folder),
        "shards": [s.__dict__ for s in shards],
        "name": name,
        "options": proxy_options(proxy),
        "go": str(folder) + ".go",
        "chunk": chunk,
    }
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(args)], stdout=subprocess.PIPE, text=True
    )


def test_two_processes_racing_for_one_shard_download_it_once(remote, proxy, tmp_path) -> None:
    root, shards, _ = remote(2, size=256 << 10)
    name, folder = shards[0].name, tmp_path / "cache"
    proxy.faults[_key(root, name)] = ["slow"]
    children = [_child(root, folder, shards, name, proxy) for _ in range(2)]
    Path(str(folder) + ".go").touch()
    results = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert {r["sha256"] for r in results} == {shards[0].sha256}
    assert sorted(r["downloads"] for r in results) == [0, 1]
    assert proxy.gets[_key(root, name)] == 1


def test_kill_9_during_a_download_leaves_no_half_shard(remote, proxy, tmp_path) -> None:
    root, shards, data = remote(2, size=256 << 10)
    name, folder = shards[0].name, tmp_path / "cache"
    proxy.faults[_key(root, name)] = ["ok", "ok", "hang"]  # 64 KiB reads: stops half-way
    child = _child(root, folder, shards, name, proxy, chunk=64 << 10)
    Path(str(folder) + ".go").touch()
    part = folder / (PART_PREFIX + name)
    _wait_for(lambda: part.exists() and part.stat().st_size >= 128 << 10, "a half download")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert not (folder / name).exists() and part.exists()
    with _cache(root, folder, 10**9, shards, proxy, prefetch=0) as cache:
        assert not part.exists()  # the dead process's temp file, removed at start
        assert _read(cache, name) == data[name]
