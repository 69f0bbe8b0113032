"""`make_loader`: a prepared dataset as a resumable DataLoader of uint8 batches.

    loader = dlpipe.make_loader("data/pets-lmdb", "train", dlpipe.LoaderConfig(batch_size=256))
    len(loader)                            # the batches this rank yields this epoch, exactly
    for images, labels in loader:          # uint8 (N, 3, 224, 224), int64 (N,)
        x = dlpipe.normalize(images, "cuda")
    state = loader.state_dict()            # mid-epoch; a new loader's load_state_dict resumes

The order and its state are dlpipe's own (`dlpipe.loading.order`), counted in batches yielded
to the caller, not prefetched: random-access formats (lmdb, hdf5) go through `EpochSampler` in
the main process, and a state resumes exactly with another ``num_workers``, world size or both
(the rest of the epoch is the same run of samples, in the new loader's global batches). The
streaming format (wds) is read in the workers (`StreamOrder`), each taking a contiguous stretch
of whole batches of the rank's run of the epoch's stream; each batch says which runs of stream
positions it holds, the loader's state is the runs given to the caller, and a state resumes
exactly with another ``num_workers`` (not another world size, or batch size: refused by name).
Every batch is one worker's, so every rank yields ``len(loader)`` batches with nothing merged
in the main process. Which batch comes when depends on ``num_workers``; the samples of the
epoch do not.

The worker settings also choose the engine (torch's worker processes, or the thread engine of
`dlpipe.loading.threads`: the 0-worker loader with each sample's transform on a pool of
threads) and where JPEGs decode (``decode="cuda"``: `dlpipe.loading.device_decode`); both are
`Stages` between the DataLoader and the caller, and neither changes the order or the state.

`load_state_dict` applies to the next ``iter(loader)``; an iterator made before it raises
`StaleIteratorError` at its next batch instead of going on with the old position.

What the batches are is one `LoaderConfig`, resolved for the split once; how fast they come is
one `WorkerSettings` (`dlpipe.loading.config`): given, or (``workers="auto"``) the profile
``dlpipe bench-loader`` measured for this dataset, machine and config (`dlpipe.loading.profile`),
otherwise a sensible default (all usable cores but one, prefetch 2, pinned memory when CUDA is
there); ``workers=4`` or ``workers={"engine": "threads"}`` set fields over that choice. The
keywords before this signature (``batch_size=``, ``num_workers=``, ...) still set one field
each for one release, with one FutureWarning (`dlpipe.loading.config.loader_arguments`).
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.data

from dlpipe.errors import DlpipeError
from dlpipe.loading.config import (
    LoaderConfig,
    LoaderConfigError,
    WorkerSettings,
    bounded_workers,
    default_workers,
    loader_arguments,
)
from dlpipe.loading.dataset import MapDataset, PreparedDataset, StreamDataset, open_dataset
from dlpipe.loading.order import EpochSampler, Run, StreamOrder, merge_runs
from dlpipe.loading.profile import LoaderProfile, select_profile
from dlpipe.loading.stages import Stages, make_stages
from dlpipe.loading.state import require_equal, require_fields
from dlpipe.loading.threads import one_torch_thread
from dlpipe.loading.transforms import ImageTransform, image_field
from dlpipe.loading.views import MapView, StreamView
from dlpipe.processes import stop_signals_blocked

__all__ = ["PreparedLoader", "StaleIteratorError", "make_loader"]

# make_loader's ``workers=``: "auto", None, a count, settings, or a dict of settings' fields
Workers = str | int | WorkerSettings | Mapping[str, Any] | None


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker ignores SIGINT, SIGHUP and every SIGTERM but its parent's: Ctrl-C, Slurm,
    systemd and a closed terminal signal the whole process group, and the main process decides
    (the trainer checkpoints first); a worker killed under it would only break the next fetch.

    The signals were blocked when the worker started (`PreparedLoader`), so none slips in
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


class StaleIteratorError(DlpipeError, RuntimeError):
    """An iterator made before `PreparedLoader.load_state_dict` was asked for a batch."""


class _Pass:
    """The pass a loader is in: where it began and what it has yielded to the caller."""

    def __init__(self, order: EpochSampler | StreamOrder) -> None:
        self.epoch = order.epoch
        self.batches = 0
        if isinstance(order, EpochSampler):
            self.start, self.drawn, self.left = order.start, order.drawn, order.remaining()
        else:
            self.base, self.workers, self.consumed = order.base, order.workers, order.consumed

    def state(self, order: EpochSampler | StreamOrder, batch_size: int) -> dict[str, Any]:
        if isinstance(order, EpochSampler):
            drawn = self.drawn + min(self.batches * batch_size, self.left)
            return order.state_at(self.epoch, self.start, drawn)
        return order.state_at(self.epoch, self.base, self.workers, self.consumed)


class PreparedLoader(torch.utils.data.DataLoader):
    """A DataLoader whose order and state are dlpipe's own (see the module docstring), whose
    workers never die of a stop signal meant for the main process, and whose `close` ends them.

    ``len(loader)`` is the exact number of batches this rank yields in a whole epoch.
    """

    def __init__(
        self,
        dataset: Any,
        stages: Stages,
        settings: WorkerSettings,
        origin: str,
        **options: Any,
    ) -> None:
        self.settings = settings  # what `options` were made from (`settings_line`)
        self.origin = origin  # where the settings came from: `_worker_settings`
        self._stream = isinstance(dataset, StreamView)
        self._stages = stages
        if self._stream:  # the workers batch
            self._batch_size, self._drop_last = options.pop("batch_size"), options.pop("drop_last")
            options.pop("collate_fn", None)
            options["batch_size"] = None
        super().__init__(dataset, **options)
        if not self._stream:
            self._batch_size = options["batch_size"]
        order = dataset.order if self._stream else self.sampler
        assert isinstance(order, EpochSampler | StreamOrder)
        self.order: EpochSampler | StreamOrder = order
        prepared: PreparedDataset = dataset.dataset
        self._identity = {"dataset": prepared.stamp.sha256, "split": prepared.split}
        self._pass: _Pass | None = None
        self._inner: Any = None  # the DataLoader iterator of the pass (its workers)
        self._generation = 0

    def __len__(self) -> int:
        if not self._stream:
            return super().__len__()
        samples, size = len(self.order), self._batch_size
        return samples // size if self._drop_last else -(-samples // size)

    def check_worker_number_rationality(self) -> None:
        """torch's warning about more workers than cores, unless a saved profile's worker
        count is used: ``bench-loader`` measured that count fastest on this machine."""
        if self.origin != "profile":
            super().check_worker_number_rationality()

    def settings_line(self) -> str:
        """``engine=processes num_workers=12 decode=cpu prefetch_factor=2 pin_memory=True
        (profile)``: what this loader runs, and where that came from (``profile``: the one
        ``bench-loader`` saved; ``defaults``: none saved for this config; ``given``)."""
        return f"{self.settings.line()} ({self.origin})"

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        context = self.multiprocessing_context
        with stop_signals_blocked(start_method=context.get_start_method() if context else None):
            return super()._get_iterator()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One pass: the loaded state's, else the next epoch after a pass begun (each
        ``iter(loader)`` is a pass, whether or not batches were drawn from the last one)."""
        if self._pass is not None:
            self.order.abandon()
        self.order.begin()
        if isinstance(self.order, StreamOrder):  # the workers take this split with them
            self.order.split_for(max(self.num_workers, 1))
        progress = _Pass(self.order)
        inner = super().__iter__()
        if isinstance(self.order, StreamOrder) and self.num_workers > 0:
            self.order.take(self.num_workers)  # the workers took the pass with them
        self._pass, self._inner = progress, inner
        threads = self._stages.threads
        source = inner if threads is None else threads.batches(inner)
        # (batch, the stream runs it holds): a stream's state moves when the caller gets it
        batches = source if self._stream else ((b, []) for b in source)
        if self._stages.device is not None:
            batches = self._stages.device.batches(batches)
        return self._counted(_on_one_torch_thread(batches), progress, self._generation)

    def _counted(
        self, batches: Iterator[tuple[Any, list[Run]]], progress: _Pass, generation: int
    ) -> Iterator[Any]:
        while True:
            if generation != self._generation:
                raise StaleIteratorError(
                    "this loader iterator was made before load_state_dict(); the loaded state "
                    "applies to the next pass: call iter(loader) (or start the for loop) again"
                )
            try:
                batch, runs = next(batches)
            except StopIteration:
                break
            self._note(progress, runs)
            progress.batches += 1
            yield batch
        if generation == self._generation:
            self._pass = None
            self.order.finish()

    @staticmethod
    def _note(progress: _Pass, runs: list[Run]) -> None:
        if runs:
            progress.consumed = merge_runs(progress.consumed + runs)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, seed and position (samples consumed globally, or
        the stream runs given for wds), plus the dataset's identity; plain data."""
        if self._pass is None:
            state = self.order.state_dict()
        else:
            state = self._pass.state(self.order, self._batch_size)
        return {**state, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` from the next ``iter(loader)`` on (see the module docstring).

        Every field is checked before anything changes (`EpochSampler.load_state_dict`,
        `StreamOrder.load_state_dict`: types, ranges, whole batches), so a refused state
        leaves the loader where it was.

        Raises:
            StateMismatchError: a field that is not a position of this loader (named, with
                its value and the rule), or a state from another dataset, split, seed or
                shuffle; for wds also another world size or batch size.
        """
        saved = require_fields(state, ("dataset", "split"), "loader")
        fix = "load a state saved by a loader of the same dataset and split"
        for name, value in self._identity.items():
            require_equal(saved, name, value, "loader", fix)
        if isinstance(self.order, EpochSampler):
            self.order.load_state_dict(dict(saved), batches=True)
        else:
            self.order.load_state_dict(dict(saved))
        self._pass, self._generation = None, self._generation + 1
        if self._stream:
            self.close()  # persistent workers hold the old position: the next pass restarts them

    def close(self) -> None:
        """End the worker processes (or the thread engine's threads) now (they end with the
        loader's garbage collection otherwise; a trainer that runs in-process must not leave
        them behind)."""
        if self._stages.threads is not None:
            self._stages.threads.close()
        for iterator in (getattr(self, "_iterator", None), self._inner):
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iterator = self._inner = None


def make_transform(config: LoaderConfig, dataset: PreparedDataset) -> Callable[..., Any] | None:
    """A resolved config's transform as the callable a loader (and the tuner) applies to each
    sample (None: raw samples)."""
    transform = config.transform
    if transform is None or callable(transform):
        return transform
    field = image_field(list(dataset.manifest.fields))
    return ImageTransform(
        str(transform), config.image_size, field, config.seed, config.min_crop_scale
    )


def _worker_settings(
    workers: str | WorkerSettings | None,
    profile: str | LoaderProfile | None,
    where: tuple[str | os.PathLike[str], str, LoaderConfig],
    **fields: Any,
) -> tuple[WorkerSettings, str]:
    """The settings `workers` names (``"auto"``: the nearest saved profile, else the
    defaults), with each keyword given set; and where they came from: ``"profile"`` (a saved
    profile's worker count), ``"defaults"`` or ``"given"`` (a `WorkerSettings`, or
    ``num_workers`` passed)."""
    origin = "given"
    if isinstance(workers, WorkerSettings):
        base = workers
    elif workers == "auto":
        path, split, config = where
        decode = fields.get("decode")  # prefer a profile measured decoding there
        chosen = select_profile(profile, path, split=split, config=config, decode=decode)
        base = default_workers() if chosen is None else chosen.settings
        origin = "defaults" if chosen is None else "profile"
    elif workers is None:
        base, origin = default_workers(), "defaults"
    else:
        raise LoaderConfigError(
            f"workers={workers!r} is not 'auto', a WorkerSettings or None; pass one of those"
        )
    changes = {name: value for name, value in fields.items() if value is not None}
    if "num_workers" in changes:
        origin = "given"
    return bounded_workers(base.replace(**changes), origin), origin


def make_loader(
    path: str | os.PathLike[str],
    split: str = "train",
    config: LoaderConfig | None = None,
    *,
    workers: Workers = "auto",
    profile: str | LoaderProfile | None = "auto",
    rank: int | None = None,
    world_size: int | None = None,
    **legacy: Any,
) -> PreparedLoader:
    """A `PreparedLoader` over one split of a prepared dataset (any format).

    Args:
        path, split: the dataset and split.
        config: what the batches are (`LoaderConfig`: batch size, transform, image size,
            crop scale, shuffle, seed, drop_last; default ``LoaderConfig()``), resolved for
            `split` once (``transform="auto"`` is ``"train"`` for the train split, else
            ``"eval"``; ``shuffle`` and ``drop_last`` True for train, else False).
        workers: how they are made (`WorkerSettings`: worker count, prefetch, pinned memory,
            engine, where JPEGs decode, start method). ``"auto"`` uses the settings
            ``dlpipe bench-loader`` saved for this dataset, machine, split and config (the
            `loader_key`), if any (logged at INFO on the ``dlpipe`` logger), else the
            defaults (all usable cores but one, prefetch 2, pinned memory with CUDA); a
            malformed profiles file is a WARNING on the ``dlpipe`` logger and the defaults.
            A `WorkerSettings` is used as is; None gives the defaults; a count is ``"auto"``
            with that ``num_workers``; a dict of `WorkerSettings` fields is ``"auto"`` with
            those fields set (``{"engine": "threads"}``: the thread engine, the profile's
            or the default count). ``engine="threads"`` transforms on ``num_workers``
            threads in this process instead of worker processes; ``decode="cuda"`` decodes
            and crops each batch on the GPU and yields it there
            (`dlpipe.loading.device_decode`).
        profile: with ``workers="auto"``, a `LoaderProfile` to use instead of the saved one,
            or None for the defaults.
        rank, world_size: this process's part (default: torch.distributed or RANK/WORLD_SIZE).
        **legacy: the keywords before this signature (``batch_size=``, ``image_size=``,
            ``num_workers=``, ``decode="auto"``, ..., and a batch size as the third
            argument), for one release: each sets its field of `config` or of ``workers``
            (over ``"auto"`` or None as before), with one FutureWarning per process that
            names the new spelling.

    Raises:
        LoaderConfigError: a config or worker field breaks its rule (named).
        LoaderArgumentError: a keyword make_loader does not take, or one field given both in
            `config`/`workers` and as an old keyword (a TypeError too).
        DecodeDeviceError: ``decode="cuda"`` without a CUDA device.
        ManifestError, ManifestNotFoundError, DatasetChangedError: the dataset cannot be read.
    """
    given, (base, changes), notice = loader_arguments(config, workers, legacy)
    if notice is not None:
        _deprecated(notice)
    config = (given or LoaderConfig()).resolved(split)
    where = (path, split, config)
    settings, origin = _worker_settings(base, profile, where, **changes)
    dataset = open_dataset(path, split, rank=rank, world_size=world_size)
    fn, stages = make_stages(settings, config, make_transform(config, dataset))
    shuffle, seed, batch_size = bool(config.shuffle), config.seed, config.batch_size
    drop_last = bool(config.drop_last)
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "collate_fn": stages.dataloader_collate,
        "drop_last": drop_last,
        **settings.dataloader_options(),
    }
    if settings.num_workers > 0:
        options["worker_init_fn"] = _ignore_stop_signals
    placement: dict[str, Any] = {"rank": dataset.rank, "world_size": dataset.world_size}
    placement |= {"shuffle": shuffle, "seed": seed}
    if isinstance(dataset, MapDataset):
        sampler = EpochSampler(len(dataset), drop_last=drop_last, block=batch_size, **placement)
        mapped = MapView(dataset, fn)
        return PreparedLoader(mapped, stages, settings, origin, sampler=sampler, **options)
    assert isinstance(dataset, StreamDataset)
    view = StreamView.build(
        dataset,
        fn,
        batch_size=batch_size,
        drop_last=drop_last,
        collate_fn=stages.dataloader_collate,
        **placement,
    )
    return PreparedLoader(view, stages, settings, origin, **options)


_warned = False  # the old keywords' FutureWarning was shown in this process


def _deprecated(notice: str) -> None:
    """Warn about make_loader's old keywords once per process, at the caller's line."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(notice, FutureWarning, stacklevel=3)


def _on_one_torch_thread(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, each made with the calling thread's torch ops on one thread (as in a
    DataLoader worker), its own thread count back in place before each batch is handed over.
    What a loader does in the caller's thread (0 workers: everything; the thread engine: the
    reads and the collate; worker processes: receiving) ran there on torch's default intra-op
    threads, whose team then spun against the loading threads. Measured on 2 cores, alternating:
    0 workers kept its 827 samples/s at 811 samples per CPU-second instead of 418; the thread
    engine with 2 threads went from 990-1,041 to 1,273-1,360 samples/s. OpenMP and MKL keep
    the count per thread, so no other thread is touched."""
    while True:
        try:
            with one_torch_thread():
                batch = next(batches)
        except StopIteration:
            return
        yield batch
