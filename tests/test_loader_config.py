"""LoaderConfig and WorkerSettings: one config resolved once, the profile key from it, the tuner
measuring exactly it, and make_loader taking them (its old keywords: test_loader_signature)."""

from __future__ import annotations

import json
import os

import pytest

import dlpipe
from dlpipe.cli import main
from dlpipe.loading import loader as loader_module
from dlpipe.loading import profile as profiles
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.transforms import ImageTransform

QUICK = ["--budget", "1", "--max-workers", "0", "--batch-size", "4", "--image-size", "16"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _record_transforms(monkeypatch) -> list[tuple[str, float]]:
    """(recipe, crop scale) of every image transform make_loader's transform builder makes."""
    made: list[tuple[str, float]] = []

    class Recorded(ImageTransform):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append((self.recipe, self.min_scale))

    monkeypatch.setattr(loader_module, "ImageTransform", Recorded)
    return made


def test_resolved_settles_the_split_defaults_once() -> None:
    config = dlpipe.LoaderConfig(batch_size=8)
    train, val = config.resolved("train"), config.resolved("val")
    assert (train.transform, train.shuffle, train.drop_last) == ("train", True, True)
    assert (val.transform, val.shuffle, val.drop_last) == ("eval", False, False)
    assert val.resolved("train") == val  # resolving twice changes nothing
    explicit = dlpipe.LoaderConfig(transform="eval", shuffle=True).resolved("train")
    assert (explicit.transform, explicit.shuffle, explicit.drop_last) == ("eval", True, True)


def test_an_image_size_left_out_is_the_task_s_and_the_recipe_is_the_task_s() -> None:
    config = dlpipe.LoaderConfig()
    tasks = (None, "classification", "captioning", "detection", "segmentation")
    sizes = [config.resolved("train", task).image_size for task in tasks]
    assert sizes == [224, 224, 224, None, 480]
    assert dlpipe.LoaderConfig(image_size=64).resolved("val", "detection").image_size == 64
    ssd = dlpipe.LoaderConfig(transform="ssd")
    assert ssd.resolved("train", "detection").transform == "ssd"
    with pytest.raises(LoaderConfigError, match=r"'ssd' is not a recipe of this classification"):
        ssd.resolved("train", "classification")
    old = profiles.loader_key("train", dlpipe.LoaderConfig(image_size=224))
    assert profiles.loader_key("train", config) == old  # profiles saved before stay found
    assert profiles.loader_key("train", config, "detection")["image_size"] is None


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"image_size": 2.5}, "image_size=2.5"),
        ({"min_crop_scale": 1.5}, "min_crop_scale=1.5"),
        ({"min_crop_scale": 0}, "min_crop_scale=0"),
        ({"transform": "random"}, "transform='random'"),
        ({"shuffle": "yes"}, "shuffle='yes'"),
    ],
)
def test_a_bad_config_field_is_named(fields, named) -> None:
    with pytest.raises(LoaderConfigError, match=named) as info:
        dlpipe.LoaderConfig(**fields)
    assert isinstance(info.value, dlpipe.DlpipeError) and isinstance(info.value, ValueError)
    with pytest.raises(TypeError):
        dlpipe.LoaderConfig(8)  # type: ignore[misc]  # keyword-only


@pytest.mark.parametrize(
    "fields, named",
    [({"num_workers": -1}, "num_workers=-1"), ({"num_workers": 2, "prefetch_factor": 0}, "=0")],
)
def test_bad_worker_settings_are_named(fields, named) -> None:
    with pytest.raises(LoaderConfigError, match=named):
        dlpipe.WorkerSettings(**fields)


def test_config_and_workers_make_the_loader(make_dataset) -> None:
    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(batch_size=4, image_size=24, min_crop_scale=0.5, seed=3)
    workers = dlpipe.WorkerSettings(num_workers=0)
    loader = dlpipe.make_loader(path, "train", config=config, workers=workers)
    images, labels = next(iter(loader))
    assert tuple(images.shape) == (4, 3, 24, 24) and loader.num_workers == 0
    same = dlpipe.make_loader(path, "train", config, workers=0)  # a count: the same batches
    assert all((a == b).all() for a, b in zip(next(iter(same)), (images, labels)))


def test_a_replaced_config_field_changes_that_field_only(make_dataset, monkeypatch) -> None:
    made = _record_transforms(monkeypatch)
    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(batch_size=4, image_size=24, min_crop_scale=0.5)
    loader = dlpipe.make_loader(path, "train", config.replace(batch_size=8), workers=0)
    assert loader.batch_size == 8 and made == [("train", 0.5)]
    raw = dlpipe.make_loader(path, "train", config.replace(transform=None), workers=0)
    assert isinstance(next(iter(raw))[0], dict)  # transform=None is a choice, not "not given"


def test_worker_fields_are_set_on_settings_or_over_the_automatic_ones(make_dataset) -> None:
    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(batch_size=4)
    workers = dlpipe.WorkerSettings(num_workers=2, prefetch_factor=6)
    loader = dlpipe.make_loader(path, "train", config, workers=workers.replace(prefetch_factor=3))
    assert (loader.num_workers, loader.prefetch_factor) == (2, 3)
    loader = dlpipe.make_loader(path, "train", config, workers=workers.replace(num_workers=0))
    assert (loader.num_workers, loader.prefetch_factor) == (0, None)
    loader = dlpipe.make_loader(
        path, "train", config, workers={"num_workers": 2, "prefetch_factor": 3}
    )
    assert (loader.num_workers, loader.prefetch_factor, loader.origin) == (2, 3, "given")
    with pytest.raises(LoaderConfigError, match="workers='fast'"):
        dlpipe.make_loader(path, "train", config, workers="fast")


def test_given_settings_pass_over_a_saved_profile(make_dataset) -> None:
    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(batch_size=4, image_size=24)
    saved = profiles.LoaderProfile(
        settings=dlpipe.WorkerSettings(num_workers=2, prefetch_factor=7),
        samples_per_s=1.0,
        machine=profiles.machine_key(),
        loader=profiles.loader_key("train", config),
    )
    profiles.save_profile(path, saved)
    assert dlpipe.make_loader(path, "train", config).prefetch_factor == 7
    given = dlpipe.make_loader(path, "train", config, workers=dlpipe.WorkerSettings(num_workers=0))
    assert given.num_workers == 0


def test_the_tuner_measures_and_keys_the_crop_scale_it_is_given(
    make_dataset, monkeypatch, capsys
) -> None:
    made = _record_transforms(monkeypatch)
    path = make_dataset("hdf5")
    assert main(["bench-loader", path, *QUICK, "--min-crop-scale", "0.4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert made and set(made) == {("train", 0.4)}  # the stages and every trial
    with open(report["saved"]) as f:
        key = json.load(f)["profiles"][0]["loader"]
    assert key["min_crop_scale"] == 0.4 and key["transform"] == "train"
    config = dlpipe.LoaderConfig(batch_size=4, image_size=16, min_crop_scale=0.4)
    assert dlpipe.find_profile(path, split="train", config=config) is not None
    default_crop = config.replace(min_crop_scale=0.08)
    assert dlpipe.find_profile(path, split="train", config=default_crop) is None
    loader = dlpipe.make_loader(path, config=config)
    assert loader.num_workers == report["best"]["num_workers"] == 0


def test_bench_loader_refuses_a_crop_scale_over_one(make_dataset, capsys) -> None:
    path = make_dataset("lmdb")
    with pytest.raises(SystemExit) as info:
        main(["bench-loader", path, *QUICK, "--min-crop-scale", "1.5"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--min-crop-scale" in err[0] and "(0, 1]" in err[0]
    assert not os.path.exists(os.path.join(path, profiles.PROFILES_NAME))
