"""A seeded, photo-like JPEG corpus in ImageFolder layout, for dlpipe's benchmarks.

Benchmarks of conversion and loading need images whose JPEG size and decode cost behave like
photographs: uniform noise compresses badly and decodes slowly, flat colour compresses to
nothing. Each image here is

- a smooth colour gradient with a few soft-edged ellipses and rectangles (the large, flat
  structure of a scene),
- plus 1/f ("pink") spectrum noise made with a numpy FFT: one luminance field shared by the
  three channels and a weaker field per channel (the texture of natural images, whose
  amplitude spectrum falls roughly as 1/f),
- plus a little per-pixel sensor grain,

saved as baseline JPEG, quality 90, 4:2:0 chroma subsampling (Pillow's default), as most
camera and web JPEGs are. The ``imagenet`` encoding keeps the same pixels but varies how each
file is written, as ImageNet's files vary: quality uniform in 75-95, 4:2:0, and of every ten
files about six baseline with the standard Huffman tables, three baseline with optimised
tables and one progressive (drawn per image from its own seeded stream).

Sizes follow ImageNet's: the width is log-normal around 400 px and the aspect ratio (height /
width) log-normal around 0.87, both sides clipped to 200-800 px, for a mean near 400x350 px.
The texture amplitude is tuned so that files average about 100 KB (ImageNet's train JPEGs
average about 110 KB).

Layout: ``root/<class>/<index>.jpg`` with classes ``class_000`` ... and image ``i`` in class
``i % classes``. Image ``i`` is a pure function of ``(seed, i)``, so the corpus is
byte-identical whatever the number of worker processes. A finished corpus holds the marker
``root/.bench-corpus.json`` (its parameters and statistics); `make_corpus` returns at once
when the marker matches the parameters asked for, and otherwise rebuilds the folder (only a
folder that it made, or an empty one).

Run from the repository root::

    python benchmarks/corpus.py /tmp/corpus --images 1500 [--classes 10] [--seed 0]
        [--encoding q90|imagenet]

or from Python: ``make_corpus(root, images, classes=10, seed=0)`` → a statistics dict.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = [
    "DEFAULT_CORPUS",
    "ENCODINGS",
    "GENERATOR_VERSION",
    "MARKER_NAME",
    "cached_corpus",
    "corpus_files",
    "image_bytes",
    "make_corpus",
    "read_marker",
]

DEFAULT_CORPUS = "/tmp/dlpipe-bench-corpus"

GENERATOR_VERSION = 1  # bump when the pixels change, so cached corpora are rebuilt
MARKER_NAME = ".bench-corpus.json"
PARTIAL_NAME = ".bench-corpus.partial"
QUALITY = 90
MIN_SIDE, MAX_SIDE = 200, 800
WIDTH_MEDIAN, WIDTH_SIGMA = 390.0, 0.22
ASPECT_MEDIAN, ASPECT_SIGMA = 0.87, 0.18
SPECTRUM_EXPONENT = 0.85  # amplitude ~ 1/f**exponent
LUMA_STD, CHROMA_STD, GRAIN_STD = 44.0, 13.0, 6.0
ENCODINGS = ("q90", "imagenet")  # q90: every file baseline, quality 90; imagenet: a mix
IMAGENET_QUALITY = (75, 95)
IMAGENET_OPTIMISED, IMAGENET_PROGRESSIVE = 0.3, 0.1  # shares of the files


# ----------------------------------------------------------------------------------- pixels


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): log-normal width and aspect ratio, sides clipped to 200-800 px."""
    width = WIDTH_MEDIAN * np.exp(WIDTH_SIGMA * rng.standard_normal())
    height = width * ASPECT_MEDIAN * np.exp(ASPECT_SIGMA * rng.standard_normal())
    return (
        int(np.clip(round(width), MIN_SIDE, MAX_SIDE)),
        int(np.clip(round(height), MIN_SIDE, MAX_SIDE)),
    )


def pink_noise(rng: np.random.Generator, fields: int, height: int, width: int) -> np.ndarray:
    """`fields` zero-mean, unit-std fields (fields x H x W) with a 1/f**exponent spectrum.

    Made on a grid rounded up to a multiple of 32 (fast FFT sizes) and cropped.
    """
    grid_h, grid_w = -(-height // 32) * 32, -(-width // 32) * 32
    white = rng.standard_normal((fields, grid_h, grid_w), dtype=np.float32)
    spectrum = np.fft.rfft2(white)
    fy = np.fft.fftfreq(grid_h)[:, None]
    fx = np.fft.rfftfreq(grid_w)[None, :]
    radius = np.sqrt(fx * fx + fy * fy)
    radius[0, 0] = 1.0
    spectrum *= (radius**-SPECTRUM_EXPONENT).astype(np.float32)
    spectrum[:, 0, 0] = 0.0
    field = np.fft.irfft2(spectrum, s=(grid_h, grid_w))[:, :height, :width]
    return (field / field.std(axis=(1, 2), keepdims=True)).astype(np.float32)


def scene(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A colour gradient with a few soft-edged shapes, as float32 HxWx3."""
    corners = rng.uniform(30, 225, size=(3, 3))
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    base = corners[0] + (corners[1] - corners[0]) * x + (corners[2] - corners[0]) * y
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(radius=1.5))
    return np.asarray(image, dtype=np.float32)


def jpeg_options(seed: int, index: int, encoding: str = "q90") -> dict[str, Any]:
    """Pillow's JPEG save options for image `index`: fixed for ``q90``, drawn from a stream
    of its own for ``imagenet`` (so both encodings hold the same pixels)."""
    if encoding == "q90":
        return {"quality": QUALITY}
    rng = np.random.default_rng([seed, index, 1])
    low, high = IMAGENET_QUALITY
    options: dict[str, Any] = {"quality": int(rng.integers(low, high + 1)), "subsampling": 2}
    kind = rng.random()
    if kind < IMAGENET_PROGRESSIVE:
        options.update(progressive=True, optimize=True)
    elif kind < IMAGENET_PROGRESSIVE + IMAGENET_OPTIMISED:
        options["optimize"] = True
    return options


def jpeg_kind(options: dict[str, Any]) -> str:
    """``baseline``, ``optimised`` (baseline, its own Huffman tables) or ``progressive``."""
    if options.get("progressive"):
        return "progressive"
    return "optimised" if options.get("optimize") else "baseline"


def image_bytes(seed: int, index: int, encoding: str = "q90") -> tuple[bytes, int, int]:
    """Image `index` of the corpus seeded `seed`: (JPEG bytes, width, height)."""
    rng = np.random.default_rng([seed, index])
    width, height = image_size(rng)
    pixels = scene(rng, width, height)
    noise = pink_noise(rng, 4, height, width)  # one luminance field, then one per channel
    pixels += noise[0][..., None] * LUMA_STD
    pixels += np.moveaxis(noise[1:], 0, -1) * CHROMA_STD
    pixels += rng.standard_normal((height, width, 1), dtype=np.float32) * GRAIN_STD
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
        buffer, format="JPEG", **jpeg_options(seed, index, encoding)
    )
    return buffer.getvalue(), width, height


# ----------------------------------------------------------------------------------- corpus


def class_name(label: int) -> str:
    return f"class_{label:03d}"


def image_path(root: str, index: int, classes: int) -> str:
    return os.path.join(root, class_name(index % classes), f"{index:07d}.jpg")


Job = tuple[str, int, int, int, str]


def _write_one(job: Job) -> tuple[int, int, int]:
    """Write image `index` (a worker task); returns (bytes, width, height)."""
    root, seed, index, classes, encoding = job
    data, width, height = image_bytes(seed, index, encoding)
    with open(image_path(root, index, classes), "wb") as f:
        f.write(data)
    return len(data), width, height


def read_marker(root: str) -> dict[str, Any] | None:
    """The finished corpus's marker (parameters and statistics), or None."""
    try:
        with open(os.path.join(root, MARKER_NAME)) as f:
            marker: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return marker


def _params(images: int, classes: int, seed: int, encoding: str) -> dict[str, Any]:
    params: dict[str, Any] = {"images": images, "classes": classes, "seed": seed}
    params["version"] = GENERATOR_VERSION
    if encoding != "q90":  # the default leaves the markers of existing corpora valid
        params["encoding"] = encoding
    return params


def _clear(root: str) -> None:
    """Empty `root` when it is a corpus this module made (finished or not), or already empty."""
    if not os.path.isdir(root):
        os.makedirs(root)
        return
    ours = any(os.path.exists(os.path.join(root, n)) for n in (MARKER_NAME, PARTIAL_NAME))
    if not ours and os.listdir(root):
        raise FileExistsError(
            f"{root} is not empty and holds no {MARKER_NAME}; "
            "give make_corpus an empty or new folder"
        )
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def make_corpus(
    root: str,
    images: int,
    classes: int = 10,
    seed: int = 0,
    workers: int | None = os.cpu_count(),
    encoding: str = "q90",
) -> dict[str, Any]:
    """Make (or reuse) the corpus in `root` and return its statistics.

    `encoding` is ``q90`` (every file baseline, quality 90) or ``imagenet`` (a mix of
    qualities, optimised and progressive files: the module's docstring).

    Returns:
        ``images``, ``classes``, ``seed``, ``per_class`` (image count per class),
        ``total_bytes``, ``mean_bytes``, ``mean_width``, ``mean_height``, ``root``,
        ``reused`` (an existing matching corpus was found) and ``seconds`` (generation time).

    Raises:
        ValueError: `images` or `classes` is below 1, or `encoding` is unknown.
        FileExistsError: `root` holds other files and was not made by this function.
    """
    if images < 1 or classes < 1:
        raise ValueError(f"images ({images}) and classes ({classes}) must be at least 1")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    root = os.path.abspath(root)
    params = _params(images, classes, seed, encoding)
    marker = read_marker(root)
    if marker is not None and marker.get("params") == params:
        return {**marker["stats"], "root": root, "reused": True}

    started = time.perf_counter()
    _clear(root)
    open(os.path.join(root, PARTIAL_NAME), "w").close()
    for label in range(classes):
        os.makedirs(os.path.join(root, class_name(label)), exist_ok=True)
    jobs = [(root, seed, i, classes, encoding) for i in range(images)]
    sizes = _run(jobs, max(1, min(workers or 1, images)))
    stats = _stats(params, sizes, time.perf_counter() - started)
    _write_marker(root, {"params": params, "stats": stats})
    os.remove(os.path.join(root, PARTIAL_NAME))
    return {**stats, "root": root, "reused": False}


def _run(jobs: Sequence[Job], workers: int) -> list[tuple[int, int, int]]:
    if workers == 1:
        return [_write_one(job) for job in jobs]
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        return pool.map(_write_one, jobs, chunksize=16)


def _stats(params: dict[str, Any], sizes: list[tuple[int, int, int]], seconds: float) -> dict:
    counts = [0] * params["classes"]
    for i in range(params["images"]):
        counts[i % params["classes"]] += 1
    arr = np.asarray(sizes, dtype=np.float64)
    return {
        "images": params["images"],
        "classes": params["classes"],
        "seed": params["seed"],
        "generator_version": params["version"],
        "per_class": counts,
        "total_bytes": int(arr[:, 0].sum()),
        "mean_bytes": float(arr[:, 0].mean()),
        "median_bytes": float(np.median(arr[:, 0])),
        "mean_width": float(arr[:, 1].mean()),
        "mean_height": float(arr[:, 2].mean()),
        "min_side": int(arr[:, 1:].min()),
        "max_side": int(arr[:, 1:].max()),
        "jpeg_quality": QUALITY if "encoding" not in params else "75-95",
        **({"encoding": params["encoding"]} if "encoding" in params else {}),
        "seconds": seconds,
    }


def _write_marker(root: str, content: dict[str, Any]) -> None:
    tmp = os.path.join(root, MARKER_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(content, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(root, MARKER_NAME))


# ----------------------------------------------------------------------------------- CLI


def corpus_files(root: str) -> list[str]:
    """Every image of a corpus, in a stable order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [os.path.join(dirpath, n) for n in sorted(filenames) if n.endswith(".jpg")]
    return files


def cached_corpus(
    root: str | None, images: int, seed: int, encoding: str = "q90"
) -> tuple[str, dict[str, Any]]:
    """The corpus at `root` (default: under DEFAULT_CORPUS), made once and reused after."""
    suffix = "" if encoding == "q90" else f"-{encoding}"
    root = root or os.path.join(DEFAULT_CORPUS, f"{images}-s{seed}{suffix}")
    cpus = os.cpu_count() or 1
    return root, make_corpus(root, images, seed=seed, workers=cpus, encoding=encoding)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", help="corpus folder (made, or reused when its marker matches)")
    parser.add_argument("--images", type=int, required=True, help="number of images")
    parser.add_argument("--classes", type=int, default=10, help="number of classes (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    parser.add_argument(
        "--encoding", choices=ENCODINGS, default="q90", help="how files are written (default q90)"
    )
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count(), help="processes (default: all cores)"
    )
    args = parser.parse_args(argv)
    try:
        stats = make_corpus(
            args.out, args.images, args.classes, args.seed, args.workers, args.encoding
        )
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{'reused' if stats['reused'] else 'made'} {stats['root']}: {stats['images']} images, "
        f"{stats['classes']} classes, {stats['total_bytes'] / 1e6:.1f} MB, "
        f"mean {stats['mean_bytes'] / 1e3:.1f} KB, "
        f"mean {stats['mean_width']:.0f}x{stats['mean_height']:.0f} px"
        + ("" if stats["reused"] else f", in {stats['seconds']:.1f} s")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
