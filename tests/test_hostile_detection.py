"""Raw input crafted to break detection: MATLAB headers that claim gigabytes, table paths no file
can have, JSON nested thousands deep, and a disk-space refusal that must leave nothing behind.

Each case is driven as a user meets it (``dlpipe convert`` in-process, or a child with an
address-space limit where an unbounded allocation is the failure) and asserts the exit code,
the one ``error:`` line naming the file, or the skipped sample naming the row, and that the
good rows still convert.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import error_records, one_error
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.hf_metadata import MAX_DEPTH
from dlpipe.converters.matfile import read_struct_rows
from dlpipe.converters.source import SourceError
from dlpipe.converters.table_paths import MAX_JSON_DEPTH, MAX_PATH_BYTES, path_problem

MAT_CAP = 16 << 20  # the devkit reader's cap on meta.mat, as read and as inflated


def jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (10, 8), (seed * 53 % 256, 70, 160)).save(out, "JPEG")
    return out.getvalue()


def convert(raw: Path, out: Path, *flags: str) -> int:
    return main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *flags])


def train_samples(out: Path) -> list[dict]:
    return list(dlpipe.open_dataset(str(out), "train"))


# --- MATLAB files: every allocation bounded by the file and MATLAB's own limits -------------


def _element(kind: int, payload: bytes) -> bytes:
    return struct.pack("<II", kind, len(payload)) + payload + bytes(-len(payload) % 8)


def _mat(*elements: bytes) -> bytes:
    return b"MATLAB 5.0 MAT-file".ljust(116) + bytes(8) + b"\x00\x01IM" + b"".join(elements)


def _flags(matlab_class: int) -> bytes:
    return _element(6, struct.pack("<II", matlab_class, 0))


def _struct(dims: bytes, names: bytes, slot: int, fields: bytes = b"", dims_kind: int = 5) -> bytes:
    """A top-level ``synsets`` struct array: dimensions, field names in `slot`-byte slots, and
    the fields' elements."""
    body = (_flags(2) + _element(dims_kind, dims) + _element(1, b"synsets")
            + struct.pack("<HHi", 5, 4, slot) + _element(1, names) + fields)  # fmt: skip
    return _element(14, body)


def _char(text: bytes) -> bytes:
    body = _flags(4) + _element(5, struct.pack("<ii", 1, len(text))) + _element(1, b"")
    return _element(14, body + _element(16, text))


def _compressed(inflated_head: bytes, zeros: int) -> bytes:
    packer = zlib.compressobj(9)
    data = packer.compress(inflated_head)
    chunk = bytes(1 << 20)
    for _ in range(zeros >> 20):
        data += packer.compress(chunk)
    data += packer.flush()
    return struct.pack("<II", 15, len(data)) + data  # compressed elements are not padded


def _nested_cells(depth: int) -> bytes:
    """A 1x1 cell holding a 1x1 cell ... `depth` deep, around one char array."""
    inner = _char(b"deep")
    for _ in range(depth):
        body = _flags(1) + _element(5, struct.pack("<ii", 1, 1)) + _element(1, b"")
        inner = _element(14, body + inner)
    return inner


CRAFTED_MATS = {
    # the 200-byte file of the report: a struct of no fields claiming 2e9 elements
    "no-fields": (_mat(_struct(struct.pack("<ii", 2_000_000_000, 1), b"", 1)), "0 fields"),
    "huge-dims": (
        _mat(_struct(struct.pack("<ii", 2_000_000_000, 1), b"WNID".ljust(8, b"\0"), 8)),
        "cannot fit",
    ),
    "unsigned-dims-past-matlab": (
        _mat(
            _struct(
                struct.pack("<II", 0xFFFFFFFF, 0xFFFFFFFF), b"WNID".ljust(8, b"\0"), 8, dims_kind=6
            )
        ),
        "each 0..2147483647",
    ),
    "negative-dims": (
        _mat(_struct(struct.pack("<ii", -1, -2_000_000_000), b"WNID".ljust(8, b"\0"), 8)),
        "an array of dimensions [-1, -2000000000]",
    ),
    "nine-dims": (
        _mat(_struct(struct.pack("<9i", *([2] * 9)), b"WNID".ljust(8, b"\0"), 8)),
        "at most 8",
    ),
    "product-overflows": (
        _mat(_struct(struct.pack("<8i", *([2**31 - 1] * 8)), b"WNID".ljust(8, b"\0"), 8)),
        "cannot fit",
    ),
    "float-dims": (
        _mat(_struct(struct.pack("<dd", 1e300, 1.0), b"WNID".ljust(8, b"\0"), 8, dims_kind=9)),
        "not 32-bit integers",
    ),
    "element-size-overflows": (
        _mat(struct.pack("<II", 14, 0xFFFFFFFF) + bytes(64)),
        "runs",
    ),
    "small-element-too-big": (
        _mat(_element(14, struct.pack("<HH", 6, 0xFFFF) + bytes(12))),
        "a small element of 65535 bytes",
    ),
    "many-fields": (
        _mat(_struct(struct.pack("<ii", 1, 1), b"a" * 100_000, 1)),
        "a struct of 100000 fields",
    ),
    "zlib-bomb": (
        _mat(_compressed(struct.pack("<II", 14, (1 << 30) - 8), 1 << 30)),
        "decompresses past 16 MiB",
    ),
    "many-small-bombs": (
        _mat(*[_compressed(struct.pack("<II", 1, (6 << 20) - 8), 6 << 20)] * 4),  # each skipped
        "decompresses past 16 MiB",
    ),
    "damaged-compression": (_mat(_element(15, b"\x78\x9c" + b"\xff" * 40)), "damaged"),
}

BOUNDED = """
import json, resource, sys
from dlpipe.converters.matfile import read_struct_rows
from dlpipe.converters.source import SourceError
vm = int(next(x for x in open("/proc/self/status") if x.startswith("VmSize")).split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (192 << 20), vm + (192 << 20)))
for path in sys.argv[1:]:
    try:
        read_struct_rows(open(path, "rb").read(), path, "synsets", ("WNID",), 16 << 20)
        print(json.dumps([path, "read"]))
    except SourceError as exc:
        print(json.dumps([path, str(exc)]))
"""


def test_crafted_mat_headers_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    paths = []
    for name, (data, _) in CRAFTED_MATS.items():
        (tmp_path / f"{name}.mat").write_bytes(data)
        paths.append(str(tmp_path / f"{name}.mat"))
    assert len((tmp_path / "no-fields.mat").read_bytes()) == 200
    command = [sys.executable, "-c", textwrap.dedent(BOUNDED), *paths]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr
    results = dict(json.loads(line) for line in done.stdout.splitlines())
    for name, (_, expected) in CRAFTED_MATS.items():
        path = str(tmp_path / f"{name}.mat")
        message = results[path]
        assert message.startswith(f"{path}: not a readable MATLAB file ("), (name, message)
        assert expected in message, (name, message)


def test_a_crafted_meta_mat_is_one_error_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    from test_source_imagenet import DEVKIT_DATA, make_devkit

    raw = make_devkit(tmp_path / "raw")
    meta = raw / DEVKIT_DATA / "meta.mat"
    meta.write_bytes(CRAFTED_MATS["no-fields"][0])
    out = tmp_path / "out"
    assert convert(raw, out) == 2
    line = one_error(capsys)
    assert f"{meta}: not a readable MATLAB file (a struct of 0 fields" in line
    assert not out.exists()


def _nested_structs(depth: int) -> bytes:
    """A struct whose one field holds a struct ... `depth` deep, each claiming 2e9 elements."""
    inner = _char(b"deep")
    for _ in range(depth):
        dims = _element(5, struct.pack("<ii", 2_000_000_000, 1))
        names = struct.pack("<HHi", 5, 4, 8) + _element(1, b"inner\0\0\0")
        inner = _element(14, _flags(2) + dims + _element(1, b"") + names + inner)
    return inner


def test_deeply_nested_cells_and_structs_are_never_recursed_into() -> None:
    wnid = _char(b"n01440764")
    rows = read_struct_rows(
        _mat(
            _struct(
                struct.pack("<ii", 1, 2),
                b"WNID\0\0\0\0deep\0\0\0\0",
                8,
                wnid + _nested_cells(5000) + wnid + _nested_structs(5000),
            )
        ),
        "meta.mat",
        "synsets",
        ("WNID", "deep"),
        MAT_CAP,
    )
    assert rows == [("n01440764", None), ("n01440764", None)]


def test_other_variables_and_structs_are_skipped_unread() -> None:
    dims = _element(5, struct.pack("<ii", 2_000_000_000, 1))
    no_fields = struct.pack("<HHi", 5, 4, 1) + _element(1, b"")
    other = _element(14, _flags(2) + dims + _element(1, b"other") + no_fields)
    wanted = _struct(struct.pack("<ii", 1, 1), b"WNID".ljust(8, b"\0"), 8, _char(b"n01"))
    assert read_struct_rows(_mat(other, wanted), "m", "synsets", ("WNID",), MAT_CAP) == [("n01",)]
    with pytest.raises(SourceError, match="no 'synsets' struct"):
        read_struct_rows(_mat(other), "m", "synsets", ("WNID",), MAT_CAP)


def test_flowers_and_cars_mat_files_cap_what_all_variables_inflate_to(tmp_path: Path) -> None:
    """scipy's loadmat keeps every variable: many small bombs, each under the cap, are one."""
    sio = pytest.importorskip("scipy.io")
    from dlpipe.converters.splitlist_mat import load_mat

    variables = {f"v{i}": np.zeros((1, 6 << 20), np.uint8) for i in range(3)}
    sio.savemat(str(tmp_path / "setid.mat"), variables, do_compression=True)
    assert (tmp_path / "setid.mat").stat().st_size < 1 << 20
    with pytest.raises(SourceError, match="a variable inflates past 16 MiB"):
        load_mat(str(tmp_path), str(tmp_path / "setid.mat"))
    sio.savemat(str(tmp_path / "ok.mat"), {"v": np.zeros((1, 6 << 20), np.uint8)},
                do_compression=True)  # fmt: skip
    assert load_mat(str(tmp_path), str(tmp_path / "ok.mat"))["v"].size == 6 << 20


# --- table image paths: a path no file can have is a skipped sample -------------------------


def _table_raw(root: Path, bad: list[str], *, suffix: str = ".csv") -> Path:
    """Six good rows, then `bad` image paths, in a labels table beside ``images/``."""
    (root / "images").mkdir(parents=True)
    rows = []
    for i in range(6):
        (root / "images" / f"{i}.jpg").write_bytes(jpeg(i))
        rows.append((f"images/{i}.jpg", "cat" if i % 2 else "dog"))
    rows += [(path, "cat") for path in bad]
    if suffix == ".csv":
        text = "image,label\n" + "".join(f'"{p}",{label}\n' for p, label in rows)
        (root / "labels.csv").write_bytes(text.encode("utf-8", "surrogateescape"))
    else:
        lines = [json.dumps({"image": p, "label": label}) for p, label in rows]
        (root / "labels.jsonl").write_text("\n".join(lines) + "\n")
    return root


HOSTILE_PATHS = {
    "nul": ("images/1\0.jpg", "holds a NUL byte"),
    "nul-first": ("\0", "holds a NUL byte"),
    "over-long": ("images/" + "a" * 5000 + ".jpg", f"over the {MAX_PATH_BYTES}-byte limit"),
    "over-long-name": ("images/" + "b" * 300 + ".jpg", "cannot be read"),
    "control-bytes-missing": ("images/\x1b[2J\r\x07\x08\x7f\u009b\u202e.jpg", "cannot be read"),
    "dot-dot": ("../../secret.jpg", "outside the raw folder"),
    "absolute": ("/etc/passwd", "outside the raw folder"),
    "no-suffix-nul": ("images/0\0", "holds a NUL byte"),
}


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize("case", HOSTILE_PATHS)
def test_a_path_no_file_can_have_is_a_skipped_sample(tmp_path, capsys, case, suffix) -> None:
    path, reason = HOSTILE_PATHS[case]
    raw = _table_raw(tmp_path / "raw", [path], suffix=suffix)
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert len(train_samples(out)) == 6
    (record,) = error_records(out)
    assert f"labels{suffix} row 6" in record["error"] and reason in record["error"], record


def test_control_bytes_in_a_path_name_a_real_file(tmp_path: Path, capsys) -> None:
    name = "images/\x1b]0;title\x07\r\x08\u009b\u202e.jpg"
    raw = _table_raw(tmp_path / "raw", [name])
    (raw / name).write_bytes(jpeg(99))
    assert convert(raw, tmp_path / "out") == 0
    assert len(train_samples(tmp_path / "out")) == 7
    assert "\x1b" not in "".join(capsys.readouterr())


@pytest.mark.parametrize("bad", ["images/1\0.jpg", "/etc/passwd", "images/" + "a" * 5000])
def test_a_table_of_nothing_but_hostile_paths_is_one_error_line(tmp_path, capsys, bad) -> None:
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "labels.csv").write_text(
        "image,label\n" + "".join(f'"{bad}{i}",{i % 2}\n' for i in range(30))
    )
    assert convert(tmp_path / "raw", tmp_path / "out") == 2
    line = one_error(capsys)
    assert "labels.csv: 30 of the first 30 image paths name no file (row 0:" in line
    assert len(line) < 1000  # a 5000-character path is cut in the message


@pytest.mark.parametrize(
    ("table", "line"),
    [
        ("labels.csv", b'"images/\xff\xfe.jpg",cat'),  # bytes that are not UTF-8
        ("labels.jsonl", b'{"image": "images/\\ud800.jpg", "label": "cat"}'),  # lone high
        ("labels.jsonl", b'{"image": "images/\\udc80.jpg", "label": "cat"}'),  # lone low
        ("labels.jsonl", b'{"image": "images/\xff.jpg", "label": "cat"}'),
    ],
)
def test_table_text_that_is_not_unicode_is_one_error_line(tmp_path, capsys, table, line) -> None:
    suffix = os.path.splitext(table)[1]
    raw = _table_raw(tmp_path / "raw", [], suffix=suffix)
    with open(raw / table, "ab") as f:
        f.write(line + b"\n")
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"{raw / table}: cannot be read as {suffix[1:]}" in line or (
        f"{table}: column 'image' holds text that is not UTF-8" in line
    )
    assert not (tmp_path / "out").exists()


def test_path_problem_closes_the_class() -> None:
    assert path_problem("a\0b") and path_problem("\ud800.jpg") and path_problem("x" * 4097)
    for fine in ("a.jpg", "\udcff.jpg", "x" * 4096, "../a.jpg", "/abs.jpg", "\x1b.jpg", "日本.jpg"):
        assert path_problem(fine) is None, fine


def _parquet_with_bad_text(path: Path, column: str) -> None:
    good = pa.array([f"images/{i}.jpg" for i in range(6)] + ["images/0.jpg"])
    raw = pa.array([b"x"] * 6 + [b"bad \xff\xfe text"], pa.binary())
    bad = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    columns = {"image": good, "label": pa.array([0, 1, 0, 1, 0, 1, 0]), "note": good}
    columns[column] = bad
    pq.write_table(pa.table(columns), path)


def test_parquet_image_path_that_is_not_utf8_is_one_error_line(tmp_path: Path, capsys) -> None:
    raw = _table_raw(tmp_path / "raw", [])
    (raw / "labels.csv").unlink()
    _parquet_with_bad_text(raw / "labels.parquet", "image")
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert "labels.parquet: column 'image' holds text that is not UTF-8" in line


def test_parquet_extra_column_that_is_not_utf8_skips_its_row(tmp_path: Path, capsys) -> None:
    raw = _table_raw(tmp_path / "raw", [])
    (raw / "labels.csv").unlink()
    _parquet_with_bad_text(raw / "labels.parquet", "note")
    assert convert(raw, tmp_path / "out", "--on-error", "skip") == 0, capsys.readouterr().err
    assert "Traceback" not in "".join(capsys.readouterr())
    assert len(train_samples(tmp_path / "out")) == 6
    (record,) = error_records(tmp_path / "out")
    assert "labels.parquet row 6" in record["error"] and "cannot be read" in record["error"]


# --- JSON nested deeper than any table holds -------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _deep_table(root: Path, depth: int, layout: str) -> Path:
    """The labels table with a first line nested `depth` deep: alone (the line is an array),
    or as a column of the row beside ``images/``; returns what to convert."""
    raw = _table_raw(root, [], suffix=".jsonl")
    table = raw / "labels.jsonl"
    lines = table.read_text().splitlines()
    lines[0] = _nested(depth) if layout == "alone" else lines[0][:-1] + f', "x": {_nested(depth)}}}'
    table.write_text("\n".join(lines) + "\n")
    return table if layout == "alone" else raw


@pytest.mark.parametrize("layout", ["alone", "beside-images"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 5000])
def test_a_jsonl_table_nested_deep_is_one_error_line(tmp_path, capsys, layout, depth) -> None:
    assert convert(_deep_table(tmp_path / "raw", depth, layout), tmp_path / "out") == 2
    line = one_error(capsys)
    if depth + (layout == "beside-images") <= MAX_JSON_DEPTH:
        assert "nested deeper" not in line and "labels.jsonl" in line, line  # Arrow's error
    else:
        assert f"labels.jsonl line 1: JSON nested deeper than {MAX_JSON_DEPTH} levels" in line


def test_nesting_that_crashes_arrow_is_refused_before_it_reads(tmp_path: Path) -> None:
    """30,000 levels: Arrow's JSON reader recurses until the process dies (SIGSEGV)."""
    for layout in ("alone", "beside-images"):
        source = _deep_table(tmp_path / layout, 30_000, layout)
        command = [sys.executable, "-m", "dlpipe", "convert", str(source), "--to", "wds",
                   "--out", str(tmp_path / f"out-{layout}"), "--workers", "1"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        assert f"labels.jsonl line 1: JSON nested deeper than {MAX_JSON_DEPTH}" in done.stderr


def test_nesting_is_counted_per_line_and_outside_strings(tmp_path: Path, capsys) -> None:
    raw = _table_raw(tmp_path / "raw", [], suffix=".jsonl")
    table = raw / "labels.jsonl"
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    rows[0]["x"] = json.loads(_nested(MAX_JSON_DEPTH - 1))  # 64 levels with the row
    rows[1]["note"] = "[" * 10_000 + '\\"{' * 100  # brackets in a string are text
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert convert(raw, tmp_path / "out") == 0, capsys.readouterr().err
    assert len(train_samples(tmp_path / "out")) == 6
    rows[4]["x"] = json.loads(_nested(MAX_JSON_DEPTH))
    table.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert convert(raw, tmp_path / "out2") == 2
    assert "labels.jsonl line 5: JSON nested deeper" in one_error(capsys)


def test_a_jsonl_line_longer_than_arrow_reads_is_one_error_line(tmp_path, capsys) -> None:
    raw = _table_raw(tmp_path / "raw", [], suffix=".jsonl")
    table = raw / "labels.jsonl"
    lines = table.read_text().splitlines()
    lines[2] = lines[2][:-1] + ', "note": "' + "x" * (3 << 20) + '"}'
    table.write_text("\n".join(lines) + "\n")
    assert convert(raw, tmp_path / "out") == 2
    assert "labels.jsonl line 3: longer than 1 MiB" in one_error(capsys)
    lines[2] = lines[2][:-1][: 900 << 10] + '", "x": ' + _nested(5000) + "}"  # deep at its end
    table.write_text("\n".join(lines) + "\n")
    assert convert(raw, tmp_path / "out") == 2
    assert f"labels.jsonl line 3: JSON nested deeper than {MAX_JSON_DEPTH}" in one_error(capsys)


def test_a_deep_hugging_face_schema_note_is_ignored(tmp_path: Path, capsys) -> None:
    raw = _table_raw(tmp_path / "raw", [])
    (raw / "labels.csv").unlink()
    table = pa.table({"image": [f"images/{i}.jpg" for i in range(6)], "label": [0, 1] * 3})
    deep = '{"info": {"features": {"label": ' + _nested(5000) + "}}}"
    pq.write_table(table.replace_schema_metadata({"huggingface": deep}), raw / "train.parquet")
    assert convert(raw, tmp_path / "out") == 0, capsys.readouterr().err
    assert dlpipe.read_manifest(str(tmp_path / "out")).classes == ("0", "1")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 900, 5000])
def test_a_deep_metadata_jsonl_line_is_one_error_line(tmp_path: Path, capsys, depth) -> None:
    folder = tmp_path / "raw" / "train"
    folder.mkdir(parents=True)
    lines = []
    for i in range(4):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(folder / f"{i}.png")
        lines.append(json.dumps({"file_name": f"{i}.png", "text": f"caption {i}"}))
    lines[2] = lines[2][:-1] + f', "x": {_nested(depth - 1)}}}'
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    assert convert(tmp_path / "raw", tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"metadata.jsonl line 3: JSON nested deeper than {MAX_DEPTH} levels" in line


def test_metadata_file_names_no_file_can_have_are_skipped_samples(tmp_path, capsys) -> None:
    folder = tmp_path / "raw" / "train"
    folder.mkdir(parents=True)
    names = ["1\0.png", "2\ud800.png", "3" * 5000 + ".png", "../4.png", "/etc/passwd"]
    lines = []
    for i in range(4):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(folder / f"{i}.png")
        lines.append(json.dumps({"file_name": f"{i}.png", "text": f"caption {i}"}))
    lines += [json.dumps({"file_name": name, "text": "bad"}) for name in names]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    assert convert(tmp_path / "raw", tmp_path / "out") == 0, capsys.readouterr().err
    assert "Traceback" not in "".join(capsys.readouterr())
    assert len(train_samples(tmp_path / "out")) == 4
    skipped = sorted(r["error"].split(" (", 1)[0] for r in error_records(tmp_path / "out"))
    assert skipped == [f"train/metadata.jsonl line {n}" for n in range(5, 10)]


def test_a_metadata_parquet_whose_text_is_not_utf8_is_one_error_line(tmp_path, capsys) -> None:
    folder = tmp_path / "raw" / "train"
    folder.mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(folder / "0.png")
    raw = pa.array([b"0.png", b"\xff.png"], pa.binary())
    names = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())
    pq.write_table(pa.table({"file_name": names, "text": ["a", "b"]}), folder / "metadata.parquet")
    assert convert(tmp_path / "raw", tmp_path / "out") == 2
    assert "train/metadata.parquet: holds text that is not UTF-8" in one_error(capsys)


# --- the disk-space refusal leaves nothing it created ----------------------------------------


@pytest.fixture
def no_free_space(monkeypatch):
    monkeypatch.setattr(
        dlpipe.storage.shutil, "disk_usage", lambda p: SimpleNamespace(total=1, used=1, free=0)
    )


def test_disk_space_refusal_leaves_no_folder_it_made(tmp_path, capsys, no_free_space) -> None:
    raw = _table_raw(tmp_path / "raw", [])
    out = tmp_path / "new" / "deeper" / "out"
    assert convert(raw, out) == 2
    assert "free" in one_error(capsys)
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_disk_space_refusal_in_an_empty_folder_leaves_it_empty(
    tmp_path, capsys, no_free_space
) -> None:
    raw = _table_raw(tmp_path / "raw", [])
    out = tmp_path / "out"
    out.mkdir()
    assert convert(raw, out) == 2
    assert "free" in one_error(capsys)
    assert out.is_dir() and list(out.iterdir()) == []


def test_disk_space_refusal_keeps_a_folder_someone_else_writes_to(
    tmp_path, capsys, no_free_space, monkeypatch
) -> None:
    """A file that appears in the new folder while the run refuses keeps it (and its lock)."""
    from dlpipe.converters import engine

    raw = _table_raw(tmp_path / "raw", [])
    out = tmp_path / "out"
    real = engine.check_disk

    def check(folder: str, estimated: int) -> None:
        (Path(folder) / "notes.txt").write_text("mine")
        real(folder, estimated)

    monkeypatch.setattr(engine, "check_disk", check)
    assert convert(raw, out) == 2
    assert "free" in one_error(capsys)
    assert sorted(os.listdir(out)) == [".dlpipe-lock", "notes.txt"]
