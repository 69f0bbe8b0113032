"""The trainer's configuration: nested keyword-only dataclasses, a TOML file, CLI overrides.

    [data]                      [model]              [optim]                 [run]
    path = "data/pets-lmdb"     name = "resnet50"    optimizer = "sgd"       epochs = 90
    image_size = 224            channels_last = true lr = 0.4                batch_size = 1024

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
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.loading.config import DECODE_DEVICES, ENGINES
from dlpipe.machine import worker_limit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "BatchPlan",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "load_config",
    "plan_batches",
    "to_toml",
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
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
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
MODEL_NAME = re.compile(rf"^({_DOTTED}|{_DOTTED}:[A-Za-z_][A-Za-z0-9_]*)$")


class ConfigError(DlpipeError, ValueError):
    """A training option is malformed, unknown or inconsistent with another."""


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""
    train_split: str = "train"
    val_split: str = "val"  # "" trains without validation
    image_size: int = 224
    min_crop_scale: float = 0.08  # RandomResizedCrop's smallest area share (timm's --scale)
    # None: the nearest saved profile of this machine, else a short tune (tune = "auto"),
    # else all cores but one
    num_workers: int | None = None
    engine: str = "auto"  # "auto": the profile's, "processes" or "threads"
    decode: str = "auto"  # "auto": the profile's (else cpu), "cpu" or "cuda"
    tune: str = "auto"  # "auto": tune the loader for a few seconds when no saved profile fits


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "resnet18"  # a torchvision model name, or package.module:function
    channels_last: bool = False
    compile: bool = False


@dataclass(kw_only=True)
class OptimConfig:
    optimizer: str = "sgd"
    lr: float | None = None  # None: 0.1 x batch/256 (sgd), 5e-4 x batch/512 (adamw)
    weight_decay: float | None = None  # None: 1e-4 (sgd), 0.05 (adamw)
    momentum: float = 0.9
    warmup_epochs: float = 1.0
    clip_grad: float | None = None
    label_smoothing: float = 0.0


@dataclass(kw_only=True)
class RunConfig:
    epochs: int = 10
    batch_size: int = 256  # global: samples per optimizer step over all ranks
    micro_batch: int | None = None  # per rank and forward pass; None: batch_size / world size
    precision: str = "auto"  # auto: bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU
    out: str = ""  # "": runs/{dataset}-{model}
    resume: str = "auto"  # auto | none | a checkpoint path
    seed: int = 0
    max_steps: int | None = None
    early_stop_patience: int | None = None
    keep_last: int = 2
    checkpoint_every_steps: int = 0  # 0: at the end of each epoch (and on SIGTERM) only
    log_every_steps: int = 20
    max_nonfinite_steps: int = 20
    dist_timeout_s: float = 600.0  # how long a rank waits for the others in any collective
    wandb: str | None = None


@dataclass(kw_only=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def resolved(self) -> TrainConfig:
        """A copy with every derived default filled in (run folder, lr, weight decay)."""
        data, model = dataclasses.replace(self.data), dataclasses.replace(self.model)
        optim, run = dataclasses.replace(self.optim), dataclasses.replace(self.run)
        if not run.out:
            name = os.path.basename(os.path.normpath(data.path)) or "data"
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
        d, m, o, r = self.parts()
        _require(bool(d.path), "no dataset given: pass DATA or set [data] path in --config")
        _require(
            bool(MODEL_NAME.match(m.name)),
            f"--model {m.name!r} is not a torchvision model name (e.g. resnet18) nor "
            "package.module:function (a factory taking num_classes=)",
        )
        _choice("run.precision", r.precision, PRECISIONS)
        _choice("optim.optimizer", o.optimizer, OPTIMIZERS)
        self._validate_counts()
        self._validate_numbers()
        _require(
            d.image_size <= MAX_IMAGE_SIZE,
            f"data.image_size = {d.image_size} is above {MAX_IMAGE_SIZE}: give the crop side in "
            "pixels (224 for ImageNet models)",
        )
        _require(
            0 <= r.seed < 2**32, f"run.seed = {r.seed} must be in 0..{2**32 - 1} (NumPy's range)"
        )
        _require(
            r.resume in ("auto", "none") or os.path.isfile(r.resume),
            f"--resume {r.resume}: no such checkpoint file; give auto, none or a .pt path",
        )

    def _validate_counts(self) -> None:
        d, _, _, r = self.parts()
        for name, value, most in (
            ("data.image_size", d.image_size, None),  # its own message below
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
        d = self.data
        if d.num_workers is None:
            return
        _require(d.num_workers >= 0, f"data.num_workers = {d.num_workers} must not be negative")
        limit = worker_limit(threads=d.engine == "threads")
        _require(
            d.num_workers <= limit.workers,
            f"data.num_workers = {d.num_workers} is more loader workers than this machine can "
            f"run ({limit.workers}: {limit.reason}); set --num-workers to at most {limit.workers}, "
            "or leave it unset for the bench-loader profile or the default",
        )

    def _validate_numbers(self) -> None:
        d, _, o, r = self.parts()
        for name, number in (
            ("optim.lr", o.lr),
            ("optim.weight_decay", o.weight_decay),
            ("optim.warmup_epochs", o.warmup_epochs),
            ("optim.momentum", o.momentum),
            ("optim.clip_grad", o.clip_grad),
            ("optim.label_smoothing", o.label_smoothing),
            ("data.min_crop_scale", d.min_crop_scale),
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
            d.engine in ("auto", *ENGINES),
            f"data.engine = {d.engine!r} must be auto, processes or threads (the loader's workers)",
        )
        _require(
            d.decode in ("auto", *DECODE_DEVICES),
            f"data.decode = {d.decode!r} must be auto, cpu or cuda (where JPEGs are decoded)",
        )
        _require(
            d.tune in TUNE_CHOICES,
            f"data.tune = {d.tune!r} must be auto or off (whether a run without a fitting "
            "saved loader profile tunes the loader first)",
        )
        _require(
            0 < d.min_crop_scale <= 1,
            f"data.min_crop_scale = {d.min_crop_scale} must be in (0, 1]",
        )
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


def load_config(path: str | None, overrides: dict[str, dict[str, Any]]) -> TrainConfig:
    """Defaults, then the TOML file at `path`, then `overrides` ({section: {key: value}})."""
    config = TrainConfig()
    if path:
        _apply(config, _read_toml(path), f"config file {path}")
    _apply(config, overrides, "the command line")
    return config


def _read_toml(path: str) -> dict[str, Any]:
    """The TOML file at `path`: a regular file of at most `MAX_CONFIG_BYTES`, UTF-8, parsed
    (a FIFO would hang, /dev/zero read without end, a value nested 100,000 deep recurse)."""
    try:
        with storage.open_regular(path) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except storage.NotRegularFileError as exc:
        raise ConfigError(f"--config {path} is {exc.kind}; give the TOML file") from None
    except OSError as exc:
        raise ConfigError(f"--config {path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is over {MAX_CONFIG_BYTES >> 20} MiB; a training config is a "
            "few [section] key = value lines: give that file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
            f"offset {exc.start}); TOML files are UTF-8: save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(
            f"config file {path} nests arrays or tables too deeply to read; a training config "
            "is [section] key = value lines with plain values: fix the file"
        ) from None


def _apply(config: TrainConfig, values: dict[str, Any], source: str) -> None:
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for section, items in values.items():
        if section not in sections or not isinstance(items, dict):
            raise ConfigError(
                f"{source}: unknown section [{_cut(section)}]; sections are "
                + ", ".join(f"[{s}]" for s in sections)
            )
        part = sections[section]
        known = {f.name: f for f in dataclasses.fields(part)}
        for key, value in items.items():
            if key not in known:
                raise ConfigError(
                    f"{source}: [{section}] has no key {_shown(key)}; keys are {', '.join(known)}"
                )
            setattr(part, key, _typed(value, known[key], f"{source}: [{section}] {key}"))


def _typed(value: Any, spec: dataclasses.Field[Any], what: str) -> Any:
    """Check a TOML value against the field's declared type (ints widen to floats)."""
    kinds = str(spec.type).replace(" ", "").split("|")
    if value is None and "None" in kinds:
        return None
    if isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, int) and "int" in kinds:
        return value
    elif isinstance(value, (int, float)) and "float" in kinds:
        return float(value)
    elif isinstance(value, str) and "str" in kinds:
        return value
    expected = " or ".join(k for k in kinds if k != "None")
    raise ConfigError(f"{what} = {_shown(value)} must be {expected}")


def _shown(value: Any) -> str:
    """`value`'s repr, cut to 80 characters (a TOML array can be megabytes long)."""
    try:
        return _cut(repr(value))
    except RecursionError:
        return f"a deeply nested {type(value).__name__}"


def _cut(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def to_toml(config: TrainConfig) -> str:
    """The configuration as TOML (written by ``tomli_w``; unset optional values, which TOML
    cannot hold, are listed as comments at the end of their section)."""
    blocks = []
    for section, items in config.to_dict().items():
        text = tomli_w.dumps({section: {k: v for k, v in items.items() if v is not None}})
        unset = "".join(f"# {key} = (unset)\n" for key, value in items.items() if value is None)
        blocks.append(text + unset)
    return "\n".join(blocks)


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


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{name} = {value!r} must be one of {', '.join(allowed)}")
