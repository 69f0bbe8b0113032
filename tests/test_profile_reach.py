"""Profiles reach training: the nearest saved profile of this machine, else a short tune.

``dlpipe bench-loader`` with its defaults (batch 64, 224 px), then ``dlpipe train`` at another
batch and image size trains on that profile and its loader line says which and why; with no
profile, ``--tune auto`` tunes on the run's first batches and saves the result (the next run
uses it without tuning), ``--tune off`` says it runs the defaults; another machine's profile is
never used. No test here depends on how fast the machine is: what is asserted is which settings
were chosen and what the line says, never a rate.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import TESTS, write_colours

import dlpipe
from dlpipe.cli import main
from dlpipe.loading import profile as profiles
from dlpipe.loading import tune, tune_search, tune_stages
from dlpipe.loading.config import LoaderConfig, WorkerSettings
from dlpipe.loading.profile import LoaderProfile, ProfileError, nearest_profile, save_profile

TRAIN = ["--model", "trainer_models:tiny_cnn", "--epochs", "1", "--max-steps", "1"]
TRAIN += ["--val-split", "", "--lr", "0.1", "--warmup-epochs", "0"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch) -> None:
    """Its own user cache (no profile of the real one is found) and the test models."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setattr(tune, "QUICK_TUNE_S", 1.0)  # the shortest search: one trial an engine


@pytest.fixture
def data(tmp_path) -> str:
    """96 train samples: one batch of bench-loader's default 64."""
    return write_colours(tmp_path / "colours-lmdb", "lmdb", train=96, val=13)


def _saved(data: str) -> list[dict]:
    path = Path(data) / profiles.PROFILES_NAME
    return json.loads(path.read_text())["profiles"] if path.exists() else []


def _train(data: str, out: Path, capsys, *extra: str) -> str:
    capsys.readouterr()
    code = main(["train", data, "--out", str(out), *TRAIN, *extra])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return printed.out


def _loader_line(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("train loader ")]
    return line


# --- the user's path ------------------------------------------------------------------------


def test_bench_loader_defaults_then_train_at_another_size_uses_that_profile_and_says_so(
    data, tmp_path, capsys, caplog
) -> None:
    assert main(["bench-loader", data, "--budget", "2", "--max-workers", "2"]) == 0
    (measured,) = _saved(data)
    assert (measured["loader"]["batch_size"], measured["loader"]["image_size"]) == (64, 224)
    settings = LoaderProfile.from_json(measured).settings.line()
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "32", "--image-size", "32")
    assert _loader_line(out) == (
        f"train loader {settings} (profile measured at batch 64, 224 px on this machine; "
        "nearest to batch 32, 32 px)"
    )
    assert "tuning" not in out and _saved(data) == [measured]  # no tune, nothing saved
    # the library takes the same profile for the same reason, and logs why
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        loader = dlpipe.make_loader(data, "train", LoaderConfig(batch_size=8, image_size=48))
    assert loader.settings_line() == f"{settings} (profile)"
    assert "on this machine; nearest to batch 8, 48 px" in caplog.text


def test_the_demo_trains_on_the_profile_it_tuned(tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--per-class", "5", "--epochs", "1"]) == 0
    printed = capsys.readouterr().out
    (tuned,) = _saved(str(out / "shapes-lmdb"))  # the training tuned nothing more
    assert tuned["loader"]["min_crop_scale"] == 0.5  # the crop the demo trains with
    settings = LoaderProfile.from_json(tuned).settings.line()
    batch = tuned["loader"]["batch_size"]
    assert _loader_line(printed) == (
        f"train loader {settings} (profile measured at batch {batch}, 40 px on this machine; "
        "the same loader)"
    )


def test_tune_off_without_a_profile_runs_the_defaults_and_says_so(data, tmp_path, capsys):
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "16", "--image-size", "16",
                 "--tune", "off")  # fmt: skip
    assert _loader_line(out).endswith(" (defaults: --tune off)")
    assert "tuning" not in out and _saved(data) == []


def test_tune_off_still_uses_a_saved_profile(data, tmp_path, capsys) -> None:
    """--tune off only says not to measure: a saved profile is used as ever."""
    _save(data, WorkerSettings(num_workers=1, prefetch_factor=3), batch_size=64, image_size=224)
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "16", "--image-size", "16",
                 "--tune", "off")  # fmt: skip
    assert _loader_line(out) == (
        "train loader engine=processes num_workers=1 decode=cpu prefetch_factor=3 "
        "pin_memory=False (profile measured at batch 64, 224 px on this machine; nearest to "
        "batch 16, 16 px)"
    )


def test_an_engine_given_over_a_profile_is_named_in_the_line(data, tmp_path, capsys) -> None:
    _save(data, WorkerSettings(num_workers=1, prefetch_factor=3), batch_size=16, image_size=16)
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "16", "--image-size", "16",
                 "--engine", "threads")  # fmt: skip
    assert _loader_line(out) == (
        "train loader engine=threads num_workers=1 decode=cpu prefetch_factor=3 "
        "pin_memory=False (profile measured at batch 16, 16 px on this machine; the same "
        "loader; --engine threads given)"
    )


def test_tune_auto_without_a_profile_tunes_saves_and_the_next_run_uses_it(
    data, tmp_path, capsys
) -> None:
    args = ["--batch-size", "16", "--image-size", "16"]
    first = _train(data, tmp_path / "run1", capsys, *args)  # --tune auto is the default
    assert "no saved loader profile for this dataset on this machine: tuning" in first
    line = _loader_line(first)
    assert "(tuned now on this run's first batches: " in line
    assert f"saved to {Path(data) / profiles.PROFILES_NAME})" in line
    (saved,) = _saved(data)
    assert saved["loader"] == {
        "split": "train",
        "batch_size": 16,
        "transform": "train",
        "image_size": 16,
        "min_crop_scale": 0.08,
    }
    assert saved["machine"] == profiles.machine_key()
    settings = LoaderProfile.from_json(saved).settings.line()
    assert line.startswith(f"train loader {settings} (")
    second = _train(data, tmp_path / "run2", capsys, *args)
    assert "tuning" not in second and _saved(data) == [saved]
    assert _loader_line(second) == (
        f"train loader {settings} (profile measured at batch 16, 16 px on this machine; "
        "the same loader)"
    )


def test_given_num_workers_neither_tunes_nor_hides_it(data, tmp_path, capsys) -> None:
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "16", "--image-size", "16",
                 "--num-workers", "0")  # fmt: skip
    assert _loader_line(out).endswith(" (given: --num-workers 0)") and "tuning" not in out
    assert _saved(data) == []


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('tune = "sometimes"', "data.tune = 'sometimes': invalid choice: 'sometimes'"),
        ('tune = "Off"', "data.tune = 'Off': invalid choice: 'Off' (choose from auto, off)"),
        ("tune = false", "data.tune = False: False is a bool; give a str"),
        ("tune = 0", "data.tune = 0: 0 is an int; give a str"),
    ],
)
def test_a_bad_tune_value_is_one_error_line(toml, message, data, tmp_path, capsys) -> None:
    config = tmp_path / "run.toml"
    config.write_text(f"[data]\n{toml}\n")
    code = main(["train", data, "--config", str(config), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err and _saved(data) == []
    assert not (tmp_path / "run").exists()


def test_a_bad_tune_flag_is_refused_by_the_parser(data, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", data, "--tune", "yes", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2 and "--tune: invalid choice: 'yes'" in capsys.readouterr().err


# --- never another machine's ----------------------------------------------------------------


def _save(
    data: str,
    settings: WorkerSettings,
    *,
    machine: dict | None = None,
    split: str = "train",
    **loader,
) -> None:
    config = LoaderConfig(**{"batch_size": 64, "image_size": 224, **loader})
    save_profile(
        data,
        LoaderProfile(
            settings=settings,
            samples_per_s=100.0,
            machine=profiles.machine_key() if machine is None else machine,
            loader=profiles.loader_key(split, config),
        ),
    )


@pytest.mark.parametrize(
    "other", [{"cpus": 10_000}, {"gpu": "Another GPU 80GB"}, {"torch": "0.0.1"}], ids=str
)
def test_another_machines_profile_is_never_used(other, data, tmp_path, capsys) -> None:
    """Even for the very loader it was measured for: the settings depend on the machine."""
    machine = {**profiles.machine_key(), **other}
    _save(data, WorkerSettings(num_workers=1, prefetch_factor=7), machine=machine,
          batch_size=16, image_size=16)  # fmt: skip
    config = LoaderConfig(batch_size=16, image_size=16)
    assert nearest_profile(data, split="train", config=config) is None
    assert dlpipe.make_loader(data, "train", config).settings_line().endswith("(defaults)")
    out = _train(data, tmp_path / "run", capsys, "--batch-size", "16", "--image-size", "16",
                 "--tune", "off")  # fmt: skip
    assert _loader_line(out).endswith(" (defaults: --tune off)")
    assert "prefetch_factor=7" not in out


# --- the rule: which profile is nearest -----------------------------------------------------


def _choose(data: str, split: str = "train", decode: str | None = None, **config) -> str:
    choice = nearest_profile(data, split=split, config=LoaderConfig(**config), decode=decode)
    return "none" if choice is None else choice.reason()


def test_the_nearest_batch_and_image_size_wins(data) -> None:
    for batch, size in ((64, 224), (256, 160), (8, 32)):
        _save(data, WorkerSettings(num_workers=1), batch_size=batch, image_size=size)
    assert _choose(data, batch_size=256, image_size=176).startswith(
        "profile measured at batch 256, 160 px on this machine; nearest to batch 256, 176 px"
    )
    assert _choose(data, batch_size=16, image_size=32).startswith("profile measured at batch 8,")
    assert _choose(data, batch_size=64, image_size=224).endswith("; the same loader")
    assert _choose(data, batch_size=1, image_size=8).startswith("profile measured at batch 8,")
    big = _choose(data, batch_size=1 << 20, image_size=16384)
    assert big.startswith("profile measured at batch 256, 160 px")


def test_the_same_transform_split_crop_and_decode_are_preferred(data) -> None:
    _save(data, WorkerSettings(num_workers=1), batch_size=64, image_size=224, transform="eval")
    _save(data, WorkerSettings(num_workers=2), batch_size=8, image_size=32, min_crop_scale=0.5)
    # the eval loader prefers the eval profile, however far its sizes
    assert _choose(data, "val", batch_size=8, image_size=32).startswith(
        "profile measured at batch 64, 224 px, split 'train' on this machine"
    )
    # a train loader prefers the train profile; the crop scale only weighs in the distance
    assert _choose(data, batch_size=64, image_size=224) == (
        "profile measured at batch 8, 32 px, crop scale 0.5 on this machine; nearest to "
        "batch 64, 224 px, crop scale 0.08"
    )
    # with no train profile, the eval one serves the train loader, and the line says so
    _save(data, WorkerSettings(num_workers=3), batch_size=8, image_size=32, transform="eval")
    only_eval = Path(data) / profiles.PROFILES_NAME
    document = json.loads(only_eval.read_text())
    document["profiles"] = [p for p in document["profiles"] if p["loader"]["transform"] == "eval"]
    only_eval.write_text(json.dumps(document))
    assert _choose(data, batch_size=8, image_size=32) == (
        "profile measured at batch 8, 32 px, eval transform on this machine; nearest to "
        "batch 8, 32 px, train transform, crop scale 0.08"
    )


def test_a_decode_device_asked_for_is_preferred_over_nearer_sizes(data, monkeypatch) -> None:
    monkeypatch.setattr(profiles, "gpu_name", lambda: "Test GPU 80GB")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    _save(data, WorkerSettings(num_workers=1), batch_size=64, image_size=224)
    _save(data, WorkerSettings(num_workers=2, decode="cuda"), batch_size=256, image_size=160)
    for decode, workers in ((None, 1), ("cpu", 1), ("cuda", 2)):
        config = LoaderConfig(batch_size=64, image_size=224)
        choice = nearest_profile(data, split="train", config=config, decode=decode)
        assert choice is not None and choice.profile.settings.num_workers == workers, decode


def test_a_tie_goes_to_the_profile_saved_last(data) -> None:
    _save(data, WorkerSettings(num_workers=1), batch_size=32, image_size=224)
    _save(data, WorkerSettings(num_workers=2), batch_size=128, image_size=224)
    choice = nearest_profile(data, split="train", config=LoaderConfig(batch_size=64))
    assert choice is not None and choice.profile.settings.num_workers == 2


@pytest.mark.parametrize("transform", [None, len], ids=["raw", "custom"])
def test_raw_or_custom_samples_use_no_image_profile(transform, data) -> None:
    _save(data, WorkerSettings(num_workers=1), batch_size=8, image_size=32)
    config = LoaderConfig(batch_size=8, image_size=32, transform=transform)
    assert nearest_profile(data, split="train", config=config) is None


def test_a_contradicting_nearest_profile_is_passed_over_for_the_next(
    data, monkeypatch, caplog
) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    _save(data, WorkerSettings(num_workers=1), batch_size=256, image_size=224)
    _save(data, WorkerSettings(num_workers=2, decode="cuda"), batch_size=64, image_size=224)
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        choice = nearest_profile(data, split="train", config=LoaderConfig(batch_size=64))
    assert choice is not None and choice.profile.settings.num_workers == 1
    assert "asks for decode=cuda" in caplog.text and "it is passed over (" in caplog.text
    assert "default worker settings" not in caplog.text


# --- a profiles file is untrusted -------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_size", 0),
        ("batch_size", -64),
        ("batch_size", 64.0),
        ("batch_size", True),
        ("batch_size", "64"),
        ("batch_size", 2**21),
        ("batch_size", 10**400),
        ("image_size", 16385),
        ("image_size", "224"),  # null: a detection loader keeping its images' sizes
        ("image_size", 0),
        ("min_crop_scale", 0),
        ("min_crop_scale", 1.5),
        ("min_crop_scale", float("nan")),
        ("min_crop_scale", True),
        ("split", ""),
        ("transform", 3),
    ],
    ids=repr,
)
def test_a_loader_key_that_no_loader_has_is_a_named_error(name, value, data, caplog) -> None:
    """The nearest rule takes logarithms of the sizes: a crafted key must be refused by name,
    not crash the loader (a ZeroDivisionError, a math domain error)."""
    _save(data, WorkerSettings(num_workers=1), batch_size=64, image_size=224)
    path = Path(data) / profiles.PROFILES_NAME
    document = json.loads(path.read_text())
    document["profiles"][0]["loader"][name] = value
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError, match=f"loader {name}"):
        profiles.find_profile(data, split="train", config=LoaderConfig())
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        loader = dlpipe.make_loader(data, "train", LoaderConfig(batch_size=8, image_size=32))
    assert loader.settings_line().endswith("(defaults)")
    assert str(path) in caplog.text and f"loader {name}" in caplog.text


# --- the tune itself --------------------------------------------------------------------------


def test_the_tune_leaves_the_callers_random_streams_as_they_were(data) -> None:
    """A trainer seeds, tunes, then builds its model: the weights must not depend on whether
    (or for how many trials) it tuned."""

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    tuned = tune.tune_now(data, "train", LoaderConfig(batch_size=16, image_size=16))
    assert draws() == expected and tuned.trials >= 2  # a DataLoader with workers ran


def test_the_launcher_tunes_once_for_a_ranks_share(data, monkeypatch, tmp_path) -> None:
    """--nproc-per-node 2: the launcher tunes for a rank's micro-batch and up to its share
    of the cores, on the CPU, and saves the profile the ranks then find."""
    from rich.console import Console

    from dlpipe.train.command import _tune_for_ranks
    from dlpipe.train.config import load_config

    asked: list[tune_stages.BenchConfig] = []

    def search(config, on_trial=None, budget=None):
        asked.append(config)
        return [tune_search.Trial(WorkerSettings(num_workers=1), samples_per_s=10.0)]

    monkeypatch.setattr(tune, "search", search)
    monkeypatch.setattr("dlpipe.machine.usable_cpus", lambda: 6)
    overrides = {"data": {"path": data, "image_size": 16}, "run": {"batch_size": 32}}
    config = load_config(None, overrides).resolved()
    console = Console(record=True, width=400)
    _tune_for_ranks(config, 2, console)
    (bench,) = asked
    assert bench.loader.batch_size == 16 and bench.max_workers == 3 and bench.device == "cpu"
    assert "loader for each of the 2 ranks: tuned now" in console.export_text()
    (saved,) = _saved(data)
    assert saved["loader"]["batch_size"] == 16 and saved["num_workers"] == 1
    _tune_for_ranks(config, 2, console)  # a profile fits now: nothing more to measure
    assert len(asked) == 1
    off = load_config(None, {**overrides, "data": {**overrides["data"], "tune": "off"}})
    _tune_for_ranks(off.resolved(), 4, console)
    assert len(asked) == 1


@pytest.mark.slow
def test_two_ranks_run_on_the_profile_the_launcher_tuned(data, tmp_path) -> None:
    """--nproc-per-node 2 with no profile: the launcher tunes once for a rank's micro-batch;
    the ranks tune nothing and rank 0's loader line names that profile."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        [sys.executable, "-m", "dlpipe", "train", data, "--out", str(tmp_path / "run"), *TRAIN,
         "--batch-size", "16", "--image-size", "16", "--nproc-per-node", "2"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("tuning the loader on the first batches") == 1
    assert "loader for each of the 2 ranks: tuned now on this run's first batches" in done.stdout
    (saved,) = _saved(data)
    assert saved["loader"]["batch_size"] == 8  # a rank's micro-batch, its share of the cores
    assert saved["num_workers"] <= max(1, dlpipe.machine.usable_cpus() // 2)
    settings = LoaderProfile.from_json(saved).settings.line()
    assert _loader_line(done.stdout) == (
        f"train loader {settings} (profile measured at batch 8, 16 px on this machine; "
        "the same loader)"
    )
