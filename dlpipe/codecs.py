"""Field codecs, chosen by the field name's last extension (the WebDataset convention).

| extension | type | decoded as |
|---|---|---|
| ``jpg`` ``jpeg`` ``png`` ``webp`` | ``image`` | a loaded ``PIL.Image.Image`` |
| ``cls`` | ``int`` | ``int`` (stored as canonical ASCII decimal) |
| ``txt`` | ``text`` | ``str`` (UTF-8) |
| ``json`` | ``json`` | the JSON value |
| ``npy`` | ``ndarray`` | ``numpy.ndarray`` (``allow_pickle=False``: object arrays are refused) |
| anything else | ``bytes`` | the bytes unchanged |

Nothing here unpickles: a pickled value in any field is either refused or returned as bytes.

**One pixel limit on every decode path.** An image's width x height is read from its header
(PNG IHDR, JPEG SOF, WebP VP8/VP8L/VP8X; Pillow's lazy open for any other kind) before any
decoder allocates for it, and an image over `max_image_pixels()` is refused with
`ImageTooLargeError`: a 20000 x 20000 PNG of a few KB would otherwise take 1.2 GB as RGB. The
limit defaults to Pillow's (`DEFAULT_MAX_IMAGE_PIXELS`, 89,478,485 pixels, about 9459 x 9459);
``DLPIPE_MAX_IMAGE_PIXELS=N`` in the environment (seen by every worker process) or
`set_max_image_pixels` (this process, and loaders made after it) changes it. `decode_field`,
the loader's decode (`dlpipe.loading.transforms.decode_rgb`) and ``dlpipe convert`` all apply it.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from dlpipe.errors import DlpipeError, FieldDecodeError, InvalidFieldError
from dlpipe.sample import KEY_FIELD, check_field_name

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_EXTENSIONS",
    "MAX_PIXELS_ENV",
    "SOF_MARKERS",
    "ImageTooLargeError",
    "PixelLimitError",
    "check_image_pixels",
    "decode_field",
    "decode_sample",
    "encode_field",
    "field_type",
    "image_size",
    "jpeg_colorspace",
    "jpeg_segments",
    "max_image_pixels",
    "open_image",
    "set_max_image_pixels",
    "stable_message",
]

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # Pillow's own default: 1024 * 1024 * 1024 // 4 // 3
MAX_PIXELS_ENV = "DLPIPE_MAX_IMAGE_PIXELS"
_limit: int | None = None  # set_max_image_pixels; None: the environment, else the default


class ImageTooLargeError(FieldDecodeError):
    """An image's header gives more pixels than the pixel limit (a decompression bomb guard)."""


class PixelLimitError(DlpipeError, ValueError):
    """The pixel limit itself is not a positive integer."""


IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp"})
_PIL_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
_TYPES = {"cls": "int", "txt": "text", "json": "json", "npy": "ndarray"}


def _extension(name: str) -> str:
    return check_field_name(name).rsplit(".", 1)[-1]


def field_type(name: str) -> str:
    """The type a field name's extension stands for: image, int, text, json, ndarray or bytes."""
    ext = _extension(name)
    return "image" if ext in IMAGE_EXTENSIONS else _TYPES.get(ext, "bytes")


def decode_field(name: str, data: bytes) -> Any:
    """Decode one field's bytes by its extension.

    Raises:
        FieldDecodeError: the bytes are not what the extension says (names field and reason).
    """
    kind = field_type(name)
    try:
        if kind == "image":
            return _decode_image(data)
        if kind == "int":
            return int(data.decode("ascii"))
        if kind == "text":
            return data.decode("utf-8")
        if kind == "json":
            return json.loads(data)
        if kind == "ndarray":
            return np.load(io.BytesIO(data), allow_pickle=False)
    except ImageTooLargeError as exc:
        raise ImageTooLargeError(f"field {name!r} ({len(data)} bytes): {exc}") from exc
    except RecursionError:  # deeply nested JSON
        raise FieldDecodeError(
            f"field {name!r} ({len(data)} bytes) does not decode as {kind}: nested too deeply"
        ) from None
    except Exception as exc:  # each codec raises its own types; one named error reaches users
        raise FieldDecodeError(
            f"field {name!r} ({len(data)} bytes) does not decode as {kind}: {stable_message(exc)}"
        ) from exc
    return data


def _decode_image(data: bytes) -> Any:
    image = open_image(data)
    image.load()
    return image


def set_max_image_pixels(pixels: int | None) -> None:
    """Set the pixel limit for this process (None: back to the environment or the default).

    Loaders made afterwards carry it into their worker processes; for a process dlpipe does not
    start, set ``DLPIPE_MAX_IMAGE_PIXELS`` instead.

    Raises:
        PixelLimitError: `pixels` is not a positive integer.
    """
    global _limit
    if pixels is not None and (
        not isinstance(pixels, int) or isinstance(pixels, bool) or pixels < 1
    ):
        raise PixelLimitError(f"pixel limit {pixels!r} must be a positive integer")
    _limit = pixels


def max_image_pixels() -> int:
    """The pixel limit: `set_max_image_pixels`, else ``$DLPIPE_MAX_IMAGE_PIXELS``, else 89,478,485.

    Raises:
        PixelLimitError: ``DLPIPE_MAX_IMAGE_PIXELS`` is set to something but a positive integer.
    """
    if _limit is not None:
        return _limit
    text = os.environ.get(MAX_PIXELS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_IMAGE_PIXELS
    if not text.isdigit() or int(text) < 1:
        raise PixelLimitError(
            f"{MAX_PIXELS_ENV}={text!r} is not a positive integer; set it to a pixel count "
            f"(e.g. {DEFAULT_MAX_IMAGE_PIXELS}) or unset it"
        )
    return int(text)


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, JPEG or WebP header without decoding; None for other kinds."""
    head = bytes(data[:32])
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR" and len(head) >= 24:
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        return _webp_size(head)
    return None


# start-of-frame markers: every C0..CF but DHT (C4), JPG (C8) and DAC (CC)
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """A JPEG header's segments as libjpeg walks them: (marker, offset, end) for each one with
    a length, up to and including the first start of scan; fill bytes and standalone markers
    are stepped over; the walk stops at an end of image or a byte that is not a marker.
    `end` may lie past the data (a truncated file): the caller checks what it reads."""
    i, size = 2, len(data)
    while i + 4 <= size:
        if data[i] != 0xFF:
            return
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
        elif marker == 0xD9:  # end of image
            return
        else:
            end = i + 2 + int.from_bytes(data[i + 2 : i + 4], "big")
            yield marker, i, end
            if marker == 0xDA:  # start of scan: the header ends
                return
            i = end


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The first start-of-frame's (width, height), as libjpeg reads it."""
    for marker, i, _ in jpeg_segments(data):
        if marker in SOF_MARKERS:
            if i + 9 > len(data):
                return None
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            return int.from_bytes(data[i + 7 : i + 9], "big"), height
    return None


def jpeg_colorspace(data: bytes) -> str | None:
    """A JPEG's colour space as libjpeg reads it from the header (``jdapimin.c``: the
    component count, then a JFIF or Adobe marker, then the component ids): ``Gray``,
    ``YCbCr``, ``RGB``, ``CMYK`` or ``YCCK`` (simplejpeg's names); None: no frame header, or
    a component count libjpeg has no colour space for."""
    ids, jfif, adobe = b"", False, -1
    for marker, start, end in jpeg_segments(data):
        body = data[start + 4 : end]
        if marker == 0xE0 and body.startswith(b"JFIF\0") and len(body) >= 14:
            jfif = True
        elif marker == 0xEE and body.startswith(b"Adobe") and len(body) >= 12:
            adobe = body[11]  # the transform: 0 none, 1 YCbCr, 2 YCCK
        elif marker in SOF_MARKERS and not ids and len(body) >= 6:
            ids = body[6 : 6 + 3 * body[5] : 3]
    if len(ids) == 1:
        return "Gray"
    if len(ids) == 3:
        if jfif or adobe > 0:
            return "YCbCr"
        return "RGB" if adobe == 0 or (adobe < 0 and ids == b"RGB") else "YCbCr"
    if len(ids) == 4:
        return "CMYK" if adobe <= 0 else "YCCK"  # no Adobe marker: CMYK
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X":  # the canvas every frame must fit in
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(head[26:28], "little") & 0x3FFF, (
            int.from_bytes(head[28:30], "little") & 0x3FFF
        )
    return None


def check_image_pixels(data: bytes, limit: int | None = None) -> tuple[int, int]:
    """The image's (width, height) from its header, refused when over the pixel limit.

    Args:
        data: encoded image bytes.
        limit: the pixel limit (default `max_image_pixels()`).

    Raises:
        ImageTooLargeError: width x height is over the limit (names both and how to raise it).
        FieldDecodeError: no header gives the image's size (not an image).
    """
    limit = max_image_pixels() if limit is None else limit
    size = image_size(data) or _pillow_size(data, limit)
    _check_pixels(size, limit)
    return size


def _check_pixels(size: tuple[int, int], limit: int) -> None:
    width, height = size
    if width * height > limit:
        raise ImageTooLargeError(
            f"the image is {width}x{height} = {width * height:,} pixels, over the pixel limit "
            f"of {limit:,} (a decompression-bomb guard); if you trust this data, raise it with "
            f"{MAX_PIXELS_ENV}={width * height} or dlpipe.codecs.set_max_image_pixels()"
        )


def _pillow_size(data: bytes, limit: int) -> tuple[int, int]:
    """Pillow's lazy open reads only the header (for kinds `image_size` does not parse)."""
    from PIL import Image

    _pillow_allows(limit)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(f"{stable_message(exc)}; see {MAX_PIXELS_ENV}") from None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise FieldDecodeError(stable_message(exc)) from None


def _pillow_allows(limit: int) -> None:
    """Raise Pillow's own limit to dlpipe's when dlpipe's is higher: one limit, dlpipe's."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS is not None and limit > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = limit


def open_image(data: bytes, limit: int | None = None) -> Any:
    """A lazily opened ``PIL.Image.Image`` of `data`, after `check_image_pixels`; the size
    Pillow reads is held to the limit too (a file whose headers disagree is refused by both).

    Raises:
        ImageTooLargeError, FieldDecodeError: as `check_image_pixels`.
    """
    from PIL import Image

    limit = max_image_pixels() if limit is None else limit
    check_image_pixels(data, limit)
    _pillow_allows(limit)
    image = Image.open(io.BytesIO(data))
    if image.width * image.height > limit:
        image.close()
        _check_pixels(image.size, limit)
    return image


# " <_io.BytesIO object at 0x7f...>" names only our buffer; any other " at 0x..." is an address
_ADDRESS = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>| at 0x[0-9a-fA-F]+")


def stable_message(exc: BaseException) -> str:
    """``str(exc)`` without memory addresses (``<_io.BytesIO object at 0x7f...>``), so the same
    failure reads the same in every run (``errors.jsonl`` is compared across runs)."""
    return _ADDRESS.sub("", str(exc)) or type(exc).__name__


def decode_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """Decode every field of a sample; ``__key__`` passes through.

    Raises:
        FieldDecodeError: naming the sample key and the field that failed.
    """
    key = sample.get(KEY_FIELD, "?")
    out: dict[str, Any] = {}
    for name, value in sample.items():
        if name == KEY_FIELD:
            out[name] = value
            continue
        try:
            out[name] = decode_field(name, value)
        except FieldDecodeError as exc:
            raise type(exc)(f"sample {key!r}: {exc}") from exc
    return out


def encode_field(name: str, value: Any) -> bytes:
    """Encode a Python value as the bytes a field of this name stores.

    bytes pass through; ``int`` for ``cls``; ``str`` for ``txt``; any JSON value for ``json``;
    a non-object ``numpy.ndarray`` for ``npy``; a ``PIL.Image.Image`` for image fields.

    Raises:
        InvalidFieldError: the value does not fit the field's type.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    kind = field_type(name)
    if kind == "int" and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value)).encode("ascii")
    if kind == "text" and isinstance(value, str):
        return value.encode("utf-8")
    if kind == "json":
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")
    if kind == "ndarray" and isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise InvalidFieldError(
                f"field {name!r}: object arrays would need pickle; store a numeric dtype"
            )
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return buffer.getvalue()
    if kind == "image" and hasattr(value, "save"):
        buffer = io.BytesIO()
        value.save(buffer, format=_PIL_FORMATS[_extension(name)])
        return buffer.getvalue()
    raise InvalidFieldError(
        f"field {name!r} (type {kind}) cannot store a {type(value).__name__}; pass bytes or "
        "a value of the field's type"
    )
