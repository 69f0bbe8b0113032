"""The duplicate and leakage audit during convert's decode check, and ``--dedup``."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter
from test_source_table_layouts import convert

import dlpipe
from dlpipe.converters.audit import (
    NEAR_BITS,
    Fingerprint,
    dhash,
    find_duplicates,
    kept_and_dropped,
)
from dlpipe.converters.engine import ConvertConfig, plan_conversion
from dlpipe.converters.source import SampleError
from dlpipe.converters.worker import audit_task, image_reader


def picture(seed: int, size=(96, 72)) -> Image.Image:
    """A smooth random picture (blurred noise): different seeds give unrelated hashes."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize(size, Image.Resampling.BICUBIC)


def encoded(image: Image.Image, fmt: str = "JPEG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def test_dhash_matches_the_imagehash_definition() -> None:
    image = picture(1)
    small = np.asarray(image.convert("L").resize((9, 8), Image.Resampling.LANCZOS), dtype=int)
    bits = (small[:, 1:] > small[:, :-1]).flatten()
    assert dhash(image) == int("".join("1" if b else "0" for b in bits), 2)


def test_near_copies_are_within_the_threshold_and_other_pictures_are_not() -> None:
    base = picture(7)
    copies = [
        base.resize((48, 36)),
        Image.open(io.BytesIO(encoded(base, quality=40))),
        base.filter(ImageFilter.GaussianBlur(0.6)),
    ]
    for copy in copies:
        assert (dhash(copy) ^ dhash(base)).bit_count() <= NEAR_BITS
    others = [(dhash(picture(s)) ^ dhash(base)).bit_count() for s in range(100, 140)]
    assert min(others) > NEAR_BITS


def random_prints(count: int, seed: int) -> list[Fingerprint]:
    rng = random.Random(seed)
    return [Fingerprint("train", f"k{i:05d}", 1000 + i, rng.getrandbits(64)) for i in range(count)]


def test_find_duplicates_agrees_with_comparing_every_pair() -> None:
    prints = random_prints(400, seed=3)
    rng = random.Random(4)
    for i in range(0, 60, 3):  # near copies: flip up to NEAR_BITS + 2 bits
        flips = rng.sample(range(64), rng.randint(1, NEAR_BITS + 2))
        h = prints[i].dhash
        for bit in flips:
            h ^= 1 << bit
        prints.append(Fingerprint("val", f"n{i:05d}", 5000 + i, h))
    linked = {
        frozenset({(a.split, a.key), (b.split, b.key)})
        for x, a in enumerate(prints)
        for b in prints[x + 1 :]
        if (a.dhash ^ b.dhash).bit_count() <= NEAR_BITS
    }
    groups = find_duplicates(prints, read=lambda p: pytest.fail("sizes differ: never read"))
    in_group = {m: g for g in groups for m in g.members}
    for pair in linked:  # every close pair shares a group, every group is linked pairs
        a, b = tuple(pair)
        assert in_group[a] is in_group[b]
    assert sum(len(g.members) - 1 for g in groups) <= len(linked)
    assert groups and all(g.kind == "near" for g in groups)  # sizes differ: never read


def test_exact_copies_are_confirmed_by_their_bytes_and_only_candidates_are_read() -> None:
    files = {
        "a": b"same bytes", "b": b"same bytes",  # one size, one hash, one content
        "c": b"one content", "d": b"two content",  # one size, one hash, other bytes
        "e": b"short", "f": b"longer file",  # one hash, other sizes
        "g": b"unrelated",
    }  # fmt: skip
    far = [0, 0x00FF00FF00FF00FF, 0xF0F0F0F0F0F0F0F0, 2**64 - 1]  # 32 bits apart
    hashes = dict(zip("abcdefg", [far[0], far[0], far[1], far[1], far[2], far[2], far[3]]))
    prints = [Fingerprint("train", k, len(v), hashes[k]) for k, v in files.items()]
    read: list[str] = []

    def reader(p: Fingerprint) -> bytes:
        read.append(p.key)
        return files[p.key]

    groups = find_duplicates(prints, read=reader)
    kinds = {tuple(k for _, k in g.members): g.kind for g in groups}
    assert kinds == {("a", "b"): "exact", ("c", "d"): "near", ("e", "f"): "near"}
    assert sorted(read) == ["a", "b", "c", "d"]


def test_a_candidate_that_cannot_be_read_again_is_not_called_an_exact_copy() -> None:
    prints = [Fingerprint("train", k, 10, 7) for k in ("a", "b")]

    def gone(p: Fingerprint) -> bytes:
        raise SampleError(f"{p.key}: cannot be read (No such file or directory)")

    assert [g.kind for g in find_duplicates(prints, read=gone)] == ["near"]


def test_the_shard_tasks_fingerprints_give_the_groups_read_again(tmp_path) -> None:
    raw = leaky_folders(tmp_path / "raw")
    planned = plan_conversion(ConvertConfig.from_options(str(raw), "wds", out=str(tmp_path / "o")))
    tasks = planned.plan.tasks
    prints = [
        Fingerprint(t.split, *f)
        for t in tasks
        for f in audit_task(planned.source, t, planned.worker).fingerprints
    ]
    groups = find_duplicates(prints, read=image_reader(planned.source, tasks))
    assert [(g.kind, g.members) for g in groups] == [
        ("near", (("train", "cat%2Ft0"), ("val", "cat%2Fv0"))),
        ("exact", (("train", "dog%2Ft0"), ("train", "dog%2Ft1"))),
    ]


def test_dedup_keeps_the_evaluation_copy() -> None:
    files = {"a": b"1" * 64, "b": b"1" * 64, "c": b"1" * 64, "d": b"2" * 64, "e": b"2" * 64}
    hashes = {"a": 0, "b": 0, "c": 0, "d": 2**64 - 1, "e": 2**64 - 1}
    splits = {"a": "train", "b": "val", "c": "test", "d": "train", "e": "train"}
    prints = [Fingerprint(splits[k], k, 64, hashes[k]) for k in files]
    groups = find_duplicates(prints, read=lambda p: files[p.key])
    assert [g.kind for g in groups] == ["exact", "exact"]
    kept, dropped = kept_and_dropped(groups)
    assert kept == [("val", "b"), ("train", "d")]
    assert sorted(dropped) == [("test", "c"), ("train", "a"), ("train", "e")]


def leaky_folders(root: Path) -> Path:
    """train/ and val/ class folders where val/cat/v0 is train/cat/t0 re-encoded (leakage),
    train/dog/t1 the same bytes as train/dog/t0, and everything else unrelated."""
    for split, cls, name, image, params in [
        ("train", "cat", "t0", picture(1), {"quality": 95}),
        ("train", "cat", "t2", picture(2), {"quality": 95}),
        ("train", "dog", "t0", picture(3), {"quality": 95}),
        ("train", "dog", "t1", picture(3), {"quality": 95}),
        ("train", "dog", "t3", picture(4), {"quality": 95}),
        ("val", "cat", "v0", picture(1).resize((80, 60)), {"quality": 60}),
        ("val", "dog", "v1", picture(5), {"quality": 95}),
    ]:
        (root / split / cls).mkdir(parents=True, exist_ok=True)
        (root / split / cls / f"{name}.jpg").write_bytes(encoded(image, **params))
    return root


def test_convert_reports_duplicates_and_leakage_and_writes_them_all(tmp_path) -> None:
    raw = leaky_folders(tmp_path / "raw")
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    report = manifest.source["duplicates"]
    assert {k: report[k] for k in ("audited", "groups", "exact", "near", "leaking", "dropped")} == {
        "audited": 7, "groups": 2, "exact": 1, "near": 1, "leaking": 1, "dropped": 0
    }  # fmt: skip
    assert manifest.splits["train"].samples == 5 and manifest.splits["val"].samples == 2
    lines = [json.loads(x) for x in (tmp_path / "out" / "duplicates.jsonl").open()]
    assert lines == [
        {
            "kind": "near",
            "splits": ["train", "val"],
            "samples": [{"split": "train", "key": "cat%2Ft0"}, {"split": "val", "key": "cat%2Fv0"}],
        },
        {
            "kind": "exact",
            "splits": ["train"],
            "samples": [
                {"split": "train", "key": "dog%2Ft0"},
                {"split": "train", "key": "dog%2Ft1"},
            ],
        },
    ]


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_dedup_drops_the_copies_keeping_the_val_one(tmp_path, fmt) -> None:
    raw = leaky_folders(tmp_path / "raw")
    out = tmp_path / "out"
    args = ["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "2", "--dedup"]
    assert dlpipe.cli.main(args) == 0
    manifest = dlpipe.read_manifest(str(out))
    train = sorted(s["__key__"] for s in dlpipe.open_dataset(str(out), "train"))
    val = sorted(s["__key__"] for s in dlpipe.open_dataset(str(out), "val"))
    assert train == ["cat%2Ft2", "dog%2Ft0", "dog%2Ft3"] and val == ["cat%2Fv0", "dog%2Fv1"]
    report = manifest.source["duplicates"]
    assert (report["dropped"], report["leaking"], report["audited"]) == (2, 1, 7)
    assert manifest.options["dedup"] is True
    lines = [json.loads(x) for x in (out / "duplicates.jsonl").open()]
    assert [line["kept"] for line in lines] == [
        {"split": "val", "key": "cat%2Fv0"},
        {"split": "train", "key": "dog%2Ft0"},
    ]


def test_a_dataset_without_duplicates_reports_none_and_writes_no_list(tmp_path) -> None:
    raw = tmp_path / "raw"
    for i in range(6):
        (raw / ("a" if i % 2 else "b")).mkdir(parents=True, exist_ok=True)
        (raw / ("a" if i % 2 else "b") / f"{i}.jpg").write_bytes(encoded(picture(20 + i)))
    assert convert(raw, tmp_path / "out") == 0
    report = dlpipe.read_manifest(str(tmp_path / "out")).source["duplicates"]
    assert (report["groups"], report["audited"]) == (0, 6)
    assert not (tmp_path / "out" / "duplicates.jsonl").exists()


def test_the_summary_and_inspect_name_the_duplicates_and_the_leak(tmp_path, capsys) -> None:
    raw = leaky_folders(tmp_path / "raw")
    assert convert(raw, tmp_path / "out") == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "source: imagefolder" in printed
    leak = "duplicates: 1 exact and 1 near duplicates, 1 groups across splits (leakage)"
    assert f"{leak} (listed in duplicates.jsonl; --dedup drops them)" in printed
    assert dlpipe.cli.main(["inspect", str(tmp_path / "out")]) == 0
    assert leak in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("junk", ["many", [1, 2], {"groups": "2", "exact": -1}, None])
def test_inspect_shows_no_audit_line_for_a_malformed_report(tmp_path, capsys, junk) -> None:
    raw = leaky_folders(tmp_path / "raw")
    assert convert(raw, tmp_path / "out") == 0
    path = tmp_path / "out" / "dlpipe.json"
    manifest = json.loads(path.read_text())
    manifest["source"]["duplicates"] = junk
    manifest["source"]["unused"] = junk
    path.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert dlpipe.cli.main(["inspect", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "leakage" not in out and "Traceback" not in out


def test_convert_names_its_layout_and_counts_what_it_did_not_use(tmp_path, capsys) -> None:
    raw = leaky_folders(tmp_path / "raw")
    (raw / "train" / "cat" / "notes.json").write_text("{}")
    (raw / "train" / "dog" / "Thumbs.txt").write_text("x")
    (raw / "train" / "dog" / "clip.mp4").write_bytes(b"\0")
    assert convert(raw, tmp_path / "out") == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "source: imagefolder: its sub-folders read as class folders of images" in printed
    assert "not used: 2 annotation files, 1 other" in printed
    source = dlpipe.read_manifest(str(tmp_path / "out")).source
    assert source["unused"] == {"annotation files": 2, "other": 1}
