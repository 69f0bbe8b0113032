"""Region-of-interest JPEG decoding (TurboJPEG 3): the pixels of the whole decode, pixel for
pixel, at every DCT scale, box and image kind; a refusal (None) for what it must not decode;
one decompressor per thread; found where the ``jpeg-region`` extra installs it, off on request.
The fallback (no library) is exercised by tests/test_crop_decode.py's ``whole`` runs."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import simplejpeg
from PIL import Image
from test_crop_decode import photo

from dlpipe import turbojpeg
from dlpipe.loading.jpeg_region import decode_jpeg_region
from dlpipe.turbojpeg import REGION_ENV, region_library

needs_library = pytest.mark.skipif(
    region_library() is None, reason="no TurboJPEG 3 here: pip install 'dlpipe[jpeg-region]'"
)


def whole(data: bytes, factor: int) -> np.ndarray:
    """simplejpeg's whole decode at DCT scale 1/factor (the path the region replaces)."""
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    shape = (-(-height // factor), -(-width // factor))
    array = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=shape[0], min_width=shape[1])
    assert array.shape[:2] == shape
    return array


def size_of(data: bytes) -> tuple[int, int]:
    return Image.open(io.BytesIO(data)).size


def region_equals_whole(data: bytes, factor: int, box: tuple[int, int, int, int]) -> None:
    found = decode_jpeg_region(data, size_of(data), factor, box)
    assert found is not None
    array, row, col = found
    top, left, rows, cols = box
    assert row <= top and col <= left
    got = array[top - row : top - row + rows, left - col : left - col + cols]
    np.testing.assert_array_equal(got, whole(data, factor)[top : top + rows, left : left + cols])


KINDS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(progressive=True),
    "greyscale": dict(mode="L"),
}


@needs_library
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("width", "height"), [(405, 347), (97, 61), (1001, 17), (9, 9)])
def test_the_region_is_the_whole_decodes_pixels_at_every_scale(
    kind: str, width: int, height: int
) -> None:
    """Random boxes, edges and corners included, pixel for pixel (chroma upsampling at the
    box's edges sees the neighbours the whole decode gives it)."""
    data = photo(width, height, seed=width, **KINDS[kind])  # type: ignore[arg-type]
    rng = np.random.default_rng(width * height)
    for factor in (1, 2, 4, 8):
        rows, cols = -(-height // factor), -(-width // factor)
        boxes = [(0, 0, rows, cols), (rows - 1, cols - 1, 1, 1), (0, cols - 1, rows, 1)]
        for _ in range(12):
            top, left = int(rng.integers(0, rows)), int(rng.integers(0, cols))
            tall, wide = int(rng.integers(1, rows - top + 1)), int(rng.integers(1, cols - left + 1))
            boxes.append((top, left, tall, wide))
        for box in boxes:
            region_equals_whole(data, factor, box)


@needs_library
def test_a_box_in_the_lower_right_decodes_less_than_the_image() -> None:
    data = photo(640, 480, subsampling=2)
    array, row, col = decode_jpeg_region(data, (640, 480), 1, (300, 400, 100, 120))  # type: ignore[misc]
    assert (row, col) == (300, 400 - 16) and array.shape == (100 + 16, 120 + 16 + 16, 3)


@needs_library
@pytest.mark.parametrize(
    "data",
    [
        photo(64, 48, mode="CMYK"),  # Adobe CMYK: Pillow's conversion on the full path
        photo(64, 48, format="PNG"),
        b"\xff\xd8not a jpeg",
        photo(64, 48)[:-400],  # truncated: libjpeg warns, the warning stops the decode
    ],
    ids=["cmyk", "png", "garbage", "truncated"],
)
def test_what_it_must_not_decode_is_refused_for_the_full_path(data: bytes) -> None:
    """...and the refusal leaves the thread's decompressor fit for the next image (a refused
    header can leave a TurboJPEG handle failing every later decode: it is replaced)."""
    assert decode_jpeg_region(data, (64, 48), 1, (0, 0, 8, 8)) is None
    good = photo(64, 48)
    for _ in range(2):
        assert decode_jpeg_region(good, (64, 48), 1, (0, 0, 8, 8)) is not None


@needs_library
def test_a_header_read_otherwise_than_the_callers_is_refused() -> None:
    """The caller checked its own header parse against the pixel limit; bytes this library
    reads as another size are not decoded here."""
    data = photo(64, 48)
    assert decode_jpeg_region(data, (64, 49), 1, (0, 0, 8, 8)) is None
    assert decode_jpeg_region(data, (64, 48), 1, (0, 0, 8, 8)) is not None


@needs_library
def test_threads_decode_side_by_side_with_their_own_decompressor() -> None:
    images = [photo(300 + 7 * i, 200 + 5 * i, seed=i) for i in range(16)]
    jobs = [(data, size_of(data), (10 + i, 20 + i, 100, 150)) for i, data in enumerate(images)]

    def run(job: tuple) -> np.ndarray:
        data, size, box = job
        return decode_jpeg_region(data, size, 1, box)[0]  # type: ignore[index]

    serial = [run(job) for job in jobs]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            for got, want in zip(pool.map(run, jobs), serial):
                np.testing.assert_array_equal(got, want)


def test_the_pip_extra_provides_the_library() -> None:
    """Where the ``turbojpeg`` wheel (the ``jpeg-region`` extra) is installed, its bundled
    libjpeg-turbo 3 is found without any system library."""
    spec = importlib.util.find_spec("turbojpeg")
    if spec is None or not spec.origin or spec.origin.endswith(".py"):
        pytest.skip("the jpeg-region extra is not installed here")
    assert region_library() is not None


def test_no_library_means_no_region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turbojpeg, "_library", [None])
    assert decode_jpeg_region(photo(64, 48), (64, 48), 1, (0, 0, 8, 8)) is None


def test_the_environment_turns_it_off() -> None:
    script = "from dlpipe.turbojpeg import region_library; print(region_library())"
    env = {**os.environ, REGION_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
