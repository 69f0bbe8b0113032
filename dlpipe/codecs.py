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
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from dlpipe.errors import FieldDecodeError, InvalidFieldError
from dlpipe.sample import KEY_FIELD, check_field_name

__all__ = [
    "IMAGE_EXTENSIONS",
    "decode_field",
    "decode_sample",
    "encode_field",
    "field_type",
]

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
    except Exception as exc:  # each codec raises its own types; one named error reaches users
        raise FieldDecodeError(
            f"field {name!r} ({len(data)} bytes) does not decode as {kind}: {exc}"
        ) from exc
    return data


def _decode_image(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


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
            raise FieldDecodeError(f"sample {key!r}: {exc}") from exc
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
