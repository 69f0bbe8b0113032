"""A raw folder as an attacker (or a messy disk) leaves it: FIFOs, devices, links out and in
loops, OS litter, empty classes, undecodable and overlong names, tables pointing elsewhere.

Each test drives ``dlpipe convert`` as a user would (a subprocess with a timeout wherever a hang
or an unbounded read is the failure) and asserts the exact outcome: the exit code, one
``error:`` line naming the file, no traceback, the real samples and nothing read from outside.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import resource
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.imagefolder import ImageFolderSource
from dlpipe.converters.source import SourceError, SourceOptions, read_file
from dlpipe.sample import MAX_KEY_LENGTH, check_key, escape_key, make_key, unescape_key

MEMORY_LIMIT_BYTES = 2 << 30  # the convert child's address space: /dev/zero read whole would die
CLASSES = ("cat", "dog")


def jpeg(seed: int, side: int = 12) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (side, side), (seed * 37 % 256, seed * 91 % 256, 120)).save(out, "JPEG")
    return out.getvalue()


def make_raw(root: Path, per_class: int = 3) -> dict[str, bytes]:
    """root/<cat|dog>/<i>.jpg; returns relative path → bytes."""
    files = {}
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            data = jpeg(c * 10 + i)
            (root / name / f"{i}.jpg").write_bytes(data)
            files[f"{name}/{i}.jpg"] = data
    return files


def convert_child(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -m dlpipe convert ...`` in a child with a 2 GiB address space and a timeout."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))

    return subprocess.run(
        [sys.executable, "-m", "dlpipe", "convert", *args, "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
    )


def one_error_line(stdout: str, stderr: str, *needles: str) -> str:
    """The single ``error:`` line, checked to name every needle; no traceback anywhere."""
    assert "Traceback" not in stdout + stderr
    lines = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stdout + stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def all_samples(out: Path) -> list[dict]:
    manifest = dlpipe.read_manifest(str(out))
    return [s for split in manifest.splits for s in dlpipe.open_dataset(str(out), split)]


def skipped_reasons(out: Path) -> dict[str, str]:
    source = dlpipe.read_manifest(str(out)).source
    return {e["path"]: e["reason"] for e in source["skipped_examples"]}


# --- 1. only regular files are read; no read is unbounded ----------------------------------


def test_fifo_socket_and_device_in_a_class_are_skipped_never_opened(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    os.mkfifo(raw / "cat" / "x.jpg")  # opened for reading, this blocks until a writer comes
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(raw / "dog" / "sock.jpg"))
    try:
        done = convert_child(str(raw), "--to", "wds", "--out", str(out))
    finally:
        server.close()
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert sorted(s["jpg"] for s in all_samples(out)) == sorted(real.values())
    reasons = skipped_reasons(out)
    assert reasons == {
        str(raw / "cat" / "x.jpg"): "a FIFO",
        str(raw / "dog" / "sock.jpg"): "a socket",
    }
    assert dlpipe.read_manifest(str(out)).source["skipped_entries"] == 2


def test_device_node_inside_the_raw_folder_is_never_opened(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    try:
        os.mknod(raw / "cat" / "zero.jpg", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    done = convert_child(str(raw), "--to", "hdf5", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(s["jpg"] for s in all_samples(out)) == sorted(real.values())
    assert skipped_reasons(out) == {str(raw / "cat" / "zero.jpg"): "a character device"}


def test_link_to_dev_zero_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    os.symlink("/dev/zero", raw / "cat" / "endless.jpg")
    done = convert_child(str(raw), "--to", "lmdb", "--out", str(out))
    assert done.returncode == 0, done.stderr  # under a 2 GiB address space: nothing read whole
    assert sorted(s["jpg"] for s in all_samples(out)) == sorted(real.values())
    reason = skipped_reasons(out)[str(raw / "cat" / "endless.jpg")]
    assert reason.startswith("a link to /dev/zero, outside the raw folder")


def test_read_file_refuses_a_fifo_at_once_and_reads_no_more_than_the_size(tmp_path) -> None:
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    with pytest.raises(dlpipe.DlpipeError, match=r"pipe\.jpg: is a FIFO; dlpipe reads only"):
        read_file(str(fifo), str(tmp_path))  # O_NONBLOCK: the open cannot hang
    with pytest.raises(dlpipe.DlpipeError, match="is a character device"):
        read_file("/dev/zero")
    (tmp_path / "a.jpg").write_bytes(b"12345")
    assert read_file(str(tmp_path / "a.jpg"), str(tmp_path)) == b"12345"
    with pytest.raises(dlpipe.DlpipeError, match="5 bytes, over the 4-byte limit"):
        read_file(str(tmp_path / "a.jpg"), str(tmp_path), max_bytes=4)


def test_raw_root_that_is_a_fifo_is_one_error_line(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "raw.csv")
    done = convert_child(str(tmp_path / "raw.csv"), "--to", "wds", "--out", str(tmp_path / "o"))
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, "raw.csv", "not a folder or a regular file")


# --- 2. links are followed only within the raw folder; loops add nothing --------------------


def test_link_to_a_valid_jpeg_outside_is_never_read(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    secret = jpeg(99, side=20)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "id-card.jpg").write_bytes(secret)
    os.symlink(tmp_path / "private" / "id-card.jpg", raw / "dog" / "steal.jpg")
    os.symlink("../../private/id-card.jpg", raw / "cat" / "steal2.jpg")
    os.symlink("0.jpg", raw / "cat" / "alias.jpg")  # a link inside the folder is followed
    done = convert_child(str(raw), "--to", "wds", "--out", str(out))
    assert done.returncode == 0, done.stderr
    stored = [s["jpg"] for s in all_samples(out)]
    assert secret not in stored
    assert sorted(stored) == sorted([*real.values(), real["cat/0.jpg"]])
    reasons = skipped_reasons(out)
    assert set(reasons) == {str(raw / "dog" / "steal.jpg"), str(raw / "cat" / "steal2.jpg")}
    assert all("outside the raw folder" in r for r in reasons.values())


def test_link_loops_and_dangling_links_add_no_images_and_no_classes(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    os.symlink("..", raw / "cat" / "loop")  # back up to the root: every image again
    os.symlink(raw, raw / "zebra")  # a class that is the root itself
    os.symlink("cat", raw / "kitten")  # a second name for a class
    os.symlink("missing.jpg", raw / "cat" / "dangling.jpg")
    os.symlink("self.jpg", raw / "dog" / "self.jpg")
    done = convert_child(str(raw), "--to", "wds", "--out", str(out))
    assert done.returncode == 0, done.stderr
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == CLASSES
    samples = all_samples(out)
    assert sorted(s["jpg"] for s in samples) == sorted(real.values())
    assert len({s["__key__"] for s in samples}) == len(real)
    reasons = skipped_reasons(out)
    assert reasons[str(raw / "cat" / "dangling.jpg")] == "a dangling symbolic link"
    assert reasons[str(raw / "dog" / "self.jpg")] == "a symbolic link loop"
    assert reasons[str(raw / "cat" / "loop")].startswith("a link to a folder")
    assert manifest.source["skipped_entries"] == 5


# --- 3. no silent classes ------------------------------------------------------------------


def test_os_and_tool_folders_are_never_classes_and_labels_stay_right(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    litter = [
        "__MACOSX/cat/._0.jpg",
        "__MACOSX/._cat",
        ".git/objects/ab.jpg",
        "@eaDir/0.jpg/SYNOPHOTO_THUMB_M.jpg",
        ".ipynb_checkpoints/x.jpg",
        "__pycache__/y.jpg",
        "$RECYCLE.BIN/z.jpg",
        "System Volume Information/w.jpg",
        ".Trash-1000/files/v.jpg",
        "lost+found/u.jpg",
        "cat/._1.jpg",
        "cat/.DS_Store",
        "dog/Thumbs.db",
        "dog/desktop.ini",
    ]
    for name in litter:
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(jpeg(7))
    done = convert_child(str(raw), "--to", "wds", "--out", str(out))
    assert done.returncode == 0, done.stderr
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == CLASSES  # not __MACOSX as label 0
    samples = all_samples(out)
    assert len(samples) == len(real)
    for sample in samples:
        rel = dlpipe.unescape_key(sample["__key__"]) + ".jpg"
        assert sample["jpg"] == real[rel]
        assert CLASSES[int(sample["cls"])] == rel.split("/")[0]


def test_empty_class_folder_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    make_raw(raw)
    (raw / "bird").mkdir()
    (raw / "bird" / "notes.txt").write_text("no images here")
    assert main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]) == 2
    captured = capsys.readouterr()
    one_error_line(captured.out, captured.err, str(raw / "bird"), "--keep-empty-classes")
    assert not (out / "dlpipe.json").exists()
    assert (raw / "bird" / "notes.txt").exists()


def test_the_flag_the_error_names_converts_with_the_empty_class(tmp_path: Path, capsys) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    make_raw(raw)
    (raw / "bird").mkdir()
    args = ["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]
    assert main([*args, "--keep-empty-classes"]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and "bird" in captured.err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("bird", "cat", "dog")
    counts = [s.class_counts for s in manifest.splits.values()]
    assert all(c is not None and c[0] == 0 for c in counts)


def test_keep_empty_classes_keeps_the_label_with_a_warning(tmp_path: Path, caplog) -> None:
    raw = tmp_path / "raw"
    make_raw(raw)
    (raw / "bird").mkdir()
    with pytest.raises(SourceError, match="1 class folders hold no images"):
        ImageFolderSource(str(raw)).scan()
    with caplog.at_level("WARNING", logger="dlpipe"):
        scan = ImageFolderSource(str(raw), SourceOptions(keep_empty_classes=True)).scan()
    assert scan.classes == ("bird", "cat", "dog")
    assert {it.label for it in scan.items} == {1, 2}
    assert "bird" in caplog.text and "no images" in caplog.text


def test_a_prepared_dataset_inside_the_raw_folder_is_not_a_class(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    real = make_raw(raw)
    assert main(["convert", str(raw), "--to", "wds", "--out", str(tmp_path / "old")]) == 0
    os.rename(tmp_path / "old", raw / "old-wds")  # a user tidies the output into the raw data
    assert main(["convert", str(raw), "--to", "wds", "--out", str(tmp_path / "new")]) == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "new"))
    assert manifest.classes == CLASSES
    assert sum(s.samples for s in manifest.splits.values()) == len(real)
    assert manifest.source["skipped_examples"] == [
        {"path": str(raw / "old-wds"), "reason": "a prepared dataset (dlpipe.json), not a class"}
    ]


# --- 4. any file name works ----------------------------------------------------------------


def test_names_that_are_not_utf8_convert(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    real = make_raw(raw)
    rawb = os.fsencode(raw)
    os.mkdir(rawb + b"/\xff\xfeclass")
    for name, data in ((b"/\xff\xfeclass/1.jpg", jpeg(50)), (b"/cat/caf\xe9.jpg", jpeg(51))):
        with open(rawb + name, "wb") as f:
            f.write(data)
    done = convert_child(str(raw), "--to", "hdf5", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("\\xff\\xfeclass", "cat", "dog")
    by_key = {s["__key__"]: s for s in all_samples(out)}
    assert by_key["cat%2Fcaf%E9"]["jpg"] == jpeg(51)
    assert by_key["%FF%FEclass%2F1"]["cls"] == b"0"
    assert len(by_key) == len(real) + 2
    assert unescape_key("cat%2Fcaf%E9") == os.fsdecode(b"cat/caf\xe9")


def test_cjk_and_overlong_names_convert_with_stable_shortened_keys(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    make_raw(raw)
    long_names = ["猫" * 30, "猫" * 30 + "x", "a" * 240, "a" * 240 + "b"]  # pairs share prefixes
    for i, stem in enumerate(long_names):
        (raw / "cat" / f"{stem}.jpg").write_bytes(jpeg(60 + i))
    keys = []
    for run in ("first", "second"):
        out = tmp_path / run
        assert main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]) == 0
        keys.append(sorted(s["__key__"] for s in all_samples(out)))
    assert keys[0] == keys[1]  # stable across runs
    records = [json.loads(x) for x in (tmp_path / "first" / "keys.jsonl").read_text().splitlines()]
    assert sorted(r["original"] for r in records) == sorted(f"cat/{s}.jpg" for s in long_names)
    assert len(set(keys[0])) == len(make_raw(tmp_path / "count")) + 4
    scan = ImageFolderSource(str(raw)).scan()
    originals = {it.original: it for it in scan.items if it.original}
    assert set(originals) == {f"cat/{stem}.jpg" for stem in long_names}
    for item in originals.values():
        assert len(item.key) <= MAX_KEY_LENGTH and check_key(item.key) == item.key
        assert "." not in item.key and "/" not in item.key


# --- the shortening rule itself (dlpipe.sample.make_key) ------------------------------------


@pytest.mark.parametrize("text", ["cat/001", "ünï", "a" * 200, "%2D", "x-y"])
def test_make_key_leaves_short_keys_as_escape_key_makes_them(text: str) -> None:
    assert make_key(text) == (escape_key(text), False)


def test_make_key_shortens_deterministically_to_a_readable_prefix_and_a_hash() -> None:
    text = "路径/" * 40
    key, shortened = make_key(text)
    assert shortened and key == make_key(text)[0]
    assert len(key) <= MAX_KEY_LENGTH and check_key(key) == key
    prefix, _, digest = unescape_key(key).rpartition("-")
    assert text.startswith(prefix) and len(prefix) > 10  # whole characters, readable
    assert len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)


def test_shortened_keys_never_collide_with_each_other_or_with_plain_keys() -> None:
    texts = ["a" * 300 + str(i) for i in range(200)] + ["b" * 199 + "%2D" + "0" * 16]
    keys = [make_key(t)[0] for t in texts]
    assert len(set(keys)) == len(keys)
    assert all("%2D" in k for k in keys[:200])
    plain = [escape_key(t) for t in ["-", "a-b", "%2D", "x" * 150 + "-" * 40]]
    assert not any("%2D" in k for k in plain)  # "-" is never escaped: the mark is free


def test_make_key_handles_undecodable_bytes_and_refuses_only_empty_text() -> None:
    name = os.fsdecode(b"\xe9" * 150)
    key, shortened = make_key(name)
    assert shortened and check_key(key) == key
    assert make_key(os.fsdecode(b"caf\xe9")) == ("caf%E9", False)
    with pytest.raises(dlpipe.InvalidKeyError):
        make_key("")


# --- 5. tables: image paths stay inside the raw folder; table files are read bounded ----------


def test_table_image_paths_outside_the_folder_are_skipped_and_never_read(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "images").mkdir(parents=True)
    (raw / "images" / "ok.jpg").write_bytes(jpeg(1))
    secret = jpeg(2, side=30)
    (tmp_path / "secret.jpg").write_bytes(secret)
    os.symlink(tmp_path / "secret.jpg", raw / "images" / "link.jpg")
    rows = [
        "images/ok.jpg",
        "../secret.jpg",
        str(tmp_path / "secret.jpg"),
        "images/link.jpg",
        "/etc/passwd",
    ]
    text = "image,label\n" + "".join(f"{path},{i % 2}\n" for i, path in enumerate(rows))
    (raw / "labels.csv").write_text(text)
    done = convert_child(str(raw), "--to", "wds", "--out", str(out), "--source", "table")
    assert done.returncode == 0, done.stderr
    samples = all_samples(out)
    assert [s["jpg"] for s in samples] == [jpeg(1)]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 4
    assert all("outside the raw folder" in e["error"] for e in errors), errors
    assert not any(secret in s["jpg"] for s in samples)


@pytest.mark.parametrize("hostile", ["fifo", "dev_zero", "outside"])
def test_table_file_that_is_no_regular_file_inside_is_one_error_line(
    tmp_path: Path, hostile: str
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jpg").write_bytes(jpeg(1))
    (raw / "train.csv").write_text("image,label\na.jpg,0\n")
    (tmp_path / "elsewhere.csv").write_text("image,label\n/etc/hostname,0\n")
    target = raw / "val.csv"
    if hostile == "fifo":
        os.mkfifo(target)
    else:
        os.symlink("/dev/zero" if hostile == "dev_zero" else tmp_path / "elsewhere.csv", target)
    out = str(tmp_path / "out")
    done = convert_child(str(raw), "--to", "wds", "--out", out, "--source", "table")
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, "val.csv", "not a regular table file")
    assert not (tmp_path / "out" / "dlpipe.json").exists()


# --- cifar, mnist, files: every raw file they open is a regular file, read bounded -----------


def test_mnist_file_linked_to_dev_zero_or_a_gzip_bomb_is_refused(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    labels = struct.pack(">II", 0x801, 4) + bytes([0, 1, 2, 3])
    (raw / "train-labels-idx1-ubyte").write_bytes(labels)
    os.symlink("/dev/zero", raw / "train-images-idx3-ubyte")
    done = convert_child(str(raw), "--to", "wds", "--out", str(tmp_path / "o"), "--source", "mnist")
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, "train-images-idx3-ubyte")
    (raw / "train-images-idx3-ubyte").unlink()
    count = 40_000  # 40000 x 28 x 28 zeros: 31 MB from 31 KB of gzip, a 1000x ratio
    bomb = gzip.compress(struct.pack(">IIII", 0x803, count, 28, 28) + bytes(count * 784))
    (raw / "train-images-idx3-ubyte.gz").write_bytes(bomb)
    done = convert_child(str(raw), "--to", "wds", "--out", str(tmp_path / "o"), "--source", "mnist")
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, "train-images-idx3-ubyte.gz", "decompression bomb")


def test_cifar_batch_that_is_a_fifo_is_one_error_line(tmp_path: Path) -> None:
    folder = tmp_path / "raw" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "batches.meta")
    os.mkfifo(folder / "data_batch_1")
    done = convert_child(
        str(tmp_path / "raw"), "--to", "wds", "--out", str(tmp_path / "o"), "--source", "cifar"
    )
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, str(tmp_path / "raw"), "no CIFAR files")


def test_files_source_class_list_that_is_a_fifo_is_one_error_line(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(3):
        (raw / f"{i:04d}.jpg").write_bytes(jpeg(i))
        (raw / f"{i:04d}.cls").write_text(str(i % 2))
    os.mkfifo(raw / "classes.txt")
    done = convert_child(str(raw), "--to", "wds", "--out", str(tmp_path / "o"), "--source", "files")
    assert done.returncode == 2
    one_error_line(done.stdout, done.stderr, "classes.txt", "is a FIFO")


# --- 6. a folder that cannot be listed is one error line, not a silently missing class -------


@pytest.mark.parametrize("how", ["chmod", "denied"])
def test_unlistable_class_folder_is_one_error_line(
    tmp_path: Path, capsys, monkeypatch, how: str
) -> None:
    raw = tmp_path / "raw"
    make_raw(raw)
    locked = raw / "dog"
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root lists any folder whatever its mode (the 'denied' case covers it)")
        locked.chmod(0)
    else:  # as root: the kernel's answer for a folder we may not list, without chmod
        scandir = os.scandir

        def refusing_scandir(path: str) -> object:
            if os.fspath(path) == str(locked):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return scandir(path)

        monkeypatch.setattr(os, "scandir", refusing_scandir)
    try:
        code = main(["convert", str(raw), "--to", "wds", "--out", str(tmp_path / "o")])
    finally:
        locked.chmod(0o755)
        monkeypatch.undo()
    assert code == 2
    captured = capsys.readouterr()
    one_error_line(captured.out, captured.err, str(locked), "cannot be listed", "Permission")
    assert not (tmp_path / "o" / "dlpipe.json").exists()
