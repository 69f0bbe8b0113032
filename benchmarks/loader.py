"""Benchmark: ``dlpipe.make_loader`` against torchvision, FFCV, DALI and the physical limit.

One run measures, on the photo-like JPEG corpus from ``benchmarks/corpus.py`` (default 800
images of ~100 KB in 10 classes, cached under ``/tmp/dlpipe-bench-corpus/``), converted once
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
c. **peers**, where they install (``benchmarks/peers.py`` says how): FFCV
   (``RandomResizedCropRGBImageDecoder``, W threads) and NVIDIA DALI's CPU pipeline
   (``decoders.image_random_crop``, W threads), W in {1, ..., 4}; the best counts.
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

The sweep: each loader is built once, warmed up (max(2, W + 1) batches: worker start and
first prefetch), then timed over a fixed number of batches (default 10, epochs wrap around),
five times; the figure is the median window (one window with ``--quick``). Each row also gives the
warm-up time (to the first batches), the memory (the proportional set size of this process
and its worker processes) and the loading process's own CPU per sample: with worker processes,
what receiving their batches costs it (the IPC). Then side by side
(what the summary table and the goals use): each contender's best count from the sweep, all
built at once, timed in turns over as many rounds; each round gives every contender one window,
after the others' workers have gone idle (they filled their prefetch queues) and its own ready
batches are drained, and one pass of the best full decoder on one core (the limit). Ratios are
medians of the round-by-round ratios: the shared machine's speed drifts by 20-30 % over a
run, which a sweep, contender after contender, turns into ratios. Decode candidates are
timed in CPU time over the first images of the corpus, the candidates alternating pass by pass,
median of 5 passes (1 with ``--quick``).

Run from the repository root, in the venv where dlpipe is installed (~4-6 min on 2 cores)::

    python benchmarks/loader.py            # writes benchmarks/results/loader.{json,md}
    python benchmarks/loader.py --quick    # 200 images, 1 window: loader_quick.*
    python benchmarks/loader.py --images 1500 --batches 10
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
    convert_corpus,
    generated_line,
    log,
    met,
    without_region_decode,
    write_results,
)
from corpus import DEFAULT_CORPUS, cached_corpus, corpus_files  # siblings
from machine import machine_info as shared_machine_info
from peers import dali_available, dali_loader, ffcv_available, ffcv_loader

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
    dataset = ImageFolder(root, transform=transform)
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


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
    from dlpipe.loading.tune import BenchConfig, measure_stages

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
            "FFCV (RandomResizedCropRGBImageDecoder)": (
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


def _drain(it: Iterator[Any], made_s: float = 0.01, most: int = 64) -> None:
    """Take the batches a loader made while it waited (its prefetch queue, whatever depth)
    until one comes as slowly as a batch being made (`made_s`; a ready one takes well
    under a millisecond): what follows is made while the window runs."""
    for _ in range(most):
        start = time.perf_counter()
        next(it)
        if time.perf_counter() - start > made_s:
            return


def side_by_side(
    found: list[Contender],
    rows: list[dict[str, Any]],
    decoders: list[dict[str, Any]],
    files: list[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Every contender at its best count from the sweep, all built at once and timed in
    turns: each round gives each one window (after the others' workers have gone idle and
    its own ready batches are drained: `_settle`, `_drain`) and one pass of the best full
    decoder on one core (the limit), so every ratio compares figures measured seconds apart,
    round by round, however the shared machine's speed drifts over the run."""
    best = _best_rows(rows)
    makers = {name: make for name, _, make, _ in found}
    full = [r for r in decoders if r["full"]]
    limit_name = max(full, key=lambda r: r["samples_per_s_per_core"])["candidate"]
    limit_fn = decode_candidates()[limit_name]
    blobs = [Path(p).read_bytes() for p in files]
    loaders: dict[str, Iterator[Any]] = {}
    for name, row in best.items():
        it = forever(makers[name](row["workers"]))
        for _ in range(max(2, row["workers"] + 1)):
            next(it)
        loaders[name] = it
    for data in blobs[:16]:
        limit_fn(data)  # warm-up
    turns = [*loaders, LIMIT]
    rates: dict[str, list[float]] = {name: [] for name in turns}
    per_cpu: dict[str, list[float]] = {name: [] for name in turns}
    for round_ in range(args.windows):
        for name in turns[round_ % len(turns) :] + turns[: round_ % len(turns)]:
            _settle()
            if name == LIMIT:
                rate = one_core_rate(limit_fn, blobs)
                rates[name].append(rate)
                per_cpu[name].append(rate)
                continue
            it = loaders[name]
            _drain(it)
            count, start, cpu = 0, time.perf_counter(), cpu_seconds()
            for _ in range(args.batches):
                images, _ = next(it)
                count += len(images)
            rates[name].append(count / (time.perf_counter() - start))
            per_cpu[name].append(count / max(cpu_seconds() - cpu, 1e-9))
        log(f"  side by side: round {round_ + 1} of {args.windows}")
    loaders.clear()
    log(f"  side by side: the limit's decoder {limit_name}")
    return {
        "limit_decoder": limit_name,
        "workers": {name: row["workers"] for name, row in best.items()},
        "rates": rates,
        "per_cpu": per_cpu,
    }


LIMIT = "limit"


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
    ffcv = next((name for name in names if name.startswith("FFCV")), None)
    table = [
        {
            "contender": name,
            "kind": kinds[name],
            "workers": side["workers"][name],
            "samples_per_s": statistics.median(rates[name]),
            "samples_per_cpu_s": statistics.median(per_cpu[name]),
            "x_baseline": _paired(rates[name], rates[baseline]),
            "x_ffcv": _paired(rates[name], rates[ffcv]) if ffcv else None,
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


def markdown(result: dict[str, Any]) -> str:
    m, c, cfg, s = result["machine"], result["corpus"], result["config"], result["summary"]
    lim, g = s["limit"], s["goals"]
    lines = [
        "# `dlpipe.make_loader` against torchvision, FFCV, DALI and the physical limit",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"no GPU used, Python {m['python']}, torch {m['torch']}, torchvision {m['torchvision']}, "
        f"Pillow {m['pillow']} (libjpeg-turbo {m['libjpeg_turbo']}), dlpipe {m['dlpipe']}"
        f"{''.join(f', {k} {v}' for k, v in result['peers'].items())}.",
        "",
        f"Corpus (`benchmarks/corpus.py`, seed {c['seed']}): {c['images']} photo-like JPEGs in "
        f"{c['classes']} classes, {c['total_bytes'] / 1e6:.1f} MB, mean "
        f"{c['mean_bytes'] / 1e3:.1f} KB, mean {c['mean_width']:.0f}x{c['mean_height']:.0f} px"
        f"{' (reduced from the usual 1,500 to keep the run short)' if c['images'] < 1500 else ''}"
        f". Converted once per format with `dlpipe convert` ({result['convert_s']}); "
        "*seekable* rows read a second conversion made with `--seekable-jpeg` (the same "
        "pixels, a restart marker per MCU, so a crop entropy-decodes only its box).",
        "",
        "Every loader yields uint8 (64, 3, 224, 224) batches of RandomResizedCrop(224) + flip. "
        "First a sweep: each contender at each count of worker processes "
        f"{cfg['workers']} or threads {cfg['threads']}, built once, warmed up (max(2, W+1) "
        f"batches), timed over {cfg['batches']} batches ({cfg['batches'] * BATCH} samples; "
        f"epochs wrap around) {cfg['windows']} time(s) (every figure below the goals). Then "
        "**side by side**: each contender's best count, all built at once, timed in turns, "
        f"{cfg['windows']} round(s), each giving every contender one window (after the "
        "others' workers have gone idle and its own ready batches are drained) and the limit "
        "one pass. The table gives the median window and, in the x columns, the median of "
        "the round-by-round ratios, so a slow spell of the shared machine falls on both sides "
        "of each ratio. Samples per CPU-second count this process's threads and its worker "
        f"processes. The 2-core full-decode limit = {lim['cores']} cores x one core's rate "
        f"of the best *full* decode + transform of the decode candidates below "
        f"({lim['decoder']}), measured in each round: median {lim['per_core']:.0f} samples "
        f"per CPU-second, so {lim['samples_per_s']:.0f} samples/s.",
        "",
        "| contender | workers | samples/s | samples per CPU-s | x baseline | x FFCV | x limit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in s["best"]:
        lines.append(
            f"| {t['contender']} | {t['workers']} | {t['samples_per_s']:,.0f} "
            f"| {t['samples_per_cpu_s']:,.0f} | {t['x_baseline']:.2f} | {_x(t['x_ffcv'])} "
            f"| {t['x_limit']:.2f} |"
        )
    lines.append(
        f"| **2-core full-decode limit** | {lim['cores']} cores | {lim['samples_per_s']:,.0f} "
        f"| {lim['per_core']:,.0f} | {lim['samples_per_s'] / s['best'][0]['samples_per_s']:.2f} "
        "| - | 1.00 |"
    )
    for name, why in result["missing_peers"].items():
        lines.append(f"| {name} | - | not measured: {why} | - | - | - | - |")
    wds = g["wds_x_lmdb"]
    lines += [
        "",
        f"Goals, on the fastest dlpipe loader ({g['best']}):",
        "",
        f"- >= {GOAL_FFCV}x FFCV: {met(g['ffcv_met'])} ({_x(g['x_ffcv'])}x)",
        f"- >= {GOAL_LIMIT}x the 2-core full-decode limit: {met(g['limit_met'])} "
        f"({g['x_limit']:.2f}x)",
        f"- samples per CPU-second >= {GOAL_CPU}x one core's best full decode + transform: "
        f"{met(g['cpu_met'])} ({g['x_cpu']:.2f}x)",
        f"- wds within 5 % of lmdb (best against best): {met(g['wds_met'])} "
        f"({'-' if wds is None else f'{wds:.2f}x'})",
        "",
        "## Side by side, round by round",
        "",
        "samples/s per window (samples per CPU-second in brackets); the limit row is one "
        "core's samples per CPU-second.",
        "",
        "| contender | workers | rounds |",
        "|---|---:|---|",
    ]
    side = result["side_by_side"]
    for name, rates in side["rates"].items():
        cells = ", ".join(
            f"{r:,.0f} ({c:,.0f})" for r, c in zip(rates, side["per_cpu"][name], strict=True)
        )
        workers = side["workers"].get(name, "1 core")
        lines.append(f"| {name} | {workers} | {cells} |")
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
        "One process, the tuner's stage measurement (`dlpipe.loading.tune.measure_stages`, "
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
    parser.add_argument("--images", type=int, help="corpus size (default 800; --quick 200)")
    parser.add_argument("--quick", action="store_true", help="small corpus, 1 window")
    parser.add_argument("--batches", type=int, help="batches per timed window (default 10)")
    parser.add_argument("--windows", type=int, help="timed windows (default 5; --quick 1)")
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
    args.images = args.images or (200 if args.quick else 800)
    args.batches = args.batches or (3 if args.quick else 10)
    args.windows = args.windows or (1 if args.quick else 5)
    args.decode_repeats = 1 if args.quick else 5
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
