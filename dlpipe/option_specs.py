"""Config fields that are options: `option` makes one, `OptionSpec` describes it, `Checked`
checks a config's own options by their rules, `build_config` makes a nested config from flat
option names.

Types come from `typing.get_type_hints` (an option is a bool, int, float or str, optionally
``| None``), never from ``str(field.type)``; a field whose type is a dataclass is a section.
A field typed ``tuple[K, ...]`` (K an int, float or str; optionally ``| None``) is a list
option: its flag takes one or more values, its TOML value is an array and its keyword a
tuple or list, each item checked by K and the field's rule; one value alone is a list of
one (so ``path = "data"`` reads as ``path = ["data"]``), and the value is kept as a tuple.
A field typed ``Mapping[str, str]`` or ``Mapping[str, Mapping[str, str]]`` (optionally ``|
None``) is a table option: its flag takes words of ``NAME=VALUE,...`` (two levels: ``KEY:NAME=
VALUE,...``, `dlpipe.option_values.table_word`), its TOML value is a table, its keyword a
mapping; each value is checked by the field's rule, and the value is kept as a dict.
The public names are re-exported by `dlpipe.options`, the face of the mechanism.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar, TypeVar

from dlpipe.errors import DlpipeError
from dlpipe.option_values import one_of

__all__ = [
    "Checked",
    "MissingOptionError",
    "OptionError",
    "OptionSpec",
    "build_config",
    "items_of",
    "iter_options",
    "option",
    "option_specs",
]

T = TypeVar("T")
_KINDS = {bool: "bool", int: "int", float: "float", str: "str"}
_ITEM_KINDS = ("int", "float", "str")  # what a list option's items may be


class OptionError(DlpipeError, ValueError):
    """An option is unknown, of the wrong type, or breaks its rule."""


class MissingOptionError(OptionError):
    """A required option was given nowhere (no flag, no key in the ``--config`` file)."""


def option(
    help: str,
    *,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    name: str | None = None,
    flag: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is also a CLI flag, a TOML key and a checked Python keyword.

    Args:
        help: the flag's help line.
        default: the default value (none given, nor `default_factory`: required).
        default_factory: makes the default, as `dataclasses.field`'s.
        parse: the rule, as an argparse type (raises `argparse.ArgumentTypeError`); a value
            from TOML or Python is checked by parsing its ``str``.
        choices: the allowed strings (sets `parse` and the metavar).
        name: the option's flat name (default: the field's name); unique over the config tree.
        flag: ``None``: ``--`` + the name with dashes; a flag without dashes is positional;
            ``""``: no CLI flag (TOML and Python only).
        metavar: the value's name in ``--help``.
    """
    if choices is not None:
        parse, metavar = one_of(choices), metavar or "{" + ",".join(choices) + "}"
    facts = {"help": help, "parse": parse, "choices": choices, "name": name, "flag": flag}
    facts["metavar"] = metavar
    return dataclasses.field(default=default, default_factory=default_factory, metadata=facts)


@dataclass(frozen=True)
class OptionSpec:
    """One option: its flat `name`, where it lives (`path` from the root config), its CLI face.

    `path` is the attribute path from the root config, e.g. ``("source", "image_col")``.
    """

    name: str
    path: tuple[str, ...]
    flag: str  # "--quality"; a name without dashes is positional; "": no flag
    kind: str  # "bool", "int", "float" or "str": the value's, or a list option's items'
    optional: bool  # None is allowed
    default: Any  # MISSING: required
    help: str
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None
    metavar: str | None
    many: bool = False  # a list option (``tuple[kind, ...]``): a tuple of items
    table: int = 0  # a table option: the levels of str-keyed tables around its str values

    @property
    def attr(self) -> str:
        """The field's attribute name in its dataclass."""
        return self.path[-1]

    @property
    def shown_flag(self) -> str:
        """How messages name the option: its flag, else its name."""
        return self.flag or self.name

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this option (type, then rule); None when nothing.
        A list option's value is a tuple or list (one value alone: a list of one), each item
        checked in turn."""
        if value is None and self.optional:
            return None
        if self.table:
            return self._table_problem(value, self.table)
        if not self.many:
            return self._item_problem(value)
        items = items_of(value)
        for number, item in enumerate(items, 1):
            problem = self._item_problem(item)
            if problem is not None:
                return (
                    problem
                    if len(items) == 1
                    else f"item {number} of {_cut(repr(value))}: {problem}"
                )
        return None

    def _table_problem(self, value: Any, depth: int) -> str | None:
        """What is wrong with `value` as a table of `depth` levels (a key, then its value)."""
        if not isinstance(value, Mapping):
            given = type(value).__name__
            shape = "a table of names" if depth == 1 else "a table of tables of names"
            optional = " or None" if self.optional and depth == self.table else ""
            return f"{_cut(repr(value))} is {_article(given)} {given}; give {shape}{optional}"
        for key, item in value.items():
            if not isinstance(key, str):
                given = type(key).__name__
                return f"key {_cut(repr(key))} is {_article(given)} {given}; give a str"
            problem = (
                self._table_problem(item, depth - 1)
                if depth > 1
                else self._item_problem(item, optional=False)
            )
            if problem is not None:
                return f"at {_cut(repr(key))}: {problem}"
        return None

    def _item_problem(self, value: Any, *, optional: bool | None = None) -> str | None:
        """What is wrong with one value or item (`optional`: whether to say None is allowed,
        default the option's)."""
        optional = self.optional if optional is None else optional
        wanted: tuple[type, ...] = {"bool": (bool,), "int": (int,), "str": (str,)}.get(
            self.kind, (int, float)
        )
        if not isinstance(value, wanted) or (self.kind != "bool" and isinstance(value, bool)):
            given = type(value).__name__
            return (
                f"{_cut(repr(value))} is {_article(given)} {given}; give {_article(self.kind)} "
                f"{self.kind}"
                + (f" or a list of {self.kind}s" if self.many else "")
                + (" or None" if optional else "")
            )
        if self.parse is not None:
            try:
                self.parse(str(value))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                return str(exc)
        return None

    def check(self, value: Any) -> Any:
        """`value` when it is of this option's type and keeps its rule (an int for a float
        option comes back a float; a list option's value a tuple).

        Raises:
            OptionError: naming the flag, the value and the rule.
        """
        problem = self.problem(value)
        if problem is not None:
            raise OptionError(f"argument {self.shown_flag}: {problem}")
        if value is None:
            return None
        if self.many:
            return tuple(self._item(item) for item in items_of(value))
        if self.table:
            return _table_copy(value)
        return self._item(value)

    def _item(self, value: Any) -> Any:
        return float(value) if self.kind == "float" else value


def _table_copy(table: Mapping[str, Any]) -> dict[str, Any]:
    """A table option's value as plain nested dicts (a caller's mapping is not kept)."""
    return {k: _table_copy(v) if isinstance(v, Mapping) else v for k, v in table.items()}


def option_specs(cls: type) -> list[OptionSpec]:
    """Every option of config class `cls`: its own fields first, then each nested dataclass
    field's, depth first, in field order (the CLI's order).

    Raises:
        TypeError: two options share a flat name, or an option's type is not a bool, int,
            float or str, a ``tuple[...]`` of int, float or str, or a table of str
            (``Mapping[str, str]``, ``Mapping[str, Mapping[str, str]]``), optionally ``| None``.
    """
    specs = list(_specs(cls, ()))
    names = [s.name for s in specs]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise TypeError(f"{cls.__name__}: option names {doubled} are not unique")
    return specs


@functools.cache
def _specs(cls: type, prefix: tuple[str, ...]) -> tuple[OptionSpec, ...]:
    hints = typing.get_type_hints(cls)
    own: list[OptionSpec] = []
    nested: list[OptionSpec] = []
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            own.append(_spec_of(f, hints[f.name], (*prefix, f.name)))
        elif dataclasses.is_dataclass(hints[f.name]):
            nested.extend(_specs(hints[f.name], (*prefix, f.name)))
    return (*own, *nested)


def _spec_of(f: dataclasses.Field[Any], hint: Any, path: tuple[str, ...]) -> OptionSpec:
    facts = f.metadata
    kind, optional, many, table = _kind_of(hint, path)
    name = facts["name"] or f.name
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    flag = "--" + name.replace("_", "-") if facts["flag"] is None else facts["flag"]
    return OptionSpec(
        name=name,
        path=path,
        flag=flag,
        kind=kind,
        optional=optional,
        default=default,
        help=facts["help"],
        parse=facts["parse"],
        choices=facts["choices"],
        metavar=facts["metavar"],
        many=many,
        table=table,
    )


def _kind_of(hint: Any, path: tuple[str, ...]) -> tuple[str, bool, bool, int]:
    """(the kind of the value or of a list or table option's items, None allowed, a list
    option, a table option's levels)."""
    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if typing.get_origin(hint) is typing.Union:
        parts = typing.get_args(hint)
    kinds = [_item_kind(p) for p in parts if p is not type(None)]
    if len(kinds) != 1 or kinds[0] is None:
        raise TypeError(
            f"option {'.'.join(path)}: type {hint} is not bool, int, float or str, nor a "
            "tuple[K, ...] of int, float or str, nor a Mapping[str, str] or "
            "Mapping[str, Mapping[str, str]]"
        )
    kind, many, table = kinds[0]
    return kind, len(parts) > 1, many, table


def _item_kind(hint: Any) -> tuple[str, bool, int] | None:
    """(kind, is a list option, a table's levels) of one part of an option's type, or None
    when it is none."""
    if hint in _KINDS:
        return _KINDS[hint], False, 0
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        kind = _KINDS.get(args[0])
        return (kind, True, 0) if kind in _ITEM_KINDS else None
    table = _table_levels(hint)
    return ("str", False, table) if table else None


def _table_levels(hint: Any) -> int:
    """1 for ``Mapping[str, str]``, 2 for ``Mapping[str, Mapping[str, str]]``, else 0."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) not in (Mapping, dict) or len(args) != 2 or args[0] is not str:
        return 0
    if args[1] is str:
        return 1
    return 2 if _table_levels(args[1]) == 1 else 0


def items_of(value: Any) -> tuple[Any, ...]:
    """A list option's value as its items: a tuple or list as it is, one value alone as one."""
    return tuple(value) if isinstance(value, list | tuple) else (value,)


class Checked:
    """A config dataclass whose `__post_init__` checks each of its own option fields by its
    rule (`OptionSpec.check`), so a config made in Python is refused as the CLI refuses it,
    and keeps a list option's value as a tuple (a list, or one value alone, given) and a
    table option's as a dict; a subclass may raise its own `OptionError` subclass
    (`option_error`)."""

    option_error: ClassVar[type[OptionError]] = OptionError

    def __post_init__(self) -> None:
        cls: Any = type(self)
        for spec in _specs(cls, ()):
            if len(spec.path) != 1:
                continue
            value = getattr(self, spec.attr)
            problem = spec.problem(value)
            if problem is not None:
                raise self.option_error(f"argument {spec.shown_flag}: {problem}")
            if (spec.many or spec.table) and value is not None:
                object.__setattr__(self, spec.attr, spec.check(value))  # frozen ones too


def build_config(cls: type[T], values: Mapping[str, Any]) -> T:
    """`cls` made from flat option names → values, each checked by its option's rule; the
    options not in `values` keep their defaults.

    Raises:
        OptionError: an unknown name (the options are listed), a value of the wrong type or
            breaking its rule, a required option missing.
    """
    specs = {s.name: s for s in option_specs(cls)}
    unknown = [name for name in values if name not in specs]
    if unknown:
        raise OptionError(f"{unknown[0]!r} is not an option; the options are {', '.join(specs)}")
    missing = [s for s in specs.values() if s.default is MISSING and s.name not in values]
    if missing:
        first = missing[0]
        raise MissingOptionError(f"the argument {first.shown_flag} is required: {first.help}")
    tree: dict[str, Any] = {}
    for name, value in values.items():
        spec = specs[name]
        node = tree
        for part in spec.path[:-1]:
            node = node.setdefault(part, {})
        node[spec.attr] = spec.check(value)
    return _made(cls, tree)


def _made(cls: type[T], tree: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {
        key: _made(hints[key], value) if dataclasses.is_dataclass(hints[key]) else value
        for key, value in tree.items()
    }
    return cls(**kwargs)


def iter_options(config: Any) -> Iterator[tuple[OptionSpec, Any]]:
    """Each option of `config` with its value."""
    for spec in option_specs(type(config)):
        value = config
        for part in spec.path:
            value = getattr(value, part)
        yield spec, value


def _cut(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def _article(noun: str) -> str:
    return "an" if noun[:1] in "aeiou" else "a"
