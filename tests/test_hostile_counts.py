"""A manifest that miscounts a shard's samples (one fewer or one more than it holds) is named by
every reader, not read short: lmdb and hdf5 at open, wds at the shard's end, with the shard, both
counts and the fix. Verify still lists the shard."""

from __future__ import annotations

import json
from pathlib import Path

import lmdb
import pytest
from conftest import FORMAT_NAMES, write_dataset
from test_bad_input import resync_manifest as _resync

import dlpipe
from dlpipe.formats.lmdb import index_key

SHARD_SAMPLES = 8


def _miscount(path: str, delta: int) -> str:
    """Change the first train shard's count in the manifest by `delta` (the split's total and
    a class count with it, so the manifest itself stays consistent); its name."""
    manifest = Path(path) / "dlpipe.json"
    data = json.loads(manifest.read_text())
    split = data["splits"]["train"]
    shard = split["shards"][0]
    shard["samples"] += delta
    split["samples"] += delta
    counts = split.get("class_counts")
    for _ in range(abs(delta) if counts else 0):
        counts[max(range(len(counts)), key=counts.__getitem__)] += 1 if delta > 0 else -1
    manifest.write_text(json.dumps(data))
    return str(shard["name"])


@pytest.fixture
def dataset(tmp_path, samples):
    def make(fmt: str) -> str:
        return write_dataset(tmp_path / fmt, fmt, {"train": samples[:16]})

    return make


def _assert_named(error: dlpipe.SampleCountError, shard: str, delta: int) -> None:
    text = str(error)
    said = SHARD_SAMPLES + delta
    assert shard in text and "dlpipe verify" in text, text
    assert f"holds {SHARD_SAMPLES} samples but the manifest says {said}" in text, text
    assert (error.found, error.expected) == (SHARD_SAMPLES, said)
    assert isinstance(error, dlpipe.ShardCorruptError)


@pytest.mark.parametrize("delta", [-1, +1, -SHARD_SAMPLES + 1, +5])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_miscounted_shard_is_named_by_the_loader(fmt, delta, dataset) -> None:
    path = dataset(fmt)
    shard = _miscount(path, delta)
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, transform=None, shuffle=False),
        workers=0,
        profile=None,
    )
    with pytest.raises(dlpipe.SampleCountError) as caught:
        for _ in loader:
            pass
    _assert_named(caught.value, shard, delta)


@pytest.mark.parametrize("delta", [-1, +1])
@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_random_access_formats_know_their_count_at_open(fmt, delta, dataset) -> None:
    """The first sample of the shard already fails: nothing is read short."""
    path = dataset(fmt)
    shard = _miscount(path, delta)
    with dlpipe.open_dataset(path) as ds:
        with pytest.raises(dlpipe.SampleCountError) as caught:
            ds[0]
        _assert_named(caught.value, shard, delta)
        assert ds[SHARD_SAMPLES + delta]["__key__"]  # the next shard is fine


@pytest.mark.parametrize("delta", [-1, +1])
def test_wds_names_it_where_a_shuffled_stream_stops_at_the_manifest_count(delta, dataset) -> None:
    """The stream order reads each block with islice and closes the shard: the count is
    checked before the manifest's last sample is handed over, not after (every sample is
    read: with drop_last a shard's last sample may be cut from the pass, and its end never
    reached)."""
    path = dataset("wds")
    shard = _miscount(path, delta)
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=2, transform=None, seed=3, drop_last=False),
        workers=0,
    )
    with pytest.raises(dlpipe.SampleCountError) as caught:
        list(loader)
    _assert_named(caught.value, shard, delta)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_verify_still_lists_the_miscounted_shard(fmt, dataset) -> None:
    path = dataset(fmt)
    shard = _miscount(path, -1)
    report = dlpipe.verify_dataset(path)
    problems = [p for p in report.problems if p.shard == shard]
    assert problems and "holds 8 samples but the manifest says 7" in problems[0].message


def test_an_lmdb_shard_missing_a_sample_is_a_count_error_and_a_hole_is_named(
    tmp_path, samples
) -> None:
    """A deleted sample changes the count (named at open); a hole with the right count (one
    key moved past the end) is named at the sample."""
    path = write_dataset(tmp_path / "lmdb", "lmdb", {"train": samples[:8]}, max_shard_samples=None)
    shard = Path(path) / "train-000000.lmdb"
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        value = txn.get(index_key(1))
        txn.delete(index_key(1))
    env.close()
    _resync(path)
    with dlpipe.open_dataset(path) as ds, pytest.raises(dlpipe.SampleCountError, match="holds 7"):
        ds[0]
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(index_key(8), value)
    env.close()
    _resync(path)
    with dlpipe.open_dataset(path) as ds:
        assert ds[0]["__key__"]
        with pytest.raises(dlpipe.ShardCorruptError, match="sample 1: has no such sample"):
            ds[1]
