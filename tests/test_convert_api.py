"""``dlpipe.convert(raw, to=..., **options)``: a conversion as a Python call, by a user."""

from __future__ import annotations

import pytest

import dlpipe
from dlpipe.cli import main
from dlpipe.synthetic import split_samples, write_imagefolder


@pytest.fixture
def raw(tmp_path) -> str:
    folder = tmp_path / "raw"
    write_imagefolder(str(folder), list(split_samples(2, seed=0)))  # 8 classes, 16 images
    return str(folder / "train")  # 2 per class leave val empty: train/ holds the classes


def test_convert_writes_a_dataset_open_dataset_reads(raw, tmp_path) -> None:
    out = tmp_path / "shapes-lmdb"
    result = dlpipe.convert(raw, to="lmdb", out=str(out), workers=1, max_side=48, quality=90)
    assert result.out == str(out) and result.skipped == []
    assert result.manifest.options["max_side"] == 48 and result.manifest.options["quality"] == 90
    train = dlpipe.open_dataset(str(out), "train")
    total = sum(s.samples for s in result.manifest.splits.values())
    assert (
        total == result.samples_in == 16 and len(train) == result.manifest.splits["train"].samples
    )
    assert max(dlpipe.decode_field("jpg", train[0]["jpg"]).size) <= 48
    assert dlpipe.verify_dataset(str(out), decode=True).ok


def test_convert_takes_a_whole_config_too(raw, tmp_path) -> None:
    from dlpipe.converters.config import ImagePolicy, ShardConfig

    config = dlpipe.ConvertConfig(
        raw=raw, to="wds", out=str(tmp_path / "w"), shards=ShardConfig(val_fraction=0.5)
    )
    assert config.value_of("val_fraction") == 0.5 and config.engine.workers >= 1
    result = dlpipe.convert(config)
    assert set(result.manifest.splits) == {"train", "val"}
    with pytest.raises(dlpipe.DlpipeError, match="ConvertConfig alone"):
        dlpipe.convert(config, to="wds")
    with pytest.raises(dlpipe.DlpipeError, match="argument --quality: 0 is not an integer in"):
        ImagePolicy(quality=0)  # each group checks its own fields


@pytest.mark.parametrize(
    ("options", "flags", "message"),
    [
        ({"quality": 500}, ["--quality", "500"], "argument --quality: 500 is not an integer in"),
        ({"workers": 0}, ["--workers", "0"], "argument --workers: 0 is not an integer of at least"),
        (
            {"shard_bytes": 0},
            ["--shard-size", "0"],
            "argument --shard-size: '0' is not a size; write bytes",
        ),
        ({"on_error": "ignore"}, ["--on-error", "ignore"], "argument --on-error: invalid choice"),
        (
            {"resume": True, "overwrite": True},
            ["--resume", "--overwrite"],
            "--resume and --overwrite contradict each other",
        ),
    ],
)
def test_a_bad_option_raises_the_error_the_cli_prints(
    raw, tmp_path, capsys, options, flags, message
) -> None:
    out = tmp_path / "out"
    with pytest.raises(dlpipe.DlpipeError, match=message) as caught:
        dlpipe.convert(raw, to="wds", out=str(out), **options)
    assert isinstance(caught.value, ValueError)
    try:
        code = main(["convert", raw, "--to", "wds", "--out", str(out), *flags])
    except SystemExit as exit_:  # argparse's one error: line
        code = int(str(exit_.code))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert str(caught.value) in err  # the same words, the CLI adds where to look
    assert not out.exists()


def test_an_unknown_or_mistyped_option_is_named(raw, tmp_path) -> None:
    with pytest.raises(dlpipe.DlpipeError, match="'qualty' is not a conversion option; .*quality"):
        dlpipe.convert(raw, to="wds", qualty=90)
    with pytest.raises(dlpipe.DlpipeError, match="argument --workers: '2' is a str; give an int"):
        dlpipe.convert(raw, to="wds", workers="2")
    with pytest.raises(dlpipe.DlpipeError, match="argument --to: invalid choice: 'zip'"):
        dlpipe.convert(raw, to="zip")
    with pytest.raises(dlpipe.DlpipeError, match="--to is required"):
        dlpipe.convert(raw)
    assert not (tmp_path / "raw-wds").exists()


def test_the_docstring_lists_every_option() -> None:
    from dlpipe.converters.config import option_specs

    doc = dlpipe.convert.__doc__ or ""
    for spec in option_specs():
        if spec.name not in ("raw", "to"):
            assert f"``{spec.name}`` ({spec.flag}" in doc, spec.name


SCRIPT_WITHOUT_GUARD = """\
import dlpipe
result = dlpipe.convert({raw!r}, to="wds", out={out!r}, workers=2, shard_bytes=1)
print("converted", result.samples_in, len(result.manifest.splits["train"].shards) > 1)
"""


@pytest.mark.parametrize("how", ["a file", "stdin"])
def test_a_script_without_a_main_guard_converts_with_worker_processes(raw, tmp_path, how) -> None:
    """Spawned workers do not run the caller's script again: without the guard it started
    the conversion over in every worker, and a script read from stdin was not found."""
    import subprocess
    import sys

    script = SCRIPT_WITHOUT_GUARD.format(raw=raw, out=str(tmp_path / "out"))
    (tmp_path / "convert_it.py").write_text(script)
    command = [sys.executable, "convert_it.py"] if how == "a file" else [sys.executable, "-"]
    done = subprocess.run(
        command,
        input=None if how == "a file" else script,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "converted 16 True"
    assert "Traceback" not in done.stderr, done.stderr
