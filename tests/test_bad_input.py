"""Bad shards and bad manifests get named errors; nothing unsafe is executed or extracted."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import struct
import tarfile
from pathlib import Path

import lmdb
import pytest
from conftest import FORMAT_NAMES, write_dataset

import dlpipe
from dlpipe.cli import main


def resync_manifest(path: str) -> None:
    """Make the manifest agree with the shards on disk (as a buggy or hostile writer would)."""
    manifest_path = Path(path, "dlpipe.json")
    data = json.loads(manifest_path.read_text())
    for split in data["splits"].values():
        for shard in split["shards"]:
            body = Path(path, shard["name"]).read_bytes()
            shard["bytes"], shard["sha256"] = len(body), hashlib.sha256(body).hexdigest()
        split["bytes"] = sum(s["bytes"] for s in split["shards"])
    manifest_path.write_text(json.dumps(data))


def first_shard(path: str) -> Path:
    return Path(path, dlpipe.read_manifest(path).splits["train"].shards[0].name)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_verify_names_a_bit_flipped_shard(fmt, make_dataset, capsys) -> None:
    path = make_dataset(fmt)
    shard = first_shard(path)
    body = bytearray(shard.read_bytes())
    body[len(body) // 2] ^= 0x01
    shard.write_bytes(bytes(body))
    report = dlpipe.verify_dataset(path)
    assert [p.shard for p in report.problems] == [shard.name]
    assert "sha256" in report.problems[0].message
    assert main(["verify", path]) == 1
    assert shard.name in capsys.readouterr().out


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_truncated_shard_is_named_when_read(fmt, make_dataset) -> None:
    path = make_dataset(fmt)
    shard = first_shard(path)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    ds = dlpipe.open_dataset(path)
    with pytest.raises(dlpipe.ShardCorruptError, match=f"{shard.name}.*truncated"):
        list(ds)
    report = dlpipe.verify_dataset(path)
    assert not report.ok and report.problems[0].shard == shard.name


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_structurally_broken_shard_names_path_and_sample(fmt, make_dataset) -> None:
    """The manifest agrees with the broken file, so only the format's own checks can catch it."""
    path = make_dataset(fmt)
    shard = first_shard(path)
    body = shard.read_bytes()
    shard.write_bytes(body[: int(len(body) * 0.6)])
    resync_manifest(path)
    with pytest.raises(dlpipe.ShardCorruptError, match=rf"{shard.name}, sample \d+"):
        list(dlpipe.open_dataset(path))
    report = dlpipe.verify_dataset(path, decode=True)
    assert [p.shard for p in report.problems] == [shard.name]


def test_decode_problem_names_shard_sample_and_field(tmp_path, samples) -> None:
    broken = dict(samples[3], jpg=b"\xff\xd8 not a jpeg")
    path = write_dataset(tmp_path / "d", "hdf5", {"train": [*samples[:3], broken, *samples[4:8]]})
    assert dlpipe.verify_dataset(path).ok  # checksums match what was written
    report = dlpipe.verify_dataset(path, decode=True)
    (problem,) = report.problems
    assert (problem.shard, problem.sample) == ("train-000000.h5", 3)
    assert "'jpg'" in problem.message and broken["__key__"] in problem.message
    assert main(["verify", path, "--decode"]) == 1


def _tar_shard(path: str, members: list[tarfile.TarInfo], data: bytes = b"1") -> None:
    """Replace the first wds shard with a tar holding `members`."""
    shard = first_shard(path)
    with tarfile.open(shard, "w") as tar:
        for member in members:
            if member.isreg():
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
            else:
                tar.addfile(member)
    resync_manifest(path)


def _member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    "member",
    [
        _member("../evil.cls"),
        _member("/etc/evil.cls"),
        _member("sub/dir.cls"),
        _member("a.cls", tarfile.SYMTYPE, "/etc/passwd"),
        _member("a.cls", tarfile.LNKTYPE, "b"),
        _member("a", tarfile.DIRTYPE),
        _member("a.cls", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "absolute", "subdir", "symlink", "hardlink", "dir", "device"],
)
def test_unsafe_tar_members_are_refused(member, tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]})
    _tar_shard(path, [member])
    with pytest.raises(dlpipe.UnsafeMemberError, match="refuse|path in it"):
        list(dlpipe.open_dataset(path))
    assert not (tmp_path / "evil.cls").exists()


class _Exploit:
    marker = ""

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_in_lmdb_is_refused_not_executed(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples[:8]})
    marker = tmp_path / "pwned"
    _Exploit.marker = str(marker)
    payload = pickle.dumps({"__key__": "a", "jpg": _Exploit()})
    shard = first_shard(path)
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", 2), payload)
    env.close()
    resync_manifest(path)
    ds = dlpipe.open_dataset(path)
    assert ds[1] == samples[1]
    with pytest.raises(dlpipe.ShardCorruptError, match="sample 2: value is not a MessagePack"):
        ds[2]
    with pytest.raises(dlpipe.ShardCorruptError, match="sample 2"):
        list(ds)
    assert not marker.exists()


def test_missing_manifest_names_the_resume_command(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]})
    os.remove(os.path.join(path, "dlpipe.json"))
    with pytest.raises(dlpipe.ManifestNotFoundError, match="unfinished.*--resume"):
        dlpipe.open_dataset(path)
    with pytest.raises(dlpipe.ManifestNotFoundError, match="not a dlpipe dataset"):
        dlpipe.open_dataset(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: {**d, "schema_version": 99}, "schema_version 99"),
        (lambda d: {k: v for k, v in d.items() if k != "splits"}, "missing key 'splits'"),
        (lambda d: {**d, "format": "zip"}, "format 'zip' is unknown"),
        (lambda d: {**d, "format_version": 7}, "version 7"),
        (lambda d: [1, 2], "not a JSON object"),
        (lambda d: _edit_shard(d, name="../../etc/passwd"), "not a plain file name"),
        (lambda d: _edit_shard(d, sha256="abc"), "64 hex"),
        (lambda d: _edit_shard(d, samples=-1), "non-negative"),
    ],
)
def test_malformed_manifest_is_a_named_error(edit, message, make_dataset) -> None:
    path = make_dataset("hdf5")
    manifest = Path(path, "dlpipe.json")
    edited = edit(json.loads(manifest.read_text()))
    manifest.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(dlpipe.ManifestError, match=message):
        dlpipe.open_dataset(path)
    assert main(["inspect", path]) == 2


def _edit_shard(data: dict, **changes: object) -> dict:
    data["splits"]["train"]["shards"][0].update(changes)
    return data
