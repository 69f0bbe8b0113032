"""The output folder has one owner (`dlpipe.formats.output.DatasetOutput`): both ways of writing a
dataset (`DatasetWriter` and ``dlpipe convert``) finish through it, the manifest is written last
and never read back, and reading a manifest imports no shard format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import dlpipe
from dlpipe import manifest as manifest_module
from dlpipe import storage
from dlpipe.converters import engine
from dlpipe.converters.engine import ConvertConfig
from dlpipe.synthetic import split_samples, synthetic_samples, write_imagefolder


def _atomic_writes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files written atomically from now on, in order (shards are renamed into
    place, not listed here)."""
    names: list[str] = []
    real_bytes, real_jsonl = storage.atomic_write_bytes, storage.atomic_write_jsonl

    def write_bytes(path: str, data: bytes, **kwargs: bool) -> None:
        names.append(Path(path).name)
        real_bytes(path, data, **kwargs)

    def write_jsonl(path: str, records: list[dict]) -> None:
        names.append(Path(path).name)
        real_jsonl(path, records)

    monkeypatch.setattr(storage, "atomic_write_bytes", write_bytes)
    monkeypatch.setattr(storage, "atomic_write_jsonl", write_jsonl)
    return names


def _write_streaming(tmp_path: Path, out: Path) -> dlpipe.Manifest:
    limits = dlpipe.ShardLimits(max_shard_samples=3)
    with dlpipe.DatasetWriter(
        out=str(out), format="wds", classes=["a", "b"], limits=limits
    ) as writer:
        for i, sample in enumerate(synthetic_samples(10)):
            writer.write("val" if i % 4 == 0 else "train", {**sample, "cls": str(i % 2).encode()})
        return writer.close()


def _write_converting(tmp_path: Path, out: Path) -> dlpipe.Manifest:
    raw = tmp_path / "raw"
    write_imagefolder(str(raw), split_samples(2, seed=1, val_fraction=0.5))
    config = ConvertConfig.from_options(raw=str(raw), to="hdf5", out=str(out), workers=1)
    return engine.convert(config).manifest


@pytest.mark.parametrize("write", [_write_streaming, _write_converting], ids=["writer", "convert"])
def test_the_manifest_is_written_last_from_memory_and_the_journal_goes(
    tmp_path, monkeypatch, write
) -> None:
    out = tmp_path / "out"
    written = _atomic_writes(monkeypatch)

    def read_back(folder: str) -> bytes:
        raise AssertionError(f"the manifest of {folder} was read back")

    monkeypatch.setattr(manifest_module, "read_manifest_bytes", read_back)
    returned = write(tmp_path, out)
    monkeypatch.undo()
    assert written[-1] == "dlpipe.json" and written.count("dlpipe.json") == 1, written
    assert not (out / ".dlpipe-journal").exists()
    assert returned == dlpipe.read_manifest(str(out))  # what a reader parses, to the value
    assert sorted(returned.splits) == ["train", "val"]
    for split in returned.splits.values():  # the owner's counts, summed over the shards
        assert split.class_counts is not None and sum(split.class_counts) == split.samples


def test_a_manifest_a_reader_would_refuse_is_never_written(tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(dlpipe.ManifestError, match="'classes' holds a non-string; it was not"):
        with dlpipe.DatasetWriter(out=str(out), format="wds", classes=[0, 1]) as writer:  # type: ignore[list-item]
            writer.write("train", next(synthetic_samples(1)))
    assert not (out / "dlpipe.json").exists()
    with pytest.raises(dlpipe.ManifestNotFoundError, match="unfinished conversion"):
        dlpipe.read_manifest(str(out))


def test_a_split_that_lost_every_sample_writes_its_reasons_and_no_manifest(tmp_path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_imagefolder(str(raw), split_samples(2, seed=1, val_fraction=0.5))
    broken = sorted((raw / "val").rglob("*.jpg"))
    for path in broken:
        path.write_bytes(b"not an image")
    config = ConvertConfig.from_options(raw=str(raw), to="wds", out=str(out))
    with pytest.raises(dlpipe.DlpipeError, match="every sample of split 'val' was skipped") as e:
        engine.convert(config)
    assert str(out / "errors.jsonl") in str(e.value)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == len(broken) > 0
    assert not (out / "dlpipe.json").exists()


_IMPORTED = (
    "import json, sys, dlpipe\n"
    "outcome = []\n"
    "manifest = dlpipe.read_manifest(sys.argv[1])\n"
    "outcome.append(manifest.splits['train'].samples)\n"
    "try:\n"
    "    dlpipe.read_manifest(sys.argv[2])\n"
    "except dlpipe.ManifestNotFoundError as exc:\n"
    "    outcome.append('--resume' in str(exc))\n"
    "heavy = ('dlpipe.formats', 'lmdb', 'h5py')\n"
    "outcome.append(sorted(m for m in sys.modules if m.split('.')[0] in heavy\n"
    "                      or m.startswith('dlpipe.formats')))\n"
    "print(json.dumps(outcome))\n"
)


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_reading_a_manifest_imports_no_shard_format(tmp_path, fmt) -> None:
    done = tmp_path / "done"
    with dlpipe.DatasetWriter(out=str(done), format=fmt) as writer:
        for sample in synthetic_samples(3):
            writer.write("train", sample)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / f"train-000000{dlpipe.FORMATS[fmt].suffix}").write_bytes(b"")
    run = subprocess.run(
        [sys.executable, "-c", _IMPORTED, str(done), str(unfinished)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [3, True, []]


def test_resume_rewrites_a_shard_whose_record_was_cut_short_and_matches_a_clean_run(
    tmp_path,
) -> None:
    raw = tmp_path / "raw"
    write_imagefolder(str(raw), split_samples(3, seed=2, val_fraction=0))
    options = {"raw": str(raw / "train"), "to": "lmdb", "shard_bytes": 1, "workers": 1}
    clean, out = tmp_path / "clean", tmp_path / "out"
    engine.convert(ConvertConfig.from_options(**options, out=str(clean)))
    finished: list[str] = []

    def interrupt_after_three(result: object) -> None:
        finished.append(getattr(result, "name", ""))
        if len(finished) == 3:
            raise KeyboardInterrupt  # Ctrl-C: three shards journalled, no manifest

    with pytest.raises(KeyboardInterrupt):
        engine.convert(
            ConvertConfig.from_options(**options, out=str(out)), on_progress=interrupt_after_three
        )
    assert not (out / "dlpipe.json").exists()
    (out / ".dlpipe-journal" / f"{finished[0]}.json").write_bytes(b"")  # a power cut's record
    result = engine.convert(ConvertConfig.from_options(**options, out=str(out), resume=True))
    assert result.resumed_shards == 2
    files = sorted(p.name for p in clean.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    assert all((clean / n).read_bytes() == (out / n).read_bytes() for n in files), files
