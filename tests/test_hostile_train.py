"""dlpipe train under what a cluster and a tired person do: process-group signals, a killed
launcher, a hung rank, broken and foreign checkpoints, another worker count, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_train import COLOURS, COMMON, colour_samples, write_colours

import dlpipe
from dlpipe.cli import main
from dlpipe.train import checkpoint as ckpt

TESTS = Path(__file__).resolve().parent
HANG_S = 600  # a bound on a hang only: every wait here is for a state, not a duration

HOSTILE_MODELS = """
import os, sys, time
from pathlib import Path
from torch import nn
from trainer_models import TinyCNN


def raises(num_classes):
    raise RuntimeError("boom in the factory")


def not_a_module(num_classes):
    return {"weights": num_classes}


def wider_cnn(num_classes):
    model = TinyCNN(num_classes)
    model.head = nn.Linear(16, num_classes + 1)
    return model


def slow_start(num_classes):
    Path(os.environ["DLPIPE_TEST_MARKER"]).write_text("building")
    time.sleep(3600)  # held here: only the test's stop signal ends it
    return TinyCNN(num_classes)


class _HangsOnRank1(TinyCNN):
    calls = 0

    def forward(self, x):
        self.calls += 1
        if self.training and self.calls == 3 and os.environ.get("RANK") == "1":
            time.sleep(float(os.environ.get("DLPIPE_TEST_HANG_S", "8")))
        return super().forward(x)


def hangs_on_rank_1(num_classes):
    return _HangsOnRank1(num_classes)
"""

# torch.save held, with a marker file as it starts, until DLPIPE_TEST_RELEASE exists: signals
# sent meanwhile arrive during the checkpoint write, however slow the machine. Each signal the
# trainer's handler took is logged to DLPIPE_TEST_HANDLED, so the test sends the next only
# once the last was handled (two pending ones would merge into one).
SLOW_SAVE = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import torch
    from dlpipe.train.signals import StopSignals
    original, handle = torch.save, StopSignals._handle
    def slow_save(obj, f, *args, **kwargs):
        marker = Path(os.environ["DLPIPE_TEST_MARKER"])
        marker.write_text(str(int(marker.read_text() or 0) + 1) if marker.exists() else "1")
        while not os.path.exists(os.environ["DLPIPE_TEST_RELEASE"]):
            time.sleep(0.01)
        return original(obj, f, *args, **kwargs)
    def logged_handle(self, signum, frame):
        try:
            return handle(self, signum, frame)
        finally:
            with open(os.environ["DLPIPE_TEST_HANDLED"], "a") as log:
                log.write(signal.Signals(signum).name + "\\n")
    torch.save, StopSignals._handle = slow_save, logged_handle
    from dlpipe.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> str:
    return write_colours(tmp_path_factory.mktemp("hostile") / "lmdb", "lmdb")


@pytest.fixture(autouse=True)
def _models(monkeypatch, tmp_path) -> None:
    (tmp_path / "hostile_models.py").write_text(HOSTILE_MODELS)
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(tmp_path)]))
    monkeypatch.chdir(tmp_path)


def train(data: str, out: Path, *extra: str) -> int:
    return main(["train", data, "--out", str(out), *COMMON, *extra])


def steps_of(run: Path) -> list[int]:
    return [int(Path(p).name[5:13]) for p in ckpt.list_checkpoints(str(run))]


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def spawn(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


def wait_for(predicate, child: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def logged_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count('"event": "step"') if metrics.is_file() else 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# ---- signals ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_whole_process_group_checkpoints_and_resumes(
    signum, colours, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    child = spawn(
        "-m", "dlpipe", "train", colours, "--out", str(run), *COMMON, "--num-workers", "2",
        "--epochs", "200", start_new_session=True,
    )  # fmt: skip
    wait_for(lambda: logged_steps(run) >= 3 and len(children(child.pid)) >= 2, child)
    os.killpg(child.pid, signum)  # Slurm, systemd, a closed terminal; the loader's workers too
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "Traceback" not in out + err and error_lines(err) == []
    name = signal.Signals(signum).name
    assert f"stopped on {name}" in out
    stopped_at = ckpt.list_checkpoints(str(run))[0]
    state = ckpt.load_checkpoint(stopped_at)
    assert state["reason"] == "signal" and state["step"] >= 3
    resume = out.split("resume with: ")[1].split()[1:]  # dlpipe <train --config RUN/config.toml>
    assert main([*resume, "--max-steps", str(state["step"] + 2)]) == 0
    assert f"resumed from {stopped_at}" in capsys.readouterr().out
    assert steps_of(run)[0] == state["step"] + 2


@pytest.mark.slow
def test_more_signals_during_a_checkpoint_write_never_abandon_it(colours, tmp_path) -> None:
    run, marker = tmp_path / "run", tmp_path / "saving"
    handled, release = tmp_path / "handled", tmp_path / "release"
    child = spawn(
        "-c", SLOW_SAVE, "train", colours, "--out", str(run), *COMMON, "--epochs", "200",
        "--checkpoint-every", "2",
        env={"DLPIPE_TEST_MARKER": str(marker), "DLPIPE_TEST_HANDLED": str(handled),
             "DLPIPE_TEST_RELEASE": str(release)},
    )  # fmt: skip
    try:
        wait_for(marker.exists, child)  # the step-2 checkpoint is being written, held
        sent = [signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGINT]
        for count, signum in enumerate(sent, 1):
            child.send_signal(signum)  # a second Ctrl-C here would stop at once elsewhere
            wait_for(lambda n=count: _lines(handled) == n, child)
        assert marker.read_text() == "1"  # all four came during the first checkpoint write
        release.touch()
        out, err = child.communicate(timeout=HANG_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert handled.read_text().split() == [signal.Signals(s).name for s in sent]
    assert child.returncode == 0, err
    assert "Traceback" not in out + err and error_lines(err) == []
    assert "stopped on SIGTERM at step 3" in out
    assert steps_of(run) == [3, 2]
    for path in ckpt.list_checkpoints(str(run)):
        assert ckpt.load_checkpoint(path)["step"] in (2, 3)  # whole, not truncated
    assert not [p for p in os.listdir(run / "checkpoints") if ".tmp-" in p]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_during_start_up_is_one_line_without_a_traceback(
    signum, code, colours, tmp_path
) -> None:
    marker = tmp_path / "building"
    run = tmp_path / "run"
    child = spawn(
        "-m", "dlpipe", "train", colours, "--out", str(run), *COMMON,
        "--model", "hostile_models:slow_start", env={"DLPIPE_TEST_MARKER": str(marker)},
    )  # fmt: skip
    try:
        wait_for(marker.exists, child)  # the model factory is running, held there
        child.send_signal(signum)
        out, err = child.communicate(timeout=HANG_S)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == code
    assert "Traceback" not in out + err
    assert error_lines(err) == [err.strip()] and signal.Signals(signum).name in err
    assert not (run / "checkpoints").exists()


# ---- a killed launcher, a hung rank ------------------------------------------------------


@pytest.mark.slow
def test_killing_the_launcher_leaves_no_rank_training(colours, tmp_path) -> None:
    run = tmp_path / "run"
    child = spawn(
        "-m", "dlpipe", "train", colours, "--out", str(run), *COMMON, "--epochs", "500",
        "--nproc-per-node", "2", start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: logged_steps(run) >= 3, child, timeout_s=180)
        torchrun = children(child.pid)
        ranks = [pid for parent in torchrun for pid in children(parent)]
        assert len(torchrun) == 1 and len(ranks) == 2
        child.kill()  # kill -9: no handler runs in the launcher
        child.wait()
        deadline = time.monotonic() + HANG_S  # only a bound on a hang
        while any(map(alive, torchrun + ranks)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in torchrun + ranks if alive(pid)]  # nobody writes the run
        assert ckpt.load_checkpoint(ckpt.list_checkpoints(str(run))[0])["reason"] == "signal"
    finally:
        for pid in children(child.pid):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_hung_rank_is_a_named_timeout_not_a_silent_wait(colours, tmp_path) -> None:
    """Rank 1 hangs for an hour in its 3rd step: the run ends (within the hang bound, far
    less) only because rank 0's collective timed out and rank 1 was stopped, not waited for."""
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", colours, "--out", str(run), *COMMON,
         "--model", "hostile_models:hangs_on_rank_1", "--dist-timeout", "4",
         "--nproc-per-node", "2"],
        capture_output=True, text=True, timeout=HANG_S,
        env={**os.environ, "DLPIPE_TEST_HANG_S": "3600"},
    )  # fmt: skip
    assert done.returncode != 0
    assert "error: rank 0: agreeing on the step's loss" in done.stderr
    assert "--dist-timeout 4 s" in done.stderr


# ---- checkpoints --------------------------------------------------------------------------


def test_temp_files_of_a_killed_write_are_removed_and_nothing_else(colours, tmp_path) -> None:
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "2") == 0
    folder = run / "checkpoints"
    ours = [folder / "step-00000003.pt.tmp-4242", folder / ".best.pt.tmp-4242"]
    theirs = [folder / "step-00000003.pt.tmp-notes", folder / "notes.txt", run / "step.pt.tmp-1"]
    for path in ours + theirs:
        path.write_bytes(b"half a checkpoint")
    assert train(colours, run, "--epochs", "3", "--max-steps", "3") == 0
    assert not any(p.exists() for p in ours)
    assert all(p.read_bytes() == b"half a checkpoint" for p in theirs)
    assert steps_of(run) == [3, 2]


def test_pruning_keeps_the_checkpoint_just_written_over_broken_and_foreign_ones(tmp_path) -> None:
    run = tmp_path / "run"
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, folder / "step-00000003.pt")
    (folder / "step-00000005.pt").write_bytes(b"PK\x03\x04 truncated")
    torch.save({"w": torch.ones(2)}, folder / "step-00000007.pt")
    torch.save({"w": torch.ones(2)}, folder / "step-00000009.pt")  # not this timeline's
    removed = ckpt.prune_checkpoints(str(run), 2, newest=str(folder / "step-00000007.pt"))
    assert removed == [str(folder / "step-00000005.pt")]
    assert steps_of(run) == [9, 7, 3]


def test_a_broken_newest_checkpoint_is_set_aside_and_the_new_one_kept(colours, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "6", "--checkpoint-every", "2") == 0
    newest = run / "checkpoints" / "step-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a crash while copying it elsewhere
    assert train(colours, run, "--epochs", "3", "--max-steps", "5", "--keep-last", "1") == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 4" in out and "set aside" in out
    assert steps_of(run) == [5]  # the new one, not the broken step 6
    assert ckpt.load_checkpoint(ckpt.list_checkpoints(str(run))[0])["step"] == 5
    assert len((run / "checkpoints" / "step-00000006.pt.broken").read_bytes()) == 1000
    assert train(colours, run, "--epochs", "3", "--max-steps", "7") == 0
    assert "resumed from" in capsys.readouterr().out and steps_of(run)[0] == 7


def test_when_every_checkpoint_is_broken_each_is_named_and_nothing_restarts(
    colours, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "4", "--checkpoint-every", "2") == 0
    capsys.readouterr()
    paths = ckpt.list_checkpoints(str(run))
    for path in paths:
        Path(path).write_bytes(b"not a checkpoint")
    assert train(colours, run, "--epochs", "3") == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == [err.strip()]
    assert all(os.path.basename(p) in err for p in paths) and "--resume PATH" in err
    assert steps_of(run) == [4, 2] and "step 1" not in out
    assert all(Path(p).read_bytes() == b"not a checkpoint" for p in paths)


def test_resume_none_in_a_folder_with_another_run_is_refused(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "2") == 0
    before = {p: Path(p).read_bytes() for p in ckpt.list_checkpoints(str(run))}
    capsys.readouterr()
    assert train(colours, run, "--epochs", "3", "--resume", "none", "--max-steps", "1") == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [err.strip()]
    assert "--resume auto" in err and "another --out" in err and "step-00000002.pt" in err
    assert {p: Path(p).read_bytes() for p in ckpt.list_checkpoints(str(run))} == before


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(colours, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "6", "--checkpoint-every", "2",
                 "--keep-last", "3") == 0  # fmt: skip
    older = ckpt.list_checkpoints(str(run))[-1]  # step 2
    assert train(colours, run, "--epochs", "3", "--resume", older, "--max-steps", "3") == 0
    assert steps_of(run) == [3, 2]
    names = sorted(os.listdir(run / "checkpoints"))
    assert "step-00000004.pt.superseded" in names and "step-00000006.pt.superseded" in names
    capsys.readouterr()
    assert train(colours, run, "--epochs", "3", "--max-steps", "4") == 0
    assert "step-00000003.pt (step 3" in capsys.readouterr().out


def test_the_printed_resume_command_resumes_a_resume_none_run(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "1", "--resume", "none", "--max-steps", "3") == 0
    out = capsys.readouterr().out
    assert "reached --max-steps 3 at step 3" in out
    resume = out.split("resume with: ")[1].split()[1:]
    assert resume[:2] == ["train", "--config"]
    assert main(resume) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "(step 3, epoch 1)" in out
    assert steps_of(run)[0] == 6  # the epoch's end, not a restart nor a stop at step 3
    logged = [r for r in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in r]
    assert len([r for r in logged if '"event": "step"' in r]) == 6


def test_resume_with_another_worker_count_continues_exactly(colours, tmp_path) -> None:
    """The trainer's own advice (stop, run bench-loader, resume with its workers) works."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    assert train(colours, run, "--epochs", "3", "--max-steps", "2") == 0  # --num-workers 0
    assert train(colours, run, "--epochs", "3", "--max-steps", "5", "--num-workers", "1") == 0
    assert train(colours, whole, "--epochs", "3", "--max-steps", "5") == 0
    losses = [
        [r["loss"] for r in map(json.loads, (f / "metrics.jsonl").read_text().splitlines())
         if r["event"] == "step"]
        for f in (run, whole)
    ]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 5


def test_spawned_loader_workers_start_with_stop_signals_blocked(colours, spawn_masks) -> None:
    """Under spawn a worker imports for a while before it can ignore anything: a process-group
    SIGTERM then must stay pending in it, not kill it (multiprocessing's resource tracker
    unblocks the signals when it starts, which the block has to survive)."""
    loader = dlpipe.make_loader(
        colours,
        "train",
        dlpipe.LoaderConfig(batch_size=8, image_size=16),
        workers={"num_workers": 2, "multiprocessing_context": "spawn"},
    )
    next(iter(loader))
    loader.close()
    stop = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    assert len(spawn_masks) == 2 and all(stop <= mask for mask in spawn_masks), spawn_masks
    assert not stop & signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_loader_workers_ignore_stop_signals_from_others_and_end_on_their_parents(colours):
    before = set(children(os.getpid()))
    loader = dlpipe.make_loader(
        colours, "train", dlpipe.LoaderConfig(batch_size=8, image_size=16), workers=2
    )
    batches = iter(loader)
    next(batches)
    workers = sorted(set(children(os.getpid())) - before)
    assert len(workers) == 2
    for pid in workers:  # what killpg from Slurm, systemd or a terminal does to them
        for name in ("TERM", "INT", "HUP"):
            subprocess.run(["kill", f"-{name}", str(pid)], check=True)
    assert sum(len(labels) for _, labels in batches) == 96 - 8  # a killed worker would raise
    assert all(map(alive, workers))
    os.kill(workers[0], signal.SIGTERM)  # the parent's own: multiprocessing's terminate at exit
    deadline = time.monotonic() + HANG_S  # only a bound on a hang
    while alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(workers[0])
    loader.close()
    assert not set(children(os.getpid())) - before  # ended and reaped, no zombie left


def test_an_in_process_run_leaves_no_worker_behind(colours, tmp_path) -> None:
    before = set(children(os.getpid()))
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "2", "--max-steps", "2", "--num-workers", "2") == 0
    assert not set(children(os.getpid())) - before


# ---- bad input: one error line, exit 2 ------------------------------------------------------


def _textless(path: Path) -> str:
    with dlpipe.DatasetWriter(out=str(path), format="lmdb", classes=list(COLOURS)) as writer:
        for i in range(16):
            writer.write("train", {"__key__": f"t{i}", "txt": b"x", "cls": str(i % 4).encode()})
    return str(path)


@pytest.mark.parametrize(
    ("args", "toml", "message"),
    [
        (["--model", "os:system"], None, "os.system(num_classes=4) raised TypeError"),
        (["--model", ":"], None, "is not a torchvision model name"),
        (["--model", "hostile_models:raises"], None, "raised RuntimeError: boom in the factory"),
        (["--model", "hostile_models:not_a_module"], None, "returned dict, not a torch"),
        ([], b"[optim]\nmomentum = -5\n", "optim.momentum = -5.0 must be in [0, 1)"),
        ([], b"[run]\nepochs = 3\n# caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 22)"),
        ([], b"[optim]\nmomentum = nan\n", "optim.momentum = nan must be a finite number"),
        (["--lr", "-0.1"], None, "optim.lr = -0.1 must not be negative"),
        (["--weight-decay", "-1"], None, "optim.weight_decay = -1.0 must not be negative"),
        (["--label-smoothing", "1"], None, "label_smoothing = 1.0 must be in [0, 1)"),
        (["--epochs", "-1"], None, "run.epochs = -1 must be a positive integer"),
        (["--clip-grad", "0"], None, "optim.clip_grad = 0.0 must be positive"),
        (["--dist-timeout", "0"], None, "run.dist_timeout_s = 0.0 must be positive"),
        (["--seed", "-1"], None, "run.seed = -1 must be in 0.."),
        (["--image-size", "5000"], None, "data.image_size = 5000 is above 4096"),
        (["--val-split", "valid"], None, "has no split 'valid'"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    args, toml, message, colours, tmp_path, capsys
) -> None:
    extra = list(args)
    if toml is not None:
        (tmp_path / "run.toml").write_bytes(toml)
        extra += ["--config", str(tmp_path / "run.toml")]
    assert train(colours, tmp_path / "run", *extra) == 2
    out, err = capsys.readouterr()
    assert error_lines(err) == [err.strip()] and message in err, err
    assert "Traceback" not in out + err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_dataset_without_an_image_field_is_refused(tmp_path, capsys) -> None:
    data = _textless(tmp_path / "text")
    assert train(data, tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [err.strip()] and "has no image field (fields: " in err


@pytest.mark.parametrize(
    ("model", "flags", "message"),
    [
        ("hostile_models:wider_cnn", [], "holds 'head.weight' with shape [4, 16], this model"),
        ("trainer_models:tiny_cnn", ["--optimizer", "adamw"], "is of --optimizer sgd"),
    ],
)
def test_a_checkpoint_of_another_model_or_optimizer_is_named(
    model, flags, message, colours, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    assert train(colours, run, "--epochs", "3", "--max-steps", "2") == 0
    capsys.readouterr()
    assert train(colours, run, "--epochs", "3", "--model", model, *flags) == 2
    err = capsys.readouterr().err
    assert error_lines(err) == [err.strip()] and message in err, err
    assert "step-00000002.pt" in err
    assert steps_of(run) == [2]


def test_a_missing_val_split_is_a_warning_and_training_goes_on(tmp_path, capsys) -> None:
    data = tmp_path / "noval"
    with dlpipe.DatasetWriter(out=str(data), format="lmdb", classes=list(COLOURS)) as writer:
        for sample in colour_samples(32, 3):
            writer.write("train", sample)
    assert train(str(data), tmp_path / "run", "--epochs", "1") == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no split 'val'" in warnings[0] and "without validation" in err
    assert steps_of(tmp_path / "run") == [2]


def test_bad_input_under_nproc_per_node_is_one_line_before_torchrun(colours, tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", colours, "--out", str(tmp_path / "run"),
         *COMMON, "--model", "hostile_models:raises", "--nproc-per-node", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert error_lines(done.stderr) == [done.stderr.strip()]
    assert "boom in the factory" in done.stderr
    assert "torch.distributed" not in done.stderr and "Traceback" not in done.stderr


def test_user_text_holding_rich_markup_is_printed_as_is(colours, tmp_path, capsys) -> None:
    data = tmp_path / "data[/b][red]"
    shutil.copytree(colours, data)
    run = tmp_path / "run[/b]"
    assert train(str(data), run, "--epochs", "1", "--max-steps", "2") == 0
    out = capsys.readouterr().out
    assert f"data {data} (lmdb)" in out and f"checkpoint {run}" in out
    assert train(str(data), run, "--epochs", "1") == 0  # to the end: the summary's paths
    out = capsys.readouterr().out
    assert f"resumed from {run}" in out and f"metrics {run}" in out
