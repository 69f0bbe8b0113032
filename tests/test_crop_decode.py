"""The crop-aware train decode changes nothing but the cost: RandomResizedCrop's distribution,
the full-decode path's pixels within interpolation error, every image kind, the pixel limit,
and the same output for the same (seed, epoch, index) in any process."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import write_dataset
from PIL import Image
from scipy.stats import ks_2samp
from torchvision import transforms as T
from torchvision.transforms import v2

import dlpipe
from dlpipe import turbojpeg
from dlpipe.codecs import ImageTooLargeError
from dlpipe.loading import transforms as transforms_module
from dlpipe.loading.transforms import ImageTransform, dct_factor

SIZES = [(400, 300), (333, 217), (640, 480), (120, 500), (50, 50)]


def photo(width: int, height: int, seed: int = 0, mode: str = "RGB", **save: object) -> bytes:
    """A photo-like image: a colour gradient plus blurred texture plus a little grain."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 160 + 40, y / height * 160 + 40, (x + y) / (width + height) * 200])
    texture = np.asarray(
        Image.fromarray(rng.normal(128, 60, (height // 4 + 1, width // 4 + 1)).astype(np.uint8))
        .resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32
    )  # fmt: skip
    pixels = base.transpose(1, 2, 0) + (texture[..., None] - 128) * 0.6
    pixels += rng.normal(0, 3, (height, width, 1))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, save.pop("format", "JPEG"), **({"quality": 90} | save))
    return buffer.getvalue()


def both(data: bytes, size: int, index: int, **kwargs: object) -> tuple[torch.Tensor, ...]:
    """The crop-aware and the full-decode outputs for the same seed, epoch and index."""
    sample = {"__key__": "k", "jpg": data, "cls": b"3"}
    crop, label = ImageTransform("train", size, "jpg", **kwargs)(sample, 1, index)  # type: ignore[arg-type]
    full, _ = ImageTransform("train", size, "jpg", decode="full", **kwargs)(sample, 1, index)  # type: ignore[arg-type]
    assert label == 3 and crop.dtype == torch.uint8 and crop.shape == (3, size, size)
    return crop, full


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


def box_stats(boxes: list[tuple[int, int, int, int]], width: int, height: int) -> np.ndarray:
    """Per box: area share, log aspect ratio, centre x and centre y as shares of the image."""
    top, left, h, w = np.asarray(boxes, dtype=np.float64).T
    return np.stack(
        [h * w / (width * height), np.log(w / h), (left + w / 2) / width, (top + h / 2) / height]
    )


def reference_boxes(width: int, height: int, scale: tuple[float, float], n: int) -> np.ndarray:
    torch.manual_seed(12345)
    image = torch.empty(()).expand(3, height, width)
    boxes = [T.RandomResizedCrop.get_params(image, list(scale), [3 / 4, 4 / 3]) for _ in range(n)]
    return box_stats(boxes, width, height)


def dlpipe_boxes(width: int, height: int, min_scale: float, n: int) -> np.ndarray:
    transform = ImageTransform("train", 224, "jpg", min_scale=min_scale)
    torch.manual_seed(777)  # another stream than the reference's: a real two-sample test
    boxes = [tuple(transform.sample_box(width, height)) for _ in range(n)]
    return box_stats(boxes, width, height)  # type: ignore[arg-type]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_crop_boxes_follow_torchvision_random_resized_crop(width: int, height: int) -> None:
    ours, reference = (
        dlpipe_boxes(width, height, 0.08, 3000),
        reference_boxes(width, height, (0.08, 1.0), 3000),
    )
    for name, a, b in zip(("area", "log aspect", "centre x", "centre y"), ours, reference):
        assert ks_2samp(a, b).pvalue > 0.001, name
    assert ((ours[0] > 0) & (ours[0] <= 1)).all()


@pytest.mark.parametrize("min_scale", [0.08, 0.35, 1.0])
def test_a_seeded_generator_draws_torchvision_make_params_own_box(min_scale: float) -> None:
    """Box by box, not only in distribution: a generator seeded like the default generator
    gives v2.RandomResizedCrop.make_params's box, fallback (odd shapes) included."""
    transform = ImageTransform("train", 224, "jpg", min_scale=min_scale)
    crop = v2.RandomResizedCrop(224, scale=(min_scale, 1.0))
    for index in range(600):
        width, height = [(400, 300), (5, 7), (1001, 3), (3, 1001), (224, 224)][index % 5]
        generator = transform.generator(0, index)
        torch.default_generator.manual_seed(generator.initial_seed())
        params = crop.make_params([torch.empty(()).expand(3, height, width)])
        expected = (params["top"], params["left"], params["height"], params["width"])
        assert tuple(transform.sample_box(width, height, generator)) == expected


@pytest.mark.parametrize("size", [24, 224])
def test_the_full_path_is_torchvisions_random_resized_crop_and_flip_pixel_for_pixel(
    size: int,
) -> None:
    """``decode="full"``, the reference the crop-aware path is held to, is v2's own
    RandomResizedCrop + RandomHorizontalFlip on the same decode and the same draws (its resize
    kernel is called directly): downscales, upscales, odd shapes, PNG."""
    images = [photo(400, 300), photo(5, 7), photo(1001, 3), photo(97, 61, format="PNG")]
    transform = ImageTransform("train", size, "jpg", decode="full")
    reference = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    for index in range(24):
        data = images[index % len(images)]
        ours, _ = transform({"jpg": data}, 0, index)
        torch.default_generator.manual_seed(transform.generator(0, index).initial_seed())
        theirs = reference(transforms_module.decode_rgb(data))
        assert torch.equal(ours, theirs), index


def test_the_box_test_tells_another_distribution() -> None:
    """The same test rejects a different crop scale: it has power, it is not a formality."""
    ours, reference = dlpipe_boxes(400, 300, 0.3, 3000), reference_boxes(400, 300, (0.08, 1), 3000)
    assert ks_2samp(ours[0], reference[0]).pvalue < 1e-6


def test_dct_factor_is_the_largest_that_keeps_the_box_at_the_output_size() -> None:
    assert dct_factor(1792, 1800, 224) == 8
    assert dct_factor(1791, 1800, 224) == 4
    assert dct_factor(448, 900, 224) == 2
    assert dct_factor(447, 900, 224) == 1
    assert dct_factor(10, 10, 224) == 1


@pytest.fixture(params=["region", "whole"])
def jpeg_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once with the region decoder (a TurboJPEG 3 library, the ``jpeg-region``
    extra) and once without it (simplejpeg decodes the whole image at the DCT scale)."""
    if request.param == "whole":
        monkeypatch.setattr(turbojpeg, "_library", [None])
    elif turbojpeg.region_library() is None:
        pytest.skip("no TurboJPEG 3 library here: pip install 'dlpipe[jpeg-region]'")
    return str(request.param)


def record_factors(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The DCT scale divisor of every crop-aware JPEG decode from now on."""
    factors: list[int] = []
    real = transforms_module.decode_jpeg_box

    def recorded(data: bytes, size: tuple[int, int], box: object, factor: int) -> object:
        factors.append(factor)
        return real(data, size, box, factor)  # type: ignore[arg-type]

    monkeypatch.setattr(transforms_module, "decode_jpeg_box", recorded)
    return factors


def box_resized(data: bytes, size: int, like: torch.Tensor) -> torch.Tensor:
    """The whole image resized with Pillow's BOX filter (another standard resampler), in the
    orientation of `like` (the full path's output, flipped or not; Pillow's libjpeg decodes a
    little differently, so the nearer orientation)."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    full = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    bilinear = T.functional.resize(full, [size, size], antialias=True)
    box = torch.from_numpy(np.array(image.resize((size, size), Image.Resampling.BOX)))
    box = box.permute(2, 0, 1)
    flipped = mean_abs_diff(T.functional.hflip(bilinear), like) < mean_abs_diff(bilinear, like)
    return T.functional.hflip(box) if flipped else box


@pytest.mark.parametrize(("size", "factor"), [(64, 8), (128, 4), (256, 2)])
def test_scaled_decode_matches_the_full_decode_within_interpolation_error(
    size: int, factor: int, monkeypatch: pytest.MonkeyPatch, jpeg_decoder: str
) -> None:
    """A 512 px square with min_scale 1 is cropped whole, so the output size sets the scale.
    The difference from the full path (bilinear, antialiased) is no larger than the one
    between two standard resamplers of the same full decode (bilinear against box)."""
    asked = record_factors(monkeypatch)
    for seed in range(3):
        data = photo(512, 512, seed)
        crop, full = both(data, size, seed, min_scale=1.0)
        resamplers = mean_abs_diff(box_resized(data, size, full), full)
        diff = mean_abs_diff(crop, full)
        assert 0.05 < diff < 1.1 * resamplers, (diff, resamplers)  # measured 1.00-1.01x
    assert asked == [factor] * 3


def train_box(transform: ImageTransform, data: bytes, epoch: int, index: int) -> tuple:
    """The box and DCT factor the transform draws for (epoch, index), seeded as it seeds."""
    width, height = Image.open(io.BytesIO(data)).size
    box = transform.sample_box(width, height, transform.generator(epoch, index))
    return box, dct_factor(box.width, box.height, transform.image_size)


def resampler_gap(data: bytes, box: tuple[int, int, int, int], size: int, full: torch.Tensor):
    """Bilinear (the full path's) against Pillow's BOX resize of the same crop of the full
    decode: the difference two standard resamplers make on this crop."""
    top, left, height, width = box
    image = (
        Image.open(io.BytesIO(data)).convert("RGB").crop((left, top, left + width, top + height))
    )
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    bilinear = T.functional.resize(pixels, [size, size], antialias=True)
    boxed = torch.from_numpy(np.array(image.resize((size, size), Image.Resampling.BOX)))
    boxed = boxed.permute(2, 0, 1)
    flipped = mean_abs_diff(T.functional.hflip(bilinear), full) < mean_abs_diff(bilinear, full)
    return mean_abs_diff(T.functional.hflip(boxed) if flipped else boxed, full)


def check_within_interpolation_error(data: bytes, size: int, indices: range) -> set[int]:
    """Crop-aware against full decode over draws; returns the DCT factors used. Unscaled crops
    are the full path's (the same libjpeg-turbo decode, box and flip); scaled ones differ from
    it on average no more than 1.5x the bilinear-vs-box gap on the same crops (measured
    0.8-1.2x), each below 10 of 255 (measured up to 8.7 on these grainy photos)."""
    diffs: dict[int, list[float]] = {1: [], 2: [], 4: [], 8: []}
    gaps: dict[int, list[float]] = {1: [], 2: [], 4: [], 8: []}
    for index in indices:
        crop, full = both(data, size, index)
        box, factor = train_box(ImageTransform("train", size, "jpg"), data, 1, index)
        diffs[factor].append(mean_abs_diff(crop, full))
        gaps[factor].append(resampler_gap(data, box, size, full) if factor > 1 else 0.0)
    assert all(diff < 0.5 for diff in diffs[1]), diffs[1]
    for factor in (2, 4, 8):
        if diffs[factor]:
            assert all(0.05 < diff < 10 for diff in diffs[factor]), diffs[factor]
            assert np.mean(diffs[factor]) < 1.5 * np.mean(gaps[factor]), (factor, diffs, gaps)
    return {factor for factor, found in diffs.items() if found}


def test_random_crops_match_the_full_decode_and_keep_its_box_and_flip(jpeg_decoder: str) -> None:
    """Default scale at 32 px on 400x300 and 120x100 photos draws every scale."""
    factors = set()
    for seed in range(2):
        factors |= check_within_interpolation_error(photo(400, 300, seed), 32, range(30))
        factors |= check_within_interpolation_error(photo(120, 100, seed), 32, range(10))
    assert factors == {1, 2, 4, 8}


def kinds() -> dict[str, tuple[bytes, bool]]:
    """Image kind → (bytes, whether the crop-aware path must equal the full path exactly)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    return {
        "rgb 4:2:0": (photo(333, 217, subsampling=2), False),
        "rgb 4:4:4": (photo(333, 217, subsampling=0), False),
        "progressive": (photo(517, 389, progressive=True), False),
        "greyscale": (photo(333, 217, mode="L"), False),
        "cmyk": (photo(333, 217, mode="CMYK"), True),
        "exif rotated": (photo(333, 217, exif=exif.tobytes()), False),
        "png": (photo(333, 217, format="PNG"), True),
        "png rgba": (photo(97, 61, mode="RGBA", format="PNG"), True),
        "webp": (photo(333, 217, format="WEBP"), True),
        "tiny jpeg": (photo(5, 7), False),
        "odd sizes": (photo(1001, 3), False),
    }


@pytest.mark.parametrize("kind", list(kinds()))
def test_every_image_kind_decodes_to_the_output_size(kind: str, jpeg_decoder: str) -> None:
    data, exact = kinds()[kind]
    if not exact:
        check_within_interpolation_error(data, 24, range(8))
        return
    for index in range(6):
        crop, full = both(data, 24, index)
        assert torch.equal(crop, full)


def test_exif_orientation_is_ignored_as_the_full_decode_ignores_it() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    plain, rotated = photo(333, 217), photo(333, 217, exif=exif.tobytes())
    for index in range(4):
        assert torch.equal(both(plain, 24, index)[0], both(rotated, 24, index)[0])
        assert torch.equal(both(plain, 24, index)[1], both(rotated, 24, index)[1])


def test_without_simplejpeg_or_turbojpeg_3_the_crop_comes_from_the_full_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transforms_module, "simplejpeg", None)
    monkeypatch.setattr(turbojpeg, "_library", [None])
    for index in range(6):
        crop, full = both(photo(512, 512, index), 32, index)
        assert torch.equal(crop, full)


def test_the_pixel_limit_refuses_a_huge_header_before_any_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = bytearray(photo(16, 16))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (20000).to_bytes(2, "big") * 2  # height, width
    calls = []
    monkeypatch.setattr(transforms_module, "decode_jpeg_box", lambda *a: calls.append(a))
    monkeypatch.setattr(transforms_module, "decode_image", lambda *a, **k: calls.append(a))
    transform = ImageTransform("train", 224, "jpg")
    with pytest.raises(ImageTooLargeError) as caught:
        transform({"__key__": "bomb", "jpg": bytes(data)}, 0, 0)
    assert calls == []
    assert "sample 'bomb'" in str(caught.value) and "20000x20000" in str(caught.value)


def test_bad_decode_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="decode 'fast' must be one of crop, full"):
        ImageTransform("train", 224, "jpg", decode="fast")


SCRIPT = """
import hashlib, sys
from dlpipe.loading.transforms import ImageTransform
data = open(sys.argv[1], "rb").read()
out, _ = ImageTransform("train", 48, "jpg", seed=5)({"jpg": data}, 2, 9)
print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def test_same_seed_epoch_and_index_give_the_same_crop_in_another_process(tmp_path) -> None:
    path = tmp_path / "a.jpg"
    path.write_bytes(photo(600, 450))
    transform = ImageTransform("train", 48, "jpg", seed=5)
    here = transform({"jpg": path.read_bytes()}, 2, 9)[0]
    other = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, check=True
    )
    assert other.stdout.strip() == hashlib.sha256(here.numpy().tobytes()).hexdigest()
    assert not torch.equal(here, transform({"jpg": path.read_bytes()}, 2, 10)[0])
    assert torch.equal(here, transform({"jpg": path.read_bytes()}, 2, 9)[0])


def test_make_loader_decodes_train_crops_at_dct_scale(
    tmp_path, monkeypatch: pytest.MonkeyPatch, jpeg_decoder: str
) -> None:
    """A user's loader takes the crop-aware path by default: scaled decodes, close pixels."""
    samples = [
        {"__key__": f"s{i}", "jpg": photo(512, 512, i), "cls": str(i % 3).encode()}
        for i in range(8)
    ]
    path = write_dataset(tmp_path / "data", "lmdb", {"train": samples})
    factors = record_factors(monkeypatch)
    config = dlpipe.LoaderConfig(batch_size=8, image_size=64, min_crop_scale=1.0, seed=3)
    images, labels = next(iter(dlpipe.make_loader(path, "train", config, workers=0, profile=None)))
    assert factors == [8] * 8  # 512 px decoded at 1/8
    full = ImageTransform("train", 64, "jpg", seed=3, min_scale=1.0, decode="full")
    config = config.replace(transform=full)
    reference = dlpipe.make_loader(path, "train", config, workers=0, profile=None)
    ref_images, ref_labels = next(iter(reference))
    assert torch.equal(labels, ref_labels)
    assert (
        images.shape == (8, 3, 64, 64) and mean_abs_diff(images, ref_images) < 5.0
    )  # measured 4.0
