"""make_loader's one signature: at most 8 parameters, the config in `LoaderConfig`, the workers in
`WorkerSettings` (or "auto", a count, a dict of its fields), and the old keywords through a
one-release shim: the same batches, one FutureWarning per process naming the new spelling,
an unknown keyword a TypeError naming it, a field given both ways an error."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
import torch

import dlpipe
from dlpipe.loading import loader as loader_module
from dlpipe.loading.config import LoaderArgumentError, LoaderConfigError, WorkerSettings

# each old keyword with a value that is not the default, and the same loader in the new spelling
CONFIG_KEYWORDS: list[tuple[str, Any]] = [
    ("batch_size", 8),
    ("transform", "eval"),
    ("transform", None),
    ("image_size", 24),
    ("min_crop_scale", 0.5),
    ("shuffle", False),
    ("seed", 7),
    ("drop_last", False),
]
WORKER_KEYWORDS: list[tuple[str, Any]] = [
    ("num_workers", 0),
    ("prefetch_factor", 3),
    ("pin_memory", True),
    ("engine", "threads"),
    ("decode", "cpu"),
    ("multiprocessing_context", "fork"),
]
BASE = {"batch_size": 5, "image_size": 16}  # small batches (32 samples: one short), small images


@pytest.fixture(autouse=True)
def no_saved_profiles(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def fresh_warning(monkeypatch) -> None:
    """This process has not shown the old keywords' warning yet."""
    monkeypatch.setattr(loader_module, "_warned", False)


def _old(path: str, **keywords: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return dlpipe.make_loader(path, "train", **keywords)


def _batches(loader: Any) -> list[Any]:
    """Two epochs of the loader (the second epoch's order depends on the seed too)."""
    out = [batch for _ in range(2) for batch in loader]
    loader.close()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_make_loader_takes_at_most_eight_parameters() -> None:
    parameters = inspect.signature(dlpipe.make_loader).parameters
    assert len(parameters) <= 8
    assert list(parameters)[:3] == ["path", "split", "config"]
    keyword_only = [p.name for p in parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keyword_only[0] == "workers" and parameters["workers"].default == "auto"
    for name in dlpipe.LoaderConfig.__dataclass_fields__:  # no copies of the config's fields
        assert name not in parameters
    for name in WorkerSettings.__dataclass_fields__:
        assert name not in parameters


@pytest.mark.parametrize(("name", "value"), CONFIG_KEYWORDS, ids=lambda v: str(v))
def test_an_old_config_keyword_gives_the_new_spellings_batches(make_dataset, name, value) -> None:
    path = make_dataset("lmdb")
    fields = {**BASE, name: value}
    old = _old(path, num_workers=0, **fields)
    new = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(**fields), workers=0)
    assert old.settings == new.settings and len(old) == len(new) > 0
    assert _same(_batches(old), _batches(new))
    default = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(**BASE), workers=0)
    assert not _same(_batches(default), _batches(_old(path, num_workers=0, **fields)))


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.parametrize(("name", "value"), WORKER_KEYWORDS, ids=lambda v: str(v))
@pytest.mark.parametrize("fmt", ["lmdb", "wds"])
def test_an_old_worker_keyword_gives_the_new_spellings_settings_and_batches(
    make_dataset, fmt, name, value
) -> None:
    path = make_dataset(fmt)
    count = {"num_workers": 1} if name != "num_workers" else {}
    config = dlpipe.LoaderConfig(**BASE)
    old = _old(path, **BASE, **count, **{name: value})
    new = dlpipe.make_loader(path, "train", config, workers={**count, name: value})
    assert old.settings == new.settings and old.origin == new.origin == "given"
    assert getattr(new.settings, name) == value
    plain = dlpipe.make_loader(path, "train", config, workers=count).settings
    assert (new.settings != plain) == (getattr(plain, name) != value)  # decode: cpu either way
    assert _same(_batches(old), _batches(new))


def test_the_old_third_argument_is_the_batch_size(make_dataset) -> None:
    path = make_dataset("hdf5")
    old = _old(path, **{"image_size": 16, "num_workers": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        old = dlpipe.make_loader(path, "train", 8, image_size=16, num_workers=0)  # type: ignore[arg-type]
    new = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=8, image_size=16), workers=0
    )
    assert old.batch_size == 8 and _same(_batches(old), _batches(new))


def test_old_keywords_over_workers_none_keep_the_defaults_origin(make_dataset) -> None:
    """``workers=None, prefetch_factor=3`` was the defaults with one field changed: still so,
    and the notice's spelling (``profile=None``) makes the same settings."""
    path = make_dataset("lmdb")
    old = _old(path, batch_size=4, workers=None, prefetch_factor=3)
    config = dlpipe.LoaderConfig(batch_size=4)
    new = dlpipe.make_loader(path, "train", config, workers={"prefetch_factor": 3}, profile=None)
    assert old.origin == new.origin == "defaults" and old.settings == new.settings
    assert old.prefetch_factor == 3


def test_the_old_keywords_warn_once_per_process_naming_the_new_spelling(
    make_dataset, fresh_warning
) -> None:
    path = make_dataset("lmdb")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dlpipe.make_loader(path, "train", 4, image_size=16, num_workers=1, engine="threads")
        dlpipe.make_loader(path, "val", batch_size=2, num_workers=0)
        dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4), workers=0)
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(deprecations) == 1
    text = str(deprecations[0].message)
    assert deprecations[0].filename == __file__  # points at the caller's line
    assert "(a batch size as the third argument, image_size=, num_workers=, engine=)" in text
    assert "config=dlpipe.LoaderConfig(batch_size=4, image_size=16)" in text
    assert "workers={'num_workers': 1, 'engine': 'threads'}" in text


@pytest.mark.parametrize(
    ("keywords", "spelling"),
    [
        ({"num_workers": 2}, "pass workers=2 ("),
        ({"seed": 3}, "pass config=dlpipe.LoaderConfig(seed=3) ("),
        ({"workers": None, "pin_memory": False}, "workers={'pin_memory': False}, profile=None"),
        ({"decode": "auto"}, "pass nothing (None and decode='auto' meant the default)"),
        ({"engine": None, "seed": None}, "pass nothing"),
        ({"shuffle": None, "num_workers": 0}, "arguments (shuffle=, num_workers=) are deprecated"),
    ],
)
def test_the_notice_names_the_spelling_that_makes_the_same_loader(
    make_dataset, fresh_warning, keywords, spelling
) -> None:
    path = make_dataset("lmdb")
    with pytest.warns(FutureWarning, match="deprecated") as caught:
        dlpipe.make_loader(path, "train", **keywords)
    assert spelling in str(caught[0].message)


@pytest.mark.parametrize(
    ("keyword", "hint"),
    [
        ("batchsize", "did you mean 'batch_size'?"),
        ("num_worker", "did you mean 'num_workers'?"),
        ("world", "did you mean 'world_size'?"),
        ("persistent_workers", "pass workers={'persistent_workers': ...}"),
        ("timeout", "make_loader takes path, split, config, workers, profile, rank, world_size"),
        ("Batch_Size", "did you mean 'batch_size'?"),
    ],
)
def test_an_unknown_keyword_is_a_type_error_naming_it(
    make_dataset, fresh_warning, keyword, hint
) -> None:
    path = make_dataset("lmdb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any notice
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'") as info:
            dlpipe.make_loader(path, "train", **{keyword: 1})
        with pytest.raises(LoaderArgumentError):  # beside an old keyword too
            dlpipe.make_loader(path, "train", num_workers=0, **{keyword: 1})
    assert hint in str(info.value)
    assert isinstance(info.value, dlpipe.DlpipeError) and isinstance(info.value, LoaderConfigError)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"config": dlpipe.LoaderConfig(batch_size=4), "batch_size": 8},
            r"batch_size twice: in config= and as the old keyword batch_size=8; "
            r"pass config=config.replace\(batch_size=8\) alone",
        ),
        ({"config": dlpipe.LoaderConfig(), "transform": None}, "transform twice"),
        ({"config": dlpipe.LoaderConfig(), "seed": 0}, "seed twice"),  # even the same value
        ({"config": 8, "batch_size": 8}, "batch_size twice: as the third argument"),
        (
            {"workers": WorkerSettings(num_workers=2), "prefetch_factor": 3},
            r"prefetch_factor twice: in workers= .*workers=workers.replace\(prefetch_factor=3\)",
        ),
        ({"workers": WorkerSettings(num_workers=0), "decode": "cuda"}, "decode twice"),
        ({"workers": 2, "num_workers": 3}, "num_workers twice: in workers="),
        ({"workers": {"engine": "threads"}, "engine": "processes"}, "engine twice"),
    ],
)
def test_a_field_given_both_ways_is_refused(make_dataset, arguments, message) -> None:
    with pytest.raises(LoaderArgumentError, match=message) as info:
        dlpipe.make_loader(make_dataset("lmdb"), "train", **arguments)
    assert isinstance(info.value, TypeError) and isinstance(info.value, dlpipe.DlpipeError)


def test_old_keywords_beside_the_other_half_are_not_doubled(make_dataset) -> None:
    """A config with an old worker keyword, or workers with an old config keyword: each field
    once, so the shim takes them (the same loader as the new spelling)."""
    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(**BASE)
    old = _old(path, config=config, num_workers=0)
    assert old.settings == dlpipe.make_loader(path, "train", config, workers=0).settings
    old = _old(path, workers=WorkerSettings(num_workers=0), **BASE)
    new = dlpipe.make_loader(path, "train", config, workers=WorkerSettings(num_workers=0))
    assert _same(_batches(old), _batches(new))
    old = _old(path, workers={"prefetch_factor": 3}, num_workers=1, **BASE)
    new = dlpipe.make_loader(
        path, "train", config, workers={"prefetch_factor": 3, "num_workers": 1}
    )
    assert old.settings == new.settings


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ("fast", "workers='fast' is not 'auto', None, a worker count, a WorkerSettings"),
        ("AUTO", "workers='AUTO' is not 'auto'"),
        (True, "workers=True is not 'auto'"),
        (2.0, "workers=2.0 is not 'auto'"),
        (-1, "workers=-1 is not a worker count >= 0"),
        ([2], r"workers=\[2\] is not 'auto'"),
        ({"workers": 2}, "names 'workers', which is not a WorkerSettings field"),
        ({"num_workers": None}, "sets num_workers to None.*leave num_workers out"),
        ({"engine": "gpu"}, "engine='gpu' is not 'processes' or 'threads'"),
        ({"multiprocessing_context": "thread"}, "multiprocessing_context='thread' is not None"),
    ],
)
def test_a_bad_workers_argument_is_named(make_dataset, workers, message) -> None:
    with pytest.raises(LoaderConfigError, match=message):
        dlpipe.make_loader(make_dataset("lmdb"), "train", workers=workers)


@pytest.mark.parametrize(
    "config", [{"batch_size": 8}, "train", 8.0, True, WorkerSettings(num_workers=0)]
)
def test_a_config_that_is_not_a_loader_config_is_named(make_dataset, config) -> None:
    with pytest.raises(LoaderConfigError, match=r"config=.* is not a LoaderConfig or None"):
        dlpipe.make_loader(make_dataset("lmdb"), "train", config)


def test_a_count_and_a_dict_set_fields_over_the_saved_profile(make_dataset) -> None:
    """``workers=2`` is the old ``num_workers=2``: the profile's other settings, origin given;
    ``workers={"prefetch_factor": 5}`` keeps the profile's count and its origin."""
    from dlpipe.loading import profile as profiles

    path = make_dataset("lmdb")
    config = dlpipe.LoaderConfig(**BASE)
    saved = WorkerSettings(num_workers=1, prefetch_factor=7)
    profiles.save_profile(
        path,
        profiles.LoaderProfile(
            settings=saved,
            samples_per_s=1.0,
            machine=profiles.machine_key(),
            loader=profiles.loader_key("train", config),
        ),
    )
    counted = dlpipe.make_loader(path, "train", config, workers=0)
    assert (counted.num_workers, counted.origin) == (0, "given")
    assert counted.settings == saved.replace(num_workers=0)
    fields = dlpipe.make_loader(path, "train", config, workers={"prefetch_factor": 5})
    assert fields.settings == saved.replace(prefetch_factor=5) and fields.origin == "profile"
    assert dlpipe.make_loader(path, "train", config, workers={}).settings == saved


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is not a positive integer"),
        ({"config": -1}, "batch_size=-1 is not a positive integer"),  # the old third argument
        ({"config": 2**21}, "batch_size=2097152 is more than 1048576"),
        ({"image_size": 2.5}, "image_size=2.5 is not a positive integer"),
        ({"shuffle": "yes"}, "shuffle='yes' is not True, False or None"),
        ({"num_workers": -1}, "num_workers=-1 is not an integer >= 0"),
        ({"num_workers": True}, "num_workers=True is not an integer >= 0"),
        ({"prefetch_factor": 0, "num_workers": 1}, "prefetch_factor=0 is not None or"),
        ({"engine": "greenlets"}, "engine='greenlets' is not 'processes' or 'threads'"),
        ({"decode": "gpu"}, "decode='gpu' is not 'cpu' or 'cuda'"),
        ({"multiprocessing_context": "threads"}, "multiprocessing_context='threads' is not"),
    ],
)
def test_an_old_keyword_with_a_bad_value_is_named_as_its_field_is(
    make_dataset, arguments, message
) -> None:
    path = make_dataset("lmdb")
    with pytest.raises(LoaderConfigError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dlpipe.make_loader(path, "train", **arguments)
