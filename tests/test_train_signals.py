"""dlpipe train's stop signals and error lines as a cluster meets them: `--nproc-per-node 2`
(gloo, CPU) stopped by Ctrl-C twice, by a signal during start-up or after it finished, with a
hung rank; an error raised in a DataLoader worker; the epoch numbers metrics.jsonl writes.

Each run ends with the documented exit code (0 when stopped by a signal with a checkpoint,
128 + the signal during start-up, 1 when training fails, 2 on bad input), one final line, no
traceback, and the checkpoint kept and resumable. Nothing here sleeps a fixed time and hopes:
each signal waits for a state (a marker file a test model writes, a line of output, a
checkpoint in the run folder)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_hostile_train import HOSTILE_MODELS, children, error_lines, logged_steps, steps_of
from test_train import COLOURS, COMMON, TESTS, colour_samples, records, write_colours

import dlpipe
from dlpipe.cli import main
from dlpipe.train import checkpoint as ckpt
from dlpipe.train.signals import STOP_SIGNALS, Interrupted, StopSignals, startup_guard

# models for the runs below, loaded by every rank through --model signal_models:NAME
SIGNAL_MODELS = """
import os, signal, time
from pathlib import Path
import torch
from trainer_models import TinyCNN


def slow_save_cnn(num_classes):
    # the stop checkpoint's write (a save after the ranks agreed to stop) announces itself
    # (its pid in DLPIPE_TEST_MARKER), then waits for DLPIPE_TEST_RELEASE to exist; each stop
    # signal the trainer's handler took, and each rank's agreement to stop, is logged as
    # "pid SIGINT" / "pid COMMIT" to DLPIPE_TEST_HANDLED, so a test sends the next signal and
    # releases the write once the state it needs is there, however slow the machine
    from dlpipe.train.signals import StopSignals

    original, handle, commit = torch.save, StopSignals._handle, StopSignals.commit
    committed = []

    def log(what):
        if "DLPIPE_TEST_HANDLED" in os.environ:
            with open(os.environ["DLPIPE_TEST_HANDLED"], "a") as f:
                f.write(f"{os.getpid()} {what}\\n")

    def slow_save(obj, f, *args, **kwargs):
        if committed and "DLPIPE_TEST_MARKER" in os.environ:  # not when resumed in-process
            Path(os.environ["DLPIPE_TEST_MARKER"]).write_text(str(os.getpid()))
            while not os.path.exists(os.environ["DLPIPE_TEST_RELEASE"]):
                time.sleep(0.01)
        return original(obj, f, *args, **kwargs)

    def logged_handle(self, signum, frame):
        log(signal.Signals(signum).name)
        return handle(self, signum, frame)

    def logged_commit(self):
        commit(self)
        committed.append(True)
        log("COMMIT")

    torch.save, StopSignals._handle, StopSignals.commit = slow_save, logged_handle, logged_commit
    return TinyCNN(num_classes)


class _ChangesTheDataset(TinyCNN):
    calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 2 and os.environ.get("RANK", "0") == "0":
                manifest = Path(os.environ["DLPIPE_TEST_DATA"]) / "dlpipe.json"
                manifest.write_bytes(manifest.read_bytes() + b"\\n")  # another manifest
        return super().forward(x)


def changes_the_dataset(num_classes):
    return _ChangesTheDataset(num_classes)
"""


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> str:
    return write_colours(tmp_path_factory.mktemp("signals") / "lmdb", "lmdb")


@pytest.fixture(autouse=True)
def _models(monkeypatch, tmp_path) -> None:
    (tmp_path / "hostile_models.py").write_text(HOSTILE_MODELS)
    (tmp_path / "signal_models.py").write_text(SIGNAL_MODELS)
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(tmp_path)]))
    monkeypatch.chdir(tmp_path)


class Run:
    """``dlpipe train`` in a child process, its output read as it comes (`saw` a line)."""

    def __init__(self, data: str, out: Path, *extra: str, env: dict[str, str] | None = None):
        self.out = out
        self.child = subprocess.Popen(
            [sys.executable, "-m", "dlpipe", "train", data, "--out", str(out), *COMMON, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.child.stdout, self.lines)),
            threading.Thread(target=self._read, args=(self.child.stderr, self.errors)),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait_for(self, predicate, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.child.poll() is None, (
                "ended early",
                self.lines[-5:],
                "\n".join(self.errors),
            )
            assert time.monotonic() < deadline, ("timed out", self.lines[-5:], self.errors)
            time.sleep(0.05)

    def saw(self, start: str) -> bool:
        return any(line.startswith(start) for line in self.lines)

    def ranks(self) -> list[int]:
        """The rank processes (torchrun's children; the launcher's only child is torchrun)."""
        return [pid for torchrun in children(self.child.pid) for pid in children(torchrun)]

    def finish(self, timeout_s: float = 240) -> tuple[int, list[str], list[str]]:
        try:
            code = self.child.wait(timeout=timeout_s)
        finally:
            if self.child.poll() is None:
                os.killpg(self.child.pid, signal.SIGKILL)
            for pid in self.ranks():
                os.kill(pid, signal.SIGKILL)
        for reader in self._readers:
            reader.join()
        return code, self.lines, self.errors


def assert_stopped_with_a_checkpoint(code: int, out: list[str], err: list[str], run: Path):
    """Exit 0, nothing on stderr, the stop line then the resume command last; the checkpoint
    is whole and the run resumes from it (on one rank: lmdb resumes on another count)."""
    assert code == 0, err
    assert err == [], err  # no traceback, no error line, not even torchrun's banner
    assert out[-2].startswith("stopped on SIG") and out[-1].startswith("resume with: dlpipe")
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(str(run))[0])
    assert state["reason"] == "signal" and f"at step {state['step']};" in out[-2]
    assert not [p for p in os.listdir(run / "checkpoints") if ".tmp-" in p]
    more = str(state["step"] + 1)
    assert main(["train", "--config", str(run / "config.toml"), "--max-steps", more]) == 0
    assert steps_of(run)[0] == state["step"] + 1


def one_error_line(code: int, expected: int, err: list[str]) -> str:
    """The one line a failed run printed on stderr (nothing else: no traceback)."""
    assert code == expected, err
    assert len(err) == 1 and error_lines(err[0]) == err, err
    return err[0]


# ---- Ctrl-C twice, a signal after the run finished -----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("when", ["during the checkpoint write", "after the checkpoint"])
def test_a_double_ctrl_c_keeps_the_checkpoint_and_exits_0(when, colours, tmp_path) -> None:
    run, marker, release = tmp_path / "run", tmp_path / "saving", tmp_path / "release"
    handled = tmp_path / "handled"
    if when == "after the checkpoint":
        release.touch()  # checkpoint writes are not held
    started = Run(
        colours, run, "--epochs", "500", "--nproc-per-node", "2",
        "--model", "signal_models:slow_save_cnn",
        env={"DLPIPE_TEST_MARKER": str(marker), "DLPIPE_TEST_RELEASE": str(release),
             "DLPIPE_TEST_HANDLED": str(handled)},
    )  # fmt: skip

    def handled_by_the_writer(count: int) -> bool:
        writer = marker.read_text() if marker.exists() else None
        lines = handled.read_text().splitlines() if handled.exists() else []
        ranks_agreed = sum(line.endswith(" COMMIT") for line in lines) == 2
        return ranks_agreed and writer is not None and lines.count(f"{writer} SIGINT") >= count

    started.wait_for(lambda: logged_steps(run) >= 2)
    started.child.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher
    if when == "during the checkpoint write":
        # both ranks agreed to stop, the stop checkpoint's write is held
        started.wait_for(lambda: handled_by_the_writer(1))
    else:
        started.wait_for(lambda: started.saw("stopped on SIGINT"))
    started.child.send_signal(signal.SIGINT)
    if when == "during the checkpoint write":
        started.wait_for(lambda: handled_by_the_writer(2))  # the second came during the write
        release.touch()
    assert_stopped_with_a_checkpoint(*started.finish(), run)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after done: to the launcher", "at the last checkpoint: ranks"])
def test_sigterm_twice_as_the_run_finishes_changes_nothing(when, colours, tmp_path) -> None:
    run = tmp_path / "run"
    started = Run(colours, run, "--epochs", "1", "--nproc-per-node", "2")
    if when.startswith("after done"):
        started.wait_for(lambda: started.saw("done:"))  # printed as the ranks end
        pids = [started.child.pid]
    else:
        pids = started_ranks(started)
        started.wait_for(lambda: (run / "checkpoints" / "step-00000006.pt").exists())
    for pid in pids:
        for _ in range(2):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                break  # this rank had ended already
    code, out, err = started.finish()
    assert code == 0 and err == [], err
    assert any(line.startswith("done: val top-1") for line in out), out[-3:]
    assert out[-1].startswith("metrics ") and steps_of(run) == [6]


def started_ranks(started: Run) -> list[int]:
    started.wait_for(lambda: len(started.ranks()) == 2)
    return started.ranks()


@pytest.mark.slow
def test_sigterm_to_a_rank_after_its_stop_checkpoint_exits_0(colours, tmp_path) -> None:
    run = tmp_path / "run"
    started = Run(colours, run, "--epochs", "500", "--nproc-per-node", "2")
    started.wait_for(lambda: logged_steps(run) >= 2)
    ranks = started_ranks(started)
    started.child.send_signal(signal.SIGTERM)  # the pre-emption notice
    started.wait_for(lambda: bool(ckpt.list_checkpoints(str(run))))
    for pid in ranks:  # then the node's own SIGTERM to every process of the job
        with contextlib.suppress(ProcessLookupError):  # it may have ended already
            os.kill(pid, signal.SIGTERM)
    assert_stopped_with_a_checkpoint(*started.finish(), run)


def test_sigterm_again_after_a_single_process_checkpointed_exits_0(colours, tmp_path) -> None:
    run = tmp_path / "run"
    started = Run(colours, run, "--epochs", "500")
    started.wait_for(lambda: logged_steps(run) >= 2)
    started.child.send_signal(signal.SIGTERM)
    started.wait_for(lambda: bool(ckpt.list_checkpoints(str(run))))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGINT):
        try:
            started.child.send_signal(signum)
        except ProcessLookupError:
            break
    assert_stopped_with_a_checkpoint(*started.finish(), run)


# ---- start-up ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "group"),
    [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGHUP, True), (signal.SIGINT, False)],
)
def test_a_stop_signal_during_start_up_of_2_ranks_is_one_line(
    signum, group, colours, tmp_path
) -> None:
    """SIGTERM to the launcher, or Ctrl-C and a closed terminal to its whole process group,
    while the ranks build the model (one may still be importing): 128 + the signal, one line."""
    run, marker = tmp_path / "run", tmp_path / "building"
    started = Run(
        colours, run, "--nproc-per-node", "2", "--model", "hostile_models:slow_start",
        env={"DLPIPE_TEST_MARKER": str(marker)},
    )  # fmt: skip
    started.wait_for(marker.exists)  # a rank is in the model factory (it sleeps for 60 s)
    if group:
        os.killpg(started.child.pid, signum)
    else:
        started.child.send_signal(signum)
    code, _out, err = started.finish()
    line = one_error_line(code, 128 + signum, err)
    assert f"stopped by {signal.Signals(signum).name} before the next checkpoint" in line
    assert not (run / "checkpoints").exists()


# ---- a hung rank ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_dist_timeout_naming_it(colours, tmp_path) -> None:
    """Rank 1 sleeps for an hour in its 3rd forward pass: the run ends at all (the finish's
    timeout is only a bound on a hang, far below that hour) because rank 1 was stopped, not
    waited for."""
    run = tmp_path / "run"
    started = Run(
        colours, run, "--nproc-per-node", "2", "--model", "hostile_models:hangs_on_rank_1",
        "--dist-timeout", "3", "--checkpoint-every", "2", "--epochs", "3",
        env={"DLPIPE_TEST_HANG_S": "3600"},
    )  # fmt: skip
    code, _out, err = started.finish(timeout_s=600)
    line = one_error_line(code, 1, err)
    assert line.startswith("error: rank 0: agreeing on the step's loss") and "3 s" in line
    assert "rank 1 never reached it (the last collective it entered: " in line
    assert steps_of(run) == [2]  # the step-2 checkpoint is kept and resumes
    assert main(["train", "--config", str(run / "config.toml"), "--max-steps", "4"]) == 0
    assert steps_of(run)[0] == 4


# ---- errors in DataLoader workers -------------------------------------------------------------


@pytest.mark.parametrize(
    "loader",
    [
        ["--num-workers", "2"],
        ["--num-workers", "0"],
        ["--num-workers", "2", "--engine", "threads"],
    ],
)
def test_a_dataset_changed_under_a_worker_is_its_own_error_line(
    loader, colours, tmp_path, capsys, monkeypatch
) -> None:
    """The manifest is replaced during epoch 1: the val loader's workers refuse the next
    shard; the run prints the error's own line (not torch's "Caught ... in DataLoader worker
    process 0" and the worker's traceback) and exits 2; the dataset's shards are untouched."""
    data = tmp_path / "data"
    shutil.copytree(colours, data)
    shards = {p.name: p.read_bytes() for p in data.iterdir() if p.name != "dlpipe.json"}
    monkeypatch.setenv("DLPIPE_TEST_DATA", str(data))
    code = main(["train", str(data), "--out", str(tmp_path / "run"), *COMMON, *loader,
                 "--model", "signal_models:changes_the_dataset", "--epochs", "2"])  # fmt: skip
    out, err = capsys.readouterr()
    line = one_error_line(code, 2, err.splitlines())
    assert "was replaced or removed while it was being read" in line and "shard val-" in line
    assert "Caught" not in out + err and "Traceback" not in out + err
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.name != "dlpipe.json"} == shards


def test_a_corrupt_sample_decoded_in_a_worker_is_its_own_error_line(tmp_path, capsys) -> None:
    data = tmp_path / "data"
    with dlpipe.DatasetWriter(out=str(data), format="lmdb", classes=list(COLOURS)) as writer:
        for sample in colour_samples(32, 1):
            writer.write("train", sample)
        for i, sample in enumerate(colour_samples(8, 2)):
            writer.write("val", {**sample, "jpg": b"\xff\xd8\xff not a JPEG"} if i == 5 else sample)
    args = ["train", str(data), "--out", str(tmp_path / "run"), *COMMON, "--epochs", "1"]
    assert main([*args, "--num-workers", "2"]) == 2
    _out, err = capsys.readouterr()
    line = one_error_line(2, 2, err.splitlines())
    assert line.startswith("error: sample 's2-0005' field 'jpg': ") and "Caught" not in err


@pytest.mark.slow
def test_a_worker_error_on_2_ranks_is_one_line_and_exit_2(colours, tmp_path) -> None:
    data = tmp_path / "data"
    shutil.copytree(colours, data)
    started = Run(
        str(data), tmp_path / "run", "--nproc-per-node", "2", "--num-workers", "1",
        "--model", "signal_models:changes_the_dataset", "--epochs", "2",
        env={"DLPIPE_TEST_DATA": str(data)},
    )  # fmt: skip
    code, _out, err = started.finish()
    line = one_error_line(code, 2, err)
    assert "was replaced or removed while it was being read" in line


# ---- epoch numbers ----------------------------------------------------------------------------


def test_metrics_and_console_number_epochs_alike_from_1(colours, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = ["train", colours, "--out", str(run), *COMMON, "--epochs", "3"]
    assert main([*args, "--max-steps", "8"]) == 0  # epoch 1, then 2 steps of epoch 2
    first = capsys.readouterr().out
    assert main(args) == 0  # resumes in epoch 2
    second = capsys.readouterr().out
    epochs = records(run, "epoch")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    for record in epochs:
        assert f"epoch {record['epoch']}/3 | step {record['step']} |" in first + second
    (resumed,) = records(run, "resume")
    assert "(step 8, epoch 2)" in second and resumed["epoch"] == 2
    assert [s["first_epoch"] for s in records(run, "schedule")] == [1, 1]
    state = ckpt.load_checkpoint(ckpt.list_checkpoints(str(run))[0])
    assert state["epoch"] == 3 and [h["epoch"] for h in state["trainer"]["history"]] == [1, 2, 3]


# ---- the handlers themselves ------------------------------------------------------------------


@pytest.fixture
def restored_handlers():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_second_ctrl_c_stops_at_once_only_before_the_ranks_agree_to_checkpoint(
    first, restored_handlers
) -> None:
    asked: list[str] = []
    stops = StopSignals(asked.append)
    stops.install()
    os.kill(os.getpid(), first)
    assert asked == [signal.Signals(first).name]
    with pytest.raises(Interrupted) as stopped:
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while training: stop now
    assert stopped.value.exit_code == 130 and stops.interrupted is stopped.value
    os.kill(os.getpid(), signal.SIGINT)  # a third, while it unwinds: noted, nothing raised
    stops.restore()
    for hold in ("protect", "commit", "settle"):
        stops = StopSignals(asked.append)
        stops.install()
        os.kill(os.getpid(), first)
        if hold == "protect":
            with stops.protect():  # a checkpoint being written
                os.kill(os.getpid(), signal.SIGINT)
        else:
            getattr(stops, hold)()  # the ranks agreed to checkpoint; the outcome is decided
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                os.kill(os.getpid(), signum)
        assert stops.interrupted is None and stops.name == signal.Signals(first).name
        stops.restore()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_start_up_guard_raises_a_pending_signal_and_only_notes_one_after_settling(
    signum, restored_handlers
) -> None:
    previous = signal.getsignal(signum)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signum})  # how torchrun starts a rank
    signal.pthread_kill(threading.get_ident(), signum)  # sent while the rank imports: pending
    with pytest.raises(Interrupted) as stopped, startup_guard():
        pass
    assert stopped.value.exit_code == 128 + signum
    assert signum not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert signal.getsignal(signum) is previous  # put back, also after raising on entry
    with startup_guard() as guard:
        guard.settle()
        os.kill(os.getpid(), signum)
    assert guard.late == signal.Signals(signum).name
    assert signal.getsignal(signum) is previous


def test_a_settled_command_that_owns_its_process_ignores_stop_signals_to_the_end() -> None:
    code = textwrap.dedent("""
        import os, signal
        from dlpipe.train.signals import startup_guard
        with startup_guard(owns_process=True) as guard:
            guard.settle()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(os.getpid(), signum)  # as the interpreter exits
        print("exited normally")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "exited normally\n", done.stderr
