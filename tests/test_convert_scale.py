"""Beyond one machine: shards on a real S3 API (moto's server on loopback) and the Ray engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dlpipe
from dlpipe.synthetic import split_samples, write_imagefolder

BIN = Path(sys.executable).parent


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    write_imagefolder(str(tmp_path / "raw"), split_samples(6, seed=2, val_fraction=0.25))
    return tmp_path / "raw"


def _convert(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "dlpipe"), "convert", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["wds", "hdf5"])
def test_convert_to_s3_and_read_back(fmt, raw, tmp_path, s3_env, monkeypatch) -> None:
    import s3fs

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    if not s3fs.S3FileSystem().exists("dlpipe-test"):
        s3fs.S3FileSystem().mkdir("dlpipe-test")
    url = f"s3://dlpipe-test/shapes-{fmt}"
    done = _convert([str(raw), "--to", fmt, "--out", url, "--shard-size", "30KB"], s3_env)
    assert done.returncode == 0, done.stderr
    local = tmp_path / "local"
    assert (
        _convert([str(raw), "--to", fmt, "--out", str(local), "--shard-size", "30KB"]).returncode
        == 0
    )
    s3fs.S3FileSystem.clear_instance_cache()
    remote = dlpipe.read_manifest(url)
    assert remote.splits == dlpipe.read_manifest(str(local)).splits  # same shards, same sha256
    assert list(dlpipe.open_dataset(url, "val")) == list(dlpipe.open_dataset(str(local), "val"))
    assert dlpipe.verify_dataset(url, decode=True).ok
    listing = s3fs.S3FileSystem().ls(f"dlpipe-test/shapes-{fmt}")
    assert not any(".dlpipe-journal" in p or ".tmp" in p for p in listing)


def test_lmdb_to_s3_is_refused_up_front(raw) -> None:
    done = _convert([str(raw), "--to", "lmdb", "--out", "s3://bucket/x"])
    assert done.returncode == 2 and "local filesystem" in done.stderr


@pytest.mark.slow
def test_ray_engine_writes_what_the_local_engine_writes(raw, tmp_path) -> None:
    args = [str(raw), "--to", "wds", "--shard-size", "20KB"]
    local, ray_out = tmp_path / "local", tmp_path / "ray"
    assert _convert([*args, "--out", str(local)]).returncode == 0
    done = _convert(
        [*args, "--out", str(ray_out), "--engine", "ray"],
        {"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(os.listdir(local))
    assert names == sorted(os.listdir(ray_out)) and len(names) > 3
    for name in names:
        assert (local / name).read_bytes() == (ray_out / name).read_bytes(), name
