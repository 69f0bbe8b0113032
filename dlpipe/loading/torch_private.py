"""Every use the loading room makes of torch's private (underscored) API, each behind one name.

torch does not promise these across releases, so each is wrapped here, says which behaviour it
relies on (as of torch 2.x, checked on 2.14), and has a test in ``tests/test_torch_private.py``
that fails if torch changes it. No other module of the loading room touches an underscored
name of torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data
from torch.utils.data._utils.collate import collate as _collate
from torch.utils.data._utils.collate import collate_tensor_fn as _collate_tensor_fn
from torch.utils.data._utils.collate import default_collate_fn_map as _default_collate_fn_map
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

__all__ = [
    "HookedDataLoader",
    "collate_tensors",
    "collate_with",
    "default_collate_fns",
    "pin_batch",
    "shared_memory_like",
    "shutdown_workers",
]

CollateMap = dict[Any, Callable[..., Any]]


def collate_with(batch: list[Any], collate_fn_map: CollateMap) -> Any:
    """`batch` collated as ``default_collate`` does (recursing into mappings, tuples, named
    tuples and lists), with each element type's function taken from `collate_fn_map`.

    Relies on ``torch.utils.data._utils.collate.collate(batch, collate_fn_map=...)``, the
    function ``default_collate`` runs and whose map its docstring documents (torch >= 1.13).
    """
    return _collate(batch, collate_fn_map=collate_fn_map)


def collate_tensors(batch: list[torch.Tensor], collate_fn_map: CollateMap | None = None) -> Any:
    """Tensors stacked as ``default_collate`` stacks them: into a shared-memory tensor inside
    a DataLoader worker, and with torch's own error for tensors of different shapes.

    Relies on ``torch.utils.data._utils.collate.collate_tensor_fn`` (torch >= 1.13).
    """
    return _collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def default_collate_fns() -> CollateMap:
    """A copy of ``default_collate``'s type → function map (``torch.Tensor`` →
    `collate_tensors`, numpy arrays, numbers, strings), to override entries of.

    Relies on ``torch.utils.data._utils.collate.default_collate_fn_map`` (torch >= 1.13).
    """
    return dict(_default_collate_fn_map)


def shared_memory_like(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised CPU tensor of `tensor`'s dtype and `shape` in shared memory: what a
    DataLoader worker stacks a batch into, so it crosses to the main process without a copy.

    Relies on ``Tensor._typed_storage()._new_shared(numel)``, as ``collate_tensor_fn`` uses
    it in a worker (torch >= 2.0).
    """
    numel = 1
    for size in shape:
        numel *= size
    storage = tensor._typed_storage()._new_shared(numel)
    return tensor.new(storage).resize_(*shape)


def pin_batch(batch: Any) -> Any:
    """`batch` with its tensors in pinned memory, as the DataLoader's pin-memory thread pins a
    worker's batch: named tuples stay their type, tuples and lists become lists, anything not
    a tensor is left as it is.

    Relies on ``torch.utils.data._utils.pin_memory.pin_memory(data)`` (torch >= 1.13).
    """
    return _pin_memory(batch)


def shutdown_workers(loader: torch.utils.data.DataLoader, *iterators: Any) -> None:
    """End the worker processes of `loader`'s persistent iterator and of `iterators` (any
    that are not multi-process iterators are passed over) and forget the persistent one, so
    the next ``iter(loader)`` starts fresh workers.

    Relies on the DataLoader keeping its persistent-workers iterator in ``loader._iterator``
    and on ``_MultiProcessingDataLoaderIter._shutdown_workers()`` ending and joining its
    workers, and being safe to call twice (torch >= 1.7).
    """
    for iterator in (getattr(loader, "_iterator", None), *iterators):
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
    loader._iterator = None


class HookedDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose private hooks a subclass overrides through public methods:
    `starting_iterator` around each iterator torch makes, and `warns_about_workers` before
    torch's warning about more workers than cores.

    Relies on ``DataLoader.__iter__`` making each iterator (the first one with persistent
    workers, where the workers start) in ``DataLoader._get_iterator()``, and on
    ``check_worker_number_rationality()`` being where ``DataLoader.__init__`` and
    ``_get_iterator`` warn about the worker count (torch >= 1.7; `warns_about_workers` must
    work before a subclass's ``__init__`` has called the DataLoader's).
    """

    def starting_iterator(self) -> contextlib.AbstractContextManager[None]:
        """What surrounds the making of each DataLoader iterator (its workers' start)."""
        return contextlib.nullcontext()

    def warns_about_workers(self) -> bool:
        """Whether torch may warn that ``num_workers`` is more than this machine's cores."""
        return True

    def _get_iterator(self) -> Any:
        with self.starting_iterator():
            return super()._get_iterator()

    def check_worker_number_rationality(self) -> None:
        if self.warns_about_workers():
            super().check_worker_number_rationality()
