"""Options in TOML files: `read_config_file` reads a ``--config`` file into flat option names,
`config_toml` and `write_config_file` write a config back, every section in full.

Keys follow the dataclass nesting (``[source]`` then ``image_col = "path"``); an option's flat
name is also accepted at the top level. A config file is untrusted input: a regular file of at
most `MAX_CONFIG_BYTES`, UTF-8; an unknown key is refused with the keys there are. A string
for a number option is read as its flag reads it (``shard_bytes = "256MB"``). A list option
(``tuple[K, ...]``) is an array (``weights = [0.7, 0.3]``; one value alone is a list of one)
and is written back as one. A table option (``Mapping[str, ...]``) is a table
(``class_map = { "1" = { kitty = "cat" } }``), written back as its own ``[section.name.KEY]``
tables after its section's keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Collection, Mapping
from typing import Any

import tomli_w

from dlpipe import storage
from dlpipe.option_specs import OptionError, OptionSpec, _cut, option_specs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "MAX_CONFIG_BYTES",
    "config_toml",
    "read_config_file",
    "read_toml",
    "table_options",
    "write_config_file",
]

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes


def read_config_file(path: str, cls: type) -> dict[str, Any]:
    """The options a TOML file sets for `cls`, as flat name → checked value.

    Keys follow the dataclass nesting (``[source]`` then ``image_col = "path"``); an option's
    flat name is also accepted at the top level. The file is read as untrusted input: a
    regular file of at most `MAX_CONFIG_BYTES`, UTF-8.

    Raises:
        OptionError: the file cannot be read or parsed, a key is unknown (named, with the keys
            there are), or a value breaks its option's rule.
    """
    return table_options(read_toml(path), cls, path)


def table_options(table: Mapping[str, Any], cls: type, source: str) -> dict[str, Any]:
    """The options a TOML table (as `read_toml` gives it) sets for `cls`, as flat name →
    checked value; `source` names the table in errors (`read_config_file`'s rules)."""
    values: dict[str, Any] = {}
    _take(table, (), option_specs(cls), source, values)
    return values


def _take(
    table: Mapping[str, Any],
    at: tuple[str, ...],
    specs: list[OptionSpec],
    path: str,
    values: dict[str, Any],
) -> None:
    here = {s.path[-1]: s for s in specs if s.path[:-1] == at}
    if not at:
        here = {s.name: s for s in specs} | here
    sections = {
        s.path[len(at)] for s in specs if s.path[: len(at)] == at and len(s.path) > len(at) + 1
    }
    for key, value in table.items():
        where = ".".join((*at, key))
        if isinstance(value, Mapping) and key in sections:
            _take(value, (*at, key), specs, path, values)
        elif key in here:  # a table for another option is that option's type error
            spec = here[key]
            value = _as_flag_reads(spec, value, f"config file {path}: {where}")
            problem = spec.problem(value)
            if problem is not None:
                raise OptionError(f"config file {path}: {where} = {_cut(repr(value))}: {problem}")
            values[spec.name] = spec.check(value)
        else:
            raise OptionError(
                f"config file {path}: unknown key {_cut(where)!r}; {_known(at, specs)}"
            )


def _as_flag_reads(spec: OptionSpec, value: Any, where: str) -> Any:
    """A file's text for a number option read as its flag reads it (``shard_bytes = "256MB"``:
    TOML has no size literal), a list option's array item by item; any other value as it is.

    Raises:
        OptionError: the text breaks the option's rule (naming `where` and the value).
    """
    if spec.many and isinstance(value, list):
        return [_as_flag_reads(spec, item, where) for item in value]
    if not (isinstance(value, str) and spec.kind in ("int", "float") and spec.parse):
        return value
    try:
        return spec.parse(value)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise OptionError(f"{where} = {_cut(repr(value))}: {exc}") from None


def _known(at: tuple[str, ...], specs: list[OptionSpec]) -> str:
    """The keys a table at `at` takes, for an unknown key's message: its own options, then its
    sections (at the top also any option's flat name, too many to list)."""
    below = [s.path[len(at) :] for s in specs if s.path[: len(at)] == at]
    options = [rest[0] for rest in below if len(rest) == 1]  # in the config's own order
    sections = list(dict.fromkeys(f"[{'.'.join((*at, r[0]))}]" for r in below if len(r) > 1))
    where = "there" if at else "at the top"
    flat = f" (or any option's own name, e.g. {specs[-1].name})" if not at and specs else ""
    return f"the keys {where} are {', '.join(options + sections)}{flat}"


def read_toml(path: str) -> dict[str, Any]:
    """The TOML file at `path`: a regular file of at most `MAX_CONFIG_BYTES`, UTF-8, parsed
    (a FIFO would hang, /dev/zero read without end, a value nested 100,000 deep recurse)."""
    try:
        with storage.open_regular(path) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise OptionError(f"--config {path}: no such file; give a TOML file") from None
    except storage.NotRegularFileError as exc:
        raise OptionError(f"--config {path} is {exc.kind}; give the TOML file") from None
    except OSError as exc:
        raise OptionError(f"--config {path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise OptionError(
            f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB; a config is a few "
            "key = value lines: give that file"
        )
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise OptionError(
            f"config file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise OptionError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise OptionError(
            f"config file {path} nests arrays or tables too deeply to read; a config is "
            "key = value lines with plain values: fix the file"
        ) from None


def config_toml(config: Any, *, omit: Collection[str] = ()) -> str:
    """`config`'s options as TOML, every section in full (an unset optional value, which TOML
    cannot hold, is a comment); `read_config_file` reads it back to the same config. The
    options named in `omit` (flat names) are left out, and a section left empty with them."""
    return _toml_of(config, (), frozenset(omit))


def write_config_file(dest: str, config: Any, *, omit: Collection[str] = ()) -> None:
    """Write `config` as TOML (`config_toml`) to `dest`, a path or URL: to a temp name in the
    same folder, then renamed, so the file appears whole or not at all."""
    storage.atomic_write_bytes(dest, config_toml(config, omit=omit).encode("utf-8"))


def _toml_of(config: Any, at: tuple[str, ...], omit: frozenset[str]) -> str:
    hints = typing.get_type_hints(type(config))
    plain: dict[str, Any] = {}
    unset: list[str] = []
    tables: list[str] = []  # a table option's own [section.name.KEY] tables
    sections: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if "help" in f.metadata and (f.metadata["name"] or f.name) not in omit:
            if value is None:
                unset.append(f"# {f.name} = (unset)\n")
            elif isinstance(value, Mapping):
                tables.append(tomli_w.dumps(_nested_under((*at, f.name), value)))
            else:
                plain[f.name] = value
        elif dataclasses.is_dataclass(hints[f.name]):
            sections.append(_toml_of(value, (*at, f.name), omit))
    body = tomli_w.dumps(plain) + "".join(unset)
    header = f"[{'.'.join(at)}]\n" if at and body else ""
    return "\n".join(text for text in [header + body, *tables, *sections] if text)


def _nested_under(at: tuple[str, ...], value: Mapping[str, Any]) -> dict[str, Any]:
    """`value` as the table at path `at` of a TOML document (``{"a": {"b": value}}``)."""
    table = dict(value)
    for part in reversed(at):
        table = {part: table}
    return table
