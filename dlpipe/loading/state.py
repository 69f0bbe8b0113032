"""`Stateful`: the one protocol every resumable part of loading and training follows.

A component's ``state_dict()`` is plain data (ints, floats, strings, lists and dicts of them;
tensors only where torch owns the state) that ``torch.save`` stores with
``weights_only=True``; ``load_state_dict(state)`` on a fresh component built with the same
arguments makes what follows equal to what would have followed the save.

A state is untrusted input (it comes from a file): ``load_state_dict`` checks every field it
reads before it changes anything, with the checks below (each names the field, the value and
the rule), and a state that does not fit raises `StateMismatchError`, never a bare KeyError,
TypeError or AssertionError, and never yields other data silently. A count is an ``int``
(``True`` is not one, nor ``3.0``), in its range.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dlpipe.errors import DlpipeError

__all__ = [
    "MAX_COUNT",
    "SAVED_BY_DLPIPE",
    "StateMismatchError",
    "Stateful",
    "is_int",
    "mismatch",
    "require_equal",
    "require_fields",
    "require_float",
    "require_int",
    "require_like",
    "require_list",
    "shown",
]

MAX_COUNT = 2**62  # no run counts this far (steps, epochs, samples): a larger count is damage
SAVED_BY_DLPIPE = "load a state saved by this component"


class _Short(reprlib.Repr):
    """Reprs cut short, two levels deep, a tensor or array as its dtype and shape."""

    def repr_Tensor(self, value: Any, level: int) -> str:  # (reprlib names by type)
        return f"<{value.dtype} tensor of shape {list(value.shape)}>"

    repr_ndarray = repr_Tensor


_REPR = _Short()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlist = 60, 60, 40, 4
_REPR.maxdict, _REPR.maxlevel = 4, 2


def shown(value: Any) -> str:
    """`value`'s repr on one line, cut short (a crafted state may hold a huge list, string
    or tensor)."""
    return _REPR.repr(value).replace("\n", " ")


def _upto(high: int) -> str:
    return "2**62" if high == MAX_COUNT else str(high)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateMismatchError(DlpipeError, ValueError):
    """A saved state does not fit the component it is loaded into.

    ``problem`` is the message without its fix, for a caller that words its own (the trainer
    names the checkpoint file and a command).
    """

    def __init__(self, message: str, *, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem if problem is not None else message


def mismatch(what: str, name: str, value: Any, rule: str, fix: str) -> StateMismatchError:
    """The error for field `name` of a saved `what` state holding `value`, against `rule`."""
    problem = f"the saved {what} state has {name}={shown(value)}: {rule}"
    return StateMismatchError(f"{problem}; {fix}", problem=problem)


def require_fields(state: Any, fields: tuple[str, ...], what: str) -> Mapping[str, Any]:
    """`state` as a mapping holding every one of `fields`, else `StateMismatchError`."""
    if not isinstance(state, Mapping):
        problem = f"the saved {what} state is a {type(state).__name__}, not a dict"
        raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)
    missing = [name for name in fields if name not in state]
    if missing:
        problem = f"the saved {what} state has no {', '.join(missing)}"
        raise StateMismatchError(
            f"{problem}: it was not saved by this version of dlpipe or not by this component",
            problem=problem,
        )
    return state


def is_int(value: Any) -> bool:
    """An integer, and not a bool (``True`` is not a count)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def require_int(
    state: Mapping[str, Any],
    name: str,
    what: str,
    *,
    low: int = 0,
    high: int = MAX_COUNT,
    fix: str = SAVED_BY_DLPIPE,
) -> int:
    """``state[name]`` as an int in ``low..high``, else `StateMismatchError`."""
    value = state[name]
    if not is_int(value) or not low <= value <= high:
        raise mismatch(what, name, value, f"it must be an integer in {low}..{_upto(high)}", fix)
    return int(value)


def require_float(
    state: Mapping[str, Any],
    name: str,
    what: str,
    *,
    low: float = 0.0,
    high: float = math.inf,
    optional: bool = False,
    fix: str = SAVED_BY_DLPIPE,
) -> float | None:
    """``state[name]`` as a finite number in ``[low, high]`` (None too if `optional`)."""
    value = state[name]
    if value is None and optional:
        return None
    number = isinstance(value, float | np.floating) or is_int(value)
    if not number or not math.isfinite(value) or not low <= value <= high:
        rule = f"it must be a finite number in [{low:g}, {high:g}]"
        raise mismatch(what, name, value, rule + (" or None" if optional else ""), fix)
    return float(value)


def require_list(
    state: Mapping[str, Any], name: str, what: str, *, fix: str = SAVED_BY_DLPIPE
) -> list[Any]:
    """``state[name]`` as a list (a list or tuple was saved), else `StateMismatchError`."""
    value = state[name]
    if not isinstance(value, list | tuple):
        raise mismatch(what, name, value, "it must be a list", fix)
    return list(value)


def _same_kind(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool):
        return isinstance(value, bool)
    if is_int(expected):
        return is_int(value)
    if isinstance(expected, list | tuple):
        return (
            isinstance(value, list | tuple)
            and len(value) == len(expected)
            and all(_same_kind(v, e) for v, e in zip(value, expected, strict=True))
        )
    return type(value) is type(expected)


def require_equal(state: Mapping[str, Any], name: str, expected: Any, what: str, fix: str) -> None:
    """Raise `StateMismatchError` naming `name` unless ``state[name]`` is `expected` (of the
    same kind: ``True`` is not ``1``, a list is compared item by item)."""
    value = state[name]
    same = _same_kind(value, expected)
    if same and isinstance(expected, list | tuple):
        same = list(value) == list(expected)
    elif same:
        same = bool(value == expected)
    if not same:
        problem = (
            f"the saved {what} state has {name}={shown(value)}, this {what} has "
            f"{name}={shown(expected)}"
        )
        raise StateMismatchError(f"{problem}; {fix}", problem=problem)


def require_like(
    saved: Any,
    current: Any,
    name: str,
    what: str,
    fix: str = SAVED_BY_DLPIPE,
    *,
    subset: bool = False,
) -> None:
    """`saved` has the shape of `current` (what this component's own ``state_dict()`` holds
    now): the same keys (`subset`: no others, at the top level), lists of the same length,
    bools where bools are, numbers where numbers are (finite, not negative; an int where an
    int is), None where None is, strings where strings are, tensors of the same dtype.

    For states torch owns (a GradScaler, an LR scheduler, an optimizer's hyperparameters),
    whose own ``load_state_dict`` takes any value and fails at a later step, or sets every
    key it is given as an attribute.
    """
    if isinstance(current, Mapping):
        if not isinstance(saved, Mapping):
            raise mismatch(what, name, saved, "it must be a dict", fix)
        unknown = sorted(map(str, set(saved) - set(current)))
        missing = [] if subset else sorted(map(str, set(current) - set(saved)))
        if unknown or missing:
            rule = f"it must not hold {unknown}" if unknown else f"it lacks {missing}"
            raise mismatch(what, name, saved, f"{rule}; its keys are {sorted(current)}", fix)
        keys = set(saved)
        for key in [key for key in current if key in keys]:
            require_like(saved[key], current[key], f"{name}.{key}", what, fix)
    elif isinstance(current, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(current):
            raise mismatch(what, name, saved, f"it must be a list of {len(current)}", fix)
        for i, (item, now) in enumerate(zip(saved, current, strict=True)):
            require_like(item, now, f"{name}[{i}]", what, fix)
    elif isinstance(current, bool) or current is None or isinstance(current, str):
        if not _same_kind(saved, current):
            kind = "None" if current is None else type(current).__name__
            raise mismatch(what, name, saved, f"it must be a {kind}", fix)
    elif is_int(current) or isinstance(current, float):
        if is_int(current):
            require_int({name: saved}, name, what, fix=fix)
        else:
            require_float({name: saved}, name, what, fix=fix)
    elif hasattr(current, "dtype") and (  # a tensor
        type(saved) is not type(current) or saved.dtype != current.dtype
    ):
        raise mismatch(what, name, saved, f"it must be a {current.dtype} tensor", fix)
