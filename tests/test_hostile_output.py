"""The output folder under attack: user files beside shards, two writers, --out inside the raw
folder, a killed main process, a full disk, a changed input on --resume, shortened keys."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from convert_hold import HANG_S, ConvertHold

import dlpipe
from dlpipe import storage
from dlpipe.cli import main
from dlpipe.converters import engine
from dlpipe.converters.engine import ConvertConfig
from dlpipe.converters.source import Item, Scan, Source
from dlpipe.synthetic import SHAPE_CLASSES, split_samples, synthetic_samples, write_imagefolder

PYTHON_DLPIPE = [sys.executable, "-m", "dlpipe"]
WORKERS_2 = ["--workers", "2", "--shard-size", "1"]
USER_FILES = {  # shard-like names and plain names a user keeps beside a dataset
    "photos-000001.tar": b"holiday tar",
    "family-000002.h5": b"family hdf5",
    "notes-000003.lmdb": b"an lmdb of mine",
    "notes.txt": b"mine",
    "train-000777.tar": b"no manifest lists this one",
}


def make_raw(root: Path, per_class: int = 2, *, splits: bool = False) -> Path:
    """Shapes as class folders: root/<class>/*.jpg (or root/{train,val}/<class>/*.jpg)."""
    pairs = split_samples(per_class, seed=1, val_fraction=0.5 if splits else 0)
    write_imagefolder(str(root), pairs)
    return root if splits else root / "train"


def convert(*argv: str) -> int:
    return main(["convert", *argv])


def one_error(err: str) -> str:
    """The single ``error:`` line of a failed command (and no traceback)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (but the writer lock) by relative path."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != storage.LOCK_NAME:
            found[str(path.relative_to(folder))] = path.read_bytes()
    return found


def plant(out: Path, files: dict[str, bytes]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (out / name).write_bytes(data)


def assert_kept(out: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (out / name).read_bytes() == data, f"{name} was changed or deleted"


# --- 1. nothing dlpipe did not write is deleted ----------------------------------------------


@pytest.mark.parametrize("fmt", sorted(dlpipe.FORMATS))
def test_overwrite_keeps_user_files_with_shard_like_names(tmp_path, fmt, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw"), tmp_path / "out"
    assert convert(str(raw), "--to", fmt, "--out", str(out), "--shard-size", "1") == 0
    old_shards = {n for n in os.listdir(out) if n.endswith(dlpipe.FORMATS[fmt].suffix)}
    plant(out, USER_FILES)
    argv = [str(raw), "--to", fmt, "--out", str(out), "--shard-size", "1", "--seed", "3"]
    assert convert(*argv, "--overwrite") == 0
    assert_kept(out, USER_FILES)
    manifest = dlpipe.read_manifest(str(out))
    listed = {s.name for split in manifest.splits.values() for s in split.shards}
    assert manifest.options["seed"] == 3 and listed == old_shards
    report = dlpipe.verify_dataset(str(out))  # verify names the user's look-alikes, no more
    suffix = dlpipe.FORMATS[fmt].suffix
    assert {p.shard for p in report.problems} == {n for n in USER_FILES if n.endswith(suffix)}
    assert all("does not list it" in p.message for p in report.problems)
    names = {"dlpipe.json", "convert.toml", storage.LOCK_NAME}  # convert.toml: the CLI's config
    assert set(os.listdir(out)) == listed | set(USER_FILES) | names


def test_overwrite_with_fewer_shards_deletes_only_the_listed_old_ones(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=2), tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--shard-size", "1") == 0
    plant(out, USER_FILES)
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite") == 0
    assert_kept(out, USER_FILES)
    shards = sorted(n for n in os.listdir(out) if n.startswith("train-0000"))
    assert shards == ["train-000000.tar"]  # the 16 one-sample shards went, the user's 777 stayed


def test_a_user_file_under_a_planned_shard_name_is_refused_before_any_delete(
    tmp_path, capsys
) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=2), tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out)) == 0  # one shard
    plant(out, {"train-000005.tar": b"a stray tar of mine", **USER_FILES})
    before = snapshot(out)
    argv = [str(raw), "--to", "wds", "--out", str(out), "--shard-size", "1", "--overwrite"]
    assert convert(*argv) == 2
    line = one_error(capsys.readouterr().err)
    assert "train-000005.tar" in line and "nothing was deleted" in line and "--out" in line
    assert snapshot(out) == before  # not even the old manifest went


def test_overwrite_of_a_folder_with_only_user_files_refuses_a_clash(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    plant(out, {"train-000000.tar": b"my own tar, no manifest anywhere"})
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite") == 2
    assert "train-000000.tar" in one_error(capsys.readouterr().err)
    assert (out / "train-000000.tar").read_bytes() == b"my own tar, no manifest anywhere"


@pytest.mark.parametrize(
    "manifest_bytes",
    [b"{" * 100_000, b'{"schema": "dlpipe.dataset", "splits": 5}', b"\xff\xfe not json"],
    ids=["deeply-nested", "wrong-shape", "not-utf8"],
)
def test_overwrite_over_a_malformed_manifest_deletes_nothing(
    tmp_path, capsys, manifest_bytes
) -> None:
    raw, out = make_raw(tmp_path / "raw"), tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--shard-size", "1") == 0
    (out / "dlpipe.json").write_bytes(manifest_bytes)
    plant(out, USER_FILES)
    before = snapshot(out)
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite") == 2
    line = one_error(capsys.readouterr().err)
    shards = len(list(out.glob("train-*.tar")))
    assert "nothing was deleted" in line and f"{shards + 3} shard-named files remain" in line
    assert "dlpipe.json" in line and snapshot(out) == before


def test_a_crafted_manifest_cannot_list_a_user_file_for_deletion(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw"), tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out)) == 0
    data = json.loads((out / "dlpipe.json").read_bytes())
    data["splits"]["train"]["shards"][0]["name"] = "notes.txt"  # the attacker's "shard"
    (out / "dlpipe.json").write_text(json.dumps(data))
    plant(out, {"notes.txt": b"mine", "victim.jpg": b"\xff\xd8\xff mine"})
    code = convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite")
    capsys.readouterr()
    assert code in (0, 2)  # refused, or replaced the dataset; either way:
    assert_kept(out, {"notes.txt": b"mine", "victim.jpg": b"\xff\xd8\xff mine"})


def test_an_overwrite_killed_half_way_still_knows_which_shards_were_dlpipes(
    tmp_path, monkeypatch
) -> None:
    raw, out = make_raw(tmp_path / "raw"), tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--shard-size", "1") == 0
    plant(out, USER_FILES)
    real_remove, removed = storage.remove, []

    def killed_after_three(path: str) -> None:
        if len(removed) == 3:
            raise KeyboardInterrupt  # the kill: manifest and two shards gone, the rest not
        removed.append(path)
        real_remove(path)

    monkeypatch.setattr(storage, "remove", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        engine.convert(
            ConvertConfig.from_options(raw=str(raw), to="wds", out=str(out), overwrite=True)
        )
    monkeypatch.setattr(storage, "remove", real_remove)
    assert not (out / "dlpipe.json").exists()
    config = ConvertConfig.from_options(
        raw=str(raw), to="wds", out=str(out), overwrite=True, workers=1
    )
    engine.convert(config)
    assert_kept(out, USER_FILES)
    expected = {"dlpipe.json", "convert.toml", "train-000000.tar", storage.LOCK_NAME, *USER_FILES}
    assert set(os.listdir(out)) == expected  # every old one-sample shard was found and removed


def test_dataset_writer_overwrite_after_a_crash_keeps_user_files(tmp_path, samples) -> None:
    out = tmp_path / "d"
    limits = dlpipe.ShardLimits(max_shard_samples=2)
    with pytest.raises(RuntimeError, match="crash"):
        with dlpipe.DatasetWriter(out=str(out), format="wds", limits=limits) as writer:
            for sample in samples[:7]:
                writer.write("train", sample)
            raise RuntimeError("crash")  # three shards published, no manifest
    assert not (out / "dlpipe.json").exists() and (out / "train-000002.tar").exists()
    plant(out, USER_FILES)
    with dlpipe.DatasetWriter(out=str(out), format="hdf5", overwrite=True) as writer:
        writer.write("train", samples[0])
    assert_kept(out, USER_FILES)
    assert not list(out.glob("train-00000?.tar"))
    report = dlpipe.verify_dataset(str(out))
    assert [p.shard for p in report.problems] == ["family-000002.h5"]  # the user's, named


def test_dataset_writer_refuses_to_replace_a_users_file(tmp_path, samples) -> None:
    out = tmp_path / "d"
    plant(out, {"train-000000.tar": b"mine"})
    with pytest.raises(dlpipe.OutputExistsError, match="train-000000.tar"):
        with dlpipe.DatasetWriter(out=str(out), format="wds", overwrite=True) as writer:
            writer.write("train", samples[0])
    assert (out / "train-000000.tar").read_bytes() == b"mine"
    assert not (out / "dlpipe.json").exists()


# --- 2. one conversion per output folder -----------------------------------------------------


def _holder_pid(out: Path) -> str:
    try:
        return (out / storage.LOCK_NAME).read_text().strip()
    except FileNotFoundError:
        return ""


def _start(
    raw: Path, out: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*PYTHON_DLPIPE, "convert", str(raw), "--to", "wds", "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_converts_started_together_never_both_succeed(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=3), tmp_path / "out"
    procs = [_start(raw, out, "--workers", "1", "--shard-size", "1") for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    err = next(e for code, e in results if code == 2)
    line = one_error(err)
    assert "being written by another dlpipe process" in line or "is not empty" in line
    assert main(["verify", str(out)]) == 0
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 3 * len(SHAPE_CLASSES)


@pytest.mark.parametrize("second", [[], ["--overwrite"], ["--resume"]], ids=str)
def test_a_second_convert_while_one_runs_fails_at_once_naming_the_holder(tmp_path, second) -> None:
    """The first convert is held mid-run (lock taken) until the second has ended: a second
    that waited for the lock would never end (the timeout is only a bound on that hang)."""
    raw, out = make_raw(tmp_path / "raw", per_class=8), tmp_path / "out"
    hold = ConvertHold(tmp_path / "hold")
    first = _start(raw, out, "--workers", "1", "--shard-size", "1", env=hold.env)
    try:
        assert hold.wait(first) == [first.pid]
        assert _holder_pid(out) == str(first.pid)
        done = subprocess.run(
            [*PYTHON_DLPIPE, "convert", str(raw), "--to", "wds", "--out", str(out), *second],
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        assert hold.held() == [first.pid] and _holder_pid(out) == str(first.pid)
    finally:
        hold.release()
    assert done.returncode == 2
    line = one_error(done.stderr)
    assert f"{out} is being written by another dlpipe process (pid {first.pid})" in line
    assert "wait for it to finish or choose another --out" in line
    assert first.wait(timeout=120) == 0, first.stderr.read() if first.stderr else ""
    report = dlpipe.verify_dataset(str(out))
    assert report.ok and dlpipe.read_manifest(str(out)).splits["train"].samples == 64


def test_a_dataset_writer_holds_the_lock_against_convert_and_writers(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    with storage.output_lock(str(out)):
        assert convert(str(raw), "--to", "wds", "--out", str(out)) == 2
        assert f"(pid {os.getpid()})" in one_error(capsys.readouterr().err)
        with pytest.raises(storage.OutputLockedError, match="another dlpipe process"):
            dlpipe.DatasetWriter(out=str(out), format="wds")
    writer = dlpipe.DatasetWriter(out=str(out), format="wds")
    with pytest.raises(storage.OutputLockedError):
        dlpipe.DatasetWriter(out=str(out), format="wds", overwrite=True)
    writer.abort()
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite") == 0


def test_a_lock_file_planted_as_a_link_or_fifo_is_refused(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out.mkdir()
    os.symlink(victim, out / storage.LOCK_NAME)
    assert convert(str(raw), "--to", "wds", "--out", str(out)) == 2
    assert storage.LOCK_NAME in one_error(capsys.readouterr().err)
    assert victim.read_bytes() == b"precious"
    os.remove(out / storage.LOCK_NAME)
    os.mkfifo(out / storage.LOCK_NAME)
    assert convert(str(raw), "--to", "wds", "--out", str(out)) == 2  # does not hang on open
    assert "not a plain file" in one_error(capsys.readouterr().err)


def test_the_kept_lock_file_is_empty_and_ignored_by_verify_and_inspect(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    assert convert(str(raw), "--to", "hdf5", "--out", str(out)) == 0
    assert (out / storage.LOCK_NAME).read_bytes() == b""
    assert main(["verify", str(out), "--decode"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert len(dlpipe.open_dataset(str(out))) == len(SHAPE_CLASSES)


# --- 3. --out inside the raw folder ----------------------------------------------------------


@pytest.mark.parametrize("where", ["equal", "inside", "link-inside", "equal-overwrite"])
def test_out_inside_or_equal_to_the_raw_folder_is_refused(tmp_path, capsys, where) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2, splits=True)
    before = snapshot(raw)
    link = tmp_path / "elsewhere"
    os.symlink(raw / "train", link)
    out = {
        "equal": raw,
        "inside": raw / "shards",
        "link-inside": link / "shards",
        "equal-overwrite": raw,
    }[where]
    extra = ["--overwrite"] if where.endswith("overwrite") else []
    assert convert(str(raw), "--to", "wds", "--out", str(out), *extra) == 2
    line = one_error(capsys.readouterr().err)
    assert str(out) in line and str(raw) in line and f"--out {tmp_path / 'raw-wds'}" in line
    assert snapshot(raw) == before and sorted(os.listdir(raw)) == ["train", "val"]


def test_a_default_out_that_lands_inside_raw_is_refused(tmp_path, capsys, monkeypatch) -> None:
    raw = make_raw(tmp_path / "raw", per_class=1)
    monkeypatch.setenv("DLPIPE_DATA_DIR", str(raw / "converted"))
    assert convert(str(raw), "--to", "lmdb") == 2
    line = one_error(capsys.readouterr().err)
    assert "DLPIPE_DATA_DIR" in line and str(raw) in line
    assert not (raw / "converted").exists()


# --- 4. a killed main process leaves no workers ----------------------------------------------


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the task ended while we looked
            found |= {int(c) for c in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_the_main_process_takes_its_workers_down(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=4), tmp_path / "out"  # 32 JPEGs
    hold = ConvertHold(tmp_path / "hold")
    proc = subprocess.Popen(
        [*PYTHON_DLPIPE, "convert", str(raw), "--to", "wds", "--out", str(out), *WORKERS_2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=hold.env,
        start_new_session=True,
    )
    children: set[int] = set()
    try:
        workers = hold.wait(proc)  # a worker holds before its second shard: the run is on
        children = _children(proc.pid)
        assert set(workers) <= children and len(children) >= 2, (workers, children)
        os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer does: the main process only
        proc.wait()
        deadline = time.monotonic() + HANG_S  # only a bound on a hang: the kernel kills them
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.05)
        assert not [c for c in children if _alive(c)], "workers outlived their parent"
    finally:
        for pid in [proc.pid, *children]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not (out / "dlpipe.json").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_killed_mid_run_is_one_error_and_resume_finishes(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=4), tmp_path / "out"
    hold = ConvertHold(tmp_path / "hold")
    proc = subprocess.Popen(
        [*PYTHON_DLPIPE, "convert", str(raw), "--to", "wds", "--out", str(out), *WORKERS_2],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=hold.env,
        start_new_session=True,
    )
    try:
        victim = hold.wait(proc)[0]  # it sent its first shard and holds the next one
        journal = out / ".dlpipe-journal"
        deadline = time.monotonic() + HANG_S
        while not list(journal.glob("train-*.json")):  # the main process records it
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        os.kill(victim, signal.SIGKILL)  # the OOM killer picks a worker with a shard in hand
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2
    line = one_error(err)
    assert "worker process died" in line and "finish the conversion with `" in line
    command = shlex.split(line.split("finish the conversion with `")[1].split("`")[0])
    done = subprocess.run(
        [*PYTHON_DLPIPE, *command[1:]], capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout, done.stdout
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 32


# --- 5. keys.jsonl ---------------------------------------------------------------------------

NON_UTF8 = os.fsdecode(b"caf\xe9-" + b"x" * 90)


class ShortenedKeys(Source):
    """Six samples; odd ones carry the long original name their key was shortened from."""

    kind = "shortened"
    _image = next(synthetic_samples(1))["jpg"]

    @classmethod
    def detect(cls, root: str) -> bool:
        return False

    def scan(self) -> Scan:
        names = ["写真" * 30, NON_UTF8, "z" * 300]
        items = tuple(
            Item(
                key=f"k{5 - i}",
                label=i % 2,
                split="train",
                ref=i,
                size=len(self._image),
                image_kind="jpg",
                origin=f"item {i}",
                original=names[i // 2] if i % 2 else None,
            )
            for i in range(6)
        )
        return Scan(classes=("even", "odd"), items=items)

    def load(self, item: Item) -> dict[str, bytes]:
        return {"image": bytes(self._image)}


def test_shortened_keys_are_listed_in_keys_jsonl(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(engine, "open_source", lambda raw, kind, options: ShortenedKeys(raw))
    (tmp_path / "raw").mkdir()
    out = tmp_path / "out"
    result = engine.convert(
        ConvertConfig.from_options(raw=str(tmp_path / "raw"), to="wds", out=str(out))
    )
    lines = (out / "keys.jsonl").read_bytes().decode("utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["key"] for r in records] == ["k0", "k2", "k4"]  # sorted by key
    assert [r["original"] for r in records] == ["z" * 300, NON_UTF8, "写真" * 30]
    assert "写真" in lines[2]  # readable, not \u-escaped
    assert os.fsencode(records[1]["original"]) == b"caf\xe9-" + b"x" * 90
    assert result.manifest.source["shortened_keys"] == 3
    assert dlpipe.verify_dataset(str(out)).ok


def test_no_keys_jsonl_without_shortened_keys_and_an_old_one_goes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(engine, "open_source", lambda raw, kind, options: ShortenedKeys(raw))
    (tmp_path / "raw").mkdir()
    out = tmp_path / "out"
    engine.convert(ConvertConfig.from_options(raw=str(tmp_path / "raw"), to="wds", out=str(out)))
    monkeypatch.undo()
    raw = make_raw(tmp_path / "shapes", per_class=1)
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--overwrite") == 0
    assert not (out / "keys.jsonl").exists()
    assert dlpipe.read_manifest(str(out)).source["shortened_keys"] == 0


# --- 6. errors.jsonl, always -----------------------------------------------------------------


def test_errors_jsonl_is_written_when_every_sample_of_a_split_is_skipped(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2, splits=True)
    for path in (raw / "val").rglob("*.jpg"):
        path.write_bytes(b"\xff\xd8\xff not really a jpeg")
    out = tmp_path / "out"
    assert convert(str(raw), "--to", "wds", "--out", str(out)) == 2
    line = one_error(capsys.readouterr().err)
    assert "'val'" in line and str(out / "errors.jsonl") in line
    skipped = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert len(skipped) == len(list((raw / "val").rglob("*.jpg")))
    assert not (out / "dlpipe.json").exists()


def test_errors_jsonl_is_the_same_run_to_run(tmp_path) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2)
    next(raw.rglob("*.jpg")).write_bytes(b"garbage that no decoder takes")
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert convert(str(raw), "--to", "wds", "--out", str(out)) == 0
    first, second = ((out / "errors.jsonl").read_bytes() for out in outs)
    assert first == second and b" at 0x" not in first


# --- 7. disk full ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 20 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20M", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill_after_the_check(monkeypatch, disk: Path, leave_bytes: int) -> None:
    """The up-front check passes, then something else fills the disk (as a parallel job does)."""
    real = engine.check_disk

    def check_then_fill(out: str, estimated_bytes: int) -> None:
        real(out, estimated_bytes)
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * max(0, free - leave_bytes))

    monkeypatch.setattr(engine, "check_disk", check_then_fill)


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("fmt", "workers"), [("wds", 1), ("hdf5", 2), ("lmdb", 1)])
def test_disk_full_is_one_error_and_resume_finishes(
    tmp_path, small_disk, monkeypatch, capsys, fmt, workers
) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=4), small_disk / "out"
    _fill_after_the_check(monkeypatch, small_disk, leave_bytes=24 << 10)
    argv = [str(raw), "--to", fmt, "--out", str(out), "--shard-size", "4KB", "--seed", "5"]
    assert convert(*argv, "--workers", str(workers)) == 2
    line = one_error(capsys.readouterr().err)
    assert str(out) in line and "shard" in line and "free space" in line, line
    assert not (out / "dlpipe.json").exists()
    command = shlex.split(line.rsplit("finish with `", 1)[1].split("`", 1)[0])
    assert command[:2] == ["dlpipe", "convert"] and f"--to {fmt}" in shlex.join(command)
    assert "--seed" in command and command[-1] == "--resume"
    monkeypatch.undo()
    os.remove(small_disk / "filler")
    assert (out / ".dlpipe-journal" / "plan.json").exists()  # an interrupted conversion
    assert main(command[1:]) == 0
    report = dlpipe.verify_dataset(str(out), decode=True)
    assert report.ok and dlpipe.read_manifest(str(out)).splits["train"].samples == 32


# --- 8/9. the resume fingerprint, and hints that are complete commands -----------------------


def _interrupted(raw: Path, out: Path, **options) -> None:
    """A conversion stopped after its first shard (journal kept, no manifest)."""

    def stop(result) -> None:
        raise KeyboardInterrupt

    config = ConvertConfig.from_options(
        raw=str(raw), out=str(out), shard_bytes=1, workers=1, **options
    )
    with pytest.raises(KeyboardInterrupt):
        engine.convert(config, on_progress=stop)
    assert not (out / "dlpipe.json").exists()


def test_resume_after_the_raw_folder_gained_a_class_names_it(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    _interrupted(raw, out, to="wds")
    shutil.copytree(raw / "star", raw / "zebra")
    assert convert(str(raw), "--to", "wds", "--out", str(out), "--shard-size", "1", "--resume") == 2
    line = one_error(capsys.readouterr().err)
    assert "the classes changed (added 'zebra')" in line and "--overwrite" in line
    assert "--to wds" in line and f"--out {out}" in line


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--to", "lmdb"], "--to was 'wds', now 'lmdb'"),
        (["--to", "wds", "--max-side", "8"], "--max-side was None, now 8"),
    ],
)
def test_resume_with_other_options_names_what_changed(tmp_path, capsys, flags, named) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    _interrupted(raw, out, to="wds")
    assert convert(str(raw), "--out", str(out), "--shard-size", "1", "--resume", *flags) == 2
    assert named in one_error(capsys.readouterr().err)


def test_the_printed_commands_are_complete_and_work(tmp_path, capsys) -> None:
    raw, out = make_raw(tmp_path / "raw", per_class=1), tmp_path / "out"
    _interrupted(raw, out, to="hdf5", seed=4, quality=90)
    argv = [str(raw), "--to", "hdf5", "--out", str(out), "--shard-size", "1"]
    assert convert(*argv, "--seed", "4", "--quality", "90") == 2  # forgot --resume
    line = one_error(capsys.readouterr().err)
    resume = shlex.split(line.split("finish an interrupted conversion with `")[1].split("`")[0])
    assert resume[-1] == "--resume" and resume[3:5] == ["--to", "hdf5"]
    assert main(resume[1:]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.options["seed"] == 4 and manifest.options["quality"] == 90
    assert convert(str(raw), "--to", "hdf5", "--out", str(out), "--resume") == 2
    line = one_error(capsys.readouterr().err)
    overwrite = shlex.split(line.split("run `")[1].split("`")[0])
    assert overwrite[-1] == "--overwrite" and main(overwrite[1:]) == 0


def test_an_interrupted_conversion_names_the_command_that_finishes_it(tmp_path) -> None:
    raw, out = make_raw(tmp_path / "my raw", per_class=4), tmp_path / "out"
    config = ConvertConfig.from_options(
        raw=str(raw), to="lmdb", out=str(out), workers=1, shard_bytes=1 << 20
    )

    def stop(result) -> None:
        raise KeyboardInterrupt  # the first shard is journalled, then the run dies

    with pytest.raises(KeyboardInterrupt):
        engine.convert(config, on_progress=stop)
    with pytest.raises(dlpipe.ManifestNotFoundError) as caught:
        dlpipe.open_dataset(str(out))
    hint = str(caught.value).split("`")[1]
    expected = f"dlpipe convert {shlex.quote(str(raw))} --to lmdb --out {out} --shard-size 1048576"
    assert hint == f"{expected} --resume"
    assert main(shlex.split(hint)[1:]) == 0
    assert dlpipe.verify_dataset(str(out)).ok


def test_convert_workers_are_spawned_with_stop_signals_blocked(tmp_path, spawn_masks) -> None:
    """So a Ctrl-C to the process group while a worker still imports stays pending (the worker
    drops it in its initializer) instead of printing a KeyboardInterrupt traceback from it; the
    resource tracker multiprocessing starts with the pool unblocks them, which broke this once."""
    raw = make_raw(tmp_path / "raw", per_class=2)
    out = tmp_path / "out"
    config = ConvertConfig.from_options(
        raw=str(raw), to="wds", out=str(out), workers=2, shard_bytes=1
    )
    engine.convert(config)
    assert spawn_masks, "no worker process was spawned"
    assert all({signal.SIGINT, signal.SIGTERM} <= mask for mask in spawn_masks), spawn_masks
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
