"""The sample model: a mapping of field name to bytes, plus a unique, filesystem-safe key.

A sample is a plain dict, as in WebDataset::

    {"__key__": "cat_0001", "jpg": b"\\xff\\xd8...", "cls": b"3"}

Field names are extensions that name their codec (`dlpipe.codecs`). Every format stores the same
field bytes, so a sample's checksum does not depend on the format.

**Key rule.** A key is 1 to 200 characters from ``A-Z a-z 0-9 _ - %``, where ``%`` only starts an
escape ``%XX`` (two upper-case hex digits). Keys never hold dots, slashes or spaces, so
``{key}.{field}`` is always one safe tar member name and WebDataset splits it back at the first
dot. `escape_key` turns any string (a relative path, a file stem) into a valid key by writing
each UTF-8 byte outside ``A-Z a-z 0-9 _ -`` as ``%XX``; `unescape_key` inverts it. A file name
that is not UTF-8 (an ``os.fsdecode`` string with surrogate escapes) keeps its raw bytes:
``b"caf\\xe9"`` becomes ``caf%E9``.

**Shortened keys.** `make_key` gives a valid key for any non-empty text. When the escaped text
is longer than 200 characters (a deep path, or about 23 CJK characters, which escape to 9
characters each), the key is the longest prefix of the escaped text that ends on a character
boundary and fits in 181 characters, then ``%2D``, then the first 16 hex digits of the SHA-256
of the text's bytes: ``<prefix>%2D<16 hex>``, exactly 200 characters at most. ``%2D`` is an
escaped ``-``, which `escape_key` never writes (``-`` is a safe byte), so a shortened key can
never equal an unshortened one, and two names share a shortened key only if their SHA-256
prefixes collide. The key is stable across runs and machines; `unescape_key` turns it into the
readable prefix, ``-`` and the hash, and the converter records the full name beside it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from dlpipe.errors import InvalidFieldError, InvalidKeyError

__all__ = [
    "KEY_FIELD",
    "MAX_KEY_LENGTH",
    "Sample",
    "check_field_name",
    "check_key",
    "escape_key",
    "make_key",
    "sample_fields",
    "unescape_key",
]

KEY_FIELD = "__key__"
MAX_KEY_LENGTH = 200

Sample = dict[str, bytes | str]
"""A sample: ``"__key__"`` maps to the key (str), every other name to the field's bytes."""

_KEY_RE = re.compile(r"(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+")
_UNSAFE_BYTE = re.compile(rb"[^A-Za-z0-9_-]")  # every other byte is escaped as %XX
_FIELD_RE = re.compile(r"[a-z0-9][a-z0-9_]*(?:\.[a-z0-9][a-z0-9_]*)*")
_CLS_RE = re.compile(rb"-?(?:0|[1-9][0-9]*)")
_SHORT_MARK = "%2D"  # an escaped "-": escape_key never writes it, so it marks a shortened key
_HASH_DIGITS = 16


def _text_bytes(text: str) -> bytes:
    """`text` as UTF-8; surrogate escapes (undecodable file-name bytes) become their raw bytes."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return text.encode("utf-8", "surrogatepass")


def _escape(text: str) -> str:
    return _UNSAFE_BYTE.sub(_percent, _text_bytes(text)).decode("ascii")


def _percent(unsafe: re.Match[bytes]) -> bytes:
    return b"%%%02X" % unsafe[0][0]


def escape_key(text: str) -> str:
    """Return `text` as a valid key, escaping every unsafe UTF-8 byte as ``%XX``.

    ``escape_key("cats/img.001")`` is ``"cats%2Fimg%2E001"``.

    Raises:
        InvalidKeyError: `text` is empty or escapes to more than 200 characters (use
            `make_key` to shorten it instead).
    """
    key = _escape(text)
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"{text[:40]!r}... escapes to a {len(key)}-character key, over the "
            f"{MAX_KEY_LENGTH}-character limit; dlpipe.sample.make_key() shortens it"
        )
    check_key(key)
    return key


def make_key(text: str) -> tuple[str, bool]:
    """A valid key for any non-empty `text`, shortened by the documented rule when too long.

    Args:
        text: a relative path, a file stem, an id; may hold any character, and surrogate
            escapes from `os.fsdecode`.

    Returns:
        The key and whether it was shortened (then it is ``<prefix>%2D<16 hex of SHA-256>``).

    Raises:
        InvalidKeyError: `text` is empty.
    """
    key = _escape(text)
    if len(key) <= MAX_KEY_LENGTH:
        return check_key(key), False
    room = MAX_KEY_LENGTH - len(_SHORT_MARK) - _HASH_DIGITS
    prefix: list[str] = []
    for char in text:  # whole characters only: the prefix unescapes to readable text
        piece = _escape(char)
        if room < len(piece):
            break
        prefix.append(piece)
        room -= len(piece)
    digest = hashlib.sha256(_text_bytes(text)).hexdigest()[:_HASH_DIGITS]
    return check_key("".join(prefix) + _SHORT_MARK + digest), True


def unescape_key(key: str) -> str:
    """Invert `escape_key` (bytes that are not UTF-8 come back as surrogate escapes)."""
    check_key(key)
    return re.sub(
        rb"%([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), key.encode("ascii")
    ).decode("utf-8", "surrogateescape")


def check_key(key: object) -> str:
    """Return `key` if it follows the key rule, else raise `InvalidKeyError` saying why."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"sample key {key!r} is a {type(key).__name__}; keys are str")
    if not key or len(key) > MAX_KEY_LENGTH or not _KEY_RE.fullmatch(key):
        raise InvalidKeyError(
            f"sample key {key!r} is not allowed: keys are 1-{MAX_KEY_LENGTH} characters of "
            "A-Z a-z 0-9 _ - and %XX escapes (no dots, slashes or spaces); "
            "make one from any string with dlpipe.sample.make_key()"
        )
    return key


def check_field_name(name: object) -> str:
    """Return `name` if it is a valid field name: a lower-case extension (``jpg``, ``seg.png``)."""
    if not isinstance(name, str) or not _FIELD_RE.fullmatch(name):
        raise InvalidFieldError(
            f"field name {name!r} is not allowed: field names are lower-case extensions "
            "such as 'jpg', 'cls', 'json' or 'seg.png' (a-z, 0-9, _ and inner dots)"
        )
    return name


def sample_fields(sample: Mapping[str, object]) -> tuple[str, dict[str, bytes]]:
    """Check a sample and split it into its key and its field bytes.

    Raises:
        InvalidKeyError: no ``__key__`` or a key that breaks the key rule.
        InvalidFieldError: a bad field name, a value that is not bytes, a non-canonical ``cls``
            or a sample without fields.
    """
    if KEY_FIELD not in sample:
        raise InvalidKeyError(f"sample has no {KEY_FIELD!r}; fields present: {sorted(sample)}")
    key = check_key(sample[KEY_FIELD])
    fields: dict[str, bytes] = {}
    for name, value in sample.items():
        if name == KEY_FIELD:
            continue
        check_field_name(name)
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, bytes):
            raise InvalidFieldError(
                f"sample {key!r} field {name!r} is a {type(value).__name__}; stored fields are "
                "bytes: encode values first with dlpipe.encode_field()"
            )
        if name.rsplit(".", 1)[-1] == "cls" and not _CLS_RE.fullmatch(value):
            raise InvalidFieldError(
                f"sample {key!r} field {name!r} is {value[:40]!r}; a cls field is an integer in "
                "canonical ASCII decimal (b'3', not b'03' or b'3\\n')"
            )
        fields[name] = value
    if not fields:
        raise InvalidFieldError(f"sample {key!r} has no fields besides {KEY_FIELD!r}")
    return key, fields
