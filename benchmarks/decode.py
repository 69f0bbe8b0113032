"""Benchmark: decode + RandomResizedCrop + flip to uint8, per decoder, in samples per CPU-second.

One process, one core (``torch.set_num_threads(1)``), the JPEG bytes already in memory, every
candidate giving the same thing: a (3, S, S) uint8 tensor, the train recipe's
RandomResizedCrop(S, scale=(0.08, 1)) + horizontal flip, seeded per sample as dlpipe seeds it.

Full decode, then ``torchvision.transforms.v2`` on the uint8 tensor:

- ``torchvision.io``: ``decode_image`` (libjpeg-turbo; deprecated for images since 0.29);
- ``pillow``: ``Image.open(...).convert("RGB")``;
- ``simplejpeg``: ``decode_jpeg`` (its bundled libjpeg-turbo);
- ``dlpipe full``: ``ImageTransform("train", decode="full")``, the old path.

Crop-aware (the box drawn from the header size first, then a DCT-scaled decode at the largest
1/k, k in 1, 2, 4, 8, keeping the box at least S on both sides, then crop + resize + flip):

- ``pillow draft``: ``Image.draft("RGB", ...)`` picks the scale;
- ``dlpipe crop``: ``ImageTransform("train")`` at the scale dlpipe picks (only the box's region
  where a TurboJPEG 3 library is installed, else simplejpeg's whole decode);
- ``dlpipe crop, whole``: the same with the region decode off (``DLPIPE_JPEG_REGION=0``);
- ``dlpipe crop, seekable``: ``dlpipe crop`` on the same JPEGs rewritten as ``dlpipe convert
  --seekable-jpeg`` stores them (a restart marker per MCU: the crop decodes a window of them).

Corpora: the photo-like corpus of ``benchmarks/corpus.py`` (ImageNet-sized, mean ~400x350 px)
at S = 224 and S = 160, and a few large photo-like images (~1600x1200 px, the same generator)
at S = 224. The candidates alternate in rounds (a shared, loaded machine slows all alike) and
the figure is samples over the CPU-seconds (``time.process_time``) summed over the rounds.
Also: the share of crops decoded at each scale, the mean absolute difference (of 255) between
``dlpipe crop`` and ``dlpipe full`` on the same seeds, and ``make_loader`` (lmdb, 0 workers,
batch 64) CPU-seconds per sample with each decode mode, and on a ``--seekable-jpeg`` conversion.

Run from the repository root, in the venv where dlpipe is installed (~3 min on 2 loaded cores)::

    python benchmarks/decode.py            # writes benchmarks/results/decode.{json,md}
    python benchmarks/decode.py --quick    # fewer images, 1 round: decode_quick.*
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # siblings
    convert_corpus,
    generated_line,
    log,
    without_region_decode,
    write_results,
)
from corpus import QUALITY, cached_corpus, corpus_files, pink_noise, scene
from machine import machine_info

import dlpipe
from dlpipe.jpeg_seek import add_restart_markers
from dlpipe.loading.transforms import ImageTransform, dct_factor
from dlpipe.turbojpeg import region_library

RESULTS_DIR = Path(__file__).resolve().parent / "results"
Candidate = Callable[[bytes, int], torch.Tensor]


_SEEKABLE = region_library() is not None  # --seekable-jpeg needs TurboJPEG 3


def large_photo(seed: int, index: int, width: int = 1600, height: int = 1200) -> bytes:
    """A large photo-like JPEG: the corpus generator's scene and 1/f texture, the texture made
    at half resolution and upscaled (a camera photo's detail per pixel is finer than ImageNet's
    downscaled photos: full-resolution texture would give 1.1 MB files, ~300 KB here)."""
    rng = np.random.default_rng([seed, index, 1])
    pixels = scene(rng, width, height)
    noise = pink_noise(rng, 1, height // 2, width // 2)[0] * 44.0
    texture = Image.fromarray(noise).resize((width, height), Image.Resampling.BICUBIC)
    pixels += np.asarray(texture)[..., None] + rng.standard_normal((height, width, 1)) * 3.0
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def seeded(index: int) -> None:
    """Seed torch's CPU generator per sample, as ImageTransform does."""
    key = np.random.SeedSequence([0, 0, index]).generate_state(1)[0]
    torch.default_generator.manual_seed(int(key))


def candidates(size: int, seekables: list[bytes] | None) -> dict[str, Candidate]:
    """Every candidate as (bytes, sample index) → (3, size, size) uint8; `seekables` are the
    samples rewritten seekable, by index (None: no TurboJPEG 3 here to rewrite them)."""
    ops = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    full = ImageTransform("train", size, "jpg", decode="full")
    crop = ImageTransform("train", size, "jpg")

    def tv_io(data: bytes, index: int) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return ops(decode_image(raw, mode=ImageReadMode.RGB))

    def pillow(data: bytes, index: int) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            array = np.array(image.convert("RGB"))
        return ops(torch.from_numpy(array).permute(2, 0, 1))

    def sjpeg(data: bytes, index: int) -> torch.Tensor:
        return ops(torch.from_numpy(simplejpeg.decode_jpeg(data)).permute(2, 0, 1))

    def pillow_draft(data: bytes, index: int) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            box = crop.sample_box(width, height)
            k = dct_factor(box.width, box.height, size)
            if k > 1:
                image.draft("RGB", (math.ceil(width / k), math.ceil(height / k)))
            array = np.array(image.convert("RGB"))
        k = width / array.shape[1]
        tensor = torch.from_numpy(array).permute(2, 0, 1)
        top, left = round(box.top / k), round(box.left / k)
        out = v2.functional.resized_crop(
            tensor, top, left, max(1, round(box.height / k)), max(1, round(box.width / k)),
            [size, size], antialias=True,
        )  # fmt: skip
        return v2.functional.horizontal_flip(out) if torch.rand(1) < 0.5 else out

    def dlpipe_full(data: bytes, index: int) -> torch.Tensor:
        return full({"jpg": data}, 0, index)[0]

    def dlpipe_crop(data: bytes, index: int) -> torch.Tensor:
        return crop({"jpg": data}, 0, index)[0]

    found: dict[str, Candidate] = {
        "torchvision.io": tv_io,
        "pillow": pillow,
        "simplejpeg": sjpeg,
        "dlpipe full": dlpipe_full,
        "pillow draft": pillow_draft,
        "dlpipe crop, whole": without_region_decode(dlpipe_crop),
        "dlpipe crop": dlpipe_crop,
    }
    if seekables is not None:
        found["dlpipe crop, seekable"] = lambda data, i: dlpipe_crop(seekables[i], i)
    return found


def measure(datas: list[bytes], size: int, rounds: int) -> dict[str, float]:
    """Samples per CPU-second of each candidate, alternating candidates in rounds."""
    seekables = [add_restart_markers(data) or data for data in datas] if _SEEKABLE else None
    cands = candidates(size, seekables)
    cpu = dict.fromkeys(cands, 0.0)
    for _ in range(rounds):
        for name, fn in cands.items():
            start = time.process_time()
            for index, data in enumerate(datas):
                seeded(index)
                out = fn(data, index)
                assert out.shape == (3, size, size), (name, out.shape)
            cpu[name] += time.process_time() - start
    return {name: rounds * len(datas) / cpu[name] for name in cands}


def scales_and_difference(datas: list[bytes], size: int) -> dict[str, Any]:
    """The share of crops decoded at each DCT scale, and dlpipe crop vs full (same seeds)."""
    full = ImageTransform("train", size, "jpg", decode="full")
    crop = ImageTransform("train", size, "jpg")
    counts = dict.fromkeys((1, 2, 4, 8), 0)
    scaled_diffs = []
    for index, data in enumerate(datas):
        seeded(index)
        width, height = Image.open(io.BytesIO(data)).size
        box = crop.sample_box(width, height)
        k = dct_factor(box.width, box.height, size)
        counts[k] += 1
        if k > 1:
            a = full({"jpg": data}, 0, index)[0].float()
            b = crop({"jpg": data}, 0, index)[0].float()
            scaled_diffs.append(float((a - b).abs().mean()))
    return {
        "scale_share": {f"1/{k}": n / len(datas) for k, n in counts.items()},
        "scaled_mean_abs_diff": float(np.mean(scaled_diffs)) if scaled_diffs else None,
        "scaled_samples": len(scaled_diffs),
    }


def loader_cpu_per_sample(root: str, epochs: int) -> dict[str, float]:
    """make_loader (lmdb, 0 workers, batch 64, 224 px): CPU-seconds per sample, each decode,
    and the crop-aware decode of the same corpus converted with ``--seekable-jpeg``."""
    out: dict[str, float] = {}
    rounds = 3
    with tempfile.TemporaryDirectory() as tmp:
        plain, seekable = os.path.join(tmp, "lmdb"), os.path.join(tmp, "lmdb-seekable")
        convert_corpus(root, "lmdb", plain)
        modes = {"full": (plain, "full"), "crop": (plain, "crop")}
        if _SEEKABLE:
            convert_corpus(root, "lmdb", seekable, ("--seekable-jpeg",))
            modes["seekable"] = (seekable, "crop")
        for _ in range(rounds):  # alternate the modes
            for mode, (path, decode) in modes.items():
                transform = ImageTransform("train", 224, "jpg", decode=decode)
                config = dlpipe.LoaderConfig(batch_size=64, transform=transform)
                loader = dlpipe.make_loader(path, "train", config, workers=0, profile=None)
                samples, start = 0, time.process_time()
                for _epoch in range(epochs):
                    for images, _labels in loader:
                        samples += len(images)
                spent = (time.process_time() - start) / samples / rounds
                out[mode] = out.get(mode, 0.0) + spent
    return out


def markdown(result: dict[str, Any]) -> str:
    names = list(result["corpora"][0]["samples_per_cpu_s"])
    lines = [
        "# Decode + RandomResizedCrop + flip, one core",
        "",
        generated_line(result),
        "",
        "Samples per CPU-second (higher is better); crop-aware rows decode at DCT scale 1/k.",
        "",
        "| corpus | output | " + " | ".join(names) + " | dlpipe crop / full | crops at 1/2+ |"
        " scaled crops: mean abs diff (of 255) |",
        "|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for row in result["corpora"]:
        rates = row["samples_per_cpu_s"]
        shares = row["scale_share"]
        scaled = 1 - shares["1/1"]
        diff = row["scaled_mean_abs_diff"]
        lines.append(
            f"| {row['corpus']} | {row['size']} | "
            + " | ".join(f"{rates[n]:.0f}" for n in names)
            + f" | {rates['dlpipe crop'] / rates['dlpipe full']:.2f}x | {scaled:.0%} | "
            + ("-" if diff is None else f"{diff:.2f}")
            + " |"
        )
    loader = result["make_loader"]
    lines += [
        "",
        "`make_loader` (lmdb, 0 workers, batch 64, 224 px) CPU-ms per sample: "
        f"full {loader['full'] * 1e3:.2f}, crop {loader['crop'] * 1e3:.2f} "
        f"({loader['full'] / loader['crop']:.2f}x)"
        + (
            f", crop of the `--seekable-jpeg` conversion {loader['seekable'] * 1e3:.2f} "
            f"({loader['full'] / loader['seekable']:.2f}x full, "
            f"{loader['crop'] / loader['seekable']:.2f}x crop)."
            if "seekable" in loader
            else " (no TurboJPEG 3 here: no seekable conversion)."
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, default=300, help="corpus images (default 300)")
    parser.add_argument("--large", type=int, default=24, help="large photos (default 24)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="100 images, 8 large, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.large, args.rounds = 100, 8, 1
    torch.set_num_threads(1)
    started = time.perf_counter()
    root, _stats = cached_corpus(None, args.images, 0)
    corpus = [Path(f).read_bytes() for f in corpus_files(root)]
    large = [large_photo(0, i) for i in range(args.large)]
    rows = []
    for name, datas, size in (("imagenet-like", corpus, 224), ("imagenet-like", corpus, 160),
                              ("large ~1600x1200", large, 224)):  # fmt: skip
        log(f"{name} at {size} px: {len(datas)} images x {args.rounds} rounds")
        rates = measure(datas, size, args.rounds)
        rows.append({"corpus": name, "size": size, "images": len(datas),
                     "samples_per_cpu_s": rates, **scales_and_difference(datas, size)})  # fmt: skip
    log("make_loader, 0 workers")
    stem = "decode_quick" if args.quick else "decode"
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "corpora": rows,
        "make_loader": loader_cpu_per_sample(root, 1 if args.quick else 3),
    }
    result["total_s"] = time.perf_counter() - started
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/decode.py", *given])
    result["config"] = {"command": command, "json_name": f"{stem}.json", **vars(args)}
    write_results(RESULTS_DIR, stem, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
