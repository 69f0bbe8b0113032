"""Value parsers for options: argparse types, each raising `argparse.ArgumentTypeError` with a
message that names the value and the rule (``0 is not an integer of at least 1``).

An option's rule (`dlpipe.options.option`'s ``parse``) is one of these, so a flag, a TOML key
and a Python keyword are checked by the same words.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "area_share",
    "fraction",
    "int_in_range",
    "non_negative_float",
    "non_negative_int",
    "one_of",
    "parse_size",
    "positive_float",
    "positive_int",
    "table_text",
    "table_word",
]


def int_in_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type for an integer in ``low..high`` (no upper bound when `high` is None)."""
    rule = f"an integer of at least {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not {rule}")
        return value

    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return int_in_range(1)(text)


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0."""
    return int_in_range(0)(text)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a number above 0")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0 (a mixture's weight)."""
    return _float_in(text, lambda v: 0 <= v < math.inf, "a finite number of at least 0")


def area_share(text: str) -> float:
    """An argparse type: a share of an image's area, in (0, 1] (a crop's smallest)."""
    return _float_in(text, lambda v: 0 < v <= 1, "an area share in (0, 1]")


def fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    return _float_in(text, lambda v: 0 < v < 1, "a fraction between 0 and 1")


def _float_in(text: str, holds: Callable[[float], bool], rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
    if not holds(value):
        raise argparse.ArgumentTypeError(f"{text} is not {rule}")
    return value


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_UNITS |= {"gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """``"256MB"`` → 256000000; ``"64MiB"``, ``"1.5GB"``, ``"500000"`` (bytes) also work."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes with an optional unit, e.g. 256MB or 64MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: one of `choices`, exactly."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(choices)})"
            )
        return text

    return parse


def table_word(text: str, depth: int) -> dict[str, Any]:
    """One word of a table option's flag as a table: ``"kitty=cat,doggo=dog"`` (`depth` 1) →
    ``{"kitty": "cat", "doggo": "dog"}``; ``"1:kitty=cat"`` (`depth` 2) → ``{"1": {"kitty":
    "cat"}}`` (the key ends at the first colon, each name at its ``=``; names keep inner
    spaces, not commas).

    Raises:
        argparse.ArgumentTypeError: naming the word and the spelling.
    """
    spelling = "NAME=VALUE[,NAME=VALUE...]" if depth == 1 else "KEY:NAME=VALUE[,NAME=VALUE...]"
    if depth == 2:
        key, colon, rest = text.partition(":")
        if not colon or not key.strip():
            raise argparse.ArgumentTypeError(f"{text!r} is not {spelling}")
        try:
            return {key.strip(): table_word(rest, 1)}
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {spelling}") from None
    pairs = [piece.partition("=") for piece in text.split(",") if piece.strip()]
    if not pairs or not all(eq and name.strip() and value.strip() for name, eq, value in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not {spelling}")
    return {name.strip(): value.strip() for name, _, value in pairs}


def table_text(table: Mapping[str, Any]) -> str:
    """A table as its flag spells it (`table_word`'s words, space-separated): ``{"1":
    {"kitty": "cat"}}`` → ``1:kitty=cat``."""
    words = [
        f"{key}:{table_text(value)}" if isinstance(value, Mapping) else f"{key}={value}"
        for key, value in table.items()
    ]
    nested = any(isinstance(value, Mapping) for value in table.values())
    return (" " if nested else ",").join(words)
