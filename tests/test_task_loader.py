"""`make_loader` on detection and segmentation datasets: batches in torchvision's conventions,
the same batch for batch across formats, worker counts, engines and an elastic resume (images
and every target tensor); a recipe the task lacks and a bad annotation are named errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import tv_tensors

import dlpipe
from dlpipe.annotations import encode_boxes, encode_masks
from dlpipe.cli import main
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.targets import TargetError
from dlpipe.loading.tune import training_profile
from dlpipe.synthetic_tasks import write_coco, write_voc_segmentation

SIZE, TRAIN, VAL = 48, 12, 4
FORMATS = ("lmdb", "hdf5", "wds")
RANDOM_ACCESS = ("lmdb", "hdf5")
# detection's ssd policy crops each image to its own size (a list of images) and draws from
# every op; segmentation's train recipe resizes, flips, pads and crops
RECIPE = {"detection": "ssd", "segmentation": "train"}
SIDE = {"detection": None, "segmentation": 24}
THREADS = {"engine": "threads", "num_workers": 2}


def convert(raw: Path, out: Path, fmt: str, *extra: str) -> str:
    args = ["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra]
    assert main([*args, "--shard-size", "16KB"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """(task, format) → a converted dataset of `TRAIN` + `VAL` synthetic scenes."""
    root = tmp_path_factory.mktemp("tasks")
    write_coco(str(root / "coco"), train=TRAIN, val=VAL, seed=3, size=SIZE)
    write_voc_segmentation(str(root / "voc"), train=TRAIN, val=VAL, seed=3, size=SIZE)
    out = {}
    for fmt in FORMATS:
        out["detection", fmt] = convert(root / "coco", root / f"det-{fmt}", fmt, "--instance-masks")
        out["segmentation", fmt] = convert(root / "voc", root / f"seg-{fmt}", fmt)
    return out


def loader(path: str, workers: Any = 0, split: str = "train", **fields: Any) -> Any:
    task = dlpipe.read_manifest(path).task
    config = {"batch_size": 4, "transform": RECIPE[task], "image_size": SIDE[task], "seed": 7}
    config = dlpipe.LoaderConfig(**{**config, **fields})
    return dlpipe.make_loader(path, split, config, workers=workers, profile=None)


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types: tensors (tv_tensors too) element for element, dicts key
    for key, sequences item for item (a wds batch is a list: torch's DataLoader turns a tuple
    it does not batch into one)."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def digest(batch: Any) -> str:
    """A batch's images as a key: wds's batches come in an order that follows the workers."""
    images = batch[0] if isinstance(batch[0], list) else [batch[0]]
    return hashlib.sha256(b"".join(i.contiguous().numpy().tobytes() for i in images)).hexdigest()


def epochs(made: Any, count: int = 2) -> list[list[Any]]:
    out = [list(made) for _ in range(count)]
    made.close()
    return out


@pytest.mark.parametrize("task", ["detection", "segmentation"])
def test_batches_are_in_torchvision_s_conventions(task: str, datasets: dict) -> None:
    images, targets = next(iter(loader(datasets[task, "lmdb"], transform="train")))
    if task == "segmentation":
        assert images.dtype == torch.uint8 and images.shape == (4, 3, 24, 24)
        assert targets.dtype == torch.uint8 and targets.shape == (4, 24, 24)  # as stored
        assert 255 in targets.unique().tolist()  # the void edge keeps its ignore value
        return
    assert images.dtype == torch.uint8 and images.shape == (4, 3, SIZE, SIZE)  # sizes kept
    for target in targets:
        assert isinstance(target["boxes"], tv_tensors.BoundingBoxes)
        assert target["boxes"].format == tv_tensors.BoundingBoxFormat.XYXY
        assert target["labels"].dtype == torch.int64 and target["iscrowd"].dtype == torch.int64
        assert target["masks"].shape == (len(target["labels"]), SIZE, SIZE)
        assert isinstance(target["image_id"], int)
    ssd_images, _ = next(iter(loader(datasets[task, "lmdb"])))
    assert isinstance(ssd_images, list) and all(i.dtype == torch.uint8 for i in ssd_images)
    resized, boxed = next(iter(loader(datasets[task, "lmdb"], transform="train", image_size=32)))
    assert resized.shape == (4, 3, 32, 32) and all(t["boxes"].max() <= 32 for t in boxed)


@pytest.mark.parametrize("task", ["detection", "segmentation"])
def test_every_format_gives_the_same_batches(task: str, datasets: dict) -> None:
    """In the split's order the formats agree batch for batch; each format's own augmentation
    is seeded per sample, so the train recipe agrees between the random-access formats."""
    for transform in ("eval", RECIPE[task]):
        formats = FORMATS if transform == "eval" else RANDOM_ACCESS
        runs = [
            list(loader(datasets[task, f], transform=transform, shuffle=False)) for f in formats
        ]
        assert len(runs[0]) == TRAIN // 4
        assert all(same(run, runs[0]) for run in runs[1:]), transform


@pytest.mark.parametrize("task", ["detection", "segmentation"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_worker_counts_and_engines_give_the_same_batches(
    task: str, fmt: str, datasets: dict
) -> None:
    path = datasets[task, fmt]
    reference = epochs(loader(path, 0))
    for workers in (2, THREADS):
        for ours, theirs in zip(epochs(loader(path, workers)), reference, strict=True):
            if fmt == "wds" and workers == 2:  # the same batches, in the workers' turns
                ours, theirs = sorted(ours, key=digest), sorted(theirs, key=digest)
            assert same(ours, theirs), (workers, fmt)


def joined(a: Any, b: Any) -> Any:
    """Rank 0's and rank 1's batches of one global step as one batch."""
    images, targets = (torch.cat([x, y]) if isinstance(x, torch.Tensor) else x + y
                       for x, y in zip(a, b, strict=True))  # fmt: skip
    return images, targets


@pytest.mark.parametrize("task", ["detection", "segmentation"])
@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_a_resume_on_other_workers_and_world_size_gives_the_same_batches(
    task: str, fmt: str, datasets: dict
) -> None:
    path, stop = datasets[task, fmt], 1
    reference = epochs(loader(path, 0))
    first = loader(path, 2)
    head = [batch for _, batch in zip(range(stop), first, strict=False)]
    state = first.state_dict()
    first.close()
    assert same(head, reference[0][:stop])
    resumed = loader(path, 0)
    resumed.load_state_dict(state)
    assert same(epochs(resumed), [reference[0][stop:], reference[1]])
    ranks = []
    for rank in range(2):
        config = dlpipe.LoaderConfig(batch_size=2, transform=RECIPE[task], image_size=SIDE[task],
                                     seed=7)  # fmt: skip
        part = dlpipe.make_loader(path, "train", config, workers=0, rank=rank, world_size=2)
        part.load_state_dict(state)
        ranks.append(epochs(part))
    for epoch, expected in enumerate([reference[0][stop:], reference[1]]):
        steps = zip(ranks[0][epoch], ranks[1][epoch], strict=True)
        assert same([joined(a, b) for a, b in steps], expected)


def test_a_recipe_the_task_lacks_is_named_with_the_task_s_recipes(datasets: dict) -> None:
    with pytest.raises(LoaderConfigError, match=r"transform='ssd'.*segmentation.*train, eval"):
        loader(datasets["segmentation", "lmdb"], transform="ssd")
    with pytest.raises(LoaderConfigError, match=r"transform='mosaic'.*'hflip', 'ssd'"):
        dlpipe.LoaderConfig(transform="mosaic")


def test_the_gpu_decode_is_refused_for_a_task_dataset(datasets: dict) -> None:
    with pytest.raises(LoaderConfigError, match="decode='cuda' with a detection dataset"):
        loader(datasets["detection", "lmdb"], {"num_workers": 0, "decode": "cuda"})


def test_raw_samples_and_a_callable_pass_through(datasets: dict) -> None:
    path = datasets["detection", "lmdb"]
    raw = next(iter(loader(path, transform=None)))
    assert isinstance(raw, list) and "boxes.json" in raw[0]
    keys = next(iter(loader(path, transform=lambda s: s["__key__"])))
    assert keys == [s["__key__"] for s in raw]


def rewritten(source: str, out: Path, key: str, **fields: bytes) -> str:
    """`source`'s train split as a new lmdb dataset with sample `key`'s `fields` replaced (a
    crafted shard: convert refuses such annotations), the annotations' manifest kept."""
    samples = []
    for sample in dlpipe.open_dataset(source, "train", rank=0, world_size=1):
        sample = dict(sample)
        if sample["__key__"] == key:
            sample.update(fields)
        samples.append(sample)
    manifest = json.loads((Path(source) / "dlpipe.json").read_text())
    with dlpipe.DatasetWriter(out=str(out), format="lmdb", classes=manifest["classes"]) as w:
        for sample in samples:
            w.write("train", sample)
    ours = json.loads((out / "dlpipe.json").read_text())
    for name in ("task", "field_schemas", "class_ids"):
        if name in manifest:
            ours[name] = manifest[name]
    (out / "dlpipe.json").write_text(json.dumps(ours))
    return str(out)


@pytest.mark.parametrize("workers", [0, 2, THREADS], ids=["0 workers", "2 workers", "threads"])
def test_a_bad_annotation_is_the_loader_s_named_per_sample_error(
    workers: Any, datasets: dict, tmp_path: Path
) -> None:
    """As a sample whose image does not decode: one error naming the sample and the field."""
    source = datasets["detection", "lmdb"]
    key = next(iter(dlpipe.open_dataset(source, "train", rank=0, world_size=1)))["__key__"]
    cases = {
        "outside": {"boxes.json": encode_boxes([(2, 2, SIZE + 9, 20)], [0])},
        "mask size": {
            "boxes.json": encode_boxes([(2, 2, 9, 20)], [0]),
            "masks.json": encode_masks((SIZE + 1, SIZE), ["0"]),
        },
    }
    messages = {"outside": f"outside the {SIZE}x{SIZE} image", "mask size": f"is {SIZE}x{SIZE + 1}"}
    for name, fields in cases.items():
        path = rewritten(source, tmp_path / name.replace(" ", "-"), key, **fields)
        made = loader(path, workers, shuffle=False)
        with pytest.raises(TargetError, match=f"sample {key!r} field .*{messages[name]}"):
            list(made)
        made.close()


def test_bench_loader_on_detection_saves_a_profile_make_loader_uses(
    datasets: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "det")
    shutil.copytree(datasets["detection", "lmdb"], path)
    args = ["bench-loader", path, "--batch-size", "4", "--budget", "3", "--max-workers", "2"]
    assert main([*args, "--transform", "ssd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stages"]["recipe"] == "detection ssd"
    assert "crop-aware decode does not apply to the detection ssd recipe" in report["advice"]
    saved = json.loads(Path(report["saved"]).read_text())["profiles"][0]
    assert saved["loader"]["transform"] == "ssd" and saved["loader"]["image_size"] is None
    config = dlpipe.LoaderConfig(batch_size=4, transform="ssd")
    made = dlpipe.make_loader(path, "train", config)
    assert made.origin == "profile" and made.settings.num_workers == saved["num_workers"]
    images, targets = next(iter(made))
    made.close()
    assert len(images) == len(targets) == 4 and "boxes" in targets[0]
    profile, why = training_profile(path, "train", config.replace(batch_size=8), tune=False)
    assert profile is not None and profile.settings == made.settings  # dlpipe train's choice
    assert "measured at batch 4, own sizes" in why
