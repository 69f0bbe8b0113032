"""The detection view of ``benchmarks/convert.py``'s corpus and the audit's own cost.

`coco_view` lays the corpus out as COCO ships it: ``annotations/instances_train.json`` beside
``train/`` holding every image (hard links to the corpus files, a copy where the filesystem
has none), with a seeded 7.3 boxes per image (COCO 2017 train's mean) over COCO's 80 category
ids (gapped, 1..90), so that ``dlpipe convert VIEW --source coco`` reads the same bytes as the
one-pass reference plus one instances JSON.

`audit_cost` times, in this one process, what the duplicate audit adds to the decode check
that convert does: the reference's colour draft decode, convert's grey 1/8-scale decode alone,
then with the difference hash it feeds; and `find_duplicates` over every image's
fingerprints. `instances_parse_s` times one ``json.load`` of the view's instances file.
"""

from __future__ import annotations

import io
import json
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import simplejpeg
from PIL import Image

from dlpipe.codecs import image_size
from dlpipe.converters import images
from dlpipe.converters.audit import Fingerprint, find_duplicates

__all__ = ["COCO_CATEGORY_IDS", "audit_cost", "coco_view", "instances_parse_s"]

COCO_CATEGORY_IDS = [i for i in range(1, 91) if i not in (12, 26, 29, 30, 45, 66, 68, 69, 71, 83)]
MEAN_OBJECTS = 7.3


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())


def _objects(rng: random.Random, width: int, height: int, image_id: int, first_id: int) -> list:
    count = min(30, int(rng.expovariate(1 / MEAN_OBJECTS)))
    objects = []
    for i in range(count):
        w, h = rng.uniform(4, width / 2), rng.uniform(4, height / 2)
        x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
        objects.append(
            {
                "id": first_id + i,
                "image_id": image_id,
                "category_id": rng.choice(COCO_CATEGORY_IDS),
                "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)],
                "area": round(w * h, 2),
                "iscrowd": 0,
                "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]],
            }
        )
    return objects


def coco_view(files: Sequence[str], work: str, seed: int = 0) -> tuple[str, int]:
    """The COCO layout of `files` under `work` (made once, untimed); returns the folder and
    the number of objects."""
    root = os.path.join(work, "coco")
    images_dir = os.path.join(root, "train")
    os.makedirs(images_dir, exist_ok=True)
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    rng = random.Random(seed)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for image_id, src in enumerate(files, start=1):
        name = f"{image_id:012d}.jpg"
        _link_or_copy(src, os.path.join(images_dir, name))
        with open(src, "rb") as f:
            size = image_size(f.read(1 << 16))
        assert size is not None, src
        width, height = size
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        annotations += _objects(rng, width, height, image_id, len(annotations) + 1)
    categories = [
        {"id": i, "name": f"category{i}", "supercategory": "thing"} for i in COCO_CATEGORY_IDS
    ]
    document = {"images": images, "annotations": annotations, "categories": categories}
    with open(os.path.join(root, "annotations", "instances_train.json"), "w") as f:
        json.dump(document, f)
    return root, len(annotations)


def _draft(data: bytes, mode: str | None = None) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.draft(mode or image.mode, (max(1, image.width // 8), max(1, image.height // 8)))
    image.load()
    return image


def audit_cost(files: Sequence[str], sample: int = 2000, repeats: int = 3) -> dict[str, Any]:
    """CPU seconds per image (the best of `repeats` passes over `sample` images) of the
    reference's colour draft decode, of convert's check without the audit (libjpeg-turbo's grey
    1/8-scale decode through simplejpeg) and with it (the same decode and the difference hash:
    `dlpipe.converters.images`' quick road), and `find_duplicates` over all `files`."""
    chosen = list(files[:: max(1, len(files) // sample)])[:sample]
    blobs = []
    for path in chosen:
        with open(path, "rb") as f:
            blobs.append(f.read())

    def reference() -> None:  # the one-pass reference's check: a colour draft
        for data in blobs:
            _draft(data)

    def grey_decode() -> None:  # convert's check less the audit
        for data in blobs:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            simplejpeg.decode_jpeg(
                data, colorspace="GRAY", min_height=-(-height // 8), min_width=-(-width // 8)
            )

    def with_audit() -> None:  # convert's check as it runs (a file's sha256 only when its
        for data in blobs:  # group could be exact copies)
            assert images._quick_jpeg_draft(data, None) is not None

    timings = {}
    for name, run in (("reference", reference), ("grey", grey_decode), ("check", with_audit)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            run()
            best = min(best, time.process_time() - t0)
        timings[name] = best / len(blobs)
    rng = random.Random(0)
    prints = [
        Fingerprint("train", f"k{i}", rng.randrange(1 << 17), rng.getrandbits(64))
        for i in range(len(files))
    ]
    t0 = time.process_time()
    find_duplicates(prints, read=lambda p: b"")  # sizes differ: nothing is read
    grouping_s = time.process_time() - t0
    return {
        "images_timed": len(blobs),
        "draft_decode_us": 1e6 * timings["reference"],
        "grey_decode_us": 1e6 * timings["grey"],
        "with_fingerprints_us": 1e6 * timings["check"],
        "fingerprint_us": 1e6 * (timings["check"] - timings["grey"]),
        "grouping_images": len(files),
        "grouping_s": grouping_s,
    }


def instances_parse_s(coco_root: str) -> float:
    """CPU seconds of one ``json.load`` of the view's instances file: the least a conversion
    that reads the annotations adds to the one-pass reference (which reads only images)."""
    t0 = time.process_time()
    with open(os.path.join(coco_root, "annotations", "instances_train.json"), "rb") as f:
        json.load(f)
    return time.process_time() - t0
