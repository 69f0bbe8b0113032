"""dlpipe train on datasets whose class names differ: a ``classes`` table per
``[[data.sources]]`` table (or ``--class-map``) maps them onto the first dataset's classes;
a class left unmapped, or mapped wrong, is one error line before anything is written; a
checkpoint resumes only with the class map it was trained with."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train import COLOURS, COMMON, _user_models, colour_samples, newest, records, write_colours

import dlpipe
from dlpipe.cli import main
from dlpipe.train.config import load_config

__all__ = ["_user_models"]  # the autouse fixture that makes tests/trainer_models importable

FRENCH = {"rouge": "red", "vert": "green", "bleu": "blue", "jaune": "yellow"}
B_CLASSES = ["jaune", "bleu", "vert", "rouge"]  # B's own names, in another order than A's
RIGHT = {"rouge": "red", "vert": "green", "bleu": "blue", "jaune": "yellow"}
WRONG = {"rouge": "blue", "vert": "yellow", "bleu": "red", "jaune": "green"}  # every one off


def write_french(path: Path, train: int = 32, val: int = 13) -> str:
    """Colour samples as `write_colours` makes them, labelled by `B_CLASSES`: a sample's label
    is the index of its colour's French name, so B's indices are not A's."""
    english = list(COLOURS)
    with dlpipe.DatasetWriter(out=str(path), format="lmdb", classes=B_CLASSES) as writer:
        for split, samples in (
            ("train", colour_samples(train, 3)),
            ("val", colour_samples(val, 4)),
        ):
            for sample in samples:
                colour = english[int(sample["cls"])]
                french = next(name for name, value in FRENCH.items() if value == colour)
                label = str(B_CLASSES.index(french)).encode()
                writer.write(split, {**sample, "__key__": f"b-{sample['__key__']}", "cls": label})
    return str(path)


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> tuple[str, str]:
    """A: 96 train samples named in English; B: 32 named in French; 13 val samples each."""
    root = tmp_path_factory.mktemp("classes")
    return write_colours(root / "a-lmdb", "lmdb"), write_french(root / "b-lmdb")


def sources_file(path: Path, a: str, b: str, classes: dict[str, str] | None) -> str:
    """A config of A and B as ``[[data.sources]]`` tables, B's with `classes` (None: none)."""
    pairs = ", ".join(f'{theirs} = "{ours}"' for theirs, ours in (classes or {}).items())
    table = "" if classes is None else f"classes = {{ {pairs} }}\n"
    path.write_text(f'[[data.sources]]\npath = "{a}"\n\n[[data.sources]]\npath = "{b}"\n{table}')
    return str(path)


def map_flag(classes: dict[str, str]) -> list[str]:
    return ["--class-map", "1:" + ",".join(f"{k}={v}" for k, v in classes.items())]


def test_a_classes_table_maps_another_datasets_names_and_the_run_learns_both(
    mix, tmp_path, capsys
) -> None:
    """B's labels reach the model as A's classes: the val split of both (half of it B's) is
    learned (a map with every class wrong scores 0.5 here)."""
    run, config = tmp_path / "run", sources_file(tmp_path / "mix.toml", *mix, RIGHT)
    assert main(["train", "--config", config, "--out", str(run), *COMMON, "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "class map 1:rouge=red,vert=green,bleu=blue,jaune=yellow" in out
    assert "| samples a-lmdb 96, b-lmdb 32" in out
    epochs = records(run, "epoch")
    assert [e["source_samples"] for e in epochs] == [[96, 32], [96, 32]]
    assert epochs[-1]["val_samples"] == 26
    assert epochs[-1]["top1"] >= 0.75, f"val top-1 {epochs[-1]['top1']} (chance is 0.25)"
    assert newest(run)["classes"] == list(COLOURS)  # the model's classes: the first dataset's
    again = load_config(str(run / "config.toml"), {})  # the resolved file keeps the map
    assert again.data.path == mix and again.data.loader.class_map == {"1": RIGHT}


def test_the_flag_the_table_and_the_loader_key_give_one_class_map(mix, tmp_path) -> None:
    from dlpipe.cli import build_parser
    from dlpipe.options import given_options
    from dlpipe.train.config import TrainConfig

    a, b = mix
    words = [
        "--class-map",
        "1:rouge=red,vert=green",
        "1:bleu=blue",
        "--class-map",
        "1:jaune=yellow",
    ]
    flags = given_options(build_parser().parse_args(["train", a, b, *words]), TrainConfig)
    loader_key = tmp_path / "loader.toml"
    loader_key.write_text(
        f'[data]\npath = ["{a}", "{b}"]\n\n[data.loader.class_map.1]\n'
        + "".join(f'{k} = "{v}"\n' for k, v in RIGHT.items())
    )
    configs = [
        load_config(None, flags),
        load_config(sources_file(tmp_path / "t.toml", a, b, RIGHT), {}),
        load_config(str(loader_key), {}),
    ]
    assert all(c == configs[0] for c in configs) and configs[0].data.loader.class_map == {
        "1": RIGHT
    }


def _error(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # the parser's own error
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            [],
            "b-lmdb has the class 'jaune', which the first dataset "
            "{a} lacks (red, green, blue, yellow), so its label is ambiguous; map it onto "
            'one of those: classes = { jaune = "CLASS" } in its [[data.sources]] table, or '
            "--class-map 1:jaune=CLASS",
        ),
        (
            map_flag({**RIGHT, "rose": "red"}),
            "maps 'rose', which is not a class of it (jaune, bleu, vert, rouge); map its own",
        ),
        (
            map_flag({**RIGHT, "rouge": "crimson"}),
            "maps 'rouge' onto 'crimson', which is not a class of the first dataset",
        ),
        (
            ["--class-map", "2:rouge=red"],
            "the class map names dataset '2', which is none of the 2 given; name a dataset by "
            "its number, 0..1",
        ),
        (["--class-map", "rouge=red"], "argument --class-map: 'rouge=red' is not KEY:NAME=VALUE"),
        (
            ["--class-map", "1:rouge=red", "1:rouge=blue"],
            "argument --class-map: 1:rouge is given 'red' and 'blue'; give it one value",
        ),
    ],
)
def test_a_class_that_does_not_map_is_one_error_line_and_nothing_written(
    mix, tmp_path, capsys, given, message
) -> None:
    a, b = mix
    run = tmp_path / "run"
    code, err = _error(["train", a, b, "--out", str(run), *COMMON, *given], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert message.replace("{a}", a) in err, err
    assert not run.exists()


def test_a_class_map_with_one_dataset_is_refused_as_the_other_mixing_options(
    mix, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    argv = ["train", mix[0], "--out", str(run), *COMMON, "--class-map", "1:rouge=red"]
    code, err = _error(argv, capsys)
    assert code == 2 and err.count("\n") == 1
    assert "--class-map 1:rouge=red mixes several datasets, but one was given" in err
    assert not run.exists()


def test_a_wrong_classes_table_in_the_config_file_is_one_error_line(mix, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    config = tmp_path / "mix.toml"
    config.write_text(
        f'[[data.sources]]\npath = "{mix[0]}"\n\n[[data.sources]]\npath = "{mix[1]}"\n'
        "classes = { rouge = 1 }\n"
    )
    code, err = _error(["train", "--config", str(config), "--out", str(run), *COMMON], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"config file {config}: data.sources table 2: classes = " in err
    assert 'is not a table of class names; write classes = { kitty = "cat" }' in err
    sources_file(config, *mix, {**RIGHT, "rose": "red"})
    code, err = _error(["train", "--config", str(config), "--out", str(run), *COMMON], capsys)
    assert code == 2 and "classes in [[data.sources]] table 2" in err and "'rose'" in err
    assert not run.exists()


def test_a_checkpoint_resumes_only_with_its_class_map(mix, tmp_path, capsys) -> None:
    """Another class map changes the labels the model learned: refused, naming both maps
    (and nothing trained); the same map goes on to the end."""
    run = tmp_path / "run"
    args = ["train", *mix, "--out", str(run), *COMMON, "--epochs", "1"]
    assert main([*args, *map_flag(RIGHT), "--max-steps", "3"]) == 0
    assert newest(run)["config"]["data"]["loader"]["class_map"] == {"1": RIGHT}
    capsys.readouterr()
    code, err = _error([*args, *map_flag(WRONG)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "was trained with --class-map 1:rouge=red,vert=green,bleu=blue,jaune=yellow" in err
    assert "this run gives --class-map 1:rouge=blue,vert=yellow,bleu=red,jaune=green" in err
    assert "resume with --class-map 1:rouge=red,vert=green,bleu=blue,jaune=yellow" in err
    assert newest(run)["step"] == 3  # nothing trained
    assert main([*args, *map_flag(RIGHT)]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert newest(run)["step"] == 8 and records(run, "epoch")[0]["source_samples"] == [96, 32]
