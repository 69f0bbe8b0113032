"""Loader profiles: measured DataLoader worker settings, saved and found again.

``dlpipe bench-loader`` (or ``dlpipe train``'s own short tune) measures `WorkerSettings` for one
dataset on one machine and saves the fastest as a `LoaderProfile`, keyed by the machine
(`machine_key`) and the `LoaderConfig` (`loader_key`, the one place a config becomes a key) it
was measured on. ``make_loader(workers="auto")`` and ``dlpipe train`` use the profile of the
*nearest* key (`nearest_profile`): the settings that matter, the worker count and the engine,
barely depend on the batch or image size, so a profile measured at batch 64, 224 px serves a
run at batch 256, 160 px far better than the defaults do. The rule:

1. the machine key must be equal (CPU count, GPU model, torch version): never another
   machine's profile;
2. a profile that contradicts this machine (`contradiction`) is passed over, with a warning;
3. a loader with a recipe (``"train"``, ``"eval"``, a detection policy) may use a profile of
   any recipe (a profile lives beside its dataset: the recipes are its task's); one with raw
   samples or a custom transform only one of its own;
4. of those, the nearest wins, comparing in order: the same transform, the same decode
   device (when the caller asks for one), the same split, then the smallest
   ``|log2(batch ratio)| + |log2(image size ratio)| + |log2(crop scale ratio)|``;
   a tie goes to the profile saved last (beside the dataset before the user cache).

`ProfileChoice.reason` says which profile and why, as the trainer's loader line prints it:
``profile measured at batch 64, 224 px on this machine; nearest to batch 256, 160 px``.
`find_profile` still finds an exact match only.

Profiles live beside the dataset in ``dlpipe-profiles.json``, or, when the dataset folder is not
writable (or is a URL), in ``$XDG_CACHE_HOME/dlpipe/profiles/<16 hex>.json``, named by the
SHA-256 of the dataset's absolute path or URL. Schema version 1::

    {
      "schema": "dlpipe.loader-profiles", "schema_version": 1,
      "profiles": [
        {"num_workers": 4, "prefetch_factor": 2, "pin_memory": true,
         "persistent_workers": true, "engine": "processes", "decode": "cpu",
         "multiprocessing_context": null, "samples_per_s": 1234.5,
         "machine": {"cpus": 16, "gpu": "NVIDIA H200", "torch": "2.4.0"},
         "loader": {"split": "train", "batch_size": 256, "transform": "train",
                    "image_size": 224, "min_crop_scale": 0.08},  # null unless "train"
                    # image_size null: a detection loader keeping each image's size
         "created_by": "0.1.0"}
      ]
    }

The settings' keys are `WorkerSettings`' fields, written and read by introspection: a field
added there is stored with no change here, and a profile without a field's key (written
before the field existed: ``engine`` before the thread engine, ``decode`` before GPU decode)
takes the field's default (``processes``, ``cpu``). A ``loader`` key without
``min_crop_scale`` (written before the tuner measured the crop scale) was measured with the
default crop, 0.08, and is read as such.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from dlpipe import storage
from dlpipe._version import __version__
from dlpipe.errors import DlpipeError
from dlpipe.loading.config import (
    MAX_BATCH_SIZE,
    MAX_IMAGE_SIZE,
    TRANSFORMS,
    LoaderConfig,
    LoaderConfigError,
    WorkerSettings,
)
from dlpipe.machine import usable_cpus
from dlpipe.manifest import PROFILES_NAME

__all__ = [
    "PROFILES_NAME",
    "LoaderProfile",
    "ProfileChoice",
    "ProfileError",
    "ProfileSaveError",
    "cache_file",
    "contradiction",
    "find_profile",
    "gpu_name",
    "loader_key",
    "machine_key",
    "nearest_profile",
    "save_profile",
    "select_profile",
]

SCHEMA_NAME = "dlpipe.loader-profiles"
SCHEMA_VERSION = 1
_FIX = "re-run `dlpipe bench-loader` on this dataset (it rewrites the file), or delete the file"
# a profiles file is untrusted (it ships inside a dataset folder): settings past these would
# start a fork bomb or pin gigabytes of prefetched batches, and no measurement picks them
MAX_NUM_WORKERS = 256  # and MAX_PREFETCH_FACTOR, the loader's own bound
MAX_PROFILES_BYTES = 1 << 20
_MACHINE_KEYS = {"cpus", "gpu", "torch"}
_LOADER_KEYS = {"split", "batch_size", "transform", "image_size", "min_crop_scale"}
_LEGACY_CROP_SCALE = 0.08  # what the tuner measured before the key named the crop scale

log = logging.getLogger("dlpipe")


class ProfileError(DlpipeError, ValueError):
    """A loader profiles file (or a profile in it) is malformed or of an unknown version."""


class ProfileSaveError(DlpipeError, OSError):
    """Neither the dataset folder nor the user cache could take the profiles file."""


@dataclass(frozen=True, kw_only=True)
class LoaderProfile:
    """Worker settings measured for one dataset, machine and loader config.

    Attributes:
        settings: the measured `WorkerSettings`.
        samples_per_s: the throughput they were measured at.
        machine: the `machine_key` of the machine they were measured on.
        loader: the `loader_key` of the loader config they were measured for.
        created_by: the dlpipe version that measured them.
    """

    settings: WorkerSettings
    samples_per_s: float
    machine: dict[str, Any]
    loader: dict[str, Any]
    created_by: str = __version__

    def to_json(self) -> dict[str, Any]:
        """The profile as stored: the settings' fields at the top level, then the rest."""
        return {
            **dataclasses.asdict(self.settings),
            "samples_per_s": self.samples_per_s,
            "machine": dict(self.machine),
            "loader": dict(self.loader),
            "created_by": self.created_by,
        }

    @classmethod
    def from_json(cls, data: Any) -> LoaderProfile:
        """Parse one profile object; `ProfileError` says which key breaks which rule. A
        `WorkerSettings` field the profile lacks (it was written before the field existed)
        takes the field's default."""
        if not isinstance(data, dict):
            raise ProfileError("a profile is not a JSON object")
        try:
            settings = _settings(data)
            return cls(
                settings=settings,
                samples_per_s=_rate(data["samples_per_s"]),
                machine=_keyed(data["machine"], "machine", _MACHINE_KEYS),
                loader=_loader_keyed(data["loader"]),
                created_by=_text(data["created_by"], "created_by"),
            )
        except KeyError as exc:
            raise ProfileError(f"a profile is missing key {exc.args[0]!r}") from None
        except LoaderConfigError as exc:
            raise ProfileError(str(exc)) from None

    def matches(self, machine: dict[str, Any], loader: dict[str, Any]) -> bool:
        return self.machine == machine and self.loader == loader


def gpu_name() -> str:
    """The name of CUDA device 0, or ``"none"`` without CUDA."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def machine_key() -> dict[str, Any]:
    """What a profile's settings depend on: CPU count, GPU model and torch version."""
    import torch

    return {"cpus": usable_cpus(), "gpu": gpu_name(), "torch": torch.__version__.split("+")[0]}


def loader_key(split: str, config: LoaderConfig, task: str | None = None) -> dict[str, Any]:
    """What a profile's settings were measured for: the split and the parts of `config` that
    change the work per sample (the order and the seed do not; the crop scale only for the
    ``"train"`` transform, None for the others), `config` resolved for a dataset of `task`
    (`LoaderConfig.resolved`: None is classification's defaults). The image size is None
    for a detection loader that keeps each image's size."""
    resolved = config.resolved(split, task)
    transform = resolved.transform_name(split)
    return {
        "split": split,
        "batch_size": resolved.batch_size,
        "transform": transform,
        "image_size": resolved.image_size,
        "min_crop_scale": float(resolved.min_crop_scale) if transform == "train" else None,
    }


def writable(dataset_path: str) -> bool:
    """Whether profiles can be saved beside the dataset (a local folder we may write to)."""
    return not storage.is_url(dataset_path) and os.access(storage.local_path(dataset_path), os.W_OK)


def cache_file(dataset_path: str) -> str:
    """The user-cache profiles file for `dataset_path` (``$XDG_CACHE_HOME``, ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(_identity(dataset_path).encode("utf-8")).hexdigest()[:16]
    return os.path.join(cache, "dlpipe", "profiles", f"{digest}.json")


def save_profile(dataset_path: str | os.PathLike[str], profile: LoaderProfile) -> str:
    """Save `profile` for the dataset, replacing one with the same machine and loader keys.

    Returns:
        The file written: beside the dataset when its folder is writable, else (or when
        writing there fails) the user cache.

    Raises:
        ProfileSaveError: neither place could be written; names each place and the OS error.
    """
    path = os.fspath(dataset_path)
    beside = storage.join(path, PROFILES_NAME)
    places = [beside] if writable(path) else []
    failures = [] if places else [f"{beside} (the folder is not writable)"]
    for dest in [*places, cache_file(path)]:
        try:
            _write_profiles(dest, profile)
        except OSError as exc:
            failures.append(f"{dest} ({exc.strerror or exc})")
            continue
        return dest
    raise ProfileSaveError(
        f"could not save the loader profile to {' or '.join(failures)}; set XDG_CACHE_HOME "
        "to a writable folder or make the dataset folder writable, then re-run "
        "`dlpipe bench-loader` (or pass --no-save)"
    )


def _write_profiles(dest: str, profile: LoaderProfile) -> None:
    try:
        kept = [p for p in _read(dest) if not p.matches(profile.machine, profile.loader)]
    except ProfileError as exc:
        log.warning("replacing an unreadable profiles file: %s", exc)
        kept = []
    document = {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "profiles": [p.to_json() for p in [*kept, profile]],
    }
    if not storage.is_url(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
    storage.atomic_write_bytes(dest, (json.dumps(document, indent=2) + "\n").encode("utf-8"))


def find_profile(
    dataset_path: str | os.PathLike[str],
    *,
    split: str,
    config: LoaderConfig,
    strict: bool = True,
    task: str | None = None,
) -> tuple[LoaderProfile, str] | None:
    """The saved profile for exactly this machine, split and loader config, and its file.

    Looks beside the dataset, then in the user cache; only an exact `machine_key` and
    `loader_key` match counts (`nearest_profile` is what loaders use). With ``strict=False``
    a malformed file is one warning on the ``dlpipe`` logger (naming it and the fix) and is
    passed over. `task`: the dataset's (`loader_key`).

    Raises:
        ProfileError: (``strict``) a profiles file there is malformed or of an unknown
            schema version.
    """
    machine, loader = machine_key(), loader_key(split, config, task)
    for profile, source in _saved(os.fspath(dataset_path), strict=strict):
        if profile.matches(machine, loader):
            return profile, source
    return None


@dataclass(frozen=True)
class ProfileChoice:
    """A saved profile chosen for a loader (`nearest_profile`).

    Attributes:
        profile: the profile chosen.
        source: the file it came from.
        wanted: the `loader_key` of the loader it was chosen for.
    """

    profile: LoaderProfile
    source: str
    wanted: dict[str, Any]

    @property
    def exact(self) -> bool:
        """Whether the profile was measured for this very loader config."""
        return self.profile.loader == self.wanted

    def reason(self) -> str:
        """Which profile and why: ``profile measured at batch 64, 224 px on this machine;
        nearest to batch 256, 160 px`` (``...; the same loader`` for an exact match)."""
        measured = _describe(self.profile.loader, self.wanted)
        if self.exact:
            return f"profile measured at {measured} on this machine; the same loader"
        wanted = _describe(self.wanted, self.profile.loader)
        return f"profile measured at {measured} on this machine; nearest to {wanted}"


def nearest_profile(
    dataset_path: str | os.PathLike[str],
    *,
    split: str,
    config: LoaderConfig,
    decode: str | None = None,
    task: str | None = None,
) -> ProfileChoice | None:
    """The saved profile of this machine nearest to this loader (the module docstring's
    rule), or None when none may serve it. `decode` (``"cpu"``/``"cuda"``) prefers profiles
    measured decoding there; `task` is the dataset's (`loader_key`). A malformed profiles
    file is a warning naming it and the fix, and is passed over, as is a profile that
    contradicts this machine.
    """
    path = os.fspath(dataset_path)
    machine, wanted = machine_key(), loader_key(split, config, task)
    saved = _saved(path, strict=False)
    candidates = [
        (profile, source, index)
        for index, (profile, source) in enumerate(saved)
        if profile.machine == machine and _may_serve(profile.loader, wanted)
    ]
    sources = [source for _, source in saved]
    candidates.sort(key=lambda c: (*_distance(c[0], wanted, decode), sources.index(c[1]), -c[2]))
    passed_over: list[tuple[str, str]] = []
    chosen = None
    for profile, source, _ in candidates:
        problem = contradiction(profile)
        if problem is None:
            chosen = ProfileChoice(profile=profile, source=source, wanted=wanted)
            break
        passed_over.append((source, problem))
    then = "passed over" if chosen else "passed over and the default worker settings are used"
    for source, problem in passed_over:
        log.warning(
            "the loader profile in %s %s; a profile is advice, so it is %s (%s)",
            source,
            problem,
            then,
            _FIX,
        )
    return chosen


def select_profile(
    profile: str | LoaderProfile | None,
    dataset_path: str | os.PathLike[str],
    *,
    split: str,
    config: LoaderConfig,
    decode: str | None = None,
    task: str | None = None,
) -> LoaderProfile | None:
    """`make_loader`'s ``profile=``: ``"auto"`` finds the nearest saved one
    (`nearest_profile`, logged at INFO with which and why), else as given.

    A malformed profiles file does not stop ``"auto"``: a profile only makes loading faster,
    so it is one warning naming the file and the fix, and it is passed over.
    """
    if profile is None or isinstance(profile, LoaderProfile):
        return profile
    if profile != "auto":
        raise ProfileError(f"profile={profile!r}: pass 'auto', a LoaderProfile or None")
    choice = nearest_profile(dataset_path, split=split, config=config, decode=decode, task=task)
    if choice is None:
        log.debug(
            "no loader profile for %s on this machine; using default worker settings",
            os.fspath(dataset_path),
        )
        return None
    log.info(
        "using loader profile from %s: %s (measured %.0f samples/s); %s",
        choice.source,
        choice.profile.settings.line(),
        choice.profile.samples_per_s,
        choice.reason(),
    )
    return choice.profile


def _saved(path: str, *, strict: bool) -> list[tuple[LoaderProfile, str]]:
    """Every profile saved for the dataset at `path`, beside it first, then in the user
    cache, each with its file (in the order saved)."""
    found = []
    for source in (storage.join(path, PROFILES_NAME), cache_file(path)):
        try:
            profiles = _read(source)
        except ProfileError as exc:
            if strict:
                raise
            log.warning("%s; it is passed over", exc)
            continue
        found += [(profile, source) for profile in profiles]
    return found


_IMAGE_TRANSFORMS = TRANSFORMS[1:]  # the recipes: a profile is kept beside its dataset


def _may_serve(measured: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a profile measured for loader key `measured` may serve `wanted`: either image
    recipe serves a recipe (of the dataset's task: profiles live beside their dataset); raw
    samples or a custom transform only its own."""
    image = measured["transform"] in _IMAGE_TRANSFORMS and wanted["transform"] in _IMAGE_TRANSFORMS
    return image or measured["transform"] == wanted["transform"]


def _distance(
    profile: LoaderProfile, wanted: dict[str, Any], decode: str | None
) -> tuple[bool, bool, bool, float]:
    """How far `profile` is from the loader `wanted`, to sort by (smaller is nearer)."""
    key = profile.loader

    def far(name: str) -> float:
        a, b = key[name], wanted[name]
        return 0.0 if a is None or b is None else abs(math.log2(a / b))

    return (
        key["transform"] != wanted["transform"],
        decode is not None and profile.settings.decode != decode,
        key["split"] != wanted["split"],
        far("batch_size") + far("image_size") + far("min_crop_scale"),
    )


def _describe(key: dict[str, Any], other: dict[str, Any]) -> str:
    """``batch 64, 224 px``, and the transform, crop scale and split where they differ from
    `other`'s."""
    size = key["image_size"]
    parts = [f"batch {key['batch_size']}", "own sizes" if size is None else f"{size} px"]
    if key["transform"] != other["transform"]:
        parts.append(f"{key['transform']} transform")
    if key["min_crop_scale"] != other["min_crop_scale"] and key["min_crop_scale"] is not None:
        parts.append(f"crop scale {key['min_crop_scale']:g}")
    if key["split"] != other["split"]:
        parts.append(f"split {key['split']!r}")
    return ", ".join(parts)


def contradiction(profile: LoaderProfile) -> str | None:
    """What makes `profile` unusable on this machine, or None: settings that contradict its
    own machine key or this machine (a GPU decode or pinned memory without a GPU). A worker
    count past what the machine can run is cut by the loader (`bounded_workers`)."""
    import torch

    s, gpu = profile.settings, profile.machine.get("gpu")
    has_gpu = torch.cuda.is_available()
    for wanted, what in ((s.decode == "cuda", "decode=cuda"), (s.pin_memory, "pin_memory=true")):
        if wanted and (gpu == "none" or not has_gpu):
            where = "its machine key says gpu: none" if gpu == "none" else "this machine has none"
            return f"asks for {what}, which needs a CUDA GPU, but {where}"
    transform = profile.loader.get("transform")
    if s.decode == "cuda" and transform not in ("train", "eval"):
        only = "the GPU decodes for the 'train' and 'eval' transforms only"
        return f"asks for decode=cuda with transform {transform!r}; {only}"
    return None


def _identity(dataset_path: str) -> str:
    if storage.is_url(dataset_path):
        return dataset_path.rstrip("/")
    return os.path.abspath(storage.local_path(dataset_path))


def _read(source: str) -> list[LoaderProfile]:
    """The profiles in one file ([] when there is none); `ProfileError` naming it if bad."""
    try:
        raw = _read_capped(source)
    except FileNotFoundError:
        return []
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        reason = exc if isinstance(exc, ValueError) else "nested too deeply"
        raise ProfileError(f"{source} is not valid JSON ({reason}); {_FIX}") from None
    try:
        return _parse(data)
    except ProfileError as exc:
        raise ProfileError(f"{source} is not a valid loader profiles file: {exc}; {_FIX}") from None


def _read_capped(source: str) -> bytes:
    """The file's bytes, refusing anything but a regular file of at most MAX_PROFILES_BYTES
    (a FIFO would hang the loader, a link to /dev/zero would read without end)."""
    if storage.is_url(source):
        with storage.open_read(source) as f:
            raw = f.read(MAX_PROFILES_BYTES + 1)
    else:
        try:
            f = storage.open_regular(storage.local_path(source))
        except storage.NotRegularFileError:
            raise ProfileError(f"{source} is not a regular file; {_FIX}") from None
        with f:
            raw = f.read(MAX_PROFILES_BYTES + 1)
    if len(raw) > MAX_PROFILES_BYTES:
        raise ProfileError(f"{source} is over {MAX_PROFILES_BYTES} bytes; {_FIX}")
    return raw


def _parse(data: Any) -> list[LoaderProfile]:
    if not isinstance(data, dict):
        raise ProfileError("the top level is not a JSON object")
    if data.get("schema") != SCHEMA_NAME:
        raise ProfileError(f"'schema' is {data.get('schema')!r}, not {SCHEMA_NAME!r}")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ProfileError(f"schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
    profiles = data.get("profiles")
    if not isinstance(profiles, list):
        raise ProfileError("'profiles' is not a list")
    return [LoaderProfile.from_json(p) for p in profiles]


def _settings(data: dict[str, Any]) -> WorkerSettings:
    """A profile's worker settings: each `WorkerSettings` field from its key (checked by
    `WorkerSettings`' rules, the worker count also against `MAX_NUM_WORKERS`), or its default
    when the key is missing."""
    fields = dataclasses.fields(WorkerSettings)
    for f in fields:  # a required field: the profile says nothing without it
        if f.default is dataclasses.MISSING and f.name not in data:
            raise KeyError(f.name)
    settings = WorkerSettings(**{f.name: data[f.name] for f in fields if f.name in data})
    _count(settings.num_workers, "num_workers", MAX_NUM_WORKERS)
    return settings


def _count(value: Any, what: str, most: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ProfileError(f"{what} {value!r} is not an integer in 0..{most}")
    return value


def _rate(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ProfileError(f"samples_per_s {value!r} is not a non-negative number")
    return float(value)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{what} {value!r} is not a non-empty string")
    return value


def _loader_keyed(value: Any) -> dict[str, Any]:
    """A profile's ``loader`` key; one written before the crop scale was keyed was measured
    with the default crop (0.08) when its transform is ``"train"``."""
    if isinstance(value, dict) and set(value) == _LOADER_KEYS - {"min_crop_scale"}:
        scale = _LEGACY_CROP_SCALE if value.get("transform") == "train" else None
        value = {**value, "min_crop_scale": scale}
    key = _keyed(value, "loader", _LOADER_KEYS)
    for name in ("split", "transform"):
        _text(key[name], f"loader {name}")
    for name, most in (("batch_size", MAX_BATCH_SIZE), ("image_size", MAX_IMAGE_SIZE)):
        number = key[name]  # what a LoaderConfig may hold: the nearest rule divides them
        if number is None and name == "image_size":
            continue  # a detection loader that keeps each image's size
        if not isinstance(number, int) or isinstance(number, bool) or not 1 <= number <= most:
            shown = f"{number!r}" if len(repr(number)) < 40 else f"{repr(number)[:37]}..."
            raise ProfileError(f"loader {name} {shown} is not an integer in 1..{most}")
    scale = key["min_crop_scale"]
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1
    ):
        raise ProfileError(f"loader min_crop_scale {scale!r} is not null or a number in (0, 1]")
    return key


def _keyed(value: Any, what: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        raise ProfileError(f"{what} {value!r} is not an object with keys {sorted(keys)}")
    return dict(value)
