"""A mixture's class spaces: each source's classes mapped onto the mixture's (the first
source's) by name, and where names differ, by the user's ``class_map``.

Sources with the same class names mix as they are, in any order. A source with a class the
first lacks needs ``class_map`` (``{"1": {"kitty": "cat"}}``: the source's number or its path
as given, then its class name to one of the first source's; several may map to one), else
one `ClassMapError` names the dataset, the class, the first dataset's classes and the fix.
The labels are mapped in the loader's transform (`dlpipe.loading.views.MixTransform`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.state import is_int, shown
from dlpipe.manifest import Manifest

__all__ = ["ClassMapError", "class_map_by_source", "class_maps"]

SHOWN_CLASSES = 8
"""How many of a dataset's classes an error lists."""


class ClassMapError(LoaderConfigError):
    """A mixture's classes do not map onto the first source's.

    Attributes:
        source: the number of the source at fault (None: the map names no source).
        unmapped: a class of that source with no counterpart and no mapping (None: another
            problem).
        fix: the message's fix, in `make_loader`'s spelling (a trainer gives its own).
    """

    def __init__(
        self, problem: str, *, source: int | None, unmapped: str | None = None, fix: str = ""
    ) -> None:
        super().__init__(problem + fix)
        self.problem, self.source, self.unmapped, self.fix = problem, source, unmapped, fix


def class_maps(
    manifests: Sequence[Manifest], names: Sequence[str], class_map: Any
) -> tuple[tuple[str, ...], list[np.ndarray] | None]:
    """The mixture's classes (the first source's) and each source's label map onto them
    (None when every source's indices are already the mixture's).

    Raises:
        ClassMapError: a `class_map` key that names no source, a class it maps that the
            source lacks or onto one the first lacks, or a source class with no counterpart.
    """
    maps = class_map_by_source(class_map, names)
    ours = tuple(manifests[0].classes)
    index = {name: i for i, name in enumerate(ours)}
    labels = []
    for number, manifest in enumerate(manifests):
        own, given = tuple(manifest.classes), maps.get(number, {})
        where = f"the class map of {names[number]}"
        for theirs, mapped in given.items():
            if theirs not in own:
                raise ClassMapError(
                    f"{where} maps {theirs!r}, which is not a class of it ({listed(own)}); "
                    "map its own class names",
                    source=number,
                )
            if mapped not in index:
                raise ClassMapError(
                    f"{where} maps {theirs!r} onto {mapped!r}, which is not a class of the "
                    f"first dataset {names[0]} ({listed(ours)}); map it onto one of those",
                    source=number,
                )
        lacking = [name for name in own if name not in given and name not in index]
        if lacking:
            raise ClassMapError(
                f"{names[number]} has the class {lacking[0]!r}, which the first dataset "
                f"{names[0]} lacks ({listed(ours)}), so its label is ambiguous; map it onto "
                "one of those",
                source=number,
                unmapped=lacking[0],
                fix=f': class_map={{"{number}": {{{json.dumps(lacking[0])}: "CLASS"}}}}',
            )
        renamed = [given.get(name, name) for name in own]
        labels.append(np.asarray([index[name] for name in renamed], dtype=np.int64))
    if all(np.array_equal(lut, np.arange(len(lut))) for lut in labels):
        return ours, None
    return ours, labels


def class_map_by_source(class_map: Any, names: Sequence[str]) -> dict[int, dict[str, str]]:
    """`class_map` keyed by source number (its keys: a number or a path as given; two keys
    of one source add up).

    Raises:
        ClassMapError: not a mapping of mappings of names, or a key that names no source.
    """
    if class_map is None:
        return {}
    if not isinstance(class_map, Mapping):
        raise ClassMapError(
            f"class_map={shown(class_map)} is not a mapping; pass "
            '{"SOURCE": {"their_class": "our_class"}} (SOURCE: its number or path)',
            source=None,
        )
    out: dict[int, dict[str, str]] = {}
    for key, renames in class_map.items():
        number = _source_number(key, names)
        if not isinstance(renames, Mapping) or not all(
            isinstance(a, str) and isinstance(b, str) for a, b in renames.items()
        ):
            raise ClassMapError(
                f"class_map[{key!r}]={shown(renames)} is not a mapping of class names to "
                'class names; pass {"their_class": "our_class"}',
                source=number,
            )
        out[number] = {**out.get(number, {}), **renames}
    return out


def _source_number(key: Any, names: Sequence[str]) -> int:
    if isinstance(key, str) and key in names:
        return list(names).index(key)
    text = str(key) if is_int(key) or isinstance(key, str) else ""
    if text.isdigit() and int(text) < len(names):
        return int(text)
    raise ClassMapError(
        f"the class map names dataset {key!r}, which is none of the {len(names)} given; name "
        f"a dataset by its number, 0..{len(names) - 1} (0: {names[0]}), or by its path as given",
        source=None,
    )


def listed(classes: Sequence[str]) -> str:
    """``cat, dog`` (or the first few of many) for a message."""
    shown_ = ", ".join(classes[:SHOWN_CLASSES])
    return shown_ if len(classes) <= SHOWN_CLASSES else f"{shown_}, ... ({len(classes)} classes)"
