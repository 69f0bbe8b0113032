"""Config in every room: the CLI parsers agree with the config dataclasses, and TOML is TOML."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from dlpipe.cli import build_parser
from dlpipe.train.config import TrainConfig, load_config, to_toml

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
    path.write_text(to_toml(config), encoding="utf-8")
    tomllib.loads(path.read_text(encoding="utf-8"))  # valid TOML
    again = load_config(str(path), {})
    assert again.data.path == awkward and again.data.train_split == awkward
    assert again.run.out == awkward
    assert again.to_dict() == config.to_dict()


def test_unset_train_options_are_comments_and_read_back_as_unset(tmp_path) -> None:
    config = TrainConfig().resolved()
    text = to_toml(config)
    assert "# max_steps = (unset)" in text and "# num_workers = (unset)" in text
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(str(path), {}).to_dict() == config.to_dict()


def test_the_convert_parser_has_one_flag_per_option_with_its_default() -> None:
    from dlpipe.converters.config import option_specs
    from dlpipe.unfinished import CONVERT_OPTION_FLAGS

    actions = {a.dest: a for a in _subparser("convert")._actions if a.dest != "help"}
    specs = {spec.name: spec for spec in option_specs()}
    assert set(actions) == set(specs)
    for name, spec in specs.items():
        action = actions[name]
        assert action.option_strings == ([spec.flag] if spec.flag.startswith("-") else [])
        if spec.default is not dataclasses.MISSING:
            assert action.default == spec.default, name
    repeated = {name: spec.flag for name, spec in specs.items() if spec.repeated}
    assert repeated == CONVERT_OPTION_FLAGS  # the resume hints' allowlist names real options
    assert specs["shard_bytes"].flag == "--shard-size" and specs["source"].group == "source"


def test_a_printed_convert_command_parses_back_to_the_same_config(tmp_path) -> None:
    from dlpipe.converters.config import ConvertConfig, option_specs

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
    options = {spec.name: getattr(args, spec.name) for spec in option_specs()}
    again = ConvertConfig.from_options(**{**options, "workers": 1, "overwrite": False})
    assert again == config
    assert args.overwrite and "--workers" not in argv  # workers do not shape the output


def test_the_train_parser_has_one_flag_per_config_field_of_its_type() -> None:
    from dlpipe.train.command import config_flags

    actions = {a.dest: a for a in _subparser("train")._actions}
    flags = config_flags()
    assert set(actions) - {"help", "config", "nproc_per_node"} == set(flags)
    defaults = TrainConfig().to_dict()
    for dest, (section, key) in flags.items():
        action = actions[dest]
        assert action.default is None, dest  # "not given": the defaults live in TrainConfig
        field = next(
            f for f in dataclasses.fields(getattr(TrainConfig(), section)) if f.name == key
        )
        kinds = str(field.type).replace(" ", "").split("|")
        if "bool" in kinds:
            assert action.const is True, dest
        elif isinstance(action.choices, list):
            assert defaults[section][key] in action.choices, dest
        else:
            wanted = {"int": int, "float": float, "str": None}[kinds[0]]
            assert action.type is wanted, (dest, action.type, kinds)
