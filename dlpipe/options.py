"""One config → CLI/TOML mechanism: a dataclass field is a flag, a TOML key and a keyword.

A command's config is nested keyword-only dataclasses; each field made with `option` holds its
help line, its default and its rule, and is at once

- a command-line flag (`add_options`, `given_options`; `add_config_command` makes a whole
  subcommand),
- a key of a TOML file (`read_config_file`; sections follow the nesting, ``[source]
  image_col = "path"``, and an option's flat name is also accepted at the top level),
- a Python keyword (`build_config`, flat names),

checked by one rule (`OptionSpec.check`), so a bad value gets the same message from each.
A list option (a field typed ``tuple[K, ...]``) takes several values: positional, as words
(``dlpipe train A B``); as a flag, as words or separated by commas (``--weights 0.7 0.3`` and
``--weights 0.7,0.3`` are the same); in TOML an array; in Python a tuple or list. A table
option (a field typed ``Mapping[str, str]`` or ``Mapping[str, Mapping[str, str]]``) maps names:
as a flag, words of ``NAME=VALUE,...`` or ``KEY:NAME=VALUE,...`` that add up, the flag given
again too (``--class-map 1:kitty=cat,doggo=dog``); in TOML a table; in Python a mapping.
Order of precedence everywhere: the dataclass defaults < ``--config FILE`` < flags given
(`config_from_args`). `config_toml` writes the resolved config, which reads back the same.

This module is the face of the mechanism (fields and specs: `dlpipe.option_specs`; TOML:
`dlpipe.config_files`; value parsers: `dlpipe.option_values`). It is core: it imports no room
and not the CLI, so every room may use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING
from typing import Any, TypeVar

from dlpipe.config_files import (
    MAX_CONFIG_BYTES,
    config_toml,
    read_config_file,
    read_toml,
    table_options,
    write_config_file,
)
from dlpipe.option_specs import (
    Checked,
    MissingOptionError,
    OptionError,
    OptionSpec,
    build_config,
    items_of,
    iter_options,
    option,
    option_specs,
)
from dlpipe.option_values import (
    area_share,
    fraction,
    int_in_range,
    non_negative_float,
    non_negative_int,
    one_of,
    parse_size,
    positive_float,
    positive_int,
    table_text,
    table_word,
)

__all__ = [
    "MAX_CONFIG_BYTES",
    "Checked",
    "ListFlag",
    "MissingOptionError",
    "OptionError",
    "OptionSpec",
    "TableFlag",
    "add_config_command",
    "add_config_flag",
    "add_options",
    "area_share",
    "build_config",
    "config_from_args",
    "config_toml",
    "fraction",
    "given_options",
    "int_in_range",
    "items_of",
    "iter_options",
    "non_negative_float",
    "non_negative_int",
    "one_of",
    "option",
    "option_specs",
    "parse_size",
    "positive_float",
    "positive_int",
    "read_config_file",
    "read_toml",
    "table_options",
    "table_text",
    "table_word",
    "write_config_file",
]

T = TypeVar("T")


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: Collection[str] = ()) -> None:
    """One argument per option of `cls` (but those named in `skip` and those with no flag).

    Every argument's default is None ("not given"), so the defaults live in the dataclass and
    a ``--config`` file can set what no flag gave; a bool is a switch (``store_const`` True,
    and ``--no-NAME`` when its default is True); a positional option with a default may be
    left out. A list option takes one or more values: positional, as words; as a flag, as
    words or comma-separated (`ListFlag`). A table option's flag takes one or more words
    (`TableFlag`).
    """
    for spec in option_specs(cls):
        if spec.name in skip or not spec.flag:
            continue
        spec = dataclasses.replace(spec, help=_with_default(spec))
        if not spec.flag.startswith("-"):
            nargs = None if spec.default is MISSING else "?"
            if spec.many:
                nargs = "+" if spec.default is MISSING else "*"
            parser.add_argument(
                spec.name, metavar=spec.flag, nargs=nargs, type=_item_type(spec), help=spec.help
            )
        elif spec.table:
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                nargs="+",
                action=functools.partial(TableFlag, read=spec.table),  # type: ignore[arg-type]
                metavar=spec.metavar,
                help=spec.help,
            )
        elif spec.many:
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                nargs="+",
                action=functools.partial(ListFlag, read=_item_type(spec)),  # type: ignore[arg-type]
                metavar=spec.metavar,
                help=spec.help,
            )
        elif spec.kind == "bool":
            parser.add_argument(
                spec.flag, dest=spec.name, action="store_const", const=True, help=spec.help
            )
            if spec.default is True:
                negative, help = "--no-" + spec.flag[2:], f"turn {spec.flag} off"
                parser.add_argument(
                    negative, dest=spec.name, action="store_const", const=False, help=help
                )
        else:
            parser.add_argument(
                spec.flag,
                dest=spec.name,
                type=_item_type(spec),
                metavar=spec.metavar,
                help=spec.help,
            )


def _item_type(spec: OptionSpec) -> Callable[[str], Any]:
    """The argparse type of one value of `spec`: its rule, else its kind's constructor."""
    return spec.parse or {"int": int, "float": float}.get(spec.kind, str)


class _WordsFlag(argparse.Action):
    """A flag that takes words (``nargs="+"``) and reads them with `read`, a setting the
    subclass takes (its item type, or a table's depth); `collected` turns the words, and
    what the flag holds already, into its value."""

    def __init__(self, *args: Any, read: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read = read

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.collected(getattr(namespace, self.dest, None), values))

    def collected(self, held: Any, words: list[str]) -> Any:
        raise NotImplementedError


class ListFlag(_WordsFlag):
    """A list option's flag: ``--weights 0.7 0.3`` or ``--weights 0.7,0.3`` (each word split
    at its commas), each value read by `read` (the option's type); a bad one is the parser's
    error, as a plain flag's is; the flag given again replaces the list."""

    def collected(self, held: Any, words: list[str]) -> list[Any]:
        pieces = [piece for word in words for piece in word.split(",") if piece.strip()]
        return [self._read(piece) for piece in pieces]

    def _read(self, piece: str) -> Any:
        try:
            return self.read(piece)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        except ValueError:
            name = getattr(self.read, "__name__", "value")
            raise argparse.ArgumentError(self, f"invalid {name} value: {piece!r}") from None


class TableFlag(_WordsFlag):
    """A table option's flag: each word one entry, ``NAME=VALUE,...`` or, two levels deep
    (`read`: the depth), ``KEY:NAME=VALUE,...`` (`table_word`); the words, and the flag given
    again, add up into one table, and a name given two values is the parser's error."""

    def collected(self, held: Any, words: list[str]) -> dict[str, Any]:
        table = held or {}
        for word in words:
            try:
                entry = table_word(word, self.read)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
            self._add(table, entry, ())
        return table

    def _add(self, table: dict[str, Any], entry: Mapping[str, Any], at: tuple[str, ...]) -> None:
        for key, value in entry.items():
            if isinstance(value, Mapping):
                self._add(table.setdefault(key, {}), value, (*at, key))
            elif table.setdefault(key, value) != value:
                name = ":".join((*at, key))
                raise argparse.ArgumentError(
                    self, f"{name} is given {table[key]!r} and {value!r}; give it one value"
                )


def _with_default(spec: OptionSpec) -> str:
    """The help line, with the default when it does not say it (a switch's is off)."""
    if spec.kind == "bool" or spec.default in (MISSING, None, "", ()) or "default" in spec.help:
        return spec.help
    return f"{spec.help} (default {spec.default})"


def given_options(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of `cls` given on the command line: flat name → value (a list option left
    out, as positional words, is not given)."""
    given = {s.name: getattr(args, s.name, None) for s in option_specs(cls)}
    return {name: value for name, value in given.items() if value is not None and value != []}


def add_config_command(
    sub: argparse._SubParsersAction,
    name: str,
    cls: type[T],
    run: Callable[[T, Any], int],
    *,
    help: str,
) -> argparse.ArgumentParser:
    """A subcommand whose arguments are `cls`'s options (`add_options`) and ``--config FILE``.

    Its handler builds `cls` (`config_from_args`) and returns ``run(config, console)``; a
    required option given nowhere is the parser's one error line (exit 2).
    """
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help)
    add_options(parser, cls)
    add_config_flag(parser)

    def handler(args: argparse.Namespace, console: Any) -> int:
        try:
            config = config_from_args(args, cls)
        except MissingOptionError as exc:
            parser.error(str(exc))
        return run(config, console)

    parser.set_defaults(handler=handler)
    return parser


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, the same for every command."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="a TOML file of options: the flags' names with underscores, top level or in "
        "their [section] as the resolved config file the command writes; flags given override it",
    )


def config_from_args(
    args: argparse.Namespace, cls: type[T], fixed: Mapping[str, Any] | None = None
) -> T:
    """`cls` from the dataclass defaults, then ``args.config``'s file, then the flags given,
    then `fixed` (values the command sets itself).

    Raises:
        OptionError: a bad file, key or value, named.
    """
    path = getattr(args, "config", None)
    values = read_config_file(path, cls) if path else {}
    return build_config(cls, {**values, **given_options(args, cls), **(fixed or {})})
