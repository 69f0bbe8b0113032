"""Mixtures of detection and segmentation datasets: batches in torchvision's conventions with
each sample's source last, each sample equal to what its own dataset's loader gives (targets
checked against the source's own classes, then mapped by name onto the mixture's), and the
mixtures one batch cannot hold refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dlpipe
from dlpipe.cli import main
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.views import _label_map, _relabelled
from dlpipe.synthetic import SHAPE_CLASSES
from dlpipe.synthetic_tasks import write_coco, write_voc_segmentation

SIZE = 48
RECIPE = {
    "detection": {"transform": "eval"},
    "segmentation": {"transform": "eval", "image_size": 32},
}


def convert(raw: Path, out: Path, fmt: str, *extra: str) -> str:
    args = ["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra]
    assert main([*args, "--shard-size", "16KB"]) == 0
    return str(out)


def reversed_categories(root: Path) -> None:
    """Number a COCO layout's categories the other way round (its classes, sorted by id,
    come out reversed; every box keeps its class name)."""
    count = len(SHAPE_CLASSES)
    for path in (root / "annotations").glob("instances_*.json"):
        data = json.loads(path.read_text())
        for item in data["categories"]:
            item["id"] = count + 1 - item["id"]
        for item in data["annotations"]:
            item["category_id"] = count + 1 - item["category_id"]
        path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix-tasks")
    write_coco(str(root / "coco-a"), train=10, val=2, seed=1, size=SIZE)
    write_coco(str(root / "coco-b"), train=6, val=2, seed=2, size=SIZE)
    reversed_categories(root / "coco-b")
    write_voc_segmentation(str(root / "voc-a"), train=8, val=2, seed=3, size=SIZE)
    write_voc_segmentation(str(root / "voc-b"), train=6, val=2, seed=4, size=SIZE)
    return {
        "det-a": convert(root / "coco-a", root / "det-a", "lmdb"),
        "det-b": convert(root / "coco-b", root / "det-b", "hdf5"),
        "det-masks": convert(root / "coco-b", root / "det-masks", "lmdb", "--instance-masks"),
        "seg-a": convert(root / "voc-a", root / "seg-a", "hdf5"),
        "seg-b": convert(root / "voc-b", root / "seg-b", "lmdb"),
    }


def mixed(paths: list[str], task: str, workers: int = 0, **fields: Any) -> Any:
    fields = {"batch_size": 4, "seed": 3, "weights": (0.5, 0.5), **RECIPE[task], **fields}
    config = dlpipe.LoaderConfig(**fields)
    return dlpipe.make_loader(paths, "train", config, workers=workers, profile=None)


def alone(path: str, task: str) -> list[tuple[Any, Any]]:
    """Each sample of `path`'s train split through its own eval recipe, in stored order."""
    config = dlpipe.LoaderConfig(batch_size=1, shuffle=False, **RECIPE[task])
    loader = dlpipe.make_loader(path, "train", config, workers=0, profile=None)
    out = [(images[0], targets[0]) for images, targets in loader]
    loader.close()
    return out


def drawn(paths: list[str], task: str) -> list[tuple[int, int]]:
    """The mixture's (source, index in the source) in order, read from its raw samples."""
    indices = [
        {key: i for i, key in enumerate(s["__key__"] for s in dlpipe.open_dataset(p, "train"))}
        for p in paths
    ]
    loader = mixed(paths, task, transform=None)
    out = [
        (int(s["__source__"]), indices[int(s["__source__"])][s["__key__"]])
        for b in loader
        for s in b
    ]
    loader.close()
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_detection_mixture_gives_each_sample_as_its_dataset_does_labels_mapped_by_name(
    sets, workers
) -> None:
    paths = [sets["det-a"], sets["det-b"]]
    classes = [list(dlpipe.read_manifest(p).classes) for p in paths]
    assert classes[1] == classes[0][::-1]  # the same names, numbered the other way round
    own = [alone(p, "detection") for p in paths]
    order = drawn(paths, "detection")
    loader = mixed(paths, "detection", workers)
    got = [
        (i, t, int(s))
        for images, targets, sources in loader
        for i, t, s in zip(images, targets, sources, strict=True)
    ]
    loader.close()
    assert [s for _, _, s in got] == [s for s, _ in order] and {s for s, _ in order} == {0, 1}
    for (image, target, source), (_, index) in zip(got, order, strict=True):
        want_image, want = own[source][index]
        assert torch.equal(image, want_image)
        assert torch.equal(target["boxes"], want["boxes"])
        names = [classes[source][int(k)] for k in want["labels"]]
        assert [classes[0][int(k)] for k in target["labels"]] == names


def test_a_segmentation_mixture_gives_masks_and_sources(sets) -> None:
    paths = [sets["seg-a"], sets["seg-b"]]
    own = [alone(p, "segmentation") for p in paths]
    order = drawn(paths, "segmentation")
    batches = list(mixed(paths, "segmentation"))
    images, masks, sources = batches[0]
    assert images.dtype == torch.uint8 and images.shape[:2] == (4, 3)
    assert masks.shape == (4, *images.shape[2:]) and sources.dtype == torch.int64
    got = [(i, m) for images, masks, _ in batches for i, m in zip(images, masks, strict=True)]
    for (image, mask), (source, index) in zip(got, order, strict=True):
        assert torch.equal(image, own[source][index][0])
        assert torch.equal(mask, own[source][index][1])


def test_a_label_map_moves_classes_and_keeps_the_ignore_value() -> None:
    table = _label_map(np.array([2, 0, 1]))
    mask = torch.tensor([[0, 1, 2, 255]], dtype=torch.uint8)
    assert _relabelled(mask, table).tolist() == [[2, 0, 1, 255]]
    assert _relabelled(mask, table).dtype == torch.uint8
    target = {"boxes": torch.zeros(2, 4), "labels": torch.tensor([1, 2])}
    assert _relabelled(target, table)["labels"].tolist() == [0, 1]
    assert _relabelled(1, table) == 0 and _relabelled(-1, table) == -1


@pytest.mark.parametrize(
    "pair, message",
    [
        (("det-a", "seg-a"), "of one task"),
        (("det-a", "det-masks"), "instance masks"),
    ],
)
def test_a_mixture_one_batch_cannot_hold_is_refused_by_name(sets, pair, message) -> None:
    with pytest.raises(LoaderConfigError, match=message) as caught:
        mixed([sets[name] for name in pair], "detection")
    assert all(sets[name] in str(caught.value) for name in pair)


def test_dlpipe_train_reads_a_detection_mixture_and_counts_each_dataset(
    sets, tmp_path, monkeypatch
) -> None:
    from test_train import records
    from test_train_tasks import COMMON, MODELS, TESTS

    monkeypatch.syspath_prepend(str(TESTS))
    run = tmp_path / "run"
    args = ["train", sets["det-a"], sets["det-b"], "--weights", "0.5,0.5", "--out", str(run)]
    assert main([*args, *COMMON, *MODELS["detection"], "--batch-size", "4", "--epochs", "2"]) == 0
    epochs = records(run, "epoch")
    assert len(epochs) == 2 and all(np.isfinite(e["train_loss"]) for e in epochs)
    assert "map_50" in epochs[-1] and epochs[-1]["val_images"] == 4
    assert [sum(e["source_samples"]) for e in epochs] == [16, 16], epochs
