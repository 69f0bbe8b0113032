"""`ConvertConfig`: everything ``dlpipe convert`` takes, as nested keyword-only dataclasses.

    ConvertConfig(raw, to, out, resume, overwrite)
      .source   SourceConfig   --source --image-col --label-col --image-root --key-col
                               --keep-empty-classes --label-from --instance-masks
      .images   ImageConfig    --max-side --quality
      .shards   ShardConfig    --shard-size --val-fraction --seed --on-error
      .engine   EngineConfig   --engine --workers --ray-address

Each option is one field, which holds its default, its help line and its rule; the
``dlpipe convert`` parser is generated from the fields (`option_specs`), and
``dlpipe.convert(raw, to=..., **options)`` takes the same options by their flat names
(`ConvertConfig.from_options`), checked by the same rules, so a bad value gets the same message
from the CLI and from Python. The flags of the options a printed command repeats are
`dlpipe.unfinished.CONVERT_OPTION_FLAGS` (the core reads them back from an unfinished
folder's journal); every other flag is the option's name with dashes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import MISSING, dataclass, field
from typing import Any

from dlpipe import storage
from dlpipe.cli import int_in_range, non_negative_int, positive_int
from dlpipe.converters.filenames import label_rule
from dlpipe.converters.sources import SOURCE_KINDS
from dlpipe.errors import DlpipeError
from dlpipe.formats import FORMATS
from dlpipe.formats.writer import DUPLICATES_NAME, ERRORS_NAME
from dlpipe.machine import usable_cpus, worker_limit
from dlpipe.turbojpeg import region_library
from dlpipe.unfinished import CONVERT_OPTION_FLAGS

__all__ = [
    "ConvertConfig",
    "ConvertOptionError",
    "EngineConfig",
    "ImageConfig",
    "OptionSpec",
    "ShardConfig",
    "SourceConfig",
    "default_out",
    "option_specs",
    "parse_size",
]


class ConvertOptionError(DlpipeError, ValueError):
    """A conversion option is unknown, of the wrong type, or breaks its rule."""


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9}
_UNITS |= {"gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text: str) -> int:
    """``"256MB"`` → 256000000; ``"64MiB"``, ``"1.5GB"``, ``"500000"`` (bytes) also work."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes with an optional unit, e.g. 256MB or 64MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction between 0 and 1") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def _label_rule(text: str) -> str:
    try:
        label_rule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(choices)})"
            )
        return text

    return parse


def option(
    help: str,
    *,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    name: str | None = None,
    flag: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A config field that is also a ``dlpipe convert`` option (see `OptionSpec`)."""
    if choices is not None:
        parse, metavar = _one_of(choices), metavar or "{" + ",".join(choices) + "}"
    facts = {"help": help, "parse": parse, "choices": choices, "name": name, "flag": flag}
    facts["metavar"] = metavar
    return field(default=default, default_factory=default_factory, metadata=facts)


@dataclass(frozen=True)
class OptionSpec:
    """One option: flat `name` (``dlpipe.convert``'s keyword), where it lives, its CLI face."""

    name: str
    group: str | None  # the ConvertConfig field holding it; None: ConvertConfig itself
    attr: str
    flag: str  # "--quality"; a name without dashes is positional
    kind: str  # "bool", "int", "float" or "str"
    optional: bool  # None is allowed
    default: Any  # MISSING: required
    help: str
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None
    metavar: str | None

    @property
    def repeated(self) -> bool:
        """Printed commands (``--resume``, ``--overwrite``) repeat this option."""
        return self.name in CONVERT_OPTION_FLAGS

    def check(self, value: Any) -> Any:
        """`value` when it is of this option's type and keeps its rule.

        Raises:
            ConvertOptionError: naming the flag, the value and the rule.
        """
        if value is None and self.optional:
            return None
        types: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "str": (str,)}
        wanted = types.get(self.kind, (int, float))
        if not isinstance(value, wanted) or (self.kind != "bool" and isinstance(value, bool)):
            raise ConvertOptionError(
                f"argument {self.flag}: {value!r} is a {type(value).__name__}; give "
                f"{'an' if self.kind == 'int' else 'a'} {self.kind}"
                + (" or None" if self.optional else "")
            )
        if self.parse is not None:
            try:
                self.parse(str(value))
            except argparse.ArgumentTypeError as exc:
                raise ConvertOptionError(f"argument {self.flag}: {exc}") from None
        return value


def _specs_of(cls: type, group: str | None) -> Iterator[OptionSpec]:
    for spec in dataclasses.fields(cls):
        if "help" not in spec.metadata:
            continue
        facts = spec.metadata
        name = facts["name"] or spec.name
        kinds = str(spec.type).replace(" ", "").split("|")
        default = spec.default
        if spec.default_factory is not MISSING:
            default = spec.default_factory()
        yield OptionSpec(
            name=name,
            group=group,
            attr=spec.name,
            flag=facts["flag"] or CONVERT_OPTION_FLAGS.get(name) or "--" + name.replace("_", "-"),
            kind=next(k for k in kinds if k != "None"),
            optional="None" in kinds,
            default=default,
            help=facts["help"],
            parse=facts["parse"],
            choices=facts["choices"],
            metavar=facts["metavar"],
        )


class _Checked:
    """A config whose `__post_init__` checks every option field by its rule."""

    def __post_init__(self) -> None:
        for spec in _specs_of(type(self), None):
            spec.check(getattr(self, spec.attr))


@dataclass(frozen=True, kw_only=True)
class SourceConfig(_Checked):
    """How to read the raw data."""

    kind: str = option(
        "raw layout (default: detected)",
        default="auto",
        choices=("auto", *SOURCE_KINDS),
        name="source",
    )
    image_col: str | None = option("table column holding image paths or bytes", default=None)
    label_col: str | None = option(
        "table column holding labels (names or integers); none: the table has no labels",
        default=None,
    )
    image_root: str | None = option(
        "folder a table's image paths are looked up in after the table's own folder "
        "(default: the one sub-folder beside the table that holds them)",
        default=None,
        metavar="DIR",
    )
    key_col: str | None = option(
        "the table column whose values become sample keys (default: a __key__, key or id "
        "column, else keys from the image paths or row numbers)",
        default=None,
    )
    keep_empty_classes: bool = option(
        "keep class folders without images as classes with no samples (else refused)",
        default=False,
    )
    label_from: str | None = option(
        "labels from image file names (the filenames source): name-prefix, the name before "
        "its trailing number (cat.0.jpg: cat; great_pyrenees_173.jpg: great_pyrenees), or a "
        "regular expression searched in each file name whose one group, or group named label, "
        "is the label",
        default=None,
        parse=_label_rule,
        metavar="name-prefix|REGEX",
    )
    instance_masks: bool = option(
        "COCO's polygon and RLE segmentations as masks.json: one COCO RLE mask per object of "
        "boxes.json (the coco source; off: counted as unused)",
        default=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label_from is not None and self.kind not in ("auto", "filenames"):
            raise ConvertOptionError(
                f"--label-from takes labels from image file names, which only --source "
                f"filenames reads, not --source {self.kind}; drop one of the two"
            )
        if self.instance_masks and self.kind not in ("auto", "coco"):
            raise ConvertOptionError(
                f"--instance-masks converts COCO's segmentations, which only --source coco "
                f"reads, not --source {self.kind}; drop one of the two"
            )


@dataclass(frozen=True, kw_only=True)
class ImageConfig(_Checked):
    """What happens to each image on the way into a shard."""

    max_side: int | None = option(
        "re-encode images whose longer side exceeds N (at least 8)",
        default=None,
        parse=int_in_range(8),
        metavar="N",
    )
    quality: int = option(
        "JPEG/WebP quality when re-encoding (1..100)", default=95, parse=int_in_range(1, 100)
    )
    seekable_jpeg: bool = option(
        "rewrite JPEGs losslessly with a restart marker per MCU, so that train crops "
        "entropy-decode only their box (the same pixels; files about 3 %% bigger; needs "
        "pip install 'dlpipe[jpeg-region]')",
        default=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seekable_jpeg and region_library() is None:
            raise ConvertOptionError(
                "--seekable-jpeg needs libjpeg-turbo 3's TurboJPEG library, not found here: "
                "pip install 'dlpipe[jpeg-region]' (or a system libturbojpeg 3), or drop "
                "--seekable-jpeg"
            )


@dataclass(frozen=True, kw_only=True)
class ShardConfig(_Checked):
    """How samples are split, ordered and cut into shards."""

    shard_bytes: int | None = option(
        "target bytes per shard (e.g. 256MB; default: about 64 shards per split, "
        "1 MiB to 256 MiB each)",
        default=None,
        parse=parse_size,
        metavar="SIZE",
    )
    val_fraction: float | None = option(
        "move this fraction of each class to a val split (when there is none)",
        default=None,
        parse=_fraction,
    )
    seed: int = option("seeds the shuffle and the val split", default=0, parse=non_negative_int)
    on_error: str = option(
        f"a bad sample is skipped and listed in {ERRORS_NAME}, or stops the run",
        default="skip",
        choices=("skip", "fail"),
    )
    dedup: bool = option(
        "drop exact and near-duplicate images (within and across splits) before writing, "
        "keeping one of each group (an evaluation split's copy first); listed in "
        f"{DUPLICATES_NAME}",
        default=False,
    )


@dataclass(frozen=True, kw_only=True)
class EngineConfig(_Checked):
    """Where the shard tasks run."""

    kind: str = option(
        "local processes, or a Ray cluster",
        default="local",
        choices=("local", "ray"),
        name="engine",
    )
    workers: int = option(
        "worker processes (default: every usable core)",
        default_factory=usable_cpus,
        parse=positive_int,
    )
    ray_address: str | None = option(
        "Ray cluster address (default: start or find one)", default=None
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind == "local":
            limit = worker_limit()
            if self.workers > limit.workers:
                raise ConvertOptionError(
                    f"argument --workers: {self.workers} worker processes are more than this "
                    f"machine can run ({limit.workers}: {limit.reason}); give --workers "
                    f"{limit.workers} or fewer"
                )


_GROUPS: dict[str, type] = {
    "source": SourceConfig,
    "images": ImageConfig,
    "shards": ShardConfig,
    "engine": EngineConfig,
}


@dataclass(frozen=True, kw_only=True)
class ConvertConfig(_Checked):
    """Everything ``dlpipe convert`` takes; see the module docstring and docs/converting.md."""

    raw: str = option(
        "raw data: a folder (class folders, key.ext files, CIFAR/MNIST files) or a table "
        "(CSV/TSV/JSONL/Parquet)",
        flag="raw",
    )
    to: str = option("shard format", choices=tuple(sorted(FORMATS)))
    out: str | None = option(
        "output folder or URL (default: $DLPIPE_DATA_DIR/<name>-<fmt>, else <raw>-<fmt> "
        "beside the raw data)",
        default=None,
    )
    resume: bool = option("finish an interrupted conversion", default=False)
    overwrite: bool = option("replace the dataset in --out", default=False)
    source: SourceConfig = field(default_factory=SourceConfig)
    images: ImageConfig = field(default_factory=ImageConfig)
    shards: ShardConfig = field(default_factory=ShardConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resume and self.overwrite:
            raise ConvertOptionError("--resume and --overwrite contradict each other; choose one")

    @classmethod
    def from_options(cls, raw: str | os.PathLike[str], to: str, **options: Any) -> ConvertConfig:
        """A config from flat option names, as ``dlpipe.convert`` and the CLI take them.

        Raises:
            ConvertOptionError: an unknown option, or a value of the wrong type or out of range.
        """
        specs = {s.name: s for s in option_specs()}
        unknown = sorted(set(options) - set(specs))
        if unknown:
            known = ", ".join(n for n in specs if n not in ("raw", "to"))
            raise ConvertOptionError(
                f"{unknown[0]!r} is not a conversion option; the options are {known}"
            )
        groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        top: dict[str, Any] = {"raw": os.fspath(raw), "to": to}
        for name, value in options.items():
            spec = specs[name]
            (top if spec.group is None else groups[spec.group])[spec.attr] = value
        made = {g: _GROUPS[g](**values) for g, values in groups.items()}
        return cls(**top, **made)

    def value_of(self, name: str) -> Any:
        """The value of the option with flat name `name` (e.g. ``"quality"``)."""
        spec = next(s for s in option_specs() if s.name == name)
        return getattr(self if spec.group is None else getattr(self, spec.group), spec.attr)

    def output(self) -> str:
        """``--out``, or `default_out` when it is not given."""
        return self.out or default_out(self.raw, self.to)

    def command(self, action: str) -> str:
        """The ``dlpipe convert`` command line that repeats this conversion with `action`.

        Every option that shapes the output is in it, so the printed ``--resume`` command
        matches the interrupted run's plan.
        """
        parts = ["dlpipe", "convert", self.raw, "--to", self.to, "--out", self.output()]
        return shlex.join([*parts, *self.option_args(), action])

    def option_args(self) -> list[str]:
        """The flags (and values) of every repeated option that differs from its default."""
        args: list[str] = []
        for spec in option_specs():
            value = self.value_of(spec.name)
            if spec.repeated and value != spec.default:
                args += [spec.flag] if isinstance(value, bool) else [spec.flag, str(value)]
        return args

    def output_options(self, image_field: str, source_kind: str) -> dict[str, Any]:
        """The options that shape the output (recorded in the manifest and the plan)."""
        return {
            "format": self.to,
            "source": source_kind,
            "image_field": image_field,
            "shard_bytes": self.shards.shard_bytes,
            "max_side": self.images.max_side,
            "quality": self.images.quality,
            "seekable_jpeg": self.images.seekable_jpeg,
            "val_fraction": self.shards.val_fraction,
            "seed": self.shards.seed,
            "on_error": self.shards.on_error,
            "dedup": self.shards.dedup,
            "instance_masks": self.source.instance_masks,
        }


def option_specs() -> list[OptionSpec]:
    """Every option, top-level ones first, then group by group (the CLI's order)."""
    specs = list(_specs_of(ConvertConfig, None))
    for group, cls in _GROUPS.items():
        specs += _specs_of(cls, group)
    return specs


def default_out(raw: str, fmt: str) -> str:
    """``$DLPIPE_DATA_DIR/<name>-<fmt>`` when set, else ``<raw>-<fmt>`` beside the raw data
    (an archive's name without ``.zip``/``.tar``/``.tar.gz``; a folder inside an archive,
    ``a.zip/train``, beside the archive)."""
    if storage.is_url(raw):  # shards in object storage: the output in this folder
        name = raw.rstrip("/").rsplit("/", 1)[-1].removesuffix(".tar")
        return os.path.join(os.environ.get("DLPIPE_DATA_DIR") or os.getcwd(), f"{name}-{fmt}")
    raw = os.path.abspath(raw)
    name = os.path.basename(raw.rstrip(os.sep))
    if os.path.isfile(raw):
        lower = name.lower()
        suffix = next((s for s in (".tar.gz", ".tar") if lower.endswith(s)), None)
        name = name[: -len(suffix)] if suffix else os.path.splitext(name)[0]
    beside = os.path.dirname(raw.rstrip(os.sep))
    while beside != os.path.dirname(beside) and not os.path.lexists(beside):
        beside = os.path.dirname(beside)  # a folder inside an archive: beside the archive
    if os.path.isfile(beside):
        beside = os.path.dirname(beside)
    parent = os.environ.get("DLPIPE_DATA_DIR") or beside
    return os.path.join(parent, f"{name}-{fmt}")
