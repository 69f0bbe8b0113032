"""`make_loader`: a prepared dataset as a resumable ``StatefulDataLoader`` of uint8 batches.

    loader = dlpipe.make_loader("data/pets-lmdb", "train", batch_size=256)
    for images, labels in loader:          # uint8 (N, 3, 224, 224), int64 (N,)
        x = dlpipe.normalize(images, "cuda")
    state = loader.state_dict()            # mid-epoch; a new loader's load_state_dict resumes

Random-access formats (lmdb, hdf5) go through `EpochSampler`: seeded per epoch, exact per rank,
resumable without re-reading skipped samples. The streaming format (wds) gives each rank and
worker whole shards (`dlpipe.loading.dataset.StreamDataset`).

Worker settings: explicit ``num_workers=``, ``prefetch_factor=``, ``pin_memory=`` win; then a
profile measured by ``dlpipe bench-loader`` for this dataset, machine and call
(`dlpipe.loading.profile`, found with ``profile="auto"``); otherwise a sensible default (all
usable cores but one, prefetch 2, pinned memory when CUDA is there).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

from dlpipe.errors import DlpipeError
from dlpipe.loading.dataset import MapDataset, PreparedDataset, StreamDataset, open_dataset
from dlpipe.loading.order import EpochSampler
from dlpipe.loading.profile import LoaderProfile, select_profile
from dlpipe.loading.transforms import ImageTransform, image_field
from dlpipe.machine import usable_cpus
from dlpipe.processes import stop_signals_blocked
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["LoaderStateError", "make_loader", "saved_num_workers"]

SampleFn = Callable[[Sample], Any]


class _MapView(torch.utils.data.Dataset):
    """``ds[(epoch, index)]`` → the transformed sample; the epoch seeds augmentation."""

    def __init__(self, dataset: MapDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, index = item
        return _apply(self.transform, self.dataset[index], epoch, index)


class _StreamView(torch.utils.data.IterableDataset):
    """A streaming split as epochs of whole shards per rank x worker, resumable by position.

    Each epoch shuffles the shard order (seeded by epoch) and each block of `BLOCK_SAMPLES`
    consecutive samples of a shard (seeded by epoch, shard and offset). The state is the
    epoch, the shard position, the block's offset and how many of its samples were emitted:
    a resumed worker seeks to the block, re-reads that one block and continues. For training
    (`equal_shares`) with several ranks every reader emits the same number of samples (the
    smallest share), so every rank runs the same number of steps; for evaluation every sample
    is emitted once, and a reader without a shard emits nothing.
    """

    BLOCK_SAMPLES = 256

    def __init__(
        self,
        dataset: StreamDataset,
        transform: Callable[..., Any] | None,
        shuffle: bool,
        seed: int,
        equal_shares: bool = True,
    ) -> None:
        self.dataset, self.transform, self.shuffle, self.seed = dataset, transform, shuffle, seed
        self.equal_shares = equal_shares
        self.epoch, self.position, self.offset, self.emitted = 0, 0, 0, 0
        self._restored = False

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "offset": self.offset,
            "emitted": self.emitted,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the saved loader state used seed {state['seed']}, not {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self.offset, self.emitted = state["offset"], state["emitted"]
        self._restored = True

    def _shards(self, epoch: int) -> tuple[list[int], int]:
        """This reader's shard indices for `epoch`, and how many samples each reader emits."""
        consumer, consumers = self.dataset.consumer()
        if self.equal_shares:
            self.dataset.check_shard_count(consumers)
        count = len(self.dataset.readers)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(count)
        else:
            order = np.arange(count)
        sizes = [len(r) for r in self.dataset.readers]
        shares = [sum(sizes[i] for i in order[c::consumers]) for c in range(consumers)]
        equal = self.equal_shares and self.dataset.world_size > 1
        limit = min(shares) if equal else shares[consumer]
        return [int(i) for i in order[consumer::consumers]], limit

    def __iter__(self) -> Iterator[Any]:
        if not self._restored and (self.position or self.offset or self.emitted):
            self.epoch, self.position, self.offset, self.emitted = self.epoch + 1, 0, 0, 0
        self._restored = False
        epoch = self.epoch
        shards, limit = self._shards(epoch)
        done = sum(len(self.dataset.readers[i]) for i in shards[: self.position]) + self.offset
        done += self.emitted
        while self.position < len(shards) and done < limit:
            shard = shards[self.position]
            reader = self.dataset.readers[shard]
            # one pass per shard, from the resume point: blocks are cut from the same stream
            with contextlib.closing(reader.iter_from(self.offset)) as stream:
                while self.offset < len(reader) and done < limit:
                    block = list(itertools.islice(stream, self.BLOCK_SAMPLES))
                    if self.shuffle:
                        rng = np.random.default_rng([self.seed, epoch, shard, self.offset])
                        block = [block[i] for i in rng.permutation(len(block))]
                    while self.emitted < len(block) and done < limit:
                        sample = block[self.emitted]
                        self.emitted += 1
                        done += 1
                        index = zlib.crc32(str(sample[KEY_FIELD]).encode())
                        yield _apply(self.transform, sample, epoch, index)
                    if self.emitted == len(block):
                        self.offset, self.emitted = self.offset + len(block), 0
            if self.offset >= len(reader):
                self.position, self.offset = self.position + 1, 0
        self.epoch, self.position, self.offset, self.emitted = epoch + 1, 0, 0, 0


def _apply(transform: Callable[..., Any] | None, sample: Sample, epoch: int, index: int) -> Any:
    if transform is None:
        return sample
    if isinstance(transform, ImageTransform):
        return transform(sample, epoch, index)
    return transform(sample)


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker ignores SIGINT, SIGHUP and every SIGTERM but its parent's: Ctrl-C, Slurm,
    systemd and a closed terminal signal the whole process group, and the main process decides
    (the trainer checkpoints first); a worker killed under it would only break the next fetch.

    The signals were blocked when the worker started (`_StopSafeLoader`), so none slips in
    before this. SIGTERM stays blocked and a thread takes each one (``sigwaitinfo``): from the
    parent (``multiprocessing``'s terminate at shutdown) it ends the worker, from anyone else it
    is dropped. Without ``sigwaitinfo`` (macOS) only SIGINT and SIGHUP are ignored.
    """
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGHUP))
    if not hasattr(signal, "sigwaitinfo"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM,))
        return
    parent = os.getppid()
    threading.Thread(target=_take_sigterm, args=(parent,), daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:
            os._exit(0)  # the main process ends its workers (or it is gone): leave


class LoaderStateError(DlpipeError, ValueError):
    """A saved loader state does not fit this loader (another worker count)."""

    def __init__(self, saved_workers: int, workers: int) -> None:
        super().__init__(
            f"the saved loader state was taken with num_workers={saved_workers}, this loader "
            f"has num_workers={workers}; a state resumes exactly only with the same count: "
            f"make the loader with num_workers={saved_workers}"
        )
        self.saved_workers, self.workers = saved_workers, workers


def saved_num_workers(state: Any) -> int | None:
    """The ``num_workers`` a ``StatefulDataLoader`` state was taken with (None: unknown)."""
    if not isinstance(state, dict):
        return None
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, dict) and isinstance(snapshot.get("_worker_snapshots"), dict):
        return len(snapshot["_worker_snapshots"])
    return 0 if "_sampler_iter_state" in state or "dataset_state" in state else None


class _StopSafeLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose workers never die of a stop signal meant for the main
    process, and whose `close` ends them."""

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        context = self.multiprocessing_context
        with stop_signals_blocked(start_method=context.get_start_method() if context else None):
            return super()._get_iterator()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a `state_dict` taken with the same ``num_workers`` (else `LoaderStateError`)."""
        saved = saved_num_workers(state_dict)
        if saved is not None and saved != self.num_workers:
            raise LoaderStateError(saved, self.num_workers)
        super().load_state_dict(state_dict)

    def close(self) -> None:
        """End the worker processes now (they end with the loader's garbage collection
        otherwise; a trainer that runs in-process must not leave them behind)."""
        iterator = getattr(self, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


def _collate(batch: list[Any]) -> Any:
    if batch and isinstance(batch[0], dict):
        return batch  # raw samples: a list of dicts
    return torch.utils.data.default_collate(batch)


def _resolve_transform(
    transform: str | SampleFn | None,
    dataset: PreparedDataset,
    image_size: int,
    seed: int,
    min_crop_scale: float,
) -> Callable[..., Any] | None:
    if transform is None or callable(transform):
        return transform
    field = image_field(list(dataset.manifest.fields))
    return ImageTransform(transform, image_size, field, seed, min_crop_scale)


def make_loader(
    path: str | os.PathLike[str],
    split: str = "train",
    batch_size: int = 64,
    *,
    transform: str | SampleFn | None = "auto",
    image_size: int = 224,
    min_crop_scale: float = 0.08,
    shuffle: bool | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    profile: str | LoaderProfile | None = "auto",
    multiprocessing_context: str | None = None,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over one split of a prepared dataset (any format).

    Args:
        path, split: the dataset and split.
        batch_size: samples per batch on this rank.
        transform: ``"train"`` (RandomResizedCrop + flip), ``"eval"`` (resize + centre crop),
            None (raw sample dicts, batched as lists), or a callable on a sample dict. The
            default, ``"auto"``, is ``"train"`` for the train split and ``"eval"`` otherwise.
        image_size: the crop side of the image transforms.
        min_crop_scale: the smallest share of the image area a ``"train"`` crop keeps
            (torchvision's and timm's default 0.08; raise it when objects are small).
        shuffle, drop_last: default True for the train split, False otherwise.
        seed: seeds the epoch permutations and augmentation.
        num_workers, prefetch_factor, pin_memory: DataLoader worker settings; each one given
            overrides the profile's value.
        rank, world_size: this process's part (default: torch.distributed or RANK/WORLD_SIZE).
        profile: ``"auto"`` uses the settings ``dlpipe bench-loader`` saved for this dataset,
            machine, split, batch size, transform and image size, if there are any (logged at
            INFO on the ``dlpipe`` logger); a `LoaderProfile` is used as is; None, or no saved
            profile, gives the defaults (all cores but one, prefetch 2, pinned memory with CUDA).
            A malformed profiles file is a WARNING on the ``dlpipe`` logger and the defaults.
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"`` for the workers
            (default: the platform's); readers reopen in each worker either way.

    Raises:
        ManifestError, ManifestNotFoundError, DatasetChangedError: the dataset cannot be read.
    """
    train = split == "train"
    shuffle = train if shuffle is None else shuffle
    drop_last = train if drop_last is None else drop_last
    dataset = open_dataset(path, split, rank=rank, world_size=world_size)
    if transform == "auto":
        transform = "train" if train else "eval"
    fn = _resolve_transform(transform, dataset, image_size, seed, min_crop_scale)
    chosen = select_profile(
        profile,
        path,
        split=split,
        batch_size=batch_size,
        transform=transform,
        image_size=image_size,
    )
    if chosen is not None:
        num_workers = chosen.num_workers if num_workers is None else num_workers
        prefetch_factor = chosen.prefetch_factor if prefetch_factor is None else prefetch_factor
        pin_memory = chosen.pin_memory if pin_memory is None else pin_memory
    workers = max(1, usable_cpus() - 1) if num_workers is None else num_workers
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": workers,
        "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
        "collate_fn": _collate,
        "drop_last": drop_last,
        "persistent_workers": workers > 0 and (chosen is None or chosen.persistent_workers),
    }
    if workers > 0:
        options["prefetch_factor"] = prefetch_factor or 2
        options["multiprocessing_context"] = multiprocessing_context
        options["worker_init_fn"] = _ignore_stop_signals
    if isinstance(dataset, MapDataset):
        sampler = EpochSampler(
            len(dataset),
            rank=dataset.rank,
            world_size=dataset.world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            block=batch_size,
        )
        return _quiet_loader(_MapView(dataset, fn), sampler=sampler, **options)
    assert isinstance(dataset, StreamDataset)
    return _quiet_loader(_StreamView(dataset, fn, shuffle, seed, drop_last), **options)


def _quiet_loader(dataset: Any, **options: Any) -> StatefulDataLoader:
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch API on creation
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return _StopSafeLoader(dataset, **options)
