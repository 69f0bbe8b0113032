"""Sample keys from a key column (``--key-col``, a table's ``id``/``key`` column, a Hugging
Face metadata column): one rule for the table and hf sources.

A value becomes a key as it reads (an integral float as its integer: ``7.0`` is ``7``),
escaped by the key rule (`dlpipe.sample.make_key`: shortened with a hash when too long, the
full value kept for ``keys.jsonl``). A value that is no string or finite number (empty, None,
a boolean, a list, NaN) and a key used twice in one split are each a `SourceError` naming the
row, the column and the value.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from dlpipe.converters.source import SourceError, display_path
from dlpipe.errors import InvalidKeyError
from dlpipe.sample import make_key

__all__ = ["ColumnKey", "UniqueKeys", "column_key"]


class ColumnKey(NamedTuple):
    """A row's key, its value as text (printable), and that text when the key is shortened
    (for ``keys.jsonl``), else None."""

    key: str
    text: str
    original: str | None


def column_key(value: Any, where: str, column: str) -> ColumnKey:
    """The key the value `value` of `column` at row `where` makes (module docstring)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        if not _is_key_value(value):
            raise InvalidKeyError("a key is made from a string or a number")
        text = str(value)
        key, shortened = make_key(text)
    except InvalidKeyError as exc:
        raise SourceError(
            f"{where}: {column} {value!r} cannot be a key ({exc}); fill in the value, or give "
            "another column with --key-col"
        ) from None
    shown = display_path(text)
    return ColumnKey(key, shown, shown if shortened else None)


def _is_key_value(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int)) and not isinstance(value, bool)


class UniqueKeys:
    """The keys made so far, per split: a key made twice in a split is a `SourceError`."""

    def __init__(self) -> None:
        self._first: dict[tuple[str | None, str], str] = {}  # (split, key) -> its first row

    def add(self, split: str | None, made: ColumnKey, where: str, column: str) -> None:
        first = self._first.setdefault((split, made.key), where)
        if first != where:
            raise SourceError(
                f"{where}: key {made.text!r} in column {column!r} is a duplicate (first in "
                f"{first}); keys must be unique in a split: fix the column, or give another "
                "column with --key-col"
            )
