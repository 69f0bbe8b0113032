"""What ``dlpipe demo`` does for each task: the raw data it writes, its measured defaults, and
the small models of the detection and segmentation demos.

- classification: shape images in class folders (`dlpipe.synthetic.write_imagefolder`),
  ``shapes_cnn``;
- detection: scenes of 1-4 shapes in COCO's layout (`dlpipe.synthetic_tasks.write_coco`),
  `shapes_detector`, scored by COCO mAP@.5;
- segmentation: the same scenes in Pascal VOC's segmentation layout
  (`dlpipe.synthetic_tasks.write_voc_segmentation`), `shapes_segmenter`, scored by mIoU.

The models are torchvision's own parts on a backbone the size of the classification demo's
CNN, so that a from-scratch run learns on 2 CPU cores in minutes; torch is imported inside
them, so importing this module imports neither torch nor a room of dlpipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEMO_TASKS",
    "SCENE_SIZE",
    "DemoTask",
    "demo_task",
    "shapes_detector",
    "shapes_segmenter",
]

SCENE_SIZE = 128  # the side of a detection or segmentation scene, in pixels


@dataclass(frozen=True, kw_only=True)
class DemoTask:
    """One task's demo: its dataset's name, and the defaults of the `DemoConfig` options left
    unset (the measured recipe).

    Attributes:
        name: ``classification``, ``detection`` or ``segmentation``.
        dataset: the converted folders' prefix (``shapes-lmdb``, ``scenes-lmdb`` ...).
        per_class: images per class (the tasks: 8 x this many scenes).
        epochs, model, image_size, batch_size, lr: the training recipe.
        metric: the history key of the score the summary prints (``top1``, ``map_50``,
            ``miou``), and `metric_label` its words.
        picture: what the run folder's picture shows, and `picture_file` its name.
        time: the whole default demo on 2 CPU cores, in words (``benchmarks/demo.py``).
        next_model: a torchvision model of the task, for the summary's next step.
    """

    name: str
    dataset: str
    per_class: int
    epochs: int
    model: str
    image_size: int
    batch_size: int
    lr: float
    metric: str
    metric_label: str
    picture: str
    picture_file: str
    time: str
    next_model: str


DEMO_TASKS = {
    "classification": DemoTask(
        name="classification", dataset="shapes", per_class=400, epochs=8,
        model="dlpipe.demo:shapes_cnn", image_size=40, batch_size=64, lr=5e-3,
        metric="top1", metric_label="val top-1", picture="confusion matrix",
        picture_file="confusion.png", time="1 minute", next_model="resnet18",
    ),
    "detection": DemoTask(
        name="detection", dataset="scenes", per_class=125, epochs=10,
        model="dlpipe.demo_tasks:shapes_detector", image_size=SCENE_SIZE, batch_size=16,
        lr=3e-3, metric="map_50", metric_label="val mAP@.5", picture="predictions",
        picture_file="predictions.png", time="2 minutes",
        next_model="fasterrcnn_mobilenet_v3_large_320_fpn",
    ),
    "segmentation": DemoTask(
        name="segmentation", dataset="scenes", per_class=125, epochs=16,
        model="dlpipe.demo_tasks:shapes_segmenter", image_size=SCENE_SIZE, batch_size=16,
        lr=5e-3, metric="miou", metric_label="val mIoU", picture="predictions",
        picture_file="predictions.png", time="2 minutes", next_model="lraspp_mobilenet_v3_large",
    ),
}  # fmt: skip
"""Each task's demo; detection and segmentation measured in ``benchmarks/demo.py``."""


def demo_task(name: str) -> DemoTask:
    """The `DemoTask` of `name` (one of `DEMO_TASKS`; the option's rule checked it)."""
    return DEMO_TASKS[name]


def _conv(cin: int, cout: int, stride: int = 1) -> Any:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


_WIDTH = 64  # the backbone's channels out, and the heads'


def _stride8_cnn() -> Any:
    """Five 3x3 conv-BN-ReLU stages to stride 8, `_WIDTH` channels out (0.1 M parameters)."""
    from torch import nn

    return nn.Sequential(
        _conv(3, 16, 2),
        _conv(16, 32, 2),
        _conv(32, 32),
        _conv(32, _WIDTH, 2),
        _conv(_WIDTH, _WIDTH),
    )


def shapes_detector(num_classes: int) -> Any:
    """The detection demo's model: torchvision's FCOS on a five-stage stride-8 CNN (0.4 M
    parameters), one feature level, its 64-channel head.

    Takes float images in 0..1 (a list or a batch) and, in train mode, torchvision's targets
    (labels 1..`num_classes` - 1, 0 being the background, as `dlpipe train` gives them).
    Anchor-free FCOS learns from scratch in a few epochs where an anchor-based head needs its
    anchors tuned; images are resized inside to `SCENE_SIZE` (the demo's scenes keep theirs).
    """
    import torch
    from torch import nn
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    class Stride8(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _stride8_cnn()
            self.out_channels = _WIDTH

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"0": self.body(x)}

    # one level, its anchor the stride: FCOS's centre sampling is measured in it
    anchors = AnchorGenerator(sizes=((8,),), aspect_ratios=((1.0,),))
    return FCOS(
        Stride8(),
        num_classes=num_classes,
        anchor_generator=anchors,
        min_size=SCENE_SIZE,
        max_size=SCENE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.25, 0.25, 0.25],
    )


def shapes_segmenter(num_classes: int) -> Any:
    """The segmentation demo's model: a five-stage CNN to stride 32 (32-128 channels), its
    stride-8, -16 and -32 features upsampled onto the stride-4 ones, fused by one conv and
    classified per pixel, upsampled to the input (0.65 M parameters).

    Returns ``{"out": logits}`` at the input's size, as torchvision's segmentation models do.
    The stride-32 stage sees a whole shape at twice its size (the train recipe's largest
    scale): without it the classes of large shapes were learnt last.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Segmenter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stride4 = nn.Sequential(_conv(3, 16, 2), _conv(16, 32, 2), _conv(32, 32))
            self.stride8 = nn.Sequential(_conv(32, _WIDTH, 2), _conv(_WIDTH, _WIDTH))
            self.stride16 = nn.Sequential(_conv(_WIDTH, 96, 2), _conv(96, 96))
            self.stride32 = nn.Sequential(_conv(96, 128, 2), _conv(128, 128))
            self.fuse = _conv(32 + _WIDTH + 96 + 128, _WIDTH)
            self.classify = nn.Conv2d(_WIDTH, num_classes, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            features = [self.stride4(x)]
            for stage in (self.stride8, self.stride16, self.stride32):
                features.append(stage(features[-1]))
            size = features[0].shape[-2:]
            up = [F.interpolate(f, size=size, mode="bilinear") for f in features[1:]]
            logits = self.classify(self.fuse(torch.cat([features[0], *up], 1)))
            return {"out": F.interpolate(logits, size=x.shape[-2:], mode="bilinear")}

    return Segmenter()
