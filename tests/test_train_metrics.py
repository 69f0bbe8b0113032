"""Evaluation counts and run logging, exercised the way the trainer uses them."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from dlpipe.errors import DlpipeError
from dlpipe.train.confusion import render_confusion
from dlpipe.train.metrics import EvalCounts, EvalResult, top_k
from dlpipe.train.reporting import MissingExtraError, RunLogger

# Seven classes, six samples; each ranking lists classes from highest logit to lowest.
RANKINGS = [
    [0, 1, 2, 3, 4, 5, 6],  # label 0: top-1 hit
    [0, 1, 2, 3, 4, 5, 6],  # label 1: rank 2, top-5 hit
    [0, 1, 2, 3, 4, 5, 6],  # label 6: rank 7, miss
    [2, 0, 1, 3, 4, 5, 6],  # label 2: top-1 hit
    [5, 4, 3, 2, 1, 0, 6],  # label 2: rank 4, top-5 hit
    [1, 2, 3, 4, 6, 0, 5],  # label 5: rank 7, miss
]
LABELS = [0, 1, 6, 2, 2, 5]
CLASSES = ["cat", "dog", "bird", "fish", "frog", "horse", "ship"]


def ranked_logits(rankings: list[list[int]]) -> torch.Tensor:
    """Logits whose descending order per row is the given ranking."""
    logits = torch.zeros(len(rankings), len(rankings[0]))
    for row, ranking in enumerate(rankings):
        for place, cls in enumerate(ranking):
            logits[row, cls] = float(len(ranking) - place)
    return logits


def counts_of(logits: torch.Tensor, labels: torch.Tensor) -> EvalCounts:
    counts = EvalCounts(logits.shape[1])
    counts.update(logits, labels, F.cross_entropy(logits.float(), labels, reduction="sum"))
    return counts


def strict_json(line: str) -> Any:
    """Parses one JSON line, refusing the NaN/Infinity extensions Python accepts by default."""

    def refuse(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def read_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def small_result() -> EvalResult:
    return counts_of(ranked_logits(RANKINGS), torch.tensor(LABELS)).result()


# --- EvalCounts ---------------------------------------------------------------------------------


def test_known_logits_give_exact_metrics() -> None:
    logits, labels = ranked_logits(RANKINGS), torch.tensor(LABELS)
    result = counts_of(logits, labels).result()

    assert result.samples == 6
    assert result.top1 == 2 / 6
    assert result.top5 == 4 / 6
    assert result.loss == pytest.approx(F.cross_entropy(logits, labels).item())
    expected = [[0] * 7 for _ in range(7)]
    for true, pred in [(0, 0), (1, 0), (6, 0), (2, 2), (2, 5), (5, 1)]:
        expected[true][pred] += 1
    assert result.confusion == expected
    assert result.per_class_accuracy == [1.0, 0.0, 0.5, None, None, 0.0, 0.0]


def test_top_k_is_at_most_the_class_count() -> None:
    assert [top_k(c) for c in (1, 2, 3, 5, 6, 1000)] == [1, 2, 3, 5, 5, 5]
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    result = counts_of(logits, torch.tensor([0, 1, 2])).result()
    assert result.top1 == 1 / 3
    assert result.top5 == 1.0  # k = 3: every label is in the top 3 of 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_counts_the_same(dtype: torch.dtype) -> None:
    logits, labels = ranked_logits(RANKINGS), torch.tensor(LABELS)
    reference = counts_of(logits, labels).result()
    result = counts_of(logits.to(dtype), labels).result()
    assert (result.top1, result.top5, result.confusion) == (
        reference.top1,
        reference.top5,
        reference.confusion,
    )


@pytest.mark.parametrize("split", [7, 6, 1, 12])
def test_summed_tensors_equal_one_pass(split: int) -> None:
    """What all_reduce(SUM) does across ranks, including uneven splits (7 vs 6)."""
    gen = torch.Generator().manual_seed(split)
    logits = torch.randn(13, 7, generator=gen)
    labels = torch.randint(0, 7, (13,), generator=gen)
    losses = torch.arange(13, dtype=torch.float64) / 4  # exact in float64, whatever the order
    whole = EvalCounts(7)
    for start in range(0, 13, 5):  # several batches on one rank
        stop = start + 5
        whole.update(logits[start:stop], labels[start:stop], losses[start:stop].sum())
    ranks = [EvalCounts(7), EvalCounts(7)]
    ranks[0].update(logits[:split], labels[:split], losses[:split].sum())
    ranks[1].update(logits[split:], labels[split:], losses[split:].sum())

    for reduced, other in zip(ranks[0].tensors(), ranks[1].tensors()):
        reduced += other  # in place, as torch.distributed.all_reduce does
    for reduced, single in zip(ranks[0].tensors(), whole.tensors()):
        assert torch.equal(reduced, single)
    assert ranks[0].result() == whole.result()
    assert whole.result().samples == 13


def test_tensors_have_the_documented_layout() -> None:
    counts = counts_of(ranked_logits(RANKINGS), torch.tensor(LABELS))
    totals, confusion = counts.tensors()
    assert totals.dtype == torch.float64 and totals.shape == (4,)
    assert totals[1:].tolist() == [6.0, 2.0, 4.0]  # count, top-1 hits, top-k hits
    assert confusion.dtype == torch.int64 and confusion.shape == (7, 7)


def test_no_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="no validation samples"):
        EvalCounts(10).result()


def test_bad_shapes_and_labels_are_errors() -> None:
    counts = EvalCounts(7)
    with pytest.raises(ValueError, match=r"expected \(N, 7\)"):
        counts.update(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"expected \(4,\)"):
        counts.update(torch.zeros(4, 7), torch.zeros(3, dtype=torch.long), torch.tensor(0.0))
    counts.update(torch.zeros(2, 7), torch.tensor([3, 7]), torch.tensor(0.0))
    with pytest.raises(ValueError, match=r"1 of 2 labels were outside 0\.\.6"):
        counts.result()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_does_not_sync_on_cuda() -> None:
    logits = ranked_logits(RANKINGS).cuda()
    labels = torch.tensor(LABELS).cuda()
    counts = EvalCounts(7, device="cuda")
    loss_sum = F.cross_entropy(logits, labels, reduction="sum")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts.update(logits, labels, loss_sum)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.result() == small_result()


# --- RunLogger ----------------------------------------------------------------------------------


def log_a_run(run_dir: Path, **kwargs: Any) -> str | None:
    with RunLogger(str(run_dir), enabled=True, classes=CLASSES, **kwargs) as log:
        log.event("start", world_size=2)
        log.step(1, {"loss": 2.5, "lr": 0.1})
        log.step(2, {"loss": 2.0, "lr": 0.1})
        png = log.epoch(0, 2, {"train_loss": 2.25, "samples_per_s": None}, small_result())
        log.event("stop", reason="max_epochs")
    return png


def test_jsonl_lines_carry_every_value(tmp_path: Path) -> None:
    log_a_run(tmp_path / "run")
    lines = read_lines(tmp_path / "run")

    assert [line["event"] for line in lines] == ["start", "step", "step", "epoch", "stop"]
    assert all(isinstance(line["time"], float) for line in lines)
    assert lines[1] | {"time": 0} == {"event": "step", "step": 1, "loss": 2.5, "lr": 0.1, "time": 0}
    epoch = lines[3]
    assert (epoch["epoch"], epoch["step"], epoch["train_loss"]) == (0, 2, 2.25)
    assert epoch["samples_per_s"] is None
    assert (epoch["top1"], epoch["top5"], epoch["val_samples"]) == (2 / 6, 4 / 6, 6)
    assert epoch["val_loss"] == pytest.approx(small_result().loss)
    assert epoch["per_class_accuracy"]["bird"] == 0.5
    assert epoch["per_class_accuracy"]["fish"] is None
    assert epoch["confusion"] == small_result().confusion
    assert lines[4]["reason"] == "max_epochs"


def test_a_resumed_run_appends(tmp_path: Path) -> None:
    log_a_run(tmp_path / "run")
    first = (tmp_path / "run" / "metrics.jsonl").read_text()
    with RunLogger(str(tmp_path / "run"), enabled=True, classes=CLASSES) as log:
        log.event("resume", step=2)
        log.step(3, {"loss": 1.5})
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert text.startswith(first)
    assert [line["event"] for line in read_lines(tmp_path / "run")][-2:] == ["resume", "step"]


def test_tensorboard_holds_the_scalars_and_the_image(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_a_run(tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]

    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 2.0)]
    assert events.Scalars("epoch/train_loss")[0].value == 2.25
    assert "epoch/samples_per_s" not in scalars  # None is not plotted
    assert events.Scalars("val/top1")[0].step == 2
    assert events.Scalars("val/top5")[0].value == pytest.approx(4 / 6)
    assert "val/loss" in scalars
    assert events.Scalars("val_class/bird")[0].value == 0.5
    assert "val_class/fish" not in scalars  # no samples, no accuracy
    image = events.Images("val/confusion")[0]
    assert (image.step, image.width) == (2, Image.open(tmp_path / "run" / "confusion.png").width)


def test_confusion_png_is_written_atomically(tmp_path: Path) -> None:
    png = log_a_run(tmp_path / "run")
    assert png == str(tmp_path / "run" / "confusion.png")
    with Image.open(png) as image:
        assert image.format == "PNG"
        assert 100 <= image.width <= 2100 and 100 <= image.height <= 2100
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert names == {"metrics.jsonl", "tensorboard", "confusion.png"}  # no temp file left


def test_epoch_without_validation_writes_no_png(tmp_path: Path) -> None:
    with RunLogger(str(tmp_path / "run"), enabled=True, classes=CLASSES) as log:
        assert log.epoch(0, 10, {"train_loss": 1.0}, None) is None
    assert not (tmp_path / "run" / "confusion.png").exists()
    assert "top1" not in read_lines(tmp_path / "run")[0]


def test_disabled_logger_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not even imported on other ranks
    log = RunLogger(str(tmp_path / "run"), enabled=False, classes=CLASSES, wandb_project="p")
    log.step(1, {"loss": 1.0})
    assert log.epoch(0, 1, {"train_loss": 1.0}, small_result()) is None
    log.event("stop")
    log.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_non_finite_values_are_written_as_null(tmp_path: Path, bad: float) -> None:
    with RunLogger(str(tmp_path / "run"), enabled=True, classes=CLASSES) as log:
        log.step(1, {"loss": bad, "lr": np.float32(0.5)})
        log.epoch(0, 1, {"train_loss": bad}, None)
        log.event("oom_backoff", grad_norm=bad, history=[1.0, bad], detail={"x": bad})
    step, epoch, event = read_lines(tmp_path / "run")
    assert (step["loss"], step["lr"]) == (None, 0.5)
    assert epoch["train_loss"] is None
    assert (event["grad_norm"], event["history"], event["detail"]) == (
        None,
        [1.0, None],
        {"x": None},
    )


def test_reserved_names_and_duplicate_classes_are_refused(tmp_path: Path) -> None:
    with RunLogger(str(tmp_path / "run"), enabled=True, classes=CLASSES) as log:
        with pytest.raises(ValueError, match="clash"):
            log.step(1, {"step": 3.0})
        with pytest.raises(ValueError, match="clash"):
            log.epoch(0, 1, {"top1": 0.5}, small_result())
    with pytest.raises(ValueError, match="'cat' appears twice"):
        RunLogger(str(tmp_path / "other"), enabled=True, classes=["cat", "cat"])


def test_wandb_missing_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(MissingExtraError, match=r"pip install 'dlpipe\[wandb\]'") as caught:
        RunLogger(str(tmp_path / "run"), enabled=True, classes=CLASSES, wandb_project="p")
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, DlpipeError)
    assert not (tmp_path / "run").exists()


# --- render_confusion ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_classes", [2, 10, 150, 1000])
def test_render_confusion_sizes(num_classes: int) -> None:
    confusion = np.eye(num_classes, dtype=np.int64) * 3
    confusion[0, 1] = 1
    image = render_confusion(confusion.tolist(), [f"class-{i}" for i in range(num_classes)])
    assert image.mode == "RGB"
    assert 100 <= image.width <= 2100 and 100 <= image.height <= 2100


def test_render_confusion_colours_rows() -> None:
    """A perfect classifier: dark diagonal, white elsewhere, whatever the row totals."""
    image = render_confusion([[100, 0], [0, 1]], ["a", "b"])
    pixels = np.asarray(image)
    dark = (pixels[..., 2] < 140) & (pixels[..., 0] < 40)  # dark blue, not black text
    assert dark.sum() > 2 * 30 * 30  # both diagonal cells (40 px less numbers and lines)


def test_render_confusion_rejects_mismatched_names() -> None:
    with pytest.raises(ValueError, match="3 class names"):
        render_confusion([[1, 0], [0, 1]], ["a", "b", "c"])


def test_the_input_bound_advice_measures_the_runs_own_loader_config() -> None:
    """The advised ``bench-loader`` command keys its profile exactly as the trainer's loader
    looks it up: same micro-batch, image size and crop scale (a path with a space quoted)."""
    import shlex

    from dlpipe.bench_config import BenchLoaderConfig
    from dlpipe.cli import build_parser
    from dlpipe.loading.config import LoaderConfig
    from dlpipe.loading.profile import loader_key
    from dlpipe.options import config_from_args
    from dlpipe.train.progress import input_verdict

    assert input_verdict(0.05, "data/x", 32, 96, 0.35, cuda=False) is None
    advice = input_verdict(0.5, "data/my set", 32, 96, 0.35, cuda=False)
    assert advice is not None and advice.startswith("input-bound: waiting for data 50%")
    words = shlex.split(advice.split("run ", 1)[1].split(" (", 1)[0])
    assert words[:2] == ["dlpipe", "bench-loader"]
    bench = config_from_args(build_parser().parse_args(words[1:]), BenchLoaderConfig)
    assert bench.data == "data/my set"
    advised = LoaderConfig(
        batch_size=bench.batch_size,
        transform=bench.transform,
        image_size=bench.image_size,
        min_crop_scale=bench.min_crop_scale,
    )
    trainer = LoaderConfig(batch_size=32, image_size=96, min_crop_scale=0.35)
    assert loader_key("train", advised) == loader_key("train", trainer)


def test_the_epoch_record_tells_the_first_batch_wait_from_the_rest() -> None:
    from dlpipe.train.progress import EpochStats, epoch_values
    from dlpipe.train.step import StepResult

    stats = EpochStats()
    for wait_s, total_s in ((2.0, 3.0), (0.1, 1.0), (0.2, 1.0)):
        stats.add(StepResult(1.0, 8, None, False, False), wait_s, total_s)
    values = epoch_values(stats, lr=0.1)
    assert values["data_wait"] == pytest.approx(2.3 / 5.0)
    assert values["first_batch_wait_s"] == 2.0
    assert values["data_wait_after_first"] == pytest.approx(0.3 / 3.0)
    assert values["samples_per_s"] == pytest.approx(24 / 5.0)
    # a checkpoint written before the field existed resumes with it at zero
    old = {k: v for k, v in vars(stats).items() if k != "first_wait_s"}
    assert epoch_values(EpochStats(**old), lr=0.1)["data_wait_after_first"] == pytest.approx(0.46)


def test_the_epoch_line_says_how_much_of_the_wait_was_the_first_batch() -> None:
    from dlpipe.train.progress import epoch_line

    record = {"epoch": 2, "train_loss": 1.0, "lr": 0.1, "samples_per_s": 3000.0}
    start_up = epoch_line({**record, "data_wait": 0.23, "data_wait_after_first": 0.003}, 3, 80)
    assert start_up.endswith("data wait 23% (0% after the first batch)")
    steady = epoch_line({**record, "data_wait": 0.231, "data_wait_after_first": 0.228}, 3, 80)
    assert steady.endswith("data wait 23%")
