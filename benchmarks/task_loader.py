"""Benchmark: the detection and segmentation loaders against torchvision's own datasets over the
raw files, with the same ``torchvision.transforms.v2`` ops, in samples/s and samples per
CPU-second, in one run.

The corpus is `dlpipe.synthetic_tasks`'s scenes (textured photo-like backgrounds, 1-4 shapes
each) at 512 x 512 px, quality-90 JPEGs of about 85 KB, written once in COCO's layout (with
instance masks as RLE) and in Pascal VOC's segmentation layout, and cached under
``$TMPDIR/dlpipe-bench-tasks/``; each is converted once (``dlpipe convert RAW --to FMT``,
source detected: ``coco``, ``voc-seg``; lmdb by default, ``--formats lmdb wds hdf5`` for
every format). The contenders give the same batches:

- **detection**, torchvision's default train recipe (``hflip``: RandomHorizontalFlip,
  ConvertBoundingBoxFormat(XYXY), SanitizeBoundingBoxes; `dlpipe.loading.task_transforms`),
  batches of 16: the baseline is ``torchvision.datasets.CocoDetection`` over the raw folder,
  ``wrap_dataset_for_transforms_v2`` (targets: boxes, labels, image_id), ``v2.ToImage()``
  and the same ops (its SanitizeBoundingBoxes drops labels; dlpipe's iscrowd too), in a
  ``DataLoader`` with the references' collate (``tuple(zip(*batch))``); dlpipe is
  ``dlpipe.make_loader(DATA, "train", LoaderConfig(batch_size=16))`` on the converted
  dataset (the manifest's task picks the recipe), whose workers send a batch's targets as one
  column per key (`dlpipe.loading.targets.TargetBatch`) where the baseline's send a
  shared-memory segment per tensor. ``--detection-size N`` adds a last resize to N x N on
  both sides, which dlpipe's decode meets at a DCT scale where N is at most half the side.
- **segmentation**, the references' train recipe at their sizes (RandomResize(260, 1040),
  RandomHorizontalFlip, PadIfSmaller, RandomCrop(480)), batches of 16: the baseline is
  ``torchvision.datasets.VOCSegmentation`` over the raw folder,
  ``wrap_dataset_for_transforms_v2``, ``v2.ToImage()`` and the same ops, stacked, the masks
  as int64 (the references' ``ToDtype``); dlpipe is
  ``make_loader(DATA, "train", LoaderConfig(batch_size=16, image_size=480))``, whose masks stay
  uint8 (the trainer casts them on the device) and whose ops draw the crop first, then resize
  the whole image but only the crop window's mask (the same pixels and mask:
  `dlpipe.loading.task_transforms.segmentation_train`).

Every loader runs with the same worker processes (default: the usable cores), persistent,
shuffled. Each is built once and given one untimed epoch (worker start, page cache); then, in
rounds, each gives one whole epoch in turn (the order turning by one each round, after the
others' workers have gone idle), timed in wall seconds and in CPU seconds of this process and
its live worker processes: samples/s, samples per CPU-second (the figure other load on a
shared machine disturbs least) and cores used. Ratios are medians of the round-by-round
ratios. A profile of one process's per-sample work (``--profile``) says where the time goes.

Run from the repository root, in the venv where dlpipe is installed::

    python benchmarks/task_loader.py            # writes benchmarks/results/task_loader.{json,md}
    python benchmarks/task_loader.py --images 300 --rounds 1 --out /tmp/quick   # a smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets import CocoDetection, VOCSegmentation, wrap_dataset_for_transforms_v2
from torchvision.transforms import v2

from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.loader import make_loader
from dlpipe.loading.task_transforms import detection_ops, segmentation_ops
from dlpipe.loading.threads import one_torch_thread
from dlpipe.machine import cpu_seconds, usable_cpus
from dlpipe.synthetic_tasks import write_coco, write_voc_segmentation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # siblings
    baseline_dataloader,
    dlpipe_executable,
    generated_line,
    log,
    met,
    write_results,
)
from machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SIZE = 512
BATCH = 16
SEG_CROP = 480  # the segmentation reference's crop (its base size 520)
GOAL = 1.5  # dlpipe >= 1.5x the torchvision baseline
FORMATS = ("lmdb", "wds", "hdf5")


# ------------------------------------------------------------------------------------ corpus


def cached_corpus(images: int) -> dict[str, Path]:
    """The COCO-layout and VOC-layout raw folders of `images` scenes, written once."""
    root = Path(tempfile.gettempdir()) / "dlpipe-bench-tasks" / f"{images}-{SIZE}"
    coco, voc = root / "coco", root / "voc"
    if not (coco / ".complete").exists():
        log(f"writing {images} {SIZE} px scenes in COCO's layout under {coco}")
        write_coco(str(coco), train=images, val=0, size=SIZE)
        (coco / ".complete").touch()
    if not (voc / ".complete").exists():
        log(f"writing {images} {SIZE} px scenes in VOC's layout under {voc}")
        write_voc_segmentation(str(voc / "VOCdevkit"), train=images, val=0, size=SIZE)
        (voc / ".complete").touch()
    return {"coco": coco, "voc": voc}


def converted(raw: Path, fmt: str, out: Path, *options: str) -> Path:
    """``dlpipe convert RAW --to FMT`` (once per output folder)."""
    if (out / "dlpipe.json").exists():
        return out
    cmd = [dlpipe_executable(), "convert", str(raw), "--to", fmt, "--out", str(out), *options]
    done = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    return out


# ----------------------------------------------------------------------------------- loaders


def _references_collate(batch: list[Any]) -> tuple[Any, ...]:
    return tuple(zip(*batch, strict=True))


def coco_baseline(raw: Path, size: int | None = None) -> Dataset:
    """torchvision's CocoDetection + v2 wrapper + the detection train recipe's ops (with a
    last resize to `size` x `size` where given)."""
    *same, sanitize = detection_ops("train", size)
    assert isinstance(sanitize, v2.SanitizeBoundingBoxes)  # its labels: dlpipe's keep iscrowd
    ops = v2.Compose([v2.ToImage(), *same, v2.SanitizeBoundingBoxes()])
    annotations = str(raw / "annotations" / "instances_train.json")
    dataset = CocoDetection(str(raw / "train"), annotations, transforms=ops)
    keys = {"boxes", "labels", "image_id"}
    return wrap_dataset_for_transforms_v2(dataset, target_keys=keys)


def voc_baseline(raw: Path) -> Dataset:
    """torchvision's VOCSegmentation + v2 wrapper + the segmentation train recipe's ops."""
    ops = v2.Compose([v2.ToImage(), *segmentation_ops("train", SEG_CROP)])
    dataset = VOCSegmentation(str(raw), year="2012", image_set="train", transforms=ops)
    return wrap_dataset_for_transforms_v2(dataset)


def _stack_pairs(batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.stack([image.as_subclass(torch.Tensor) for image, _ in batch])
    masks = torch.stack([mask.as_subclass(torch.Tensor)[0].long() for _, mask in batch])
    return images, masks


def baseline_loader(task: str, raw: Path, workers: int, size: int | None = None) -> DataLoader:
    dataset = coco_baseline(raw, size) if task == "detection" else voc_baseline(raw)
    collate = _references_collate if task == "detection" else _stack_pairs
    return baseline_dataloader(dataset, BATCH, workers, collate)


def dlpipe_loader(task: str, data: Path, workers: int, size: int | None = None) -> Any:
    size = SEG_CROP if task == "segmentation" else size
    config = LoaderConfig(batch_size=BATCH, image_size=size)
    chosen = {"num_workers": workers, "engine": "processes"}
    return make_loader(str(data), "train", config, workers=chosen, profile=None)


# ----------------------------------------------------------------------------------- timing


def _settle(limit_s: float = 3.0) -> None:
    """Wait until this process and its workers are idle (prefetch queues filled)."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        cpu = cpu_seconds()
        time.sleep(0.2)
        if cpu_seconds() - cpu < 0.02:
            return


def time_epoch(loader: Any) -> tuple[int, float, float]:
    """One whole epoch: (samples, wall seconds, CPU seconds of this process and its workers)."""
    count, start, cpu = 0, time.perf_counter(), cpu_seconds()
    for images, _ in loader:
        count += len(images)
    return count, time.perf_counter() - start, cpu_seconds() - cpu


def side_by_side(loaders: dict[str, Any], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each loader's whole epochs in turns: samples/s, per CPU-second, cores, per round."""
    for name, loader in loaders.items():
        time_epoch(loader)
        log(f"  warmed up {name}")
    found: dict[str, dict[str, list[float]]] = {
        name: {"rates": [], "per_cpu": [], "cores": [], "load": []} for name in loaders
    }
    names = list(loaders)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            _settle()
            count, wall, cpu = time_epoch(loaders[name])
            row = found[name]
            row["rates"].append(count / wall)
            row["per_cpu"].append(count / max(cpu, 1e-9))
            row["cores"].append(cpu / wall)
            row["load"].append(os.getloadavg()[0])
            log(f"  round {round_ + 1}: {name}: {count / wall:.0f} samples/s, "
                f"{count / max(cpu, 1e-9):.0f} per CPU-s")  # fmt: skip
    return found


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarise(task: str, found: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    base = found["torchvision"]
    return [
        {
            "task": task,
            "loader": name,
            "samples_per_s": statistics.median(row["rates"]),
            "samples_per_cpu_s": statistics.median(row["per_cpu"]),
            "cores": statistics.median(row["cores"]),
            "x_baseline": _ratio(row["rates"], base["rates"]),
            "x_baseline_cpu": _ratio(row["per_cpu"], base["per_cpu"]),
            "rounds": row,
        }
        for name, row in found.items()
    ]


# ---------------------------------------------------------------------------------- profile


def _profiled(run: Callable[[], int]) -> dict[str, Any]:
    """`run`'s CPU per sample (it returns its sample count) and its top functions by own
    time, under cProfile (which slows both sides alike)."""
    profiler = cProfile.Profile()
    start = time.process_time()
    with one_torch_thread():  # as in a DataLoader worker
        profiler.enable()
        count = run()
        profiler.disable()
    spent = time.process_time() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(15)
    return {"cpu_ms_per_sample": 1e3 * spent / count, "top": text.getvalue()}


def per_sample_profile(
    task: str, raw: Path, data: Path, samples: int, size: int | None = None
) -> dict[str, Any]:
    """Where one process's time goes: the baseline's dataset and dlpipe's loader (0 workers:
    everything in this process), each over `samples` samples."""
    baseline = baseline_loader(task, raw, 0, size).dataset
    loader = dlpipe_loader(task, data, 0, size)

    def torchvision_side() -> int:
        for index in range(samples):
            baseline[index]
        return samples

    def dlpipe_side() -> int:
        count = 0
        for images, _ in loader:
            count += len(images)
            if count >= samples:
                break
        return count

    return {"torchvision": _profiled(torchvision_side), "dlpipe": _profiled(dlpipe_side)}


# ---------------------------------------------------------------------------------- report


def markdown(result: dict[str, Any]) -> str:
    m, cfg = result["machine"], result["config"]
    lines = [
        "# Detection and segmentation loaders against torchvision's datasets",
        "",
        generated_line(result),
        "",
        f"{cfg['images']} scenes of {SIZE} x {SIZE} px (quality-90 JPEGs, about 85 KB, 1-4 shapes "
        f"each), batches of {BATCH}, {cfg['workers']} worker processes each, "
        f"{cfg['rounds']} rounds of one whole epoch per loader. Machine: {m['cpus_usable']} "
        f"usable CPUs, torch {m['torch']}, torchvision {m['torchvision']}.",
        "",
        "| task | loader | samples/s | samples per CPU-s | cores used | x torchvision "
        "(per CPU-s) | goal >= 1.5x |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in result["table"]:
        goal = "" if row["loader"] == "torchvision" else met(row["x_baseline"] >= GOAL)
        lines.append(
            f"| {row['task']} | {row['loader']} | {row['samples_per_s']:,.0f} | "
            f"{row['samples_per_cpu_s']:,.0f} | {row['cores']:.2f} | {row['x_baseline']:.2f} "
            f"({row['x_baseline_cpu']:.2f}) | {goal} |"
        )
    lines += ["", "Recipes: " + result["recipes"], ""]
    profiles = result.get("profile", {})
    if profiles:
        lines += [
            "Per-sample CPU in one process under cProfile (one torch thread; torchvision: its "
            "dataset's items, no collate; dlpipe: the 0-worker loader, collate included; the "
            "top functions are in the JSON):",
            "",
        ]
        for task, sides in profiles.items():
            each = ", ".join(f"{n} {s['cpu_ms_per_sample']:.1f} ms" for n, s in sides.items())
            lines.append(f"- {task}: {each}")
        lines.append("")
    return "\n".join(lines)


RECIPES = (
    "detection: RandomHorizontalFlip, ConvertBoundingBoxFormat(XYXY), SanitizeBoundingBoxes "
    "(torchvision's default `hflip` policy); segmentation: RandomResize(260, 1040), "
    "RandomHorizontalFlip, PadIfSmaller(480), RandomCrop(480) (the references' train preset); "
    "its masks are int64 in torchvision's batches (the references' ToDtype), uint8 in dlpipe's "
    "(the trainer casts them on the device)."
)


def _resized(size: int | None) -> str:
    if size is None:
        return ""
    return (
        f" Detection images are resized to {size} x {size} last (Resize before the box "
        f"ops, on both sides): dlpipe decodes each {SIZE} px JPEG at the DCT scale that "
        "keeps it at least that size."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=usable_cpus())
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", default=["detection", "segmentation"])
    parser.add_argument("--formats", nargs="+", default=["lmdb"], choices=FORMATS)
    parser.add_argument("--profile", type=int, default=200, help="samples profiled (0: none)")
    parser.add_argument(
        "--detection-size",
        type=int,
        help="resize detection images to N x N last (the recipe's image_size, on both sides; "
        "dlpipe decodes a JPEG at a DCT scale where N is at most half its sides)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    start = time.perf_counter()
    raw = cached_corpus(args.images)
    work = raw["coco"].parent
    table: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    for task in args.tasks:
        source = raw["coco"] if task == "detection" else raw["voc"]
        size = args.detection_size if task == "detection" else None
        loaders = {"torchvision": baseline_loader(task, source, args.workers, size)}
        datasets = {}
        for fmt in args.formats:
            data = converted(source, fmt, work / f"{task}-{fmt}")
            datasets[fmt] = data
            loaders[f"dlpipe {fmt}"] = dlpipe_loader(task, data, args.workers, size)
        log(f"{task}: {', '.join(loaders)}")
        table += summarise(task, side_by_side(loaders, args.rounds))
        loaders.clear()
        if args.profile:
            data = datasets[args.formats[0]]
            profiles[task] = per_sample_profile(task, source, data, args.profile, size)
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "command": " ".join(["python benchmarks/task_loader.py", *sys.argv[1:]]),
            "json_name": "task_loader.json",
            "images": args.images,
            "detection_size": args.detection_size,
            "workers": args.workers,
            "rounds": args.rounds,
        },
        "machine": machine_info(torch=torch.__version__, torchvision=torchvision.__version__),
        "recipes": RECIPES + _resized(args.detection_size),
        "table": table,
        "profile": profiles,
        "total_s": time.perf_counter() - start,
    }
    write_results(args.out, "task_loader", result, markdown)


if __name__ == "__main__":
    main()
