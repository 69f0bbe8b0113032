"""A wds shard's reader answers `get(index)` (a mixture draws its samples by index): the
same sample as a pass over the shard gives at that index, in any order, after a pickle round
trip, between the samples of a pass; and a shard a pass refuses is refused by `get` with the
same error. The format itself stays streaming: a wds dataset is read in passes."""

from __future__ import annotations

import os
import pickle
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FORMAT_NAMES, mixed_samples, write_dataset
from test_bad_input import first_shard, resync_manifest
from test_hostile_counts import _miscount
from test_hostile_shards import (
    TINY,
    WDS_HOSTILE,
    good_members,
    in_bounded_child,
    tar_end,
    tar_member,
    tiny_dataset,
)

import dlpipe
from dlpipe.formats.base import ShardReader
from dlpipe.manifest import ShardInfo

LONG_KEY = "k" * 150  # its member names need pax headers: tarfile's parser reads from there
_OPENED: list[ShardReader] = []


@pytest.fixture(autouse=True)
def _close_readers() -> Iterator[None]:
    """Every reader a test made is closed after it (`get` keeps a descriptor open)."""
    yield
    while _OPENED:
        _OPENED.pop().close()


def shard_readers(path: str, split: str = "train") -> list[ShardReader]:
    """The format's own reader of every shard of `split`, as a loader makes them."""
    manifest = dlpipe.read_manifest(path)
    fmt = dlpipe.FORMATS[manifest.format]
    fields = list(manifest.fields_of(split))
    shards = manifest.splits[split].shards
    readers = [fmt.reader(str(Path(path, info.name)), info, fields) for info in shards]
    _OPENED.extend(readers)
    return readers


def pass_outcome(reader: ShardReader) -> list[dict] | str:
    """Every sample of one pass over the shard, or the error that stops it."""
    try:
        return [dict(sample) for sample in reader]
    except dlpipe.DlpipeError as exc:
        return f"{type(exc).__name__}: {exc}"


def get_outcome(reader: ShardReader, index: int) -> dict | str:
    try:
        return dict(reader.get(index))
    except dlpipe.DlpipeError as exc:
        return f"{type(exc).__name__}: {exc}"


def dataset(folder: Path, fmt: str) -> str:
    """Three shards of 8, 8 and 4 samples of every field kind; the last sample's key is long."""
    items = mixed_samples(20)
    items[-1] = {**items[-1], "__key__": LONG_KEY}
    return write_dataset(folder / fmt, fmt, {"train": items})


@pytest.fixture
def wds_dataset(tmp_path: Path) -> str:
    return dataset(tmp_path, "wds")


def test_the_registry_says_which_readers_answer_get() -> None:
    assert dlpipe.FORMATS["wds"].reader.indexable
    assert not dlpipe.FORMATS["wds"].random_access  # a wds dataset still streams
    assert all(fmt.reader.indexable for fmt in dlpipe.FORMATS.values())
    assert not ShardReader.indexable


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_get_is_the_passs_sample_at_every_index_in_any_order(fmt, tmp_path) -> None:
    order = random.Random(0)
    for reader in shard_readers(dataset(tmp_path, fmt)):
        passed = pass_outcome(reader)
        indices = list(range(len(reader)))
        order.shuffle(indices)
        assert {i: dict(reader.get(i)) for i in indices} == dict(enumerate(passed))
    assert dict(reader.get(len(reader) - 1))["__key__"] == LONG_KEY


def test_open_dataset_by_index_reads_a_wds_split_at_random(wds_dataset) -> None:
    streamed = [dict(s) for s in dlpipe.open_dataset(wds_dataset, "train")]
    with dlpipe.open_dataset(wds_dataset, "train", by_index=True) as ds:
        assert isinstance(ds, dlpipe.MapDataset) and len(ds) == len(streamed)
        order = random.Random(3).sample(range(len(ds)), len(ds))
        assert [dict(ds[i]) for i in order] == [streamed[i] for i in order]
    with pytest.raises(TypeError, match="streaming"):
        dlpipe.open_dataset(wds_dataset, "train")[0]


def test_get_reads_the_same_after_a_pickle_round_trip_which_carries_no_index(
    wds_dataset,
) -> None:
    reader = shard_readers(wds_dataset)[0]
    passed = pass_outcome(reader)
    before = pickle.dumps(reader)
    assert dict(reader.get(5)) == passed[5]
    assert pickle.dumps(reader) == before  # no index, no descriptor
    copy = pickle.loads(before)
    _OPENED.append(copy)
    assert [dict(copy.get(i)) for i in reversed(range(len(copy)))] == passed[::-1]


def test_get_between_the_samples_of_a_pass_moves_neither(wds_dataset) -> None:
    reader = shard_readers(wds_dataset)[1]
    passed = pass_outcome(reader)
    stream = iter(reader)
    for i, index in enumerate([7, 0, 3, 3, 6, 1, 2, 5]):
        assert dict(next(stream)) == passed[i]
        assert dict(reader.get(index)) == passed[index]
    assert next(stream, None) is None


def test_get_goes_on_after_close_and_rechecks_the_file(wds_dataset) -> None:
    reader = shard_readers(wds_dataset)[0]
    assert dict(reader.get(2)) == pass_outcome(reader)[2]
    reader.close()
    assert dict(reader.get(2)) == pass_outcome(reader)[2]
    reader.close()
    os.truncate(reader.path, reader.info.bytes - 512)
    with pytest.raises(dlpipe.ShardCorruptError, match="bytes but the manifest says"):
        reader.get(2)


def test_a_shard_replaced_after_close_is_walked_again(tmp_path) -> None:
    """The index belongs to the file that was walked: the same bytes in another member order
    (same size, same manifest entry) read right once the reader is closed and opened again."""
    reader = crafted(tmp_path, good_members() + tar_end())
    assert get_outcome(reader, 1) == TINY[1]
    reader.close()
    swapped = b"".join(
        tar_member(f"{s['__key__']}.txt", s["txt"]) + tar_member(f"{s['__key__']}.cls", s["cls"])
        for s in TINY
    )
    Path(reader.path + ".new").write_bytes(swapped + tar_end())
    os.replace(reader.path + ".new", reader.path)
    assert [get_outcome(reader, i) for i in range(4)] == TINY


def test_a_forked_child_reads_by_the_parents_index_on_its_own_descriptor(wds_dataset) -> None:
    reader = shard_readers(wds_dataset)[0]
    passed = pass_outcome(reader)
    assert dict(reader.get(0)) == passed[0]

    def read_in_child() -> None:
        got = [dict(reader.get(i)) for i in (7, 1, 4)]
        reader.close()  # the child's own descriptor; the parent's stays open
        assert got == [passed[i] for i in (7, 1, 4)]

    assert in_bounded_child(read_in_child) == "ok"
    assert [dict(reader.get(i)) for i in (7, 1, 4)] == [passed[i] for i in (7, 1, 4)]


def test_a_shard_cut_short_under_an_open_reader_is_the_passs_error(tmp_path) -> None:
    text = b"x" * 100_000
    items = [{"__key__": f"s{i}", "cls": b"1", "txt": text} for i in range(6)]
    reader = shard_readers(write_dataset(tmp_path / "data", "wds", {"train": items}))[0]
    assert reader.get(0)["txt"] == text  # the index is built, the shard open
    os.truncate(reader.path, reader.info.bytes // 2)  # where the fourth sample's text begins
    with pytest.raises(dlpipe.ShardCorruptError) as caught:
        reader.get(3)
    assert "sample 3: member 's3.txt' ends after 0 of its 100000 bytes" in str(caught.value)
    assert reader.path in str(caught.value)


@pytest.mark.parametrize("index", [-1, 8, 10**9])
def test_an_index_outside_the_shard_is_an_index_error(wds_dataset, index) -> None:
    reader = shard_readers(wds_dataset)[0]
    with pytest.raises(IndexError, match=f"sample {index} is outside shard .*holds 8"):
        reader.get(index)


def test_a_url_shard_is_refused_before_any_read() -> None:
    info = ShardInfo(name="train-000000.tar", samples=4, bytes=10240, sha256="0" * 64)
    reader = dlpipe.FORMATS["wds"].reader("s3://bucket/data/train-000000.tar", info, ["cls"])
    with pytest.raises(dlpipe.UnsupportedStorageError, match="needs a local file"):
        reader.get(0)


def crafted(tmp_path: Path, body: bytes) -> ShardReader:
    """The reader of a one-shard dataset of `TINY` whose shard is now `body` (the manifest
    made to agree with its bytes, as a hostile writer would, still counting four samples)."""
    path = tiny_dataset(tmp_path, "wds")
    first_shard(path).write_bytes(body)
    resync_manifest(path)
    return shard_readers(path)[0]


def symlink_member(name: str, target: str) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


def after_first_sample(members: bytes) -> bytes:
    """`members` between the first sample of `TINY` and the other three."""
    return good_members()[:2048] + members + good_members(1) + tar_end()


FIRST_FIELD = 1024  # the bytes of s0.cls (header and one block of data)

HEADER_FAULTS = {
    **{case: body for case, (body, _, _) in WDS_HOSTILE.items()},
    "dot-dot": after_first_sample(tar_member("../x.cls", b"1") + tar_member("../x.txt", b"a")),
    "slash": after_first_sample(tar_member("a/s9.cls", b"1") + tar_member("a/s9.txt", b"a")),
    "absolute": after_first_sample(tar_member("/s9.cls", b"1") + tar_member("/s9.txt", b"a")),
    "symlink": after_first_sample(symlink_member("s9.cls", "/etc/passwd")),
    "one-sample-more": good_members()
    + tar_member("s4.cls", b"1")
    + tar_member("s4.txt", b"a")
    + tar_end(),
    "one-sample-fewer": good_members(1) + tar_end(),
    "one-sample-more-then-unreadable": good_members()
    + tar_member("s4.cls", b"1")
    + WDS_HOSTILE["gnu-sparse"][0][3 * 2048 :],
    "a-field-missing": good_members(1) + tar_member("s0.cls", b"1") + tar_end(),
    "a-field-more": good_members()[:FIRST_FIELD]
    + tar_member("s0.json", b"{}")
    + good_members()[FIRST_FIELD:]
    + tar_end(),
    "bad-checksum": good_members()[:2048] + b"\xff" + good_members()[2049:] + tar_end(),
}


@pytest.mark.parametrize("case", sorted(HEADER_FAULTS))
def test_a_shard_a_pass_refuses_is_refused_by_get_at_any_index_with_its_error(
    case, tmp_path
) -> None:
    """A fault in any member header refuses the whole shard, as the pass over it does, with
    the same error (naming the shard and the sample at fault); under an address-space limit,
    so the index walk reads no more than a pass."""
    reader = crafted(tmp_path, HEADER_FAULTS[case])
    refused = in_bounded_child(lambda: list(reader))
    assert refused.startswith(("ShardCorruptError: ", "UnsafeMemberError: ", "SampleCountError")), (
        refused
    )
    assert f"shard {reader.path}" in refused
    for index in range(len(reader)):
        assert in_bounded_child(lambda: reader.get(index)) == refused, index  # noqa: B023


@pytest.mark.parametrize(
    ("case", "error", "counts"),
    [
        ("dot-dot", dlpipe.UnsafeMemberError, None),
        ("symlink", dlpipe.UnsafeMemberError, None),
        ("one-sample-more", dlpipe.SampleCountError, (5, 4)),
        ("one-sample-fewer", dlpipe.SampleCountError, (3, 4)),
    ],
)
def test_get_raises_the_error_types_a_user_catches(case, error, counts, tmp_path) -> None:
    reader = crafted(tmp_path, HEADER_FAULTS[case])
    with pytest.raises(error) as caught:
        reader.get(0)
    if counts is not None:
        assert (caught.value.found, caught.value.expected) == counts


@pytest.mark.parametrize("delta", [-1, +1])
def test_a_manifest_miscounting_the_shard_is_the_passs_count_error(delta, tmp_path) -> None:
    path = write_dataset(tmp_path / "wds", "wds", {"train": mixed_samples(16)})
    _miscount(path, delta)
    reader = shard_readers(path)[0]
    refused = pass_outcome(reader)
    assert isinstance(refused, str)
    assert f"holds 8 samples but the manifest says {8 + delta}" in refused
    assert {get_outcome(reader, i) for i in range(8 + delta)} == {refused}
    with pytest.raises(IndexError):
        reader.get(8 + delta)


@pytest.mark.parametrize(
    ("cls", "message"),
    [(b"99999999999999999999", "beyond int64"), (b"-0x1", "canonical ASCII")],
)
def test_a_bad_value_is_refused_by_its_own_samples_get_only(cls, message, tmp_path) -> None:
    """A sample's bytes are checked when it is read, by a pass or by `get`: the others read."""
    bad = tar_member("s2.cls", cls) + tar_member("s2.txt", TINY[2]["txt"])
    reader = crafted(tmp_path, good_members()[:4096] + bad + good_members(3) + tar_end())
    refused = pass_outcome(reader)
    assert isinstance(refused, str) and message in refused and "sample 2" in refused
    assert get_outcome(reader, 2) == refused
    assert [get_outcome(reader, i) for i in (0, 1, 3)] == [TINY[i] for i in (0, 1, 3)]
