"""``--instance-masks``: each COCO annotation's segmentation as one mask of ``masks.json``
(`dlpipe.annotations`), with the scan's memory still bounded.

**Memory.** ``instances_train2017.json`` is 448 MB, most of it polygon vertices: holding them,
or their masks, in the scan would cost gigabytes, and would travel with every planned item to
the workers. So the scan (`dlpipe.converters.coco_json`, ``spans=True``) keeps of each
annotation only its byte span in the instances file, one integer (``offset << 32 | length``,
about 40 bytes with its list slot), plus the file's size and mtime once per item; the worker
that loads an image opens the file once, reads its annotations back by their spans (a seek
and a read each: a few hundred bytes, a crowd region's RLE up to ~100 kB), decodes them with
``json`` and rasterises them (`dlpipe.rle`). A worker holds one image's annotations at a time,
and the file's pages stay in the page cache between samples. The other design, each worker
parsing the whole file again for its images, would cost a 448 MB parse per worker or per
shard task.

The instances file must still be the one scanned: its size and mtime are compared, and each
annotation read back must carry the id the scan saw; otherwise the sample is skipped (a
`SampleError` naming the file: convert again).

**Segmentation → mask**, as pycocotools' ``COCO.annToRLE`` makes it, on the image's height x
width:

- a list of polygons → `dlpipe.rle.from_polygons` (their union);
- ``{"counts": [...], "size": [h, w]}`` (uncompressed: COCO's crowd regions) →
  `dlpipe.rle.from_uncompressed`, the counts kept as given;
- ``{"counts": "...", "size": [h, w]}`` (compressed: LVIS, some exporters) → kept, checked;
- absent, ``null`` or ``[]`` (Roboflow writes ``[]`` for box-only objects) → an all-zero mask,
  the object covering no pixel (pycocotools' ``annToMask`` fails on ``[]``).

An RLE whose size is not the image's, counts that are no mask of it, or polygons that are not
lists of finite numbers skip the image (`dlpipe.rle` names the rule).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from dlpipe import rle
from dlpipe.annotations import encode_masks
from dlpipe.converters.coco_json import ImageId
from dlpipe.converters.source import SampleError, display_path, open_regular

__all__ = ["MaskRef", "mask_string", "masks_field", "read_segmentations"]


class MaskRef(NamedTuple):
    """Where one image's segmentations are: the instances file, its (size, mtime in ns) when
    scanned, and each annotation's byte span (``offset << 32 | length``) in object order."""

    path: str
    stamp: tuple[int, int]
    spans: tuple[int, ...]


def masks_field(
    ref: MaskRef, ids: Sequence[ImageId], size: tuple[int, int], folder: str, origin: str
) -> bytes:
    """The ``masks.json`` bytes of one image: its annotations (ids `ids`) read back by `ref`
    and rasterised on its `size` = (width, height).

    Raises:
        SampleError: the file changed since the scan, or a segmentation is no mask of the image.
    """
    width, height = size
    strings = []
    for ann_id, segmentation in zip(ids, read_segmentations(ref, ids, folder), strict=True):
        try:
            strings.append(mask_string(segmentation, height, width))
        except rle.RLEError as exc:
            raise SampleError(
                f"{origin}: annotation {ann_id!r} in {display_path(ref.path)}: its segmentation "
                f"is no mask of the {width}x{height} image: {exc}; fix the annotation, or "
                "convert without --instance-masks"
            ) from None
    return encode_masks((height, width), strings)


def read_segmentations(ref: MaskRef, ids: Sequence[ImageId], folder: str) -> list[Any]:
    """Each annotation's ``segmentation`` value (None when absent), read back by its span.

    Raises:
        SampleError: the file cannot be read, or is not the one scanned.
    """
    changed = SampleError(
        f"{display_path(ref.path)} changed since the scan (its size, time or annotations are "
        "not what the scan read); convert again"
    )
    found = []
    with open_regular(ref.path, folder) as file:
        info = os.fstat(file.fileno())
        if (info.st_size, info.st_mtime_ns) != ref.stamp:
            raise changed
        for span, ann_id in zip(ref.spans, ids, strict=True):
            file.seek(span >> 32)
            data = file.read(span & 0xFFFFFFFF)
            try:
                entry = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                raise changed from None
            if not isinstance(entry, dict) or entry.get("id") != ann_id:
                raise changed
            found.append(entry.get("segmentation"))
    return found


def mask_string(segmentation: Any, height: int, width: int) -> str:
    """One annotation's compressed RLE string on a height x width image (module docstring).

    Raises:
        RLEError: a size that is not the image's, malformed counts or polygons.
    """
    if segmentation is None or segmentation == []:
        return rle.string_of([height * width])
    if isinstance(segmentation, list):
        return rle.from_polygons(segmentation, height, width)
    if not isinstance(segmentation, dict):
        raise rle.RLEError(f"{segmentation!r:.40} is neither polygons nor an RLE")
    size, counts = segmentation.get("size"), segmentation.get("counts")
    if size != [height, width]:
        raise rle.RLEError(f"its RLE's size {size!r:.40} is not [{height}, {width}]")
    if isinstance(counts, str):
        rle.check(counts, (height, width))
        return counts
    return rle.from_uncompressed(counts, height, width)
