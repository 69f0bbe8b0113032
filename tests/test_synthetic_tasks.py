"""The detection and segmentation demo data: each scene's boxes and masks are what it drew, and
dlpipe's own coco and voc-seg sources convert them with boxes and masks intact."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe import rle
from dlpipe.cli import main
from dlpipe.loading.task_collate import task_collate
from dlpipe.loading.task_transforms import make_task_transform
from dlpipe.sample import unescape_key
from dlpipe.synthetic import SHAPE_CLASSES
from dlpipe.synthetic_tasks import render_scene, write_coco, write_voc_segmentation

SIZE = 64


def convert(raw: Path, out: Path, *extra: str) -> int:
    return main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *extra])


def samples(out: Path, split: str) -> dict[str, dict]:
    dataset = dlpipe.open_dataset(str(out), split, rank=0, world_size=1)
    return {unescape_key(s["__key__"]): s for s in dataset}


def test_a_scene_is_seeded_and_its_boxes_bound_its_masks() -> None:
    scene = render_scene(3, seed=1, size=SIZE)
    again = render_scene(3, seed=1, size=SIZE)
    assert scene.image.tobytes() == again.image.tobytes() and len(scene.objects) >= 1
    assert render_scene(4, seed=1, size=SIZE).image.tobytes() != scene.image.tobytes()
    for obj in scene.objects:
        rows, cols = np.flatnonzero(obj.mask.any(1)), np.flatnonzero(obj.mask.any(0))
        assert obj.box == (cols[0], rows[0], cols[-1] + 1, rows[-1] + 1)
        assert (scene.label_map[obj.mask] != 0).all()  # its class or the void edge
    for label in range(len(SHAPE_CLASSES)):
        drawn = np.zeros((SIZE, SIZE), bool)
        for obj in (o for o in scene.objects if o.label == label):
            drawn |= obj.mask
        assert not ((scene.label_map == label + 1) & ~drawn).any()  # a class only where drawn
    counts = [len(render_scene(i, size=128).objects) for i in range(20)]
    assert max(counts) > 1 and min(counts) >= 1  # several shapes per image


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("coco")
    assert write_coco(str(root / "raw"), train=10, val=4, seed=2, size=SIZE)["train"] >= 10
    assert convert(root / "raw", root / "out", "--instance-masks") == 0
    return root / "raw", root / "out"


def test_the_coco_layout_converts_with_boxes_and_masks_intact(coco: tuple[Path, Path]) -> None:
    raw, out = coco
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.task == "detection" and manifest.classes == SHAPE_CLASSES
    assert manifest.class_ids == tuple(range(1, 9)) and manifest.source["skipped"] == 0
    assert {name: s.samples for name, s in manifest.splits.items()} == {"train": 10, "val": 4}
    for split, first in (("train", 0), ("val", 10)):
        stored = samples(out, split)
        for index in range(first, first + manifest.splits[split].samples):
            scene, sample = render_scene(index, seed=2, size=SIZE), stored[f"{index:06d}"]
            boxes = json.loads(sample["boxes.json"])
            assert boxes["boxes"] == [list(obj.box) for obj in scene.objects]
            assert boxes["labels"] == [obj.label for obj in scene.objects]
            assert boxes["iscrowd"] == [0] * len(scene.objects)
            masks = json.loads(sample["masks.json"])
            assert masks["size"] == [SIZE, SIZE]
            for string, obj in zip(masks["counts"], scene.objects, strict=True):
                assert np.array_equal(rle.decode(string, masks["size"]), obj.mask)
            assert json.loads(sample["json"])["image_id"] == index + 1
    data = json.loads((raw / "annotations" / "instances_val.json").read_text())
    assert data["categories"][0] == {"id": 1, "name": SHAPE_CLASSES[0]}
    for annotation in data["annotations"]:
        mask = rle.decode(annotation["segmentation"]["counts"], [SIZE, SIZE])
        assert annotation["area"] == int(mask.sum()) > 0 and annotation["iscrowd"] == 0


def test_the_converted_coco_makes_detection_batches(coco: tuple[Path, Path]) -> None:
    _, out = coco
    manifest = dlpipe.read_manifest(str(out))
    transform = make_task_transform(manifest, "train", 48, seed=0)
    pairs = [transform(s, 0, i) for i, s in enumerate(samples(out, "train").values())]
    images, targets = task_collate("detection")(pairs)
    assert images.shape == (10, 3, 48, 48) and len(targets) == 10
    assert sum(len(t["labels"]) for t in targets) > 10
    assert all(t["masks"].shape[1:] == (48, 48) for t in targets)


def test_the_voc_layout_converts_with_label_maps_intact(tmp_path: Path) -> None:
    assert write_voc_segmentation(str(tmp_path / "raw"), train=6, val=3, seed=4, size=SIZE) == {
        "train": 6, "val": 3
    }  # fmt: skip
    assert convert(tmp_path / "raw", tmp_path / "out") == 0  # detected: voc-seg
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.task == "segmentation" and manifest.classes == ("background", *SHAPE_CLASSES)
    assert manifest.field_schemas["seg.png"]["ignore"] == 255
    stored = samples(tmp_path / "out", "val")
    for index in range(6, 9):
        label_map = np.asarray(Image.open(io.BytesIO(stored[f"2026_{index:06d}"]["seg.png"])))
        scene = render_scene(index, seed=4, size=SIZE)
        assert np.array_equal(label_map, scene.label_map)
        assert {0, 255} < set(np.unique(label_map).tolist())
    transform = make_task_transform(manifest, "train", 32, seed=0)
    images, masks = task_collate("segmentation")(
        [transform(s, 0, i) for i, s in enumerate(stored.values())]
    )
    assert images.shape == (3, 3, 32, 32) and masks.shape == (3, 32, 32)
