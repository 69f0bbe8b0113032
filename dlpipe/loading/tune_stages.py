"""What ``bench-loader`` measures (`BenchConfig`) and its first step: the stages on one process.

`measure_stages` reads the split's first samples' bytes, then + decode, + transform,
+ collate, with the transform the loader builds from the config; the per-sample cost each stage
adds (`StageRates.costs`) names the bottleneck. A detection or segmentation recipe's decode
includes its targets', its transform is the joint ops on both. The whole tuner is described
in `dlpipe.loading.tune`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dlpipe.jpeg_seek import restart_layout
from dlpipe.loading.config import LoaderConfig, LoaderConfigError, recipe_task
from dlpipe.loading.dataset import MapDataset, StreamDataset, open_dataset
from dlpipe.loading.task_collate import task_collate
from dlpipe.loading.task_transforms import TaskTransform
from dlpipe.loading.threads import one_torch_thread
from dlpipe.loading.transforms import ImageTransform, decode_rgb, image_field
from dlpipe.loading.views import collate as collate_batch
from dlpipe.machine import usable_cpus
from dlpipe.manifest import read_manifest

__all__ = ["BenchConfig", "StageRates", "measure_stages"]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``bench-loader`` measures and how long it may search.

    Attributes:
        path, split: the dataset and split.
        loader: the loader config measured (resolved here for `split` and the dataset's
            task, read from its manifest); its transform must be a recipe of the task
            (``"auto"``, ``"train"``, ``"eval"``, a detection policy).
        budget_s: seconds for the whole search.
        max_workers: the largest ``num_workers`` tried (default: 2 x the usable cores).
        device: ``"cuda"`` also tries ``pin_memory`` (and, for classification, GPU decode).
        task: the task whose recipes the dataset has (`recipe_task`), set from its manifest.
    """

    path: str
    split: str = "train"
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    budget_s: float = 60.0
    max_workers: int | None = None
    device: str = "cpu"
    task: str = field(init=False, default="classification")

    def __post_init__(self) -> None:
        task = recipe_task(read_manifest(self.path).task)
        resolved = self.loader.resolved(self.split, task)
        if not isinstance(resolved.transform, str):
            raise LoaderConfigError(
                f"transform={self.loader.transform!r}: bench-loader measures the recipes "
                "only; pass transform 'auto', 'train', 'eval' or another recipe of the task"
            )
        object.__setattr__(self, "loader", resolved)
        object.__setattr__(self, "task", task)

    def worker_limit(self) -> int:
        return self.max_workers if self.max_workers is not None else 2 * usable_cpus()


@dataclass(frozen=True)
class StageRates:
    """Samples/s on one process after each stage, and the read rate in MB/s."""

    read: float
    decode: float
    transform: float
    collate: float
    read_mb_per_s: float
    crop_decode: bool = False  # the train recipe's crop-aware decode was measured
    recipe: str = ""  # ``detection ssd``, ``segmentation train``: a task recipe measured
    seekable_share: float = 0.0  # of the measured images: seekable JPEGs (`dlpipe.jpeg_seek`)

    def costs(self) -> dict[str, float]:
        """Seconds per sample each stage adds."""
        steps = [
            ("read", self.read),
            ("decode", self.decode),
            ("transform", self.transform),
            ("collate", self.collate),
        ]
        costs, before = {}, 0.0
        for name, rate in steps:
            total = 1.0 / rate
            costs[name] = max(total - before, 0.0)
            before = total
        return costs


def _clock(iterable: Iterator[Any], seconds: float, minimum: int) -> tuple[list[Any], float]:
    items, start = [], time.perf_counter()
    for item in iterable:
        items.append(item)
        if len(items) >= minimum and time.perf_counter() - start >= seconds:
            break
    return items, time.perf_counter() - start


def measure_stages(
    config: BenchConfig, seconds: float = 2.0, dataset: MapDataset | StreamDataset | None = None
) -> StageRates:
    """One process, stage by stage, on the first samples of the split (`dataset`, if it is
    open already), with the transform the loader builds from the config. A detection or
    segmentation recipe's decode includes its targets' (`TaskTransform.decode`), its
    transform is the joint ops on both."""
    from dlpipe.loading.loader import make_transform

    batch_size = config.loader.batch_size
    if dataset is None:
        dataset = open_dataset(config.path, config.split, rank=0, world_size=1)
    transform = make_transform(config.loader, dataset)
    samples, read_s = _clock(iter(dataset), seconds, minimum=batch_size)
    field_name = image_field(list(dataset.manifest.fields))
    nbytes = sum(len(s[field_name]) for s in samples)
    datas = [bytes(s[field_name]) for s in samples]
    with one_torch_thread():  # what a DataLoader worker gets
        if isinstance(transform, TaskTransform):
            times = _time_task_stages(transform, samples, batch_size)
        else:
            assert isinstance(transform, ImageTransform)  # BenchConfig admits recipes only
            times = _time_stages(transform, datas, batch_size)
    decode_s, transform_s, collate_s = times
    dataset.close()
    cumulative, rates = 0.0, []
    for step in (read_s, decode_s, transform_s, collate_s):
        cumulative += step
        rates.append(len(samples) / max(cumulative, 1e-9))
    read, decode, transform_rate, collate = rates
    return StageRates(
        read=read,
        decode=decode,
        transform=transform_rate,
        collate=collate,
        read_mb_per_s=nbytes / 1e6 / max(read_s, 1e-9),
        crop_decode=isinstance(transform, ImageTransform)
        and transform.recipe == "train"
        and transform.decode == "crop",
        recipe=f"{transform.spec.task} {transform.recipe}"
        if isinstance(transform, TaskTransform)
        else "",
        seekable_share=sum(restart_layout(d) is not None for d in datas) / max(len(datas), 1),
    )


def _time_stages(
    transform: ImageTransform, datas: list[bytes], batch_size: int
) -> tuple[float, float, float]:
    """Seconds to decode `datas`, transform the images and collate them in batches, each
    stage on the last one's output."""
    if transform.recipe == "train":  # the loader's own decode (DCT-scaled to the box), then crop
        generators = [transform.generator(0, i) for i in range(len(datas))]
        start = time.perf_counter()
        pairs = list(zip(datas, generators, strict=True))
        decoded = [transform.decode_for_crop(d, g) for d, g in pairs]
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        crops = [transform.crop_flip(*d, g) for d, g in zip(decoded, generators, strict=True)]
        transform_s = time.perf_counter() - start
    else:
        start = time.perf_counter()
        images = [decode_rgb(d) for d in datas]
        decode_s = time.perf_counter() - start
        start = time.perf_counter()
        crops = [transform.ops()(image) for image in images]
        transform_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(crops) - batch_size + 1, batch_size):
        collate_batch(crops[i : i + batch_size])
    return decode_s, transform_s, time.perf_counter() - start


def _time_task_stages(
    transform: TaskTransform, samples: list[Any], batch_size: int
) -> tuple[float, float, float]:
    """Seconds to decode `samples`' images and targets, run the recipe's joint ops on them
    and collate them in batches (`task_collate`), each stage on the last one's output."""
    start = time.perf_counter()
    decoded = [transform.decode(s, i) for i, s in enumerate(samples)]
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    pairs = [transform.apply(*d, transform.rng_seed(0, i)) for i, d in enumerate(decoded)]
    transform_s = time.perf_counter() - start
    start = time.perf_counter()
    collate = task_collate(transform.spec.task)
    for i in range(0, len(pairs) - batch_size + 1, batch_size):
        collate(pairs[i : i + batch_size])
    return decode_s, transform_s, time.perf_counter() - start
