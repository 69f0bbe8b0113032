"""dlpipe train on detection and segmentation datasets: a run learns, resumes bitwise after
kill -9, runs under 2 gloo ranks with the metrics of one process, and refuses another task's
dataset or model in one ``error:`` line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_train import losses_by_step, newest, records, wait_for_checkpoint

import dlpipe
from dlpipe.cli import main
from dlpipe.synthetic_tasks import write_coco, write_voc_segmentation

TESTS = Path(__file__).resolve().parent
COMMON = [
    "--image-size", "64", "--num-workers", "0", "--tune", "off", "--optimizer", "adamw",
    "--warmup-epochs", "0", "--log-every", "1",
]  # fmt: skip
MODELS = {
    "detection": ["--model", "trainer_models:tiny_detector", "--lr", "0.003"],
    "segmentation": ["--model", "trainer_models:tiny_segmenter", "--lr", "0.01"],
}
METRICS = {"detection": ("map", "map_50"), "segmentation": ("miou", "pixel_acc")}


def _convert(raw: Path, out: Path) -> str:
    dlpipe.convert(str(raw), to="lmdb", out=str(out), workers=1)
    return str(out)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, str]:
    """64 px scenes: detection 96 train + 13 val (COCO's layout), segmentation 32 + 13 (VOC's),
    and a classification dataset; 13 val images split unevenly over 2 ranks."""
    root = tmp_path_factory.mktemp("tasks")
    write_coco(str(root / "coco"), train=96, val=13, size=64)
    write_voc_segmentation(str(root / "voc"), train=32, val=13, size=64)
    limits = dlpipe.ShardLimits(max_shard_samples=16)
    out = str(root / "classes")
    with dlpipe.DatasetWriter(out=out, format="lmdb", classes=["a", "b"], limits=limits) as w:
        for split, count in (("train", 16), ("val", 4)):
            for i in range(count):
                sample = {"__key__": f"{split}{i}", "jpg": _jpeg(i), "cls": str(i % 2).encode()}
                w.write(split, sample)
    return {
        "detection": _convert(root / "coco", root / "det"),
        "segmentation": _convert(root / "voc", root / "seg"),
        "classification": out,
    }


def _jpeg(seed: int) -> bytes:
    import io

    pixels = np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.fixture(autouse=True)
def _user_models(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch) -> Iterator[None]:
    """Tiny models on one intra-op thread, here and in the runs started: on shared cores two
    OpenMP threads a process made these runs 25 times slower (4 samples/s against 107)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def args(task: str, data: str, out: Path, *extra: str) -> list[str]:
    return ["train", data, "--out", str(out), *COMMON, *MODELS[task], *extra]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_a_detector_learns_and_draws_its_predictions(datasets, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main([*args("detection", datasets["detection"], run, "--batch-size", "4"),
                 "--epochs", "10"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    epochs = records(run, "epoch")
    assert epochs[-1]["train_loss"] < 0.8 * epochs[0]["train_loss"]
    assert max(e["map_50"] for e in epochs[1:]) > epochs[0]["map_50"]
    assert epochs[-1]["val_images"] == 13
    classes = dlpipe.read_manifest(datasets["detection"]).classes
    assert set(epochs[-1]["per_class_ap"]) == set(classes)
    assert {"classification", "box_regression"} <= set(records(run, "step")[0])
    assert "mAP" in out and f"predictions {run / 'predictions.png'}" in out
    with Image.open(run / "predictions.png") as picture:
        assert picture.width > 4 * 64  # four validation images, enlarged
    assert (run / "checkpoints" / "best.pt").is_file()


def test_a_segmenter_learns_and_draws_its_masks(datasets, tmp_path, capsys) -> None:
    """The losses fall, and the mIoU rises once the model finds the shapes (4 % of the
    pixels: the tiny model predicts background everywhere for its first 200-odd steps)."""
    run = tmp_path / "run"
    assert main([*args("segmentation", datasets["segmentation"], run, "--batch-size", "4"),
                 "--epochs", "40"]) == 0  # fmt: skip
    epochs = records(run, "epoch")
    assert epochs[-1]["train_loss"] < 0.8 * epochs[0]["train_loss"]
    assert epochs[-1]["val_loss"] < 0.8 * epochs[0]["val_loss"]
    assert max(e["miou"] for e in epochs[-8:]) > epochs[0]["miou"] + 0.003
    assert max(e["pixel_acc"] for e in epochs[-8:]) > epochs[0]["pixel_acc"]
    assert epochs[-1]["val_samples"] == 13 and 0 < epochs[-1]["pixel_acc"] <= 1
    assert "background" in epochs[-1]["per_class_iou"]
    assert "mIoU" in capsys.readouterr().out and (run / "predictions.png").is_file()


def test_a_torchvision_detector_trains_from_scratch(datasets, tmp_path) -> None:
    """A real torchvision detector, built without downloads, sums and logs its loss parts and
    is scored by COCO mAP; the dataset's 8 classes are its 9 outputs (0: the background)."""
    run = tmp_path / "run"
    model = "fasterrcnn_mobilenet_v3_large_320_fpn"
    command = ["train", datasets["detection"], "--out", str(run), *COMMON, "--model", model,
               "--batch-size", "8", "--epochs", "1", "--lr", "0.001"]  # fmt: skip
    assert main(command) == 0
    step = records(run, "step")[0]
    parts = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")
    assert step["loss"] == pytest.approx(sum(step[p] for p in parts), rel=1e-5)
    (epoch,) = records(run, "epoch")
    assert 0 <= epoch["map"] <= epoch["map_50"] <= 1
    assert newest(run)["model"]["roi_heads.box_predictor.cls_score.bias"].shape == (9,)


@pytest.mark.slow
@pytest.mark.parametrize(("task", "steps"), [("detection", 14), ("segmentation", 6)])
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(
    task, steps, datasets, tmp_path
) -> None:
    """kill -9 once a checkpoint of step 4 or later is written (every 2 steps) and run again:
    the run continues from its newest whole checkpoint and ends as the uninterrupted run,
    weights bit for bit, past its first evaluation (detection: 12 steps an epoch, killed
    mid-epoch; segmentation: 4)."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    run_args = args(task, datasets[task], killed, "--batch-size", "8", "--epochs", "3",
                    "--checkpoint-every", "2")  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-m", "dlpipe", *run_args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    wait_for_checkpoint(child, killed, 4)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate()
    assert main([*run_args, "--max-steps", str(steps)]) == 0
    reference = args(task, datasets[task], whole, "--batch-size", "8", "--epochs", "3")
    assert main([*reference, "--checkpoint-every", "2", "--max-steps", str(steps)]) == 0
    assert losses_by_step(killed) == losses_by_step(whole) and len(losses_by_step(whole)) == steps
    assert_same_weights(newest(whole), newest(killed))
    first = METRICS[task][0]
    assert records(killed, "epoch")[0][first] == records(whole, "epoch")[0][first]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["detection", "segmentation"])
def test_two_gloo_ranks_match_one_process(task, datasets, tmp_path) -> None:
    """The same steps and the same scores on 2 ranks as in one process: mAP from every rank's
    detections gathered, mIoU from pixel counts summed, 13 val images split 7 + 6."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run = ["--batch-size", "8", "--epochs", "2"]
    assert main([*args(task, datasets[task], single), *run]) == 0
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", *args(task, datasets[task], ddp), *run,
         "--nproc-per-node", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 8 = 2 ranks x micro-batch 4 x 1 accumulation steps" in done.stdout
    a, b = losses_by_step(single), losses_by_step(ddp)
    np.testing.assert_allclose(list(b.values()), list(a.values()), rtol=1e-5)
    for one, two in zip(records(single, "epoch"), records(ddp, "epoch"), strict=True):
        for key in METRICS[task]:
            assert two[key] == pytest.approx(one[key], abs=1e-6), key
    assert newest(ddp)["world_size"] == 2


@pytest.mark.parametrize(
    ("data", "extra", "words"),
    [
        ("detection", ["--task", "segmentation"], "is a detection dataset"),
        ("segmentation", ["--task", "detection"], "is a segmentation dataset"),
        ("classification", ["--task", "detection"], "is a classification dataset"),
        ("detection", ["--task", "classification"], "is a detection dataset"),
        ("detection", ["--model", "deeplabv3_mobilenet_v3_large"], "is a segmentation model"),
        ("segmentation", ["--model", "resnet18"], "is a classification model"),
        ("detection", ["--model", "maskrcnn_resnet50_fpn"], "has none (no masks.json field)"),
    ],
)
def test_another_tasks_dataset_or_model_is_one_error_line(
    data, extra, words, datasets, tmp_path, capsys
) -> None:
    command = ["train", datasets[data], "--out", str(tmp_path / "run"), *COMMON, *extra]
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and words in err, err
    assert "Traceback" not in err
