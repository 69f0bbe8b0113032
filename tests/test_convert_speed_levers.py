"""The conversion's speed levers keep its guarantees: same bytes, same checks."""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import random
import string
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.formats import wds_writer


def _tarfile_header(name: str, size: int) -> bytes:
    """The header tarfile itself writes for dlpipe's members (mode 0444, owner 0:0, mtime 0)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o444
    info.uname = info.gname = ""
    kind = tarfile.USTAR_FORMAT if len(name) <= tarfile.LENGTH_NAME else tarfile.PAX_FORMAT
    return info.tobuf(kind, "utf-8", "strict")


def _member_names() -> list[str]:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "_-.%"
    names = ["a.jpg", "x" * 96 + ".jpg", "x" * 97 + ".cls", "é.jpg", "é" * 60 + ".jpg"]
    names += ["".join(rng.choices(alphabet, k=rng.randint(1, 130))) for _ in range(300)]
    return names


def _outcome(make_header: Callable[[str, int], bytes], name: str, size: int) -> bytes | str:
    try:
        return make_header(name, size)
    except ValueError as exc:  # e.g. a non-ASCII name of over 100 bytes in ustar
        return f"ValueError: {exc}"


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 98_765, 8**11 - 1])
def test_wds_member_headers_are_the_bytes_tarfile_writes(size) -> None:
    for name in _member_names():
        want = _outcome(_tarfile_header, name, size)
        assert _outcome(wds_writer._header, name, size) == want, (name, size)


def test_a_member_too_large_for_ustar_is_refused_as_tarfile_refuses_it() -> None:
    with pytest.raises(ValueError, match="overflow"):
        wds_writer._header("big.bin", 8**11)


def _jpeg(seed: int, *, progressive: bool = False) -> bytes:
    pixels = (np.random.default_rng(seed).random((240, 320, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90, progressive=progressive)
    return buffer.getvalue()


def _cut_in_last_scan(data: bytes) -> bytes:
    """`data` cut half-way through the entropy-coded data of its last scan."""
    sos = data.rfind(b"\xff\xda")
    start = sos + 2 + int.from_bytes(data[sos + 2 : sos + 4], "big")
    return data[: (start + len(data) - 2) // 2]


def _raw_folder(root: Path) -> dict[str, bytes]:
    """Two classes of noise JPEGs (~150 KB: several 1 MiB shards), two cut in their last scan."""
    files = {}
    for i in range(24):
        files[f"c{i % 2}/{i:02d}.jpg"] = _jpeg(i, progressive=i % 3 == 0)
    files["c0/00.jpg"] = _cut_in_last_scan(files["c0/00.jpg"])  # progressive: 10 scans
    files["c1/01.jpg"] = _cut_in_last_scan(files["c1/01.jpg"])  # baseline: one scan
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.mark.parametrize("fmt", sorted(dlpipe.FORMATS))
def test_shards_hashed_while_written_match_their_files_and_cut_jpegs_are_caught(
    tmp_path, capsys, fmt
) -> None:
    files = _raw_folder(tmp_path / "raw")
    out = tmp_path / "out"
    workers = "2" if fmt == "wds" else "1"  # the pool once; wds is the format that hashes itself
    argv = ["convert", str(tmp_path / "raw"), "--to", fmt, "--out", str(out), "--workers", workers]
    assert main(argv) == 0
    manifest = dlpipe.read_manifest(str(out))
    shards = manifest.splits["train"].shards
    assert len(shards) > 1
    for shard in shards:
        assert shard.sha256 == hashlib.sha256((out / shard.name).read_bytes()).hexdigest()
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    errors_keys = sorted(dlpipe.unescape_key(e["key"]) for e in errors)
    assert errors_keys == ["c0/00", "c1/01"]
    assert all("truncated" in e["error"] for e in errors)
    samples = dlpipe.open_dataset(str(out), "train")
    kept = {dlpipe.unescape_key(s["__key__"]): s["jpg"] for s in samples}
    assert kept == {rel[:-4]: data for rel, data in files.items() if rel[:-4] not in errors_keys}
    assert dlpipe.verify_dataset(str(out)).ok


def test_a_wds_shard_past_the_write_back_step_is_whole_and_hashed_right(tmp_path, monkeypatch):
    started: list[tuple[int, int]] = []
    real_start = wds_writer.start_writeback
    monkeypatch.setattr(
        wds_writer,
        "start_writeback",
        lambda fd, at, n: (started.append((at, n)), real_start(fd, at, n)),
    )
    payloads = [np.random.default_rng(i).bytes(3_000_001 + i) for i in range(4)]
    out = tmp_path / "out"
    limits = dlpipe.ShardLimits(max_shard_bytes=1 << 30)
    with dlpipe.DatasetWriter(out=str(out), format="wds", limits=limits) as writer:
        for i, data in enumerate(payloads):
            writer.write("train", {"__key__": f"s{i}", "bin": data})
    (shard,) = dlpipe.read_manifest(str(out)).splits["train"].shards
    assert [at for at, _ in started] == [0] and started[0][1] >= 8 << 20  # one 8 MiB step
    assert shard.sha256 == hashlib.sha256((out / shard.name).read_bytes()).hexdigest()
    with tarfile.open(out / shard.name) as tar:  # plain tar reads it, byte for byte
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    assert members == [(f"s{i}.bin", data) for i, data in enumerate(payloads)]


def _two_frame_headers(pixels: int) -> bytes:
    """A 16x16 JPEG with a second frame header of `pixels` x `pixels` before its scan: the
    header check reads the first (as libjpeg does), Pillow the last."""
    data = _small_jpeg()
    sof, sos = data.index(b"\xff\xc0"), data.index(b"\xff\xda")
    frame = bytearray(data[sof : sof + 2 + int.from_bytes(data[sof + 2 : sof + 4], "big")])
    frame[5:9] = pixels.to_bytes(2, "big") * 2
    return data[:sos] + bytes(frame) + data[sos:]


def _small_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 120, 30)).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_an_image_pillow_reads_as_over_the_pixel_limit_is_one_named_skip(tmp_path) -> None:
    """The size Pillow reads is held to dlpipe's limit (no warnings filter per image)."""
    raw = tmp_path / "raw"
    for name in ("a", "b"):
        (raw / name).mkdir(parents=True)
        (raw / name / "ok.jpg").write_bytes(_small_jpeg())
    (raw / "a" / "two-frames.jpg").write_bytes(_two_frame_headers(12_000))  # 1.6x the limit
    out = tmp_path / "out"
    assert main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]) == 0
    (error,) = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert error["key"] == "a%2Ftwo-frames"
    assert "12000x12000 = 144,000,000 pixels, over the pixel limit" in error["error"]
    assert sum(s.samples for s in dlpipe.read_manifest(str(out)).splits.values()) == 2


def test_a_raw_file_is_read_only_where_the_kernel_places_it_inside_the_folder(tmp_path) -> None:
    """The per-file open needs no real path, and still reads nothing outside RAW: a class
    folder swapped for a link out after the scan, a FIFO, a link within RAW (read)."""
    from dlpipe.converters.source import SampleError, raw_folder_of, read_file

    raw, outside = tmp_path / "raw", tmp_path / "outside"
    for folder in (raw / "c", outside / "c"):
        folder.mkdir(parents=True)
    (raw / "c" / "a.jpg").write_bytes(b"inside")
    (outside / "c" / "a.jpg").write_bytes(b"secret")
    (raw / "c" / "link.jpg").symlink_to(raw / "c" / "a.jpg")
    os.mkfifo(raw / "c" / "fifo.jpg")
    real = raw_folder_of(str(raw))
    assert read_file(str(raw / "c" / "a.jpg"), real) == b"inside"
    assert read_file(str(raw / "c" / "link.jpg"), real) == b"inside"
    with pytest.raises(SampleError, match="is a FIFO"):
        read_file(str(raw / "c" / "fifo.jpg"), real)
    (raw / "c").rename(tmp_path / "moved")
    (raw / "c").symlink_to(outside / "c", target_is_directory=True)
    with pytest.raises(SampleError, match="outside the raw folder"):
        read_file(str(raw / "c" / "a.jpg"), real)


def test_a_raw_file_handed_over_in_pieces_is_read_whole_and_size_limits_hold(
    tmp_path, monkeypatch
) -> None:
    """A read the kernel cuts short (a signal) still gives the whole file; a file over its
    kind's byte limit is refused before it is read."""
    from dlpipe.converters.source import SampleError, raw_folder_of, read_file

    raw = tmp_path / "raw"
    raw.mkdir()
    data = np.random.default_rng(0).bytes(250_001)
    (raw / "a.jpg").write_bytes(data)
    real_read = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: real_read(fd, min(n, 65_536), at))
    assert read_file(str(raw / "a.jpg"), raw_folder_of(str(raw))) == data
    with pytest.raises(SampleError, match="250001 bytes, over the 1000-byte limit"):
        read_file(str(raw / "a.jpg"), raw_folder_of(str(raw)), max_bytes=1000)


@pytest.mark.parametrize("sizes", [(0, 1, 511), (512, 513, 4096), (4097, 100_000, 3)])
def test_wds_samples_of_any_field_sizes_read_back_byte_for_byte(tmp_path, sizes) -> None:
    """Small fields are written joined to their headers, large ones alone: a plain tar
    reader gets every member back whole, and the shard's sha256 is its file's."""
    rng = np.random.default_rng(sum(sizes))
    samples = [
        {"__key__": f"s{i}", **{f"f{j}.bin": rng.bytes(sizes[(i + j) % 3]) for j in range(3)}}
        for i in range(3)
    ]
    out = tmp_path / "out"
    with dlpipe.DatasetWriter(out=str(out), format="wds") as writer:
        for sample in samples:
            writer.write("train", sample)
    (shard,) = dlpipe.read_manifest(str(out)).splits["train"].shards
    assert shard.sha256 == hashlib.sha256((out / shard.name).read_bytes()).hexdigest()
    with tarfile.open(out / shard.name) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    want = [(f"{s['__key__']}.{n}", v) for s in samples for n, v in s.items() if n != "__key__"]
    assert members == want


_FAULTS_AFTER_FREEING = """
import resource, sys
from dlpipe.converters.executors import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def shard():  # LMDB's pattern: a shard's pages, 100 KB each, freed together at commit
    pages = [bytearray(100_000) for _ in range(300)]
    del pages
shard()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    shard()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="glibc's mallopt only",
)
def test_a_converting_process_keeps_a_shards_freed_memory_for_the_next() -> None:
    def faults(mode: str) -> int:
        run = [sys.executable, "-c", _FAULTS_AFTER_FREEING, mode]
        return int(subprocess.run(run, capture_output=True, text=True, check=True).stdout)

    pages_per_shard = 300 * 100_000 // 4096
    assert faults("given back") > 4 * pages_per_shard  # each shard faulted in afresh
    assert faults("kept") < pages_per_shard  # the first shard's pages, used again


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_a_shard_written_at_its_close_goes_to_disk_while_it_is_hashed(
    tmp_path, monkeypatch, fmt
) -> None:
    from dlpipe.formats import base

    started: list[tuple[int, int]] = []
    real_start = base.start_writeback
    monkeypatch.setattr(
        base, "start_writeback", lambda fd, at, n: (started.append((at, n)), real_start(fd, at, n))
    )
    out = tmp_path / "out"
    with dlpipe.DatasetWriter(out=str(out), format=fmt) as writer:
        for i in range(3):
            writer.write("train", {"__key__": f"s{i}", "bin": np.random.default_rng(i).bytes(5000)})
    (shard,) = dlpipe.read_manifest(str(out)).splits["train"].shards
    assert started == [(0, 0)]  # the whole file, before it is read back
    assert shard.sha256 == hashlib.sha256((out / shard.name).read_bytes()).hexdigest()
    assert [s["bin"] for s in dlpipe.open_dataset(str(out), "train")] == [
        np.random.default_rng(i).bytes(5000) for i in range(3)
    ]
