"""dlpipe train's schedule and resume across world sizes: the schedule counts the steps the
loader really yields, a 2-rank run resumes on 1 rank with the same global batch, a stream
refuses another world size, and a checkpoint of an older layout is one clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import COMMON, _user_models, newest, records, step_losses, train, write_colours

from dlpipe.cli import main
from dlpipe.train import checkpoint as ckpt

__all__ = ["_user_models"]  # the autouse fixture that makes tests/trainer_models importable


def train_on_2_ranks(data: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", data, "--out", str(out), *COMMON,
         "--nproc-per-node", "2", *extra],
        capture_output=True, text=True, cwd=out.parent, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def odd_wds(tmp_path_factory) -> str:
    """90 train samples in shards of 16, 16, 16, 16, 16 and 10: 4 readers at 2 ranks x 2
    workers hold unequal shares, and no share is a whole number of batches of 8."""
    return write_colours(tmp_path_factory.mktemp("odd") / "wds", "wds", train=90)


@pytest.fixture(scope="module")
def lmdb(tmp_path_factory) -> str:
    return write_colours(tmp_path_factory.mktemp("elastic") / "lmdb", "lmdb")


@pytest.mark.slow
def test_the_schedule_counts_the_steps_wds_yields_on_2_ranks_with_2_workers(
    odd_wds, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    done = train_on_2_ranks(odd_wds, run, "--epochs", "2", "--num-workers", "2")
    (schedule,) = records(run, "schedule")
    epochs = records(run, "epoch")
    assert schedule["total_steps"] == newest(run)["step"] == len(step_losses(run))
    assert [e["steps"] for e in epochs] == [schedule["steps_per_epoch"]] * 2
    assert f"{schedule['steps_per_epoch']} steps per epoch" in done.stdout
    # another world size cannot continue a stream: one line that says why and what to do
    assert main(["train", "--config", str(run / "config.toml"), "--epochs", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint ")
    assert "written by 2 ranks, this run has 1" in err[0] and "--nproc-per-node 2" in err[0]
    assert "deals whole shards" in err[0]


@pytest.mark.slow
def test_a_2_rank_run_resumes_on_1_rank_and_ends_like_a_1_rank_run(lmdb, tmp_path, capsys) -> None:
    single, elastic = tmp_path / "single", tmp_path / "elastic"
    assert train(lmdb, single, "--epochs", "2") == 0
    done = train_on_2_ranks(lmdb, elastic, "--epochs", "2", "--max-steps", "4")
    assert "global batch 16 = 2 ranks x micro-batch 8" in done.stdout
    assert newest(elastic)["world_size"] == 2 and newest(elastic)["step"] == 4
    capsys.readouterr()
    assert main(["train", "--config", str(elastic / "config.toml")]) == 0
    out = capsys.readouterr().out
    assert "global batch 16 = 1 rank x micro-batch 16 x 1 accumulation steps" in out
    assert "(step 4, epoch 1, saved by 2 ranks, now on 1)" in out
    a, b = newest(single), newest(elastic)
    assert a["step"] == b["step"] == 12 and b["world_size"] == 1
    # the first 4 steps ran as DDP (gradients averaged over 2 ranks): equal up to rounding
    np.testing.assert_allclose(step_losses(elastic), step_losses(single), rtol=1e-5)
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-5, atol=1e-6)
    assert records(elastic, "epoch")[-1]["confusion"] == records(single, "epoch")[-1]["confusion"]


def test_a_checkpoint_of_an_older_layout_is_one_clear_error(lmdb, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(lmdb, run, "--epochs", "1", "--max-steps", "2") == 0
    path = ckpt.list_checkpoints(str(run))[0]
    old = torch.load(path, weights_only=True)
    old["version"] = 1
    torch.save(old, path)
    capsys.readouterr()
    assert main(["train", "--config", str(run / "config.toml")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "has version 1, written by an older dlpipe" in line
    assert "start afresh in another --out" in line


def test_another_global_batch_is_refused_naming_the_one_to_use(lmdb, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(lmdb, run, "--epochs", "2", "--max-steps", "2") == 0
    capsys.readouterr()
    assert main(["train", "--config", str(run / "config.toml"), "--batch-size", "32"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "global batch of 16, this run has 32" in line and "--batch-size 16" in line
