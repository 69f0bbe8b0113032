"""Loader profiles: saved beside the dataset or in the cache, found only on an exact match."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

import dlpipe
from dlpipe.loading import profile as profiles
from dlpipe.loading.config import LoaderConfig, WorkerSettings
from dlpipe.loading.profile import LoaderProfile, ProfileError, find_profile, save_profile

CONFIG = LoaderConfig(batch_size=4, transform="train", image_size=24)
KEY = {"split": "train", "config": CONFIG}


def _key(split: str = "train", **changes) -> dict:
    return {"split": split, "config": CONFIG.replace(**changes)}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own user cache and a fixed machine."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(profiles, "gpu_name", lambda: "Test GPU 80GB")
    return cache


def _profile(num_workers: int = 3, **changes) -> LoaderProfile:
    values = {
        "settings": WorkerSettings(num_workers=num_workers, prefetch_factor=5, pin_memory=False),
        "samples_per_s": 1234.4,
        "machine": profiles.machine_key(),
        "loader": profiles.loader_key(**KEY),
        "created_by": dlpipe.__version__,
    }
    return LoaderProfile(**(values | changes))


def test_save_then_find_round_trips_beside_the_dataset(make_dataset) -> None:
    path = make_dataset("lmdb")
    saved = _profile()
    where = save_profile(path, saved)
    assert where == os.path.join(path, profiles.PROFILES_NAME)
    assert find_profile(path, **KEY) == (saved, where)
    data = json.loads(Path(where).read_text())
    assert data["schema"] == "dlpipe.loader-profiles" and data["schema_version"] == 1


def test_saving_the_same_key_replaces_and_other_keys_are_kept(make_dataset) -> None:
    path = make_dataset("lmdb")
    save_profile(path, _profile())
    other = _profile(loader=profiles.loader_key(**_key(batch_size=8)))
    save_profile(path, other)
    where = save_profile(path, _profile(num_workers=7))
    assert len(json.loads(Path(where).read_text())["profiles"]) == 2
    assert find_profile(path, **KEY)[0].settings.num_workers == 7
    assert find_profile(path, **_key(batch_size=8))[0] == other


@pytest.mark.parametrize(
    "change",
    [
        {"batch_size": 8},
        {"image_size": 32},
        {"transform": "eval"},
        {"min_crop_scale": 0.5},
        {"split": "val"},
    ],
)
def test_a_different_loader_config_finds_nothing(make_dataset, change) -> None:
    path = make_dataset("lmdb")
    save_profile(path, _profile())
    assert find_profile(path, **_key(**change)) is None


def test_order_and_seed_do_not_change_the_key(make_dataset) -> None:
    path = make_dataset("lmdb")
    save_profile(path, _profile())
    assert find_profile(path, **_key(seed=7, shuffle=False, drop_last=False)) is not None


@pytest.mark.parametrize("what", ["gpu", "cpus"])
def test_a_different_machine_finds_nothing(make_dataset, monkeypatch, what) -> None:
    path = make_dataset("lmdb")
    save_profile(path, _profile())
    if what == "gpu":
        monkeypatch.setattr(profiles, "gpu_name", lambda: "none")
    else:
        monkeypatch.setattr(profiles, "usable_cpus", lambda: 1000)
    assert find_profile(path, **KEY) is None


def test_transform_names_in_the_key() -> None:
    def key(transform, split="train"):
        found = profiles.loader_key(split, CONFIG.replace(transform=transform, min_crop_scale=0.3))
        return found["transform"], found["min_crop_scale"]

    assert [key("auto"), key("auto", "val"), key(None), key(len)] == [
        ("train", 0.3),
        ("eval", None),  # the crop scale counts only for the train crop
        ("none", None),
        ("custom", None),
    ]


def test_a_profile_saved_before_the_crop_scale_was_keyed_reads_as_the_default(
    make_dataset,
) -> None:
    path = make_dataset("lmdb")
    where = save_profile(path, _profile())
    document = json.loads(Path(where).read_text())
    del document["profiles"][0]["loader"]["min_crop_scale"]
    Path(where).write_text(json.dumps(document))
    assert find_profile(path, **_key(min_crop_scale=0.08)) is not None
    assert find_profile(path, **_key(min_crop_scale=0.5)) is None


# a profiles file as the release before `multiprocessing_context` was stored wrote it, and one
# profile from before the thread engine and GPU decode (no "engine", no "decode")
OLD_PROFILES = """\
{
  "schema": "dlpipe.loader-profiles",
  "schema_version": 1,
  "profiles": [
    {
      "num_workers": 3, "prefetch_factor": 4, "pin_memory": false,
      "persistent_workers": true, "engine": "threads", "decode": "cpu",
      "samples_per_s": 900.5, "machine": MACHINE,
      "loader": {"split": "train", "batch_size": 4, "transform": "train",
                 "image_size": 24, "min_crop_scale": 0.08},
      "created_by": "0.1.0"
    },
    {
      "num_workers": 2, "prefetch_factor": 2, "pin_memory": false,
      "persistent_workers": true, "samples_per_s": 800.0, "machine": MACHINE,
      "loader": {"split": "val", "batch_size": 4, "transform": "eval", "image_size": 24},
      "created_by": "0.1.0"
    }
  ]
}
"""


def test_a_profiles_file_of_the_previous_release_still_loads(make_dataset) -> None:
    """A `WorkerSettings` field the file lacks takes its default; saving a profile replaces
    the one of its key and writes the other again with every field."""
    path = make_dataset("lmdb")
    beside = Path(path) / profiles.PROFILES_NAME
    beside.write_text(OLD_PROFILES.replace("MACHINE", json.dumps(profiles.machine_key())))
    threads, _ = find_profile(path, **KEY)
    assert threads.settings == WorkerSettings(num_workers=3, prefetch_factor=4, engine="threads")
    val = LoaderConfig(batch_size=4, image_size=24)
    old, _ = find_profile(path, split="val", config=val)
    assert old.settings == WorkerSettings(num_workers=2)  # processes, cpu: the defaults
    save_profile(path, _profile())
    kept, new = json.loads(beside.read_text())["profiles"]
    assert (kept["engine"], kept["decode"], new["multiprocessing_context"]) == (
        "processes",
        "cpu",
        None,
    )
    assert LoaderProfile.from_json(kept).settings == old.settings


def test_read_only_dataset_falls_back_to_the_user_cache(make_dataset, monkeypatch, cache_dir):
    path = make_dataset("lmdb")
    os.chmod(path, 0o555)  # root ignores the mode, hence the patched `writable` as well
    monkeypatch.setattr(profiles, "writable", lambda p: False)
    try:
        where = save_profile(path, _profile())
    finally:
        os.chmod(path, 0o755)
    assert os.path.dirname(where) == str(cache_dir / "dlpipe" / "profiles")
    assert len(os.path.basename(where)) == len("0123456789abcdef.json")
    assert not os.path.exists(os.path.join(path, profiles.PROFILES_NAME))
    assert find_profile(path, **KEY) == (_profile(), where)


def test_auto_uses_the_saved_settings_and_logs_them(make_dataset, caplog) -> None:
    path = make_dataset("lmdb")
    where = save_profile(path, _profile())
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        loader = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24))
    assert (loader.num_workers, loader.prefetch_factor, loader.pin_memory) == (3, 5, False)
    assert (
        f"using loader profile from {where}: engine=processes num_workers=3 decode=cpu "
        "prefetch_factor=5 pin_memory=False (measured 1234 samples/s)"
    ) in caplog.text


def test_explicit_settings_override_the_profile(make_dataset) -> None:
    path = make_dataset("lmdb")
    save_profile(path, _profile())
    loader = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24), workers=0
    )
    assert (loader.num_workers, loader.prefetch_factor) == (0, None)
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=24),
        workers={"prefetch_factor": 2},
    )
    assert (loader.num_workers, loader.prefetch_factor) == (3, 2)


def test_no_profile_gives_the_defaults(make_dataset, caplog) -> None:
    path = make_dataset("lmdb")
    with caplog.at_level(logging.DEBUG, logger="dlpipe"):
        loader = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24))
    assert loader.num_workers == max(1, (os.cpu_count() or 1) - 1)
    assert loader.prefetch_factor == 2 and "no loader profile" in caplog.text
    save_profile(path, _profile())
    loader = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24), profile=None
    )
    assert loader.num_workers == max(1, (os.cpu_count() or 1) - 1)


def test_a_profile_passed_directly_is_used_as_is(make_dataset) -> None:
    other_machine = _profile(1, machine={"cpus": 1, "gpu": "none", "torch": "0"})
    loader = dlpipe.make_loader(
        make_dataset("lmdb"), "train", dlpipe.LoaderConfig(batch_size=4), profile=other_machine
    )
    assert (loader.num_workers, loader.prefetch_factor) == (1, 5)


@pytest.mark.parametrize(
    "text, rule",
    [
        ("{not json", "not valid JSON"),
        ('{"schema": "dlpipe.loader-profiles", "schema_version": 2, "profiles": []}', "version"),
        ('{"schema": "dlpipe.loader-profiles", "schema_version": 1, "profiles": [{}]}', "missing"),
    ],
)
def test_a_malformed_profiles_file_is_named(make_dataset, text, rule, caplog) -> None:
    path = make_dataset("lmdb")
    bad = os.path.join(path, profiles.PROFILES_NAME)
    with open(bad, "w") as f:
        f.write(text)
    loader = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24)
    )  # auto: a warning, defaults
    assert loader.prefetch_factor == 2 and bad in caplog.text and rule in caplog.text
    with pytest.raises(ProfileError, match=rule) as info:
        find_profile(path, **KEY)
    assert bad in str(info.value) and "dlpipe bench-loader" in str(info.value)
    assert isinstance(info.value, dlpipe.DlpipeError) and isinstance(info.value, ValueError)
    assert save_profile(path, _profile()) == bad  # the fix works: saving replaces the bad file
    assert find_profile(path, **KEY) is not None


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"num_workers": -1}, "num_workers"),
        ({"prefetch_factor": 0}, "prefetch_factor"),
        ({"pin_memory": "yes"}, "pin_memory"),
        ({"samples_per_s": "fast"}, "samples_per_s"),
        ({"machine": {"gpu": "x"}}, "machine"),
    ],
)
def test_profile_from_json_checks_each_value(change, rule) -> None:
    with pytest.raises(ProfileError, match=rule):
        LoaderProfile.from_json(_profile().to_json() | change)
    assert LoaderProfile.from_json(_profile().to_json()) == _profile()


def test_a_measured_worker_count_past_the_cores_is_not_warned_about(make_dataset) -> None:
    """bench-loader tries up to 2x the cores and may find more workers than cores fastest:
    the loader using that profile keeps quiet; a count the caller chose gets torch's warning."""
    import warnings

    path = make_dataset("lmdb")
    many = (os.cpu_count() or 1) + 1
    save_profile(path, _profile(many))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24))
        assert loader.num_workers == many and sum(len(b[1]) for b in loader) > 0
    assert not [w for w in caught if "worker" in str(w.message)]
    assert loader.settings_line() == (
        f"engine=processes num_workers={many} decode=cpu prefetch_factor=5 pin_memory=False "
        "(profile)"
    )
    with pytest.warns(UserWarning, match="worker"):
        given = dlpipe.make_loader(
            path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24), workers=many
        )
    assert given.settings_line().endswith("(given)")
    defaults = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24), profile=None
    )
    assert defaults.settings_line().endswith("prefetch_factor=2 pin_memory=False (defaults)")
    threads = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=4, image_size=24),
        workers={"engine": "threads"},
    )
    assert threads.settings_line().startswith(f"engine=threads num_workers={many} decode=cpu")
