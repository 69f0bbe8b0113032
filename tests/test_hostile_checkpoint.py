"""A checkpoint is untrusted input (a run folder is): ``dlpipe train --resume`` checks every field
it reads back before the first step, and one that is not what dlpipe train writes is one
``error:`` line naming the file, the field, the value and a fix that works, exit code 2, and
nothing in the run folder touched: not an IndexError at start, a TypeError after a whole epoch,
or a run that goes on from a position that is not one.

Each field is tried with its neighbours (other types, a bool for a count, a float for an int,
both signs, sizes past the range, and values that disagree with the rest of the checkpoint)."""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import one_error
from test_train import COMMON, write_colours

from dlpipe.cli import main
from dlpipe.train import checkpoint as ckpt

TESTS = Path(__file__).resolve().parent
FIX = "resume from an earlier checkpoint with --resume PATH, or start afresh in another --out"


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> str:
    return write_colours(tmp_path_factory.mktemp("checkpoint") / "lmdb", "lmdb")


@pytest.fixture(scope="module")
def template(colours, tmp_path_factory) -> Path:
    """A run folder with the checkpoints of steps 2 and 4 (of 6 per epoch)."""
    run = tmp_path_factory.mktemp("template") / "run"
    extra = ["--checkpoint-every", "2", "--keep-last", "3", "--max-steps", "4"]
    assert train(colours, run, "--epochs", "3", *extra) == 0
    return run


@pytest.fixture(autouse=True)
def _models(monkeypatch, tmp_path) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.chdir(tmp_path)


def train(data: str, out: Path, *extra: str) -> int:
    return main(["train", data, "--out", str(out), *COMMON, *extra])


def crafted_run(
    template: Path, tmp_path: Path, craft: Callable[[dict[str, Any]], Any], step: int = 4
) -> Path:
    """A copy of the template run whose newest checkpoint (`step`) `craft` changed."""
    run = tmp_path / "run"
    shutil.copytree(template, run)
    path = run / "checkpoints" / f"step-{step:08d}.pt"
    state = torch.load(path, weights_only=True)
    craft(state)
    torch.save(state, path)
    return run


def folder(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "checkpoints").iterdir())}


def no_step_logged(run: Path, metrics: bytes) -> bool:
    """The run's metrics are those before, and no step was logged since (the start of a run
    logs its schedule first)."""
    now = (run / "metrics.jsonl").read_bytes()
    return now.startswith(metrics) and b'"event": "step"' not in now[len(metrics) :]


def setter(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``state[k0][k1]...`` to `value`."""

    def craft(state: dict[str, Any]) -> None:
        target = state
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return craft


def both(*crafts: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def craft(state: dict[str, Any]) -> None:
        for each in crafts:
            each(state)

    return craft


def counts(step: Any) -> Callable[[dict[str, Any]], None]:
    """The step everywhere the checkpoint holds it (the trainer's counters and its own)."""
    return both(setter("step", value=step), setter("trainer", "step", value=step))


def loader(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return setter("ranks", 0, "loader", field, value=value)


def nan_weight(state: dict[str, Any]) -> None:
    """A NaN in the first floating-point weight (training would diverge at its first step)."""
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))


CHECKPOINT_CASES = [
    ("model-nan", nan_weight, "its values must be finite numbers"),
    # the step: negative, a bool, a float, a string, past any count, not the trainer's
    ("step-negative", counts(-1), "has step=-1: it must be an integer in 0.."),
    ("step-minus-4", counts(-4), "has step=-4: it must be an integer in 0.."),
    ("step-bool", counts(True), "has step=True: it must be an integer"),
    ("step-float", counts(4.0), "has step=4.0: it must be an integer"),
    ("step-string", counts("4"), "has step='4': it must be an integer"),
    ("step-huge", counts(2**70), "has step=1180591620717411303424: it must be an integer"),
    ("step-not-trainers", setter("step", value=5), "has step=5: it must equal the trainer's"),
    ("trainer-step", setter("trainer", "step", value=-4), "step=4: it must equal the trainer's"),
    ("epoch-fraction", setter("epoch", value=0.5), "has epoch=0.5: it must be an integer"),
    ("epoch-negative", setter("epoch", value=-1), "has epoch=-1: it must be an integer in 0"),
    ("world-size-0", setter("world_size", value=0), "has world_size=0: it must be an integer in 1"),
    ("world-size-bool", setter("world_size", value=True), "has world_size=True: it must be"),
    ("world-size-2", setter("world_size", value=2), "ranks=[{"),
    ("global-batch-0", setter("global_batch", value=0), "has global_batch=0: it must be"),
    ("global-batch-float", setter("global_batch", value=16.0), "global_batch=16.0: it must be"),
    ("classes-string", setter("classes", value="red"), "has classes='red': it must be a list"),
    ("classes-ints", setter("classes", value=[0, 1, 2, 3]), "classes=[0, 1, 2, 3]: it must be"),
    # every rank's part: one per rank, each a loader and an rng state
    ("ranks-empty", setter("ranks", value=[]), "has ranks=[]: it must be a list of one entry"),
    ("ranks-two", lambda s: s["ranks"].append(s["ranks"][0]), "it must be a list of one entry"),
    ("ranks-dict", setter("ranks", value={"0": 1}), "it must be a list of one entry per rank"),
    ("ranks-none", setter("ranks", 0, value=None), "has ranks[0]=None: it must be a dict of a"),
    ("ranks-no-rng", lambda s: s["ranks"][0].pop("rng"), "ranks[0]={'loader': {"),
    ("model-values", setter("model", value={"w": 1}), "model={'w': 1}: it must map parameter"),
    ("optimizer-list", setter("optimizer", value=[]), "has optimizer=[]: it must be a dict"),
    ("optimizer-state", setter("optimizer", "state", value=[]), "a torch optimizer's state_dict"),
    ("scheduler-string", setter("scheduler", value="x"), "has scheduler='x': it must be a dict"),
    ("config-string", setter("config", value="x"), "has config='x': it must be the run's config"),
    ("config-model", setter("config", "model", value="x"), "config.model='x': it must be a dict"),
    ("config-name", setter("config", "model", "name", value=3), "whose name is a name"),
    ("reason", setter("reason", value=3), "has reason=3: it must be a word"),
]


PART_CASES = [
    # the trainer's counters: what used to fail after a whole epoch, or go on wrong
    ("best-top1-string", setter("trainer", "best_top1", value="high"), "best_top1='high': it"),
    ("best-top1-above-1", setter("trainer", "best_top1", value=1.5), "best_top1=1.5: it must"),
    ("best-top1-nan", setter("trainer", "best_top1", value=math.nan), "best_top1=nan: it must"),
    ("best-top1-negative", setter("trainer", "best_top1", value=-0.1), "best_top1=-0.1: it"),
    ("bad-steps-negative", setter("trainer", "bad_steps", value=-1), "bad_steps=-1: it must be"),
    ("skipped-past-step", setter("trainer", "skipped_steps", value=5), "skipped_steps=5: it"),
    ("stats-string", setter("trainer", "stats", "loss_sum", value="x"), "stats.loss_sum='x'"),
    ("stats-samples-float", setter("trainer", "stats", "samples", value=64.5), "stats.samples"),
    ("stats-extra", setter("trainer", "stats", "extra", value=1), "stats={"),
    ("history-extra", setter("trainer", "history", value=[{"epoch": 1}]), "one record per"),
    ("history-record", setter("trainer", "history", value=["x"]), "history[0]='x': record 1"),
    ("best-loss-string", setter("early_stop", "best_loss", value="x"), "best_loss='x': it must"),
    ("best-loss-inf", setter("early_stop", "best_loss", value=math.inf), "best_loss=inf: it"),
    ("stale-negative", setter("early_stop", "stale_epochs", value=-1), "stale_epochs=-1: it"),
    ("stale-fraction", setter("early_stop", "stale_epochs", value=1.5), "stale_epochs=1.5: it"),
    ("splits-0", setter("runner", "splits", value=0), "splits=0: it must be an integer in 1"),
    ("splits-3", setter("runner", "splits", value=3), "splits=3: it must be a power of 2"),
    ("splits-bool", setter("runner", "splits", value=True), "splits=True: it must be an integer"),
    ("scaler-string", setter("runner", "scaler", value="x"), "scaler='x': it must be a dict"),
    ("runner-list", setter("runner", value=[]), "runner=[]: it must be a dict"),
    # torch's own: the optimizer's groups and state, the LR schedule
    (
        "lr-string",
        setter("optimizer", "param_groups", 0, "lr", value="x"),
        "optimizer.param_groups[0].lr='x': it must be a finite number",
    ),
    (
        "lr-negative",
        setter("optimizer", "param_groups", 0, "lr", value=-0.2),
        "optimizer.param_groups[0].lr=-0.2",
    ),
    (
        "momentum-bool",
        setter("optimizer", "param_groups", 1, "nesterov", value=1),
        "optimizer.param_groups[1].nesterov=1: it must be a bool",
    ),
    (
        "group-extra-key",
        setter("optimizer", "param_groups", 0, "params_extra", value=1),
        "optimizer.param_groups[0]={",
    ),
    (
        "momentum-shape",
        setter("optimizer", "state", 0, "momentum_buffer", value=torch.zeros(3)),
        "momentum_buffer=<torch.float32 tensor of shape [3]>: it must be a finite tensor",
    ),
    (
        "momentum-nan",
        lambda s: s["optimizer"]["state"][0]["momentum_buffer"].fill_(math.nan),
        "momentum_buffer=<torch.float32 tensor of shape [8, 3, 3, 3]>: it must be a finite",
    ),
    (
        "state-index",
        lambda s: s["optimizer"]["state"].update({99: {}}),
        "optimizer.state[99]={}: it must be a dict for one of the",
    ),
    ("scheduler-epoch", setter("scheduler", "last_epoch", value=-5), "scheduler.last_epoch=-5"),
    ("scheduler-lrs", setter("scheduler", "base_lrs", value=[0.2]), "scheduler.base_lrs=[0.2]"),
    (
        "scheduler-attribute",
        setter("scheduler", "optimizer", value=None),
        "scheduler={",
    ),
    # the rank's RNG streams (numpy used to read outside its state with a position of -1)
    ("rng-python", setter("ranks", 0, "rng", "python", value="x"), "ranks[0].rng={"),
    ("rng-numpy-pos", setter("ranks", 0, "rng", "numpy", 2, value=-1), "ranks[0].rng={"),
    ("rng-torch", setter("ranks", 0, "rng", "torch", value=torch.zeros(3)), "ranks[0].rng={"),
]


@pytest.mark.parametrize(
    ("craft", "message"),
    [case[1:] for case in CHECKPOINT_CASES + PART_CASES],
    ids=[case[0] for case in CHECKPOINT_CASES + PART_CASES],
)
def test_a_crafted_checkpoint_field_is_one_error_line_and_nothing_is_touched(
    craft, message, template, colours, tmp_path, capsys
) -> None:
    """The checkpoint's own fields and its parts' (what used to fail after a whole epoch)
    are refused before the first step."""
    run = crafted_run(template, tmp_path, craft)
    path = run / "checkpoints" / "step-00000004.pt"
    before = folder(run)
    metrics = (run / "metrics.jsonl").read_bytes()
    assert train(colours, run, "--epochs", "3", "--resume", str(path)) == 2
    line = one_error(capsys)
    assert f"checkpoint {path}" in line and message in line and FIX in line, line
    assert folder(run) == before and no_step_logged(run, metrics)


LOADER_CASES = [
    ("samples-negative", loader("samples", -16), "samples=-16: it must be an integer in 0..96"),
    ("samples-tail", loader("samples", -1), "samples=-1: it must be an integer in 0..96"),
    ("samples-bool", loader("samples", True), "samples=True: it must be an integer"),
    ("samples-huge", loader("samples", 10**9), "samples=1000000000: it must be an integer"),
    ("samples-float", loader("samples", 64.0), "samples=64.0: it must be an integer"),
    ("samples-fraction", loader("samples", 56.5), "samples=56.5: it must be an integer"),
    ("partial-mid-batch", loader("partial", 3), "partial=3: a loader's position is whole"),
    ("partial-negative", loader("partial", -1), "partial=-1: it must be an integer in 0..15"),
    ("epoch-fraction", loader("epoch", 0.5), "epoch=0.5: it must be an integer"),
    ("epoch-huge", loader("epoch", 2**40), "epoch=1099511627776: it must be an integer"),
    ("epoch-other", loader("epoch", 2), "epoch=2: it must be the trainer's epoch=0"),
    ("block-zero", loader("block", 0), "block=0: it must be an integer in 1.."),
    ("dataset", loader("dataset", "0" * 64), "dataset='000"),
    ("split", loader("split", "val"), "split='val', this loader has split='train'"),
    ("seed-bool", loader("seed", False), "seed=False, this sampler has seed=0"),
    ("not-a-dict", setter("ranks", 0, "loader", value={"x": 1}), "has no dataset, split"),
]


@pytest.mark.parametrize(
    ("craft", "message"),
    [case[1:] for case in LOADER_CASES],
    ids=[case[0] for case in LOADER_CASES],
)
def test_a_crafted_loader_position_is_refused_naming_the_rank_and_field(
    craft, message, template, colours, tmp_path, capsys
) -> None:
    run = crafted_run(template, tmp_path, craft)
    path = run / "checkpoints" / "step-00000004.pt"
    before = folder(run)
    assert train(colours, run, "--epochs", "3", "--resume", str(path)) == 2
    line = one_error(capsys)
    assert f"checkpoint {path} cannot continue this run's data (ranks[0].loader): " in line
    assert message in line and "start afresh in another --out" in line, line
    assert folder(run) == before


def test_the_advice_of_a_refusal_works(template, colours, tmp_path, capsys) -> None:
    """Both fixes the message names run: the earlier checkpoint, and another --out (the old
    advice, --resume none, is refused in this folder)."""
    run = crafted_run(template, tmp_path, counts(-4))
    newest = run / "checkpoints" / "step-00000004.pt"
    assert train(colours, run, "--epochs", "3", "--resume", str(newest)) == 2
    assert "--resume none" not in one_error(capsys)
    assert train(colours, run, "--epochs", "3", "--resume", "none") == 2
    assert "--resume none would mix the two runs" in one_error(capsys)
    earlier = run / "checkpoints" / "step-00000002.pt"
    assert train(colours, run, "--epochs", "3", "--resume", str(earlier), "--max-steps", "3") == 0
    assert "(step 2, epoch 1)" in capsys.readouterr().out
    assert (run / "checkpoints" / "step-00000004.pt.superseded").read_bytes()  # kept, aside
    assert train(colours, tmp_path / "afresh", "--epochs", "3", "--max-steps", "1") == 0


def test_a_truncated_checkpoint_named_by_path_advises_what_works(
    template, colours, tmp_path, capsys
) -> None:
    run = crafted_run(template, tmp_path, lambda state: None)
    newest = run / "checkpoints" / "step-00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    assert train(colours, run, "--epochs", "3", "--resume", str(newest)) == 2
    line = one_error(capsys)
    assert "it may be truncated" in line and FIX in line and "--resume none" not in line


def test_resume_auto_sets_a_crafted_newest_aside_like_a_broken_one(
    template, colours, tmp_path, capsys
) -> None:
    """With --resume auto a checkpoint whose fields are not dlpipe's is broken: the newest
    one that is whole is resumed, and the crafted one renamed (never deleted)."""
    run = crafted_run(template, tmp_path, counts(-4))
    crafted = (run / "checkpoints" / "step-00000004.pt").read_bytes()
    assert train(colours, run, "--epochs", "3", "--max-steps", "3") == 0
    out = capsys.readouterr().out
    assert "step=-4: it must be an integer in 0.." in out and "(step 2, epoch 1)" in out
    assert (run / "checkpoints" / "step-00000004.pt.broken").read_bytes() == crafted


def test_resume_auto_with_only_crafted_checkpoints_is_one_line(
    template, colours, tmp_path, capsys
) -> None:
    run = crafted_run(template, tmp_path, counts(-4))
    os.remove(run / "checkpoints" / "step-00000002.pt")
    before = folder(run)
    assert train(colours, run, "--epochs", "3") == 2
    line = one_error(capsys)
    assert "step-00000004.pt has step=-4" in line and "start afresh in another --out" in line
    assert folder(run) == before


def test_check_fields_accepts_every_checkpoint_dlpipe_writes(template) -> None:
    for path in ckpt.list_checkpoints(str(template)):
        ckpt.check_fields(torch.load(path, weights_only=True), path)


def test_another_global_batch_advises_a_batch_size_that_runs(
    template, colours, tmp_path, capsys
) -> None:
    run = crafted_run(template, tmp_path, lambda state: None)
    assert train(colours, run, "--epochs", "3", "--batch-size", "8") == 2
    line = one_error(capsys)
    assert line.endswith("resume with --batch-size 16"), line
    assert train(colours, run, "--epochs", "3", "--batch-size", "16", "--max-steps", "5") == 0
    # on 3 ranks 16 does not divide: the advice names the ranks that saved it too
    state = {"global_batch": 16, "world_size": 2, "classes": ["a", "b"]}
    with pytest.raises(ckpt.CheckpointError, match="--batch-size 16 --nproc-per-node 2$"):
        ckpt.check_resumable(state, "c.pt", ["a", "b"], world_size=3, global_batch=15,
                             elastic=True)  # fmt: skip


@pytest.fixture(scope="module")
def wds_run(tmp_path_factory) -> tuple[str, Path]:
    """A wds dataset and a run folder with the checkpoint of step 2 (32 samples given)."""
    data = write_colours(tmp_path_factory.mktemp("wds") / "wds", "wds")
    run = tmp_path_factory.mktemp("wds-run") / "run"
    assert train(data, run, "--epochs", "3", "--max-steps", "2") == 0
    return data, run


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("consumed", [[0, 8]], "consumed=[[0, 8]]: the runs given to the caller must be whole"),
        ("consumed", [[0, 16], [8, 32]], "consumed runs ((0, 16), (8, 32)) out of order or"),
        ("consumed", [[0, 32.0]], "consumed=[[0, 32.0]], not a list of [start, stop] pairs"),
        ("base", [[0, 95]], "base=[[0, 95]]: its 95 samples must be whole batches of 16"),
        ("base", [[0, 96.0]], "base=[[0, 96.0]], not a list of [start, stop] pairs"),
        ("workers", True, "workers=True, not a worker count"),
        ("epoch", -1, "epoch=-1: it must be an integer in 0..2147483647"),
    ],
)
def test_a_crafted_wds_position_in_a_checkpoint_is_refused(
    field, value, message, wds_run, tmp_path, capsys
) -> None:
    data, template = wds_run
    run = crafted_run(template, tmp_path, loader(field, value), step=2)
    path = run / "checkpoints" / "step-00000002.pt"
    before = folder(run)
    assert train(data, run, "--epochs", "3") == 2
    line = one_error(capsys)
    assert f"checkpoint {path} cannot continue this run's data (ranks[0].loader): " in line
    assert message in line, line
    assert folder(run) == before


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([], "c.pt is not a dlpipe checkpoint: it holds a <class 'list'>"),
        ({"step": 1}, "checkpoint c.pt lacks epoch, model, optimizer"),
    ],
)
def test_a_state_that_is_not_a_checkpoint_is_refused_by_check_fields(state, message) -> None:
    """`resume.restore` checks the fields too: a library caller may pass a state it loaded."""
    with pytest.raises(ckpt.CheckpointError, match=message.replace("[", "\\[")):
        ckpt.check_fields(state, "c.pt")
