"""A stream worker's last few samples reach the loader through its pipe as bytes, not as one
shared-memory segment (a file descriptor over a socket) per tensor; the batches are unchanged."""

from __future__ import annotations

from collections import namedtuple
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # registers the reductions that put tensors in shared memory
from conftest import batch_list, write_dataset

import dlpipe
from dlpipe.loading.views import pack_rows, unpack_rows

Pair = namedtuple("Pair", "image label")


def rows() -> list:
    image = torch.arange(2 * 5 * 7, dtype=torch.uint8).reshape(2, 5, 7)
    return [
        (image, 3),
        Pair(image.float().transpose(1, 2), torch.tensor(4)),  # a strided view, a 0-d tensor
        {"x": [image[:, 1], torch.ones(2, dtype=torch.bfloat16)], "key": "k", "raw": b"\x00"},
    ]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_packed_rows_come_back_as_they_were() -> None:
    back = unpack_rows(ForkingPickler.loads(ForkingPickler.dumps(pack_rows(rows()))))
    assert all(same(a, b) for a, b in zip(rows(), back, strict=True))
    plain = rows()
    assert unpack_rows(plain) == plain  # samples from the loading process pass through


def test_packed_rows_send_no_shared_memory_but_the_unpacked_ones_would() -> None:
    image_rows = [(torch.zeros(3, 8, 8, dtype=torch.uint8), i) for i in range(4)]
    assert b"rebuild_storage" in bytes(ForkingPickler.dumps(image_rows))
    assert b"rebuild_storage" not in bytes(ForkingPickler.dumps(pack_rows(image_rows)))


def per_sample(batches: list) -> list[tuple[int, bytes]]:
    return sorted(
        (int(label), image.numpy().tobytes())
        for images, labels in batches
        for image, label in zip(images, labels, strict=True)
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_leftovers_give_every_sample_as_zero_workers_do(workers, tmp_path, samples) -> None:
    """Shards of 5 samples, batches of 16: every worker ends its pass with leftovers, merged
    in the loading process; each sample comes once, with the 0-worker loader's pixels."""
    path = write_dataset(tmp_path / "data", "wds", {"train": samples}, max_shard_samples=5)
    options = dict(batch_size=16, image_size=16, profile=None, drop_last=False, seed=2)
    inline = batch_list(dlpipe.make_loader(path, "train", num_workers=0, **options))
    loaded = batch_list(dlpipe.make_loader(path, "train", num_workers=workers, **options))
    assert [len(b[0]) for b in loaded] == [16, 16, 8]
    assert per_sample(loaded) == per_sample(inline)
