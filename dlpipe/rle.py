"""COCO's run-length encoding of binary masks, in numpy: what ``pycocotools.mask`` writes and
reads, without pycocotools.

A mask of H x W pixels is read in column-major (Fortran) order, pixel ``(y, x)`` at ``x * H +
y``, as alternating run lengths, zeros first (a mask whose first pixel is set starts with a run
of 0): its *uncompressed* counts. The *compressed* form (``rleToString`` in pycocotools'
``maskApi.c``) writes each count from the fourth on as its difference from the count two before,
then every count as 5-bit groups, least significant first, each group plus 48 one ASCII
character, bit ``0x20`` set on every group of a count but its last, whose bit ``0x10`` is the
sign. ``decode(s, (h, w))`` gives what ``pycocotools.mask.decode({"size": [h, w], "counts":
s})`` gives, as an (H, W) uint8 array:

- `encode`: a mask's compressed counts, as ``mask.encode(np.asfortranarray(m))``.
- `from_polygons`: COCO polygons, as ``mask.merge(mask.frPyObjects(polygons, h, w))``.
- `from_uncompressed`: a crowd region's count list, as ``mask.frPyObjects(rle, h, w)``.
- `decode`, `check`; `counts_of` / `string_of` convert between the two forms.

**Polygons** follow ``rleFrPoly`` step by step: vertices scaled by 5 and rounded (C's
``(int)(5 * v + .5)``, which truncates towards zero), every edge walked one upsampled step at a
time along its longer axis (rounding the other coordinate the same way), and a column
boundary kept where the walk crosses a pixel centre's upsampled column ``5 x + 2.5``, at row
``ceil((v + .5) / 5 - .5)`` clamped to ``[0, H]``; the boundaries toggle the mask in
column-major order. So a pixel is set when its centre lies inside the polygon drawn on a 1/5-pixel
grid: an axis-aligned rectangle ``[x0, x1] x [y0, y1]`` sets the pixels whose ``5 x + 2`` lies in
``[r(5 x0), r(5 x1))`` and ``5 y + 2`` in ``[r(5 y0), r(5 y1))``, ``r`` rounding half up. The
arithmetic is IEEE double in pycocotools' order. Where this differs from pycocotools:

- ``frPyObjects`` reads a list whose *first* polygon has exactly 4 numbers as ``[x, y, w, h]``
  boxes, and fails on an empty list or a first polygon of fewer than 4 numbers; `from_polygons`
  reads every list as a polygon, and one of fewer than 3 vertices sets no pixel (which is what
  ``rleFrPoly`` gives it). A trailing odd number is ignored, as ``rleFrPoly``'s ``k = n / 2``.
- A repeated vertex makes ``rleFrPoly`` divide 0 by 0 and cast the NaN to ``int`` (undefined in
  C); the point it computes sits between two of the same column, so it never makes a boundary,
  and here its row is 0: the same mask.
- A build that fuses ``ys + s * t`` into one multiply-add (GCC's default on aarch64) may round
  a walked point that falls exactly on ``.5`` otherwise; x86-64 builds compute as here.
- Refused, where pycocotools has undefined behaviour or runs out of memory: a coordinate
  whose upsampled value is beyond C's ``int``, a polygon whose walk is over
  `MAX_POLYGON_POINTS` upsampled points, counts that are negative, not integers, or do not sum
  to H x W (pycocotools casts them to uint32 and reads or writes past the mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dlpipe.errors import DlpipeError

__all__ = [
    "MAX_POLYGON_POINTS",
    "RLEError",
    "check",
    "counts_of",
    "decode",
    "encode",
    "from_polygons",
    "from_uncompressed",
    "string_of",
]

MAX_POLYGON_POINTS = 1 << 21
"""The most upsampled points one polygon's walk may visit (about 400,000 pixels of outline;
COCO's longest is a few thousand); each costs about 60 bytes while it is rasterised."""
_SCALE = 5.0
_MAX_GROUPS = 7  # a count below 2**32, or a difference of two, is at most 35 bits: 7 groups
_INT_LIMIT = 2.0**31  # C's int, which rleFrPoly's upsampled coordinates are


class RLEError(DlpipeError, ValueError):
    """Counts or polygons that are no COCO mask of the size given."""


def counts_of(string: str) -> np.ndarray:
    """The uncompressed counts of a compressed RLE string (pycocotools' ``rleFrString``).

    Raises:
        RLEError: a character outside ``0``..``o``, a count cut off at the end, one over 7
            characters, or a count below 0 or above 2**32 - 1.
    """
    try:
        chars = np.frombuffer(string.encode("ascii"), np.uint8).astype(np.int64) - 48
    except UnicodeEncodeError:
        raise RLEError("the counts hold a character that is not ASCII") from None
    if chars.size and (chars.min() < 0 or chars.max() > 63):
        raise RLEError("the counts hold a character outside '0'..'o' (ASCII 48-111)")
    last = (chars & 0x20) == 0
    if chars.size and not last[-1]:
        raise RLEError("the counts end inside a count (its last character has bit 0x20 set)")
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if lengths.size and lengths.max() > _MAX_GROUPS:
        raise RLEError(f"the counts hold a count of over {_MAX_GROUPS} characters")
    if not ends.size:
        return np.zeros(0, np.int64)
    shift = 5 * (np.arange(chars.size) - np.repeat(starts, lengths))
    values = np.add.reduceat((chars & 0x1F) << shift, starts)
    values -= np.where(chars[ends] & 0x10, np.int64(1) << (5 * lengths), 0)  # sign-extend
    counts = values.copy()
    counts[1::2] = np.cumsum(values[1::2])  # from the fourth on: the difference from two before
    counts[2::2] = np.cumsum(values[2::2])
    if counts.min() < 0 or counts.max() >= 2**32:
        raise RLEError("the counts hold a run length below 0 or over 2**32 - 1")
    return counts


def string_of(counts: Sequence[int] | np.ndarray) -> str:
    """The compressed RLE string of uncompressed counts (pycocotools' ``rleToString``)."""
    values = np.asarray(counts, dtype=np.int64).copy()
    values[3:] -= np.asarray(counts, dtype=np.int64)[1:-2]
    sizes = np.ones(values.size, np.int64)  # characters: the fewest 5-bit groups that hold it
    for groups in range(1, _MAX_GROUPS + 1):
        bound = np.int64(1) << (5 * groups - 1)
        sizes += (values >= bound) | (values < -bound)
    shift = 5 * (np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes))
    spread = np.repeat(values, sizes)
    more = shift < 5 * (np.repeat(sizes, sizes) - 1)
    chars = ((spread >> shift) & 0x1F) | (more.astype(np.int64) << 5)
    return (chars + 48).astype(np.uint8).tobytes().decode("ascii")


def check(string: str, size: Sequence[int]) -> None:
    """Refuse a compressed RLE string that is no mask of ``size`` = (height, width).

    Raises:
        RLEError: malformed counts (`counts_of`), or counts that do not sum to height x width.
    """
    _checked(string, size)


def _checked(string: str, size: Sequence[int]) -> np.ndarray:
    counts = counts_of(string)
    height, width = size
    if int(counts.sum()) != height * width:
        raise RLEError(
            f"the counts cover {int(counts.sum())} pixels, not the {height}x{width} = "
            f"{height * width} of the mask"
        )
    return counts


def decode(string: str, size: Sequence[int]) -> np.ndarray:
    """The (height, width) uint8 mask (0/1) of a compressed RLE string.

    Raises:
        RLEError: as `check`.
    """
    counts = _checked(string, size)
    height, width = size
    values = np.arange(counts.size, dtype=np.int64) % 2
    flat = np.repeat(values.astype(np.uint8), counts)
    return flat.reshape(width, height).T


def encode(mask: np.ndarray) -> str:
    """The compressed RLE string of a (height, width) mask; any non-zero value is set."""
    if mask.ndim != 2:
        raise RLEError(f"a mask is (height, width), not of shape {mask.shape}")
    flat = np.asarray(mask).ravel(order="F") != 0
    return string_of(_counts_of_flat(flat))


def _counts_of_flat(flat: np.ndarray) -> np.ndarray:
    changes = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    counts = np.diff(np.concatenate(([0], changes, [flat.size])))
    return np.concatenate(([0], counts)) if flat.size and flat[0] else counts


def from_uncompressed(counts: Any, height: int, width: int) -> str:
    """The compressed string of COCO's uncompressed counts (a crowd region's ``counts``), kept
    as given (zero runs included), as ``frPyObjects`` keeps them.

    Raises:
        RLEError: not a list of integers >= 0 that sums to height x width.
    """
    if not isinstance(counts, list) or not all(_is_count(c) for c in counts):
        raise RLEError("the uncompressed counts are not a list of integers >= 0")
    if sum(counts) != height * width:
        raise RLEError(
            f"the uncompressed counts cover {sum(counts)} pixels, not the {height}x{width} = "
            f"{height * width} of the image"
        )
    return string_of(counts)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def from_polygons(polygons: Any, height: int, width: int) -> str:
    """The compressed string of the union of COCO polygons ``[[x0, y0, x1, y1, ...], ...]`` in
    a height x width image (pixel-edge coordinates), as pycocotools rasterises them (module
    docstring).

    Raises:
        RLEError: not a list of lists of finite numbers, a coordinate beyond C's int once
            upsampled, or a polygon longer than `MAX_POLYGON_POINTS`.
    """
    if not isinstance(polygons, list):
        raise RLEError("the polygons are not a list of [x0, y0, x1, y1, ...] lists")
    each = [_boundaries(_vertices(p, i), height, width) for i, p in enumerate(polygons)]
    total = height * width
    toggles = each[0] if len(each) == 1 else _union(each)
    toggles = toggles[toggles < total]
    return string_of(np.diff(np.concatenate(([0], toggles, [total]))))


def _union(each: list[np.ndarray]) -> np.ndarray:
    """The toggles of the union of masks given by their toggles (runs ``[t0, t1)``, ...)."""
    if not each:
        return np.zeros(0, np.int64)
    edges = np.concatenate([*(t[0::2] for t in each), *(t[1::2] for t in each)])
    starts = sum((t.size + 1) // 2 for t in each)
    steps = np.where(np.arange(edges.size) < starts, 1, -1)
    where, index = np.unique(edges, return_inverse=True)
    covered = np.cumsum(np.bincount(index, weights=steps, minlength=where.size)) > 0.5
    return where[covered != np.concatenate(([False], covered[:-1]))]


def _vertices(polygon: Any, index: int) -> np.ndarray:
    """A polygon's (k, 2) vertices, checked; a trailing odd number left out."""
    if not isinstance(polygon, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for v in polygon
    ):
        raise RLEError(f"polygon {index} is not a list of finite numbers [x0, y0, x1, y1, ...]")
    points = np.asarray(polygon[: len(polygon) // 2 * 2], dtype=np.float64).reshape(-1, 2)
    if points.size and np.abs(_SCALE * points + 0.5).max() >= _INT_LIMIT:
        raise RLEError(f"polygon {index} has a coordinate beyond +-{_INT_LIMIT / _SCALE:.0f}")
    return points


def _boundaries(points: np.ndarray, height: int, width: int) -> np.ndarray:
    """The sorted column-major positions where one polygon's mask toggles (``rleFrPoly``), each
    position toggled an odd number of times once; an odd count closed at height x width."""
    u, v = _walk(points)
    moved = np.flatnonzero(u[1:] != u[:-1]) + 1
    uj, up, vj, vp = u[moved], u[moved - 1], v[moved], v[moved - 1]
    xd = (np.where(uj < up, uj, uj - 1) + 0.5) / _SCALE - 0.5
    keep = (np.floor(xd) == xd) & (xd >= 0) & (xd <= width - 1)
    yd = (np.where(vj < vp, vj, vp) + 0.5) / _SCALE - 0.5
    yd = np.ceil(np.clip(yd[keep], 0, height))
    positions = xd[keep].astype(np.int64) * height + yd.astype(np.int64)
    where, times = np.unique(positions, return_counts=True)
    toggles = where[times % 2 == 1]
    if toggles.size % 2:
        toggles = np.append(toggles, height * width)
    return toggles


def _walk(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The upsampled points rleFrPoly visits along the closed outline, edge by edge."""
    if not points.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    scaled = np.trunc(_SCALE * points + 0.5).astype(np.int64)  # C's (int)(5 * v + .5)
    x, y = np.append(scaled[:, 0], scaled[0, 0]), np.append(scaled[:, 1], scaled[0, 1])
    xs, xe, ys, ye = x[:-1], x[1:], y[:-1], y[1:]
    dx, dy = np.abs(xe - xs), np.abs(ys - ye)
    along_x = dx >= dy
    flip = (along_x & (xs > xe)) | (~along_x & (ys > ye))
    xs, xe = np.where(flip, xe, xs), np.where(flip, xs, xe)
    ys, ye = np.where(flip, ye, ys), np.where(flip, ys, ye)
    steps = np.where(along_x, dx, dy)
    rise = np.where(along_x, ye - ys, xe - xs).astype(np.float64)
    slope = rise / np.maximum(steps, 1).astype(np.float64)  # 0/0 (a repeated vertex): 0
    points_per_edge = steps + 1
    if int(points_per_edge.sum()) > MAX_POLYGON_POINTS:
        raise RLEError(
            f"a polygon's outline is over {MAX_POLYGON_POINTS} points at 1/5 pixel (a "
            "coordinate far outside the image?)"
        )
    edge = np.repeat(np.arange(steps.size), points_per_edge)
    d = np.arange(edge.size) - np.repeat(np.cumsum(points_per_edge) - points_per_edge,
                                         points_per_edge)  # fmt: skip
    t = np.where(flip[edge], steps[edge] - d, d)
    base = np.where(along_x, ys, xs)[edge].astype(np.float64)
    rounded = np.trunc(base + slope[edge] * t.astype(np.float64) + 0.5).astype(np.int64)
    u = np.where(along_x[edge], t + xs[edge], rounded)
    v = np.where(along_x[edge], rounded, t + ys[edge])
    return u, v
