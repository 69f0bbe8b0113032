"""Image checking and optional re-encoding while converting.

Every image is decoded once: that is the integrity check (truncated, zero-byte and non-image
files fail here). A JPEG that is kept as it is is decoded in Pillow's reduced-scale draft
mode, which still reads and entropy-decodes all of its compressed data, at a fraction of the
cost of a full decode. An image is re-encoded only when asked (``--max-side``), or when its
type differs from the dataset's image field (a PNG in a JPEG dataset). With ``--seekable-jpeg``
a stored JPEG gets a restart marker per MCU (`dlpipe.jpeg_seek`: lossless, the same pixels),
so that train crops entropy-decode only their box. Before any of that, the
header's width x height is held to the pixel limit (`dlpipe.codecs.check_image_pixels`): a
decompression bomb is one skipped sample naming its size, not a conversion out of memory.
Reasons are stable text (no memory addresses), so ``errors.jsonl`` is the same run to run.

A grey or YCbCr JPEG that libjpeg-turbo decodes without a single warning takes a shorter road
to the same check: simplejpeg reads its header and decodes it at 1/8 scale to grey in C
(`_quick_jpeg_draft`), the pixels Pillow's draft gives, without Pillow's header parsing in
Python (about 90 us an image less, an eighth of the check). Anything else (a warning, an
error, another colour space, a side under 8 pixels, an image over the pixel limit) goes
through Pillow, which decides and words the error as before.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import simplejpeg
from PIL import Image

from dlpipe.codecs import ImageTooLargeError, max_image_pixels, open_image, stable_message
from dlpipe.converters.audit import dhash
from dlpipe.converters.source import ConvertOptionError, SampleError
from dlpipe.jpeg_seek import add_restart_markers
from dlpipe.options import Checked, OptionError, int_in_range, option
from dlpipe.turbojpeg import region_library

__all__ = ["ImagePolicy", "PreparedImage", "image_dhash", "prepare_image"]

_KINDS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
_PIL_FORMAT = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}
_JPEG_MODES = frozenset({"RGB", "L", "CMYK"})
_QUICK_COLORSPACES = frozenset({"Gray", "YCbCr"})  # Pillow's modes L and RGB, drafted to grey
_DRAFT_SCALE = 8  # the check's JPEG decode scale, on both roads (Pillow's and the quick one)


@dataclass(frozen=True, kw_only=True)
class ImagePolicy(Checked):
    """What happens to each image on the way into a shard (``dlpipe convert``'s image options):
    an optional size cap, the quality, whether JPEGs get a restart marker per MCU
    (`dlpipe.jpeg_seek`); and the dataset's image field, which the conversion sets from the
    scan (no option)."""

    option_error: ClassVar[type[OptionError]] = ConvertOptionError

    field: str = "jpg"
    max_side: int | None = option(
        "re-encode images whose longer side exceeds N (at least 8)",
        default=None,
        parse=int_in_range(8),
        metavar="N",
    )
    quality: int = option(
        "JPEG/WebP quality when re-encoding (1..100)", default=95, parse=int_in_range(1, 100)
    )
    seekable: bool = option(
        "rewrite JPEGs losslessly with a restart marker per MCU, so that train crops "
        "entropy-decode only their box (the same pixels; files about 3 %% bigger; needs "
        "pip install 'dlpipe[jpeg-region]')",
        default=False,
        name="seekable_jpeg",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.field not in _PIL_FORMAT:
            raise ValueError(f"image field {self.field!r} must be one of {sorted(_PIL_FORMAT)}")
        if self.seekable and region_library() is None:
            raise ConvertOptionError(
                "--seekable-jpeg needs libjpeg-turbo 3's TurboJPEG library, not found here: "
                "pip install 'dlpipe[jpeg-region]' (or a system libturbojpeg 3), or drop "
                "--seekable-jpeg"
            )


@dataclass(frozen=True)
class PreparedImage:
    """An image as stored: its bytes, whether they were re-encoded, the (width, height) of
    the source image and of the stored one (they differ after ``--max-side``), and the
    decoded image's difference hash (`dlpipe.converters.audit.dhash`)."""

    data: bytes
    reencoded: bool
    size_in: tuple[int, int]
    size_out: tuple[int, int]
    dhash: int


def prepare_image(data: bytes, policy: ImagePolicy, origin: str) -> PreparedImage:
    """Check one encoded image and return it as it is to be stored.

    Raises:
        SampleError: the bytes are empty, truncated, over the pixel limit or not an image
            Pillow can decode.
    """
    if not data:
        raise SampleError(f"{origin}: empty file (0 bytes), not an image")
    if policy.field == "jpg":
        quick = _quick_jpeg_draft(data, policy.max_side)
        if quick is not None:
            size, fingerprint = quick
            return PreparedImage(_seekable(data, policy), False, size, size, fingerprint)
    try:
        image = open_image(data, max_image_pixels())  # the pixel limit first, from the headers
        kept = _KINDS.get(image.format or "") == policy.field
        if kept and (policy.max_side is None or max(image.size) <= policy.max_side):
            size = image.size  # before the draft, which shrinks it
            fingerprint = _draft_dhash(image)
            return PreparedImage(_seekable(data, policy), False, size, size, fingerprint)
        image.load()
    except ImageTooLargeError as exc:
        raise SampleError(f"{origin}: {exc}") from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"{origin}: not a readable image ({stable_message(exc)})") from exc
    resized = _resized(image, policy.max_side)
    stored = _seekable(_encode(resized, policy), policy)
    fingerprint = image_dhash(data) if image.format == "JPEG" else dhash(image)  # as kept
    return PreparedImage(stored, True, image.size, resized.size, fingerprint)


def _draft_dhash(image: Image.Image) -> int:
    """Decode a lazily opened image as the integrity check does (a JPEG at 1/8 scale, a
    colour one to grey: every coefficient is still entropy-decoded, and the chroma planes'
    inverse DCT and colour conversion are skipped) and return its difference hash."""
    if image.format == "JPEG":
        mode = "L" if image.mode in ("RGB", "L") else image.mode
        size = (max(1, image.width // _DRAFT_SCALE), max(1, image.height // _DRAFT_SCALE))
        image.draft(mode, size)
    image.load()
    return dhash(image)


def _quick_jpeg_draft(data: bytes, max_side: int | None) -> tuple[tuple[int, int], int] | None:
    """(width, height) and difference hash of a JPEG that is kept as it is, from
    libjpeg-turbo's 1/8-scale grey decode through simplejpeg: Pillow's draft decode (scale 8
    for sides of 8 pixels or more, grey output from a grey or YCbCr file: the same library
    call, the same pixels), without Pillow. None sends the image to Pillow: not a JPEG, a
    colour space Pillow drafts otherwise, a side under 8 (Pillow's draft takes another
    scale), over the pixel limit or `max_side` (Pillow names it, or re-encodes), and any
    libjpeg warning or error (Pillow accepts some warnings, and words every refusal)."""
    if not data.startswith(b"\xff\xd8"):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    small = width < _DRAFT_SCALE or height < _DRAFT_SCALE
    if small or colorspace not in _QUICK_COLORSPACES or width * height > max_image_pixels():
        return None
    if max_side is not None and max(width, height) > max_side:
        return None
    shape = (-(-height // _DRAFT_SCALE), -(-width // _DRAFT_SCALE))
    try:
        grey = simplejpeg.decode_jpeg(
            data, colorspace="GRAY", min_height=shape[0], min_width=shape[1], strict=True
        )
    except ValueError:
        return None
    if grey.shape[:2] != shape:  # not the 1/8 scale Pillow's draft decodes (never seen)
        return None
    return (width, height), dhash(Image.fromarray(np.ascontiguousarray(grey[:, :, 0])))


def image_dhash(data: bytes) -> int:
    """The difference hash of an encoded image, decoded as the integrity check decodes it (a
    JPEG at 1/8 scale), so that it is the same whether or not the image is re-encoded.

    Raises:
        SampleError: the image cannot be decoded, or is over the pixel limit.
    """
    quick = _quick_jpeg_draft(data, None)
    if quick is not None:
        return quick[1]
    try:
        return _draft_dhash(open_image(data, max_image_pixels()))
    except ImageTooLargeError as exc:
        raise SampleError(str(exc)) from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"not a readable image ({stable_message(exc)})") from exc


def _seekable(data: bytes, policy: ImagePolicy) -> bytes:
    """A JPEG with a restart marker per MCU when asked; a JPEG the rewrite does not take
    (CMYK, 12-bit, arithmetic-coded, over `dlpipe.jpeg_seek.MAX_TILES` MCUs) as it is."""
    if not policy.seekable or policy.field != "jpg":
        return data
    return add_restart_markers(data) or data


def _resized(image: Image.Image, max_side: int | None) -> Image.Image:
    if max_side is None or max(image.size) <= max_side:
        return image
    scale = max_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)


def _encode(image: Image.Image, policy: ImagePolicy) -> bytes:
    buffer = io.BytesIO()
    if policy.field == "jpg":
        if image.mode not in _JPEG_MODES:
            image = image.convert("RGB")
        image.save(buffer, format="JPEG", quality=policy.quality)
    elif policy.field == "webp":
        image.save(buffer, format="WEBP", quality=policy.quality)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()
