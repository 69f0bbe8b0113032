"""A COCO instances file read element by element: bounded memory for any file size.

``instances_train2017.json`` is 448 MB, and ``json.load`` of it holds the text and a Python
object for every polygon vertex (gigabytes). `read_arrays` instead walks the top-level object
with a sliding text buffer and decodes one element of a top-level array at a time
(``json.JSONDecoder.raw_decode``); `read_instances` keeps only what a sample needs: per image
its id, file name and size, per annotation its id, image, category, box and crowd flag. The
polygons and RLE masks are decoded one annotation at a time, counted and dropped; asked for
(``spans=True``, ``--instance-masks``), each annotation's byte span in the file is kept instead,
one integer, for a worker to read that annotation again (`dlpipe.converters.coco_masks`).

A hostile file is one `SourceError` naming the file and the problem, never a crash: a file that
is not one JSON object, is truncated or is not UTF-8, a top-level key given twice, nesting
deeper than `MAX_DEPTH`, a number that is not finite or beyond +-2**63 (``1e999``, ``NaN``), one
element over `MAX_ELEMENT_CHARS`, or an ``images``/``annotations``/``categories`` entry whose
ids cannot be read. A bad annotation of one image (a box that is not 4 numbers with a positive
width and height, a crowd flag that is not 0/1, no id) is kept as that image's problem, for the
source to raise as a per-sample error.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import IO, Any, cast

from dlpipe.annotations import four_numbers
from dlpipe.converters.source import SampleError, SourceError, display_path, open_regular

__all__ = [
    "MAX_DEPTH",
    "MAX_ELEMENT_CHARS",
    "Instances",
    "file_stamp",
    "read_arrays",
    "read_instances",
]

MAX_DEPTH = 16
"""Nesting levels a file may have (COCO's deepest, a polygon's vertex list, is at level 5)."""
MAX_ELEMENT_CHARS = 16 << 20
"""The largest element of a top-level array (COCO's largest annotation, an RLE, is ~100 kB)."""
_MAX_NUMBER = 2**63
_CHUNK_CHARS = 1 << 20
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_TAIL = re.compile(r"[0-9.eE+-]*")  # what may follow a number cut at the buffer's end
_NEAR_END = 64  # a decode error this close to the buffer's end may be a cut element

_ID_TYPES = frozenset({int, str})
Handlers = dict[str, Callable[..., None]]
ImageId = int | str
Object = tuple[ImageId, int, float, float, float, float, int]
"""An annotation as kept: (id, category id, x, y, width, height, iscrowd)."""


class _Reader:
    """A JSON text walked with a sliding buffer: values are decoded where the walk stands."""

    def __init__(self, file: IO[bytes], shown: str) -> None:
        self._file = file
        self._text = codecs.getincrementaldecoder("utf-8-sig")()
        self._decoder = json.JSONDecoder()
        self.shown = shown
        self.buf = ""
        self.pos = 0
        self.dropped = 0  # characters before buf[0]
        self.eof = False
        self.spans = False  # keep track of byte offsets (`byte_at`)
        self._ascii = True  # buf is ASCII: a character is a byte
        self._bytes_dropped = 0  # bytes of the file before buf[0] (a BOM included)
        self._cursor = (0, 0)  # (index in buf, bytes of buf before it): `byte_at` moves it on
        self.value_start = 0  # the character where the last `value` began

    def fail(self, problem: str, at: int | None = None) -> SourceError:
        where = self.dropped + (self.pos if at is None else at)
        return SourceError(
            f"{self.shown}: {problem} at character {where}; dlpipe cannot read it as COCO "
            "annotations (restore the file from the download, or export it again)"
        )

    def _fill(self, want: int = 0) -> bool:
        """Read more text, dropping what lies before `pos`; False at the end of the file."""
        if self.eof:
            return False
        if self.spans:
            self._bytes_dropped = self.byte_at(self.dropped + self.pos)
            self._cursor = (0, 0)
        self.dropped += self.pos
        self.buf, self.pos = self.buf[self.pos :], 0
        try:
            raw = self._file.read(max(want, _CHUNK_CHARS))
            self.eof = not raw
            if self.dropped == 0 and not self.buf and raw.startswith(codecs.BOM_UTF8):
                self._bytes_dropped = len(codecs.BOM_UTF8)  # the decoder drops it
            self.buf += self._text.decode(raw, final=self.eof)
            self._ascii = self.buf.isascii()
        except UnicodeDecodeError as exc:
            raise self.fail(f"not UTF-8 text ({exc.reason})", len(self.buf)) from None
        except OSError as exc:
            raise SourceError(f"{self.shown}: cannot be read ({exc.strerror or exc})") from exc
        return not self.eof

    def byte_at(self, char: int) -> int:
        """The file's byte offset of character `char` (counted from the file's start), which
        lies in the buffer at or after the last one asked for (`spans` only)."""
        index = char - self.dropped
        if self._ascii:
            return self._bytes_dropped + index
        at, before = self._cursor
        before += len(self.buf[at:index].encode("utf-8"))
        self._cursor = (index, before)
        return self._bytes_dropped + before

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), not consumed."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def expect(self, chars: str, what: str) -> str:
        """Consume the next character, one of `chars`."""
        char = self.peek()
        if not char or char not in chars:
            found = repr(char) if char else "the end of the file (is it truncated?)"
            raise self.fail(f"expected {what}, found {found}")
        self.pos += 1
        return char

    def value(self, depth: int) -> Any:
        """The JSON value at the walk's position, checked by `_check` from nesting `depth`."""
        if not self.peek():
            raise self.fail("the file ends early (is it truncated?)")
        self.value_start = self.dropped + self.pos
        while True:
            try:
                value, end = self._decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                self._more_or_fail(exc)
                continue
            except ValueError as exc:  # Python's limit on an integer's digits
                raise self.fail(f"an integer of too many digits ({str(exc)[:50]}...)") from None
            except RecursionError:
                raise self.fail(f"nesting deeper than {MAX_DEPTH} levels") from None
            if _NUMBER_TAIL.fullmatch(self.buf, end) and self._fill():
                continue  # a number may go on past the buffer's end ("1" of "1e-7")
            _check(value, depth, self)  # the position names the value's start
            self.pos = end
            return value

    def _more_or_fail(self, exc: json.JSONDecodeError) -> None:
        """Read more when the element may be cut by the buffer's end, else refuse the file."""
        cut = exc.pos >= len(self.buf) - _NEAR_END or exc.msg.startswith("Unterminated string")
        if not cut or self.eof:
            problem = "the file ends early (is it truncated?)" if cut else f"bad JSON ({exc.msg})"
            raise self.fail(problem, exc.pos)
        if len(self.buf) - self.pos > MAX_ELEMENT_CHARS:
            raise self.fail(f"an element longer than {MAX_ELEMENT_CHARS} characters")
        self._fill(len(self.buf) - self.pos)  # double the buffer: an element decodes in O(log n)


def _check(value: Any, depth: int, reader: _Reader) -> None:
    """Refuse nesting deeper than `MAX_DEPTH` and numbers that are not finite or are huge.

    Called once per element of a top-level array (an annotation of 10-20 values): a container's
    scalars are checked inline and a flat list of numbers (a polygon, an RLE's counts) in C, so
    that the serial parse costs a few microseconds per annotation. A scalar's range test also
    refuses NaN and the infinities (every comparison with NaN is false).
    """
    if depth > MAX_DEPTH:
        raise reader.fail(f"nesting deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        first = type(value[0]) if value else int
        if first is list or first is dict or first is str:
            items: Any = value  # sum() would refuse it: item by item
        else:
            try:
                total = sum(value)
            except TypeError:
                items = value  # not all numbers: item by item
            else:
                if value and not (
                    _finite(total) and -_MAX_NUMBER < min(value) <= max(value) < _MAX_NUMBER
                ):
                    raise reader.fail(
                        "a list holding a number that is not finite or beyond +-2**63"
                    )
                return
    elif isinstance(value, dict):
        items = value.values()
    else:
        items = (value,)
    for item in items:
        kind = type(item)
        if kind is list or kind is dict:
            _check(item, depth + 1, reader)
        elif (kind is float or kind is int) and not -_MAX_NUMBER < item < _MAX_NUMBER:
            raise reader.fail(f"the number {item!r:.40} is not finite or beyond +-2**63")


def _finite(number: float) -> bool:
    """False for inf and NaN (an int is finite, however large: `float()` would overflow)."""
    return not isinstance(number, float) or math.isfinite(number)


def read_arrays(
    path: str, folder: str, handlers: Handlers, *, spans: Collection[str] = ()
) -> set[str]:
    """Walk the JSON object in `path`, calling ``handlers[key](index, element)`` for each element
    of the top-level array under each handled key; other values are read, checked and dropped.

    Args:
        path: the JSON file.
        folder: the real raw folder the file must lie in.
        handlers: top-level key → what to do with each element of its array.
        spans: the keys whose handlers also get each element's byte span in the file,
            ``offset << 32 | length``, as a third argument.

    Returns:
        The top-level keys the file has.

    Raises:
        SourceError: the file cannot be read, or is not such an object (module docstring).
    """
    shown = display_path(path)
    try:
        file = open_regular(path, folder)
    except SampleError as exc:
        raise SourceError(str(exc)) from None
    with file:
        reader = _Reader(file, shown)
        reader.spans = bool(spans)
        first = reader.peek()
        if first != "{":
            what = f"begins with {first!r}" if first else "is empty"
            raise reader.fail(f"the file is not a JSON object (it {what})")
        reader.pos += 1
        keys: set[str] = set()
        if reader.peek() == "}":
            reader.pos += 1
        else:
            _members(reader, handlers, keys, set(spans))
        if reader.peek():
            raise reader.fail("more text after the JSON object")
    return keys


def _members(reader: _Reader, handlers: Handlers, keys: set[str], spans: set[str]) -> None:
    while True:
        key = reader.value(1)
        if not isinstance(key, str):
            raise reader.fail(f"expected a key string, found {key!r:.40}")
        if key in keys:
            raise reader.fail(f"the key {key!r:.40} given twice")
        keys.add(key)
        reader.expect(":", "':'")
        handler = handlers.get(key)
        if reader.peek() == "[":
            reader.pos += 1
            _elements(reader, handler, key in spans)
        elif handler is not None:
            raise reader.fail(f"{key!r} is not a list")
        else:
            reader.value(2)
        if reader.expect(",}", "',' or '}'") == "}":
            return


def _elements(reader: _Reader, handler: Callable[..., None] | None, spans: bool) -> None:
    if reader.peek() == "]":
        reader.pos += 1
        return
    index = 0
    while True:
        element = reader.value(3)
        if handler is not None and spans:
            offset = reader.byte_at(reader.value_start)
            length = reader.byte_at(reader.dropped + reader.pos) - offset
            handler(index, element, offset << 32 | length)
        elif handler is not None:
            handler(index, element)
        index += 1
        if reader.expect(",]", "',' or ']'") == "]":
            return


@dataclass
class Instances:
    """What conversion keeps of one instances file.

    Attributes:
        images: image id → (file_name, width or None, height or None, problem or None), in the
            file's order.
        categories: category id → name.
        objects: image id → its annotations in the file's order: an `Object`, or the problem
            that makes the image's sample an error.
        masks: annotations with a polygon or RLE segmentation.
        spans: when asked for (`read_instances`), image id → the byte span in the file of each
            of its annotations, in the order of `objects` (``offset << 32 | length``).
        stamp: the file's (size, mtime in ns) when it was read, to tell a later change.
    """

    shown: str
    images: dict[ImageId, tuple[str, int | None, int | None, str | None]] = field(
        default_factory=dict
    )
    categories: dict[int, str] = field(default_factory=dict)
    objects: dict[ImageId, list[Object | str]] = field(default_factory=dict)
    masks: int = 0
    spans: dict[ImageId, list[int]] | None = None
    stamp: tuple[int, int] = (0, 0)

    def image(self, index: int, entry: Any) -> None:
        """Keep one element of ``images``."""
        where = f"{self.shown}: images[{index}]"
        image_id = _entry_id(entry, "id", where)
        if image_id in self.images:
            raise SourceError(f"{where}: image id {image_id!r} is given twice; ids must be unique")
        name = entry.get("file_name")
        if not isinstance(name, str) or not name or "\0" in name:
            raise SourceError(f"{where}: 'file_name' {name!r:.60} is not a file name")
        width, height = entry.get("width"), entry.get("height")
        problem = None
        if not all(v is None or (_is_int(v) and v > 0) for v in (width, height)):
            problem = (
                f"{where} (image id {image_id!r}): width {width!r:.20} and height "
                f"{height!r:.20} are not positive integers"
            )
        self.images[image_id] = (name, width, height, problem)

    def category(self, index: int, entry: Any) -> None:
        """Keep one element of ``categories``."""
        where = f"{self.shown}: categories[{index}]"
        category_id = _entry_id(entry, "id", where)
        name = entry.get("name")
        if not isinstance(category_id, int) or category_id in self.categories:
            what = "is given twice" if category_id in self.categories else "is not an integer"
            raise SourceError(f"{where}: category id {category_id!r} {what}")
        if not isinstance(name, str) or not name:
            raise SourceError(f"{where}: category {category_id} has no 'name' string")
        self.categories[category_id] = name

    def annotation(self, index: int, entry: Any, span: int = 0) -> None:
        """Keep one element of ``annotations``: its object, or the problem it has (and, when
        `spans` are kept, its byte span)."""
        plain = _plain_object(entry)
        if plain is None:
            where = f"{self.shown}: annotations[{index}]"
            image_id = _entry_id(entry, "image_id", where)
            kept = _object(entry, where)
        else:
            image_id, kept = plain
        segmentation = entry.get("segmentation")
        if isinstance(segmentation, dict) or (isinstance(segmentation, list) and segmentation):
            self.masks += 1
        self.objects.setdefault(image_id, []).append(kept)
        if self.spans is not None:
            self.spans.setdefault(image_id, []).append(span)


def _plain_object(entry: Any) -> tuple[ImageId, Object] | None:
    """An annotation's image id and object when every value is as COCO writes it (the serial
    parse's common case, no message built); None otherwise: `_entry_id` and `_object` name
    the problem (the types are JSON's own: no subclasses)."""
    if type(entry) is not dict:
        return None
    image_id, ann_id, box = entry.get("image_id"), entry.get("id"), entry.get("bbox")
    category_id, crowd = entry.get("category_id"), entry.get("iscrowd", 0)
    if not (
        type(image_id) in _ID_TYPES
        and type(ann_id) in _ID_TYPES
        and type(category_id) is int
        and (crowd == 0 or crowd == 1)
        and type(crowd) is int
        and four_numbers(box)
        and box[2] > 0
        and box[3] > 0
    ):
        return None
    x, y, width, height = box
    return cast(ImageId, image_id), cast(Object, (ann_id, category_id, x, y, width, height, crowd))


def _object(entry: dict[str, Any], where: str) -> Object | str:
    ann_id, category_id = entry.get("id"), entry.get("category_id")
    box, crowd = entry.get("bbox"), entry.get("iscrowd", 0)
    where = f"{where} (id {ann_id!r:.30})"
    if not (_is_int(ann_id) or isinstance(ann_id, str)):
        return f"{where}: has no integer or string 'id'"
    if not _is_int(category_id):
        return f"{where}: 'category_id' {category_id!r:.30} is not an integer"
    if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box)):
        return f"{where}: 'bbox' {box!r:.60} is not 4 numbers [x, y, width, height]"
    x, y, width, height = box
    if not (width > 0 and height > 0):
        return f"{where}: 'bbox' {box!r:.60} has no positive width and height"
    if crowd not in (0, 1) or not isinstance(crowd, int):
        return f"{where}: 'iscrowd' {crowd!r:.30} is not 0 or 1"
    return cast(Object, (ann_id, category_id, x, y, width, height, int(crowd)))


def file_stamp(path: str) -> tuple[int, int]:
    """A file's (size, mtime in ns); (0, 0) when it cannot be read (the read then fails)."""
    try:
        info = os.stat(path)
    except OSError:
        return (0, 0)
    return (info.st_size, info.st_mtime_ns)


def _entry_id(entry: Any, name: str, where: str) -> ImageId:
    if not isinstance(entry, dict):
        raise SourceError(f"{where} is not an object; each entry is {{...}}")
    value = entry.get(name)
    if not (_is_int(value) or isinstance(value, str)):
        raise SourceError(f"{where}: {name!r} {value!r:.40} is not an integer (or string) id")
    return cast(ImageId, value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_instances(path: str, folder: str, *, spans: bool = False) -> Instances:
    """The images, categories and annotation boxes of a COCO instances file.

    Args:
        path: the instances file.
        folder: the real raw folder it must lie in.
        spans: keep each annotation's byte span (`Instances.spans`) and the file's stamp.

    Raises:
        SourceError: the file is hostile or malformed (module docstring), or has no
            ``images``, ``annotations`` or ``categories`` list.
    """
    found = Instances(display_path(path), spans={} if spans else None)
    handlers: Handlers = {
        "images": found.image,
        "annotations": found.annotation,
        "categories": found.category,
    }
    if spans:
        found.stamp = file_stamp(path)  # before reading: a later change shows
    keys = read_arrays(path, folder, handlers, spans=("annotations",) if spans else ())
    missing = [key for key in handlers if key not in keys]
    if missing:
        raise SourceError(
            f"{found.shown}: no {' or '.join(repr(k) for k in missing)} list; an instances file "
            "has 'images', 'annotations' and 'categories' (is it a captions, keypoints or "
            "image_info file?)"
        )
    if not found.categories:
        raise SourceError(f"{found.shown}: 'categories' is empty; the classes are named there")
    return found
