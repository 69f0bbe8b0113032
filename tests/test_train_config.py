"""The trainer's configuration, batch plan and bad input: clear errors, exit code 2, no run."""

from __future__ import annotations

import pytest
import torch

from dlpipe.cli import main
from dlpipe.train.config import ConfigError, load_config, plan_batches, to_toml


def test_cli_flags_override_the_toml_file_which_overrides_defaults(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[data]\npath = "d"\n[run]\nepochs = 7\nbatch_size = 64\n[optim]\nlr = 1\n')
    config = load_config(str(path), {"run": {"epochs": 3}})
    assert (config.run.epochs, config.run.batch_size, config.optim.lr) == (3, 64, 1.0)
    resolved = config.resolved()
    assert resolved.optim.weight_decay == 1e-4 and resolved.run.out.endswith("d-resnet18")
    again = tmp_path / "again.toml"
    again.write_text(to_toml(resolved))
    assert load_config(str(again), {}) == resolved  # the written config repeats the run


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
        ("[run]\nepoch = 3\n", "[run] has no key 'epoch'; keys are epochs"),
        ("[runs]\nepochs = 3\n", "unknown section [runs]"),
        ('[run]\nepochs = "3"\n', "[run] epochs = '3' must be int"),
        ("[run\n", "is not valid TOML"),
    ],
)
def test_a_bad_config_file_is_named_with_the_key_and_the_fix(tmp_path, text, message) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(str(path), {})


def test_a_decode_device_from_a_config_file_is_checked(tmp_path) -> None:
    path = tmp_path / "gpu.toml"
    path.write_text('[data]\npath = "d"\ndecode = "gpu"\n')
    with pytest.raises(ConfigError, match="data.decode = 'gpu' must be auto, cpu or cuda"):
        load_config(str(path), {}).validate()


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
