"""`LoaderConfig` (what the batches are) and `WorkerSettings` (how fast they come).

    config = dlpipe.LoaderConfig(batch_size=256, image_size=176, min_crop_scale=0.35)
    loader = dlpipe.make_loader("data/pets-lmdb", "train", config=config)
    loader = dlpipe.make_loader(path, "val", config=config, workers=dlpipe.WorkerSettings(
        num_workers=4, prefetch_factor=2))

The config decides the data: the same config gives the same batches whatever the workers.
`resolved` settles the split-dependent defaults (``transform="auto"``, ``shuffle`` and
``drop_last``) in one place; `dlpipe.loading.profile.loader_key` derives a saved profile's key
from it, and ``dlpipe bench-loader`` measures exactly the config it is given. The worker
settings change only the speed: they are what a profile stores and what the tuner searches.
`loader_arguments` reads `make_loader`'s ``config`` and ``workers`` (``"auto"``, a count, a
`WorkerSettings` or a dict of its fields), and its keywords from before that signature, for one
release. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import multiprocessing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dlpipe.errors import DlpipeError
from dlpipe.machine import usable_cpus, worker_limit
from dlpipe.options import area_share, int_in_range, non_negative_float, option, parse_size

__all__ = [
    "LoaderArgumentError",
    "LoaderConfig",
    "LoaderConfigError",
    "WorkerSettings",
    "bounded_workers",
    "default_workers",
    "recipe_task",
]

CLASSIFICATION_RECIPES = ("train", "eval")
TASK_RECIPES: dict[str, tuple[str, ...]] = {
    "detection": ("train", "hflip", "ssd", "ssdlite", "eval"),
    "segmentation": ("train", "eval"),
}
"""The joint transform recipes of the tasks that have their own (`dlpipe.loading.task_transforms`;
detection's ``train`` is ``hflip``); every other dataset has `CLASSIFICATION_RECIPES`."""
TRANSFORMS = ("auto", *dict.fromkeys(CLASSIFICATION_RECIPES + sum(TASK_RECIPES.values(), ())))
DEFAULT_IMAGE_SIZE: dict[str, int | None] = {
    "classification": 224,
    "detection": None,
    "segmentation": 480,
}
"""``image_size`` when a config leaves it None: the classification crop; each detection image
keeps its size (torchvision's references leave resizing to the model); the segmentation
reference's train crop (its eval resize, ``base_size``, is 520)."""
ENGINES = ("processes", "threads")
DECODE_DEVICES = ("cpu", "cuda")
Transform = str | Callable[..., Any] | None

log = logging.getLogger("dlpipe")
# Past these a loader cannot run: a batch or a crop that allocates terabytes, a seed numpy and
# torch refuse, a prefetch that queues a billion batches' indices before the first one.
MAX_BATCH_SIZE = 1 << 20
MAX_IMAGE_SIZE = 16384
MAX_SEED = 2**64 - 1
MAX_PREFETCH_FACTOR = 64


class LoaderConfigError(DlpipeError, ValueError):
    """A `LoaderConfig` or `WorkerSettings` field breaks its rule."""


class LoaderArgumentError(LoaderConfigError, TypeError):
    """`make_loader` got a keyword it does not take, or one field two ways."""


def _reject(what: str, value: Any, rule: str, fix: str) -> LoaderConfigError:
    return LoaderConfigError(f"{what}={value!r} {rule}; {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def recipe_task(task: str | None) -> str:
    """The task whose recipes and defaults a dataset of manifest task `task` has: detection and
    segmentation their own (`TASK_RECIPES`), every other dataset classification's."""
    return task if task is not None and task in TASK_RECIPES else "classification"


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """What one loader yields: the batch, the transform, the order.

    Attributes:
        batch_size: samples per batch on this rank.
        transform: a recipe of the dataset's task: classification's ``"train"``
            (RandomResizedCrop + flip) and ``"eval"`` (resize + centre crop); detection's
            ``"train"`` (= ``"hflip"``), ``"ssd"``, ``"ssdlite"`` and ``"eval"``;
            segmentation's ``"train"`` and ``"eval"`` (`dlpipe.loading.task_transforms`);
            ``"auto"`` is ``"train"`` for the train split and ``"eval"`` otherwise; None (raw
            sample dicts, batched as lists), or a callable on a sample dict.
        image_size: the side of the batches' images, in pixels; None is the task's
            (`DEFAULT_IMAGE_SIZE`): the classification crop 224, the segmentation train crop
            480, and detection images keep their sizes (given, they are resized to it).
        base_size: segmentation: the side the eval recipe resizes to, and the train recipe's
            random resize is based on; None is ``image_size`` x 520/480 (the references').
        min_crop_scale: the smallest share of the image area a classification ``"train"``
            crop keeps (torchvision's and timm's default 0.08; raise it when objects are small).
        shuffle, drop_last: None is True for the train split and False otherwise.
        seed: seeds the epoch permutations and augmentation.
        weights, on_source_end, epoch_samples, class_map: a mixture of several datasets
            (`make_loader` given a list of paths; `dlpipe.loading.mixing`), which changes what
            the batches are: each source's share of every epoch (None: its size), what a
            source that runs out does (``"cycle"``: its next permutation; ``"stop"``: each
            sample once an epoch), the samples per epoch (None: the sources' total), and
            ``{"SOURCE": {"their_class": "our_class"}}`` for sources whose classes differ.
        cache_dir, cache_limit: where and how large a URL dataset's shard cache is
            (`dlpipe.loading.remote`; bytes as an int or ``"50GB"``); they change neither the
            batches nor the profile's key.
        dataset_version: read the dataset as it was at this version (`Manifest.at_version`:
            each split's shards of versions 1..N), so a state saved on version N goes on after
            ``dlpipe convert --append`` made N+1; None: the latest (which refuses such a state,
            naming both versions).
    """

    batch_size: int = 64
    transform: Transform = "auto"
    # the fields made with `option` are a user's choices: each is also a ``dlpipe train`` flag
    # and a [data.loader] key (its other fields, the trainer sets from the run)
    image_size: int | None = option(
        "the side of the batches' images, in pixels (default: the task's: a 224 classification "
        "crop, a 480 segmentation crop; detection images keep their sizes)",
        default=None,
        parse=int_in_range(1, MAX_IMAGE_SIZE),
    )
    base_size: int | None = option(
        "segmentation: the side the eval recipe resizes to (default: image size x 520/480)",
        default=None,
        parse=int_in_range(1, MAX_IMAGE_SIZE),
    )
    min_crop_scale: float = option(
        "the smallest share of the image area a train crop keeps",
        default=0.08,
        parse=area_share,
    )
    shuffle: bool | None = None
    seed: int = 0
    drop_last: bool | None = None
    # the mixing fields (options too: ``dlpipe train A B --weights 0.7,0.3``), checked against
    # the sources by `dlpipe.loading.mix_sources`
    weights: tuple[float, ...] | None = option(
        "several datasets: each one's share of every epoch, one per dataset, e.g. 0.7,0.3 "
        "(default: each one's size)",
        default=None,
        parse=non_negative_float,
        metavar="W",
    )
    on_source_end: str = option(
        "several datasets: a dataset that runs out goes on with its next permutation (cycle) "
        "or gives each sample once an epoch (stop)",
        default="cycle",
        choices=("cycle", "stop"),
    )
    epoch_samples: int | None = option(
        "several datasets: samples per epoch (default: the datasets' total)",
        default=None,
        parse=int_in_range(1),
        metavar="N",
    )
    class_map: Mapping[str, Mapping[str, str]] | None = option(
        "several datasets: map a dataset's class names onto the first dataset's classes, "
        "e.g. 1:kitty=cat,doggo=dog (N: the dataset's number, 0 the first)",
        default=None,
        metavar="N:THEIRS=OURS",
    )
    cache_dir: str | None = option(
        "a URL dataset's shard cache: the folder holding one cache per dataset (default: "
        "$DLPIPE_DATA_DIR/cache, else ~/.cache/dlpipe/shards)",
        default=None,
        metavar="DIR",
    )
    cache_limit: int | None = option(
        "the most bytes of shards a URL dataset's cache keeps, e.g. 50GB (default: what it "
        "holds plus half the free space of its disk)",
        default=None,
        parse=parse_size,
        metavar="SIZE",
    )
    dataset_version: int | None = option(
        "read the dataset as it was at this version (its shards of versions 1..N): go on with "
        "a run saved before an append (default: the latest)",
        default=None,
        parse=int_in_range(1, 1 << 20),
        metavar="N",
    )

    def __post_init__(self) -> None:
        for name in ("batch_size", "image_size", "base_size"):
            value = getattr(self, name)
            most = MAX_BATCH_SIZE if name == "batch_size" else MAX_IMAGE_SIZE
            if value is None and name != "batch_size":
                continue  # the task's default
            if not _is_int(value) or value < 1:
                raise _reject(name, value, "is not a positive integer", f"pass {name}=64, say")
            if value > most:
                raise _reject(name, value, f"is more than {most}", f"pass at most {most}")
        scale = self.min_crop_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
            raise _reject(
                "min_crop_scale", scale, "is not in (0, 1]", "pass the smallest crop's area share"
            )
        if not (self.transform is None or callable(self.transform)) and (
            self.transform not in TRANSFORMS
        ):
            rule = f"is not one of {', '.join(map(repr, TRANSFORMS))}, None or a callable"
            raise _reject("transform", self.transform, rule, "pass one of those")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            rule = f"is not an integer in 0..{MAX_SEED} (what numpy and torch seed with)"
            raise _reject("seed", self.seed, rule, "pass seed=0, say")
        for name in ("shuffle", "drop_last"):
            if getattr(self, name) not in (None, True, False):
                raise _reject(name, getattr(self, name), "is not True, False or None", "pass one")

    def resolved(self, split: str, task: str | None = None) -> LoaderConfig:
        """This config for `split` and a dataset of `task` (`recipe_task`; None: not known,
        classification's defaults and no check): ``transform="auto"``, ``shuffle`` and
        ``drop_last`` settled (``"train"``, True, True for the train split; ``"eval"``,
        False, False otherwise), and ``image_size`` None the task's (`DEFAULT_IMAGE_SIZE`).

        Raises:
            LoaderConfigError: a `task` is given and the transform is not one of its recipes.
        """
        train, kind = split == "train", recipe_task(task)
        transform = ("train" if train else "eval") if self.transform == "auto" else self.transform
        recipes = TASK_RECIPES.get(kind, CLASSIFICATION_RECIPES)
        if task is not None and isinstance(transform, str) and transform not in recipes:
            rule = f"is not a recipe of this {kind} dataset (its recipes: {', '.join(recipes)})"
            raise _reject("transform", transform, rule, "pass one of those, None or a callable")
        return dataclasses.replace(
            self,
            transform=transform,
            image_size=DEFAULT_IMAGE_SIZE[kind] if self.image_size is None else self.image_size,
            shuffle=train if self.shuffle is None else self.shuffle,
            drop_last=train if self.drop_last is None else self.drop_last,
        )

    def transform_name(self, split: str) -> str:
        """The recipe (``"auto"`` settled by `split`), ``"none"`` or ``"custom"``."""
        transform = self.resolved(split).transform
        if transform is None:
            return "none"
        return "custom" if callable(transform) else str(transform)

    def replace(self, **changes: Any) -> LoaderConfig:
        """A copy with the fields in `changes` set (checked again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How a loader's batches are made: only the speed depends on these, never the data.

    Attributes:
        num_workers: with the ``processes`` engine, DataLoader worker processes (0: load in
            the main process); with ``threads``, the threads transforming samples (1 or more).
        prefetch_factor: batches each worker keeps ready (None: torch's 2; unused with 0
            workers); with ``threads``, the batches queued on the pool ahead of the one
            being collated.
        pin_memory: batches in page-locked memory, for fast copies to a GPU.
        persistent_workers: keep the workers between epochs (ignored with 0 workers and
            with threads, whose pool lives as long as the loader).
        engine: ``processes`` (torch's worker processes) or ``threads`` (a pool of threads
            in the loading process: no IPC, no fork; `dlpipe.loading.threads`). Both give
            the same batches; ``dlpipe bench-loader`` measures both and keeps the faster.
        decode: where JPEGs are decoded: ``cpu`` (in the workers, crop-aware) or ``cuda``
            (the workers read bytes and plan the crop, the batch is decoded, cropped and
            resized on the GPU and yielded there: `dlpipe.loading.device_decode`). The
            pixels agree within decoder and interpolation error; the boxes and flips are
            the same draws.
        multiprocessing_context: how worker processes start: ``"fork"``, ``"spawn"`` or
            ``"forkserver"`` (None: the platform's); readers reopen in each worker either
            way. Unused with 0 workers and with threads.
    """

    num_workers: int
    prefetch_factor: int | None = 2
    pin_memory: bool = False
    persistent_workers: bool = True
    engine: str = "processes"
    decode: str = "cpu"
    multiprocessing_context: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.num_workers) or self.num_workers < 0:
            raise _reject(
                "num_workers", self.num_workers, "is not an integer >= 0", "pass 0 or more"
            )
        prefetch = self.prefetch_factor
        if prefetch is not None and (
            not _is_int(prefetch) or not 1 <= prefetch <= MAX_PREFETCH_FACTOR
        ):
            rule = f"is not None or an integer in 1..{MAX_PREFETCH_FACTOR}"
            raise _reject("prefetch_factor", prefetch, rule, "pass 2, say")
        for name in ("pin_memory", "persistent_workers"):
            if not isinstance(getattr(self, name), bool):
                raise _reject(name, getattr(self, name), "is not True or False", "pass one")
        if self.engine not in ENGINES:
            rule = "is not 'processes' or 'threads'"
            raise _reject("engine", self.engine, rule, "pass one of those")
        if self.decode not in DECODE_DEVICES:
            rule = "is not 'cpu' or 'cuda'"
            fix = "pass one of those (or leave it out of workers= for the profile's choice)"
            raise _reject("decode", self.decode, rule, fix)
        methods = multiprocessing.get_all_start_methods()
        if self.multiprocessing_context is not None and self.multiprocessing_context not in methods:
            rule = f"is not None or a start method of this platform {tuple(methods)}"
            raise _reject("multiprocessing_context", self.multiprocessing_context, rule, "pass one")
        if self.engine == "threads" and self.num_workers < 1:
            rule = "is not 1 or more, as the threads engine needs"
            raise _reject("num_workers", self.num_workers, rule, "pass the thread count")

    @property
    def threads(self) -> int:
        """The thread engine's thread count (0: the processes engine)."""
        return self.num_workers if self.engine == "threads" else 0

    def line(self) -> str:
        """``engine=processes num_workers=12 decode=cpu prefetch_factor=2 pin_memory=True``:
        how the loader, ``bench-loader`` and ``dlpipe train`` name these settings."""
        return (
            f"engine={self.engine} num_workers={self.num_workers} decode={self.decode} "
            f"prefetch_factor={self.prefetch_factor} pin_memory={self.pin_memory}"
        )

    def replace(self, **changes: Any) -> WorkerSettings:
        """A copy with the fields in `changes` set (checked again)."""
        return dataclasses.replace(self, **changes)

    def dataloader_options(self) -> dict[str, Any]:
        """These settings as ``torch.utils.data.DataLoader`` keywords (prefetch and persistence
        only with workers, as torch requires; the thread engine's DataLoader runs in this
        process and pins its batches itself)."""
        if self.threads:
            return {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
        options: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.num_workers > 0 and self.persistent_workers,
        }
        if self.num_workers > 0:
            options["prefetch_factor"] = self.prefetch_factor or 2
            options["multiprocessing_context"] = self.multiprocessing_context
        return options


def default_workers() -> WorkerSettings:
    """Settings without a measured profile: every usable core but one (at least one worker),
    prefetch 2, pinned memory when CUDA is there."""
    import torch

    return WorkerSettings(
        num_workers=max(1, usable_cpus() - 1),
        prefetch_factor=2,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=True,
    )


def bounded_workers(settings: WorkerSettings, origin: str) -> WorkerSettings:
    """`settings` within what this machine can run (`dlpipe.machine.worker_limit`: cores,
    memory, open files). A count asked for (`origin` ``"given"``) past it cannot run: it is
    refused, naming the limit. A saved profile's or the defaults' is advice: it is cut to the
    limit, with a warning on the ``dlpipe`` logger.

    Raises:
        LoaderConfigError: a given ``num_workers`` is more than the machine can run.
    """
    limit = worker_limit(threads=settings.engine == "threads")
    if settings.num_workers <= limit.workers:
        return settings
    what = "threads" if settings.engine == "threads" else "worker processes"
    rule = f"is more {what} than this machine can run ({limit.workers}: {limit.reason})"
    if origin == "given":
        fix = f"pass at most {limit.workers} (`dlpipe bench-loader` measures the fastest count)"
        raise _reject("num_workers", settings.num_workers, rule, fix)
    log.warning(
        "the %s num_workers=%d %s; using %d (re-run `dlpipe bench-loader` on this machine)",
        "saved profile's" if origin == "profile" else "default",
        settings.num_workers,
        rule.removeprefix("is "),
        limit.workers,
    )
    return settings.replace(num_workers=limit.workers)


# --- make_loader's arguments ---------------------------------------------------------------

# make_loader's keywords before its one signature: each sets one field, accepted for one release
# (`loader_arguments`); a new field is a `LoaderConfig` or `WorkerSettings` field, never one here
LEGACY_CONFIG_KEYWORDS: tuple[str, ...] = (
    "batch_size",
    "transform",
    "image_size",
    "min_crop_scale",
    "shuffle",
    "seed",
    "drop_last",
)
LEGACY_WORKER_KEYWORDS: tuple[str, ...] = (
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "engine",
    "decode",
    "multiprocessing_context",
)
LOADER_PARAMETERS = ("path", "split", "config", "workers", "profile", "rank", "world_size")
WORKER_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerSettings))
# what `make_loader` passes on: the workers named ("auto", None or settings) and the fields set
WorkerRequest = tuple[str | WorkerSettings | None, dict[str, Any]]


def loader_arguments(
    config: Any, workers: Any, legacy: Mapping[str, Any]
) -> tuple[LoaderConfig | None, WorkerRequest, str | None]:
    """`make_loader`'s config, workers and old keywords as (the config, the workers named and
    the worker fields set over them, the deprecation notice for old keywords or None).

    ``workers`` is ``"auto"``, None, a worker count (``"auto"`` with that ``num_workers``), a
    `WorkerSettings`, or a mapping of its fields (``"auto"`` with those fields set).

    Raises:
        LoaderArgumentError: an unknown keyword, or a field given both in the new spelling and
            as an old keyword (TypeError, as Python's own).
        LoaderConfigError: `config` or `workers` is none of the kinds above, or a field given
            breaks its rule.
    """
    request = _worker_request(workers)
    notice = None
    if legacy or _is_int(config):
        config, request, notice = _from_legacy(config, request, dict(legacy))
    if config is not None and not isinstance(config, LoaderConfig):
        rule = "is not a LoaderConfig or None"
        raise _reject("config", config, rule, "pass config=dlpipe.LoaderConfig(batch_size=64)")
    return config, request, notice


def _worker_request(workers: Any) -> WorkerRequest:
    if (
        workers is None
        or isinstance(workers, WorkerSettings)
        or (isinstance(workers, str) and workers == "auto")
    ):
        return workers, {}
    if _is_int(workers):
        if workers < 0:
            raise _reject("workers", workers, "is not a worker count >= 0", "pass 0 or more")
        return "auto", {"num_workers": workers}
    if isinstance(workers, Mapping):
        for name, value in workers.items():
            if name not in WORKER_FIELDS:
                rule = f"names {name!r}, which is not a WorkerSettings field {WORKER_FIELDS}"
                raise _reject("workers", dict(workers), rule, "pass those fields only")
            if value is None:
                rule = f"sets {name} to None"
                raise _reject("workers", dict(workers), rule, f"leave {name} out, or set it")
        return "auto", dict(workers)
    rule = "is not 'auto', None, a worker count, a WorkerSettings or a dict of its fields"
    raise _reject("workers", workers, rule, "pass one of those")


def _from_legacy(
    config: Any, request: WorkerRequest, legacy: dict[str, Any]
) -> tuple[LoaderConfig | None, WorkerRequest, str]:
    """The old keywords (and an int third argument, the old batch size) in the new spelling."""
    for name in legacy:
        if name not in LEGACY_CONFIG_KEYWORDS + LEGACY_WORKER_KEYWORDS:
            raise LoaderArgumentError(_unknown(name))
    old = [f"{name}=" for name in legacy]
    if _is_int(config):
        if "batch_size" in legacy:
            raise _twice("batch_size", "as the third argument", legacy["batch_size"], "it once")
        legacy, config = {"batch_size": config, **legacy}, None
        old.insert(0, "a batch size as the third argument")
    given = {k: v for k, v in legacy.items() if v is not None or k == "transform"}
    if given.get("decode") == "auto":  # the old "not given"
        del given["decode"]
    fields = {k: v for k, v in given.items() if k in LEGACY_CONFIG_KEYWORDS}
    if fields and config is not None:
        name, value = next(iter(fields.items()))
        raise _twice(name, "in config=", value, f"config=config.replace({name}={value!r}) alone")
    base, changes = request
    for name, value in given.items():
        if isinstance(base, WorkerSettings) and name in LEGACY_WORKER_KEYWORDS:
            fix = f"workers=workers.replace({name}={value!r}) alone"
            raise _twice(name, "in workers=", value, fix)
        if name in changes:
            raise _twice(name, "in workers=", value, "it once, in workers=")
    worker_fields = {k: v for k, v in given.items() if k in LEGACY_WORKER_KEYWORDS}
    config = LoaderConfig(**fields) if fields else config
    request = (base, {**changes, **worker_fields})
    return config, request, _notice(old, fields, request)


def _unknown(name: str) -> str:
    text = f"make_loader() got an unexpected keyword argument {name!r}"
    if name in WORKER_FIELDS:
        return f"{text}; it is a WorkerSettings field: pass workers={{{name!r}: ...}}"
    known = LOADER_PARAMETERS + LEGACY_CONFIG_KEYWORDS + LEGACY_WORKER_KEYWORDS
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return (
        f"{text}; {hint}make_loader takes {', '.join(LOADER_PARAMETERS)} (LoaderConfig's "
        "fields go in config=, WorkerSettings' in workers=)"
    )


def _twice(name: str, where: str, value: Any, fix: str) -> LoaderArgumentError:
    return LoaderArgumentError(
        f"make_loader() got {name} twice: {where} and as the old keyword {name}={value!r}; "
        f"pass {fix}"
    )


def _notice(old: list[str], fields: dict[str, Any], request: WorkerRequest) -> str:
    """The deprecation notice: the old keywords given and the same loader in the new spelling."""
    parts = []
    if fields:
        values = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        parts.append(f"config=dlpipe.LoaderConfig({values})")
    base, changes = request
    if changes and not isinstance(base, WorkerSettings):
        count = changes.get("num_workers")
        parts.append(
            f"workers={count}" if list(changes) == ["num_workers"] else f"workers={changes}"
        )
        if base is None:
            parts.append("profile=None")
    new = ", ".join(parts) or "nothing (None and decode='auto' meant the default)"
    return (
        f"make_loader's old arguments ({', '.join(old)}) are deprecated and go in the next "
        f"release; pass {new} "
        f"(make_loader({', '.join(LOADER_PARAMETERS)}); this warning is shown once)"
    )
