"""Convert's image check: the quick libjpeg-turbo road gives what Pillow's gives, or defers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from dlpipe.codecs import set_max_image_pixels
from dlpipe.converters import images
from dlpipe.converters.images import ImagePolicy, image_dhash, prepare_image
from dlpipe.converters.source import SampleError


def photo(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth random picture with some grain: every DCT block carries coefficients."""
    rng = np.random.default_rng(seed)
    bands = 3 if mode == "RGB" else 4 if mode == "CMYK" else 1
    coarse = rng.integers(0, 255, (max(2, height // 16), max(2, width // 16), bands), np.uint8)
    smooth = Image.fromarray(coarse.squeeze(-1) if bands == 1 else coarse, mode)
    pixels = np.asarray(smooth.resize((width, height), Image.Resampling.BICUBIC), np.int16)
    grain = rng.integers(-12, 13, pixels.shape, np.int16)
    return Image.fromarray(np.clip(pixels + grain, 0, 255).astype(np.uint8), mode)


def jpeg(image: Image.Image, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **params)
    return buffer.getvalue()


def outcome(data: bytes, policy: ImagePolicy) -> object:
    try:
        return prepare_image(data, policy, "raw/a/x.jpg")
    except SampleError as exc:
        return f"SampleError: {exc}"


def both_roads(monkeypatch, data: bytes, policy: ImagePolicy | None = None):
    """prepare_image's outcome as it runs, whether the quick road decided it, and its outcome
    with Pillow alone (the quick road turned off)."""
    policy = policy or ImagePolicy()
    taken: list[bool] = []
    quick = images._quick_jpeg_draft

    def spy(*args):
        got = quick(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(images, "_quick_jpeg_draft", spy)
    now = outcome(data, policy)
    monkeypatch.setattr(images, "_quick_jpeg_draft", lambda *args: None)
    pillow = outcome(data, policy)
    monkeypatch.setattr(images, "_quick_jpeg_draft", quick)
    return now, any(taken), pillow


def turbo_jpeg(image: Image.Image, subsampling: str) -> bytes:
    """libjpeg-turbo's encoder, for the subsamplings Pillow does not write."""
    return simplejpeg.encode_jpeg(np.asarray(image), quality=85, colorsubsampling=subsampling)


KEPT = {
    "4:2:0": (lambda: photo(401, 355), {"quality": 90}),
    "4:2:2": (lambda: photo(333, 250, 1), {"quality": 85, "subsampling": 1}),
    "4:4:4": (lambda: photo(120, 97, 2), {"quality": 95, "subsampling": 0}),
    "grey": (lambda: photo(257, 129, 3, "L"), {"quality": 90}),
    "progressive": (lambda: photo(300, 200, 4), {"quality": 80, "progressive": True}),
    "optimised": (lambda: photo(211, 173, 5), {"quality": 75, "optimize": True}),
    "restart markers": (lambda: photo(160, 120, 6), {"quality": 90, "restart_marker_blocks": 1}),
    "8x8": (lambda: photo(8, 8, 7), {"quality": 90}),
    "9x17": (lambda: photo(9, 17, 8), {"quality": 90}),
    "1x1 MCU wide, tall": (lambda: photo(15, 801, 9), {"quality": 90}),
}
TURBO = {
    "4:4:0": lambda: turbo_jpeg(photo(203, 151, 20), "440"),
    "4:1:1": lambda: turbo_jpeg(photo(203, 151, 21), "411"),
    "trailing bytes after the end of image": lambda: jpeg(photo(90, 60, 23)) + b"\0junk" * 50,
    "an EXIF block": lambda: jpeg(photo(90, 60, 24), exif=Image.Exif()),
}


@pytest.mark.parametrize("name", KEPT)
def test_the_quick_road_gives_pillows_size_bytes_and_hash(monkeypatch, name) -> None:
    make, params = KEPT[name]
    data = jpeg(make(), **params)
    now, quick, pillow = both_roads(monkeypatch, data)
    assert quick, f"{name}: took Pillow's road"
    assert now == pillow
    assert image_dhash(data) == now.dhash


@pytest.mark.parametrize("name", TURBO)
def test_other_subsamplings_and_extra_bytes_give_pillows_outcome(monkeypatch, name) -> None:
    data = TURBO[name]()
    now, quick, pillow = both_roads(monkeypatch, data)
    assert now == pillow
    assert quick, f"{name}: took Pillow's road"


DEFERRED = {
    "CMYK": lambda: jpeg(photo(64, 48, 10, "CMYK")),
    "a side under 8": lambda: jpeg(photo(5, 40, 11)),
    "7x7": lambda: jpeg(photo(7, 7, 12)),
    "truncated": lambda: jpeg(photo(200, 150, 13))[:-2000],
    "cut in the header": lambda: jpeg(photo(200, 150, 13))[:300],
    "extraneous bytes before a marker": lambda: _junk_before_scan(jpeg(photo(90, 60, 14))),
    "a PNG": lambda: _png(photo(30, 20, 16)),
    "not an image": lambda: b"\xff\xd8\xff plain text",
}


def _junk_before_scan(data: bytes) -> bytes:
    scan = data.index(b"\xff\xda")
    return data[:scan] + b"\x00\x01\x02" + data[scan:]  # libjpeg: a warning; Pillow keeps it


def test_scribbled_entropy_data_gets_one_verdict_on_both_roads(monkeypatch) -> None:
    for seed in range(8):
        now, _, pillow = both_roads(monkeypatch, _scribbled(jpeg(photo(200, 150, seed)), seed))
        assert now == pillow


def _scribbled(data: bytes, seed: int = 0) -> bytes:
    start = len(data) // 3 + 97 * seed
    return data[:start] + bytes(b ^ 0x5A for b in data[start : start + 64]) + data[start + 64 :]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("name", DEFERRED)
def test_what_the_quick_road_cannot_vouch_for_pillow_decides_as_before(monkeypatch, name) -> None:
    data = DEFERRED[name]()
    now, quick, pillow = both_roads(monkeypatch, data)
    assert not quick
    assert now == pillow


def test_the_junk_warning_is_kept_and_the_truncated_file_refused(monkeypatch) -> None:
    kept = outcome(DEFERRED["extraneous bytes before a marker"](), ImagePolicy())
    assert not isinstance(kept, str) and kept.size_in == (90, 60)
    refused = outcome(DEFERRED["truncated"](), ImagePolicy())
    assert refused.startswith(
        "SampleError: raw/a/x.jpg: not a readable image (image file is truncated"
    )


def test_the_pixel_limit_and_max_side_still_hold(monkeypatch) -> None:
    data = jpeg(photo(400, 300, 17))
    set_max_image_pixels(400 * 300 - 1)
    try:
        now, quick, pillow = both_roads(monkeypatch, data)
    finally:
        set_max_image_pixels(None)
    assert not quick and now == pillow
    assert "over the pixel limit of 119,999" in now
    now, _, pillow = both_roads(monkeypatch, data, ImagePolicy(max_side=200))
    assert now == pillow  # re-encoded by Pillow; its fingerprint from the source's draft
    assert now.reencoded and now.size_out == (200, 150)
    now, quick, pillow = both_roads(monkeypatch, data, ImagePolicy(max_side=400))
    assert quick and now == pillow and not now.reencoded
