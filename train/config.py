"""The trainer's configuration: nested keyword-only dataclasses, a TOML file, CLI overrides.

    [data]                   [data.loader]       [data.workers]     [model]            [run]
    path = "data/pets-lmdb"  image_size = 224    num_workers = 8    name = "resnet50"  epochs = 90

Each option is one field made with `dlpipe.options.option` (its default, help line and rule);
the ``dlpipe train`` parser is generated from them, a flag per field. ``[data.loader]`` is the
train loader's `LoaderConfig` itself: its option fields are the user's, its other fields (the
batch size, transform and seed) the trainer sets from the run (`train_loader_config`), so a
new `LoaderConfig` option is a flag and a key here unchanged. ``[data.workers]`` is its
`WorkerSettings` as chosen (`WorkerChoices`; unset: the saved profile's). The flat keys of
config files written before those sections (``[data] image_size = 224``, ``num_workers``,
``engine``, ``decode``, ``min_crop_scale``) are read into them.

Defaults < the TOML file (``--config``) < command-line flags. The resolved configuration, with
every default filled in (the learning rate and weight decay too), is written to the run folder
as ``config.toml`` and printed at the start; ``dlpipe train --config RUN/config.toml`` resumes
the run: the file records ``resume = "auto"`` and no ``max_steps`` (those two are how one
invocation starts and stops, not part of the run), so the printed resume command continues
from the newest checkpoint whatever the first invocation said.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlpipe import options
from dlpipe.loading.config import (
    DECODE_DEVICES,
    ENGINES,
    MAX_PREFETCH_FACTOR,
    LoaderConfig,
    LoaderConfigError,
)
from dlpipe.machine import worker_limit
from dlpipe.options import Checked, OptionError, int_in_range, option

__all__ = [
    "DEFAULT_MODELS",
    "TASKS",
    "BatchPlan",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "WorkerChoices",
    "load_config",
    "plan_batches",
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
TASKS = ("classification", "detection", "segmentation")
DEFAULT_MODELS = {
    "classification": "resnet18",
    "detection": "fasterrcnn_mobilenet_v3_large_fpn",
    "segmentation": "deeplabv3_mobilenet_v3_large",
}
"""Each task's model when ``--model`` is left at ``auto``."""
OPTIMIZERS = ("sgd", "adamw")
TUNE_CHOICES = ("auto", "off")  # data.tune, --tune
MAX_IMAGE_SIZE = 4096  # a crop side past this is a typo, and would allocate gigabytes a batch
# The range of every other number (docs/security.md, "Training"): past these a value
# is a typo or an attack, and overflows a float32 step, a timedelta or a schedule (lr = 1e308,
# warmup_epochs = 1e308) long before it trains anything.
MAX_EPOCHS = 100_000  # also warmup_epochs and early_stop_patience
MAX_BATCH_SIZE = 1 << 20  # also micro_batch
MAX_STEPS = 10**12  # max_steps and every "every N steps" or "N steps" count
MAX_KEEP_LAST = 1000
MAX_LR = 100.0
MAX_WEIGHT_DECAY = 10.0
CLIP_GRAD_RANGE = (1e-6, 1e6)
DIST_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)  # one second to one week
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
MODEL_NAME = re.compile(rf"^({_DOTTED}|{_DOTTED}:[A-Za-z_][A-Za-z0-9_]*)$")
_PROFILE = "the saved profile's (dlpipe bench-loader)"


class ConfigError(OptionError):
    """A training option is malformed, unknown or inconsistent with another."""


@dataclass(kw_only=True)
class WorkerChoices(Checked):
    """The train loader's `WorkerSettings` as the user chose them, field for field (its
    ``num_workers`` is required there); a field left at its default here (None, ``"auto"``)
    is the saved profile's, else a short tune's or `WorkerSettings`' default. `chosen` is
    what the trainer passes as ``make_loader(workers=...)``."""

    num_workers: int | None = option(
        f"loader workers (default: {_PROFILE}, else a short tune, else all cores but one)",
        default=None,
    )
    prefetch_factor: int | None = option(
        f"batches each worker keeps ready (default: {_PROFILE}, else 2)",
        default=None,
        parse=int_in_range(1, MAX_PREFETCH_FACTOR),
    )
    pin_memory: bool | None = option(
        f"batches in page-locked memory, for fast copies to a GPU (default: {_PROFILE})",
        default=None,
    )
    persistent_workers: bool = option("keep the worker processes between epochs", default=True)
    engine: str = option(
        "loader workers as processes or as threads in this process (auto: the profile's)",
        default="auto",
        choices=("auto", *ENGINES),
    )
    decode: str = option(
        "where JPEGs are decoded: cuda decodes each batch on the GPU (auto: the profile's)",
        default="auto",
        choices=("auto", *DECODE_DEVICES),
    )
    multiprocessing_context: str | None = option(
        "how worker processes start (default: the platform's)",
        default=None,
        choices=tuple(multiprocessing.get_all_start_methods()),
    )

    def chosen(self) -> dict[str, Any]:
        """The fields set to other than their defaults: `WorkerSettings` field → value."""
        defaults = WorkerChoices()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(defaults, f.name)
        }


@dataclass(kw_only=True)
class DataConfig(Checked):
    path: tuple[str, ...] = option(
        "dataset folder or URL, or several: one seeded mixture of them (--weights) (or [data] "
        "path in --config)",
        default=(),
        flag="data",
    )
    train_split: str = option("the split to train on", default="train")
    val_split: str = option(
        'the split to validate on ("" trains without validation)', default="val"
    )
    tune: str = option(
        "auto: with no saved loader profile for this dataset on this machine, tune the loader "
        "for a few seconds first and save the result; off: the default settings",
        default="auto",
        choices=TUNE_CHOICES,
    )
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    workers: WorkerChoices = field(default_factory=WorkerChoices)


@dataclass(kw_only=True)
class ModelConfig(Checked):
    task: str = option(
        "what to train (auto: the dataset's task, from its manifest; classification without one)",
        default="auto",
        choices=("auto", *TASKS),
    )
    name: str = option(
        "a torchvision model of the task by name, or package.module:function (a factory taking "
        "num_classes=); auto: resnet18, fasterrcnn_mobilenet_v3_large_fpn or "
        "deeplabv3_mobilenet_v3_large by task",
        default="auto",
        name="model",
    )
    channels_last: bool = option("train in the channels-last memory format", default=False)
    compile: bool = option("torch.compile the model", default=False)


@dataclass(kw_only=True)
class OptimConfig(Checked):
    optimizer: str = option("the optimizer", default="sgd", choices=OPTIMIZERS)
    lr: float | None = option(
        "peak learning rate (default: 0.1 x batch/256 for sgd, 5e-4 x batch/512 for adamw)",
        default=None,
    )
    weight_decay: float | None = option(
        "weight decay (default: 1e-4 for sgd, 0.05 for adamw)", default=None
    )
    momentum: float = option("SGD momentum", default=0.9)
    warmup_epochs: float = option("epochs of linear learning-rate warm-up", default=1.0)
    clip_grad: float | None = option("max gradient norm (default: no clipping)", default=None)
    label_smoothing: float = option("label smoothing of the loss", default=0.0)


@dataclass(kw_only=True)
class RunConfig(Checked):
    epochs: int = option("epochs to train", default=10)
    batch_size: int = option("global batch: samples per optimizer step over all ranks", default=256)
    micro_batch: int | None = option(
        "samples per rank and forward pass (default: batch size / ranks)", default=None
    )
    precision: str = option(
        "auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU",
        default="auto",
        choices=PRECISIONS,
    )
    out: str = option("run folder (default: runs/{dataset}-{model})", default="")
    resume: str = option("auto (newest valid checkpoint), none, or a .pt path", default="auto")
    seed: int = option("seeds the model, the order and the augmentation", default=0)
    max_steps: int | None = option("stop (with a checkpoint) after N steps", default=None)
    early_stop_patience: int | None = option(
        "stop after N epochs without a gain in val loss (detection: mAP; segmentation: mIoU)",
        default=None,
    )
    keep_last: int = option("step checkpoints kept, plus best.pt", default=2)
    checkpoint_every_steps: int = option(
        "also checkpoint every N steps (0: at the end of each epoch and on SIGTERM only)",
        default=0,
        flag="--checkpoint-every",
        metavar="N",
    )
    log_every_steps: int = option(
        "log the step loss every N steps", default=20, flag="--log-every", metavar="N"
    )
    max_nonfinite_steps: int = option(
        "fail after N steps in a row with a non-finite loss", default=20
    )
    dist_timeout_s: float = option(
        "seconds a rank waits for the others in any collective",
        default=600.0,
        flag="--dist-timeout",
        metavar="SECONDS",
    )
    wandb: str | None = option(
        "also log to this Weights & Biases project", default=None, metavar="PROJECT"
    )


@dataclass(kw_only=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        """The options as nested sections, as in ``config.toml`` (None for the unset)."""
        out: dict[str, Any] = {}
        for spec, value in options.iter_options(self):
            node = out
            for part in spec.path[:-1]:
                node = node.setdefault(part, {})
            node[spec.attr] = value
        return out

    def resolved(self, dataset_task: str | None = None) -> TrainConfig:
        """A copy with every derived default filled in (task, model, run folder, lr, weight
        decay); `dataset_task` is the manifest's task, which ``task = "auto"`` takes (None:
        classification)."""
        data, model = dataclasses.replace(self.data), dataclasses.replace(self.model)
        optim, run = dataclasses.replace(self.optim), dataclasses.replace(self.run)
        if model.task == "auto":
            model.task = dataset_task if dataset_task in TASKS else "classification"
        if model.name == "auto":
            model.name = DEFAULT_MODELS[model.task]
        if not run.out:
            names = [os.path.basename(os.path.normpath(p)) or "data" for p in data.path]
            name = "+".join(names) if len(names) <= 3 else f"{names[0]}+{len(names) - 1}-more"
            run.out = os.path.join("runs", f"{name}-{model.name.replace(':', '.')}")
        if optim.lr is None:
            optim.lr = (0.1 / 256 if optim.optimizer == "sgd" else 5e-4 / 512) * run.batch_size
        if optim.weight_decay is None:
            optim.weight_decay = 1e-4 if optim.optimizer == "sgd" else 0.05
        return TrainConfig(data=data, model=model, optim=optim, run=run)

    def for_resume(self) -> TrainConfig:
        """The copy written as ``config.toml``: ``resume = "auto"``, no ``max_steps``."""
        run = dataclasses.replace(self.run, resume="auto", max_steps=None)
        return dataclasses.replace(self, run=run)

    def parts(self) -> tuple[DataConfig, ModelConfig, OptimConfig, RunConfig]:
        return self.data, self.model, self.optim, self.run

    def validate(self) -> None:
        """Reject values no run can use, naming the option and the fix."""
        d, m, _, r = self.parts()
        _require(
            bool(d.path) and all(d.path),
            "no dataset given: pass DATA or set [data] path in --config",
        )
        _require(
            m.name == "auto" or bool(MODEL_NAME.match(m.name)),
            f"--model {m.name!r} is not a torchvision model name (e.g. resnet18) nor "
            "package.module:function (a factory taking num_classes=)",
        )
        self._validate_counts()
        self._validate_numbers()
        self._validate_loader()
        _require(
            d.loader.image_size is None or d.loader.image_size <= MAX_IMAGE_SIZE,
            f"data.image_size = {d.loader.image_size} is above {MAX_IMAGE_SIZE}: give the crop "
            "side in pixels (224 for ImageNet models)",
        )
        _require(
            0 <= r.seed < 2**32, f"run.seed = {r.seed} must be in 0..{2**32 - 1} (NumPy's range)"
        )
        _require(
            r.resume in ("auto", "none") or os.path.isfile(r.resume),
            f"--resume {r.resume}: no such checkpoint file; give auto, none or a .pt path",
        )

    def _validate_counts(self) -> None:
        r = self.run
        for name, value, most in (
            ("run.epochs", r.epochs, MAX_EPOCHS),
            ("run.batch_size", r.batch_size, MAX_BATCH_SIZE),
            ("run.micro_batch", r.micro_batch, MAX_BATCH_SIZE),
            ("run.max_steps", r.max_steps, MAX_STEPS),
            ("run.early_stop_patience", r.early_stop_patience, MAX_EPOCHS),
            ("run.keep_last", r.keep_last, MAX_KEEP_LAST),
            ("run.log_every_steps", r.log_every_steps, MAX_STEPS),
            ("run.max_nonfinite_steps", r.max_nonfinite_steps, MAX_STEPS),
        ):
            _require(value is None or value > 0, f"{name} = {value} must be a positive integer")
            _at_most(name, value, most)
        _require(
            r.checkpoint_every_steps >= 0,
            f"run.checkpoint_every_steps = {r.checkpoint_every_steps} must not be negative",
        )
        _at_most("run.checkpoint_every_steps", r.checkpoint_every_steps, MAX_STEPS)
        self._validate_workers()

    def _validate_workers(self) -> None:
        """An explicit worker count must be one this machine can run (cores, memory, open
        files): 100,000 workers in a run folder's config.toml would fork until it fell over."""
        w = self.data.workers
        if w.num_workers is None:
            return
        _require(w.num_workers >= 0, f"data.num_workers = {w.num_workers} must not be negative")
        limit = worker_limit(threads=w.engine == "threads")
        _require(
            w.num_workers <= limit.workers,
            f"data.num_workers = {w.num_workers} is more loader workers than this machine can "
            f"run ({limit.workers}: {limit.reason}); set --num-workers to at most {limit.workers}, "
            "or leave it unset for the bench-loader profile or the default",
        )

    def _validate_loader(self) -> None:
        """The loader fields that are not options are the trainer's to set: refuse a
        `LoaderConfig` given in Python that sets one (it would be overwritten unseen)."""
        loader, default = self.data.loader, LoaderConfig()
        for f in dataclasses.fields(LoaderConfig):
            value = getattr(loader, f.name)
            _require(
                "help" in f.metadata or value == getattr(default, f.name),
                f"data.loader.{f.name} = {value!r} is set by the trainer from the run "
                f"(the batch from run.batch_size, the seed from run.seed, the transform and "
                "order from the split); leave it at its default",
            )

    def _validate_numbers(self) -> None:
        _, _, o, r = self.parts()
        for name, number in (
            ("optim.lr", o.lr),
            ("optim.weight_decay", o.weight_decay),
            ("optim.warmup_epochs", o.warmup_epochs),
            ("optim.momentum", o.momentum),
            ("optim.clip_grad", o.clip_grad),
            ("optim.label_smoothing", o.label_smoothing),
            ("run.dist_timeout_s", r.dist_timeout_s),
        ):
            _require(
                number is None or math.isfinite(number),
                f"{name} = {number} must be a finite number",
            )
        for name, number, most in (
            ("optim.lr", o.lr, MAX_LR),
            ("optim.weight_decay", o.weight_decay, MAX_WEIGHT_DECAY),
            ("optim.warmup_epochs", o.warmup_epochs, MAX_EPOCHS),
        ):
            _require(number is None or number >= 0, f"{name} = {number} must not be negative")
            _at_most(name, number, most)
        _require(
            o.clip_grad is None or o.clip_grad > 0,
            f"optim.clip_grad = {o.clip_grad} must be positive (leave it unset for no clipping)",
        )
        if o.clip_grad is not None:
            _in_range("optim.clip_grad", o.clip_grad, CLIP_GRAD_RANGE, "a gradient norm")
        _require(0 <= o.momentum < 1, f"optim.momentum = {o.momentum} must be in [0, 1)")
        _require(
            0 <= o.label_smoothing < 1,
            f"optim.label_smoothing = {o.label_smoothing} must be in [0, 1)",
        )
        _require(r.dist_timeout_s > 0, f"run.dist_timeout_s = {r.dist_timeout_s} must be positive")
        _in_range("run.dist_timeout_s", r.dist_timeout_s, DIST_TIMEOUT_RANGE_S, "seconds")


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is cut: ``batch_size = world_size x micro_batch x accumulation``."""

    batch_size: int
    world_size: int
    micro_batch: int
    accumulation: int


def plan_batches(batch_size: int, world_size: int, micro_batch: int | None) -> BatchPlan:
    """Derive the per-rank micro-batch and accumulation steps from the global batch."""
    per_rank, rest = divmod(batch_size, world_size)
    if rest:
        raise ConfigError(
            f"--batch-size {batch_size} (global) does not divide over {world_size} ranks; "
            f"use a multiple of {world_size}"
        )
    micro = per_rank if micro_batch is None else micro_batch
    if per_rank % micro:
        raise ConfigError(
            f"--micro-batch {micro} does not divide the {per_rank} samples each of the "
            f"{world_size} ranks takes per step (--batch-size {batch_size}); use a divisor of "
            f"{per_rank}"
        )
    return BatchPlan(batch_size, world_size, micro, per_rank // micro)


def load_config(path: str | None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file at `path`, then `overrides`: option names → values (the
    flags given, `dlpipe.options.given_options`), or sections as in the file
    (``{"run": {"epochs": 3}}``).

    Raises:
        ConfigError: the file cannot be read, or a key is unknown or a value of the wrong type
            or breaking its rule (named).
    """
    try:
        values = _values(options.read_toml(path), path) if path else {}
        values.update(_values(overrides or {}, "(the options given)"))
        return options.build_config(TrainConfig, values)
    except (OptionError, LoaderConfigError) as exc:
        raise ConfigError(str(exc)) from None


def _values(table: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The options a TOML table sets, as option name → checked value (`dlpipe.options`'
    rules, with the flat keys of a section moved to where they live: `_nested`)."""
    nested = _nested(_sources_tables(table, source), (), options.option_specs(TrainConfig))
    return options.table_options(nested, TrainConfig, source)


def _sources_tables(table: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """`table` with ``[[data.sources]]`` (each a ``path``, an optional ``weight`` and optional
    ``classes``, its class names → the first dataset's) read as ``[data] path = [...]``,
    ``weights = [...]`` and ``class_map = {"N" = {...}}`` (N: the table's dataset number from
    0), which the resolved config writes."""
    data = table.get("data")
    if not isinstance(data, Mapping) or "sources" not in data:
        return table
    tables, where = data["sources"], f"config file {source}: data.sources"
    loader = data.get("loader")
    loader = loader if isinstance(loader, Mapping) else {}
    given = sorted(_SOURCE_KEYS & {*data, *loader})
    _require(
        isinstance(tables, list) and bool(tables) and all(isinstance(t, Mapping) for t in tables),
        f"{where} must be [[data.sources]] tables, each with a path (and a weight)",
    )
    if given:
        raise ConfigError(
            f"{where} and data.{'loader.' if given[0] in loader else ''}{given[0]} are both "
            "given; with [[data.sources]] tables, give each dataset's path, weight and classes "
            "in its table"
        )
    for number, entry in enumerate(tables, 1):
        unknown = sorted(set(entry) - {"path", "weight", "classes"})
        _require(
            not unknown,
            f"{where} table {number} has {unknown}; a table takes path, weight, classes",
        )
        _require("path" in entry, f"{where} table {number} has no path; give its dataset's path")
        _check_classes_table(entry.get("classes", {}), f"{where} table {number}: classes")
    weighted = ["weight" in entry for entry in tables]
    _require(all(weighted) or not any(weighted), f"{where}: give every table a weight, or none")
    rest = {key: value for key, value in data.items() if key != "sources"}
    rest["path"] = [entry["path"] for entry in tables]
    if all(weighted):
        rest["weights"] = [entry["weight"] for entry in tables]
    maps = {str(i): entry["classes"] for i, entry in enumerate(tables) if "classes" in entry}
    if maps:
        rest["class_map"] = maps
    return {**table, "data": rest}


_SOURCE_KEYS = {"path", "weights", "class_map"}  # what [[data.sources]] tables set


def _check_classes_table(classes: Any, where: str) -> None:
    """A source table's ``classes``: a table of its class names → the first dataset's."""
    _require(
        isinstance(classes, Mapping) and all(isinstance(value, str) for value in classes.values()),
        f"{where} = {classes!r} is not a table of class names; write classes = "
        "{ kitty = \"cat\" } (this dataset's class = one of the first dataset's)",
    )


def _nested(
    table: Mapping[str, Any], at: tuple[str, ...], specs: list[options.OptionSpec]
) -> dict[str, Any]:
    """`table` (the section at `at`) with each key that is the flat name of an option of a
    section below it moved there: ``[data] image_size = 224``, as config files said it before
    ``[data.loader]``, is ``[data.loader] image_size = 224``."""
    below = {s.name: s for s in specs if s.path[: len(at)] == at and len(s.path) > len(at) + 1}
    sections = {s.path[len(at)] for s in below.values()}
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping) and key in sections:
            out.setdefault(key, {}).update(_nested(value, (*at, key), specs))
        elif at and key in below:
            node = out
            for part in below[key].path[len(at) : -1]:
                node = node.setdefault(part, {})
            node[below[key].attr] = value
        else:
            out[key] = value  # (a table option's table is its value)
    return out


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _at_most(name: str, value: float | None, most: float | None) -> None:
    if value is not None and most is not None and value > most:
        shown = f"{most:g}" if isinstance(most, float) else str(most)
        derived = " (sgd's default is 0.1 x batch_size/256: set --lr)" if name == "optim.lr" else ""
        raise ConfigError(
            f"{name} = {value} must be at most {shown}{derived}; give a value in its documented "
            "range (docs/security.md, 'Training')"
        )


def _in_range(name: str, value: float, bounds: tuple[float, float], unit: str) -> None:
    low, high = bounds
    _require(
        low <= value <= high,
        f"{name} = {value} must be in [{low:g}, {high:g}] ({unit})",
    )
