"""Config in every room: the CLI parsers agree with the config dataclasses, and TOML is TOML."""

from __future__ import annotations

import argparse
import sys

import pytest

from dlpipe.cli import build_parser
from dlpipe.converters.config import ConvertConfig
from dlpipe.options import OptionError, config_toml, read_config_file
from dlpipe.train.config import TrainConfig, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[name]
    return parser


def test_config_toml_round_trips_strings_with_newlines_quotes_backslashes_unicode(
    tmp_path,
) -> None:
    awkward = "line one\nline \"two\"\\ and 'three' \t ünïcødé ✓ \u2028"
    config = load_config(
        None, {"data": {"path": awkward, "train_split": awkward}, "run": {"out": awkward}}
    ).resolved()
    path = tmp_path / "config.toml"
    path.write_text(config_toml(config), encoding="utf-8")
    tomllib.loads(path.read_text(encoding="utf-8"))  # valid TOML
    again = load_config(str(path), {})
    assert again.data.path == (awkward,) and again.data.train_split == awkward
    assert again.run.out == awkward
    assert again.to_dict() == config.to_dict()


def test_unset_train_options_are_comments_and_read_back_as_unset(tmp_path) -> None:
    config = TrainConfig().resolved()
    text = config_toml(config)
    assert "# max_steps = (unset)" in text and "# num_workers = (unset)" in text
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(str(path), {}).to_dict() == config.to_dict()


def test_the_convert_parser_has_one_flag_per_option_with_its_default() -> None:
    from dlpipe.converters.config import option_specs
    from dlpipe.unfinished import CONVERT_OPTION_FLAGS

    actions = {a.dest: a for a in _subparser("convert")._actions if a.dest != "help"}
    specs = {spec.name: spec for spec in option_specs()}
    assert set(actions) == {*specs, "config"}
    for name, spec in specs.items():
        action = actions[name]
        assert action.option_strings == ([spec.flag] if spec.flag.startswith("-") else [])
        assert action.default is None, name  # "not given": the defaults live in the config
    flags = {name: spec.flag for name, spec in specs.items() if name in CONVERT_OPTION_FLAGS}
    assert flags == CONVERT_OPTION_FLAGS  # the resume hints' allowlist names real options
    assert specs["shard_bytes"].flag == "--shard-size"
    assert specs["source"].path == ("source", "kind")


def test_a_printed_convert_command_parses_back_to_the_same_config(tmp_path) -> None:
    from dlpipe.converters.config import ConvertConfig
    from dlpipe.options import given_options

    config = ConvertConfig.from_options(
        str(tmp_path / "raw dir"),
        "wds",
        out=str(tmp_path / "out"),
        quality=80,
        shard_bytes=1 << 20,
        val_fraction=0.25,
        keep_empty_classes=True,
        key_col="id",
        on_error="fail",
        workers=1,
    )
    import shlex

    argv = shlex.split(config.command("--overwrite"))[1:]
    args = build_parser().parse_args(argv)
    options = given_options(args, ConvertConfig)
    again = ConvertConfig.from_options(**{**options, "workers": 1, "overwrite": False})
    assert again == config
    assert args.overwrite and "--workers" not in argv  # workers do not shape the output


@pytest.mark.parametrize(
    ("text", "expected"), [('"256MB"', 256 * 1000**2), ('"1GiB"', 1 << 30), ("1048576", 1 << 20)]
)
def test_a_size_in_a_config_file_is_read_as_the_flag_reads_it(tmp_path, text, expected) -> None:
    path = tmp_path / "convert.toml"
    path.write_text(f"[shards]\nshard_bytes = {text}\n")
    assert read_config_file(str(path), ConvertConfig)["shard_bytes"] == expected


@pytest.mark.parametrize("text", ['"lots"', '"-5MB"', '""'])
def test_a_bad_size_text_in_a_config_file_is_one_named_error(tmp_path, text) -> None:
    path = tmp_path / "convert.toml"
    path.write_text(f"[shards]\nshard_bytes = {text}\n")
    with pytest.raises(OptionError, match=r"convert\.toml: shards\.shard_bytes = "):
        read_config_file(str(path), ConvertConfig)
