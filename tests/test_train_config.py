"""The trainer's configuration, batch plan and bad input: clear errors, exit code 2, no run."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dlpipe.cli import build_parser, main
from dlpipe.loading.config import LoaderConfig, WorkerSettings
from dlpipe.options import (
    OptionSpec,
    add_options,
    build_config,
    config_toml,
    given_options,
    option,
    option_specs,
    read_config_file,
    table_text,
)
from dlpipe.train.config import (
    ConfigError,
    DataConfig,
    TrainConfig,
    WorkerChoices,
    load_config,
    plan_batches,
)
from dlpipe.train.trainer import train_loader_config

TESTS = Path(__file__).resolve().parent


def _train_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["train"]
    return parser


def test_cli_flags_override_the_toml_file_which_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[data]\npath = "d"\n[run]\nepochs = 7\nbatch_size = 64\n[optim]\nlr = 1\n')
    config = load_config(str(path), {"run": {"epochs": 3}})
    assert (config.run.epochs, config.run.batch_size, config.optim.lr) == (3, 64, 1.0)
    resolved = config.resolved()
    assert resolved.optim.weight_decay == 1e-4 and resolved.run.out.endswith("d-resnet18")
    again = tmp_path / "again.toml"
    again.write_text(config_toml(resolved))
    assert load_config(str(again), {}) == resolved  # the written config repeats the run


@pytest.mark.parametrize(
    ("task", "dataset_task", "resolved_task", "model"),
    [
        ("auto", None, "classification", "resnet18"),
        ("auto", "detection", "detection", "fasterrcnn_mobilenet_v3_large_fpn"),
        ("auto", "segmentation", "segmentation", "deeplabv3_mobilenet_v3_large"),
        ("auto", "captioning", "classification", "resnet18"),
        ("detection", None, "detection", "fasterrcnn_mobilenet_v3_large_fpn"),
    ],
)
def test_the_task_and_model_default_to_the_datasets(
    task, dataset_task, resolved_task, model, tmp_path
) -> None:
    """``--task auto`` is the manifest's task (classification without one), ``--model auto``
    that task's model; the run folder is named after it and config.toml repeats both."""
    config = load_config(None, {"data": {"path": "d"}, "model": {"task": task}})
    resolved = config.resolved(dataset_task)
    assert (resolved.model.task, resolved.model.name) == (resolved_task, model)
    assert resolved.run.out.endswith(f"d-{model}")
    path = tmp_path / "config.toml"
    path.write_text(config_toml(resolved))
    assert load_config(str(path), {}).resolved("segmentation") == resolved


def test_a_task_is_one_of_the_trainers(capsys) -> None:
    with pytest.raises(ConfigError, match="classification, detection, segmentation"):
        load_config(None, {"data": {"path": "d"}, "model": {"task": "captioning"}})
    with pytest.raises(SystemExit) as stopped:
        main(["train", "d", "--task", "captioning"])
    assert stopped.value.code == 2 and "--task" in capsys.readouterr().err


def test_default_lr_scales_with_the_global_batch() -> None:
    sgd = load_config(None, {"data": {"path": "d"}, "run": {"batch_size": 512}}).resolved()
    adamw = load_config(
        None, {"data": {"path": "d"}, "optim": {"optimizer": "adamw"}, "run": {"batch_size": 1024}}
    ).resolved()
    assert sgd.optim.lr == pytest.approx(0.2) and adamw.optim.lr == pytest.approx(1e-3)
    assert adamw.optim.weight_decay == 0.05


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[run]\nepoch = 3\n", "unknown key 'run.epoch'; the keys there are epochs"),
        ("[runs]\nepochs = 3\n", "unknown key 'runs'"),
        ('[run]\nepochs = "3"\n', "run.epochs = '3': '3' is a str; give an int"),
        ("[run\n", "is not valid TOML"),
        ('[data]\ndecode = "gpu"\n', "decode = 'gpu': invalid choice: 'gpu'"),
        ("[data.loader]\nimage_size = 0\n", "image_size = 0: 0 is not an integer in 1..16384"),
        ("[data.loader]\nbatch_size = 8\n", "unknown key 'data.loader.batch_size'"),
        ("[data.workers]\nprefetch_factor = 0\n", "prefetch_factor = 0: 0 is not an integer"),
    ],
)
def test_a_bad_config_file_is_named_with_the_key_and_the_fix(tmp_path, text, message) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as info:
        load_config(str(path), {})
    assert str(path) in str(info.value)


# `config.toml` as the release before [data.loader] and [data.workers] wrote it: the loader and
# worker options as flat keys of [data]
OLD_CONFIG = """\
[data]
path = {data}
train_split = "train"
val_split = "val"
image_size = 16
min_crop_scale = 0.5
num_workers = 0
engine = "auto"
decode = "auto"
tune = "auto"

[model]
name = "trainer_models:tiny_cnn"
channels_last = false
compile = false

[optim]
optimizer = "sgd"
lr = 0.2
weight_decay = 0.0001
momentum = 0.9
warmup_epochs = 0.0
label_smoothing = 0.0
# clip_grad = (unset)

[run]
epochs = 1
batch_size = 16
precision = "auto"
out = {out}
resume = "auto"
seed = 0
keep_last = 2
checkpoint_every_steps = 0
log_every_steps = 20
max_nonfinite_steps = 20
dist_timeout_s = 600.0
# micro_batch = (unset)
# max_steps = (unset)
# early_stop_patience = (unset)
# wandb = (unset)
"""


def test_a_run_folder_config_of_the_flat_data_keys_still_resumes(
    make_dataset, tmp_path, capsys, monkeypatch
) -> None:
    """``dlpipe train --config RUN/config.toml`` on a file the previous release wrote: its
    [data] image_size, min_crop_scale and num_workers reach the loader; the run folder's
    config is rewritten in sections, and running it again finds the run complete."""
    monkeypatch.syspath_prepend(str(TESTS))
    out = tmp_path / "run"
    out.mkdir()
    old = out / "config.toml"
    old.write_text(
        OLD_CONFIG.format(data=json.dumps(make_dataset("lmdb")), out=json.dumps(str(out)))
    )
    config = load_config(str(old), {})
    assert (config.data.loader.image_size, config.data.loader.min_crop_scale) == (16, 0.5)
    assert config.data.workers.chosen() == {"num_workers": 0}
    assert main(["train", "--config", str(old)]) == 0
    printed = capsys.readouterr().out
    assert "num_workers=0" in printed and "given: --num-workers 0" in printed
    written = old.read_text()
    assert "[data.loader]\nimage_size = 16\nmin_crop_scale = 0.5\n" in written
    assert "[data.workers]\n" in written and "num_workers = 0\n" in written
    assert load_config(str(old), {}) == config.resolved()
    assert main(["train", "--config", str(old)]) == 0
    assert "already complete (1 epochs)" in capsys.readouterr().out


def _other(spec: OptionSpec) -> Any:
    """A valid value of `spec` other than its default (a list option's: a list of one)."""
    if spec.many:
        return (_other(dataclasses.replace(spec, many=False, default=None)),)
    if spec.table:  # a table option's: one entry
        return {"1": {"a": "b"}} if spec.table == 2 else {"a": "b"}
    if spec.choices:
        return next(c for c in spec.choices if c != spec.default)
    if spec.kind == "bool":
        return spec.default is not True
    if spec.kind == "int":
        return 1 if spec.default is None else spec.default + 1
    if spec.kind == "str":
        return "other"
    return 0.5 if spec.default is None else spec.default / 2


def _argv(spec: OptionSpec, value: Any) -> list[str]:
    if spec.kind == "bool":
        return [spec.flag if value else "--no-" + spec.flag[2:]]
    if spec.table:
        return [spec.flag, table_text(value)]
    return [spec.flag, *map(str, value)] if spec.many else [spec.flag, str(value)]


def test_every_loader_and_worker_option_reaches_the_trainer_by_flag_and_toml(tmp_path) -> None:
    """A new loader option is its field (made with `option`) and its consumer: no list in the
    trainer names it. Each `LoaderConfig` option and each `WorkerSettings` field, found by
    introspection, is a ``dlpipe train`` flag and a TOML key, in its section and as a flat
    [data] key, and reaches the `LoaderConfig` and the worker settings the trainer builds."""
    loader = {s.name: _other(s) for s in option_specs(LoaderConfig)}
    assert {"image_size", "min_crop_scale"} <= set(loader)
    workers = {s.name: _other(s) for s in option_specs(WorkerChoices)}
    assert set(workers) == {f.name for f in dataclasses.fields(WorkerSettings)}
    specs = {s.name: s for s in option_specs(TrainConfig)}
    argv = ["data"] + [a for n, v in (loader | workers).items() for a in _argv(specs[n], v)]
    from_flags = load_config(None, given_options(_train_parser().parse_args(argv), TrainConfig))
    sections = {"data": {"path": "data", "loader": loader, "workers": workers}}
    flat = {"data": {"path": "data", **loader, **workers}}
    for config in (from_flags, load_config(None, sections), load_config(None, flat)):
        made = train_loader_config(config, 8, "train")
        assert {name: getattr(made, name) for name in loader} == loader
        assert config.data.workers.chosen() == workers
        settings = WorkerSettings(**config.data.workers.chosen())  # its fields, checked
        assert {name: getattr(settings, name) for name in workers} == workers


def test_a_new_loader_option_needs_only_its_field_and_its_consumer(tmp_path) -> None:
    """A `LoaderConfig` with one more option field (here a subclass): ``dlpipe train``'s
    parser, its TOML and its resolved config file carry it, and the trainer's loader config
    holds it, with no change to the trainer or its config."""
    sharp = option("how much to sharpen", default=0.0)
    wider = dataclasses.make_dataclass(
        "Wider", [("sharpness", float, sharp)], bases=(LoaderConfig,), frozen=True, kw_only=True
    )
    loader = dataclasses.field(default_factory=wider)
    data = dataclasses.make_dataclass("Data", [("loader", wider, loader)], bases=(DataConfig,))
    config_class = dataclasses.make_dataclass(
        "Train", [("data", data, dataclasses.field(default_factory=data))], bases=(TrainConfig,)
    )
    parser = argparse.ArgumentParser()
    add_options(parser, config_class)
    given = given_options(parser.parse_args(["d", "--sharpness", "0.3"]), config_class)
    config = build_config(config_class, given)
    assert train_loader_config(config, 8, "train").sharpness == 0.3
    path = tmp_path / "config.toml"
    path.write_text(config_toml(config))
    table = '[data.loader]\nmin_crop_scale = 0.08\non_source_end = "cycle"\nsharpness = 0.3\n'
    assert table in path.read_text()
    assert read_config_file(str(path), config_class)["sharpness"] == 0.3


def test_the_train_parser_has_one_flag_per_option_and_only_those() -> None:
    actions = _train_parser()._actions
    specs = {s.name: s for s in option_specs(TrainConfig)}
    assert {a.dest for a in actions} - {"help", "config", "nproc_per_node"} == set(specs)
    for name, spec in specs.items():
        mine = [a for a in actions if a.dest == name]
        assert all(a.default is None for a in mine), name  # the defaults live in TrainConfig
        strings = [s for a in mine for s in a.option_strings]
        assert strings[:1] == ([spec.flag] if spec.flag.startswith("-") else [])
    renamed = ["--model", "--checkpoint-every", "--log-every", "--dist-timeout"]
    assert [specs[n].flag for n in ("model", "checkpoint_every_steps")] == renamed[:2]
    assert [specs[n].flag for n in ("log_every_steps", "dist_timeout_s")] == renamed[2:]
    assert specs["path"].flag == "data"  # the positional DATA


def test_a_loader_config_that_sets_what_the_trainer_sets_is_refused() -> None:
    config = TrainConfig()
    config.data.path = "d"
    config.data.loader = LoaderConfig(batch_size=32)
    with pytest.raises(ConfigError, match=r"data.loader.batch_size = 32 is set by the trainer"):
        config.resolved().validate()


def test_batch_plan_derives_micro_batch_and_accumulation() -> None:
    plan = plan_batches(256, 4, 32)
    assert (plan.micro_batch, plan.accumulation) == (32, 2)
    assert plan_batches(256, 4, None).accumulation == 1
    with pytest.raises(ConfigError, match="does not divide over 3 ranks"):
        plan_batches(256, 3, None)
    with pytest.raises(ConfigError, match="use a divisor of 64"):
        plan_batches(256, 4, 48)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no dataset given"),
        (["DATA", "--epochs", "0"], "run.epochs = 0 must be a positive integer"),
        (["DATA", "--resume", "nowhere.pt"], "--resume nowhere.pt: no such checkpoint"),
        (["DATA", "--config", "missing.toml"], "--config missing.toml: no such file"),
        (["DATA", "--batch-size", "10", "--micro-batch", "4"], "use a divisor of 10"),
        (["DATA", "--model", "resnet1"], "not a torchvision classification model"),
        (["DATA", "--model", "no_such_pkg:f"], "cannot import no_such_pkg"),
        (["DATA", "--label-smoothing", "1.5"], "label_smoothing = 1.5 must be in"),
        pytest.param(
            ["DATA", "--decode", "cuda"],
            "decode='cuda' needs a CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU machine"),
        ),
    ],
)
def test_bad_input_exits_2_with_one_error_line(
    args, message, make_dataset, tmp_path, capsys
) -> None:
    data = make_dataset("lmdb")
    argv = [data if a == "DATA" else a for a in args]
    code = main(["train", *argv, "--out", str(tmp_path / "run"), "--image-size", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_wandb_without_the_package_names_the_extra(make_dataset, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)
    args = ["--batch-size", "8", "--image-size", "16", "--wandb", "p"]
    code = main(["train", make_dataset("lmdb"), "--out", str(tmp_path / "r"), *args])
    assert code == 2 and "pip install 'dlpipe[wandb]'" in capsys.readouterr().err


def test_not_a_dataset_is_refused_before_training(tmp_path, capsys) -> None:
    code = main(["train", str(tmp_path), "--out", str(tmp_path / "run")])
    assert code == 2 and "dlpipe convert" in capsys.readouterr().err
