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

On read a shard is untrusted input. At open, before any data is read, the root group must hold
exactly these datasets as hard links (soft and external links are refused, never followed), each
1-D, of its dtype, contiguous in the file, with no filters, no external raw storage and not
virtual, fully allocated and lying inside the file; the offsets must start at 0, never decrease
and end at the blob's length. So every read is bounded by the file's size and nothing outside
the file is read. Chunked, compressed or compact datasets are refused: dlpipe never writes them.

The blob layout was chosen over variable-length (``vlen``) datasets by measurement
(``benchmarks/hdf5_layout.py``; figures in docs/formats.md). Read it with plain h5py::

    with h5py.File("train-000000.h5") as f:
        off = f["jpg.offsets"][:]
        jpg_bytes = f["jpg"][off[3]:off[4]].tobytes()
        label = int(f["cls"][3])
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from dlpipe import storage
from dlpipe.formats.base import SampleCountError, ShardFileWriter, ShardFormat, ShardReader
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["HDF5"]

_INT_FIELD = "cls"
_OFFSETS = ".offsets"
_LAYOUT_NAMES = {
    h5py.h5d.COMPACT: "compact",
    h5py.h5d.CHUNKED: "chunked",
    getattr(h5py.h5d, "VIRTUAL", 3): "virtual (VDS)",
}
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
                ds = f.create_dataset(name, shape=(len(blob),), dtype=np.uint8, track_times=False)
                _write_in_slices(ds, np.frombuffer(blob, dtype=np.uint8))
                ds.attrs["layout"] = "blob"
                f.create_dataset(
                    f"{name}.offsets",
                    track_times=False,
                    data=np.asarray(self._offsets[name], dtype=np.uint64),
                )
        self._blobs.clear()


_WRITE_SLICE_BYTES = 2 << 20


def _write_in_slices(dataset: h5py.Dataset, data: np.ndarray) -> None:
    """`data` into the contiguous `dataset`, 2 MiB per write: one 30 MB ``pwrite`` of the
    whole blob took three times the system time of the same bytes in slices (the kernel's
    copy into the page cache, benchmarks/convert.py); the file's bytes are the same."""
    for start in range(0, len(data), _WRITE_SLICE_BYTES):
        end = min(start + _WRITE_SLICE_BYTES, len(data))
        dataset.write_direct(data, np.s_[start:end], np.s_[start:end])


class _OpenShard:
    """The open file, its checked datasets, and each blob field's offsets, read once per process."""

    def __init__(self, reader: Hdf5Reader) -> None:
        path = reader.path
        self.fileobj = storage.open_read(path) if storage.is_url(path) else None
        self.file = h5py.File(self.fileobj or storage.local_path(path), "r")
        try:
            if self.fileobj is None:  # the file HDF5 opened is the regular file checked at open
                reader.check_same_file(os.fstat(self.file.id.get_vfd_handle()))
            self.datasets = _checked_datasets(self.file, reader)
            blobs = [n for n in (KEY_FIELD, *reader.fields) if n != _INT_FIELD]
            self.offsets = {n: _checked_offsets(n, self.datasets, reader) for n in blobs}
            labels = self.datasets.get(_INT_FIELD)
            self.labels = labels[:] if labels is not None else None
            # where each sample ends in all blobs together, to size sequential reads
            self.sample_ends = np.sum(list(self.offsets.values()), axis=0)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        self.file.close()
        if self.fileobj is not None:
            self.fileobj.close()


def _expected(reader: Hdf5Reader) -> dict[str, tuple[str, int | None]]:
    """Dataset name -> (dtype kind + bytes, length or None), as `Hdf5Writer` writes them."""
    n = reader.info.samples
    out: dict[str, tuple[str, int | None]] = {}
    for name in (KEY_FIELD, *reader.fields):
        if name == _INT_FIELD:
            out[name] = ("i8", n)
        else:
            out[name] = ("u1", None)
            out[name + _OFFSETS] = ("u8", n + 1)
    return out


def _checked_datasets(file: h5py.File, reader: Hdf5Reader) -> dict[str, h5py.Dataset]:
    """The root's datasets, each checked against what the writer writes, before any is read."""
    expected = _expected(reader)
    names = list(file)  # link names; listing them follows none
    for name in names:
        link = file.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise reader.unsafe(f"{type(link).__name__} {name!r}")
    if set(names) != set(expected):
        raise reader.corrupt(
            f"holds datasets {sorted(names)}; a dlpipe shard of fields "
            f"{sorted(reader.fields)} holds {sorted(expected)}"
        )
    _check_count(file, reader)
    datasets = {}
    for name, (dtype, length) in expected.items():
        obj = file.get(name)
        if not isinstance(obj, h5py.Dataset):
            raise reader.corrupt(f"{name!r} is a {type(obj).__name__}, not a dataset")
        _check_dataset(name, obj, dtype, length, reader)
        datasets[name] = obj
    return datasets


def _check_count(file: h5py.File, reader: Hdf5Reader) -> None:
    """The shard's sample count (its key offsets' length, less one: metadata, nothing read) is
    the manifest's, or a `SampleCountError` names both."""
    offsets = file.get(KEY_FIELD + _OFFSETS)
    if isinstance(offsets, h5py.Dataset) and offsets.ndim == 1 and offsets.shape[0] >= 1:
        found = int(offsets.shape[0]) - 1
        if found != reader.info.samples:
            raise reader.count_mismatch(found)


def _check_dataset(
    name: str, ds: h5py.Dataset, dtype: str, length: int | None, reader: Hdf5Reader
) -> None:
    """One dataset is 1-D, of `dtype`, contiguous, unfiltered, local and fully in the file."""
    plist = ds.id.get_create_plist()
    if plist.get_external_count():
        raise reader.unsafe(f"dataset {name!r} with its data in external files")
    layout = plist.get_layout()
    if layout != h5py.h5d.CONTIGUOUS:
        kind = _LAYOUT_NAMES.get(layout, f"layout {layout}")
        raise reader.unsafe(f"dataset {name!r} with a {kind} layout")
    if plist.get_nfilters():
        raise reader.unsafe(f"dataset {name!r} with filters (compression or user-defined)")
    found = f"{ds.dtype.kind}{ds.dtype.itemsize}"
    if ds.ndim != 1 or found != dtype or (length is not None and ds.shape[0] != length):
        want = f"({length if length is not None else 'n'},) {dtype}"
        raise reader.corrupt(f"dataset {name!r} is {ds.shape} {found}; expected {want}")
    nbytes = ds.shape[0] * ds.dtype.itemsize
    if nbytes == 0:
        return
    offset = ds.id.get_offset()
    if ds.id.get_storage_size() != nbytes or offset is None or offset + nbytes > reader.info.bytes:
        raise reader.corrupt(
            f"dataset {name!r} claims {nbytes} bytes but {ds.id.get_storage_size()} are stored "
            f"at byte {offset} of a {reader.info.bytes}-byte file (unallocated or outside it)"
        )


def _checked_offsets(name: str, datasets: dict[str, h5py.Dataset], reader: Hdf5Reader) -> Any:
    """A blob's offsets as int64: from 0, never decreasing, ending at the blob's length."""
    offsets = datasets[name + _OFFSETS][:].astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != datasets[name].shape[0] or np.any(np.diff(offsets) < 0):
        raise reader.corrupt(
            f"offsets of {name!r} do not run from 0 up to its {datasets[name].shape[0]} bytes"
        )
    return offsets


class Hdf5Reader(ShardReader):
    indexable = True

    def _open(self) -> Any:
        return _OpenShard(self)

    def count_samples(self) -> int:
        """From the key offsets (opening checks them against the blob and the file)."""
        try:
            return len(self.handle().offsets[KEY_FIELD]) - 1
        except SampleCountError as exc:
            assert exc.found is not None  # the offsets give the count
            return exc.found

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
