"""`ConvertConfig`: everything ``dlpipe convert`` takes, as nested keyword-only dataclasses.

    ConvertConfig(raw, to, out, resume, overwrite, append)
      .source   SourceOptions  --source --image-col --label-col --image-root --key-col
                               --keep-empty-classes --label-from --instance-masks
      .images   ImagePolicy    --max-side --quality --seekable-jpeg
      .shards   ShardConfig    --shard-size --val-fraction --seed --on-error --dedup
      .engine   EngineConfig   --engine --workers --ray-address

Each option is one field (`dlpipe.options.option`), which holds its default, its help line and
its rule; the ``dlpipe convert`` parser is generated from the fields, a ``--config`` TOML file
sets them by the same names (``[images]`` ``quality = 90``, or ``quality = 90`` at the top), and
``dlpipe.convert(raw, to=..., **options)`` takes them by their flat names
(`ConvertConfig.from_options`), checked by the same rules, so a bad value gets the same message
from the CLI, the file and Python. The source and image groups are the classes the sources and
the shard workers read (`SourceOptions`, `ImagePolicy`). The flags of the options a printed
command repeats are `dlpipe.unfinished.CONVERT_OPTION_FLAGS` (the core reads them back from an
unfinished folder's journal); every other flag is the option's name with dashes.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dlpipe import options, storage
from dlpipe.converters.images import ImagePolicy
from dlpipe.converters.source import ConvertOptionError, SourceOptions
from dlpipe.dataset_names import DUPLICATES_NAME, ERRORS_NAME
from dlpipe.formats import FORMATS
from dlpipe.machine import usable_cpus, worker_limit
from dlpipe.options import (
    Checked,
    OptionError,
    OptionSpec,
    fraction,
    non_negative_int,
    option,
    parse_size,
    positive_int,
)
from dlpipe.unfinished import CONVERT_OPTION_FLAGS

__all__ = [
    "RUN_OPTIONS",
    "ConvertConfig",
    "ConvertOptionError",
    "EngineConfig",
    "ImagePolicy",
    "ShardConfig",
    "SourceOptions",
    "default_out",
    "option_specs",
]

RUN_OPTIONS = ("out", "resume", "overwrite", "append", "engine", "workers", "ray_address")
"""Options about one run, not about the dataset it makes: left out of the resolved config
``dlpipe convert`` writes beside the shards (``convert.toml``, `CONVERT_CONFIG_NAME`), so every
run that makes the same dataset (on Ray or locally, with any worker count, resumed or not)
writes the same file, and ``--config`` with it makes that dataset again wherever ``--out``
says."""


class _Checked(Checked):
    option_error: ClassVar[type[OptionError]] = ConvertOptionError


@dataclass(frozen=True, kw_only=True)
class ShardConfig(_Checked):
    """How samples are split, ordered and cut into shards."""

    shard_bytes: int | None = option(
        "target bytes per shard (e.g. 256MB; default: about 64 shards per split, "
        "1 MiB to 256 MiB each)",
        default=None,
        parse=parse_size,
        flag="--shard-size",
        metavar="SIZE",
    )
    val_fraction: float | None = option(
        "move this fraction of each class to a val split (when there is none)",
        default=None,
        parse=fraction,
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
    append: bool = option(
        "add the raw data to the dataset in --out as its next version: new shards only, made "
        "with the dataset's format and image options (keys stay unique; --dedup skips exact "
        "copies of its samples)",
        default=False,
    )
    source: SourceOptions = field(default_factory=SourceOptions)
    images: ImagePolicy = field(default_factory=ImagePolicy)
    shards: ShardConfig = field(default_factory=ShardConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resume and self.overwrite:
            raise ConvertOptionError("--resume and --overwrite contradict each other; choose one")
        if self.append and self.overwrite:
            raise ConvertOptionError(
                "--append and --overwrite contradict each other: --append adds a version to the "
                "dataset in --out, --overwrite replaces it; choose one"
            )

    @classmethod
    def from_options(cls, raw: str | os.PathLike[str], to: str, **values: Any) -> ConvertConfig:
        """A config from flat option names, as ``dlpipe.convert`` and the CLI take them.

        Raises:
            ConvertOptionError: an unknown option, or a value of the wrong type or out of range.
        """
        names = [s.name for s in option_specs()]
        unknown = sorted(set(values) - set(names))
        if unknown:
            known = ", ".join(n for n in names if n not in ("raw", "to"))
            raise ConvertOptionError(
                f"{unknown[0]!r} is not a conversion option; the options are {known}"
            )
        try:
            return options.build_config(cls, {**values, "raw": os.fspath(raw), "to": to})
        except ConvertOptionError:
            raise
        except OptionError as exc:
            raise ConvertOptionError(str(exc)) from None

    def value_of(self, name: str) -> Any:
        """The value of the option with flat name `name` (e.g. ``"quality"``)."""
        return dict((s.name, v) for s, v in options.iter_options(self))[name]

    def output(self) -> str:
        """``--out``, or `default_out` when it is not given."""
        return self.out or default_out(self.raw, self.to)

    def command(self, action: str) -> str:
        """The ``dlpipe convert`` command line that repeats this conversion with `action`
        (none: "").

        Every option that shapes the output is in it (and ``--append``), so the printed
        ``--resume`` command matches the interrupted run's plan.
        """
        parts = ["dlpipe", "convert", self.raw, "--to", self.to, "--out", self.output()]
        appending = ["--append"] if self.append else []
        return shlex.join([*parts, *self.option_args(), *appending, *([action] if action else [])])

    def option_args(self) -> list[str]:
        """The flags (and values) of every repeated option that differs from its default."""
        args: list[str] = []
        for spec, value in options.iter_options(self):
            if spec.name in CONVERT_OPTION_FLAGS and value != spec.default:
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
            "seekable_jpeg": self.images.seekable,
            "val_fraction": self.shards.val_fraction,
            "seed": self.shards.seed,
            "on_error": self.shards.on_error,
            "dedup": self.shards.dedup,
            "instance_masks": self.source.instance_masks,
        }


def option_specs() -> list[OptionSpec]:
    """Every option, top-level ones first, then group by group (the CLI's order)."""
    return options.option_specs(ConvertConfig)


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
