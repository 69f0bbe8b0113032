"""Shards someone else made are untrusted: crafted wds/hdf5/lmdb files get named errors.

Each case builds the hostile bytes by hand (or edits a real dlpipe shard) and then writes a
manifest that agrees with them (right sha256 and byte count), so only the formats' own checks
stand between the file and the reader. Risky reads run in a forked child under an address-space
limit and a timeout, so an unbounded read or a hang fails the test instead of the machine.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import select
import signal
import struct
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path

import h5py
import lmdb
import msgpack
import numpy as np
import pytest
import torch.utils.data  # noqa: F401 (loaded before a child's address space is limited)
from conftest import write_dataset
from test_bad_input import first_shard, resync_manifest

import dlpipe
import dlpipe.formats.lmdb
from dlpipe.cli import main
from dlpipe.formats.base import UnsafeShardError

TINY = [{"__key__": f"s{i}", "cls": str(i % 3).encode(), "txt": b"hello"} for i in range(4)]
ADDRESS_SPACE_HEADROOM = 512 << 20


def tiny_dataset(tmp_path: Path, fmt: str, samples: list[dict] = TINY) -> str:
    return write_dataset(tmp_path / fmt, fmt, {"train": samples}, max_shard_samples=None)


def read_all(path: str) -> list[dict]:
    with dlpipe.open_dataset(path) as ds:
        return list(ds)


def in_bounded_child(
    fn: Callable[[], object], *, headroom: int = ADDRESS_SPACE_HEADROOM, timeout_s: float = 20
) -> str:
    """Run `fn` in a forked child whose address space may grow by `headroom` bytes at most.

    Returns ``"ok"`` or ``"<ExceptionType>: <message>"``; a hang past `timeout_s` or a death by
    signal fails the test.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            os.close(read_end)
            vm_kib = next(
                int(line.split()[1])
                for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:")
            )
            limit = vm_kib * 1024 + headroom
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            try:
                fn()
                outcome = "ok"
            except BaseException as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            os.write(write_end, outcome.encode("utf-8", "replace")[:60000])
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the read hung for over {timeout_s} s")
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"the reader died of signal {os.WTERMSIG(status)}"
    return b"".join(chunks).decode()


# ---------------------------------------------------------------- a shard that is not a file


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
@pytest.mark.parametrize("kind", ["symlink-out", "symlink-dev-zero", "fifo", "folder"])
def test_a_shard_that_is_not_a_regular_file_is_refused(fmt, kind, tmp_path) -> None:
    path = tiny_dataset(tmp_path, fmt)
    shard = first_shard(path)
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(shard.read_bytes())  # a valid shard, outside the dataset folder
    shard.unlink()
    if kind == "symlink-out":
        shard.symlink_to(elsewhere)
    elif kind == "symlink-dev-zero":
        shard.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(shard)
    else:
        shard.mkdir()
    outcome = in_bounded_child(lambda: read_all(path), timeout_s=10)
    assert outcome.startswith("UnsafeShardError: ")
    assert f"shard {shard} is a" in outcome and "not a regular file" in outcome
    assert elsewhere.read_bytes()  # untouched


def test_open_regular_file_refuses_a_link_swapped_in_after_the_check(tmp_path) -> None:
    from dlpipe.formats.base import open_regular_file

    target = tmp_path / "real.tar"
    target.write_bytes(b"x")
    link = tmp_path / "link.tar"
    link.symlink_to(target)
    with pytest.raises(UnsafeShardError, match="symbolic link"):
        open_regular_file(str(link))
    with open_regular_file(str(target)) as f:
        assert f.read() == b"x"


# ---------------------------------------------------------------- wds: crafted tar bytes


def _checksum(header: bytearray) -> bytes:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def tar_member(name: str, data: bytes, *, pax: dict[str, str] | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o444
    if pax:
        info.pax_headers = pax
    header = info.tobuf(tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT, "utf-8", "strict")
    return header + data + b"\0" * (-len(data) % 512)


def tar_end() -> bytes:
    return b"\0" * 10240


def good_members(start: int = 0) -> bytes:
    return b"".join(
        tar_member(f"{s['__key__']}.cls", s["cls"]) + tar_member(f"{s['__key__']}.txt", s["txt"])
        for s in TINY[start:]
    )


def gnu_sparse_member(name: str, stored: bytes, claimed_bytes: int) -> bytes:
    """A GNU 'S' member: `stored` on disk, expanding to `claimed_bytes` of holes on read."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "strict"))
    header[156:157] = tarfile.GNUTYPE_SPARSE
    header[386:398] = b"%011o\0" % 0  # one data extent at offset 0 ...
    header[398:410] = b"%011o\0" % len(stored)  # ... of the stored bytes
    header[483:495] = b"%011o\0" % claimed_bytes  # the real size the holes expand to
    return _checksum(header) + stored + b"\0" * (-len(stored) % 512)


def extended_header(size: int, kind: bytes = tarfile.XHDTYPE) -> bytes:
    """A pax 'x' (or global 'g') header whose size field claims `size` bytes of records."""
    info = tarfile.TarInfo("PaxHeader")
    info.type, info.size = kind, size
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def size_past_the_end() -> bytes:
    """Good members, the last one's size field raised to 1 GiB (checksum fixed)."""
    body = bytearray(good_members())
    last = len(body) - 1024  # the header of s3.txt
    header = bytearray(body[last : last + 512])
    header[124:136] = b"%011o\0" % (1 << 30)
    body[last : last + 512] = _checksum(header)
    return bytes(body) + tar_end()


SPARSE_CLAIM = 3 << 30  # 3 GiB of holes from a ~10 KB file

WDS_HOSTILE = {
    "gnu-sparse": (
        good_members(1) + gnu_sparse_member("s0.cls", b"0", SPARSE_CLAIM) + tar_end(),
        "UnsafeMemberError",
        "GNU sparse member",
    ),
    "pax-sparse-1.0": (
        tar_member(
            "s0.cls",
            b"1\n0\n1\n".ljust(512, b"\0") + b"0",
            pax={
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": "s0.cls",
                "GNU.sparse.realsize": str(SPARSE_CLAIM),
            },
        )
        + tar_end(),
        "UnsafeMemberError",
        "sparse file",
    ),
    "pax-sparse-0.1": (
        tar_member(
            "s0.cls",
            b"0",
            pax={"GNU.sparse.map": "0,1", "GNU.sparse.size": str(SPARSE_CLAIM)},
        )
        + tar_end(),
        "UnsafeMemberError",
        "sparse file",
    ),
    "pax-header-claims-1-GiB": (
        extended_header(1 << 30) + good_members() + tar_end(),
        "UnsafeMemberError",
        "claims 1073741824 bytes",
    ),
    "chained-pax-headers": (
        b"".join(tar_member("x.cls", b"", pax={"comment": "a"})[:1024] for _ in range(1200))
        + good_members()
        + tar_end(),
        "UnsafeMemberError",
        "follows another one",
    ),
    "pax-global-header": (
        extended_header(0, tarfile.XGLTYPE) + good_members() + tar_end(),
        "UnsafeMemberError",
        "pax global header",
    ),
    "member-size-past-the-end": (
        size_past_the_end(),
        "ShardCorruptError",
        "past the end of the",
    ),
    "duplicate-member": (
        tar_member("s0.cls", b"0") + tar_member("s0.cls", b"0") + good_members(1) + tar_end(),
        "ShardCorruptError",
        "appears twice",
    ),
    "truncated-in-data": (good_members()[:-300], "ShardCorruptError", "not a readable tar"),
    "truncated-in-header": (good_members()[:-700], "ShardCorruptError", "expected ['cls', 'txt']"),
    "not-a-tar": (b"\x7fELF" + b"\1" * 3000, "ShardCorruptError", "not a readable tar"),
}


@pytest.mark.parametrize("case", sorted(WDS_HOSTILE))
def test_crafted_tar_is_refused_with_bounded_memory(case, tmp_path) -> None:
    body, error, message = WDS_HOSTILE[case]
    path = tiny_dataset(tmp_path, "wds")
    shard = first_shard(path)
    shard.write_bytes(body)
    resync_manifest(path)
    assert len(body) < 2 << 20
    outcome = in_bounded_child(lambda: read_all(path))
    assert outcome.startswith(f"{error}: shard {shard}"), outcome
    assert message in outcome
    assert "Traceback" not in outcome


def test_a_crafted_tar_through_the_cli_is_one_error_line(tmp_path, capsys) -> None:
    path = tiny_dataset(tmp_path, "wds")
    first_shard(path).write_bytes(WDS_HOSTILE["gnu-sparse"][0])
    resync_manifest(path)
    assert main(["verify", path, "--decode"]) == 1
    captured = capsys.readouterr()
    assert "sparse" in captured.out + captured.err
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("case", sorted(WDS_HOSTILE))
def test_verify_without_decode_names_every_crafted_tar(case, tmp_path) -> None:
    """The count check of plain verify reads the headers through the same strict parser."""
    path = tiny_dataset(tmp_path, "wds")
    first_shard(path).write_bytes(WDS_HOSTILE[case][0])
    resync_manifest(path)
    report = dlpipe.verify_dataset(path, isolate=False)
    assert not report.ok
    assert all("crashed" not in str(p) for p in report.problems)
    assert any(first_shard(path).name in str(p) for p in report.problems)


# ---------------------------------------------------------------- hdf5: crafted files

SECRET = b"SECRET-BYTES-FROM-OUTSIDE-THE-DATASET"
CLAIM = 3 << 30  # 3 GiB claimed by a file of a few KB


def craft_h5(shard: Path, name: str, make: Callable[[h5py.File, str, np.ndarray], None]) -> None:
    """Rewrite a real dlpipe HDF5 shard with dataset `name` made by `make(file, name, data)`."""
    with h5py.File(shard, "r") as f:
        arrays = {n: f[n][:] for n in f}
        attrs = dict(f.attrs)
    shard.unlink()
    with h5py.File(shard, "w") as f:
        f.attrs.update(attrs)
        for n, data in arrays.items():
            if n == name:
                make(f, n, data)
            else:
                f.create_dataset(n, data=data)


def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    with h5py.File(tmp_path / "secret.h5", "w") as f:
        f.create_dataset("data", data=np.frombuffer(SECRET, np.uint8))
    return tmp_path


def _claim_offsets(f: h5py.File, n: str, data: np.ndarray) -> None:
    f.create_dataset(n, data=np.linspace(0, CLAIM, len(data)).astype(np.uint64))


HDF5_HOSTILE: dict[str, tuple[str, Callable[..., None], str, str]] = {
    # case: (dataset, make(f, name, data, outside), error, message)
    "external-link": (
        "txt",
        lambda f, n, d, out: f.__setitem__(n, h5py.ExternalLink(str(out / "secret.h5"), "data")),
        "UnsafeShardError",
        "holds ExternalLink 'txt'",
    ),
    "soft-link": (
        "txt",
        lambda f, n, d, out: f.__setitem__(n, h5py.SoftLink("/__key__")),
        "UnsafeShardError",
        "holds SoftLink 'txt'",
    ),
    "external-raw-storage": (
        "txt",
        lambda f, n, d, out: f.create_dataset(
            n, shape=(len(d),), dtype=np.uint8, external=[(str(out / "secret.bin"), 0, len(d))]
        ),
        "UnsafeShardError",
        "data in external files",
    ),
    "virtual-dataset": (
        "txt",
        lambda f, n, d, out: f.create_virtual_dataset(n, _vds(out, len(d))),
        "UnsafeShardError",
        "virtual (VDS) layout",
    ),
    "compressed-chunks": (
        "txt",
        lambda f, n, d, out: f.create_dataset(n, data=d, chunks=(4,), compression="gzip"),
        "UnsafeShardError",
        "chunked layout",
    ),
    "unallocated-chunks-claiming-GBs": (
        "txt",
        lambda f, n, d, out: f.create_dataset(n, shape=(CLAIM,), dtype=np.uint8, chunks=(1 << 20,)),
        "UnsafeShardError",
        "chunked layout",
    ),
    "compact": (
        "txt",
        lambda f, n, d, out: f.create_dataset(
            n, data=d, dcpl=_compact_plist(), shape=d.shape, dtype=d.dtype
        ),
        "UnsafeShardError",
        "compact layout",
    ),
    "unallocated-contiguous-claiming-GBs": (
        "txt",
        lambda f, n, d, out: f.create_dataset(n, shape=(CLAIM,), dtype=np.uint8),
        "ShardCorruptError",
        "claims 3221225472 bytes but 0 are stored",
    ),
    "offsets-claiming-GBs": (
        "txt.offsets",
        lambda f, n, d, out: _claim_offsets(f, n, d),
        "ShardCorruptError",
        "offsets of 'txt' do not run from 0",
    ),
    "offsets-decreasing": (
        "txt.offsets",
        lambda f, n, d, out: f.create_dataset(n, data=d[[0, 3, 1, 2, 4]]),
        "ShardCorruptError",
        "offsets of 'txt' do not run from 0",
    ),
    "offsets-wrapping-negative": (
        "txt.offsets",
        lambda f, n, d, out: f.create_dataset(n, data=np.array([0, 1 << 63, 5, 15, 20], "u8")),
        "ShardCorruptError",
        "offsets of 'txt' do not run from 0",
    ),
    "float-labels": (
        "cls",
        lambda f, n, d, out: f.create_dataset(n, data=d.astype(np.float64) + 0.5),
        "ShardCorruptError",
        "dataset 'cls' is (4,) f8; expected (4,) i8",
    ),
    "string-labels": (
        "cls",
        lambda f, n, d, out: f.create_dataset(n, data=np.array([b"0", b"1", b"2", b"0"])),
        "ShardCorruptError",
        "dataset 'cls' is (4,) S1",
    ),
    "two-dimensional-blob": (
        "txt",
        lambda f, n, d, out: f.create_dataset(n, data=np.stack([d, d])),
        "ShardCorruptError",
        "dataset 'txt' is (2, 20) u1",
    ),
    "group-instead-of-dataset": (
        "txt",
        lambda f, n, d, out: f.create_group(n),
        "ShardCorruptError",
        "'txt' is a Group, not a dataset",
    ),
    "missing-dataset": (
        "txt",
        lambda f, n, d, out: None,
        "ShardCorruptError",
        "holds datasets ['__key__', '__key__.offsets', 'cls', 'txt.offsets']",
    ),
    "extra-dataset": (
        "txt",
        lambda f, n, d, out: [f.create_dataset(n, data=d), f.create_dataset("evil", data=d)],
        "ShardCorruptError",
        "holds datasets ['__key__', '__key__.offsets', 'cls', 'evil', 'txt', 'txt.offsets']",
    ),
    "key-with-a-path": (
        "__key__",
        lambda f, n, d, out: f.create_dataset(n, data=np.frombuffer(b"..s1s2s3", np.uint8)),
        "ShardCorruptError",
        "sample 0: sample key '..' is not allowed",
    ),
}

HDF5_PER_SAMPLE = {"key-with-a-path"}  # found when the sample is read, not at open


def _vds(out: Path, length: int) -> h5py.VirtualLayout:
    layout = h5py.VirtualLayout(shape=(length,), dtype=np.uint8)
    layout[:] = h5py.VirtualSource(str(out / "secret.h5"), "data", shape=(len(SECRET),))[:length]
    return layout


def _compact_plist() -> h5py.h5p.PropDCID:
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_layout(h5py.h5d.COMPACT)
    return plist


@pytest.mark.parametrize("case", sorted(HDF5_HOSTILE))
def test_crafted_hdf5_is_refused_before_any_read(case, tmp_path) -> None:
    name, make, error, message = HDF5_HOSTILE[case]
    out = _outside(tmp_path)
    path = tiny_dataset(tmp_path, "hdf5")
    shard = first_shard(path)
    craft_h5(shard, name, lambda f, n, d: make(f, n, d, out))
    resync_manifest(path)
    assert shard.stat().st_size < 64 << 10

    def read() -> None:
        samples = read_all(path)
        assert not any(SECRET[:10] in s.get("txt", b"") for s in samples), "read outside"

    outcome = in_bounded_child(read)
    assert outcome.startswith(f"{error}: shard {shard}"), outcome
    assert message in outcome
    if case in HDF5_PER_SAMPLE:
        return
    with pytest.raises(dlpipe.ShardCorruptError, match=re.escape(message)):  # at open
        dlpipe.formats.FORMATS["hdf5"].reader(
            str(shard), dlpipe.read_manifest(path).splits["train"].shards[0], ["cls", "txt"]
        ).check()


def test_plain_dlpipe_hdf5_shards_pass_the_checks(tmp_path) -> None:
    path = tiny_dataset(tmp_path, "hdf5", [*TINY, {"__key__": "e", "cls": b"1", "txt": b""}])
    assert [s["txt"] for s in read_all(path)] == [b"hello"] * 4 + [b""]


# ---------------------------------------------------------------- lmdb: crafted meta pages


def _newer_meta(body: bytes) -> int:
    """The byte offset of the meta page LMDB would use (the one with the larger txnid)."""
    txn0, txn1 = (struct.unpack_from("=Q", body, page * 4096 + 144)[0] for page in (0, 1))
    return 4096 if txn1 > txn0 else 0


def _patch(fmt: str, value: int, *, meta: str = "newer") -> Callable[[bytes], bytes]:
    def patch(body: bytes) -> bytes:
        out = bytearray(body)
        base = _newer_meta(body) if meta == "newer" else 4096 - _newer_meta(body)
        offset, fmt_ = {
            "pgno": (0, "=Q"),
            "flags": (10, "=H"),
            "magic": (16, "=I"),
            "version": (20, "=I"),
            "psize": (40, "=I"),
            "main-depth": (94, "=H"),
            "main-root": (128, "=Q"),
            "last-page": (136, "=Q"),
            "txnid": (144, "=Q"),
        }[fmt]
        struct.pack_into(fmt_, out, base + offset, value)
        return bytes(out)

    return patch


LMDB_META_HOSTILE = {
    "magic": (_patch("magic", 0xDEADBEEF), "magic 0xdeadbeef"),
    "version": (_patch("version", 999), "version 999"),
    "page-size-odd": (_patch("psize", 3000), "page size"),
    "page-number": (_patch("pgno", 7), "is not a meta page"),
    "not-a-meta-page": (_patch("flags", 0x02), "is not a meta page"),
    "last-page-past-the-file": (_patch("last-page", 1 << 40), "past the file's"),
    "root-past-the-file": (_patch("main-root", 10_000), "main tree root at page 10000"),
    "root-is-a-meta-page": (_patch("main-root", 1), "main tree root at page 1"),
    "depth-beyond-lmdb": (_patch("main-depth", 200), "depth 200"),
    "txnid-parity": (_patch("txnid", 1 << 40), "of the wrong parity"),
    "older-meta-root": (_patch("main-root", 1 << 50, meta="older"), "main tree root"),
    "truncated-to-one-page": (lambda body: body[:4096], "cannot hold two"),
}


@pytest.mark.parametrize("case", sorted(LMDB_META_HOSTILE))
def test_crafted_lmdb_meta_page_is_a_named_error_not_a_crash(case, tmp_path) -> None:
    patch, message = LMDB_META_HOSTILE[case]
    path = tiny_dataset(tmp_path, "lmdb")
    shard = first_shard(path)
    shard.write_bytes(patch(shard.read_bytes()))
    resync_manifest(path)
    outcome = in_bounded_child(lambda: dlpipe.open_dataset(path)[1])  # dies by signal: fails
    assert outcome.startswith(f"ShardCorruptError: shard {shard}, sample 1: cannot be opened")
    assert message in outcome, outcome


def test_lmdb_meta_checks_pass_every_shard_dlpipe_writes(tmp_path) -> None:
    big = [{"__key__": f"b{i}", "cls": b"1", "txt": os.urandom(20_000)} for i in range(30)]
    path = tiny_dataset(tmp_path, "lmdb", [*TINY, *big])  # overflow pages, a deeper tree
    assert [s["txt"] for s in read_all(path)[4:]] == [s["txt"] for s in big]


# ---------------------------------------------------------------- lmdb: crafted values


def _put(shard: Path, index: int, value: bytes | None) -> None:
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        key = struct.pack(">Q", index)
        if value is None:
            txn.delete(key)
        else:
            txn.put(key, value)
    env.close()


def _record(**fields: object) -> bytes:
    return msgpack.packb({"__key__": "s1", "cls": b"1", "txt": b"hello", **fields})


LMDB_VALUE_HOSTILE = {
    "not-msgpack": (b"\xc1\xc1\xc1", "value is not a MessagePack field map"),
    "a-list": (msgpack.packb([1, 2]), "field map with '__key__'"),
    "no-key": (msgpack.packb({"cls": b"1", "txt": b"x"}), "field map with '__key__'"),
    "int-key": (_record(__key__=7), "sample key 7 is a int"),
    "key-with-a-path": (_record(__key__="../etc"), "sample key '../etc' is not allowed"),
    "str-field": (_record(txt="hello"), "holds a field value that is not bytes"),
    "nested-field": (_record(txt={"a": b"b"}), "holds a field value that is not bytes"),
    "extra-field": (_record(evil=b"x"), "expected ['cls', 'txt']"),
    "cls-padded": (_record(cls=b"01"), "a cls field is an integer in canonical ASCII"),
    "cls-float": (_record(cls=b"1.5"), "a cls field is an integer in canonical ASCII"),
    "cls-text": (_record(cls=b"dog"), "a cls field is an integer in canonical ASCII"),
    "cls-beyond-int64": (_record(cls=b"99999999999999999999"), "is beyond int64"),
    "deeply-nested": (b"\x91" * 100_000 + b"\xc0", "not a MessagePack field map"),
}  # a missing sample (a count the manifest disagrees with): tests/test_hostile_counts.py


@pytest.mark.parametrize("case", sorted(LMDB_VALUE_HOSTILE))
def test_crafted_lmdb_value_names_shard_and_sample(case, tmp_path) -> None:
    value, message = LMDB_VALUE_HOSTILE[case]
    path = tiny_dataset(tmp_path, "lmdb")
    shard = first_shard(path)
    _put(shard, 1, value)
    resync_manifest(path)
    ds = dlpipe.open_dataset(path)
    assert ds[0]["__key__"] == "s0"
    with pytest.raises(dlpipe.ShardCorruptError, match=rf"{shard}, sample 1: .*") as caught:
        ds[1]
    assert message in str(caught.value)
    with pytest.raises(dlpipe.ShardCorruptError, match="sample 1"):
        list(ds)


@pytest.mark.parametrize(
    ("fmt", "key", "cls", "message"),
    [
        ("wds", "a%", b"1", r"member 'a%\.cls' is not named"),
        ("hdf5", "a%", b"1", r"sample key 'a%' is not allowed"),
        ("wds", "s0", b"-0x1", "canonical ASCII"),
        ("wds", "s0", b"1e3", "canonical ASCII"),
        ("wds", "s0", b"99999999999999999999", "beyond int64"),
    ],
)
def test_bad_keys_and_labels_in_tar_and_hdf5_are_refused(fmt, key, cls, message, tmp_path) -> None:
    """(hdf5 stores cls as int64, so its labels are canonical by construction.)"""
    path = tiny_dataset(tmp_path, fmt)
    shard = first_shard(path)
    if fmt == "wds":
        members = tar_member(f"{key}.cls", cls) + tar_member(f"{key}.txt", b"x")
        shard.write_bytes(good_members(1) + members + tar_end())
    else:
        keys = np.frombuffer(f"{key}s1s2s3".encode(), np.uint8)  # "s0" -> key, same length
        craft_h5(shard, "__key__", lambda f, n, d: f.create_dataset(n, data=keys))
    resync_manifest(path)
    with pytest.raises(dlpipe.ShardCorruptError, match=message):
        read_all(path)


# ---------------------------------------------------------------- a full disk while writing


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 2 MiB tmpfs: writing more than that fills it, as a real disk fills."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mount)],
        capture_output=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], timeout=30, check=False)


BIG = [{"__key__": f"b{i}", "cls": b"1", "txt": os.urandom(100_000)} for i in range(30)]


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
def test_a_full_disk_is_enospc_naming_the_shard_and_leaves_nothing(fmt, full_disk) -> None:
    from dlpipe.formats import FORMATS, write_shard
    from dlpipe.formats.base import ShardDiskFullError

    name = FORMATS[fmt].shard_name("train", 0)
    with pytest.raises(ShardDiskFullError) as caught:
        write_shard(FORMATS[fmt], str(full_disk), name, BIG)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    message = str(caught.value)
    assert message.startswith("[Errno 28] No space left on device: writing shard " + name)
    assert str(full_disk) in message and "\n" not in message
    assert os.listdir(full_disk) == []  # no partial shard, no staging folder


def test_a_full_disk_through_the_dataset_writer_publishes_nothing(full_disk) -> None:
    with pytest.raises(OSError, match="No space left on device") as caught:
        write_dataset(full_disk / "out", "lmdb", {"train": BIG}, max_shard_samples=None)
    assert caught.value.errno == errno.ENOSPC
    left = os.listdir(full_disk / "out")
    assert "dlpipe.json" not in left and not [n for n in left if n.endswith(".lmdb")]


def test_lmdb_grows_a_full_map_and_retries(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dlpipe.formats.lmdb, "_INITIAL_MAP_BYTES", 64 << 10)
    monkeypatch.setattr(dlpipe.formats.lmdb, "_COMMIT_EVERY_BYTES", 256 << 10)
    path = tiny_dataset(tmp_path, "lmdb", BIG)
    assert [s["txt"] for s in read_all(path)] == [s["txt"] for s in BIG]


# ---------------------------------------------------------------- lmdb: crafted tree pages

PAGE = 4096


def _pages(body: bytes, flag: int) -> list[int]:
    """Numbers of the pages whose flags hold `flag` (0x02 leaf, 0x04 overflow)."""
    return [
        n
        for n in range(2, len(body) // PAGE)
        if struct.unpack_from("=H", body, n * PAGE + 10)[0] & flag == flag
        and struct.unpack_from("=Q", body, n * PAGE)[0] == n
    ]


def _first_node(body: bytes, leaf: int) -> int:
    return leaf * PAGE + struct.unpack_from("=H", body, leaf * PAGE + 16)[0]


def _bigdata_node(body: bytes, leaf: int) -> int:
    """The byte offset of the first node on `leaf` whose value lives on overflow pages."""
    lower = struct.unpack_from("=H", body, leaf * PAGE + 12)[0]
    for i in range((lower - 16) // 2):
        node = leaf * PAGE + struct.unpack_from("=H", body, leaf * PAGE + 16 + 2 * i)[0]
        if struct.unpack_from("=H", body, node + 4)[0] == 1:
            return node
    raise AssertionError("no value on overflow pages")


def _poke(offset: Callable[[bytes], int], fmt: str, value: int) -> Callable[[bytes], bytes]:
    def poke(body: bytes) -> bytes:
        out = bytearray(body)
        struct.pack_into(fmt, out, offset(body), value)
        return bytes(out)

    return poke


def _leaf(body: bytes) -> int:
    return _pages(body, 0x02)[0]


LMDB_TREE_HOSTILE = {
    "node-pointer-past-the-page": (
        _poke(lambda b: _leaf(b) * PAGE + 16, "=H", 0xFFF0),
        "points to a node at byte 65520",
    ),
    "node-data-size-overruns-the-page": (
        _poke(lambda b: _first_node(b, _leaf(b)), "=H", 0xFFFF),
        "that overruns it",
    ),
    "leaf-marked-as-branch": (
        _poke(lambda b: _leaf(b) * PAGE + 10, "=H", 0x01),
        "is not a leaf",
    ),
    "page-bounds-inverted": (
        _poke(lambda b: _leaf(b) * PAGE + 12, "=H", 4000),
        "is not a leaf",
    ),
    "duplicate-data-node": (
        _poke(lambda b: _first_node(b, _leaf(b)) + 4, "=H", 0x04),
        "node with flags 0x4",
    ),
    "overflow-value-past-the-file": (
        _poke(lambda b: _bigdata_node(b, _leaf(b)) + 8 + 8, "=Q", 10_000),
        "starts at page 10000, outside the file",
    ),
    "overflow-pages-past-the-file": (
        _poke(lambda b: _pages(b, 0x04)[0] * PAGE + 12, "=I", 10_000),
        "runs past the file",
    ),
    "overflow-value-larger-than-its-pages": (
        _poke(lambda b: _bigdata_node(b, _leaf(b)), "=H", 0xFFFF),
        "overruns its",
    ),
}

WITH_BIG_VALUE = [*TINY[:3], {"__key__": "s3", "cls": b"0", "txt": bytes(range(256)) * 40}]


@pytest.mark.parametrize("case", sorted(LMDB_TREE_HOSTILE))
def test_crafted_lmdb_tree_page_is_a_named_error_not_a_crash(case, tmp_path) -> None:
    patch, message = LMDB_TREE_HOSTILE[case]
    path = tiny_dataset(tmp_path, "lmdb", WITH_BIG_VALUE)
    shard = first_shard(path)
    shard.write_bytes(patch(shard.read_bytes()))
    resync_manifest(path)
    outcome = in_bounded_child(lambda: read_all(path))
    assert outcome.startswith(f"ShardCorruptError: shard {shard}, sample 0: cannot be opened")
    assert message in outcome, outcome


@pytest.mark.slow
def test_flipping_any_byte_of_a_leaf_page_head_never_kills_the_reader(tmp_path) -> None:
    """The first 160 bytes of the leaf: page header, node pointers and the first nodes."""
    path = tiny_dataset(tmp_path, "lmdb", WITH_BIG_VALUE)
    shard = first_shard(path)
    body = shard.read_bytes()
    leaf = _leaf(body) * PAGE
    nodes = _first_node(body, _leaf(body))
    for pos in [*range(leaf, leaf + 48), *range(nodes, nodes + 112)]:
        flipped = bytearray(body)
        flipped[pos] ^= 0xFF
        shard.write_bytes(flipped)
        outcome = in_bounded_child(lambda: read_all(path), timeout_s=10)  # a signal fails here
        assert outcome == "ok" or outcome.startswith("ShardCorruptError: "), (pos, outcome)


def test_a_field_named_like_an_offsets_dataset_still_reads(tmp_path) -> None:
    samples = [{"__key__": f"s{i}", "cls": b"1", "x.offsets": b"abc" * i} for i in range(3)]
    path = tiny_dataset(tmp_path, "hdf5", samples)
    assert [s["x.offsets"] for s in read_all(path)] == [s["x.offsets"] for s in samples]


def test_a_tar_shard_cut_short_while_it_is_read_is_a_named_error(tmp_path) -> None:
    """Member data is read straight from the open shard file at its offset: a file that
    shrinks under the reader (another process rewriting it) is a corrupt shard naming the
    member, never a sample with short bytes."""
    text = b"x" * 100_000
    samples = [{"__key__": f"s{i}", "cls": b"1", "txt": text} for i in range(6)]
    path = write_dataset(tmp_path / "data", "wds", {"train": samples})
    shard = first_shard(path)
    reading = iter(dlpipe.open_dataset(path, "train").readers[0])  # the shard's own reader
    assert bytes(next(reading)["txt"]) == text
    os.truncate(shard, shard.stat().st_size // 2)  # where the fourth sample's text begins
    with pytest.raises(dlpipe.ShardCorruptError, match=re.escape(shard.name)) as caught:
        list(reading)
    assert "sample 3: member 's3.txt' ends after 0 of its 100000 bytes" in str(caught.value)


def wds_outcome(path: str) -> str:
    """Every sample of the split, or the error that stops the read."""
    try:
        return repr([dict(sample) for sample in read_all(path)])
    except dlpipe.DlpipeError as exc:
        return f"{type(exc).__name__}: {exc}"


def with_tarfile_only(monkeypatch: pytest.MonkeyPatch, read: Callable[[], str]) -> str:
    """`read` with every header left to tarfile's parser (dlpipe's template parser off)."""
    with monkeypatch.context() as patch:
        patch.setattr(dlpipe.formats.wds, "_template_member", lambda header, offset: None)
        return read()


def test_dlpipe_headers_skip_tarfiles_parser_and_read_the_same(tmp_path, monkeypatch) -> None:
    path = tiny_dataset(tmp_path, "wds")
    parsed: list[int] = []
    real = dlpipe.formats.wds._template_member

    def recorded(header: bytes, offset: int):
        member = real(header, offset)
        parsed.extend([offset] if member is not None else [])
        return member

    monkeypatch.setattr(dlpipe.formats.wds, "_template_member", recorded)
    fast = wds_outcome(path)
    assert parsed == [1024 * i for i in range(2 * len(TINY))]  # every member
    assert fast == with_tarfile_only(monkeypatch, lambda: wds_outcome(path))
    assert fast.startswith("[{")


def with_checksum(header: bytearray) -> bytearray:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return header


@pytest.mark.parametrize("fix_checksum", [False, True], ids=["flipped", "flipped-resummed"])
def test_any_byte_of_a_header_changed_reads_as_tarfile_reads_it(
    fix_checksum, tmp_path, monkeypatch
) -> None:
    """Every byte of the second member's header flipped in turn (and the checksum made right
    again, or not): dlpipe's template parser and tarfile's give the same samples or the same
    named error, so the template parser accepts nothing tarfile would read otherwise."""
    path = tiny_dataset(tmp_path, "wds")
    shard = first_shard(path)
    body = shard.read_bytes()
    outcomes = set()
    for position in range(512):
        if fix_checksum and 148 <= position < 156:
            continue
        changed = bytearray(body)
        changed[1024 + position] ^= 0x01
        if fix_checksum:
            changed[1024 : 1024 + 512] = with_checksum(changed[1024 : 1024 + 512])
        shard.write_bytes(changed)
        resync_manifest(path)
        fast = wds_outcome(path)
        assert fast == with_tarfile_only(monkeypatch, lambda: wds_outcome(path)), position
        outcomes.add(fast.split(":")[0] if not fast.startswith("[") else "samples")
    assert "ShardCorruptError" in outcomes and "samples" in outcomes  # both kinds were seen
