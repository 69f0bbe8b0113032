"""``hdf5``: one HDF5 file per shard, a contiguous byte blob plus offsets per field.

Layout of ``{split}-{n:06d}.h5`` (all datasets contiguous, in the root group):

- For each field ``F`` other than ``cls`` (and for ``__key__``, UTF-8): ``F`` is a 1-D ``uint8``
  dataset holding every sample's bytes back to back, and ``F.offsets`` a 1-D ``uint64`` dataset
  of ``n + 1`` offsets, so sample ``i`` is ``F[offsets[i]:offsets[i + 1]]``. Attribute
  ``layout = "blob"``.
- ``cls`` is an ``int64`` dataset of ``n`` labels (attribute ``layout = "int64"``); its field bytes
  are the ASCII decimal of the label.
- Root attributes: ``dlpipe_format = "hdf5"``, ``format_version = 1``, ``samples = n``,
  ``fields`` = the field names as a JSON list.

The blob layout was chosen over variable-length (``vlen``) datasets by measurement
(``benchmarks/hdf5_layout.py``; figures in the README). Read it with plain h5py::

    with h5py.File("train-000000.h5") as f:
        off = f["jpg.offsets"][:]
        jpg_bytes = f["jpg"][off[3]:off[4]].tobytes()
        label = int(f["cls"][3])
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from dlpipe import storage
from dlpipe.formats.base import ShardFileWriter, ShardFormat, ShardReader
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["HDF5"]

_INT_FIELD = "cls"
_READ_AHEAD_BYTES = 1 << 20


class Hdf5Writer(ShardFileWriter):
    def __init__(self, path: str, fields: list[str]) -> None:
        super().__init__(path, fields)
        self._blobs: dict[str, bytearray] = {n: bytearray() for n in (KEY_FIELD, *fields)}
        self._offsets: dict[str, list[int]] = {n: [0] for n in self._blobs if n != _INT_FIELD}
        self._labels: list[int] = []

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        for name, data in ((KEY_FIELD, key.encode("utf-8")), *fields.items()):
            if name == _INT_FIELD:
                self._labels.append(int(data))
                continue
            self._blobs[name] += data
            self._offsets[name].append(len(self._blobs[name]))

    def close(self) -> None:
        samples = len(self._offsets[KEY_FIELD]) - 1
        with h5py.File(self.path, "w", track_order=False) as f:
            f.attrs["dlpipe_format"] = "hdf5"
            f.attrs["format_version"] = 1
            f.attrs["samples"] = samples
            f.attrs["fields"] = json.dumps(list(self.fields))
            for name, blob in self._blobs.items():
                if name == _INT_FIELD:
                    ds = f.create_dataset(
                        name, data=np.asarray(self._labels, dtype=np.int64), track_times=False
                    )
                    ds.attrs["layout"] = "int64"
                    continue
                ds = f.create_dataset(
                    name, data=np.frombuffer(blob, dtype=np.uint8), track_times=False
                )
                ds.attrs["layout"] = "blob"
                f.create_dataset(
                    f"{name}.offsets",
                    track_times=False,
                    data=np.asarray(self._offsets[name], dtype=np.uint64),
                )
        self._blobs.clear()


class _OpenShard:
    """The open file plus each blob field's offsets, read once per process."""

    def __init__(self, path: str, names: tuple[str, ...]) -> None:
        self.fileobj = storage.open_read(path) if storage.is_url(path) else None
        self.file = h5py.File(self.fileobj or storage.local_path(path), "r")
        try:
            self.datasets = {n: self.file[n] for n in names}
            self.offsets = {
                n: self.file[f"{n}.offsets"][:].astype(np.int64) for n in names if n != _INT_FIELD
            }
            self.labels = self.file[_INT_FIELD][:] if _INT_FIELD in names else None
            # where each sample ends in all blobs together, to size sequential reads
            self.sample_ends = np.sum(list(self.offsets.values()), axis=0)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        self.file.close()
        if self.fileobj is not None:
            self.fileobj.close()


class Hdf5Reader(ShardReader):
    random_access = True

    def _open(self) -> Any:
        shard = _OpenShard(self.path, (KEY_FIELD, *self.fields))
        for name, offsets in shard.offsets.items():
            if (
                len(offsets) != self.info.samples + 1
                or offsets[-1] != shard.datasets[name].shape[0]
            ):
                shard.close()
                raise ValueError(f"offsets of {name!r} do not match its data or the manifest")
        return shard

    def get(self, index: int) -> Sample:
        return next(self._read(index, index + 1))

    def __iter__(self) -> Iterator[Sample]:
        start = 0
        while start < self.info.samples:
            stop = self._read_ahead_stop(start)
            yield from self._read(start, stop)
            start = stop

    def _read_ahead_stop(self, start: int) -> int:
        """End of the next sequential read: about 1 MiB of data, at least one sample.

        Measured (benchmarks/hdf5_layout.py): 25 MB slices of 100 KB JPEGs read 3x slower per
        sample than 100 KB ones, while many tiny reads pay h5py's per-call cost.
        """
        ends = self.handle(start).sample_ends
        stop = int(np.searchsorted(ends, ends[start] + _READ_AHEAD_BYTES, side="right")) - 1
        return min(max(stop, start + 1), self.info.samples)

    def _read(self, start: int, stop: int) -> Iterator[Sample]:
        """Samples [start, stop): one slice read per field, then cut in memory."""
        shard: _OpenShard = self.handle(start)
        if not 0 <= start < stop <= self.info.samples:
            raise IndexError(f"sample {start} is outside shard {self.path}")
        try:
            chunks = {}
            for name, offsets in shard.offsets.items():
                lo, hi = int(offsets[start]), int(offsets[stop])
                chunks[name] = (shard.datasets[name][lo:hi].tobytes(), lo)
        except Exception as exc:  # h5py raises OSError/RuntimeError/KeyError on broken files
            raise self.corrupt(f"HDF5 read failed ({exc})", start) from exc
        for i in range(start, stop):
            fields: dict[str, Any] = {}
            for name, (data, base) in chunks.items():
                off = shard.offsets[name]
                fields[name] = data[int(off[i]) - base : int(off[i + 1]) - base]
            if shard.labels is not None:
                fields[_INT_FIELD] = str(int(shard.labels[i])).encode("ascii")
            try:
                key = fields.pop(KEY_FIELD).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.corrupt("key is not UTF-8", i) from exc
            yield self.make_sample(i, key, fields)


HDF5 = ShardFormat(
    name="hdf5",
    version=1,
    suffix=".h5",
    writer=Hdf5Writer,
    reader=Hdf5Reader,
    random_access=True,
    supports_urls=True,
)
