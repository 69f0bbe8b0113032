"""Several datasets read as one: an exact, seeded, weighted mixture at the sample level.

    config = dlpipe.LoaderConfig(batch_size=256, weights=(0.7, 0.3))
    loader = dlpipe.make_loader(["data/a-lmdb", "data/b-hdf5"], "train", config)
    for images, labels, sources in loader:  # sources: int64 (N,), each sample's dataset index

A mixture is one more kind of dataset (`dlpipe.loading.mix_sources.MixedDataset`: the sources
opened and checked, their class spaces mapped; planned by `dlpipe.loading.views.plan_view`)
over random-access sources (lmdb, hdf5). Its order
(`MixSampler`) is an `EpochSampler` whose global sequence is the mixture's: epoch ``e`` has
``epoch_samples`` positions, and position ``p`` is one draw from one source. Each source gets
its exact share of the epoch (``weights``, largest remainder, ties to the earlier source),
interleaved by a seeded shuffle (evenly spread without ``shuffle``); the ``k``-th draw from
source ``i`` is sample ``perm(seed, i, k // n_i)[k % n_i]`` of its own per-source-epoch
permutation. The positions are dealt to the ranks in per-rank batch blocks like one dataset's,
so global step ``s`` holds the same samples on any world size and a state resumes batch for
batch with another ``num_workers`` or world size.

Epoch and per-source rules (Mosaic streaming's defaults where it has one):

- ``epoch_samples`` (default: the sources' total, as Mosaic's ``epoch_size``): the mixture's
  samples per epoch; with ``weights=None`` each source's share is its size, so every sample is
  read once an epoch.
- ``on_source_end="cycle"`` (default): a source whose draws run past its size goes on with
  its next permutation (its own source epoch); its position carries over mixture epochs, so
  over a run every sample of a source is read equally often.
- ``on_source_end="stop"``: a source gives each sample at most once per mixture epoch (its
  source epoch is the mixture's); its share is capped at its size, and what it cannot fill
  goes to the others in proportion to their weights. An epoch is then at most the sources'
  total.

The state (`MixSampler.state_dict`) is the sampler's (epoch, seed, samples consumed globally)
plus the sources' identities (manifest sha256 and size), the rule, the weights in force, the
position where they took force (``since``) with each source's draws there, and each source's
draws at the state's position (``cursors``: source epoch ``cursor // size``). Loading a state
into a loader with other ``weights`` is allowed: positions before the loaded one kept the old
mapping, and the new weights share out the rest of the epoch from there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.order import EpochSampler
from dlpipe.loading.state import (
    MAX_COUNT,
    SAVED_BY_DLPIPE,
    StateMismatchError,
    is_int,
    mismatch,
    require_fields,
    require_int,
    require_list,
    shown,
)

__all__ = [
    "MAX_EPOCH_SAMPLES",
    "MIX_RULES",
    "SOURCE_FIELD",
    "MixSampler",
    "Mixture",
    "SourceIdentity",
    "checked_weights",
    "share_out",
]

MIX_RULES = ("cycle", "stop")
SOURCE_FIELD = "__source__"  # the source index a mixture's view adds to each sample read
MAX_EPOCH_SAMPLES = 2**40
_MIX_TAG = 0x6D6978  # keeps a mixture's draws apart from one dataset's permutations
_LONGEST_NAME = 1024  # a source's path as a state names it, whole up to this length
_SAME_SOURCES = "load it into a loader of the same datasets and split, in the same order"


class SourceIdentity(NamedTuple):
    """One source of a mixture: its path as given, its manifest's sha256, its split's size."""

    name: str
    sha256: str
    samples: int

    def line(self) -> str:
        return _source_line(self)


def _source_line(source: Sequence[Any]) -> str:
    """A source as a state or a loader names it: path (samples, manifest sha256 prefix)."""
    name, sha256, samples = (
        repr(part) if isinstance(part, str) and len(part) <= _LONGEST_NAME else shown(part)
        for part in source
    )
    return f"{name} ({samples} samples, manifest {sha256[:13]}')"


@dataclass(frozen=True)
class Mixture:
    """What a mixture's order is made of (checked by `open_sources`)."""

    sources: tuple[SourceIdentity, ...]
    weights: tuple[float, ...]
    on_source_end: str
    epoch_samples: int


class _Segment(NamedTuple):
    """A stretch of an epoch under one set of weights: from position ``since``, where each
    source had been drawn ``cursors`` times."""

    since: int
    weights: tuple[float, ...]
    cursors: tuple[int, ...]


def share_out(
    length: int, weights: Sequence[float], caps: Sequence[int] | None = None
) -> np.ndarray:
    """Integer counts summing to `length` in proportion to `weights`, exactly (largest
    remainder over exact fractions, ties to the earlier source), none above its cap: a capped
    source's surplus goes to the others by their weights."""
    counts = np.zeros(len(weights), dtype=np.int64)
    room = [length] * len(weights) if caps is None else [int(c) for c in caps]
    exact_weights = [Fraction(w) for w in weights]
    left = length
    while left > 0:
        open_ = [w if room[i] > counts[i] else Fraction(0) for i, w in enumerate(exact_weights)]
        total = sum(open_)
        if total <= 0:
            raise ValueError(f"{left} positions left and no source with room and weight")
        quotas = [left * w / total for w in open_]
        take = [math.floor(q) for q in quotas]
        order = sorted(range(len(take)), key=lambda i: (-(quotas[i] - take[i]), i))
        for i in order[: left - sum(take)]:
            take[i] += 1
        for i, wanted in enumerate(take):
            given = min(wanted, room[i] - int(counts[i]))
            counts[i] += given
            left -= given
    return counts


def _interleave(counts: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """Source labels with `counts` of each: shuffled by `rng`, else evenly spread."""
    labels = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    if rng is not None:
        return rng.permutation(labels)
    keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c] or [np.zeros(0)])
    return labels[np.argsort(keys, kind="stable")]


class MixSampler(EpochSampler):
    """`EpochSampler` over a mixture's global sequence (see the module docstring): it yields
    ``(epoch, code)``, where ``code = source_epoch * total + offset[source] + index`` names the
    draw (`MixedDataset.locate` reads it back; the transform is seeded by it, so a sample
    drawn twice is augmented twice differently).

    Args:
        mixture: the sources, weights, rule and epoch length.
        **placement: `EpochSampler`'s rank, world size, shuffle, seed, drop_last and block.
    """

    def __init__(self, mixture: Mixture, **placement: Any) -> None:
        super().__init__(mixture.epoch_samples, **placement)
        self.mixture = mixture
        self.sizes = [source.samples for source in mixture.sources]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        zero = (0,) * len(self.sizes)
        self.segments = {0: _Segment(0, mixture.weights, zero)}  # per epoch (this and the last)
        self._drawn: dict[tuple[int, _Segment], tuple[np.ndarray, np.ndarray]] = {}

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def epoch_order(self, epoch: int, start: int) -> np.ndarray:
        """The mixture's codes of `epoch` from global position `start`."""
        segment = self._segment(epoch)
        _, codes = self._order(epoch, segment)
        return codes[start - segment.since :]

    def next_epoch(self) -> None:
        """The next epoch under the loader's weights; each source's draws go on (cycle) or
        start anew (stop)."""
        ending = self.segments[self.epoch]
        super().next_epoch()
        self.segments = {self.epoch - 1: ending, self.epoch: self._after(self.epoch - 1, ending)}

    def _segment(self, epoch: int) -> _Segment:
        """`epoch`'s start: known, or up to two epochs past the last known one under the
        loader's weights (a remote source's cache plans ahead, in a worker's copy of this
        sampler made before its pass began)."""
        if epoch in self.segments:
            return self.segments[epoch]
        last = max(self.segments)
        if not last < epoch <= last + 2:
            raise KeyError(f"epoch {epoch} is not among {sorted(self.segments)} or just after")
        segment = self.segments[last]
        for before in range(last, epoch):
            segment = self._after(before, segment)
        return segment

    def _after(self, epoch: int, segment: _Segment) -> _Segment:
        """The start of the epoch after `epoch`, whose last stretch began at `segment`."""
        cursors = (0,) * len(self.sizes)
        if self.mixture.on_source_end == "cycle":
            cursors = self._cursors(epoch, segment, self.num_samples)
        return _Segment(0, self.mixture.weights, cursors)

    def _order(self, epoch: int, segment: _Segment) -> tuple[np.ndarray, np.ndarray]:
        """(source labels, codes) of `epoch`'s positions from ``segment.since``."""
        key = (epoch, segment)
        if key not in self._drawn:  # kept: this epoch's and the last (a pass drawn ahead)
            self._drawn = {k: v for k, v in self._drawn.items() if k[0] == epoch - 1}
            self._drawn[key] = self._draw(epoch, segment)
        return self._drawn[key]

    def _draw(self, epoch: int, segment: _Segment) -> tuple[np.ndarray, np.ndarray]:
        caps = None
        if self.mixture.on_source_end == "stop":
            caps = [size - c for size, c in zip(self.sizes, segment.cursors, strict=True)]
        counts = share_out(self.num_samples - segment.since, segment.weights, caps)
        rng = None
        if self.shuffle:
            rng = np.random.default_rng([self.seed, _MIX_TAG, epoch, segment.since])
        labels = _interleave(counts, rng)
        codes = np.empty(len(labels), dtype=np.int64)
        for source, count in enumerate(counts.tolist()):
            if count:
                first = segment.cursors[source]
                codes[labels == source] = self._codes(source, first, count, epoch)
        return labels, codes

    def _codes(self, source: int, first: int, count: int, epoch: int) -> np.ndarray:
        """The codes of draws ``first .. first + count - 1`` of `source` in `epoch`."""
        size, stop = self.sizes[source], first + count
        if self.mixture.on_source_end == "stop":  # the source epoch is the mixture's
            local = self._permutation(source, epoch)[first:stop]
            return epoch * self.total + self.offsets[source] + local
        rounds = np.arange(first, stop, dtype=np.int64) // size
        local = np.empty(count, dtype=np.int64)
        for round_ in range(first // size, (stop - 1) // size + 1):  # contiguous runs of draws
            lo, hi = max(first, round_ * size), min(stop, (round_ + 1) * size)
            local[lo - first : hi - first] = self._permutation(source, round_)[
                lo - round_ * size : hi - round_ * size
            ]
        return rounds * self.total + self.offsets[source] + local

    def _permutation(self, source: int, source_epoch: int) -> np.ndarray:
        size = self.sizes[source]
        if not self.shuffle:
            return np.arange(size)
        rng = np.random.default_rng([self.seed, _MIX_TAG + 1 + source, source_epoch])
        return rng.permutation(size)

    def _cursors(self, epoch: int, segment: _Segment, samples: int) -> tuple[int, ...]:
        """Each source's draws at global position `samples` of `epoch`."""
        labels, _ = self._order(epoch, segment)
        drawn = np.bincount(labels[: samples - segment.since], minlength=len(self.sizes))
        return tuple(int(c + d) for c, d in zip(segment.cursors, drawn.tolist(), strict=True))

    def state_at(self, epoch: int, start: int, drawn: int) -> dict[str, Any]:
        """`EpochSampler.state_at` plus the mixture's fields (see the module docstring)."""
        state = super().state_at(epoch, start, drawn)
        segment = self.segments[epoch]
        return {
            **state,
            "sources": [list(source) for source in self.mixture.sources],
            "on_source_end": self.mixture.on_source_end,
            "weights": list(segment.weights),
            "since": segment.since,
            "since_cursors": list(segment.cursors),
            "cursors": list(self._cursors(epoch, segment, state["samples"])),
        }

    def load_state_dict(self, state: dict[str, Any], *, batches: bool = False) -> None:
        """Continue at the saved position, as `EpochSampler.load_state_dict`; the loader's
        ``weights``, where they differ from the saved ones, share out the rest of the epoch.

        Raises:
            StateMismatchError: a field that is not what this sampler saves, another set of
                sources (named), another ``on_source_end``, or a weight change mid-batch.
        """
        epoch, samples, partial = self._checked(state, batches)
        segment = self._checked_segment(state, epoch, samples)
        if segment.weights != self.mixture.weights:
            if partial:
                rule = "new weights take effect at a batch boundary"
                raise mismatch("sampler", "partial", partial, rule, "save at a batch boundary")
            cursors = self._cursors(epoch, segment, samples)
            segment = _Segment(samples, self.mixture.weights, cursors)
        self.epoch, self.start, self.drawn, self.armed = epoch, samples, partial, True
        self.segments = {epoch: segment}

    def _checked_segment(self, state: Any, epoch: int, samples: int) -> _Segment:
        """The saved segment of `epoch`, every mixture field checked against this sampler."""
        what = "mixture"
        fields = ("sources", "on_source_end", "weights", "since", "since_cursors", "cursors")
        saved = require_fields(state, fields, what)
        self._check_sources(saved["sources"])
        if saved["on_source_end"] != self.mixture.on_source_end:
            rule = f"this loader has on_source_end={self.mixture.on_source_end!r}"
            fix = "make the loader with the saved on_source_end"
            raise mismatch(what, "on_source_end", saved["on_source_end"], rule, fix)
        weights = self._checked_weights(saved["weights"])
        since = require_int(saved, "since", what, high=samples)
        cursors = self._checked_cursors(saved, "since_cursors")
        segment = _Segment(since, weights, cursors)
        now = self._checked_cursors(saved, "cursors")
        try:
            expected = self._cursors(epoch, segment, samples)
        except ValueError:  # the saved weights cannot fill the epoch from those draws
            expected = None
        if now != expected:
            rule = f"the saved weights, since and since_cursors give {shown(expected)}"
            raise mismatch(what, "cursors", saved["cursors"], rule, SAVED_BY_DLPIPE)
        return segment

    def _check_sources(self, value: Any) -> None:
        mine = [list(source) for source in self.mixture.sources]
        same = isinstance(value, list | tuple) and len(value) == len(mine)
        same = same and all(
            isinstance(saved, list | tuple)
            and len(saved) == 3
            and isinstance(saved[0], str)
            and list(saved[1:]) == now[1:]
            and is_int(saved[2])
            for saved, now in zip(value, mine, strict=False)
        )
        if not same:
            saved = shown(value)
            if isinstance(value, list | tuple) and all(
                isinstance(s, list | tuple) and len(s) == 3 for s in value
            ):
                saved = "[" + ", ".join(map(_source_line, value)) + "]"
            ours = ", ".join(source.line() for source in self.mixture.sources)
            problem = f"the saved mixture state has sources={saved}, this loader reads [{ours}]"
            raise StateMismatchError(f"{problem}; {_SAME_SOURCES}", problem=problem)

    def _checked_weights(self, value: Any) -> tuple[float, ...]:
        try:
            weights = checked_weights(value, len(self.sizes), self.mixture.on_source_end)
        except LoaderConfigError as exc:
            raise mismatch("mixture", "weights", value, str(exc), SAVED_BY_DLPIPE) from None
        return weights

    def _checked_cursors(self, saved: Mapping[str, Any], name: str) -> tuple[int, ...]:
        value = require_list(saved, name, "mixture")
        stop = self.mixture.on_source_end == "stop"
        rounds = 1 if stop else MAX_COUNT // self.total  # (a code counts the source's epochs)
        if len(value) != len(self.sizes) or not all(
            is_int(c) and 0 <= c <= rounds * size
            for c, size in zip(value, self.sizes, strict=False)
        ):
            rule = f"it must be {len(self.sizes)} draw counts in range, one per source"
            raise mismatch("mixture", name, value, rule, SAVED_BY_DLPIPE)
        return tuple(int(c) for c in value)


def checked_weights(
    value: Any, count: int, rule: str, sizes: Sequence[int] | None = None
) -> tuple[float, ...]:
    """`value` as `count` mixture weights (None: `sizes`, one per source's sample).

    Raises:
        LoaderConfigError: not `count` finite numbers >= 0 with a positive sum (a bool is
            not a number); a zero weight with ``on_source_end="stop"``.
    """
    if value is None and sizes is not None:
        return tuple(float(size) for size in sizes)
    fix = f"pass {count} finite numbers >= 0, one per dataset, e.g. weights={(1.0,) * count}"
    if not isinstance(value, list | tuple) or len(value) != count:
        raise _bad_weights(value, f"is not a list of {count} weights (one per dataset)", fix)
    for weight in value:
        number = isinstance(weight, float | np.floating) or is_int(weight)
        if not number or not math.isfinite(weight) or weight < 0:
            raise _bad_weights(value, f"holds {weight!r}, not a finite number >= 0", fix)
    if sum(value) <= 0:
        raise _bad_weights(value, "sums to 0, so no source would be read", fix)
    if rule == "stop" and 0 in value:
        rule_text = "has a zero weight, but on_source_end='stop' reads every source each epoch"
        raise _bad_weights(value, rule_text, "leave that dataset out of the list")
    return tuple(float(weight) for weight in value)


def _bad_weights(value: Any, rule: str, fix: str) -> LoaderConfigError:
    return LoaderConfigError(f"weights={shown(value)} {rule}; {fix}")
