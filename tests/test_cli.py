"""The dlpipe command as a user runs it: in-process through main(), and as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dlpipe
from dlpipe.cli import main
from dlpipe.demo import DEMO_TIME, DemoConfig


def test_inspect_shows_format_splits_fields_and_class_counts(make_dataset, capsys) -> None:
    path = make_dataset("lmdb")
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "lmdb v1, 40 samples" in out
    assert "jpg (image)" in out and "cls (int)" in out
    assert "train" in out and "32" in out and "crescent" in out


def test_inspect_json_is_machine_readable(make_dataset, capsys) -> None:
    assert main(["inspect", make_dataset("hdf5"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hdf5" and info["samples"] == 40
    assert info["splits"]["val"]["class_counts"] == [1] * 8
    assert info["splits"]["train"]["shards"] == 4


def test_verify_ok_and_decode(make_dataset, capsys) -> None:
    path = make_dataset("wds")
    assert main(["verify", path, "--decode"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok:") and "5 shards, 40 samples decoded" in out


def test_errors_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not a dlpipe dataset" in err
    assert main(["verify", str(tmp_path)]) == 2


def test_demo_writes_every_format_and_verifies(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--per-class", "5"]) == 0
    printed = capsys.readouterr().out
    for fmt in dlpipe.FORMATS:
        ds = dlpipe.open_dataset(out / f"shapes-{fmt}", "train")
        assert len(ds) == 32 and fmt in printed
        assert dlpipe.verify_dataset(str(out / f"shapes-{fmt}"), decode=True).ok
    assert sum(1 for _ in (out / "raw").rglob("*.jpg")) == 40
    first = printed.splitlines()[0]  # the time, up front
    assert f"(about {DEMO_TIME} on 2 CPU cores with the defaults;" in first
    assert "8 shape classes" in printed
    assert (
        "tuned the loader" in printed and (out / "shapes-lmdb" / "dlpipe-profiles.json").is_file()
    )
    assert (
        "val top-1" in printed and f"tensorboard --logdir {out / 'run' / 'tensorboard'}" in printed
    )
    for made in ("metrics.jsonl", "confusion.png", "config.toml", "checkpoints/best.pt"):
        assert (out / "run" / made).is_file(), made
    # reruns over its own output; --epochs 0 converts and verifies only
    assert main(["demo", "--out", str(out), "--per-class", "5", "--epochs", "0"]) == 0
    assert not (out / "run").exists()


def test_demo_refuses_a_folder_it_did_not_make(tmp_path, capsys) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "not made by dlpipe demo" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_console_script_and_python_m_run_as_processes(make_dataset) -> None:
    path = make_dataset("hdf5")
    bindir = Path(sys.executable).parent
    for command in ([str(bindir / "dlpipe")], [sys.executable, "-m", "dlpipe"]):
        done = subprocess.run([*command, "verify", path], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "ok:" in done.stdout
        bad = subprocess.run(
            [*command, "inspect", os.path.dirname(path) + "/nope"], capture_output=True, text=True
        )
        assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_the_default_demo_trains_to_at_least_90_percent(tmp_path, capsys) -> None:
    """The README's first command, in-process: the embedded dataset is learnt, not guessed."""
    out, default = tmp_path / "demo", DemoConfig(out="").resolved()
    assert main(["demo", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    epochs = [
        json.loads(line)
        for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
        if '"event": "epoch"' in line
    ]
    assert len(epochs) == default.epochs and epochs[-1]["val_samples"] == 640
    assert epochs[-1]["top1"] >= 0.90, [round(e["top1"], 3) for e in epochs]
    last = f"{100 * epochs[-1]['top1']:.1f}% after {default.epochs} epochs"
    assert f"val top-1:        {last}" in printed
