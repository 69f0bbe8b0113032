"""The one config → CLI/TOML mechanism (`dlpipe.options`): a field's flag, TOML key and Python
keyword reach the same value by the same rule; ``--config`` then a flag; the resolved file."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

import pytest

import dlpipe
from dlpipe.options import (
    Checked,
    OptionError,
    OptionSpec,
    add_config_flag,
    add_options,
    build_config,
    config_from_args,
    config_toml,
    int_in_range,
    option,
    option_specs,
    read_config_file,
    table_text,
)


@dataclass(frozen=True, kw_only=True)
class Inner(Checked):
    image_col: str | None = option("the image column", default=None)
    quality: int = option("quality 1..100", default=95, parse=int_in_range(1, 100))
    strict: bool = option("be strict", default=True)


@dataclass(frozen=True, kw_only=True)
class Outer(Checked):
    data: str = option("the data", flag="data")
    kind: str = option("what kind", default="auto", choices=("auto", "a", "b"), name="source")
    rate: float = option("a rate", default=0.5)
    hidden: int = option("TOML and Python only", default=3, flag="")
    inner: Inner = field(default_factory=Inner)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_options(parser, Outer)
    add_config_flag(parser)
    return parser


def _resolved(argv: list[str]) -> Outer:
    return config_from_args(_parser().parse_args(argv), Outer)


def test_specs_walk_the_nesting_with_flat_names_and_attribute_paths() -> None:
    specs = {s.name: s for s in option_specs(Outer)}
    assert list(specs) == ["data", "source", "rate", "hidden", "image_col", "quality", "strict"]
    assert specs["image_col"].path == ("inner", "image_col")
    assert specs["image_col"].flag == "--image-col" and specs["image_col"].optional
    assert specs["source"].path == ("kind",) and specs["source"].flag == "--source"
    assert specs["data"].flag == "data" and specs["hidden"].flag == ""
    assert (specs["rate"].kind, specs["strict"].kind, specs["quality"].kind) == (
        "float",
        "bool",
        "int",
    )


def test_defaults_file_and_flags_in_that_order(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('source = "a"\nhidden = 7\n[inner]\nquality = 50\nstrict = false\n')
    assert _resolved(["d"]) == Outer(data="d")
    from_file = _resolved(["d", "--config", str(path)])
    assert (from_file.kind, from_file.hidden, from_file.inner.quality) == ("a", 7, 50)
    assert from_file.inner.strict is False
    flagged = _resolved(["d", "--config", str(path), "--quality", "60", "--strict"])
    assert (flagged.kind, flagged.inner.quality, flagged.inner.strict) == ("a", 60, True)
    assert _resolved(["d", "--no-strict"]).inner.strict is False


@pytest.mark.parametrize(
    ("flags", "toml", "keywords"),
    [
        (["--quality", "0"], "[inner]\nquality = 0\n", {"quality": 0}),
        (["--source", "c"], 'source = "c"\n', {"source": "c"}),
    ],
)
def test_a_flag_a_toml_key_and_a_keyword_break_one_rule_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, toml, keywords
) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["d", *flags])
    cli_rule = capsys.readouterr().err.rsplit(": ", 1)[-1].strip()
    (tmp_path / "c.toml").write_text(toml)
    with pytest.raises(OptionError) as from_file:
        read_config_file(str(tmp_path / "c.toml"), Outer)
    with pytest.raises(OptionError) as from_python:
        build_config(Outer, {"data": "d", **keywords})
    assert cli_rule in str(from_file.value) and cli_rule in str(from_python.value)
    assert str(tmp_path / "c.toml") in str(from_file.value)


def test_a_direct_constructor_keeps_the_rule() -> None:
    with pytest.raises(OptionError, match=r"argument --quality: 101 is not an integer in 1\.\.100"):
        Inner(quality=101)
    with pytest.raises(OptionError, match="argument --quality: '9' is a str; give an int"):
        Inner(quality="9")  # type: ignore[arg-type]


def test_a_typo_key_is_refused_naming_it_and_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[inner]\nqualty = 5\n")
    with pytest.raises(OptionError, match=r"unknown key 'inner\.qualty'; .* image_col, quality"):
        read_config_file(str(path), Outer)
    path.write_text("[innr]\nquality = 5\n")
    with pytest.raises(OptionError, match=r"unknown key 'innr'.*\[inner\]"):
        read_config_file(str(path), Outer)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"quality = ", "is not valid TOML"),
        (b"\xff\xfe", "is not UTF-8"),
        (b"# x\n" * (1 << 19), "is over 1 MiB"),
    ],
)
def test_a_bad_file_is_one_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    with pytest.raises(OptionError, match=message):
        read_config_file(str(path), Outer)
    with pytest.raises(OptionError, match="no such file"):
        read_config_file(str(tmp_path / "none.toml"), Outer)


def test_the_resolved_config_round_trips(tmp_path: Path) -> None:
    config = build_config(Outer, {"data": "d", "source": "b", "rate": 2, "image_col": "p"})
    assert config.rate == 2.0 and isinstance(config.rate, float)
    path = tmp_path / "resolved.toml"
    path.write_text(config_toml(config))
    assert build_config(Outer, read_config_file(str(path), Outer)) == config
    unset = build_config(Outer, {"data": "d"})
    assert "# image_col = (unset)" in config_toml(unset)
    path.write_text(config_toml(unset))
    assert build_config(Outer, read_config_file(str(path), Outer)) == unset


def test_unknown_and_missing_keywords_are_named() -> None:
    with pytest.raises(OptionError, match="'qualty' is not an option; the options are data, "):
        build_config(Outer, {"data": "d", "qualty": 3})
    with pytest.raises(OptionError, match="the argument data is required"):
        build_config(Outer, {})


# --- every command, as a user runs it ---------------------------------------------------------


def _commands() -> dict[str, type]:
    from dlpipe.bench_config import BenchLoaderConfig
    from dlpipe.converters.config import ConvertConfig
    from dlpipe.demo import DemoConfig

    return {"convert": ConvertConfig, "bench-loader": BenchLoaderConfig, "demo": DemoConfig}


COMMANDS = ["convert", "bench-loader", "demo"]
REQUIRED = {"raw": "raw", "to": "wds", "data": "data"}
GOOD = {"label_from": "name-prefix", "val_fraction": 0.5, "max_side": 8}
BAD: dict[str, list[Any]] = {"int": [0, -1], "float": [0.0, -1.0, 2.0], "str": ["no-such"]}


def _subparser(command: str) -> argparse.ArgumentParser:
    from dlpipe.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[command]
    return parser


def _good(spec: OptionSpec) -> Any:
    if spec.name in GOOD:
        return GOOD[spec.name]
    if spec.kind == "bool":
        return not spec.default
    if spec.choices:
        return spec.choices[-1]
    if spec.default not in (MISSING, None):
        return spec.default
    return {"int": 9, "float": 0.5, "str": "x.png"}[spec.kind]


def _argv(command: str, spec: OptionSpec, value: Any) -> list[str]:
    required = []
    for other in option_specs(_commands()[command]):
        if other.default is MISSING and other.name != spec.name:
            flag = [other.flag] if other.flag.startswith("--") else []
            required += [*flag, REQUIRED[other.name]]
    if isinstance(value, bool):
        return [*required, spec.flag if value else "--no-" + spec.flag[2:]]
    return [*required, spec.flag, str(value)]


def _toml(spec: OptionSpec, value: Any) -> str:
    import tomli_w

    table: dict[str, Any] = {spec.attr: value}
    for part in reversed(spec.path[:-1]):
        table = {part: table}
    return tomli_w.dumps(table)


def _reached(config: Any, spec: OptionSpec) -> Any:
    for part in spec.path:
        config = getattr(config, part)
    return config


def _flagged(command: str) -> list[tuple[str, OptionSpec]]:
    return [
        (command, spec)
        for spec in option_specs(_commands()[command])
        if spec.flag.startswith("--") and not (spec.kind == "bool" and spec.default)
    ]


def _cases() -> list[Any]:
    from dlpipe.turbojpeg import region_library

    no_region = pytest.mark.skipif(region_library() is None, reason="needs TurboJPEG 3")
    return [
        pytest.param(
            c, s, id=f"{c}:{s.name}", marks=[no_region] if s.name == "seekable_jpeg" else []
        )
        for command in COMMANDS
        for c, s in _flagged(command)
    ]


@pytest.mark.parametrize(("command", "spec"), _cases())
def test_a_flag_a_toml_key_and_a_keyword_reach_the_same_field(
    tmp_path: Path, command: str, spec: OptionSpec
) -> None:
    cls, value = _commands()[command], _good(spec)
    required = {s.name: REQUIRED[s.name] for s in option_specs(cls) if s.default is MISSING}
    args = _subparser(command).parse_args(_argv(command, spec, value))
    from_flag = config_from_args(args, cls)
    path = tmp_path / "c.toml"
    path.write_text(_toml(spec, value))
    from_file = build_config(cls, {**required, **read_config_file(str(path), cls)})
    from_python = build_config(cls, {**required, spec.name: value})
    assert _reached(from_flag, spec) == _reached(from_file, spec) == _reached(from_python, spec)
    assert _reached(from_python, spec) == value
    assert from_flag == from_file == from_python


def _bad(spec: OptionSpec) -> Any:
    return next((v for v in BAD.get(spec.kind, []) if spec.problem(v) is not None), None)


@pytest.mark.parametrize(
    ("command", "spec"), [c for c in _cases() if _bad(c.values[1]) is not None]
)
def test_a_bad_value_gets_one_message_from_the_flag_the_file_and_python(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, spec: OptionSpec
) -> None:
    cls, value = _commands()[command], _bad(spec)
    problem = spec.problem(value)
    assert problem is not None
    with pytest.raises(SystemExit):
        _subparser(command).parse_args(_argv(command, spec, value))
    assert f"argument {spec.flag}: {problem}" in capsys.readouterr().err
    path = tmp_path / "c.toml"
    path.write_text(_toml(spec, value))
    with pytest.raises(OptionError, match=re.escape(problem)):
        read_config_file(str(path), cls)
    required = {s.name: REQUIRED[s.name] for s in option_specs(cls) if s.default is MISSING}
    with pytest.raises(OptionError, match=re.escape(f"argument {spec.flag}: {problem}")):
        build_config(cls, {**required, spec.name: value})


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_config_and_generated_flags_that_default_to_not_given(
    command: str,
) -> None:
    actions = {a.dest: a for a in _subparser(command)._actions if a.dest != "help"}
    specs = {s.name: s for s in option_specs(_commands()[command])}
    assert set(actions) == {*specs, "config"}
    assert all(a.default is None for a in actions.values())


def test_dlpipe_convert_reads_a_config_file_and_writes_the_resolved_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlpipe.cli import main
    from dlpipe.converters.config import ConvertConfig
    from dlpipe.dataset_names import CONVERT_CONFIG_NAME as CONFIG_NAME
    from dlpipe.synthetic import split_samples, write_imagefolder

    raw, out = tmp_path / "raw", tmp_path / "out"
    write_imagefolder(str(raw), list(split_samples(2, seed=0)))
    raw = raw / "train"  # 2 per class leave val empty: train/ holds the classes
    config = tmp_path / "c.toml"
    config.write_text(
        f'to = "lmdb"\nout = "{out}"\n[images]\nquality = 70\n[engine]\nworkers = 1\n'
    )
    assert main(["convert", str(raw), "--config", str(config), "--quality", "80"]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.format == "lmdb" and manifest.options["quality"] == 80  # the flag wins
    written = out / CONFIG_NAME
    text = written.read_text()
    assert "[engine]" not in text and "out =" not in text and "resume" not in text  # the run's
    again = build_config(ConvertConfig, read_config_file(str(written), ConvertConfig))
    assert (again.raw, again.to, again.images.quality) == (str(raw), "lmdb", 80)
    assert again == ConvertConfig.from_options(str(raw), "lmdb", quality=80)
    assert dlpipe.verify_dataset(str(out)).ok
    config.write_text('to = "lmdb"\n[images]\nqualty = 70\n')
    assert main(["convert", str(raw), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'images.qualty'" in err and "quality" in err


@pytest.mark.slow
def test_dlpipe_bench_loader_reads_a_config_file_and_writes_the_resolved_one(
    make_dataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import json
    import os

    from dlpipe.bench_config import BenchLoaderConfig
    from dlpipe.cli import main
    from dlpipe.dataset_names import BENCH_CONFIG_NAME

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = make_dataset("lmdb")
    config = tmp_path / "b.toml"
    config.write_text("budget = 1\nmax_workers = 0\nbatch_size = 4\nimage_size = 64\n")
    assert (
        main(["bench-loader", data, "--config", str(config), "--image-size", "16", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["config"] == os.path.join(data, BENCH_CONFIG_NAME)  # beside the profile
    again = build_config(BenchLoaderConfig, read_config_file(report["config"], BenchLoaderConfig))
    assert (again.data, again.budget, again.batch_size, again.image_size) == (data, 1.0, 4, 16)
    config.write_text("batch_sise = 4\n")
    assert main(["bench-loader", data, "--config", str(config)]) == 2
    assert "unknown key 'batch_sise'" in capsys.readouterr().err


# --- list options: a field typed tuple[K, ...] ---------------------------------------------


@dataclass(kw_only=True)
class Listed(Checked):
    paths: tuple[str, ...] = option("the datasets", default=(), flag="data")
    weights: tuple[float, ...] | None = option(
        "one per dataset", default=None, parse=dlpipe.options.non_negative_float
    )
    sizes: tuple[int, ...] = option("sizes", default=(1, 2), parse=int_in_range(1, 9))


def _listed(argv: list[str]) -> Listed:
    parser = argparse.ArgumentParser()
    add_options(parser, Listed)
    add_config_flag(parser)
    return config_from_args(parser.parse_args(argv), Listed)


def test_a_list_option_is_words_or_commas_an_array_and_a_tuple_or_list(tmp_path: Path) -> None:
    words = _listed(["A", "B", "--weights", "0.7", "0.3", "--sizes", "3"])
    assert words == _listed(["A", "B", "--weights", "0.7,0.3", "--sizes", "3"])
    assert words == Listed(paths=["A", "B"], weights=[0.7, 0.3], sizes=[3])  # type: ignore[arg-type]
    assert (words.paths, words.weights, words.sizes) == (("A", "B"), (0.7, 0.3), (3,))
    path = tmp_path / "c.toml"
    path.write_text('paths = ["A", "B"]\nweights = [0.7, 0.3]\nsizes = [3]\n')
    assert build_config(Listed, read_config_file(str(path), Listed)) == words
    path.write_text(config_toml(words))
    assert 'paths = [\n    "A",\n    "B",\n]' in path.read_text()  # written back as arrays
    assert build_config(Listed, read_config_file(str(path), Listed)) == words


def test_one_value_alone_is_a_list_of_one_and_a_list_left_out_keeps_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.toml"
    path.write_text('paths = "A"\nsizes = 4\n')  # as a file written before the option was a list
    from_file = _listed(["--config", str(path)])  # no DATA words: the file's stand
    assert (from_file.paths, from_file.sizes) == (("A",), (4,))
    assert Listed(paths="A").paths == ("A",)  # type: ignore[arg-type]
    assert _listed(["B", "--config", str(path)]).paths == ("B",)  # the words given win
    assert _listed([]) == Listed()


@pytest.mark.parametrize(
    ("flags", "toml", "keywords", "rule"),
    [
        (["--sizes", "3,10"], "sizes = [3, 10]", [3, 10], "10 is not an integer in 1..9"),
        (["--weights", "1", "-2"], "weights = [1, -2]", [1, -2], "-2 is not a finite number"),
    ],
)
def test_each_item_of_a_list_option_keeps_the_rule_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags, toml, keywords, rule
) -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, Listed)
    with pytest.raises(SystemExit):
        parser.parse_args(flags)
    assert f"argument {flags[0]}: {rule}" in capsys.readouterr().err
    (tmp_path / "c.toml").write_text(toml + "\n")
    with pytest.raises(OptionError, match=re.escape(rule)):
        read_config_file(str(tmp_path / "c.toml"), Listed)
    name = flags[0][2:]
    with pytest.raises(OptionError, match=rf"argument {flags[0]}: item 2 of .*{re.escape(rule)}"):
        build_config(Listed, {name: keywords})
    with pytest.raises(OptionError, match="'x' is a str; give an int or a list of ints"):
        build_config(Listed, {"sizes": ["x"]})


def test_a_list_of_another_kind_is_not_an_option() -> None:
    for hint in ("tuple[bool, ...]", "tuple[str, int]", "list[str]"):
        cls = type("Bad", (), {"__annotations__": {"items": hint}, "items": option("x")})
        with pytest.raises(TypeError, match="nor a tuple"):
            option_specs(dataclass(cls))


# --- table options: a field typed Mapping[str, str] or Mapping[str, Mapping[str, str]] -----


@dataclass(frozen=True, kw_only=True)
class Mapped(Checked):
    renames: Mapping[str, str] | None = option("old name=new name", default=None)
    class_map: Mapping[str, Mapping[str, str]] | None = option("per source", default=None)
    inner: Inner = field(default_factory=Inner)


def _mapped(argv: list[str]) -> Mapped:
    parser = argparse.ArgumentParser()
    add_options(parser, Mapped)
    add_config_flag(parser)
    return config_from_args(parser.parse_args(argv), Mapped)


def test_a_table_option_is_flag_words_a_toml_table_and_a_mapping(tmp_path: Path) -> None:
    words = _mapped(
        [
            "--renames",
            "a=b,c=d",
            "--class-map",
            "1:kitty=cat",
            "2:x=y",
            "--class-map",
            "1:big cat=cat",
        ]
    )
    wanted = {"1": {"kitty": "cat", "big cat": "cat"}, "2": {"x": "y"}}
    assert words == Mapped(renames={"a": "b", "c": "d"}, class_map=wanted)
    assert words.class_map == wanted and type(words.class_map) is dict
    path = tmp_path / "c.toml"
    path.write_text(
        'renames = { a = "b", c = "d" }\n[class_map]\n1 = { kitty = "cat", "big cat" = "cat" }\n'
        '2 = { x = "y" }\n'
    )
    assert build_config(Mapped, read_config_file(str(path), Mapped)) == words
    path.write_text(config_toml(words))
    written = path.read_text()
    assert '[class_map.1]\nkitty = "cat"\n"big cat" = "cat"\n' in written
    assert written.index("[class_map.2]") < written.index("[inner]")  # before the sections
    assert build_config(Mapped, read_config_file(str(path), Mapped)) == words
    assert table_text(words.class_map) == "1:kitty=cat,big cat=cat 2:x=y"


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ({"1": "cat"}, "at '1': 'cat' is a str; give a table of names"),
        ({"1": {"kitty": 3}}, "at '1': at 'kitty': 3 is an int; give a str"),
        ("1:kitty=cat", "'1:kitty=cat' is a str; give a table of tables of names or None"),
    ],
)
def test_a_table_of_the_wrong_shape_is_one_message_from_the_file_and_python(
    tmp_path: Path, value: Any, rule: str
) -> None:
    with pytest.raises(OptionError, match=re.escape(f"argument --class-map: {rule}")):
        Mapped(class_map=value)
    path = tmp_path / "c.toml"
    path.write_text(f"class_map = {_toml_value(value)}\n")
    with pytest.raises(OptionError, match=re.escape(rule)):
        read_config_file(str(path), Mapped)


def _toml_value(value: Any) -> str:
    import tomli_w

    return tomli_w.dumps({"v": [value]})[len("v = [\n    ") : -len(",\n]\n")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--class-map", "kitty=cat"], "'kitty=cat' is not KEY:NAME=VALUE"),
        (["--class-map", "1:kitty"], "'1:kitty' is not KEY:NAME=VALUE"),
        (["--renames", "a"], "'a' is not NAME=VALUE"),
        (["--class-map", "1:a=b", "--class-map", "1:a=c"], "1:a is given 'b' and 'c'; give it one"),
    ],
)
def test_a_bad_table_flag_is_the_parsers_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        _mapped(argv)
    err = capsys.readouterr().err
    assert f"argument {argv[0]}: {message}" in err, err


def test_a_table_of_another_kind_is_not_an_option() -> None:
    for hint in (
        "Mapping[str, int]",
        "Mapping[int, str]",
        "Mapping[str, Mapping[str, Mapping[str, str]]]",
    ):
        cls = type("Bad", (), {"__annotations__": {"items": hint}, "items": option("x")})
        cls.__module__ = __name__
        with pytest.raises(TypeError, match="nor a Mapping"):
            option_specs(dataclass(cls))
