"""COCO's run-length masks (`dlpipe.rle`) write and read what pycocotools does: round trips,
vectors that pycocotools produced, and polygons rasterised by its pixel-centre rule."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dlpipe import rle

# Written by pycocotools 2.0 (mask.encode / frPyObjects / merge), as projects that test against
# it record them (pytorchcocotools' tests, rpycocotools' docs).
SQUARES_25 = [  # a 25x25 mask with [a:b, a:b] set → its compressed counts
    (0, 5, "05d00000000d?"),
    (5, 10, "R45d00000000b;"),
    (20, 25, "X`05d00000000"),
    (0, 25, "0ac0"),
]
COMPLEX_POLYGONS = [  # two polygons of one COCO annotation in a 427x640 image, each frPoly'd
    [266.83, 189.37, 267.79, 175.29, 269.46, 170.04, 271.37, 165.98, 270.89, 163.12, 269.12,
     159.54, 272.8, 156.44, 287.36, 156.44, 293.33, 157.87, 296.91, 160.49, 296.91, 161.21,
     291.89, 161.92, 289.98, 165.03, 291.42, 169.56, 285.16, 196.54],
    [266.35, 214.44, 270.41, 217.3, 276.38, 218.97, 282.11, 218.97, 285.93, 217.3, 286.88,
     207.28, 267.07, 201.07],
]  # fmt: skip
COMPLEX_COUNTS = [
    "\\`_3;j<6B@nCc0Q<@kCc0S<;01N10001O001O00001O001O0000O1L4K6K4L4B]COh<O<O001O0O2Omk^4",
    "RT_32n<<O100O0010O000010O0001O00001O000O101O0ISPc4",
]
# an RLE with three leading zero counts (two cancel out); encoding its mask drops them
ZERO_LEADING = (
    "000lg0Zb01O00001O00001O001O00001O00001O001O00001O01O2N3M3M3M2N3M3N2M3M2N1O1O1O1O2N1O1O1O"
    "2N1O1O101N1O1O1O2N1O1O1O2N3M2N1O2N1O2O0O2N1O1O2N1O2N1O2N1O2N1O2N1O2O0O2N1O3M2N1O2N2N2N2N"
    "2N1O2N2N2N2N1O2N2N2N2N2N1N3N2N00O1O1O1O100000000000000O100000000000000001O0000001O00001O"
    "0O5L7I5K4L4L3M2N2N2N1O2m]OoXOm`0Sg0j^OVYOTa0lf0c^O]YO[a0ef0\\^OdYOba0bg0N2N2N2N2N2N2N2N2N"
    "2N2N2N2N2N2N2N2N3M2M4M2N3M2N3M2N3M2N3M2N3M2N3M2N3M2N3M2M4M2N2N3M2M4M2N2N3M2M3N3M2N3M2M3N"
    "3M2N2N3L3N2N3M2N3L3N2N3M5J4M3M4L3M3L5L3M3M4L3L4\\EXTOd6jo0K6J5K6I4M1O1O1O1N2O1O1O001N2O"
    "00001O0O101O000O2O00001N101N101N2N101N101N101N2O0O2O0O2O0O2O1N101N2N2O1N2O1N2O1N101N2O1N"
    "2O1N2O0O2O1N2N2O1N2O0O2O1N2O1N2N2N1N4M2N2M4M2N3L3N2N3L3N3L3N2N3L3N2N3L3M4L3M3M4L3M5K5K5K"
    "6J5K5K6J7I7I7Ibijn0"
)


def square(a: int, b: int, n: int = 25) -> np.ndarray:
    mask = np.zeros((n, n), np.uint8)
    mask[a:b, a:b] = 1
    return mask


@pytest.mark.parametrize(("a", "b", "counts"), SQUARES_25)
def test_encode_and_decode_give_pycocotools_strings(a: int, b: int, counts: str) -> None:
    assert rle.encode(square(a, b)) == counts
    decoded = rle.decode(counts, (25, 25))
    assert decoded.shape == (25, 25) and decoded.dtype == np.uint8
    assert np.array_equal(decoded, square(a, b))


def test_known_counts_and_strings() -> None:
    assert rle.string_of([5, 2, 2, 2, 5]) == "52203"  # a 4x4 mask
    assert rle.counts_of("52203").tolist() == [5, 2, 2, 2, 5]
    uncompressed = [130, 5, 20, 5, 20, 5, 20, 5, 20, 5, 390]
    assert rle.from_uncompressed(uncompressed, 25, 25) == "R45d00000000b;"
    mask = rle.decode(ZERO_LEADING, (1350, 1080))
    assert rle.encode(mask) == ZERO_LEADING[2:]


def test_polygons_give_pycocotools_strings() -> None:
    polygon = [10, 10, 20, 10, 20, 20, 21, 21, 10, 20]
    assert rle.from_polygons([polygon], 25, 25) == "T8:?00000000001O00000:F`2"
    box = [10, 10, 10, 20, 20, 20, 20, 10]  # frBbox([[10, 10, 10, 10]]) draws this polygon
    assert rle.from_polygons([box], 25, 25) == "T8:?00000000000000000c3"
    for polygon, counts in zip(COMPLEX_POLYGONS, COMPLEX_COUNTS, strict=True):
        assert rle.from_polygons([polygon], 427, 640) == counts
        assert rle.encode(rle.decode(counts, (427, 640))) == counts
    union = rle.decode(COMPLEX_COUNTS[0], (427, 640)) | rle.decode(COMPLEX_COUNTS[1], (427, 640))
    assert rle.from_polygons(COMPLEX_POLYGONS, 427, 640) == rle.encode(union)  # mask.merge


@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 17), (17, 1), (3, 5), (31, 2), (64, 48), (7, 300)], ids=str
)
@pytest.mark.parametrize("kind", ["random", "zeros", "ones", "sparse", "blocks"])
def test_masks_round_trip(shape: tuple[int, int], kind: str) -> None:
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    mask = {
        "random": lambda: rng.integers(0, 2, shape),
        "zeros": lambda: np.zeros(shape),
        "ones": lambda: np.ones(shape),
        "sparse": lambda: rng.random(shape) < 0.02,
        "blocks": lambda: np.kron(rng.integers(0, 2, (shape[0], 1)), np.ones((1, shape[1]))),
    }[kind]().astype(np.uint8)
    counts = rle.encode(mask)
    assert np.array_equal(rle.decode(counts, shape), mask)
    flat = mask.ravel(order="F")
    runs = rle.counts_of(counts).tolist()
    assert sum(runs) == flat.size and all(r > 0 for r in runs[1:])  # canonical: zeros first
    assert (runs[0] == 0) == bool(flat[0])


def test_all_zero_and_all_one_strings() -> None:
    assert rle.encode(np.zeros((4, 4), np.uint8)) == rle.string_of([16])
    assert rle.counts_of(rle.encode(np.ones((4, 4), np.uint8))).tolist() == [0, 16]
    assert rle.encode(np.zeros((0, 3), np.uint8)) == "0"  # what rleEncode writes for no pixels


def test_counts_round_trip_through_strings_at_every_size() -> None:
    rng = np.random.default_rng(0)
    big = [0, 2**32 - 1, 1, 2**31, 7, 2**20, 2**32 - 2, 0, 1]
    for counts in (big, rng.integers(0, 2**32, 200).tolist(), rng.integers(0, 40, 500).tolist()):
        assert rle.counts_of(rle.string_of(counts)).tolist() == counts


def pixel_centres(box: tuple[float, float, float, float], height: int, width: int) -> np.ndarray:
    """pycocotools' rule for an axis-aligned rectangle, computed here: a pixel is set when its
    centre, on the 1/5-pixel grid with the edges rounded half up, lies inside."""
    x0, y0, x1, y1 = (math.floor(5 * v + 0.5) for v in box)
    cols = [x0 <= 5 * c + 2 < x1 for c in range(width)]
    rows = [y0 <= 5 * r + 2 < y1 for r in range(height)]
    return np.outer(rows, cols).astype(np.uint8)


RECTANGLES = [
    (2, 3, 12, 9),  # whole pixels: exactly those pixels
    (1.5, 2.25, 11.5, 14.75),  # edges through pixel centres: the left and top ones are out
    (0.3, 0.7, 0.71, 1.69),  # smaller than a pixel
    (0.49, 0.5, 1.1, 1.5),
    (-3, -2.5, 5.2, 4.4),  # partly outside
    (10, 8, 25, 30),  # past the right and bottom edges
    (0, 0, 16, 12),  # the whole image
]


@pytest.mark.parametrize("box", RECTANGLES, ids=str)
@pytest.mark.parametrize("winding", ["clockwise", "counter-clockwise", "shifted start"])
def test_a_rectangle_sets_the_pixels_whose_centres_it_holds(box, winding: str) -> None:
    x0, y0, x1, y1 = box
    corners = [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]
    if winding == "counter-clockwise":
        corners = corners[::-1]
    elif winding == "shifted start":
        corners = corners[2:] + corners[:2]
    polygon = [v for corner in corners for v in corner]
    mask = rle.decode(rle.from_polygons([polygon], 12, 16), (12, 16))
    assert np.array_equal(mask, pixel_centres(box, 12, 16))


def test_polygons_are_unioned_and_degenerate_ones_set_nothing() -> None:
    a, b = [1, 1, 9, 1, 9, 6, 1, 6], [5, 3, 14, 3, 14, 11, 5, 11]
    union = rle.decode(rle.from_polygons([a, b], 12, 16), (12, 16))
    expected = pixel_centres((1, 1, 9, 6), 12, 16) | pixel_centres((5, 3, 14, 11), 12, 16)
    assert np.array_equal(union, expected)
    empty = rle.string_of([12 * 16])
    assert rle.from_polygons([], 12, 16) == empty
    assert rle.from_polygons([[], [3, 4], [3, 4, 9, 9]], 12, 16) == empty  # under 3 vertices
    alone = rle.from_polygons([a], 12, 16)
    assert rle.from_polygons([a, [3, 4, 9, 9]], 12, 16) == alone
    assert rle.from_polygons([[*a, 7]], 12, 16) == alone  # a trailing odd number is left out
    assert rle.from_polygons([a[:2] + a], 12, 16) == alone  # a repeated vertex


@pytest.mark.parametrize(
    ("call", "rule"),
    [
        (lambda: rle.counts_of("5\x7f"), "outside '0'..'o'"),
        (lambda: rle.counts_of("5é"), "not ASCII"),
        (lambda: rle.counts_of("5P"), "end inside a count"),
        (lambda: rle.counts_of("PPPPPPPP0"), "over 7 characters"),
        (lambda: rle.counts_of("0O"), "below 0"),
        (lambda: rle.decode("52203", (4, 5)), "cover 16 pixels, not the 4x5 = 20"),
        (lambda: rle.check("", (2, 2)), "cover 0 pixels"),
        (lambda: rle.from_uncompressed([5, 2, 2, 2, 4], 4, 4), "cover 15 pixels"),
        (lambda: rle.from_uncompressed([5, -2, 13], 4, 4), "integers >= 0"),
        (lambda: rle.from_uncompressed([True, 15], 4, 4), "integers >= 0"),
        (lambda: rle.from_uncompressed("52203", 4, 4), "integers >= 0"),
        (lambda: rle.from_polygons({"counts": []}, 4, 4), "not a list"),
        (lambda: rle.from_polygons([[0, 0, "1", 1, 1, 0]], 4, 4), "polygon 0 is not"),
        (lambda: rle.from_polygons([[0, 0, 1, 1, 1, 0], [0, math.inf, 1, 1]], 4, 4), "polygon 1"),
        (lambda: rle.from_polygons([[0, 0, 1e9, 1, 1, 0]], 4, 4), "beyond"),
        (lambda: rle.from_polygons([[0, 0, 4e5, 1, 1, 0]], 4, 4), "over 2097152 points"),
        (lambda: rle.encode(np.zeros((2, 2, 1))), "(height, width)"),
    ],
)
def test_malformed_counts_and_polygons_are_refused(call, rule: str) -> None:
    with pytest.raises(rle.RLEError, match=re.escape(rule)):
        call()
