"""Config in every room: the CLI parsers agree with the config dataclasses, and TOML is TOML."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import pytest

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
    awkward = 'line one\nline "two"\\ and \'three\' \t ünïcødé ✓ \u2028'
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
