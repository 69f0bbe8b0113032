"""The tars of the ``webdataset`` source (`dlpipe.converters.wds_source`), read into items.

Each tar is walked header by header with dlpipe's own tar reader, seeking over member data:
consecutive members sharing a key are grouped into one sample (only ``cls`` and img2dataset's
``json`` are read), an unsafe member fails its sample, and a damaged tar keeps the samples read
whole before the damage. The walked tars' samples then become items: a split's fields by
majority, keys unique across tars, a damaged tar as one failing item.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

from dlpipe.annotations import CAPTION_SCHEMA
from dlpipe.converters.source import (
    IMAGE_SUFFIXES,
    Item,
    SourceError,
    display_path,
    file_stamp,
    image_kind_of_name,
    log,
)
from dlpipe.errors import InvalidFieldError
from dlpipe.formats.wds import RefusedHeaderError, tar_members  # dlpipe's tar reader
from dlpipe.sample import check_field_name, make_key

__all__ = [
    "CLASSES_FILE",
    "KEY_EXT",
    "ItemBuilder",
    "Ref",
    "Tar",
    "TarWalker",
    "Walk",
    "most_common",
]

_IMAGE_EXTS = frozenset(suffix[1:] for suffix in IMAGE_SUFFIXES)
KEY_EXT = re.compile(r"((?:.*/|)[^.]+)[.]([^/]*)")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
CLASSES_FILE = "classes.txt"
_MAX_CLS_BYTES, _MAX_JSON_BYTES = 64, 1 << 20
_MAX_LABEL = 1 << 20  # without classes.txt, labels name classes 0..max: keep that list small
_ZERO_BLOCK = tarfile.NUL * tarfile.BLOCKSIZE
_MAX_LISTED = 20  # names or tars listed in the description; the rest are counted


class Ref(NamedTuple):
    """What `load` reads: the tar, its (size, mtime) at the scan, and (field, offset, size)."""

    tar: str
    stamp: tuple[int, int]
    members: tuple[tuple[str, int, int], ...]
    problem: str | None = None


class Tar(NamedTuple):
    path: str
    split: str | None


@dataclass
class _Sample:
    """One group of consecutive members while the tar is walked."""

    key: str
    offset: int
    members: dict[str, tuple[int, int]] = field(default_factory=dict)  # field → (offset, size)
    image_ext: str | None = None
    label: int | None = None
    status: str | None = None
    problems: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)  # fields whose member is never read


@dataclass
class Walk:
    """A tar's samples, its members not read (reason → count), and where it is damaged."""

    samples: list[_Sample] = field(default_factory=list)
    unread: Counter[str] = field(default_factory=Counter)
    damage: tuple[int, str] | None = None
    stamp: tuple[int, int] = (0, 0)


class _Damage(Exception):
    def __init__(self, offset: int, message: str) -> None:
        super().__init__(message)
        self.offset = offset


def _field_of(ext: str) -> str | None:
    """The field a member extension names: ``image`` for an image; None when none."""
    if ext in _IMAGE_EXTS:
        return "image"
    try:
        return None if ext == "image" else check_field_name(ext)
    except InvalidFieldError:
        return None


def _unsafe(member: tarfile.TarInfo, name: str) -> str | None:
    """Why a member is never read: a link, device or sparse file, or a name leaving the tar."""
    if member.issym() or member.islnk():
        kind = "symbolic" if member.issym() else "hard"
        what = f"is a {kind} link (to {member.linkname!r})"
    elif not member.isreg():
        what = "is no regular file (a device, FIFO or special entry)"
    elif member.issparse() or any(k.startswith("GNU.sparse.") for k in member.pax_headers):
        what = "is a sparse file (its holes expand to any size)"
    elif name.startswith("/") or ".." in name.split("/"):
        what = "has an absolute name or one with '..'"
    else:
        return None
    return f"member {name!r} {what}; dlpipe reads only regular members named inside the tar"


def _read_small(f: IO[bytes], member: tarfile.TarInfo, limit: int) -> bytes | None:
    """A small member's bytes (a label, img2dataset's json); None when over `limit`."""
    if member.size > limit:
        return None
    f.seek(member.offset_data)
    return f.read(member.size)


def _parse_label(data: bytes | None) -> int | str:
    """A ``cls`` member's label, or why it has none."""
    if data is None:
        return f"its cls member is over {_MAX_CLS_BYTES} bytes"
    text = data.decode("ascii", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        return f"its cls member {text[:20]!r} is not a non-negative integer"
    return int(text)


def _parse_status(data: bytes | None) -> str:
    """img2dataset's ``status`` from a ``json`` member (``success`` when it has none)."""
    if data is None:
        raise ValueError(f"over {_MAX_JSON_BYTES} bytes")
    record = json.loads(data.decode("utf-8"))
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return "success" if record.get("status") is None else str(record["status"])


def _check_end(f: IO[bytes], end: int) -> None:
    """The archive ends with a zero block where the next header would be: tarfile stops
    quietly at a damaged or cut header, which would make a silently short dataset."""
    f.seek(end)
    block = f.read(tarfile.BLOCKSIZE)
    if block == _ZERO_BLOCK:
        return
    if len(block) < tarfile.BLOCKSIZE:
        raise _Damage(end, f"ends at byte {end + len(block)} without the end-of-archive blocks")
    raise _Damage(end, f"the header at byte {end} is damaged (its checksum or fields are wrong)")


class TarWalker:
    """Walks one tar's headers into samples, seeking over member data: only ``cls`` and, with
    `statuses`, img2dataset's ``json`` are read."""

    def __init__(self, f: IO[bytes], statuses: bool) -> None:
        stamp = file_stamp(f)
        self.f, self.size, self.statuses = f, stamp[0], statuses
        self.walk = Walk(stamp=stamp)
        self.sample: _Sample | None = None

    def run(self) -> Walk:
        """The tar's samples, and where it is damaged, if it is."""
        end = 0  # where the next header starts
        try:
            for member in tar_members(self.f):
                end = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                self._member(member)
            _check_end(self.f, end)
        except _Damage as exc:
            self.walk.damage = (exc.offset, str(exc))
        except RefusedHeaderError as exc:
            self.walk.damage = (end, f"{exc}, which dlpipe refuses")
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            self.walk.damage = (end, f"not a readable tar from byte {end} on ({exc})")
        else:
            self.walk.samples += [self.sample] if self.sample is not None else []
        return self.walk

    def _member(self, member: tarfile.TarInfo) -> None:
        """Group `member` into the current sample, or start the next (the current one is then
        whole); a member past the file's end is damage."""
        name = member.name
        while name.startswith("./"):
            name = name[2:]
        if member.isdir():
            return
        match = KEY_EXT.fullmatch(name)
        if match is None or _META.match(name) or (name.startswith("__") and name.endswith("__")):
            self.walk.unread["not named key.extension"] += 1
            return
        key, ext = match[1], match[2].lower()
        if self.sample is None or key != self.sample.key:
            self.walk.samples += [self.sample] if self.sample is not None else []
            self.sample = _Sample(key, member.offset)
        if member.offset_data + member.size > self.size:
            raise _Damage(
                member.offset,
                f"member {name!r} claims {member.size} bytes at byte {member.offset_data}, "
                f"past the end of the {self.size}-byte file",
            )
        self._field(self.sample, member, name, ext)

    def _field(self, sample: _Sample, member: tarfile.TarInfo, name: str, ext: str) -> None:
        field_name, problem = _field_of(ext), _unsafe(member, name)
        if field_name is None:
            self.walk.unread[f"extension {ext[:40]!r} is not a field name"] += 1
            return
        if problem is None and (field_name in sample.members or field_name in sample.refused):
            problem = f"member {name!r} gives its sample a second {field_name} field"
        if problem is not None:
            sample.problems.append(problem)
            sample.refused.add(field_name)
            return
        sample.members[field_name] = (member.offset_data, member.size)
        if field_name == "image":
            sample.image_ext = ext
        elif field_name == "cls":
            label = _parse_label(_read_small(self.f, member, _MAX_CLS_BYTES))
            if isinstance(label, str):
                sample.problems.append(label)
            else:
                sample.label = label
        elif field_name == "json" and self.statuses:
            try:
                sample.status = _parse_status(_read_small(self.f, member, _MAX_JSON_BYTES))
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                sample.problems.append(
                    f"its json member has no readable img2dataset status ({exc})"
                )


def most_common(counts: Counter[str]) -> dict[str, int]:
    """The `_MAX_LISTED` largest counts by name (a hostile tar may hold any number of names),
    the rest summed under ``"others"``."""
    top = dict(sorted(counts.most_common(_MAX_LISTED)))
    rest = sum(counts.values()) - sum(top.values())
    return {**top, "others": rest} if rest else top


class _Found(NamedTuple):
    tar: Tar
    stamp: tuple[int, int]
    sample: _Sample


class ItemBuilder:
    """Items from walked tars: a split's fields by majority, unique keys, problems attached."""

    def __init__(self, classes: tuple[str, ...]) -> None:
        self.classes = classes
        self.unread: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.not_success = 0
        self.damaged: list[dict[str, Any]] = []
        self.fields: dict[str | None, set[str]] = {}
        self._found: list[_Found] = []
        self._poisoned: list[Item] = []

    def add(self, tar: Tar, walk: Walk) -> None:
        """A walked tar's samples with status success (or none), and its damage as one item."""
        self.unread.update(walk.unread)
        kept = [
            s
            for s in walk.samples
            if s.status in (None, "success") and (s.members or s.refused or s.problems)
        ]
        self.not_success += len(walk.samples) - len(kept)
        self._found += [_Found(tar, walk.stamp, s) for s in kept]
        if walk.damage is None:
            return
        offset, problem = walk.damage
        message = (
            f"damaged at byte {offset}: {problem}; the {len(kept)} samples before it are kept, "
            "the rest of the tar is not read (re-create or download the tar again)"
        )
        shown = display_path(tar.path)
        log.warning("%s: %s", shown, message)
        self.damaged.append({"tar": shown, "byte": offset, "problem": problem, "kept": len(kept)})
        key, _ = make_key(os.path.basename(tar.path))  # holds a dot: never a member's key
        ref = Ref(tar.path, walk.stamp, (), message)
        self._poisoned.append(Item(key, None, tar.split, ref, 0, None, shown))

    def items(self) -> tuple[Item, ...]:
        for split in dict.fromkeys(found.tar.split for found in self._found):
            self.fields[split] = self._split_fields(split)
        prefixed = self._repeated_keys()
        return tuple(self._item(found, prefixed) for found in self._found) + tuple(self._poisoned)

    def _split_fields(self, split: str | None) -> set[str]:
        """The fields more than half the split's samples carry (the image among them)."""
        samples = [f.sample for f in self._found if f.tar.split == split]
        counts = Counter(name for sample in samples for name in {*sample.members, *sample.refused})
        fields = {name for name, n in counts.items() if 2 * n > len(samples)}
        if samples and "image" not in fields:
            raise SourceError(
                f"{'split ' + split if split else 'the tars'}: {len(samples) - counts['image']} "
                f"of {len(samples)} samples have no image member (.jpg, .png, .webp, ...); "
                "dlpipe stores an image per sample"
            )
        return fields

    def _repeated_keys(self) -> bool:
        """True when a member key appears in two tars of one split."""
        tars: dict[tuple[str | None, str], str] = {}
        for found in self._found:
            seen = tars.setdefault((found.tar.split, found.sample.key), found.tar.path)
            if seen != found.tar.path:
                return True
        return False

    def _item(self, found: _Found, prefixed: bool) -> Item:
        tar, sample = found.tar, found.sample
        text = f"{os.path.basename(tar.path)[:-4]}/{sample.key}" if prefixed else sample.key
        key, shortened = make_key(text)
        fields = self.fields[tar.split]
        problems = [*sample.problems, *self._problems(sample, fields)]
        self.dropped.update(set(sample.members) - fields)
        names = sorted(fields & set(sample.members) - {"cls"})
        members = tuple((name, *sample.members[name]) for name in names)
        kind = image_kind_of_name(f"x.{sample.image_ext}") if sample.image_ext else None
        label = sample.label if "cls" in fields and not problems else None
        shown = f"{display_path(tar.path)}, sample {display_path(sample.key)!r}"
        ref = Ref(tar.path, found.stamp, members, "; ".join(problems) or None)
        size = sum(size for _, _, size in members)
        original = display_path(text) if shortened else None
        origin = f"{shown} at byte {sample.offset}"
        return Item(key, label, tar.split, ref, size, kind, origin, original)

    def _problems(self, sample: _Sample, fields: set[str]) -> list[str]:
        """Why a sample does not fit its split: a missing field, a label beyond the classes."""
        problems = []
        missing = sorted(fields - set(sample.members) - sample.refused)
        if missing:
            problems.append(
                f"it has no {' or '.join(missing)} member, which most samples of its split have"
            )
        limit = len(self.classes) or _MAX_LABEL
        if "cls" in fields and sample.label is not None and sample.label >= limit:
            names = f"the {limit} classes of {CLASSES_FILE}" if self.classes else f"{limit - 1}"
            problems.append(f"its label {sample.label} is beyond {names}")
        return problems

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"unread_members": most_common(self.unread)}
        if self.dropped:
            dropped = most_common(self.dropped)
            log.warning("dropped members that most samples of their split lack: %s", dropped)
            report["dropped_fields"] = dropped
        if self.damaged:
            report["damaged_tars"] = self.damaged[:_MAX_LISTED]
            report["damaged_tar_count"] = len(self.damaged)
        return report

    def task(self) -> tuple[str | None, dict[str, dict[str, Any]]]:
        """The dataset's task and its annotation fields' schemas."""
        fields = list(self.fields.values())
        captioned = bool(fields) and all("txt" in f for f in fields)
        task = "classification" if any("cls" in f for f in fields) else None
        task = task or ("captioning" if captioned else None)
        kinds = {"txt": CAPTION_SCHEMA, "json": {"kind": "columns"}}
        return task, {name: s for name, s in kinds.items() if any(name in f for f in fields)}
