"""`Stateful`: the one protocol every resumable part of loading and training follows.

A component's ``state_dict()`` is plain data (ints, floats, strings, lists and dicts of them;
tensors only where torch owns the state) that ``torch.save`` stores with
``weights_only=True``; ``load_state_dict(state)`` on a fresh component built with the same
arguments makes what follows equal to what would have followed the save. A state that does
not fit the component raises `StateMismatchError` naming the field, never a bare KeyError or
AssertionError, and never yields other data silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from dlpipe.errors import DlpipeError

__all__ = ["StateMismatchError", "Stateful", "require_equal", "require_fields"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateMismatchError(DlpipeError, ValueError):
    """A saved state does not fit the component it is loaded into."""


def require_fields(state: Any, fields: tuple[str, ...], what: str) -> Mapping[str, Any]:
    """`state` as a mapping holding every one of `fields`, else `StateMismatchError`."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(f"the saved {what} state is a {type(state).__name__}, not a dict")
    missing = [name for name in fields if name not in state]
    if missing:
        raise StateMismatchError(
            f"the saved {what} state has no {', '.join(missing)}: it was not saved by this "
            "version of dlpipe or not by this component"
        )
    return state


def require_equal(state: Mapping[str, Any], name: str, expected: Any, what: str, fix: str) -> None:
    """Raise `StateMismatchError` naming `name` unless ``state[name] == expected``."""
    if state[name] != expected:
        raise StateMismatchError(
            f"the saved {what} state has {name}={state[name]!r}, this {what} has "
            f"{name}={expected!r}; {fix}"
        )
