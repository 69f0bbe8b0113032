"""`make_loader`: a prepared dataset as a resumable DataLoader of uint8 batches.

    loader = dlpipe.make_loader("data/pets-lmdb", "train", dlpipe.LoaderConfig(batch_size=256))
    len(loader)                            # the batches this rank yields this epoch, exactly
    for images, labels in loader:          # uint8 (N, 3, 224, 224), int64 (N,)
        x = dlpipe.normalize(images, "cuda")
    state = loader.state_dict()            # mid-epoch; a new loader's load_state_dict resumes

On a detection or segmentation dataset (the manifest's task) the transform is the task's
recipe (`dlpipe.loading.task_transforms`) and the batches are in torchvision's conventions
(`dlpipe.loading.task_collate`): ``(images, targets)``, images a uint8 (N, 3, H, W) batch when
their sizes agree, else a list of (3, H_i, W_i), targets a list of dicts (``boxes`` as
``tv_tensors.BoundingBoxes``, ``labels``, ``iscrowd``, ``image_id``, ``masks`` where present);
``(images, masks)``, uint8 (N, 3, H, W) and uint8 (N, H, W), for segmentation. A sample whose
annotation makes no valid target (`dlpipe.loading.targets.TargetError`) is an error naming it,
as one whose image does not decode is.

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
epoch do not. The loader drives both orders through one pass contract
(`dlpipe.loading.order.PassOrder`) over the view, order and options `plan_view` makes for the
dataset's kind, so nothing here branches on the format.

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

import contextlib
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from dlpipe.errors import DlpipeError, ManifestError
from dlpipe.loading.config import (
    TASK_RECIPES,
    LoaderConfig,
    LoaderConfigError,
    WorkerSettings,
    bounded_workers,
    default_workers,
    loader_arguments,
    recipe_task,
)
from dlpipe.loading.mix_sources import open_sources
from dlpipe.loading.order import PassOrder, PassProgress, Run
from dlpipe.loading.profile import LoaderProfile, select_profile
from dlpipe.loading.stages import Stages, make_stages
from dlpipe.loading.state import StateMismatchError, require_equal, require_fields
from dlpipe.loading.targets import TargetSpec
from dlpipe.loading.task_transforms import TaskTransform
from dlpipe.loading.threads import one_torch_thread
from dlpipe.loading.torch_private import HookedDataLoader, shutdown_workers
from dlpipe.loading.transforms import ImageTransform, image_field
from dlpipe.loading.views import Opened, ViewPlan, plan_view, tag_sources
from dlpipe.manifest_versions import state_version_problem
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


class PreparedLoader(HookedDataLoader):
    """A DataLoader whose order and state are dlpipe's own (see the module docstring), whose
    workers never die of a stop signal meant for the main process, and whose `close` ends them.

    It drives its order through the one pass contract of both kinds (`PassOrder`), and its
    DataLoader yields `Piece` s of either view, so nothing here depends on the format.
    ``len(loader)`` is the exact number of batches this rank yields in a whole epoch.
    """

    def __init__(
        self,
        plan: ViewPlan,
        stages: Stages,
        settings: WorkerSettings,
        origin: str,
        **options: Any,
    ) -> None:
        self.settings = settings  # what `options` were made from (`settings_line`)
        self.origin = origin  # where the settings came from: `_worker_settings`
        self._stages = stages
        super().__init__(plan.view, **plan.options, **options)
        self.order: PassOrder = plan.order
        self._identity = plan.identity
        self._manifest = plan.dataset.manifest  # its versions name an older state's version
        self._dataset = plan.dataset  # its readers (and a URL's shard cache) in this process
        self._pass: PassProgress | None = None
        self._inner: Any = None  # the DataLoader iterator of the pass (its workers)
        self._generation = 0

    def __len__(self) -> int:
        return self.order.batch_count()

    def warns_about_workers(self) -> bool:
        """torch's warning about more workers than cores, unless a saved profile's worker
        count is used: ``bench-loader`` measured that count fastest on this machine."""
        return self.origin != "profile"

    def settings_line(self) -> str:
        """``engine=processes num_workers=12 decode=cpu prefetch_factor=2 pin_memory=True
        (profile)``: what this loader runs, and where that came from (``profile``: the one
        ``bench-loader`` saved; ``defaults``: none saved for this config; ``given``)."""
        return f"{self.settings.line()} ({self.origin})"

    def starting_iterator(self) -> contextlib.AbstractContextManager[None]:
        """Workers start with the stop signals blocked (`_ignore_stop_signals`)."""
        if self.num_workers == 0:
            return contextlib.nullcontext()
        context = self.multiprocessing_context
        return stop_signals_blocked(start_method=context.get_start_method() if context else None)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One pass: the loaded state's, else the next epoch after a pass begun (each
        ``iter(loader)`` is a pass, whether or not batches were drawn from the last one)."""
        if self._pass is not None:
            self.order.abandon()
        progress = self.order.start_pass(max(self.num_workers, 1))
        inner = super().__iter__()
        self.order.started(self.num_workers)
        self._pass, self._inner = progress, inner
        threads = self._stages.threads
        pieces: Iterator[Any] = inner if threads is None else threads.batches(inner)
        if self._stages.device is not None:
            pieces = self._stages.device.batches(pieces)
        return self._counted(_on_one_torch_thread(pieces), progress, self._generation)

    def _counted(
        self, pieces: Iterator[tuple[Any, list[Run]]], progress: PassProgress, generation: int
    ) -> Iterator[Any]:
        while True:
            if generation != self._generation:
                raise StaleIteratorError(
                    "this loader iterator was made before load_state_dict(); the loaded state "
                    "applies to the next pass: call iter(loader) (or start the for loop) again"
                )
            try:
                batch, runs = next(pieces)
            except StopIteration:
                break
            progress.given(runs)  # the state moves when the caller gets the batch
            yield batch
        if generation == self._generation:
            self._pass = None
            self.order.finish()

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the epoch, seed and position (samples consumed globally, or
        the stream runs given for wds), plus the dataset's identity; plain data."""
        state = self.order.state_dict() if self._pass is None else self._pass.state()
        return {**state, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state` from the next ``iter(loader)`` on (see the module docstring).

        Every field is checked before anything changes (`PassOrder.load_pass_state`: types,
        ranges, whole batches), so a refused state leaves the loader where it was.

        Raises:
            StateMismatchError: a field that is not a position of this loader (named, with
                its value and the rule), or a state from another dataset, split, seed or
                shuffle; for wds also another world size or batch size.
        """
        saved = require_fields(state, ("dataset", "split"), "loader")
        saved = {"dataset_version": 1, **saved}  # saved before datasets had versions: 1
        problem = state_version_problem(saved["dataset"], self._manifest)
        if problem is not None:
            raise StateMismatchError(problem, problem=problem)
        fix = "load a state saved by a loader of the same dataset and split"
        for name, value in self._identity.items():
            require_equal(saved, name, value, "loader", fix)
        self.order.load_pass_state(dict(saved))
        self._pass, self._generation = None, self._generation + 1
        if self.order.restarts_workers:
            self._end_workers()  # persistent ones hold the old position: the next pass restarts

    def close(self) -> None:
        """End the worker processes (or the thread engine's threads) now, and close the shard
        readers this process opened (a URL dataset's shard cache too: its download threads
        end). They end with the loader's garbage collection otherwise; a trainer that runs
        in-process must not leave them behind. A later pass opens what it needs again."""
        self._end_workers()
        self._dataset.close()

    def _end_workers(self) -> None:
        if self._stages.threads is not None:
            self._stages.threads.close()
        shutdown_workers(self, self._inner)
        self._inner = None


def make_transform(config: LoaderConfig, dataset: Opened) -> Callable[..., Any] | None:
    """A config's transform, resolved for the dataset's split and task, as the callable a
    loader (and the tuner) applies to each sample (None: raw samples): a detection or
    segmentation dataset's recipe is a `TaskTransform`, any other dataset's an
    `ImageTransform`.

    Raises:
        ManifestError: a detection or segmentation dataset without the annotation field its
            task reads.
    """
    transform = config.transform
    if transform is None or callable(transform):
        return transform
    manifest = dataset.manifest
    if recipe_task(manifest.task) in TASK_RECIPES:
        try:
            spec = TargetSpec.from_manifest(manifest)
        except ValueError as exc:
            raise ManifestError(f"{dataset.path}: {exc}") from None
        field = image_field(list(manifest.fields))
        return TaskTransform(spec, str(transform), config.image_size, field, config.seed,
                             base_size=config.base_size)  # fmt: skip
    assert config.image_size is not None  # resolved: a classification loader's is set
    field = image_field(list(manifest.fields))
    return ImageTransform(
        str(transform), config.image_size, field, config.seed, config.min_crop_scale
    )


def _worker_settings(
    workers: str | WorkerSettings | None,
    profile: str | LoaderProfile | None,
    where: tuple[str | os.PathLike[str], str, LoaderConfig, str],
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
        path, split, config, task = where
        decode = fields.get("decode")  # prefer a profile measured decoding there
        chosen = select_profile(profile, path, split=split, config=config, decode=decode, task=task)
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
    path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
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
        path, split: the dataset and split; a list of dataset paths (local lmdb or hdf5) is
            one seeded, weighted mixture of them (`dlpipe.loading.mixing`: the config's
            ``weights``, ``on_source_end``, ``epoch_samples`` and ``class_map`` say how), whose
            batches are ``(images, labels, sources)``: ``sources`` an int64 tensor of each
            sample's index in the list (``sources.bincount(minlength=len(path))`` counts
            them; raw samples carry it as ``__source__``), the labels those of the first
            dataset's classes (mapped by name).
        config: what the batches are (`LoaderConfig`: batch size, transform, image size,
            crop scale, shuffle, seed, drop_last; default ``LoaderConfig()``), resolved for
            `split` and the dataset's task once (``transform="auto"`` is ``"train"`` for the
            train split, else ``"eval"``; ``shuffle`` and ``drop_last`` True for train, else
            False; an image size left None is the task's).
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
        LoaderConfigError: a config or worker field breaks its rule (named); a transform that
            is not a recipe of the dataset's task; ``decode="cuda"`` with a detection or
            segmentation dataset.
        LoaderArgumentError: a keyword make_loader does not take, or one field given both in
            `config`/`workers` and as an old keyword (a TypeError too).
        DecodeDeviceError: ``decode="cuda"`` without a CUDA device.
        ManifestError, ManifestNotFoundError, DatasetChangedError: the dataset cannot be read.
    """
    given, (base, changes), notice = loader_arguments(config, workers, legacy)
    if notice is not None:
        _deprecated(notice)
    cache: dict[str, Any] = (
        {"cache_dir": given.cache_dir, "cache_limit": given.cache_limit} if given else {}
    )
    if given is not None and given.dataset_version is not None:
        cache["version"] = given.dataset_version
    dataset = open_sources(
        path, split, given or LoaderConfig(), rank=rank, world_size=world_size, **cache
    )
    task = recipe_task(dataset.manifest.task)
    config = (given or LoaderConfig()).resolved(split, task)
    where = (dataset.path, split, config, task)
    settings, origin = _worker_settings(base, profile, where, **changes)
    transform = tag_sources(dataset, lambda opened: make_transform(config, opened))
    fn, stages = make_stages(settings, config, transform)
    options: dict[str, Any] = settings.dataloader_options()
    if settings.num_workers > 0:
        options["worker_init_fn"] = _ignore_stop_signals
    plan = plan_view(
        dataset,
        fn,
        collate_fn=stages.dataloader_collate,
        batch_size=config.batch_size,
        drop_last=bool(config.drop_last),
        shuffle=bool(config.shuffle),
        seed=config.seed,
        rank=dataset.rank,
        world_size=dataset.world_size,
    )
    return PreparedLoader(plan, stages, settings, origin, **options)


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
