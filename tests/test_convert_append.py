"""``dlpipe convert NEW_RAW --out DATASET --append`` as a user runs it: a new version of new
shards only, verified and read whole; key clashes, copies and other options refused or reported;
a kill mid-append leaves the old version readable and ``--resume`` finishes it; a loader state
of the old version is refused on the new one, and goes on where ``dataset_version`` asks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest import one_error
from convert_hold import ConvertHold

import dlpipe
from dlpipe.cli import main
from dlpipe.loading.state import StateMismatchError
from dlpipe.manifest import DatasetVersionError, parse_manifest
from dlpipe.synthetic import SHAPE_CLASSES, synthetic_samples, write_imagefolder

DLPIPE = str(Path(sys.executable).parent / "dlpipe")
FORMATS = ("lmdb", "hdf5", "wds")


def make_raw(root: Path, count: int, start: int, *, classes: Iterable[int] | None = None) -> Path:
    """An ImageFolder of `count` shapes numbered from `start` (keys ``<class>_<number>``),
    every fourth in val; with `classes`, only the samples of those labels."""
    wanted = set(range(len(SHAPE_CLASSES)) if classes is None else classes)
    pairs = [
        ("val" if i % 4 == 3 else "train", s)
        for i, s in enumerate(synthetic_samples(count, seed=1, start=start))
        if int(s["cls"]) in wanted
    ]
    write_imagefolder(str(root), pairs)
    return root


def convert(raw: Path, out: Path, *flags: str, fmt: str = "lmdb") -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *flags])


def keys(out: Path, split: str = "train", **config: object) -> list[str]:
    loader_config = dlpipe.LoaderConfig(
        batch_size=4, transform=None, shuffle=False, drop_last=False, **config
    )
    loader = dlpipe.make_loader(str(out), split, loader_config, workers=0)
    return [str(sample["__key__"]) for batch in loader for sample in batch]


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_adds_a_version_of_new_shards_that_verifies_and_reads_whole(
    tmp_path, capsys, fmt
) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 16, 0), out, fmt=fmt) == 0
    before = files(out)
    first = {split: keys(out, split) for split in ("train", "val")}
    capsys.readouterr()
    assert convert(make_raw(tmp_path / "raw2", 16, 100), out, "--append", fmt=fmt) == 0
    assert "appended version 2" in capsys.readouterr().out
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.version == 2
    added = manifest.versions[1]
    suffix = {"lmdb": ".lmdb", "hdf5": ".h5", "wds": ".tar"}[fmt]
    assert added.splits["train"].shards == (f"train-000001{suffix}",)
    assert added.splits["val"].shards == (f"val-000001{suffix}",)
    assert added.appended_to is not None and added.date is not None
    assert (added.splits["train"].samples, added.splits["val"].samples) == (12, 4)
    for name, data in before.items():  # nothing of version 1 was rewritten
        if name != "dlpipe.json":
            assert (out / name).read_bytes() == data, name
    assert dlpipe.verify_dataset(str(out), decode=True).ok
    assert main(["verify", str(out)]) == 0
    train = keys(out)
    assert len(train) == 24 and train[:12] == first["train"]
    assert {k.rsplit("_", 1)[1] for k in train[12:]} == {
        f"{i:06d}" for i in range(100, 116) if i % 4 != 3
    }
    assert len(keys(out, "val")) == 8
    assert keys(out, dataset_version=1) == first["train"]


def test_a_dataset_converted_before_versions_reads_as_version_1(tmp_path) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    data = json.loads((out / "dlpipe.json").read_text())
    assert "version" not in data and "versions" not in data  # a one-version manifest is as before
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.version == 1 and manifest.versions == ()
    assert [r.version for r in manifest.version_records()] == [1]
    with pytest.raises(DatasetVersionError, match="versions 1..1"):
        manifest.at_version(2)


def _appended(tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    assert convert(make_raw(tmp_path / "raw2", 8, 100), out, "--append") == 0
    return out, json.loads((out / "dlpipe.json").read_text())


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: d["versions"].pop(), "not a list of 2 records"),
        (lambda d: d["versions"][1].update(version=3), "versions[1].version is not 2"),
        (lambda d: d["versions"][1].update(date="yesterday"), "is not YYYY-MM-DDTHH:MM:SSZ"),
        (lambda d: d["versions"][1].pop("appended_to"), "appended_to must be given"),
        (lambda d: d["versions"][1].update(appended_to="x" * 64), "is not 64 hex digits"),
        (lambda d: d["versions"][1]["splits"]["train"].update(samples=99), "its shards hold"),
        (
            lambda d: d["versions"][0]["splits"]["train"].update(
                shards=d["versions"][1]["splits"]["train"]["shards"]
            ),
            "not, in order, the shards its versions added",
        ),
        (
            lambda d: d["versions"][1]["splits"]["train"]["shards"].append("train-000009.lmdb"),
            "not, in order, the shards its versions added",
        ),
        (lambda d: d.update(version=1), "'versions' is given but 'version' is 1"),
        (lambda d: d.update(version=True), "'version' True is not an integer"),
    ],
)
def test_the_version_records_are_checked_as_untrusted_input(tmp_path, change, reason) -> None:
    _, data = _appended(tmp_path)
    parse_manifest(json.dumps(data).encode(), "dlpipe.json")  # the control: it parses
    change(data)
    with pytest.raises(dlpipe.ManifestError, match="not a valid dlpipe manifest") as caught:
        parse_manifest(json.dumps(data).encode(), "dlpipe.json")
    assert reason in str(caught.value)


def test_a_key_clash_is_one_error_line_and_nothing_is_written(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    before = files(out)
    raw2 = make_raw(tmp_path / "raw2", 8, 0)  # the same keys
    clash = raw2 / "train" / SHAPE_CLASSES[0] / f"{SHAPE_CLASSES[0]}_000000.jpg"
    clash.write_bytes(next(synthetic_samples(1, seed=7))["jpg"])  # other bytes under one key
    capsys.readouterr()
    assert convert(raw2, out, "--append") == 2
    line = one_error(capsys)
    assert "key 'bars%2Fbars_000000' of split 'train'" in line or "of split 'train'" in line
    assert "version 1, shard train-000000.lmdb" in line
    assert str(raw2) in line and "rename or remove the new file" in line
    assert files(out) == before


def _copies(tmp_path: Path) -> Path:
    """A raw folder of 4 exact copies of raw1's samples under new keys, and 4 new samples."""
    raw3 = make_raw(tmp_path / "raw3", 8, 200)
    originals = make_raw(tmp_path / "copies", 4, 0)
    for path in sorted(originals.rglob("*.jpg")):
        target = raw3 / path.relative_to(originals)
        target.with_name("copy_" + path.name).write_bytes(path.read_bytes())
    return raw3


def _duplicates(out: Path) -> list[dict]:
    lines = (out / "duplicates.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("of_existing")]


def test_exact_copies_of_the_datasets_samples_are_reported(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    capsys.readouterr()
    assert convert(_copies(tmp_path), out, "--append") == 0
    assert "4 new samples are exact copies of samples the dataset holds" in capsys.readouterr().out
    copies = _duplicates(out)
    assert len(copies) == 4 and all(r["version"] == 2 for r in copies)
    first = copies[0]["samples"]
    assert first[0]["version"] == 1 and first[1]["version"] == 2
    assert first[1]["key"] == first[0]["key"].replace("%2F", "%2Fcopy_")
    assert len(keys(out)) + len(keys(out, "val")) == 8 + 12


def test_dedup_leaves_out_exact_copies_of_the_datasets_samples(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    capsys.readouterr()
    assert convert(_copies(tmp_path), out, "--append", "--dedup") == 0
    assert "--dedup left them out" in capsys.readouterr().out
    copies = _duplicates(out)
    assert len(copies) == 4 and all(r["kept"]["version"] == 1 for r in copies)
    every = keys(out) + keys(out, "val")
    assert len(every) == 8 + 8 and not any("copy_" in k for k in every)
    assert dlpipe.read_manifest(str(out)).versions[1].source["duplicates"]["of_existing"] == 4
    assert convert(make_raw(tmp_path / "again", 8, 0), out, "--append", "--dedup") == 2
    assert "every new sample is an exact copy" in one_error(capsys)


@pytest.mark.parametrize(
    ("flags", "named", "fix"),
    [
        (["--to", "wds"], "--to is 'wds' in this run, but", "pass --to lmdb"),
        (["--max-side", "32"], "--max-side is 32 in this run", "leave out --max-side"),
        (["--quality", "50"], "--quality is 50 in this run", "pass --quality 95"),
        (["--seekable-jpeg"], "--seekable-jpeg is True", "leave out --seekable-jpeg"),
    ],
)
def test_other_options_are_refused_naming_both_values(tmp_path, capsys, flags, named, fix) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    before = files(out)
    capsys.readouterr()
    argv = ["convert", str(make_raw(tmp_path / "raw2", 8, 100)), "--out", str(out)]
    to = [] if "--to" in flags else ["--to", "lmdb"]
    assert main([*argv, *to, *flags, "--append", "--workers", "1"]) == 2
    line = one_error(capsys)
    assert named in line and "was made with" in line and fix in line
    assert files(out) == before


def test_unlabelled_samples_are_refused_on_a_labelled_dataset(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    raw = tmp_path / "flat"
    raw.mkdir()
    for i, sample in enumerate(synthetic_samples(4, seed=2, start=300)):
        (raw / f"{i:04d}.jpg").write_bytes(sample["jpg"])
    capsys.readouterr()
    assert convert(raw, out, "--append", "--source", "files") == 2
    assert "have no labels, the dataset's split labels" in one_error(capsys)


def test_new_classes_go_at_the_end_and_old_labels_keep_their_index(tmp_path) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 16, 0, classes=[2, 3]), out) == 0
    old = dlpipe.read_manifest(str(out)).classes
    assert convert(make_raw(tmp_path / "raw2", 16, 100, classes=[1, 3]), out, "--append") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes[: len(old)] == old
    assert manifest.classes == (*old, SHAPE_CLASSES[1])
    labels = {}
    for sample in dlpipe.open_dataset(str(out), "train"):
        name = str(sample["__key__"]).split("%2F")[0]
        labels.setdefault(name, set()).add(int(sample["cls"]))
    assert labels == {name: {manifest.classes.index(name)} for name in labels}
    train = manifest.splits["train"]
    assert train.class_counts is not None and sum(train.class_counts) == train.samples
    assert dlpipe.verify_dataset(str(out), decode=True).ok


def test_append_needs_a_finished_dataset_and_refuses_overwrite(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", 8, 0)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    assert convert(raw, empty, "--append") == 2
    line = one_error(capsys)
    assert "--append adds to a finished dataset" in line and "not a dlpipe dataset" in line
    assert sorted(os.listdir(empty)) == ["notes.txt"]
    assert convert(raw, tmp_path / "missing", "--append") == 2
    assert "not a dlpipe dataset" in one_error(capsys)
    assert not (tmp_path / "missing").exists()
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    capsys.readouterr()
    assert convert(raw, out, "--append", "--overwrite") == 2
    assert "--append and --overwrite contradict each other" in one_error(capsys)


def test_resume_of_an_append_that_is_not_unfinished_is_one_error_line(tmp_path, capsys) -> None:
    out, _ = _appended(tmp_path)
    raw2 = tmp_path / "raw2"
    capsys.readouterr()
    assert convert(raw2, out, "--append", "--resume") == 2
    assert "holds no unfinished append to resume" in one_error(capsys)
    manifest = dlpipe.read_manifest(str(out))
    journal = out / ".dlpipe-journal"  # as a kill after the manifest's rename leaves it
    journal.mkdir()
    plan = {"fingerprint": "f", "options": {"append_to": manifest.versions[1].appended_to}}
    (journal / "plan.json").write_text(json.dumps(plan))
    assert convert(raw2, out, "--append", "--resume") == 2
    assert "finished as version 2; nothing to resume" in one_error(capsys)
    assert convert(make_raw(tmp_path / "raw3", 8, 200), out, "--append") == 0
    assert not journal.exists() and dlpipe.read_manifest(str(out)).version == 3


def _hold_an_append(tmp_path: Path, out: Path, args: list[str]) -> None:
    """Start an append of one sample per shard and kill -9 it after its first shard."""
    ConvertHold(tmp_path / "hold").kill_after_first_shard([DLPIPE, "convert", *args, "--append"])
    assert len(list((out / ".dlpipe-journal").glob("train-*.json"))) == 1


@pytest.mark.slow
def test_kill_9_mid_append_leaves_version_1_readable_and_resume_finishes(tmp_path) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    manifest_bytes = (out / "dlpipe.json").read_bytes()
    first = keys(out)
    raw2 = make_raw(tmp_path / "raw2", 8, 100)
    args = [str(raw2), "--to", "lmdb", "--out", str(out), "--shard-size", "1", "--workers", "1"]
    _hold_an_append(tmp_path, out, args)
    assert (out / "dlpipe.json").read_bytes() == manifest_bytes  # still version 1, whole
    assert keys(out) == first and dlpipe.read_manifest(str(out)).version == 1
    problems = dlpipe.verify_dataset(str(out)).problems  # the one new shard, named for what it is
    assert len(problems) == 1 and "unfinished dlpipe convert --append" in problems[0].message
    done = subprocess.run(
        [DLPIPE, "convert", *args, "--append", "--resume"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "resumed 1 finished shards" in done.stdout
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.version == 2 and not (out / ".dlpipe-journal").exists()
    assert dlpipe.verify_dataset(str(out)).ok
    assert len(keys(out)) == 12 and keys(out)[:6] == first


@pytest.mark.slow
def test_a_new_append_after_a_killed_one_deletes_its_unlisted_shards(tmp_path) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 8, 0), out) == 0
    raw2 = make_raw(tmp_path / "raw2", 8, 100)
    args = [str(raw2), "--to", "lmdb", "--out", str(out), "--shard-size", "1", "--workers", "1"]
    _hold_an_append(tmp_path, out, args)
    left = {p.name for p in out.glob("train-*.lmdb")} - {"train-000000.lmdb"}
    assert len(left) == 1
    (out / "mine-000001.lmdb").write_text("a user's file")
    done = subprocess.run([DLPIPE, "convert", *args, "--append"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "deleted 1 shards of an unfinished append" in done.stdout
    assert (out / "mine-000001.lmdb").read_text() == "a user's file"
    assert dlpipe.read_manifest(str(out)).version == 2
    assert len(keys(out)) == 12


def test_a_version_1_loader_state_is_refused_on_version_2_and_goes_on_when_asked(
    tmp_path,
) -> None:
    out = tmp_path / "out"
    assert convert(make_raw(tmp_path / "raw1", 16, 0), out) == 0
    config = dlpipe.LoaderConfig(batch_size=4, transform=None, seed=3)

    def loader(**fields: object) -> dlpipe.PreparedLoader:
        return dlpipe.make_loader(str(out), "train", config.replace(**fields), workers=0)

    reference = loader()
    batches = iter(reference)
    next(batches)
    state = reference.state_dict()
    assert state["dataset_version"] == 1
    rest = [[s["__key__"] for s in batch] for batch in batches]
    assert convert(make_raw(tmp_path / "raw2", 16, 100), out, "--append") == 0
    latest = loader()
    with pytest.raises(StateMismatchError, match="taken on version 1") as caught:
        latest.load_state_dict(state)
    assert "reads version 2" in str(caught.value) and "dataset_version=1" in str(caught.value)
    pinned = loader(dataset_version=1)
    pinned.load_state_dict(state)
    assert [[s["__key__"] for s in batch] for batch in pinned] == rest
    assert loader(dataset_version=2).state_dict()["dataset_version"] == 2
    with pytest.raises(DatasetVersionError, match="versions 1..2"):
        loader(dataset_version=3)


def test_a_reader_open_during_an_append_reads_on_but_not_across_an_overwrite(tmp_path) -> None:
    out = tmp_path / "out"
    raw1 = make_raw(tmp_path / "raw1", 8, 0)
    assert convert(raw1, out, "--shard-size", "1") == 0  # one sample a shard: each read opens one
    dataset = dlpipe.open_dataset(str(out), "train")
    first = dataset[0]["__key__"]
    assert convert(make_raw(tmp_path / "raw2", 8, 100), out, "--append") == 0
    assert [s["__key__"] for s in dataset][:1] == [first] and len(list(dataset)) == 6  # v1
    assert convert(raw1, out, "--overwrite") == 0
    with pytest.raises(dlpipe.DatasetChangedError, match="replaced or removed"):
        list(dataset)


@pytest.mark.slow
def test_an_append_on_ray_writes_the_shards_a_local_one_does(tmp_path) -> None:
    pytest.importorskip("ray")
    raw1, raw3 = make_raw(tmp_path / "raw1", 8, 0), _copies(tmp_path)
    shards = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        assert convert(raw1, out, fmt="hdf5") == 0
        flags = ["--append", "--dedup", "--engine", engine, "--workers", "1"]
        done = subprocess.run(
            [DLPIPE, "convert", str(raw3), "--to", "hdf5", "--out", str(out), *flags],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_DISABLE_IMPORT_WARNING": "1"},
        )
        assert done.returncode == 0, done.stderr
        manifest = dlpipe.read_manifest(str(out))
        shards[engine] = [s for split in manifest.splits.values() for s in split.shards]
    assert shards["ray"] == shards["local"] and len(shards["ray"]) == 4
