"""A prepared dataset someone else made is untrusted input: its manifest, its shards, its folder.

Each test does what an attacker (or a careless copy) does to a dataset and asserts the exact
outcome: a named error, one ``error:`` line, the exit code, no traceback, nothing deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import msgpack
import pytest
from conftest import FORMAT_NAMES, write_dataset
from test_bad_input import resync_manifest as resync

import dlpipe
from dlpipe.cli import main
from dlpipe.loading.dataset import DatasetChangedError

Edit = Callable[[dict], object]


# --- helpers -----------------------------------------------------------------------------------


def manifest_path(path: str) -> Path:
    return Path(path, "dlpipe.json")


def load(path: str) -> dict:
    return json.loads(manifest_path(path).read_text())


def save(path: str, data: dict) -> None:
    manifest_path(path).write_text(json.dumps(data))


def one_error_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging (a FIFO read blocks forever)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def shard_of(data: dict, **changes: object) -> dict:
    data["splits"]["train"]["shards"][0].update(changes)
    return data


def deep(levels: int) -> dict:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    assert isinstance(value, dict)
    return value


def total_overflow(data: dict) -> dict:
    shards = data["splits"]["train"]["shards"]
    for shard in shards[:2]:
        shard["samples"] = 2**62 + 1
    data["splits"]["train"]["samples"] = sum(s["samples"] for s in shards)
    return data


def counts(data: dict, value: object) -> dict:
    data["splits"]["train"]["class_counts"] = value
    return data


# --- 1. every malformed manifest is a ManifestError --------------------------------------------

MALFORMED: list[tuple[str, Edit, str]] = [
    ("deep-nesting", lambda d: "[" * 200_000 + "]" * 200_000, "nested deeper than"),
    ("deep-options", lambda d: {**d, "options": deep(60)}, "nested deeper than 32"),
    ("top-list", lambda d: [d], "not a JSON object"),
    ("top-string", lambda d: json.dumps("dlpipe"), "not a JSON object"),
    ("top-null", lambda d: "null", "not a JSON object"),
    ("nan", lambda d: json.dumps(shard_of(d, samples=8)).replace(": 8,", ": NaN,", 1), "NaN"),
    (
        "infinity",
        lambda d: json.dumps(d).replace('"bytes": ', '"bytes": Infinity, "x": ', 1),
        "Infinity",
    ),
    ("float-count", lambda d: shard_of(d, samples=8.0), "not a non-negative integer"),
    ("bool-count", lambda d: shard_of(d, bytes=True), "not a non-negative integer"),
    ("negative-count", lambda d: shard_of(d, samples=-1), "non-negative"),
    ("beyond-int64", lambda d: shard_of(d, bytes=2**63), "at most 2**63-1"),
    ("total-beyond-int64", total_overflow, "more than 2**63-1"),
    ("string-count", lambda d: shard_of(d, samples="8"), "not a non-negative integer"),
    ("class-counts-short", lambda d: counts(d, [1, 2]), "2 entries but there are 8 classes"),
    ("class-counts-sum", lambda d: counts(d, [100] * 8), "add up to 800, not its 32"),
    ("class-counts-type", lambda d: counts(d, {"a": 1}), "class_counts is not a list"),
    ("duplicate-shard", lambda d: _duplicate_shard(d), "listed twice"),
    ("dotdot-shard", lambda d: shard_of(d, name="../x.h5"), "not a plain file name"),
    ("absolute-shard", lambda d: shard_of(d, name="/etc/passwd.h5"), "not a plain file name"),
    ("nested-shard", lambda d: shard_of(d, name="a/b.h5"), "not a plain file name"),
    ("empty-shard", lambda d: shard_of(d, name=""), "not a plain file name"),
    ("dotfile-shard", lambda d: shard_of(d, name=".dlpipe-lock.h5"), "not a plain file name"),
    ("non-string-shard", lambda d: shard_of(d, name=7), "not a plain file name"),
    ("manifest-as-shard", lambda d: shard_of(d, name="dlpipe.json"), "not a hdf5 shard name"),
    ("other-format-shard", lambda d: shard_of(d, name="train-000000.tar"), "not a hdf5 shard"),
    ("bad-split-name", lambda d: _rename_split(d, "../train"), "split name '../train'"),
    ("empty-split-name", lambda d: _rename_split(d, ""), "split name ''"),
    ("non-string-class", lambda d: {**d, "classes": [1, *d["classes"][1:]]}, "non-string"),
    ("bad-field-name", lambda d: {**d, "fields": {"../jpg": "image"}}, "field name '../jpg'"),
    ("duplicate-key", lambda d: json.dumps(d)[:-1] + ', "format": "lmdb"}', "appears twice"),
    ("shards-not-list", lambda d: _split(d, shards="x"), "'shards' is not a list"),
    ("split-samples-bool", lambda d: _split(d, samples=True), "says True samples"),
    ("split-bytes-wrong", lambda d: _split(d, bytes=1), "says 1 bytes"),
]


def _duplicate_shard(data: dict) -> dict:
    train = data["splits"]["train"]
    train["shards"][1]["name"] = train["shards"][0]["name"]
    return data


def _rename_split(data: dict, name: str) -> dict:
    data["splits"][name] = data["splits"].pop("train")
    return data


def _split(data: dict, **changes: object) -> dict:
    data["splits"]["train"].update(changes)
    return data


@pytest.mark.parametrize(
    ("edit", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_manifest_is_a_manifest_error(edit, message, make_dataset, capsys) -> None:
    path = make_dataset("hdf5")
    edited = edit(load(path))
    manifest_path(path).write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(dlpipe.ManifestError, match="dlpipe.json") as caught:
        dlpipe.read_manifest(path)
    assert message in str(caught.value)
    for command in (["inspect", path], ["verify", path], ["inspect", "--json", path]):
        assert main(command) == 2
        one_error_line(capsys.readouterr().err, "dlpipe.json", message)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"schema": "dlpipe.manifest", "x": "\xff\xfe"}', "not UTF-8 (byte 0xff at offset 36)"),
        ('{"schema": 1}'.encode("utf-16"), "not UTF-8"),
        (b"\x00" * 64, "not valid JSON"),
        (b"", "not valid JSON"),
    ],
    ids=["latin1-bytes", "utf16", "nul-bytes", "empty"],
)
def test_manifest_bytes_that_are_not_utf8_json(raw, message, make_dataset, capsys) -> None:
    path = make_dataset("wds")
    manifest_path(path).write_bytes(raw)
    with pytest.raises(dlpipe.ManifestError, match=re.escape(message)):
        dlpipe.open_dataset(path)
    assert main(["inspect", path]) == 2
    one_error_line(capsys.readouterr().err, message)


def test_oversized_manifest_is_refused_before_it_is_read(make_dataset, capsys) -> None:
    """A sparse 300 MiB dlpipe.json costs no disk; reading it whole would cost 300 MiB."""
    path = make_dataset("wds")
    with open(manifest_path(path), "r+b") as f:
        f.truncate(300 << 20)
    code = (
        "import resource, sys, dlpipe\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))\n"
        "try:\n    dlpipe.read_manifest(sys.argv[1])\n"
        "except dlpipe.ManifestError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "larger than 256 MiB" in done.stdout
    assert main(["inspect", path]) == 2
    one_error_line(capsys.readouterr().err, "larger than 256 MiB")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_manifest_that_is_not_a_regular_file_is_refused_without_hanging(
    kind, make_dataset, capsys
) -> None:
    path = make_dataset("lmdb")
    target = manifest_path(path)
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", target)
    else:
        target.mkdir()
    with deadline(120):  # a bound on a hang (a FIFO read never ends), not a speed
        with pytest.raises(dlpipe.ManifestError, match="not a regular file"):
            dlpipe.open_dataset(path)
        assert main(["verify", path]) == 2
    one_error_line(capsys.readouterr().err, "not a regular file")


def test_wrong_length_class_counts_no_longer_crash_inspect(make_dataset, capsys) -> None:
    path = make_dataset("lmdb")
    data = load(path)
    data["splits"]["val"]["class_counts"] = [8]  # inspect indexed this by label: IndexError
    save(path, data)
    assert main(["inspect", path]) == 2
    one_error_line(capsys.readouterr().err, "splits.val.class_counts has 1 entries")


# --- 6. the resume hint names the command that works -------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_resume_hint_names_format_and_out(fmt, tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "my data", fmt, {"train": samples[:16]})
    manifest_path(path).unlink()
    journal = Path(path, ".dlpipe-journal")
    journal.mkdir()
    (journal / "plan.json").write_text('{"fingerprint": "abc"}')
    with pytest.raises(dlpipe.ManifestNotFoundError) as caught:
        dlpipe.open_dataset(path)
    message = str(caught.value)
    assert f"dlpipe convert RAW --to {fmt} --out '{path}' --resume" in message
    (journal / "plan.json").write_text(json.dumps({"format": fmt, "raw": "/data/my raw"}))
    with pytest.raises(dlpipe.ManifestNotFoundError, match=f"convert '/data/my raw' --to {fmt}"):
        dlpipe.open_dataset(path)


def test_resume_hint_survives_a_hostile_journal(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "hdf5", {"train": samples[:8]})
    manifest_path(path).unlink()
    journal = Path(path, ".dlpipe-journal")
    journal.mkdir()
    (journal / "plan.json").write_text("[" * 100_000)
    with pytest.raises(dlpipe.ManifestNotFoundError, match=f"--to hdf5 --out {path} --resume"):
        dlpipe.open_dataset(path)
    (journal / "plan.json").write_text('{"format": "zip; rm -rf ~", "raw": 3}')
    with pytest.raises(dlpipe.ManifestNotFoundError, match="convert RAW --to hdf5 --out"):
        dlpipe.open_dataset(path)
    for args, shown in [
        (["--seed", "1; rm -rf ~"], " --seed '1; rm -rf ~' --resume"),  # quoted, never run
        (["--overwrite"], f"--out {path} --resume"),  # not an option a resume repeats
        (["--seed"], f"--out {path} --resume"),  # a flag without its value
        (["--keep-empty-classes", "--quality", "90"], " --keep-empty-classes --quality 90 --"),
    ]:
        (journal / "plan.json").write_text(json.dumps({"format": "hdf5", "args": args}))
        with pytest.raises(dlpipe.ManifestNotFoundError) as caught:
            dlpipe.open_dataset(path)
        assert shown in str(caught.value), str(caught.value)


# --- 2. verify survives a reader that crashes the interpreter ------------------------------------

_PAGE = 4096
_BIGDATA = 0x01


def crash_lmdb_leaf(shard: Path) -> None:
    """Make one leaf node's overflow value run past the end of the file: one changed size field.

    The file and its meta pages stay valid; reading that value touches pages past the end of
    the memory-mapped file, and the kernel sends SIGBUS.
    """
    body = bytearray(shard.read_bytes())
    for page in range(2, len(body) // _PAGE):
        base = page * _PAGE
        flags, lower = struct.unpack_from("<HH", body, base + 10)
        if not flags & 0x02:  # P_LEAF
            continue
        for slot in range((lower - 16) // 2):
            node = base + struct.unpack_from("<H", body, base + 16 + 2 * slot)[0]
            node_flags, key_size = struct.unpack_from("<HH", body, node + 4)
            if node_flags & _BIGDATA:
                (pgno,) = struct.unpack_from("<Q", body, node + 8 + key_size)
                size = len(body) - pgno * _PAGE + 64 * _PAGE  # well past the end of the file
                struct.pack_into("<HH", body, node, size & 0xFFFF, size >> 16)
                shard.write_bytes(bytes(body))
                return
    raise AssertionError(f"{shard} has no overflow value to corrupt")


def lmdb_crash_dataset(tmp_path: Path, samples: list[dict]) -> tuple[str, Path]:
    big = [dict(s, txt=s["txt"] * 400) for s in samples[:24]]  # values on overflow pages
    path = write_dataset(tmp_path / "d", "lmdb", {"train": big})
    shard = Path(path, "train-000001.lmdb")
    crash_lmdb_leaf(shard)
    resync(path)  # the manifest agrees with the crafted bytes: only reading can tell
    return path, shard


def test_crafted_lmdb_page_really_crashes_a_plain_reader(tmp_path, samples) -> None:
    _, shard = lmdb_crash_dataset(tmp_path, samples)
    code = (
        "import lmdb, sys\n"
        "env = lmdb.open(sys.argv[1], subdir=False, readonly=True, lock=False)\n"
        "with env.begin() as txn:\n    [v for _, v in txn.cursor()]\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(shard)], timeout=60)
    assert done.returncode == -signal.SIGBUS


def test_verify_names_the_crafted_lmdb_shard_and_survives(tmp_path, samples, capsys) -> None:
    """Through dlpipe the crafted page is either refused by the reader or contained by verify:
    either way the shard is named, the next one is checked and the command exits 1."""
    path, shard = lmdb_crash_dataset(tmp_path, samples)
    before = sorted(os.listdir(path))
    report = dlpipe.verify_dataset(path, decode=True)
    assert report.shards_checked == 3
    (problem,) = report.problems
    assert problem.shard == shard.name
    assert "crashed (signal SIGBUS)" in problem.message or "cannot be opened" in problem.message
    assert report.samples_decoded == 16
    assert main(["verify", path, "--decode"]) == 1
    out = capsys.readouterr()
    assert f"train/{shard.name}" in out.out and "Traceback" not in out.out + out.err
    assert sorted(os.listdir(path)) == before


CRASHING_READER = """
import ctypes, os
import dlpipe.verify

_check = dlpipe.verify.check_shard


def check_shard(path, manifest, split, shard, *, decode):
    if shard.name in os.environ["DLPIPE_TEST_CRASH_ON"].split(","):
        ctypes.string_at(0)  # a C library reading a bad address: SIGSEGV, no Python error
    return _check(path, manifest, split, shard, decode=decode)


dlpipe.verify.check_shard = check_shard
"""


@pytest.fixture
def crashing_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """crashing_reader("a,b"): in verify's child processes, reading shard a or b segfaults.

    Installed through sitecustomize in the children only: dlpipe has no test hook of its own.
    """
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CRASHING_READER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    return lambda names: monkeypatch.setenv("DLPIPE_TEST_CRASH_ON", names)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_verify_contains_a_segfaulting_reader_and_goes_on(
    fmt, crashing_reader, make_dataset, capsys
) -> None:
    path = make_dataset(fmt)
    names = [s.name for s in dlpipe.read_manifest(path).splits["train"].shards]
    crashing_reader(f"{names[0]},{names[2]}")
    seen: list[str] = []
    report = dlpipe.verify_dataset(path, decode=True, on_shard=seen.append)
    assert report.shards_checked == 5 and len(seen) == 5
    assert [(p.shard, p.sample) for p in report.problems] == [(names[0], None), (names[2], None)]
    for problem in report.problems:
        assert problem.message.startswith("is corrupt: the reader crashed (signal SIGSEGV)")
    assert report.samples_decoded == 40 - 16
    assert main(["verify", path]) == 1
    out = capsys.readouterr()
    assert f"train/{names[2]}: is corrupt: the reader crashed (signal SIGSEGV)" in out.out
    assert "Traceback" not in out.out + out.err


def test_verify_crash_in_a_subprocess_exits_1_without_traceback(
    crashing_reader, make_dataset
) -> None:
    path = make_dataset("lmdb")
    crashing_reader("val-000000.lmdb")
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "verify", path, "--decode"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "val/val-000000.lmdb: is corrupt: the reader crashed (signal SIGSEGV)" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr


# --- 3. counts checked against the shards; unlisted shards reported ----------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("decode", [False, True], ids=["checksums", "decode"])
def test_verify_checks_each_shards_sample_count(fmt, decode, make_dataset) -> None:
    """The sha256 and bytes are right; only the counts lie (the split total still adds up)."""
    path = make_dataset(fmt)
    data = load(path)
    shards = data["splits"]["train"]["shards"]
    shards[0]["samples"], shards[1]["samples"] = 7, 9
    save(path, data)
    report = dlpipe.verify_dataset(path, decode=decode)
    assert [p.shard for p in report.problems] == [shards[0]["name"], shards[1]["name"]]
    counted = r"holds 8 samples but the manifest says [79]"
    by_offsets = r"'__key__.offsets' is \(9,\) u8; expected \((8|10),\)"  # hdf5 opening
    for problem in report.problems:
        assert re.search(f"{counted}|{by_offsets}", problem.message), problem.message


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_verify_reports_unlisted_shards_and_deletes_nothing(fmt, make_dataset, capsys) -> None:
    path = make_dataset(fmt)
    first = dlpipe.read_manifest(path).splits["train"].shards[0].name
    suffix = dlpipe.FORMATS[fmt].suffix
    copy = shutil.copytree if fmt == "lmdb" and Path(path, first).is_dir() else shutil.copy
    copy(Path(path, first), Path(path, f"photos-000001{suffix}"))
    copy(Path(path, first), Path(path, f"train-000099{suffix}"))
    for name in (".dlpipe-lock", "errors.jsonl", "keys.jsonl", "dlpipe-profiles.json", "notes.txt"):
        Path(path, name).write_text("{}")
    before = sorted(os.listdir(path))
    report = dlpipe.verify_dataset(path)
    assert sorted(p.shard for p in report.problems) == [
        f"photos-000001{suffix}",
        f"train-000099{suffix}",
    ]
    assert all("the manifest does not list it" in p.message for p in report.problems)
    assert main(["verify", path]) == 1
    assert f"photos-000001{suffix}: is named like a {fmt} shard" in capsys.readouterr().out
    assert sorted(os.listdir(path)) == before


# --- shards that point out of the folder, or are not files -------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_verify_refuses_a_shard_linked_out_of_the_folder(fmt, make_dataset, tmp_path) -> None:
    path = make_dataset(fmt)
    name = dlpipe.read_manifest(path).splits["val"].shards[0].name
    outside = tmp_path / "elsewhere.bin"
    shutil.move(Path(path, name), outside)  # same bytes, same sha256: only the link is wrong
    os.symlink(outside, Path(path, name))
    report = dlpipe.verify_dataset(path)
    (problem,) = report.problems
    assert problem.shard == name and "outside the dataset folder" in problem.message
    assert str(outside) in problem.message


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_verify_never_reads_a_shard_that_is_not_a_regular_file(kind, make_dataset) -> None:
    path = make_dataset("wds")
    name = dlpipe.read_manifest(path).splits["train"].shards[2].name
    Path(path, name).unlink()
    if kind == "fifo":
        os.mkfifo(Path(path, name))
    else:
        os.symlink("/dev/zero", Path(path, name))
    with deadline(60):
        report = dlpipe.verify_dataset(path, decode=True)
    problems = [p for p in report.problems if p.shard == name]
    assert len(problems) == 1
    assert "not a regular file" in problems[0].message or "outside" in problems[0].message
    assert report.shards_checked == 5


# --- 4. labels and keys checked on read ---------------------------------------------------------


def labelled(tmp_path: Path, fmt: str, samples: list[dict], labels: dict[int, bytes]) -> str:
    """A dataset whose `labels` (index -> cls bytes) lie outside the classes it names.

    Written without class names (the writer range-checks labels against them), then given
    three, as a hand-edited or hostile manifest would.
    """
    items = [dict(s, cls=labels.get(i, b"1")) for i, s in enumerate(samples[:16])]
    limits = dlpipe.ShardLimits(max_shard_samples=8)
    with dlpipe.DatasetWriter(out=str(tmp_path / fmt), format=fmt, limits=limits) as writer:
        for item in items:
            writer.write("train", item)
    path = str(tmp_path / fmt)
    save(path, {**load(path), "classes": ["a", "b", "c"]})
    return path


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("label", [b"99", b"-1", b"3"])
def test_out_of_range_label_is_a_named_read_error(fmt, label, tmp_path, samples) -> None:
    path = labelled(tmp_path, fmt, samples, {11: label})
    report = dlpipe.verify_dataset(path, decode=True)
    (problem,) = report.problems
    assert (problem.shard, problem.sample) == (f"train-000001{dlpipe.FORMATS[fmt].suffix}", 3)
    assert f"cls={label!r}, outside 0..2" in problem.message
    where = rf"train-000001\.\w+, sample 3: .*cls={re.escape(repr(label))}, outside 0\.\.2"
    ds = dlpipe.open_dataset(path)
    if isinstance(ds, dlpipe.MapDataset):
        assert ds[10]["cls"] == b"1"
        with pytest.raises(dlpipe.ShardCorruptError, match=where):
            ds[11]
    with pytest.raises(dlpipe.ShardCorruptError, match=where):
        list(ds)
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, transform=None, shuffle=False),
        workers=0,
        profile=None,
    )
    with pytest.raises(dlpipe.ShardCorruptError, match=where):
        list(loader)


def test_unlabelled_dataset_has_no_range_check(tmp_path, samples) -> None:
    path = labelled(tmp_path, "hdf5", samples, {2: b"99"})
    save(path, {**load(path), "classes": []})
    assert dlpipe.verify_dataset(path, decode=True).ok
    assert dlpipe.open_dataset(path)[2]["cls"] == b"99"


def test_lmdb_key_breaking_the_key_rule_is_a_named_read_error(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples[:8]})
    shard = Path(path, "train-000000.lmdb")
    env = lmdb.open(str(shard), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        value = msgpack.packb({**samples[5], "__key__": "../../etc/passwd"}, use_bin_type=True)
        txn.put(struct.pack(">Q", 5), value)
    env.close()
    resync(path)
    report = dlpipe.verify_dataset(path, decode=True)
    (problem,) = report.problems
    assert (problem.shard, problem.sample) == ("train-000000.lmdb", 5)
    assert "'../../etc/passwd' is not allowed" in problem.message
    with pytest.raises(dlpipe.ShardCorruptError, match="train-000000.lmdb, sample 5: .*passwd"):
        dlpipe.open_dataset(path)[5]


# --- 5. a dataset replaced while it is read ------------------------------------------------------


def overwrite(path: str, fmt: str, samples: list[dict]) -> None:
    """What `dlpipe convert --overwrite` does: the old manifest goes, new shards, new manifest."""
    limits = dlpipe.ShardLimits(max_shard_samples=8)
    writer = dlpipe.DatasetWriter(out=path, format=fmt, overwrite=True, limits=limits)
    with writer:
        for sample in samples:
            writer.write("train", sample)


def first_sample(ds: dlpipe.MapDataset | dlpipe.StreamDataset, shard: int = 0) -> dict:
    if isinstance(ds, dlpipe.MapDataset):
        return ds[shard * 8]
    return next(iter(ds.readers[shard]))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_overwrite_under_a_live_dataset_is_a_named_error(fmt, make_dataset, samples) -> None:
    path = make_dataset(fmt)
    ds = dlpipe.open_dataset(path)
    assert first_sample(ds) == samples[0]
    overwrite(path, fmt, samples[8:40])  # other samples, the same number of shards
    with pytest.raises(DatasetChangedError, match=f"{path} was replaced.*train-000002"):
        first_sample(ds, 2)
    with pytest.raises(DatasetChangedError):
        list(ds)
    fresh = dlpipe.open_dataset(path)
    assert first_sample(fresh, 2) == samples[24]


def test_equal_sized_replaced_shard_is_never_read_under_the_old_manifest(
    make_dataset, samples
) -> None:
    path = make_dataset("hdf5")
    ds = dlpipe.open_dataset(path)
    assert ds[0] == samples[0]
    shard = Path(path, "train-000002.h5")
    body = bytearray(shard.read_bytes())
    at = body.index(samples[17]["txt"])
    body[at : at + 6] = b"SAMPLE"  # same size: the size check alone cannot tell
    shard.write_bytes(bytes(body))
    resync(path)
    with pytest.raises(DatasetChangedError, match="train-000002.h5"):
        ds[17]


def test_removed_manifest_under_a_live_dataset_is_a_named_error(make_dataset) -> None:
    path = make_dataset("lmdb")
    ds = dlpipe.open_dataset(path)
    ds[0]
    manifest_path(path).unlink()  # an overwrite starting
    with pytest.raises(DatasetChangedError, match="replaced or removed"):
        ds[20]


def test_a_touched_or_identical_manifest_is_not_a_change(make_dataset, samples) -> None:
    path = make_dataset("wds")
    ds = dlpipe.open_dataset(path)
    first_sample(ds)
    body = manifest_path(path).read_bytes()
    manifest_path(path).unlink()
    manifest_path(path).write_bytes(body)  # another inode, the same bytes
    os.utime(manifest_path(path), ns=(1, 1))
    assert list(ds) == samples[:32]


def test_workers_carry_the_manifest_stamp(make_dataset, samples) -> None:
    """Spawned workers get the dataset pickled: the stamp goes with it and is checked there."""
    import pickle

    path = make_dataset("hdf5")
    ds = dlpipe.open_dataset(path)
    assert ds[0] == samples[0]
    copy = pickle.loads(pickle.dumps(ds))
    overwrite(path, "hdf5", samples[8:40])
    with pytest.raises(DatasetChangedError):
        copy[0]  # a new process (here: a new object) opens the shard anew


def test_forked_loader_workers_refuse_a_replaced_dataset(make_dataset, samples) -> None:
    path = make_dataset("lmdb")
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, transform=None, shuffle=False),
        workers={"num_workers": 1, "multiprocessing_context": "fork"},
        profile=None,
    )
    batches = iter(loader)
    try:
        assert [s["__key__"] for s in next(batches)] == [s["__key__"] for s in samples[:4]]
        overwrite(path, "lmdb", samples[8:40])
        with pytest.raises(DatasetChangedError, match="replaced"):
            list(batches)
    finally:
        # the iterator that raised is kept alive by the traceback: stop its worker now, not
        # at interpreter exit
        loader.close()


def test_a_closed_and_reopened_view_checks_the_manifest_again(make_dataset, samples) -> None:
    path = make_dataset("lmdb")
    ds = dlpipe.open_dataset(path)
    assert ds[0] == samples[0]
    ds.close()
    overwrite(path, "lmdb", samples[8:40])
    with pytest.raises(DatasetChangedError, match="train-000000.lmdb"):
        ds[0]


def test_a_replaced_dataset_on_object_storage_is_a_named_error(samples) -> None:
    url = "memory://dlpipe-hostile/replaced"
    write_dataset(url, "hdf5", {"train": samples[:32]})
    ds = dlpipe.open_dataset(url)
    assert ds[0] == samples[0]
    overwrite(url, "hdf5", samples[8:40])
    with pytest.raises(DatasetChangedError, match="train-000001.h5"):
        ds[8]
