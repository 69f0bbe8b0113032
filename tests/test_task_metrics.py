"""COCO mAP and mIoU: right on hand-computed cases, equal to pycocotools, and the same on 2 gloo
ranks as on 1 rank over the union."""

from __future__ import annotations

import contextlib
import io
import json
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlpipe.train.task_metrics import DetectionEval, SegmentationEval


def box(x0: float, y0: float, x1: float, y1: float) -> list[float]:
    return [x0, y0, x1, y1]


def truth(boxes: list, labels: list, image_id: int, crowd: list | None = None) -> dict:
    target = {"boxes": torch.tensor(boxes).reshape(-1, 4), "labels": torch.tensor(labels),
              "image_id": image_id}  # fmt: skip
    if crowd is not None:
        target["iscrowd"] = torch.tensor(crowd)
    return target


def found(boxes: list, scores: list, labels: list) -> dict:
    return {"boxes": torch.tensor(boxes).reshape(-1, 4), "scores": torch.tensor(scores),
            "labels": torch.tensor(labels)}  # fmt: skip


def test_a_box_of_iou_0_68_is_a_hit_at_4_of_the_10_thresholds() -> None:
    # IoU 68/100 clears 0.50, 0.55, 0.60, 0.65 and misses 0.70 ... 0.95: AP 4/10
    metric = DetectionEval(2)
    metric.update([found([box(0, 0, 10, 6.8)], [0.9], [0])], [truth([box(0, 0, 10, 10)], [0], 1)])
    result = metric.result()
    assert result.map == pytest.approx(0.4) and result.map_50 == 1.0 and result.map_75 == 0.0
    assert result.per_class_ap == [pytest.approx(0.4), None] and result.images == 1


def test_a_false_positive_ranked_first_halves_the_precision() -> None:
    # ranked: a miss (0.9), then the hit (0.8): precision 1/2 at recall 1, at every threshold
    metric = DetectionEval(1)
    metric.update(
        [found([box(50, 50, 60, 60), box(0, 0, 10, 10)], [0.9, 0.8], [0, 0])],
        [truth([box(0, 0, 10, 10)], [0], 1)],
    )
    assert metric.result().map == pytest.approx(0.5)


def test_no_images_or_an_image_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="no validation images"):
        DetectionEval(1).result()
    metric = DetectionEval(1)
    for _ in range(2):
        metric.update([found([], [], [])], [truth([box(0, 0, 4, 4)], [0], 7)])
    with pytest.raises(ValueError, match="image id 7 was evaluated twice"):
        metric.result()


def random_case(images: int, classes: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    predictions, targets = [], []
    for image_id in range(images):
        count = int(rng.integers(0, 6))
        corner = rng.uniform(0, 200, (count, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(5, 80, (count, 2))], 1)
        labels = rng.integers(0, classes, count)
        crowd = (rng.random(count) < 0.1).astype(np.int64)
        targets.append(truth(boxes.tolist(), labels.tolist(), 1000 + image_id, crowd.tolist()))
        noisy = np.concatenate([boxes + rng.normal(0, 4, boxes.shape),
                                rng.uniform(0, 250, (2, 4)).cumsum(1)])  # fmt: skip
        noisy[:, 2:] = np.maximum(noisy[:, 2:], noisy[:, :2] + 1)
        guesses = np.concatenate([labels, rng.integers(0, classes, 2)])
        predictions.append(found(noisy.tolist(), rng.random(count + 2).tolist(), guesses.tolist()))
    return predictions, targets


def pycocotools_map(predictions: list[dict], targets: list[dict]) -> tuple[list[float], Any]:
    """The same case through pycocotools' own COCO, loadRes and COCOeval."""
    from pycocotools import coco as coco_api
    from pycocotools import cocoeval as coco_eval

    images, annotations, results = [], [], []
    for prediction, target in zip(predictions, targets, strict=True):
        images.append({"id": target["image_id"]})
        for b, label, crowd in zip(target["boxes"].tolist(), target["labels"].tolist(),
                                   target["iscrowd"].tolist(), strict=True):  # fmt: skip
            w, h = b[2] - b[0], b[3] - b[1]
            annotations.append({"id": len(annotations) + 1, "image_id": target["image_id"],
                                "category_id": label, "bbox": [b[0], b[1], w, h],
                                "area": w * h, "iscrowd": crowd})  # fmt: skip
        for b, score, label in zip(prediction["boxes"].tolist(), prediction["scores"].tolist(),
                                   prediction["labels"].tolist(), strict=True):  # fmt: skip
            xywh = [b[0], b[1], b[2] - b[0], b[3] - b[1]]
            results.append({"image_id": target["image_id"], "category_id": label,
                            "bbox": xywh, "score": score})  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        gt = coco_api.COCO()
        gt.dataset = {"images": images, "annotations": annotations,
                      "categories": [{"id": k} for k in range(5)]}  # fmt: skip
        gt.createIndex()
        evaluator = coco_eval.COCOeval(gt, gt.loadRes(results), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return list(evaluator.stats[:3]), evaluator.eval["precision"]


def test_coco_map_is_pycocotools_map() -> None:
    predictions, targets = random_case(40, 5, seed=0)
    metric = DetectionEval(5)
    metric.update(predictions, targets)
    result = metric.result()
    stats, precision = pycocotools_map(predictions, targets)
    assert [result.map, result.map_50, result.map_75] == pytest.approx(stats, abs=1e-12)
    assert 0.2 < result.map < 0.9  # a case with hits and misses
    for k, ap in enumerate(result.per_class_ap):
        valid = precision[:, :, k, 0, -1]
        assert ap == pytest.approx(float(valid[valid > -1].mean()), abs=1e-12)


def test_miou_and_pixel_accuracy_by_hand_with_the_ignore_index() -> None:
    metric = SegmentationEval(3, ignore_index=255)
    logits = torch.zeros(1, 3, 2, 3)
    logits[0, :, 0, 0], logits[0, :, 0, 1], logits[0, :, 0, 2] = torch.eye(3)[[0, 1, 1]] * 5
    logits[0, :, 1, 0], logits[0, :, 1, 1], logits[0, :, 1, 2] = torch.eye(3)[[2, 2, 0]] * 5
    masks = torch.tensor([[[0, 1, 2], [2, 255, 255]]])  # predicted [[0, 1, 1], [2, 2, 0]]
    metric.update(logits, masks)
    result = metric.result()
    # counted: (0,0) (1,1) (2,1) (2,2); IoU 0: 1/1, 1: 1/2, 2: 1/2
    assert result.pixels == 4 and result.pixel_accuracy == 0.75
    assert result.per_class_iou == [1.0, 0.5, 0.5] and result.miou == pytest.approx(2 / 3)
    wrong = SegmentationEval(2, ignore_index=255)
    wrong.update(torch.tensor([[[0, 1]]]), torch.tensor([[[0, 2]]]))
    with pytest.raises(ValueError, match="1 of 2 pixels had a target or prediction outside"):
        wrong.result()


def segmentation_case(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4, 8, 8, generator=generator)
    masks = torch.randint(0, 4, (6, 8, 8), generator=generator)
    masks[:, 0] = 255
    return logits[rank::world_size], masks[rank::world_size]


def evaluate(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's share of both cases (every world_size-th image) → the metrics of all."""
    predictions, targets = random_case(30, 5, seed=1)
    detection = DetectionEval(5)
    for start in range(rank * 3, len(targets), world_size * 3):  # batches of 3 images
        detection.update(predictions[start : start + 3], targets[start : start + 3])
    segmentation = SegmentationEval(4, ignore_index=255)
    segmentation.update(*segmentation_case(rank, world_size))
    if world_size > 1:
        for tensor in segmentation.tensors():
            dist.all_reduce(tensor)
    return {"detection": asdict(detection.result()), "segmentation": asdict(segmentation.result())}


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        Path(out, f"{rank}.json").write_text(json.dumps(evaluate(rank, 2)))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_gloo_ranks_give_the_numbers_of_one_rank_on_the_union(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    one = json.loads(json.dumps(evaluate(0, 1)))
    ranks = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] == one
    assert one["detection"]["images"] == 30 and one["segmentation"]["pixels"] == 6 * 7 * 8
    shares = [len(range(r * 3, 30, 6)) for r in range(2)]
    assert shares == [5, 5]  # each rank held half of the batches
