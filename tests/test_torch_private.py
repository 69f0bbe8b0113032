"""torch's private API as `dlpipe.loading.torch_private` relies on it: one test per wrapper.

Each test asserts the behaviour the loading room depends on, so a torch release that changes
it fails here, by name, rather than somewhere inside a loader. A last test keeps every other
module of the loading room off torch's underscored names.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.data

import dlpipe
from dlpipe.loading import torch_private
from dlpipe.loading.torch_private import (
    HookedDataLoader,
    collate_tensors,
    collate_with,
    default_collate_fns,
    pin_batch,
    shared_memory_like,
    shutdown_workers,
)


class _Pair(NamedTuple):
    batch: Any
    runs: list[tuple[int, int]]


def test_collate_with_recurses_and_takes_each_type_s_function_from_the_map() -> None:
    seen = []

    def stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        seen.append(len(batch))
        return torch.stack(batch)

    batch = [{"x": torch.zeros(2), "y": (torch.ones(1), 3)} for _ in range(4)]
    out = collate_with(batch, {**default_collate_fns(), torch.Tensor: stack})
    assert out["x"].shape == (4, 2) and out["y"][0].shape == (4, 1)
    assert out["y"][1].tolist() == [3, 3, 3, 3] and seen == [4, 4]


def test_collate_tensors_stacks_and_names_a_shape_mismatch() -> None:
    stacked = collate_tensors([torch.ones(2), torch.zeros(2)])
    assert torch.equal(stacked, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(RuntimeError, match="size"):
        collate_tensors([torch.ones(2), torch.zeros(3)])


def test_default_collate_fns_is_a_copy_with_a_tensor_entry() -> None:
    fns = default_collate_fns()
    assert fns[torch.Tensor] is torch.utils.data._utils.collate.collate_tensor_fn
    fns[torch.Tensor] = None
    assert default_collate_fns()[torch.Tensor] is not None


def test_shared_memory_like_is_a_shared_tensor_of_the_shape_and_dtype() -> None:
    out = shared_memory_like(torch.zeros(3, dtype=torch.uint8), (4, 2, 3))
    assert out.is_shared() and out.shape == (4, 2, 3) and out.dtype == torch.uint8
    out.fill_(7)
    assert int(out.sum()) == 7 * 24


def test_pin_batch_keeps_a_named_tuple_and_its_runs() -> None:
    piece = pin_batch(_Pair("raw samples", [(0, 4), (8, 12)]))
    assert type(piece) is _Pair and piece.batch == "raw samples"
    assert [tuple(run) for run in piece.runs] == [(0, 4), (8, 12)]
    if torch.cuda.is_available():
        assert pin_batch(_Pair(torch.zeros(2), [])).batch.is_pinned()


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


def test_shutdown_workers_ends_the_persistent_workers_and_forgets_them() -> None:
    loader = torch.utils.data.DataLoader(
        _Numbers(), batch_size=2, num_workers=1, persistent_workers=True
    )
    first = iter(loader)
    assert next(first).tolist() == [0, 1]
    assert iter(loader) is first  # torch keeps the persistent iterator ...
    workers = list(first._workers)
    assert all(worker.is_alive() for worker in workers)
    shutdown_workers(loader, first)
    assert not any(worker.is_alive() for worker in workers)  # ... and this ends its workers
    shutdown_workers(loader, first)  # twice is harmless
    again = iter(loader)
    assert again is not first and [b.tolist() for b in again] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    shutdown_workers(loader)


class _Counting(HookedDataLoader):
    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any) -> None:
        self.started, self.quiet = 0, quiet  # torch checks the worker count in __init__ too
        super().__init__(*args, **kwargs)

    def starting_iterator(self) -> Any:
        self.started += 1
        return super().starting_iterator()

    def warns_about_workers(self) -> bool:
        return not self.quiet


def test_hooked_data_loader_hooks_each_iterator_and_the_worker_count_warning() -> None:
    loader = _Counting(_Numbers(), batch_size=4)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    list(loader)
    assert loader.started == 2  # each iter() makes its iterator through the hook
    many = 10_000  # more workers than any machine's cores: torch warns ...
    with pytest.warns(UserWarning, match="worker"):
        _Counting(_Numbers(), num_workers=many)
    with warnings.catch_warnings():  # ... unless the hook says not to
        warnings.simplefilter("error")
        _Counting(_Numbers(), num_workers=many, quiet=True).check_worker_number_rationality()


def test_no_other_loading_module_touches_a_private_name_of_torch() -> None:
    private = re.compile(
        r"torch[\w.]*\._[a-z]"  # torch.utils.data._utils, ...
        r"|\._(get_iterator|shutdown_workers|iterator|typed_storage|new_shared)\b"
    )
    room = Path(dlpipe.__file__).parent / "loading"
    mine = Path(torch_private.__file__).name
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(room.glob("*.py"))
        if path.name != mine
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, found
