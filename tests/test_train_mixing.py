"""dlpipe train on several datasets: ``dlpipe train A B --weights``, ``[data] path = [...]`` and
``[[data.sources]]``; per-dataset counts in the metrics; exact resume after kill -9; 2 ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import (
    COMMON,
    _user_models,
    losses_by_step,
    newest,
    records,
    step_losses,
    write_colours,
)
from trainer_models import HOLD_ENV

from dlpipe.cli import main
from dlpipe.options import config_toml
from dlpipe.train.config import TrainConfig, load_config

__all__ = ["_user_models"]  # the autouse fixture that makes tests/trainer_models importable

# A: 96 train samples, B: 32; an epoch is their 128 = 8 steps of 16; 13 val samples each
WEIGHTS = ["--weights", "0.75,0.25"]


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return write_colours(root / "a-lmdb", "lmdb"), write_colours(root / "b-lmdb", "lmdb", train=32)


def train(paths: tuple[str, ...], out: Path, *extra: str) -> int:
    return main(["train", *paths, "--out", str(out), *COMMON, *extra])


def test_two_datasets_train_as_one_weighted_mixture_counted_per_dataset(
    mix, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    assert train(mix, run, "--epochs", "2", "--weights", "3", "1") == 0
    out = capsys.readouterr().out
    assert "data " in out and "a-lmdb, " in out and "(weights 3, 1; on_source_end cycle)" in out
    assert "| samples a-lmdb 96, b-lmdb 32" in out
    epochs = records(run, "epoch")
    assert [e["source_samples"] for e in epochs] == [[96, 32], [96, 32]]
    assert epochs[1]["val_samples"] == 26  # each dataset's val split, every sample once
    assert len(step_losses(run)) == 16
    again = load_config(str(run / "config.toml"), {})
    assert again.data.path == mix and again.data.loader.weights == (3.0, 1.0)


def test_other_weights_on_resume_share_out_the_rest_of_the_epoch(mix, tmp_path) -> None:
    """Resumed with other weights, a run goes on from its step: the new weights share out
    what is left of the epoch (48 samples were drawn 3:1, the other 80 go 1:1)."""
    run = tmp_path / "run"
    assert train(mix, run, "--epochs", "2", "--weights", "3,1", "--max-steps", "3") == 0
    drawn = newest(run)["ranks"][0]["loader"]["cursors"]
    assert sum(drawn) == 48 and drawn != [24, 24]
    assert train(mix, run, "--epochs", "2", "--weights", "1,1") == 0
    first, second = (e["source_samples"] for e in records(run, "epoch"))
    assert first == [drawn[0] + 40, drawn[1] + 40] and second == [64, 64]


def test_a_mixture_reads_the_same_from_flags_an_array_and_source_tables(mix, tmp_path) -> None:
    """``A B --weights 0.75 0.25`` = ``--weights 0.75,0.25`` = ``[data] path = [A, B]`` with
    ``weights`` = ``[[data.sources]]`` tables; the resolved file reads back the same."""
    from dlpipe.cli import build_parser
    from dlpipe.options import given_options

    a, b = mix
    parser = build_parser()
    flagged = [
        load_config(None, given_options(parser.parse_args(["train", a, b, *w]), TrainConfig))
        for w in (["--weights", "0.75", "0.25"], WEIGHTS)
    ]
    array, tables = tmp_path / "array.toml", tmp_path / "tables.toml"
    array.write_text(f'[data]\npath = ["{a}", "{b}"]\nweights = [0.75, 0.25]\n')
    tables.write_text(
        f'[[data.sources]]\npath = "{a}"\nweight = 0.75\n\n'
        f'[[data.sources]]\npath = "{b}"\nweight = 0.25\n'
    )
    configs = [*flagged, load_config(str(array), {}), load_config(str(tables), {})]
    assert all(c == configs[0] for c in configs)
    assert configs[0].data.path == (a, b) and configs[0].data.loader.weights == (0.75, 0.25)
    resolved = tmp_path / "config.toml"
    resolved.write_text(config_toml(configs[0].resolved()))
    assert load_config(str(resolved), {}) == configs[0].resolved()


def test_a_single_dataset_config_of_old_still_reads_as_one_path(tmp_path) -> None:
    old = tmp_path / "config.toml"
    old.write_text('[data]\npath = "data/pets-lmdb"\n')
    config = load_config(str(old), {})
    assert config.data.path == ("data/pets-lmdb",)
    assert config.resolved().run.out == os.path.join("runs", "pets-lmdb-resnet18")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["A", "--weights", "1"], "--weights 1 mixes several datasets, but one was given"),
        (["A", "B", "--weights", "1"], "is not a list of 2 weights"),
        (["A", "B", "--weights", "1,-1"], "argument --weights: -1 is not a finite number"),
    ],
)
def test_a_bad_mixture_is_one_error_line(mix, tmp_path, capsys, args, message) -> None:
    paths = {"A": mix[0], "B": mix[1]}
    argv = [paths.get(arg, arg) for arg in args]
    try:
        code = main(["train", *argv, "--out", str(tmp_path / "run"), *COMMON])
    except SystemExit as exit_:  # the parser's own error
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_mixture_tunes_on_its_first_dataset_and_the_next_run_finds_that_profile(
    tmp_path, capsys, monkeypatch
) -> None:
    """A mixture's loader profile is its first dataset's (where `make_loader` looks it up):
    the first run tunes there and saves it, the next run of the mixture uses it."""
    from dlpipe.loading import tune
    from dlpipe.loading.profile import PROFILES_NAME

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no profile of the real one
    monkeypatch.setattr(tune, "QUICK_TUNE_S", 1.0)  # the shortest search

    a = write_colours(tmp_path / "a-lmdb", "lmdb")
    b = write_colours(tmp_path / "b-lmdb", "lmdb", train=32)
    args = ["--model", "trainer_models:tiny_cnn", "--image-size", "16", "--batch-size", "16",
            "--epochs", "1", "--max-steps", "1", *WEIGHTS]  # fmt: skip
    assert main(["train", a, b, "--out", str(tmp_path / "run1"), *args]) == 0
    first = capsys.readouterr().out
    assert "tuned now on this run's first batches" in first
    assert (Path(a) / PROFILES_NAME).is_file() and not (Path(b) / PROFILES_NAME).exists()
    assert main(["train", a, b, "--out", str(tmp_path / "run2"), *args]) == 0
    second = capsys.readouterr().out
    assert "tuning" not in second and "(profile measured at batch 16, 16 px" in second


def wait_for_file(child: subprocess.Popen, path: Path) -> None:
    """Until `path` exists (a state waited for, not a time: the bound is only on a hang)."""
    deadline = time.monotonic() + 600
    while not path.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"{path} never appeared: {child.communicate()}")
        time.sleep(0.02)


@pytest.mark.slow
def test_a_mixture_killed_with_sigkill_resumes_to_the_same_weights_and_counts(
    mix, tmp_path
) -> None:
    """kill -9 while step 5 runs, its checkpoint of step 4 written (every step; an epoch is
    8): the run goes on from there mid-epoch and ends as the uninterrupted run, weights bit
    for bit, with the same samples per dataset in its first epoch."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    run = ["train", *mix, *COMMON, *WEIGHTS, "--epochs", "3", "--checkpoint-every", "1"]
    run += ["--model", "trainer_models:holds_at_step"]  # TinyCNN; holds only in the child
    hold = tmp_path / "hold"
    hold.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-m", "dlpipe", *run, "--out", str(killed)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
        env={**os.environ, HOLD_ENV: f"{hold}:5"},
    )  # fmt: skip
    wait_for_file(child, hold / "held")  # a state waited for: the run holds at step 5
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert newest(killed)["step"] == 4  # stopped mid-epoch, at a known step
    assert main([*run, "--out", str(killed), "--max-steps", "12"]) == 0
    assert main([*run, "--out", str(whole), "--max-steps", "12"]) == 0
    assert losses_by_step(killed) == losses_by_step(whole) and len(step_losses(whole)) == 12
    a, b = newest(whole), newest(killed)
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert records(killed, "epoch")[0]["source_samples"] == [96, 32]
    assert records(killed, "epoch")[0]["val_loss"] == records(whole, "epoch")[0]["val_loss"]


@pytest.mark.slow
def test_two_gloo_ranks_train_the_mixture_as_one_process(mix, tmp_path) -> None:
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert train(mix, single, *WEIGHTS, "--epochs", "1") == 0
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", *mix, "--out", str(ddp), *COMMON, *WEIGHTS,
         "--epochs", "1", "--nproc-per-node", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_allclose(step_losses(ddp), step_losses(single), rtol=1e-5)
    (one,), (two,) = records(single, "epoch"), records(ddp, "epoch")
    assert one["source_samples"] == two["source_samples"] == [96, 32]  # summed over ranks
    assert two["val_samples"] == 26 and two["top1"] == one["top1"]
