"""Seekable JPEGs (`dlpipe.jpeg_seek`, ``dlpipe convert --seekable-jpeg``): the rewrite is
lossless for every JPEG kind it takes, a window cut for a box decodes to the whole image's
pixels of that box at every DCT scale, train crops are unchanged by it, a lying file is refused
rather than trusted, and convert stores seekable JPEGs that the loader reads to the same batches."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image
from test_crop_decode import photo

import dlpipe
from dlpipe import turbojpeg
from dlpipe.jpeg_seek import MAX_TILES, add_restart_markers, restart_layout, seek_window
from dlpipe.loading import transforms as transforms_module
from dlpipe.loading.transforms import ImageTransform

needs_library = pytest.mark.skipif(
    turbojpeg.region_library() is None,
    reason="no TurboJPEG 3 here: pip install 'dlpipe[jpeg-region]'",
)


def exif_rotated() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return photo(333, 217, exif=exif.tobytes())


def kinds() -> dict[str, bytes]:
    return {
        "4:2:0": photo(333, 217, subsampling=2),
        "4:2:2": photo(333, 217, subsampling=1),
        "4:4:4": photo(333, 217, subsampling=0),
        "greyscale": photo(333, 217, mode="L"),
        "progressive": photo(517, 389, progressive=True),  # its own Huffman tables, as
        "optimized tables": photo(400, 300, optimize=True),  # these: the rewrite's are standard
        "restart markers per row": photo(400, 300, restart_marker_rows=1),
        "exif rotated": exif_rotated(),
        "one pixel": photo(1, 1),
        "odd sizes": photo(1001, 3),
        "tall": photo(17, 403),
    }


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return np.asarray(image)


@needs_library
@pytest.mark.parametrize("kind", list(kinds()))
def test_the_rewrite_is_lossless_and_seekable_for_every_kind(kind: str) -> None:
    data = kinds()[kind]
    seekable = add_restart_markers(data)
    assert seekable is not None and seekable != data
    np.testing.assert_array_equal(pixels(seekable), pixels(data))  # Pillow's libjpeg
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(seekable), simplejpeg.decode_jpeg(data))
    layout = restart_layout(seekable)
    assert layout is not None and restart_layout(data) is None
    with Image.open(io.BytesIO(data)) as original, Image.open(io.BytesIO(seekable)) as rewritten:
        assert (layout.width, layout.height) == original.size
        assert rewritten.getexif().get(0x0112) == original.getexif().get(0x0112)
    assert len(layout.starts) == layout.columns * layout.rows
    mcus = layout.columns * layout.rows  # a marker, alignment, the DC restart, the index:
    if kind in ("progressive", "optimized tables"):  # a few bytes an MCU, and the standard
        assert len(seekable) < 1.3 * len(data)  # Huffman tables where the source had its own
    else:
        assert len(seekable) < len(data) + 7 * mcus + 600
    assert add_restart_markers(seekable) is seekable  # already seekable: as it is


@needs_library
def test_what_the_rewrite_does_not_take_is_left_as_it_is() -> None:
    assert add_restart_markers(photo(64, 48, mode="CMYK")) is None
    assert add_restart_markers(photo(64, 48, format="PNG")) is None
    assert add_restart_markers(b"\xff\xd8\xff\xe0 not a jpeg") is None
    big = photo(16 * 200, 16 * 170)  # 34,000 MCUs: more than one index segment holds
    assert MAX_TILES < 200 * 170 and add_restart_markers(big) is None


def test_without_the_library_there_is_no_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turbojpeg, "_library", [None])
    assert add_restart_markers(photo(64, 48)) is None


def write_raw(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def random_boxes(width: int, height: int, count: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    boxes = []
    for _ in range(count):
        h, w = int(rng.integers(1, height + 1)), int(rng.integers(1, width + 1))
        top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
        boxes.append((top, left, h, w))
    return boxes


@needs_library
@pytest.mark.parametrize("kind", ["4:2:0", "4:2:2", "4:4:4", "greyscale", "odd sizes", "tall"])
@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_a_window_decodes_to_the_whole_images_pixels_of_its_box(kind: str, factor: int) -> None:
    seekable = add_restart_markers(kinds()[kind])
    assert seekable is not None
    layout = restart_layout(seekable)
    assert layout is not None
    scaled = (-(-layout.height // factor), -(-layout.width // factor))
    whole = simplejpeg.decode_jpeg(seekable, min_height=scaled[0], min_width=scaled[1])
    assert whole.shape[:2] == scaled or (factor > 1 and min(scaled) < 8)  # libjpeg's own scales
    if whole.shape[:2] != scaled:
        return
    cut = 0
    for top, left, h, w in random_boxes(scaled[1], scaled[0], 40, seed=factor):
        full_box = (top * factor, left * factor, h * factor, w * factor)
        window = seek_window(seekable, layout, full_box, factor)
        if window is None:  # the box needs every MCU
            continue
        cut += 1
        data, (width, height), y0, x0 = window
        assert y0 % factor == 0 and x0 % factor == 0
        size = (-(-height // factor), -(-width // factor))
        part = simplejpeg.decode_jpeg(data, min_height=size[0], min_width=size[1])
        assert part.shape[:2] == size
        y, x = top - y0 // factor, left - x0 // factor
        np.testing.assert_array_equal(
            part[y : y + h, x : x + w], whole[top : top + h, left : left + w]
        )
    assert cut or (kind == "odd sizes" and factor > 1)


@needs_library
@pytest.mark.parametrize("decoder", ["region", "whole"])
def test_train_crops_of_a_seekable_jpeg_are_the_originals(
    decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same crops, pixel for pixel, with and without a TurboJPEG 3 library at load time,
    and the window path is the one taken."""
    originals = [photo(400, 300, seed=1), photo(640, 480, seed=2), kinds()["greyscale"]]
    seekables = [add_restart_markers(data) for data in originals]
    if decoder == "whole":
        monkeypatch.setattr(turbojpeg, "_library", [None])
    windows: list[int] = []
    real = transforms_module.cut_window

    def counted(*args: object) -> object:
        window = real(*args)  # type: ignore[arg-type]
        windows.append(window is not None)
        return window

    monkeypatch.setattr(transforms_module, "cut_window", counted)
    transform = ImageTransform("train", 64, "jpg", min_scale=0.08)
    for index, (original, seekable) in enumerate(zip(originals, seekables, strict=True)):
        for epoch in range(6):
            want, _ = transform({"jpg": original}, epoch, index)
            got, _ = transform({"jpg": seekable}, epoch, index)
            assert torch.equal(got, want), (index, epoch)
    assert sum(windows) >= 12  # most boxes cut a window (a box can need every MCU)


@needs_library
def test_a_lying_or_damaged_seekable_jpeg_is_refused_not_trusted() -> None:
    seekable = add_restart_markers(photo(400, 300))
    assert seekable is not None
    index_at = seekable.index(b"dlpipe restart intervals\0") + len(b"dlpipe restart intervals\0")
    lengths = bytearray(seekable)
    lengths[index_at] ^= 0x01  # the first interval's length is off by one
    assert restart_layout(bytes(lengths)) is None
    assert restart_layout(seekable[: len(seekable) // 2]) is None  # truncated
    renumbered = bytearray(seekable)
    second = restart_layout(seekable).ends[0]  # type: ignore[union-attr]
    renumbered[second + 1] = 0xD5  # a restart marker out of order
    assert restart_layout(bytes(renumbered)) is None
    no_dri = seekable.replace(b"\xff\xdd\x00\x04\x00\x01", b"\xff\xfe\x00\x04\x00\x01")
    assert restart_layout(no_dri) is None
    # damaged entropy data behind a true index: the crop decodes or names the sample's error
    damaged = bytearray(seekable)
    middle = len(damaged) * 2 // 3
    damaged[middle : middle + 40] = bytes(40)
    transform = ImageTransform("train", 32, "jpg")
    for index in range(8):
        try:
            image, _ = transform({"jpg": bytes(damaged), "__key__": "k"}, 0, index)
        except dlpipe.FieldDecodeError as exc:
            assert "sample 'k'" in str(exc)
        else:
            assert image.shape == (3, 32, 32)


@needs_library
def test_convert_stores_seekable_jpegs_and_the_loader_gives_the_same_batches(
    tmp_path: Path,
) -> None:
    raw = tmp_path / "raw"
    rng = np.random.default_rng(0)
    for i in range(24):
        size = (int(rng.integers(96, 300)), int(rng.integers(96, 300)))
        write_raw(raw / "ab"[i % 2] / f"{i:03d}.jpg", photo(*size, seed=i))
    plain, seekable = tmp_path / "plain", tmp_path / "seekable"
    cli = [sys.executable, "-m", "dlpipe", "convert", str(raw), "--to", "wds", "--workers", "1"]
    subprocess.run([*cli, "--out", str(plain)], check=True, capture_output=True)
    subprocess.run(
        [*cli, "--out", str(seekable), "--seekable-jpeg"], check=True, capture_output=True
    )
    manifest = dlpipe.read_manifest(str(seekable))
    assert manifest.options["seekable_jpeg"] is True
    stored = {s["__key__"]: s["jpg"] for s in dlpipe.open_dataset(str(seekable), "train")}
    kept = {s["__key__"]: s["jpg"] for s in dlpipe.open_dataset(str(plain), "train")}
    assert stored.keys() == kept.keys() and len(stored) == 24
    for key, data in stored.items():
        assert restart_layout(bytes(data)) is not None
        np.testing.assert_array_equal(pixels(bytes(data)), pixels(bytes(kept[key])))

    def batches(path: Path) -> list[torch.Tensor]:
        config = dlpipe.LoaderConfig(batch_size=8, image_size=48, shuffle=True, seed=3)
        workers = dlpipe.WorkerSettings(num_workers=0)
        loader = dlpipe.make_loader(str(path), "train", config=config, workers=workers)
        return [images for images, _ in loader]

    for got, want in zip(batches(seekable), batches(plain), strict=True):
        assert torch.equal(got, want)


def test_convert_refuses_the_switch_without_the_library(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    write_raw(raw / "a" / "1.jpg", photo(32, 32))
    write_raw(raw / "b" / "2.jpg", photo(32, 32, 1))
    out = tmp_path / "out"
    env = {**os.environ, turbojpeg.REGION_ENV: "0"}
    cli = [sys.executable, "-m", "dlpipe", "convert", str(raw), "--to", "lmdb", "--out", str(out)]
    done = subprocess.run([*cli, "--seekable-jpeg"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--seekable-jpeg" in errors[0] and "jpeg-region" in errors[0]
    assert not out.exists()


@needs_library
def test_convert_makes_re_encoded_jpegs_seekable_too_and_keeps_what_it_cannot_rewrite() -> None:
    from dlpipe.converters.images import ImagePolicy, prepare_image

    policy = ImagePolicy(max_side=64, seekable=True)
    shrunk = prepare_image(photo(300, 200), policy, "a.jpg")
    assert shrunk.reencoded and restart_layout(shrunk.data) is not None
    assert (shrunk.size_in, shrunk.size_out) == ((300, 200), (64, 43))
    from_png = prepare_image(photo(90, 70, format="PNG"), policy, "b.png")
    assert from_png.reencoded and restart_layout(from_png.data) is not None
    cmyk = photo(48, 40, mode="CMYK")
    kept_cmyk = prepare_image(cmyk, policy, "c.jpg")
    assert (kept_cmyk.data, kept_cmyk.reencoded) == (cmyk, False)
    kept = prepare_image(photo(120, 90), ImagePolicy(seekable=False), "d.jpg").data
    assert restart_layout(kept) is None
