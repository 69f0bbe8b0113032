"""Benchmark: ``dlpipe.make_loader`` against a torchvision baseline and the physical limit.

One run measures, on the photo-like JPEG corpus from ``benchmarks/corpus.py`` (default 800
images of ~100 KB in 10 classes, cached under ``/tmp/dlpipe-bench-corpus/``), converted once
per format with ``dlpipe convert CORPUS --to FMT --source imagefolder --out ... --overwrite``
(a subprocess of the venv's ``dlpipe``), the samples/s of loaders that all give the same
output: the 224 px train transform (RandomResizedCrop(224) + horizontal flip), uint8 batches
of 64 (64, 3, 224, 224) and int64 labels:

a. **baseline**: what a user would write: torchvision ``ImageFolder`` (PIL loading) with
   ``transforms.RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``PILToTensor()`` and a
   ``DataLoader`` (shuffle, drop_last, persistent workers), at each ``num_workers`` in
   {0, 1, 2, 3, 4}; the best counts.
b. **dlpipe**: ``dlpipe.make_loader(path, "train", batch_size=64, num_workers=W,
   profile=None)`` for each format (wds, lmdb, hdf5) at each W in {0, ..., 4}; the best counts.
c. **decode candidates**, one process, ``torch.set_num_threads(1)``, the JPEG bytes already in
   memory: PIL decode + PIL transforms; ``torchvision.io.decode_jpeg`` and
   ``torchvision.io.decode_image`` + ``transforms.v2`` on uint8 tensors; PIL with draft mode
   (libjpeg's reduced-size DCT decode, used only when both sides are >= 2x the crop) + PIL
   transforms; and dlpipe's own ``ImageTransform`` (its per-sample path, seeded per sample).
   This says which decoder dlpipe should use.
d. **the physical limit** = cores x the best single-core rate from (c).

Each loader is built once, warmed up (max(2, W + 1) batches: worker start and first
prefetch), then timed over a fixed number of batches (default 10, epochs wrap around), three
times; the figure is the median window (one window with ``--quick``). Decode candidates are
timed over the first images of the corpus, median of 3 passes (1 with ``--quick``).

Run from the repository root, in the venv where dlpipe is installed (~3-4 min on 2 cores)::

    python benchmarks/loader.py            # writes benchmarks/results/loader.{json,md}
    python benchmarks/loader.py --quick    # 200 images, 1 window: loader_quick.*
    python benchmarks/loader.py --images 1500 --batches 10
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import PIL
import torch
import torchvision
from PIL import Image, features
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms import v2

from dlpipe.machine import usable_cpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import convert_corpus, generated_line, log, met, write_results  # sibling script
from corpus import DEFAULT_CORPUS, cached_corpus, corpus_files  # siblings
from machine import machine_info as shared_machine_info

FORMATS = ("wds", "lmdb", "hdf5")
WORKERS = (0, 1, 2, 3, 4)
BATCH = 64
SIZE = 224
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL_BASELINE = 2.0  # dlpipe >= 2x the baseline
GOAL_LIMIT = 0.9  # dlpipe >= 0.9x the physical limit


# ----------------------------------------------------------------------------------- loaders


def baseline_loader(root: str, workers: int) -> DataLoader:
    """The loader a user would write with torchvision alone."""
    transform = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])
    dataset = ImageFolder(root, transform=transform)
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def dlpipe_loader(path: str, workers: int) -> Any:
    import dlpipe

    return dlpipe.make_loader(path, "train", batch_size=BATCH, num_workers=workers, profile=None)


def forever(loader: Any) -> Iterator[Any]:
    while True:  # small corpus: epoch after epoch
        yield from loader


def time_loader(
    make: Callable[[], Any], workers: int, batches: int, windows: int
) -> dict[str, Any]:
    """Warm up, then `windows` timed windows of `batches` batches; samples/s per window."""
    t0 = time.perf_counter()
    loader = make()
    it = forever(loader)
    for _ in range(max(2, workers + 1)):
        images, labels = next(it)
    warmup_s = time.perf_counter() - t0
    assert images.dtype == torch.uint8 and tuple(images.shape) == (BATCH, 3, SIZE, SIZE)
    assert labels.dtype == torch.int64 and labels.shape == (BATCH,)
    rates = []
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        for _ in range(batches):
            images, _ = next(it)
            count += len(images)
        rates.append(count / (time.perf_counter() - start))
    del it, loader
    return {"rates": rates, "samples_per_s": statistics.median(rates), "warmup_s": warmup_s}


# ----------------------------------------------------------------------------------- decoders


def _pil_ops() -> Callable[[Image.Image], torch.Tensor]:
    return T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])


def _v2_ops() -> Callable[[torch.Tensor], torch.Tensor]:
    return v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])


def decode_candidates() -> dict[str, Callable[[bytes], torch.Tensor]]:
    """Name → bytes → uint8 (3, 224, 224) tensor, one per decoder under test."""
    pil_ops, v2_ops = _pil_ops(), _v2_ops()

    def pil(data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            return pil_ops(image.convert("RGB"))

    def pil_draft(data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            # libjpeg scales by 1/2, 1/4, 1/8 while both sides stay >= the size asked for:
            # asking for 224 x 224 reduces only images whose sides are both >= 2 x 224
            image.draft("RGB", (SIZE, SIZE))
            return pil_ops(image.convert("RGB"))

    def tv_jpeg(data: bytes) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return v2_ops(decode_jpeg(raw, mode=ImageReadMode.RGB))

    def tv_image(data: bytes) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return v2_ops(decode_image(raw, mode=ImageReadMode.RGB))

    from dlpipe.loading.transforms import ImageTransform

    dl = ImageTransform("train", SIZE, "jpg", seed=0)
    counter = iter(range(1 << 62))

    def dlpipe_transform(data: bytes) -> torch.Tensor:
        image, _ = dl({"jpg": data, "cls": b"0"}, 0, next(counter))
        return image

    return {
        "PIL decode + PIL transforms": pil,
        "torchvision.io.decode_jpeg + v2 (uint8)": tv_jpeg,
        "torchvision.io.decode_image + v2 (uint8)": tv_image,
        "PIL draft (>= 2x crop) + PIL transforms": pil_draft,
        "dlpipe ImageTransform (decode_image + v2, seeded)": dlpipe_transform,
    }


def time_decoders(files: list[str], repeats: int) -> list[dict[str, Any]]:
    """Single-process samples/s of each candidate over `files` (bytes read beforehand)."""
    blobs = [Path(p).read_bytes() for p in files]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for name, fn in decode_candidates().items():
            for data in blobs[:16]:  # warm-up
                out = fn(data)
            assert out.dtype == torch.uint8 and tuple(out.shape) == (3, SIZE, SIZE), name
            rates = []
            for _ in range(repeats):
                start = time.perf_counter()
                for data in blobs:
                    fn(data)
                rates.append(len(blobs) / (time.perf_counter() - start))
            rate = statistics.median(rates)
            rows.append({"candidate": name, "rates": rates, "samples_per_s_per_core": rate})
            log(f"  decode {name:<52} {rate:7.1f} samples/s per core")
    finally:
        torch.set_num_threads(threads)
    return rows


# ----------------------------------------------------------------------------------- setup


def machine_info() -> dict[str, Any]:
    from dlpipe import __version__ as dlpipe_version

    return shared_machine_info(
        torch=torch.__version__,
        torchvision=torchvision.__version__,
        pillow=PIL.__version__,
        libjpeg_turbo=features.version("jpg") if features.check("libjpeg_turbo") else None,
        dlpipe=dlpipe_version,
    )


# ----------------------------------------------------------------------------------- run


def run_loaders(
    corpus_root: str, datasets: dict[str, str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    contenders: list[tuple[str, str, Callable[[int], Any]]] = [
        (
            "baseline: torchvision ImageFolder + PIL",
            "baseline",
            lambda w: baseline_loader(corpus_root, w),
        )
    ]
    for fmt, path in datasets.items():
        contenders.append(
            (f"dlpipe make_loader ({fmt})", "dlpipe", lambda w, p=path: dlpipe_loader(p, w))
        )
    rows = []
    for name, kind, make in contenders:
        for workers in args.workers:
            row: dict[str, Any] = {"contender": name, "kind": kind, "workers": workers}
            try:
                row.update(
                    time_loader(lambda m=make, w=workers: m(w), workers, args.batches, args.windows)
                )
                log(f"  {name:<42} workers={workers} {row['samples_per_s']:7.1f} samples/s")
            except Exception as exc:  # e.g. too few shards for the workers: recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                log(f"  {name:<42} workers={workers} error: {row['error']}")
            rows.append(row)
    return rows


def summarise(rows: list[dict[str, Any]], decoders: list[dict[str, Any]], cores: int) -> dict:
    best_decoder = max(decoders, key=lambda r: r["samples_per_s_per_core"])
    limit = cores * best_decoder["samples_per_s_per_core"]
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if "error" in row:
            continue
        if (
            row["contender"] not in best
            or row["samples_per_s"] > best[row["contender"]]["samples_per_s"]
        ):
            best[row["contender"]] = row
    baseline = next(r for r in best.values() if r["kind"] == "baseline")
    table = []
    for name, row in best.items():
        table.append(
            {
                "contender": name,
                "kind": row["kind"],
                "workers": row["workers"],
                "samples_per_s": row["samples_per_s"],
                "x_baseline": row["samples_per_s"] / baseline["samples_per_s"],
                "x_limit": row["samples_per_s"] / limit,
            }
        )
    dl = [t for t in table if t["kind"] == "dlpipe"]
    return {
        "limit": {
            "samples_per_s": limit,
            "cores": cores,
            "per_core": best_decoder["samples_per_s_per_core"],
            "decoder": best_decoder["candidate"],
        },
        "best": table,
        "goals": {
            "x_baseline_goal": GOAL_BASELINE,
            "x_limit_goal": GOAL_LIMIT,
            "per_format": {
                t["contender"]: {
                    "x_baseline": t["x_baseline"],
                    "x_limit": t["x_limit"],
                    "baseline_met": t["x_baseline"] >= GOAL_BASELINE,
                    "limit_met": t["x_limit"] >= GOAL_LIMIT,
                }
                for t in dl
            },
            "baseline_met": bool(dl) and all(t["x_baseline"] >= GOAL_BASELINE for t in dl),
            "limit_met": bool(dl) and all(t["x_limit"] >= GOAL_LIMIT for t in dl),
        },
    }


def markdown(result: dict[str, Any]) -> str:
    m, c, cfg, s = result["machine"], result["corpus"], result["config"], result["summary"]
    lim, goals = s["limit"], s["goals"]

    lines = [
        "# `dlpipe.make_loader` against a torchvision baseline and the physical limit",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"no GPU used, Python {m['python']}, torch {m['torch']}, torchvision {m['torchvision']}, "
        f"Pillow {m['pillow']} (libjpeg-turbo {m['libjpeg_turbo']}), dlpipe {m['dlpipe']}.",
        "",
        f"Corpus (`benchmarks/corpus.py`, seed {c['seed']}): {c['images']} photo-like JPEGs in "
        f"{c['classes']} classes, {c['total_bytes'] / 1e6:.1f} MB, mean "
        f"{c['mean_bytes'] / 1e3:.1f} KB, mean {c['mean_width']:.0f}x{c['mean_height']:.0f} px"
        f"{' (reduced from the usual 1,500 to keep the run short)' if c['images'] < 1500 else ''}"
        f". Converted once per format with `dlpipe convert` ({result['convert_s']}).",
        "",
        f"Every loader yields uint8 (64, 3, 224, 224) batches of RandomResizedCrop(224) + flip. "
        f"Each is built once, warmed up (max(2, W+1) batches), then timed over {cfg['batches']} "
        f"batches ({cfg['batches'] * BATCH} samples; epochs wrap around), "
        f"{cfg['windows']} time(s); median window. Best worker count of {cfg['workers']} per "
        f"contender. Physical limit = {lim['cores']} cores x {lim['per_core']:.0f} samples/s "
        f"(the best single-core decode + transform below: {lim['decoder']}) = "
        f"{lim['samples_per_s']:.0f} samples/s.",
        "",
        "| contender | workers | samples/s | x baseline | x limit |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in s["best"]:
        lines.append(
            f"| {t['contender']} | {t['workers']} | {t['samples_per_s']:,.0f} "
            f"| {t['x_baseline']:.2f} | {t['x_limit']:.2f} |"
        )
    lines.append(
        f"| **physical limit** | {lim['cores']} cores | {lim['samples_per_s']:,.0f} | "
        f"{lim['samples_per_s'] / s['best'][0]['samples_per_s']:.2f} | 1.00 |"
    )
    per = goals["per_format"]
    lines += [
        "",
        f"- Goal dlpipe >= {goals['x_baseline_goal']:.0f}x the baseline: "
        f"{met(goals['baseline_met'])} ("
        + ", ".join(f"{k.split('(')[1].rstrip(')')} {v['x_baseline']:.2f}x" for k, v in per.items())
        + ")",
        f"- Goal dlpipe >= {goals['x_limit_goal']}x the physical limit: "
        f"{met(goals['limit_met'])} ("
        + ", ".join(f"{k.split('(')[1].rstrip(')')} {v['x_limit']:.2f}x" for k, v in per.items())
        + ")",
        "",
        "## Every loader measurement",
        "",
        "| contender | workers | samples/s | windows | warm-up s |",
        "|---|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['contender']} | {r['workers']} | error: {r['error']} | - | - |")
        else:
            windows = ", ".join(f"{x:.0f}" for x in r["rates"])
            lines.append(
                f"| {r['contender']} | {r['workers']} | {r['samples_per_s']:,.1f} | {windows} "
                f"| {r['warmup_s']:.2f} |"
            )
    decoders = sorted(result["decoders"], key=lambda r: -r["samples_per_s_per_core"])
    fastest, slowest = decoders[0], decoders[-1]
    lines += [
        "",
        "## Decode candidates, one core",
        "",
        f"One process, `torch.set_num_threads(1)`, the first {cfg['decode_images']} corpus "
        f"images' bytes in memory, each decoded to RGB and put through RandomResizedCrop(224) + "
        f"flip to a uint8 (3, 224, 224) tensor; median of {cfg['decode_repeats']} pass(es).",
        "",
        "| candidate | samples/s per core | x fastest |",
        "|---|---:|---:|",
    ]
    for r in decoders:
        lines.append(
            f"| {r['candidate']} | {r['samples_per_s_per_core']:,.1f} "
            f"| {r['samples_per_s_per_core'] / fastest['samples_per_s_per_core']:.2f} |"
        )
    lines += [
        "",
        f"Fastest per core: **{fastest['candidate']}** "
        f"({fastest['samples_per_s_per_core']:.0f} samples/s, "
        f"{fastest['samples_per_s_per_core'] / slowest['samples_per_s_per_core']:.2f}x the "
        f"slowest, {slowest['candidate']}).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, help="corpus size (default 800; --quick 200)")
    parser.add_argument("--quick", action="store_true", help="small corpus, 1 window")
    parser.add_argument("--batches", type=int, help="batches per timed window (default 10)")
    parser.add_argument("--windows", type=int, help="timed windows (default 3; --quick 1)")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--decode-images", type=int, default=200, help="images per decode pass")
    parser.add_argument("--corpus", help=f"corpus folder (default {DEFAULT_CORPUS}/<images>-s0)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    args.images = args.images or (200 if args.quick else 800)
    args.batches = args.batches or (3 if args.quick else 10)
    args.windows = args.windows or (1 if args.quick else 3)
    args.decode_repeats = 1 if args.quick else 3
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    started = time.perf_counter()
    cores = usable_cpus()
    root, corpus = cached_corpus(args.corpus, args.images, args.seed)
    log(f"corpus {root} ({'reused' if corpus['reused'] else 'made'})")
    files = corpus_files(root)
    work = tempfile.mkdtemp(prefix="dlpipe-bench-loader-")
    try:
        datasets, convert_s = {}, {}
        for fmt in args.formats:
            datasets[fmt] = os.path.join(work, fmt)
            convert_s[fmt] = convert_corpus(root, fmt, datasets[fmt])
            log(f"  converted to {fmt} in {convert_s[fmt]:.1f} s")
        decoders = time_decoders(files[: args.decode_images], args.decode_repeats)
        rows = run_loaders(root, datasets, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = "loader_quick" if args.quick else "loader"
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "images": args.images,
            "batch_size": BATCH,
            "image_size": SIZE,
            "batches": args.batches,
            "windows": args.windows,
            "workers": args.workers,
            "formats": args.formats,
            "decode_images": min(args.decode_images, len(files)),
            "decode_repeats": args.decode_repeats,
            "quick": args.quick,
            "command": "python benchmarks/loader.py" + (" " + " ".join(argv) if argv else ""),
            "json_name": f"{stem}.json",
        },
        "machine": machine_info(),
        "corpus": {k: v for k, v in corpus.items() if k not in ("per_class", "reused")},
        "convert_s": ", ".join(f"{f} {s:.1f} s" for f, s in convert_s.items()),
        "decoders": decoders,
        "rows": rows,
        "summary": summarise(rows, decoders, cores),
        "total_s": time.perf_counter() - started,
    }
    write_results(args.out, stem, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
