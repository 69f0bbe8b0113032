"""Benchmark: ``dlpipe.make_loader`` against torchvision, FFCV, DALI and the physical limit.

One run measures, on the photo-like JPEG corpus from ``benchmarks/corpus.py`` (default 5,000
images of ~85 KB, ~400x350 px, in 10 classes, in its ``imagenet`` encoding: qualities 75-95,
some files with optimised Huffman tables, some progressive; cached under
``/tmp/dlpipe-bench-corpus/``), converted once
per format with ``dlpipe convert CORPUS --to FMT --source imagefolder --out ... --overwrite``
(a subprocess of the venv's ``dlpipe``), the samples/s and the samples per CPU-second (this
process's threads plus its live worker processes) of loaders that all give the same output:
RandomResizedCrop(224) + horizontal flip, uint8 batches of 64 (64, 3, 224, 224), int64 labels:

a. **baseline**: what a user would write: torchvision ``ImageFolder`` (PIL loading) with
   ``transforms.RandomResizedCrop(224)``, ``RandomHorizontalFlip()``, ``PILToTensor()`` and a
   ``DataLoader`` (shuffle, drop_last, persistent workers), at each ``num_workers`` in
   {0, 1, 2, 3, 4}; the best counts.
b. **dlpipe**: ``dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=64),
   workers={"num_workers": W, "engine": E}, profile=None)`` for each format (wds, lmdb,
   hdf5), with worker processes (W in {0, ..., 4}) and with the thread engine (W threads in
   {1, ..., 4}); the best counts.
c. **peers**, where they install (``benchmarks/peers.py`` says how): FFCV in its own
   ImageNet recipe (its .beton written as FFCV's ImageNet example writes it: at most 400 px
   a side, 90 % raw pixels, 10 % quality-90 JPEGs; order QUASI_RANDOM, ``os_cache``,
   ``ToTorchImage()``), FFCV over the same JPEG bytes as the others
   (``RandomResizedCropRGBImageDecoder``, W threads) and NVIDIA DALI's CPU pipeline
   (``decoders.image_random_crop``, W threads), W in {1, ..., 4} (FFCV: at most the core
   count, which it refuses to pass); the best counts.
d. **decode candidates**, one process, ``torch.set_num_threads(1)``, the JPEG bytes already in
   memory: full decodes (PIL, ``torchvision.io.decode_jpeg``/``decode_image``, simplejpeg,
   TorchCodec's ``decode_jpeg`` where it installs, each + the same crop/flip on uint8) and
   the ones that decode less (PIL draft, dlpipe's crop-aware transform with the box's region
   decoded where a TurboJPEG 3 library is installed, and with simplejpeg's whole decode).
e. **the 2-core full-decode limit** = cores x the single-core rate of the best *full* decode
   in (d), measured again in each side-by-side round: only decoding less than the whole image
   can pass it.

Pillow-SIMD has no wheel and replaces Pillow in a venv, so it is measured by running this
script in a venv where ``pip install pillow-simd`` (a compiler and libjpeg headers needed)
replaced Pillow: the PIL rows (a) and (d) then use it, and the machine line names its version.
Measured once that way on 2 cores (Pillow-SIMD 12.1.1.post0 against Pillow 13.0.0, the PIL
decode + RandomResizedCrop(224) + flip of (d)): 823-851 against 529-571 samples per CPU-second;
its resize is 4.3x Pillow's (131-137 against 582-589 µs per crop), its decode the same.

The sweep picks each contender's count: each loader is built once, warmed up (max(2, W + 1)
batches: worker start and first prefetch), then timed over a fixed number of batches (default
10, epochs wrap around), three times; the figure is the median window (one with ``--quick``).
Each row also gives the warm-up time (to the first batches), the memory (the proportional set
size of this process and its worker processes) and the loading process's own CPU per sample:
with worker processes, what receiving their batches costs it (the IPC). Then side by side,
over whole epochs (what the summary table and the goals use): each contender at its best
count, all built at once, each given one untimed epoch (worker start, page cache, FFCV's
compilation), then timed in turns over rounds (default 5); each round gives every contender
one whole epoch, from ``iter()`` to its end, after the others' workers have gone idle, and
one pass of the best full decoder on one core (the limit); the order turns by one each round.
Each epoch gives samples/s, samples per CPU-second (the figure other load on a shared
machine disturbs least) and the cores it used (CPU-seconds over wall seconds). Ratios are
medians of the round-by-round ratios. The 1-minute load average is recorded at the start and
after each round. Decode candidates are timed in CPU time over the first images of the
corpus, the candidates alternating pass by pass, median of 5 passes (1 with ``--quick``).

Run from the repository root, in the venv where dlpipe is installed (and FFCV and DALI, for
their rows: ``benchmarks/peers.py``); on 2 shared cores the committed run took the time its
report names::

    python benchmarks/loader.py            # writes benchmarks/results/loader.{json,md}
    python benchmarks/loader.py --quick    # 200 images, 1 window, 1 round: loader_quick.*
    python benchmarks/loader.py --formats wds lmdb --seekable lmdb --workers 2 4 \
        --threads 2 4 --windows 1 --rounds 3
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
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
import simplejpeg
import torch
import torchvision
from PIL import Image, features
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image, decode_jpeg
from torchvision.transforms import v2

from dlpipe.loading.threads import one_torch_thread
from dlpipe.machine import cpu_seconds, proportional_set_size, usable_cpus
from dlpipe.turbojpeg import region_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # sibling script
    baseline_dataloader,
    convert_corpus,
    generated_line,
    log,
    met,
    without_region_decode,
    write_results,
)
from corpus import DEFAULT_CORPUS, ENCODINGS, cached_corpus, corpus_files  # siblings
from machine import machine_info as shared_machine_info
from peers import (
    FFCV_RECIPE,
    dali_available,
    dali_loader,
    ffcv_available,
    ffcv_loader,
    ffcv_recipe_loader,
)

FORMATS = ("wds", "lmdb", "hdf5")
WORKERS = (0, 1, 2, 3, 4)
THREADS = (1, 2, 3, 4)
BATCH = 64
SIZE = 224
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL_FFCV = 1.25  # dlpipe >= 1.25x FFCV
GOAL_LIMIT = 1.2  # dlpipe >= 1.2x the 2-core full-decode limit
GOAL_CPU = 1.2  # dlpipe's samples per CPU-second >= 1.2x one core's best full decode
GOAL_WDS = 0.95  # wds within 5 % of lmdb


# ----------------------------------------------------------------------------------- loaders


def baseline_loader(root: str, workers: int) -> DataLoader:
    """The loader a user would write with torchvision alone."""
    transform = T.Compose([T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.PILToTensor()])
    return baseline_dataloader(ImageFolder(root, transform=transform), BATCH, workers)


def dlpipe_loader(path: str, workers: int, engine: str) -> Any:
    import dlpipe

    config = dlpipe.LoaderConfig(batch_size=BATCH)
    chosen = {"num_workers": workers, "engine": engine}  # over the defaults (no profile)
    return dlpipe.make_loader(path, "train", config, workers=chosen, profile=None)


def pss_bytes() -> int:
    """Proportional set size of this process and its live children (worker processes)."""
    children = [c.pid for c in multiprocessing.active_children() if c.pid is not None]
    return proportional_set_size([os.getpid(), *children])


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
    memory = pss_bytes()
    assert images.dtype == torch.uint8 and tuple(images.shape) == (BATCH, 3, SIZE, SIZE)
    assert labels.dtype == torch.int64 and labels.shape == (BATCH,)
    rates, per_cpu, own = [], [], []
    for _ in range(windows):
        count, start, cpu, mine = 0, time.perf_counter(), cpu_seconds(), time.process_time()
        for _ in range(batches):
            images, _ = next(it)
            count += len(images)
        rates.append(count / (time.perf_counter() - start))
        per_cpu.append(count / max(cpu_seconds() - cpu, 1e-9))
        own.append((time.process_time() - mine) / count * 1e6)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del it, loader
    return {
        "rates": rates,
        "samples_per_s": statistics.median(rates),
        "samples_per_cpu_s": statistics.median(per_cpu),
        "loading_process_us": statistics.median(own),  # with workers: receiving the batches
        "warmup_s": warmup_s,
        "pss_mb": max(memory, pss_bytes()) / 1e6,
    }


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

    def sjpeg(data: bytes) -> torch.Tensor:
        return v2_ops(torch.from_numpy(simplejpeg.decode_jpeg(data)).permute(2, 0, 1))

    from dlpipe.loading.transforms import ImageTransform

    crop = ImageTransform("train", SIZE, "jpg", seed=0)
    counter = iter(range(1 << 62))

    def dlpipe_crop(data: bytes) -> torch.Tensor:
        image, _ = crop({"jpg": data, "cls": b"0"}, 0, next(counter))
        return image

    candidates = {
        "PIL decode + PIL transforms": pil,
        "torchvision.io.decode_jpeg + v2 (uint8)": tv_jpeg,
        "torchvision.io.decode_image + v2 (uint8)": tv_image,
        "simplejpeg + v2 (uint8)": sjpeg,
        "PIL draft (>= 2x crop) + PIL transforms": pil_draft,
        WHOLE_AT_SCALE: without_region_decode(dlpipe_crop),
    }
    if region_library() is not None:
        candidates[REGION_AT_SCALE] = dlpipe_crop
    try:  # TorchCodec: torchvision's successor for image decoding (optional)
        from torchcodec.decoders import decode_jpeg as torchcodec_jpeg
    except ImportError:
        return candidates

    def tc_jpeg(data: bytes) -> torch.Tensor:
        return v2_ops(torchcodec_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)))

    return {**candidates, "TorchCodec decode_jpeg + v2 (uint8)": tc_jpeg}


WHOLE_AT_SCALE = "dlpipe ImageTransform (crop-aware: simplejpeg at DCT scale)"
REGION_AT_SCALE = "dlpipe ImageTransform (crop-aware: box region at DCT scale, TurboJPEG 3)"
PARTIAL_DECODES = frozenset(  # candidates that decode less than the whole image
    {"PIL draft (>= 2x crop) + PIL transforms", WHOLE_AT_SCALE, REGION_AT_SCALE}
)


def one_core_rate(fn: Callable[[bytes], torch.Tensor], blobs: list[bytes]) -> float:
    """One pass of a decode candidate over `blobs` with ``torch.set_num_threads(1)``: its
    samples per CPU-second on one core."""
    with one_torch_thread():
        start = time.process_time()
        for data in blobs:
            fn(data)
        return len(blobs) / (time.process_time() - start)


def time_decoders(files: list[str], repeats: int) -> list[dict[str, Any]]:
    """One process's samples per CPU-second of each candidate over `files` (bytes read
    beforehand): the candidates alternate pass by pass, so a slow spell of a shared machine
    falls on all of them, and CPU time leaves out what other processes took."""
    blobs = [Path(p).read_bytes() for p in files]
    candidates = decode_candidates()
    rates: dict[str, list[float]] = {name: [] for name in candidates}
    for name, fn in candidates.items():
        for data in blobs[:16]:  # warm-up
            out = fn(data)
        assert out.dtype == torch.uint8 and tuple(out.shape) == (3, SIZE, SIZE), name
    for _ in range(repeats):
        for name, fn in candidates.items():
            rates[name].append(one_core_rate(fn, blobs))
    rows = []
    for name, found in rates.items():
        rate = statistics.median(found)
        full = name not in PARTIAL_DECODES
        rows.append(
            {"candidate": name, "rates": found, "samples_per_s_per_core": rate, "full": full}
        )
        log(f"  decode {name:<52} {rate:7.1f} samples per CPU-second")
    return rows


# ----------------------------------------------------------------------------------- stages


def stage_costs(datasets: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per format, one process: the CPU microseconds per sample of each stage, from the
    tuner's own stage measurement (read, the loader's decode, crop + resize + flip, collate)."""
    from dlpipe.loading.config import LoaderConfig
    from dlpipe.loading.tune_stages import BenchConfig, measure_stages

    out = {}
    for fmt, path in datasets.items():
        config = BenchConfig(path=path, loader=LoaderConfig(batch_size=BATCH, image_size=SIZE))
        measure_stages(config, seconds=1.0)  # warm-up: page cache, first-call costs
        costs = measure_stages(config, seconds=3.0).costs()
        out[fmt] = {stage: seconds * 1e6 for stage, seconds in costs.items()}
        log(f"  stages {fmt}: " + ", ".join(f"{k} {v:.0f} us" for k, v in out[fmt].items()))
    return out


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


def peer_versions() -> dict[str, str]:
    """The installed peers' versions, for the report's machine line."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name, dist in (
        ("FFCV", "ffcv"),
        ("DALI", "nvidia-dali-cuda130"),
        ("simplejpeg", "simplejpeg"),
        ("TorchCodec", "torchcodec"),
        ("turbojpeg (libjpeg-turbo 3, region decode)", "turbojpeg"),
    ):
        try:
            found[name] = version(dist)
        except PackageNotFoundError:
            continue
    return found


# ----------------------------------------------------------------------------------- run


Contender = tuple[str, str, Callable[[int], Any], tuple[int, ...]]


def contenders(
    corpus_root: str, datasets: dict[str, str], work: str, args: argparse.Namespace
) -> tuple[list[Contender], dict[str, str]]:
    """(name, kind, make(workers), worker counts) of every loader to time, and why a peer
    that does not install here is left out."""
    found: list[Contender] = [
        (
            "baseline: torchvision ImageFolder + PIL",
            "baseline",
            lambda w: baseline_loader(corpus_root, w),
            tuple(args.workers),
        )
    ]
    for fmt, path in datasets.items():
        for engine, counts in (("processes", args.workers), ("threads", args.threads)):
            name = f"dlpipe make_loader ({fmt}, {engine})"
            make = lambda w, p=path, e=engine: dlpipe_loader(p, w, e)  # noqa: E731
            found.append((name, "dlpipe", make, tuple(counts)))
    missing = {}
    if args.peers:
        peers = {
            FFCV_RECIPE_NAME: (
                ffcv_available(),
                lambda w: ffcv_recipe_loader(corpus_root, work, w),
            ),
            "FFCV (the same JPEG bytes)": (
                ffcv_available(),
                lambda w: ffcv_loader(corpus_root, work, w),
            ),
            "DALI CPU (decoders.image_random_crop)": (
                dali_available(),
                lambda w: dali_loader(corpus_root, w),
            ),
        }
        cores = usable_cpus()
        for name, (why_not, make) in peers.items():
            if why_not is None:  # FFCV refuses more threads than cores
                counts = [n for n in args.threads if n <= cores or not name.startswith("FFCV")]
                found.append((name, "peer", make, tuple(counts)))
            else:
                missing[name] = why_not
                log(f"  {name}: left out: {why_not}")
    return found, missing


def run_loaders(found: list[Contender], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, kind, make, counts in found:
        for workers in counts:
            row: dict[str, Any] = {"contender": name, "kind": kind, "workers": workers}
            try:
                row.update(
                    time_loader(lambda m=make, w=workers: m(w), workers, args.batches, args.windows)
                )
                log(
                    f"  {name:<46} workers={workers} {row['samples_per_s']:7.1f} samples/s "
                    f"{row['samples_per_cpu_s']:6.1f} per CPU-s"
                )
            except Exception as exc:  # e.g. too few shards for the workers: recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                log(f"  {name:<46} workers={workers} error: {row['error']}")
            rows.append(row)
    return rows


def _settle(limit_s: float = 3.0) -> None:
    """Wait until this process and its workers are idle: the loaders timed before have
    filled their prefetch queues, so their work does not fall into the next window."""
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        cpu = cpu_seconds()
        time.sleep(0.2)
        if cpu_seconds() - cpu < 0.02:  # under a tenth of a core
            return


def time_epoch(loader: Any) -> tuple[int, float, float]:
    """One whole epoch from ``iter(loader)``: (samples, wall seconds, CPU seconds of this
    process and its live worker processes)."""
    count, start, cpu = 0, time.perf_counter(), cpu_seconds()
    for images, _ in loader:
        count += len(images)
    return count, time.perf_counter() - start, cpu_seconds() - cpu


def side_by_side(
    found: list[Contender],
    rows: list[dict[str, Any]],
    decoders: list[dict[str, Any]],
    files: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every contender at its best count from the sweep, all built at once, each given one
    untimed epoch, then timed in turns over whole epochs: each round gives each one epoch
    (after the others' workers have gone idle: `_settle`) and one pass of the best full
    decoder on one core (the limit), the order turning by one each round, so every ratio
    compares figures measured seconds apart, round by round, however the shared machine's
    speed drifts over the run."""
    best = _best_rows(rows)
    makers = {name: make for name, _, make, _ in found}
    full = [r for r in decoders if r["full"]]
    limit_name = max(full, key=lambda r: r["samples_per_s_per_core"])["candidate"]
    limit_fn = decode_candidates()[limit_name]
    blobs = [Path(p).read_bytes() for p in files]
    loaders = {name: makers[name](row["workers"]) for name, row in best.items()}
    for name, loader in loaders.items():
        time_epoch(loader)  # warm-up: workers, page cache, FFCV's compilation
        log(f"  side by side: warmed up {name}")
    for data in blobs[:16]:
        limit_fn(data)  # warm-up
    turns = [*loaders, LIMIT]
    names = ("rates", "per_cpu", "cores", "samples", "wall_s")
    found_: dict[str, dict[str, list[float]]] = {k: {n: [] for n in turns} for k in names}
    load: list[float] = []
    for round_ in range(args.rounds):
        for name in turns[round_ % len(turns) :] + turns[: round_ % len(turns)]:
            _settle()
            if name == LIMIT:
                rate = one_core_rate(limit_fn, blobs)
                count, wall, cpu = len(blobs), len(blobs) / rate, len(blobs) / rate
            else:
                count, wall, cpu = time_epoch(loaders[name])
            for key, value in zip(
                names, (count / wall, count / max(cpu, 1e-9), cpu / wall, count, wall), strict=True
            ):
                found_[key][name].append(value)
        load.append(os.getloadavg()[0])
        log(f"  side by side: round {round_ + 1} of {args.rounds} (load {load[-1]:.2f})")
    loaders.clear()
    return {
        "limit_decoder": limit_name,
        "workers": {name: row["workers"] for name, row in best.items()},
        **found_,
        "load_average": load,
    }


LIMIT = "limit"
FFCV_RECIPE_NAME = "FFCV (its ImageNet recipe)"


def _best_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if "error" in row:
            continue
        name = row["contender"]
        if name not in best or row["samples_per_s"] > best[name]["samples_per_s"]:
            best[name] = row
    return best


def _paired(a: list[float], b: list[float]) -> float:
    """The median of round-by-round ratios a/b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarise(side: dict[str, Any], rows: list[dict[str, Any]], cores: int) -> dict[str, Any]:
    """The side-by-side round's medians, each ratio the median of its per-round ratios."""
    rates, per_cpu = side["rates"], side["per_cpu"]
    per_core = rates[LIMIT]
    limit = [cores * rate for rate in per_core]
    kinds = {row["contender"]: row["kind"] for row in rows}
    names = [name for name in rates if name != LIMIT]
    baseline = next(name for name in names if kinds[name] == "baseline")
    ffcv = FFCV_RECIPE_NAME if FFCV_RECIPE_NAME in names else None
    table = [
        {
            "contender": name,
            "kind": kinds[name],
            "workers": side["workers"][name],
            "cores_used": statistics.median(side["cores"][name]),
            "samples_per_s": statistics.median(rates[name]),
            "samples_per_cpu_s": statistics.median(per_cpu[name]),
            "x_baseline": _paired(rates[name], rates[baseline]),
            "x_baseline_cpu": _paired(per_cpu[name], per_cpu[baseline]),
            "x_ffcv": _paired(rates[name], rates[ffcv]) if ffcv else None,
            "x_ffcv_cpu": _paired(per_cpu[name], per_cpu[ffcv]) if ffcv else None,
            "x_limit": _paired(rates[name], limit),
            "x_cpu": _paired(per_cpu[name], per_core),
        }
        for name in names
    ]
    return {
        "limit": {
            "samples_per_s": statistics.median(limit),
            "cores": cores,
            "per_core": statistics.median(per_core),
            "decoder": side["limit_decoder"],
        },
        "best": table,
        "goals": goals(table, rates),
    }


def goals(table: list[dict[str, Any]], rates: dict[str, list[float]]) -> dict[str, Any]:
    """Issue 13's goals on the fastest dlpipe row, and wds against lmdb: per round, each
    format's faster engine."""
    dl = [t for t in table if t["kind"] == "dlpipe"]
    top = max(dl, key=lambda t: t["samples_per_s"])
    by_format: dict[str, list[float]] = {}
    for t in dl:
        fmt = t["contender"].split("(")[1].split(",")[0]
        rounds = rates[t["contender"]]
        known = by_format.get(fmt, [0.0] * len(rounds))
        by_format[fmt] = [max(a, b) for a, b in zip(known, rounds, strict=True)]
    both = {"wds", "lmdb"} <= set(by_format)
    wds = _paired(by_format["wds"], by_format["lmdb"]) if both else None
    return {
        "best": top["contender"],
        "x_ffcv": top["x_ffcv"],
        "ffcv_met": top["x_ffcv"] is not None and top["x_ffcv"] >= GOAL_FFCV,
        "x_ffcv_cpu": top["x_ffcv_cpu"],
        "x_limit": top["x_limit"],
        "limit_met": top["x_limit"] >= GOAL_LIMIT,
        "x_cpu": top["x_cpu"],
        "cpu_met": top["x_cpu"] >= GOAL_CPU,
        "wds_x_lmdb": wds,
        "wds_met": wds is not None and wds >= GOAL_WDS,
        "by_format": {fmt: statistics.median(r) for fmt, r in by_format.items()},
    }


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _intro(result: dict[str, Any]) -> list[str]:
    """The report's title, command, machine, corpus and method."""
    m, c, cfg, lim = (
        result["machine"],
        result["corpus"],
        result["config"],
        result["summary"]["limit"],
    )
    loads = result["side_by_side"]["load_average"]
    return [
        "# `dlpipe.make_loader` against torchvision, FFCV, DALI and the physical limit",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"no GPU used, Python {m['python']}, torch {m['torch']}, torchvision {m['torchvision']}, "
        f"Pillow {m['pillow']} (libjpeg-turbo {m['libjpeg_turbo']}), dlpipe {m['dlpipe']}"
        f"{''.join(f', {k} {v}' for k, v in result['peers'].items())}. The machine was shared: "
        f"1-minute load average {result['load_average'][0]:.1f} at the start, "
        f"{min(loads):.1f}-{max(loads):.1f} after the side-by-side rounds.",
        "",
        f"Corpus (`benchmarks/corpus.py --encoding {c.get('encoding', 'q90')}`, seed "
        f"{c['seed']}): {c['images']:,} photo-like JPEGs in {c['classes']} classes, "
        f"{c['total_bytes'] / 1e6:.1f} MB, mean {c['mean_bytes'] / 1e3:.1f} KB, mean "
        f"{c['mean_width']:.0f}x{c['mean_height']:.0f} px. Converted once per format with "
        f"`dlpipe convert` ({result['convert_s']}); *seekable* rows read a second conversion "
        "made with `--seekable-jpeg` (the same pixels, a restart marker per MCU, so a crop "
        "entropy-decodes only its box). FFCV (the same JPEG bytes) reads a .beton holding each "
        "JPEG file as it is; FFCV (its ImageNet recipe) one written as FFCV's ImageNet example "
        f"writes it ({_recipe()}; {result['ffcv_recipe_beton_mb']} MB), read with order "
        "QUASI_RANDOM, os_cache, batches_ahead 3 and `ToTorchImage()` (channels-last): "
        "`benchmarks/peers.py`.",
        "",
        "Every loader yields uint8 (64, 3, 224, 224) batches of RandomResizedCrop(224) + flip. "
        "First a sweep picks each contender's count: each count of worker processes "
        f"{cfg['workers']} or threads {cfg['threads']}, built once, warmed up (max(2, W+1) "
        f"batches), timed over {cfg['batches']} batches {cfg['windows']} time(s) (the "
        "sweep's table, below the goals). Then **side by side, over whole epochs**: each "
        "contender at its best count, all built at once, each given one untimed epoch, then "
        f"{cfg['rounds']} round(s), each giving every contender one whole epoch "
        f"({c['images'] // BATCH} batches, from `iter()` to its end, after the others' "
        "workers have gone idle) and the limit one pass, the order turning by one each round. "
        "The table gives the median epoch and, in the x columns, the median of the "
        "round-by-round ratios, so a slow spell of the shared machine falls on both sides of "
        "each ratio. **Samples per CPU-second** (this process's threads and its worker "
        "processes) is the figure the other load on this machine disturbs least; *cores used* "
        "is the epoch's CPU-seconds over its wall seconds. The 2-core full-decode limit = "
        f"{lim['cores']} cores x one core's rate of the best *full* decode + transform of the "
        f"decode candidates below ({lim['decoder']}), measured in each round: median "
        f"{lim['per_core']:.0f} samples per CPU-second, so {lim['samples_per_s']:.0f} "
        "samples/s.",
        "",
    ]


def _recipe() -> str:
    r = FFCV_RECIPE
    return (
        f'`RGBImageField(write_mode="{r["write_mode"]}", max_resolution={r["max_resolution"]}, '
        f"compress_probability={r['compress_probability']}, jpeg_quality={r['jpeg_quality']})`"
    )


def _summary_table(result: dict[str, Any]) -> list[str]:
    """The side-by-side medians, one row per contender, then the limit and missing peers."""
    s = result["summary"]
    lim = s["limit"]
    lines = [
        "| contender | workers | cores used | samples/s | samples per CPU-s | x baseline "
        "(per CPU-s) | x FFCV recipe (per CPU-s) | x limit |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in s["best"]:
        lines.append(
            f"| {t['contender']} | {t['workers']} | {t['cores_used']:.2f} "
            f"| {t['samples_per_s']:,.0f} | {t['samples_per_cpu_s']:,.0f} "
            f"| {t['x_baseline']:.2f} ({t['x_baseline_cpu']:.2f}) "
            f"| {_x(t['x_ffcv'])} ({_x(t['x_ffcv_cpu'])}) | {t['x_limit']:.2f} |"
        )
    lines.append(
        f"| **2-core full-decode limit** | - | {lim['cores']} | {lim['samples_per_s']:,.0f} "
        f"| {lim['per_core']:,.0f} | - | - | 1.00 |"
    )
    for name, why in result["missing_peers"].items():
        lines.append(f"| {name} | - | - | not measured: {why} | - | - | - | - |")
    return lines


def _goals(g: dict[str, Any]) -> list[str]:
    wds = g["wds_x_lmdb"]
    return [
        "",
        f"Goals, on the fastest dlpipe loader ({g['best']}):",
        "",
        f"- >= {GOAL_FFCV}x FFCV in its own recipe: {met(g['ffcv_met'])} ({_x(g['x_ffcv'])}x; "
        f"{_x(g['x_ffcv_cpu'])}x its samples per CPU-second)",
        f"- >= {GOAL_LIMIT}x the 2-core full-decode limit: {met(g['limit_met'])} "
        f"({g['x_limit']:.2f}x)",
        f"- samples per CPU-second >= {GOAL_CPU}x one core's best full decode + transform: "
        f"{met(g['cpu_met'])} ({g['x_cpu']:.2f}x)",
        f"- wds within 5 % of lmdb (best against best): {met(g['wds_met'])} "
        f"({'-' if wds is None else f'{wds:.2f}x'})",
    ]


def _rounds(side: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Side by side, round by round",
        "",
        "samples/s per whole epoch (samples per CPU-second, cores used in brackets); the limit "
        "row is one core's samples per CPU-second.",
        "",
        "| contender | workers | rounds |",
        "|---|---:|---|",
    ]
    for name, rates in side["rates"].items():
        cells = ", ".join(
            f"{r:,.0f} ({c:,.0f}, {k:.2f})"
            for r, c, k in zip(rates, side["per_cpu"][name], side["cores"][name], strict=True)
        )
        workers = side["workers"].get(name, "1 core")
        lines.append(f"| {name} | {workers} | {cells} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The report: summary, goals, rounds, the sweep, the stages and the decode candidates."""
    cfg = result["config"]
    lines = _intro(result) + _summary_table(result) + _goals(result["summary"]["goals"])
    lines += _rounds(result["side_by_side"])
    lines += [
        "",
        "## Every loader measurement (the sweep)",
        "",
        "The loading process's CPU per sample is everything with 0 workers or threads; with "
        "worker processes it is what receiving their batches costs (unpickling, shared-memory "
        "handles): the IPC.",
        "",
        "| contender | workers | samples/s | samples per CPU-s | loading process CPU µs "
        "per sample | windows | warm-up s | memory (PSS) MB |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['contender']} | {r['workers']} | error: {r['error']} | - | - | - | - | - |"
            )
        else:
            windows = ", ".join(f"{x:.0f}" for x in r["rates"])
            lines.append(
                f"| {r['contender']} | {r['workers']} | {r['samples_per_s']:,.1f} "
                f"| {r['samples_per_cpu_s']:,.1f} | {r['loading_process_us']:,.0f} | {windows} "
                f"| {r['warmup_s']:.2f} | {r['pss_mb']:,.0f} |"
            )
    lines += [
        "",
        "## Where a sample's CPU goes",
        "",
        "One process, the tuner's stage measurement (`dlpipe.loading.tune_stages.measure_stages`, "
        "after a warm-up), microseconds per sample: read the bytes, the loader's decode (box "
        "first, DCT scale when it allows, only the box's region where TurboJPEG 3 is "
        "installed), crop + resize + flip, collate into a batch of 64.",
        "",
        "| format | read | decode | crop + resize + flip | collate | total |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fmt, costs in result["stages"].items():
        lines.append(
            f"| {fmt} | {costs['read']:.0f} | {costs['decode']:.0f} | {costs['transform']:.0f} "
            f"| {costs['collate']:.0f} | {sum(costs.values()):.0f} |"
        )
    decoders = sorted(result["decoders"], key=lambda r: -r["samples_per_s_per_core"])
    fastest = decoders[0]
    lines += [
        "",
        "## Decode candidates, one core",
        "",
        f"One process, `torch.set_num_threads(1)`, the first {cfg['decode_images']} corpus "
        f"images' bytes in memory, each decoded to RGB and put through RandomResizedCrop(224) + "
        f"flip to a uint8 (3, 224, 224) tensor; samples per CPU-second, the candidates "
        f"alternating pass by pass, median of {cfg['decode_repeats']} pass(es) each. "
        "A full decode decodes every pixel; the others decode less (DCT scaling; the box's "
        "region: the inverse DCT and colour conversion of the rest skipped, the entropy "
        "decoding up to the box's last row still paid).",
        "",
        "| candidate | decodes | samples per CPU-second (one core) | x fastest |",
        "|---|---|---:|---:|",
    ]
    for r in decoders:
        lines.append(
            f"| {r['candidate']} | {'all' if r['full'] else 'less'} "
            f"| {r['samples_per_s_per_core']:,.1f} "
            f"| {r['samples_per_s_per_core'] / fastest['samples_per_s_per_core']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, help="corpus size (default 5000; --quick 200)")
    parser.add_argument("--quick", action="store_true", help="small corpus, 1 window, 1 round")
    parser.add_argument("--batches", type=int, help="batches per sweep window (default 10)")
    parser.add_argument("--windows", type=int, help="sweep windows (default 3; --quick 1)")
    parser.add_argument("--rounds", type=int, help="side-by-side epochs (default 5; --quick 1)")
    parser.add_argument("--encoding", choices=ENCODINGS, default="imagenet", help="corpus files")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    parser.add_argument("--threads", type=int, nargs="+", default=list(THREADS))
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="skip FFCV, DALI")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument(
        "--seekable",
        nargs="*",
        choices=FORMATS,
        default=["wds", "lmdb"] if region_library() is not None else [],
        help="formats also converted with --seekable-jpeg (default: wds lmdb where "
        "TurboJPEG 3 is installed, else none)",
    )
    parser.add_argument("--decode-images", type=int, default=200, help="images per decode pass")
    parser.add_argument("--corpus", help=f"corpus folder (default {DEFAULT_CORPUS}/<images>-s0)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    args.images = args.images or (200 if args.quick else 5000)
    args.batches = args.batches or (3 if args.quick else 10)
    args.windows = args.windows or (1 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.decode_repeats = 1 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    cores = usable_cpus()
    root, corpus = cached_corpus(args.corpus, args.images, args.seed, args.encoding)
    log(f"corpus {root} ({'reused' if corpus['reused'] else 'made'})")
    files = corpus_files(root)
    work = tempfile.mkdtemp(prefix="dlpipe-bench-loader-")
    try:
        datasets, convert_s = {}, {}
        for fmt, options in [(f, ()) for f in args.formats] + [
            (f, ("--seekable-jpeg",)) for f in args.seekable
        ]:
            name = f"{fmt} seekable" if options else fmt
            datasets[name] = os.path.join(work, name.replace(" ", "-"))
            convert_s[name] = convert_corpus(root, fmt, datasets[name], options)
            log(f"  converted to {name} in {convert_s[name]:.1f} s")
        decoders = time_decoders(files[: args.decode_images], args.decode_repeats)
        stages = stage_costs(datasets)
        found, missing = contenders(root, datasets, work, args)
        rows = run_loaders(found, args)
        side = side_by_side(found, rows, decoders, files[: args.decode_images], args)
        betons = {p.name: p.stat().st_size for p in Path(work).glob("ffcv-*.beton")}
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
            "rounds": args.rounds,
            "encoding": args.encoding,
            "workers": args.workers,
            "threads": args.threads,
            "formats": args.formats,
            "seekable": args.seekable,
            "decode_images": min(args.decode_images, len(files)),
            "decode_repeats": args.decode_repeats,
            "quick": args.quick,
            "command": "python benchmarks/loader.py" + (" " + " ".join(argv) if argv else ""),
            "json_name": f"{stem}.json",
        },
        "machine": machine_info(),
        "load_average": [load_start, os.getloadavg()[0]],
        "ffcv_beton_bytes": betons,
        "ffcv_recipe_beton_mb": round(
            sum(n for name, n in betons.items() if name.startswith("ffcv-recipe-")) / 1e6
        ),
        "corpus": {k: v for k, v in corpus.items() if k not in ("per_class", "reused")},
        "convert_s": ", ".join(f"{f} {s:.1f} s" for f, s in convert_s.items()),
        "decoders": decoders,
        "stages": stages,
        "peers": peer_versions(),
        "missing_peers": missing,
        "rows": rows,
        "side_by_side": side,
        "summary": summarise(side, rows, cores),
        "total_s": time.perf_counter() - started,
    }
    write_results(args.out, stem, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
