"""``webdataset``: WebDataset tar shards as they ship, read in place: img2dataset's output or
``webdataset.ShardWriter``'s.

Layout: ``root/*.tar`` (img2dataset: ``00000.tar`` beside ``00000.parquet`` and
``00000_stats.json``; ShardWriter: ``shard-000000.tar``), one folder of tars per split
(``root/{train,val,validation,test}/*.tar``), or tars whose names hold a split as a word
(``train-000000.tar``, ``imagenet1k-validation-00.tar``; then every tar names one); or one ``.tar``
file. Other sub-folders are not read (counted). A folder dlpipe prepared (``dlpipe.json``, or an
unfinished conversion's journal) is refused: it is a dataset already (``dlpipe verify``).

Samples follow WebDataset's rule: consecutive members whose names share a key (the name up to
the first dot of its file name, folders included: ``a/0001.seg.png`` is key ``a/0001``, field
``seg.png``; extensions lower-cased; a leading ``./`` dropped) are one sample. The image member
(``jpg``, ``jpeg``, ``png``, ``webp`` or another image suffix) is the image; ``cls`` (ASCII
decimal, read during the scan) is the label, named by ``classes.txt`` beside the tars (a name
a line) or by its number; ``txt`` (a caption), ``json`` and every other valid field name keep
their names. Folder members, names without ``key.ext`` and WebDataset's ``__meta__`` members
are skipped, and a member whose extension is no field name is not read: both counted in
``unread_members``. A split's fields are those more than half its samples carry: a sample
lacking one is skipped and listed, an extra member of a sample is dropped and counted
(``dropped_fields``). The key is the member key, escaped (``a/0001`` → ``a%2F0001``); when a key
repeats in two tars of a split, every key becomes ``<tar name>/<member key>``. Task:
classification with ``cls``, captioning when every split has ``txt``.

img2dataset: its ``NNNNN.parquet`` (per-row ``status``) or else ``NNNNN_stats.json`` is read for
``source.img2dataset`` (``success``, ``failed_to_download``, ...); each ``json`` member's
``status`` is read, and a sample whose status is not ``success`` is left out and counted. A tar
holding another number of samples than its metadata's successes, or metadata of successes
without its tar, is refused (a silently short dataset).

Shards in object storage (an fsspec URL: ``s3://bucket/laion``, a folder or one ``.tar``) are
read alike, listed by `dlpipe.converters.url_tree` and read by byte ranges; a tar changed after
the scan (its size or ETag) fails its samples.

Reading (a tar is untrusted): tars are listed by the raw-folder rule, opened with
`open_regular`, walked header by header with dlpipe's own tar reader (`dlpipe.formats.wds`:
sparse members, pax global and oversized extended headers refused), seeking over member data;
a sample's ``ref`` is its members' byte ranges, and `load` reads only those. Nothing is ever
extracted. A member that is a link or device, or named absolute or with ``..``, fails its
sample (skipped and listed). A damaged tar (cut short, a bad header, a member claiming bytes
past the file's end) keeps the samples read whole before the damage and becomes one failing
sample naming the tar and byte: ``--on-error skip`` lists it in errors.jsonl, ``fail`` stops.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable

from dlpipe import storage
from dlpipe.converters.img2dataset import MAX_META_BYTES, Sidecars
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree
from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    file_stamp,
    log,
    open_regular,
    read_text,
)
from dlpipe.converters.url_tree import UrlTree
from dlpipe.converters.wds_tars import CLASSES_FILE, ItemBuilder, Ref, Tar, TarWalker, Walk
from dlpipe.manifest import MANIFEST_NAME
from dlpipe.unfinished import missing_message

__all__ = ["WebDatasetSource"]

# a split's name as a word of the tar's name, as Hugging Face's data files read it: train-0.tar,
# imagenet1k-validation-00.tar, cc3m_test.0.tar (words end at - . _ space or a digit)
_SPLIT_WORD = re.compile(r"(?:^|[-._ 0-9])(train|validation|val|test)(?=[-._ 0-9]|$)")
_COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
_JOURNAL = ".dlpipe-journal"


def _is_tar(name: str) -> bool:
    return name.lower().endswith(".tar")


def _is_folder(root: str) -> bool:
    """A folder of tars (a URL not naming a ``.tar``), or one tar."""
    return not _is_tar(root) if storage.is_url(root) else os.path.isdir(root)


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if storage.is_url(path) else os.path.dirname(path)


def _tree(root: str, listings: Listings | None) -> RawTree | UrlTree:
    """The lister of a raw folder: on disk, or at an fsspec URL (shards in object storage)."""
    return UrlTree(root) if storage.is_url(root) else RawTree(root, listings)


_CLASSES_FIX = "classes.txt holds one UTF-8 class name a line: fix or remove it"


def _read_classes(path: str, folder: str) -> tuple[str, ...]:
    """``classes.txt``: one class name a line (blank lines ignored), each named once."""
    text = read_text(path, folder, max_bytes=MAX_META_BYTES, fix=_CLASSES_FIX)
    names = tuple(line.strip() for line in text.splitlines() if line.strip())
    repeated = [name for name, n in Counter(names).items() if n > 1]
    if repeated:
        raise SourceError(
            f"{display_path(path)}: class {repeated[0]!r} is named twice; each line names one "
            "class (line i is label i)"
        )
    return names


def _split_of_name(name: str) -> str | None:
    match = _SPLIT_WORD.search(name.lower()[: -len(".tar")])
    return SPLIT_NAMES[match[1]] if match else None


def _refuse_prepared(folder: str) -> None:
    """A folder dlpipe wrote (a manifest, or an unfinished conversion's journal) is no raw data."""
    if storage.exists(storage.join(folder, MANIFEST_NAME)):
        raise SourceError(
            f"{display_path(folder)} is a dataset dlpipe prepared ({MANIFEST_NAME}), not raw "
            f"data: check it with `dlpipe verify {display_path(folder)}` and read it as it is "
            "(dlpipe.open_dataset, dlpipe train); convert the raw data it came from instead"
        )
    if storage.exists(storage.join(folder, _JOURNAL)):
        raise SourceError(f"not raw data: {missing_message(folder)}")


def _refuse_compressed(entries: Iterable[RawEntry]) -> None:
    compressed = [e for e in entries if e.name.lower().endswith(_COMPRESSED)]
    if compressed:
        raise SourceError(
            f"{display_path(compressed[0].path)} is a compressed tar; dlpipe reads WebDataset "
            "shards in place by byte ranges, which needs plain .tar files: decompress it "
            "(gunzip, unxz, zstd -d) and convert again"
        )


class WebDatasetSource(Source):
    kind = "webdataset"

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """A ``.tar`` file, or a folder with ``*.tar`` files at its top or in split folders and
        no other sub-folders (so class folders beside an archive stay class folders)."""
        if not _is_folder(root):
            return _is_tar(root) and (storage.is_url(root) or os.path.isfile(root))
        try:
            tree = _tree(root, listings)
            top = tree.listing(root)
            folders = [e for e in top if e.is_dir]
            if any(e.name not in SPLIT_NAMES for e in folders):
                return False
            inside = [e for d in folders for e in tree.listing(d.path)]
        except SourceError:
            return False
        return any(_is_tar(e.name) and not e.is_dir for e in top + inside)

    @property
    def _folder(self) -> str:
        return self.root if _is_folder(self.root) else _parent(self.root)

    def scan(self) -> Scan:
        _refuse_prepared(self._folder)
        tree = _tree(self._folder, self.take_listings())
        tars, files, unread_folders = self._tars(tree)
        sidecars = Sidecars.read(files, {t.path for t in tars}, self.raw_folder)
        walks = [self._walk(tar, statuses=bool(sidecars.counts)) for tar in tars]
        sidecars.check(walks)
        classes_file = storage.join(self._folder, CLASSES_FILE)
        labelled = any(s.label is not None for _, w in walks for s in w.samples)
        named = labelled and _is_folder(self.root) and classes_file in files
        builder = ItemBuilder(_read_classes(classes_file, self.raw_folder) if named else ())
        for tar, walk in walks:
            builder.add(tar, walk)
        items = builder.items()
        task, schema = builder.task()
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": self._layout(tars, sidecars),
            "tars": len(tars),
            "unused": {
                "other": len(files) - sidecars.used - named,
                "folders": unread_folders,
                "tar members": sum(builder.unread.values()),
            },
            **builder.report(),
            **sidecars.report(builder.not_success),
            **tree.report(),
        }
        return Scan(builder.classes, items, description, task=task, field_schemas=schema)

    def _walk(self, tar: Tar, statuses: bool) -> tuple[Tar, Walk]:
        try:
            with open_regular(tar.path, self.raw_folder) as f:
                return tar, TarWalker(f, statuses).run()
        except SampleError as exc:
            raise SourceError(f"{exc}; fix its permissions or remove it") from exc

    def _tars(self, tree: RawTree) -> tuple[list[Tar], list[str], int]:
        """The tars and their splits, the other files (sidecars included), and how many
        sub-folders are not read."""
        top = tree.listing(self._folder)
        if not _is_folder(self.root):  # one tar file, and its own sidecars
            name = self.root[len(_parent(self.root)) + 1 :]
            wanted = {name, f"{name[:-4]}.parquet", f"{name[:-4]}_stats.json"}
            top = [e for e in top if not e.is_dir and e.name in wanted]
        split_dirs = [e for e in top if e.is_dir and e.name in SPLIT_NAMES]
        unread = sum(e.is_dir and e.name not in SPLIT_NAMES for e in top)
        entries: list[tuple[RawEntry, str | None]] = [(e, None) for e in top if not e.is_dir]
        for folder in split_dirs:
            found = tree.listing(folder.path)
            unread += sum(e.is_dir for e in found)
            entries += [(e, SPLIT_NAMES[folder.name]) for e in found if not e.is_dir]
        _refuse_compressed(e for e, _ in entries)
        tars = [(e, split) for e, split in entries if _is_tar(e.name)]
        loose = [e for e, split in tars if split is None]
        if split_dirs and loose:
            raise SourceError(
                f"{display_path(loose[0].path)} lies beside the split folders "
                f"{', '.join(e.name for e in split_dirs)}, in none of them; move it into one"
            )
        if not split_dirs:
            tars = _named_splits(loose)
        if unread:
            log.warning("%s: %d sub-folders are not read", display_path(self._folder), unread)
        if not tars:
            raise SourceError(
                f"{display_path(self.root)}: no .tar files at its top or in split folders "
                "(train/, val/, test/)"
            )
        others = [e.path for e, _ in entries if not _is_tar(e.name)]
        return [Tar(e.path, split) for e, split in tars], others, unread

    @staticmethod
    def _layout(tars: list[Tar], sidecars: Sidecars) -> str:
        splits = sorted({t.split for t in tars if t.split})
        where = f"splits {', '.join(splits)}" if splits else "one split"
        if sidecars.counts:
            return f"img2dataset output: {len(tars)} tars beside .parquet/_stats.json ({where})"
        return f"WebDataset shards: {len(tars)} .tar files ({where})"

    def load(self, item: Item) -> dict[str, bytes]:
        """The sample's members, read from their byte ranges in the tar."""
        ref: Ref = item.ref
        if ref.problem:
            raise SampleError(f"{item.origin}: {ref.problem}")
        fields = {}
        with open_regular(ref.tar, self.raw_folder) as f:
            if file_stamp(f) != ref.stamp:
                raise SampleError(f"{display_path(ref.tar)}: changed since the scan; convert again")
            for name, offset, size in ref.members:
                try:
                    f.seek(offset)
                    fields[name] = f.read(size)
                except OSError as exc:
                    raise SampleError(f"{item.origin}: cannot be read ({exc})") from exc
                if len(fields[name]) != size:
                    raise SampleError(f"{item.origin}: the tar ends inside its {name} member")
        return fields


def _named_splits(tars: list[RawEntry]) -> list[tuple[RawEntry, str | None]]:
    """Splits from the tar names (``train-000000.tar``): every tar names one, or none does."""
    named = [(e, _split_of_name(e.name)) for e in tars]
    unnamed = [e for e, split in named if split is None]
    if unnamed and len(unnamed) < len(named):
        other = next(e.name for e, split in named if split)
        raise SourceError(
            f"{display_path(unnamed[0].path)} names no split while other tars do ({other}); "
            "name a split in every tar's name (train-, val-, test-...), or put the tars in "
            "train/, val/, test/ folders"
        )
    return named
