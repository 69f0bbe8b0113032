"""Datasets at an S3 URL read through the shard cache by `open_dataset`, `make_loader` and
``dlpipe train``: the same batches as from local disk, in every format, and the faults a user
meets as one named error (moto's S3 server on loopback, behind the fault proxy of
`s3_faults`, which counts each object's GETs)."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import s3_faults
import torch
from conftest import batch_list, one_error, write_dataset
from s3_faults import FaultProxy

import dlpipe
from dlpipe.cli import main
from dlpipe.shard_cache import ShardCacheLimitError, ShardFetchError
from dlpipe.shard_store import CacheSettingError, cache_folder, cache_limit_bytes
from dlpipe.synthetic import synthetic_samples

proxy = s3_faults.proxy  # the fixture (module-scoped)
TESTS = Path(__file__).resolve().parent
CONFIG = dlpipe.LoaderConfig(batch_size=8, image_size=16)
BUCKET = "remote-loading"


@pytest.fixture(scope="module")
def local_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One dataset per format: train 40 samples, val 8, 8 per shard."""
    root, samples = tmp_path_factory.mktemp("local"), list(synthetic_samples(48))
    splits = {"train": samples[:40], "val": samples[40:]}
    return {fmt: Path(write_dataset(root / fmt, fmt, splits)) for fmt in ("lmdb", "hdf5", "wds")}


@pytest.fixture
def s3(
    s3_env: dict[str, str], proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, request: Any
) -> Callable[[Path], str]:
    """s3(folder) -> the URL of a copy of `folder` on the S3 server; this process's S3
    clients reach the server through the proxy (its GET counts and faults cleared)."""
    import s3fs

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    upload = s3fs.S3FileSystem(skip_instance_cache=True)
    if not upload.exists(BUCKET):
        upload.mkdir(BUCKET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    proxy.gets.clear()
    proxy.faults.clear()

    def copy(folder: Path) -> str:
        prefix = f"{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}/{folder.name}"
        for path in folder.iterdir():
            if path.is_file() and not path.name.startswith("."):
                upload.put_file(str(path), f"{prefix}/{path.name}")
        return f"s3://{prefix}"

    yield copy
    s3fs.S3FileSystem.clear_instance_cache()


def _shard_gets(proxy: FaultProxy, url: str) -> dict[str, int]:
    prefix = url.removeprefix("s3://") + "/"
    return {k[len(prefix) :]: n for k, n in proxy.gets.items() if k.startswith(prefix)}


def _loader(path: str | Path, workers: int, cache: Path | None = None, **more: Any) -> Any:
    config = CONFIG.replace(cache_dir=str(cache) if cache else None, **more)
    settings = dlpipe.WorkerSettings(num_workers=workers)
    return dlpipe.make_loader(str(path), "train", config, workers=settings, profile=None)


def _epochs(loader: Any, count: int = 2) -> list[list[tuple[Any, Any]]]:
    try:
        return [batch_list(loader) for _ in range(count)]
    finally:
        loader.close()


def _equal(a: list[list[tuple[Any, Any]]], b: list[list[tuple[Any, Any]]]) -> bool:
    pairs = [(x, y) for ea, eb in zip(a, b, strict=True) for x, y in zip(ea, eb, strict=True)]
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in pairs)


# --- the same batches as local disk ----------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_a_url_gives_the_local_batches_exactly(
    local_sets, s3, proxy, tmp_path, fmt, workers
) -> None:
    url = s3(local_sets[fmt])
    remote = _epochs(_loader(url, workers, tmp_path / "cache"))
    local = _epochs(_loader(local_sets[fmt], workers))
    assert len(remote[0]) == 5 and _equal(remote, local)
    gets = _shard_gets(proxy, url)
    shards = [n for n in gets if n.startswith("train-")]
    assert len(shards) == 5 and all(gets[n] == 1 for n in shards), gets  # each downloaded once
    folder = Path(cache_folder(url, tmp_path / "cache"))
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("train-")) == sorted(shards)


def test_close_ends_the_shard_cache_threads_and_a_later_pass_reads_again(
    local_sets, s3, tmp_path
) -> None:
    """A 0-worker loader reads in this process: close() ends its cache's download threads
    (they would idle until the loader was collected), and the next pass opens it again."""

    def fetch_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("dlpipe-shard-fetch")]

    loader = _loader(s3(local_sets["hdf5"]), 0, tmp_path / "cache")
    first = batch_list(loader)
    assert fetch_threads()
    loader.close()
    assert not [t for t in fetch_threads() if t.is_alive() and (t.join(60) or t.is_alive())]
    again = batch_list(loader)  # the second epoch
    loader.close()
    assert _equal([first, again], _epochs(_loader(local_sets["hdf5"], 0)))


def test_open_dataset_reads_lmdb_from_a_url_at_random(local_sets, s3, tmp_path) -> None:
    url = s3(local_sets["lmdb"])
    local = dlpipe.open_dataset(local_sets["lmdb"], "val")
    with dlpipe.open_dataset(url, "val", cache_dir=tmp_path, cache_limit="10MB") as ds:
        assert len(ds) == 8
        assert [ds[i] for i in (7, 0, 3)] == [local[i] for i in (7, 0, 3)]
        assert list(ds) == list(local)
    local.close()


def test_a_restart_reads_warm_shards_and_downloads_nothing(local_sets, s3, proxy, tmp_path) -> None:
    url = s3(local_sets["wds"])
    first = _epochs(_loader(url, 0, tmp_path), 1)
    before = _shard_gets(proxy, url)
    again = _epochs(_loader(url, 0, tmp_path), 1)  # a new loader: a restarted run
    assert _equal(first, again)
    after = _shard_gets(proxy, url)
    assert after["dlpipe.json"] > before["dlpipe.json"]  # the new loader read the manifest
    assert {k: n for k, n in after.items() if k != "dlpipe.json"} == {
        k: n for k, n in before.items() if k != "dlpipe.json"
    }  # and no shard


def test_a_cache_smaller_than_the_dataset_still_gives_the_local_batches(
    local_sets, s3, tmp_path
) -> None:
    url = s3(local_sets["lmdb"])
    largest = max(p.stat().st_size for p in local_sets["lmdb"].glob("train-*"))
    remote = _epochs(_loader(url, 2, tmp_path, cache_limit=3 * largest))
    assert _equal(remote, _epochs(_loader(local_sets["lmdb"], 2)))


# --- the settings ------------------------------------------------------------------------------


def test_cache_settings_defaults_and_bad_values(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DLPIPE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = cache_folder("s3://b/data")
    assert folder.startswith(str(tmp_path / "xdg" / "dlpipe" / "shards"))
    assert cache_folder("s3://b/data/") == folder != cache_folder("s3://b/other")
    monkeypatch.setenv("DLPIPE_DATA_DIR", str(tmp_path / "data"))
    assert cache_folder("s3://b/data").startswith(str(tmp_path / "data" / "cache"))
    assert cache_limit_bytes("50GB", folder) == 50 * 10**9 == cache_limit_bytes(50 * 10**9, folder)
    assert 0 < cache_limit_bytes(None, str(tmp_path)) <= os.statvfs(tmp_path).f_bavail * 4096
    for bad in ("lots", 0, -5, True):
        with pytest.raises(CacheSettingError, match="cache_limit"):
            cache_limit_bytes(bad, folder)
    with pytest.raises(CacheSettingError, match="local disk"):
        cache_folder("s3://b/data", "s3://b/cache")


def test_cache_settings_change_no_profile_key() -> None:
    from dlpipe.loading.profile import loader_key

    plain, cached = CONFIG, CONFIG.replace(cache_dir="/x", cache_limit="5GB")
    assert loader_key("train", plain) == loader_key("train", cached)


# --- faults through the loader -----------------------------------------------------------------


def test_5xx_answers_are_retried_and_the_batches_are_right(local_sets, s3, proxy, tmp_path) -> None:
    url = s3(local_sets["hdf5"])
    prefix = url.removeprefix("s3://")
    for i in range(5):
        proxy.faults[f"{prefix}/train-{i:06d}.h5"] = ["500", "500"]
    remote = _epochs(_loader(url, 0, tmp_path), 1)
    assert _equal(remote, _epochs(_loader(local_sets["hdf5"], 0), 1))
    assert all(n >= 3 for k, n in _shard_gets(proxy, url).items() if k.startswith("train-"))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_corrupted_in_storage_is_one_named_error_never_a_batch(
    local_sets, s3, tmp_path, workers
) -> None:
    import s3fs

    url = s3(local_sets["lmdb"])
    name = "train-000002.lmdb"
    blob = bytearray((local_sets["lmdb"] / name).read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size, another sha256
    s3fs.S3FileSystem(skip_instance_cache=True).pipe_file(f"{url}/{name}", bytes(blob))
    loader = _loader(url, workers, tmp_path, shuffle=False)
    with pytest.raises(ShardFetchError) as caught:
        _epochs(loader, 1)
    message = str(caught.value)
    assert name in message and f"{url}/{name}" in message and "sha256" in message
    assert not (Path(cache_folder(url, tmp_path)) / name).exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256K", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_cache_disk_is_one_error_line_from_train(
    local_sets, s3, small_disk, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    url = s3(local_sets["lmdb"])
    (small_disk / "filler").write_bytes(b"\0" * (256 << 10))  # nothing left
    args = ["train", url, "--out", str(tmp_path / "run"), "--model", "trainer_models:tiny_cnn"]
    args += ["--image-size", "16", "--batch-size", "8", "--epochs", "1", "--num-workers", "0"]
    args += ["--cache-dir", str(small_disk), "--cache-limit", "1GB", "--tune", "off"]
    assert main(args) == 2
    line = one_error(capsys)
    assert str(small_disk) in line and "free space" in line, line


# --- a mixture of URL sources ------------------------------------------------------------------

MIX = {"weights": (0.6, 0.4)}


def _mix_epochs(paths: list[Any], workers: int, count: int = 2, **more: Any) -> list[list[Any]]:
    """`count` epochs of a two-source mixture's (images, labels, sources) batches."""
    config = CONFIG.replace(**MIX, **more)
    settings = dlpipe.WorkerSettings(num_workers=workers)
    loader = dlpipe.make_loader([str(p) for p in paths], "train", config, workers=settings)
    try:
        return [[tuple(t.clone() for t in batch) for batch in loader] for _ in range(count)]
    finally:
        loader.close()


def _same_batches(a: list[list[Any]], b: list[list[Any]]) -> bool:
    pairs = [(x, y) for ea, eb in zip(a, b, strict=True) for x, y in zip(ea, eb, strict=True)]
    return all(all(map(torch.equal, x, y)) for x, y in pairs)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("second", ["hdf5", "wds"])
def test_a_mixture_of_urls_gives_the_local_mixture_exactly(
    local_sets, s3, proxy, tmp_path, workers, second
) -> None:
    formats = ("lmdb", second)
    urls = [s3(local_sets[fmt]) for fmt in formats]
    remote = _mix_epochs(urls, workers, cache_dir=str(tmp_path))
    local = _mix_epochs([local_sets[fmt] for fmt in formats], workers)
    assert len(remote[0]) == 10 and _same_batches(remote, local)
    assert {int(s) for batch in remote[0] for s in batch[2]} == {0, 1}
    for url, fmt in zip(urls, formats, strict=True):  # the cache holds both: one download each
        gets = _shard_gets(proxy, url)
        assert sorted(n for n in gets if n.startswith("train-")) == sorted(
            p.name for p in local_sets[fmt].glob("train-*")
        )
        assert all(gets[n] == 1 for n in gets if n.startswith("train-")), gets


def test_a_mixture_shares_one_cache_limit_out_and_still_gives_the_local_batches(
    local_sets, s3, tmp_path
) -> None:
    urls = [s3(local_sets["lmdb"]), s3(local_sets["hdf5"])]
    largest = sum(max(p.stat().st_size for p in local_sets[f].glob("train-*")) for f in MIX_FMTS)
    limit = 3 * largest
    remote = _mix_epochs(urls, 2, cache_dir=str(tmp_path), cache_limit=limit)
    assert _same_batches(remote, _mix_epochs([local_sets[f] for f in MIX_FMTS], 2))
    held = sum(
        p.stat().st_size
        for url in urls
        for p in Path(cache_folder(url, tmp_path)).iterdir()
        if p.name.startswith(("train-", "val-"))
    )
    assert 0 < held <= limit


def test_a_mixture_cache_limit_too_small_for_a_sources_part_is_refused_naming_it(
    local_sets, s3, tmp_path
) -> None:
    urls = [s3(local_sets["lmdb"]), s3(local_sets["hdf5"])]
    largest = max(p.stat().st_size for p in local_sets["lmdb"].glob("train-*"))
    with pytest.raises(ShardCacheLimitError) as caught:
        _mix_epochs(urls, 0, cache_dir=str(tmp_path), cache_limit=largest)
    message = str(caught.value)
    assert "mixture's cache_limit" in message and "raise cache_limit" in message
    assert any(url in message for url in urls)


def test_a_mixtures_url_sources_each_plan_their_own_reads_in_order(
    local_sets, s3, tmp_path, monkeypatch
) -> None:
    """Each URL source's cache is told the shards it reads next, in the mixture's order:
    the codes drawn from it, mapped to its shards (8 samples each)."""
    from dlpipe.shard_cache import ShardCache

    plans: dict[str, list[list[str]]] = {}
    plan = ShardCache.plan

    def recorded(cache: ShardCache, order: Any, mine: Any = None) -> None:
        plans.setdefault(cache.url_root, []).append(list(order))
        plan(cache, order, mine)

    monkeypatch.setattr(ShardCache, "plan", recorded)
    urls = [s3(local_sets["lmdb"]), s3(local_sets["hdf5"])]
    config = CONFIG.replace(**MIX, cache_dir=str(tmp_path))
    loader = dlpipe.make_loader(urls, "train", config, workers=dlpipe.WorkerSettings(num_workers=0))
    next(iter(loader))
    codes = loader.order.indices(0)
    loader.close()
    for number, url in enumerate(urls):
        local = codes % 80 - 40 * number
        shards = (local[(local >= 0) & (local < 40)] // 8).tolist()
        names = [f"train-{s:06d}.{'lmdb' if number == 0 else 'h5'}" for s in shards]
        expected = [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]
        assert plans[url][0][: len(expected)] == expected


MIX_FMTS = ("lmdb", "hdf5")


# --- the workers of a rank share one plan ------------------------------------------------------


def test_two_workers_keep_shards_for_each_other_in_a_third_size_cache(s3, proxy, tmp_path) -> None:
    """A 2-worker wds loader, shuffled, its cache a third of the dataset: each worker's cache
    ranks eviction by both workers' next reads (not its own only, which evicted the other's
    shards as never needed again), so the shards kept at the end of the first epoch are read
    in the second instead of downloaded again. Of the reads the order makes, at least the
    shards that fit beside the held ones and the prefetch windows are not downloaded again."""
    from dlpipe.loading.remote import HELD_SHARE
    from dlpipe.loading.stream_order import StreamOrder

    shards, per_shard, batch = 48, 8, 8
    folder = tmp_path / "data"
    write_dataset(folder, "wds", {"train": list(synthetic_samples(shards * per_shard))})
    url = s3(folder)
    sizes = [p.stat().st_size for p in folder.glob("train-*")]
    limit = sum(sizes) // 3
    loader = _loader(url, 2, tmp_path / "cache", cache_limit=limit, shuffle=True)
    _epochs(loader)
    downloads = sum(n for k, n in _shard_gets(proxy, url).items() if k.startswith("train-"))
    order = StreamOrder([per_shard] * shards, batch_size=batch, seed=CONFIG.seed)
    half = (shards * per_shard // batch + 1) // 2 * batch  # worker 0's stretch: the larger
    stretches = [(0, half), (half, shards * per_shard)]
    reads = sum(len(order.segments(e, [run])) for e in (0, 1) for run in stretches)
    kept = int(limit * (1 - HELD_SHARE - 0.5)) // max(sizes)  # beside held shards and windows
    print(f"{shards} shards, {reads} reads in 2 epochs, {downloads} downloads, kept >= {kept}")
    assert downloads <= reads - kept


def test_each_map_style_worker_plans_both_workers_batches(local_sets, s3, tmp_path, monkeypatch):
    """Each worker of a 2-worker lmdb loader plans the rank's reads of this epoch and the
    next: its own batches (k % 2 == its id) at the positions it takes, the other worker's
    batches between them."""
    import json

    from dlpipe.loading.order import worker_part
    from dlpipe.shard_cache import ShardCache

    plan, record = ShardCache.plan, tmp_path / "plans.jsonl"

    def recorded(cache: ShardCache, order: Any, mine: Any = None) -> None:
        with record.open("a") as out:
            out.write(json.dumps([worker_part()[0], list(order), list(mine)]) + "\n")
        plan(cache, order, mine)

    monkeypatch.setattr(ShardCache, "plan", recorded)  # the workers fork after this
    loader = _loader(s3(local_sets["lmdb"]), 2, tmp_path / "cache", shuffle=True)
    _epochs(loader, 1)
    block = CONFIG.batch_size

    def reads(epoch: int, worker: int) -> list[str]:
        """A worker's shards of `epoch`, one per run of reads of a shard."""
        indices = loader.order.indices(epoch)
        names = [f"train-{i // 8:06d}.lmdb" for i in _worker_batches(indices, block, worker)]
        return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]

    plans = {w: (order, set(mine)) for w, order, mine in map(json.loads, record.open())}
    for worker, (order, mine) in plans.items():
        own = [n for p, n in enumerate(order) if p in mine]
        other = [n for p, n in enumerate(order) if p not in mine]
        assert own == reads(0, worker) + reads(1, worker)
        assert other == reads(0, 1 - worker) + reads(1, 1 - worker)
    assert sorted(plans) == [0, 1]


def _worker_batches(indices: Any, block: int, worker: int) -> list[int]:
    """The samples of batches ``worker``, ``worker + 2``, ... of `indices`."""
    batches = [indices[b : b + block] for b in range(0, len(indices), block)]
    return [int(i) for batch in batches[worker::2] for i in batch]


def test_the_rank_order_merges_the_workers_reads_by_time() -> None:
    """Each worker's runs of reads are one use each, at the count of samples it read before;
    the workers' uses interleave by that count (ties in worker order), pass after pass; a
    plan with a lag places the other workers' uses that much later; the limit cuts it."""
    import numpy as np

    from dlpipe.loading.read_plan import merged, runs_of

    first = runs_of(np.arange(4), np.asarray([1, 1, 2, 3]))  # uses at 0, 2, 3
    second = runs_of(np.arange(4), np.asarray([5, 6, 6, 7]))  # uses at 0, 1, 3
    passes = [[first, second], [second, first]]
    assert merged(passes, 0, 100) == ([1, 5, 6, 2, 3, 7, 5, 1, 6, 2, 7, 3], [0, 3, 4, 6, 8, 10])
    assert merged(passes, 1, 100)[1] == [1, 2, 5, 7, 9, 11]
    assert merged(passes[:1], 0, 100, lag=2) == ([1, 2, 5, 3, 6, 7], [0, 1, 3])
    assert merged(passes, 0, 4) == ([1, 5, 6, 2], [0, 3])
