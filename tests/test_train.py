"""dlpipe train end to end on CPU: formats, accuracy, resume, signals, DDP, AMP, OOM, stopping."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FORMAT_NAMES
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.train import checkpoint as ckpt

TESTS = Path(__file__).resolve().parent
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (40, 60, 220),
    "yellow": (230, 220, 40),
}
# 96 train samples = 6 steps of 16 per epoch; 13 val samples split unevenly over 2 ranks
COMMON = [
    "--model", "trainer_models:tiny_cnn", "--image-size", "16", "--num-workers", "0",
    "--batch-size", "16", "--lr", "0.2", "--warmup-epochs", "0", "--log-every", "1",
]  # fmt: skip


def colour_samples(count: int, seed: int) -> list[dict]:
    """Noisy 20 px JPEGs whose class is their colour: separable, but not by one pixel."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        label = i % len(COLOURS)
        base = np.array(list(COLOURS.values())[label], dtype=np.float64)
        pixels = np.clip(base + rng.normal(0, 45, size=(20, 20, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out.append(
            {"__key__": f"s{seed}-{i:04d}", "jpg": buf.getvalue(), "cls": str(label).encode()}
        )
    return out


def write_colours(
    path: Path, fmt: str, train: int = 96, val: int = 13, shard_samples: int = 16
) -> str:
    limits = dlpipe.ShardLimits(max_shard_samples=shard_samples)
    with dlpipe.DatasetWriter(out=str(path), format=fmt, classes=list(COLOURS), limits=limits) as w:
        for split, samples in (
            ("train", colour_samples(train, 1)),
            ("val", colour_samples(val, 2)),
        ):
            for sample in samples:
                w.write(split, sample)
    return str(path)


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("colours")
    return {fmt: write_colours(root / fmt, fmt) for fmt in FORMAT_NAMES}


@pytest.fixture(autouse=True)
def _user_models(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def train(data: str, out: Path, *extra: str) -> int:
    return main(["train", data, "--out", str(out), *COMMON, *extra])


def records(run: Path, event: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def step_losses(run: Path) -> list[float]:
    return [r["loss"] for r in records(run, "step")]


def losses_by_step(run: Path) -> dict[int, float]:
    """Each step's loss, the last one logged (a run killed after a checkpoint logs the steps
    after it twice: before the kill and again when resumed)."""
    return {r["step"]: r["loss"] for r in records(run, "step")}


def sigterm_after_3_steps(child: subprocess.Popen, run: Path) -> tuple[str, str]:
    """A pre-emption: SIGTERM once the run has logged 3 steps (that state is waited for, not a
    time: the bound is only on a hang); (stdout, stderr) at its exit."""
    deadline, metrics = time.monotonic() + 600, run / "metrics.jsonl"
    try:
        while not (metrics.is_file() and metrics.read_text().count('"step"') >= 3):
            assert child.poll() is None, ("ended before 3 steps", child.communicate())
            assert time.monotonic() < deadline, "logged no 3 steps"
            time.sleep(0.05)
    except AssertionError:
        child.kill()
        raise
    child.send_signal(signal.SIGTERM)
    return child.communicate(timeout=600)


def newest(run: Path) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(str(run))[0])


def wait_for_checkpoint(child: subprocess.Popen, run: Path, step: int) -> None:
    """Until the run has written a whole checkpoint of `step` or later (a state waited for,
    not a time: the bound is only on a hang)."""
    deadline = time.monotonic() + 600
    while not any(
        ckpt.looks_whole(str(p)) and int(p.stem.split("-")[1]) >= step
        for p in (run / "checkpoints").glob("step-*.pt")
    ):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"no checkpoint of step {step}: {child.communicate()}")
        time.sleep(0.05)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_trains_on_every_format_with_a_complete_run_folder(fmt, colours, tmp_path) -> None:
    run = tmp_path / "run"
    assert train(colours[fmt], run, "--epochs", "2") == 0
    (_, epoch2) = records(run, "epoch")
    assert epoch2["val_samples"] == 13 and sum(map(sum, epoch2["confusion"])) == 13
    assert set(epoch2["per_class_accuracy"]) == set(COLOURS)
    for key in ("train_loss", "val_loss", "top1", "top5", "lr", "samples_per_s", "data_wait"):
        assert epoch2[key] is not None, key
    assert len(step_losses(run)) == 12
    assert (run / "config.toml").is_file() and (run / "confusion.png").is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    state = torch.load(ckpt.list_checkpoints(str(run))[0], weights_only=True)
    assert state["step"] == 12 and state["epoch"] == 2
    assert not [k for k in state["model"] if k.startswith(("module.", "_orig_mod."))]
    assert (run / "checkpoints" / "best.pt").is_file()


def test_a_tiny_model_learns_a_separable_dataset(colours, tmp_path) -> None:
    run = tmp_path / "run"
    assert train(colours["lmdb"], run, "--epochs", "8", "--optimizer", "adamw", "--lr", "0.02") == 0
    top1 = records(run, "epoch")[-1]["top1"]
    assert top1 >= 0.75, f"val top-1 {top1} (chance is 0.25)"


@pytest.mark.parametrize(
    ("fmt", "loader", "reference"),
    [
        ("lmdb", [], []),
        ("wds", [], []),
        ("wds", ["--engine", "threads", "--num-workers", "2"], []),
        ("wds", ["--num-workers", "2"], ["--num-workers", "2"]),
    ],
)
def test_resume_replays_the_same_batches_and_reaches_identical_weights(
    fmt, loader, reference, colours, tmp_path
) -> None:
    """Interrupted mid-epoch and resumed, a run ends with the weights of the uninterrupted
    `reference` run. The thread engine's batches are the 0-worker loader's; a wds stream on
    worker processes is batched by the workers in turn (here from shards of 10 samples,
    batches of 16), so its reference has as many, and the resumed workers go on with their
    stretches in the same turn."""
    data = colours[fmt] if not reference else write_colours(tmp_path / fmt, fmt, shard_samples=10)
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train(data, whole, "--epochs", "3", "--max-steps", "9", *reference) == 0
    assert train(data, split, "--epochs", "3", "--max-steps", "3", *loader) == 0
    assert newest(split)["reason"] == "max_steps"
    assert train(data, split, "--epochs", "3", "--max-steps", "9", *loader) == 0
    if "threads" in loader:
        assert 'engine = "threads"' in (split / "config.toml").read_text()
    assert step_losses(split) == step_losses(whole) and len(step_losses(whole)) == 9
    a, b = newest(whole), newest(split)
    assert a["step"] == b["step"] == 9
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert records(split, "epoch")[0]["val_loss"] == records(whole, "epoch")[0]["val_loss"]


@pytest.mark.parametrize("fmt", ["lmdb", "wds"])
def test_the_next_epoch_begins_before_the_checkpoint_and_resumes_from_it_exactly(
    fmt, colours, tmp_path, monkeypatch, capsys
) -> None:
    """The workers start on epoch 2 while epoch 1 is evaluated and checkpointed: the loader
    is iterated before the epoch's checkpoint is written, and a run resumed from that
    checkpoint (its loader state: epoch 2 begun, nothing drawn) ends as the whole run."""
    from dlpipe.loading.loader import PreparedLoader
    from dlpipe.train.trainer import Trainer

    events: list[str] = []
    real_iter, real_save = PreparedLoader.__iter__, Trainer._save

    def spied_iter(self):
        events.append(f"iter {self._identity['split']}")
        return real_iter(self)

    def spied_save(self, reason, **kwargs):
        events.append(f"save {reason}")
        return real_save(self, reason, **kwargs)

    monkeypatch.setattr(PreparedLoader, "__iter__", spied_iter)
    monkeypatch.setattr(Trainer, "_save", spied_save)
    workers = ["--num-workers", "2", "--keep-last", "3"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train(colours[fmt], whole, "--epochs", "3", *workers) == 0
    assert "train loader engine=processes num_workers=2 decode=cpu" in capsys.readouterr().out
    train_iters = [e for e in events if e in ("iter train", "save epoch")]
    begun_early = ["iter train", "iter train", "save epoch", "iter train", "save epoch"]
    assert train_iters == [*begun_early, "save epoch"]  # none after the last epoch
    epoch1 = whole / "checkpoints" / "step-00000006.pt"
    assert train(colours[fmt], resumed, "--epochs", "3", "--resume", str(epoch1), *workers) == 0
    assert step_losses(resumed) == step_losses(whole)[6:]
    a, b = newest(whole), newest(resumed)
    assert a["step"] == b["step"] == 18
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_sigterm_checkpoints_exits_zero_and_the_run_resumes_exactly(colours, tmp_path) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "dlpipe", "train", colours["lmdb"], "--out", str(run)]
    child = subprocess.Popen(
        [*command, *COMMON, "--epochs", "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=tmp_path,
    )  # fmt: skip
    out, err = sigterm_after_3_steps(child, run)
    assert child.returncode == 0, err
    assert "stopped on SIGTERM" in out and "resume with: dlpipe train --config" in out
    state = newest(run)
    assert state["reason"] == "signal"
    stopped = state["step"]
    resume = out.split("resume with: ")[1].split()[1:]  # dlpipe <train --config ...>
    assert main([*resume, "--max-steps", str(stopped + 3)]) == 0
    whole = tmp_path / "whole"
    assert train(colours["lmdb"], whole, "--epochs", "200", "--max-steps", str(stopped + 3)) == 0
    assert step_losses(run) == step_losses(whole)


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_and_validate_exactly(colours, tmp_path) -> None:
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert train(colours["lmdb"], single, "--epochs", "2") == 0
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", colours["lmdb"], "--out", str(ddp), *COMMON,
         "--epochs", "2", "--nproc-per-node", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 16 = 2 ranks x micro-batch 8 x 1 accumulation steps" in done.stdout
    np.testing.assert_allclose(step_losses(ddp), step_losses(single), rtol=1e-5)
    for a, b in zip(records(single, "epoch"), records(ddp, "epoch"), strict=True):
        assert b["val_samples"] == 13  # every val sample once: 7 + 6, none padded
        assert a["confusion"] == b["confusion"]
        assert b["top1"] == a["top1"] and b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
    assert newest(ddp)["world_size"] == 2


def test_fp16_scaler_skips_an_overflowing_step_without_advancing_the_schedule(
    colours, tmp_path
) -> None:
    run = tmp_path / "run"
    args = ["--precision", "fp16", "--model", "trainer_models:overflows_once", "--epochs", "1"]
    assert train(colours["lmdb"], run, *args) == 0
    state = newest(run)
    assert state["runner"]["scaler"]["scale"] == 2.0**15  # 2**16 halved once
    assert state["trainer"]["skipped_steps"] == 1
    assert state["scheduler"]["last_epoch"] == state["step"] - 1 == 5
    assert records(run, "epoch")[0]["val_loss"] is not None


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_global_batch(
    colours, tmp_path, capsys
) -> None:
    backed, reference = tmp_path / "backed", tmp_path / "reference"
    args = ["--epochs", "1", "--micro-batch", "8"]
    assert train(colours["lmdb"], backed, *args, "--model", "trainer_models:oom_above_4") == 0
    out = capsys.readouterr().out
    assert "out of memory in step 1: micro-batch now 4, accumulation 4" in out
    assert "global batch 16" in out
    (event,) = records(backed, "oom_backoff")
    assert event["micro_batch"] == 4 and event["accumulation"] == 4
    assert newest(backed)["runner"]["splits"] == 2
    assert train(colours["lmdb"], reference, "--epochs", "1", "--micro-batch", "4") == 0
    np.testing.assert_allclose(step_losses(backed), step_losses(reference), rtol=1e-6)


def test_early_stopping_on_a_flat_val_loss(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = ["--epochs", "10", "--lr", "0", "--early-stop-patience", "2"]
    assert train(colours["lmdb"], run, *args) == 0
    assert len(records(run, "epoch")) == 3
    assert "early stop: val loss has not improved for 2 epochs" in capsys.readouterr().out


def test_a_diverging_run_stops_with_a_clear_message(colours, tmp_path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[model]\nname = "trainer_models:diverges"\n[run]\nmax_nonfinite_steps = 3\n')
    code = main(["train", colours["lmdb"], "--out", str(tmp_path / "r"), *COMMON[2:], "--config",
                 str(config), "--epochs", "2"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "not finite for 3 steps in a row" in err and "--clip-grad" in err


def test_resume_auto_skips_a_truncated_newest_checkpoint(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(colours["hdf5"], run, "--epochs", "3", "--max-steps", "8") == 0
    paths = ckpt.list_checkpoints(str(run))
    assert [os.path.basename(p) for p in paths] == ["step-00000008.pt", "step-00000006.pt"]
    Path(paths[0]).write_bytes(Path(paths[0]).read_bytes()[:1000])  # a crash mid-copy elsewhere
    assert train(colours["hdf5"], run, "--epochs", "3", "--max-steps", "10") == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "step-00000008.pt" in out
    assert "resumed from" in out and "step 6" in out
    assert newest(run)["step"] == 10


def test_a_finished_run_says_so_and_does_nothing(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(colours["lmdb"], run, "--epochs", "1") == 0
    assert train(colours["lmdb"], run, "--epochs", "1") == 0
    assert "already complete" in capsys.readouterr().out
    assert len(records(run, "epoch")) == 1


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_every_rank_and_exits_zero(colours, tmp_path) -> None:
    run = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-m", "dlpipe", "train", colours["wds"], "--out", str(run), *COMMON,
         "--epochs", "500", "--nproc-per-node", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    out, err = sigterm_after_3_steps(child, run)
    assert child.returncode == 0, err[-3000:]
    assert "resume with: dlpipe train --config" in out and "--nproc-per-node 2" in out
    state = newest(run)
    assert state["reason"] == "signal" and len(state["ranks"]) == 2
    resume = out.split("resume with: ")[1].split()[1:]  # dlpipe <train --config ... -n 2>
    stopped_at = ckpt.list_checkpoints(str(run))[0]
    more = str(state["step"] + 2)
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", *resume, "--max-steps", more],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {stopped_at}" in done.stdout
    assert newest(run)["step"] == state["step"] + 2


def test_the_input_bound_advice_is_printed_once_a_run(colours, tmp_path, capsys, monkeypatch):
    """Every epoch of an input-bound run waits for data; the advice comes once, each epoch's
    line still gives its data wait."""
    from dlpipe.train import progress

    monkeypatch.setattr(progress, "INPUT_BOUND_SHARE", -1.0)  # every epoch is input-bound
    assert train(colours["lmdb"], tmp_path / "run", "--epochs", "3") == 0
    out = capsys.readouterr().out
    assert out.count("input-bound: waiting for data") == 1
    assert out.count("data wait") == 3
