"""`convert`: raw data → a verified, prepared dataset, in parallel, resumable.

Scan the source → plan the shards (deterministic) → check the output and the disk → run the
shard tasks on an engine → hand each finished shard to the output folder's owner
(`dlpipe.formats.output.DatasetOutput`), which holds the lock (``.dlpipe-lock``, one writer per
folder), journals each shard, writes ``errors.jsonl``, ``keys.jsonl`` and ``duplicates.jsonl``
and then the manifest, last, and removes the journal. The engine plans and schedules; the owner
writes everything but the shards. A crash at any point leaves no manifest, and ``--resume``
re-runs only the shards the journal does not hold. ``--overwrite`` deletes only what dlpipe can
prove it wrote (see `dlpipe.formats.owned.prepare_output`); an output inside the raw folder is
refused.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dlpipe import storage
from dlpipe.converters import append, append_run
from dlpipe.converters.archive_view import unpacked_view
from dlpipe.converters.audit import (
    DuplicateGroup,
    Fingerprint,
    audit_report,
    find_duplicates,
    kept_and_dropped,
)
from dlpipe.converters.config import (
    RUN_OPTIONS,
    ConvertConfig,
    ConvertOptionError,
    default_out,
    option_specs,
)
from dlpipe.converters.executors import WorkerDiedError, run_local, run_ray
from dlpipe.converters.journal import (
    ResumeError,
    check_plan,
    plan_record,
    result_of,
    result_record,
)
from dlpipe.converters.plan import Plan, make_plan
from dlpipe.converters.source import Scan, SourceError, display_path
from dlpipe.converters.sources import open_source, why_detected
from dlpipe.converters.worker import (
    OutputFullError,
    TaskResult,
    WorkerConfig,
    audit_task,
    image_reader,
    is_disk_full,
)
from dlpipe.dataset_names import CONVERT_CONFIG_NAME, DUPLICATES_NAME, KEYS_NAME, MANIFEST_NAME
from dlpipe.errors import DlpipeError, OutputExistsError
from dlpipe.formats import FORMATS, get_format, require_storage
from dlpipe.formats.output import DatasetOutput
from dlpipe.manifest import Manifest
from dlpipe.options import config_toml
from dlpipe.storage import DiskSpaceError

__all__ = [
    "ConvertConfig",
    "ConvertOptionError",
    "ConvertResult",
    "DiskSpaceError",
    "OutputInsideRawError",
    "PlannedConversion",
    "convert",
    "default_out",
    "plan_conversion",
]


class OutputInsideRawError(DlpipeError, ValueError):
    """The output folder is the raw folder or inside it."""


@dataclass
class ConvertResult:
    out: str
    manifest: Manifest
    seconds: float
    samples_in: int
    skipped: list[dict[str, Any]]
    reencoded: int
    payload_bytes: int
    resumed_shards: int = 0
    discarded_shards: int = 0
    """With ``--append``: the shards of an unfinished append that this run deleted."""


Progress = Callable[[TaskResult], None]


def image_field_for(scan: Scan) -> str:
    """The dataset's one image field: the most common stored kind (``other`` counts as png)."""
    kinds = Counter(
        ("png" if it.image_kind == "other" else it.image_kind) for it in scan.items if it.image_kind
    )
    if not kinds:
        return "jpg"
    return max(sorted(kinds), key=lambda k: (kinds[k], k == "jpg"))


@dataclass(frozen=True)
class PlannedConversion:
    """What scanning and planning produce: everything the shard tasks and the manifest need."""

    source: Any
    plan: Plan
    worker: WorkerConfig
    options: dict[str, Any]
    description: dict[str, Any]
    scan: Scan
    dedup_groups: tuple[DuplicateGroup, ...] = ()
    """``--dedup``'s duplicate groups, found before planning (their extra copies are not in
    the plan); empty without ``--dedup``, when the writing pass's fingerprints are audited."""
    base: append.AppendBase | None = None
    """With ``--append``: the dataset this run adds a version to."""
    stored: dict[tuple[str, str], append.StoredSample] | None = None
    """With ``--append``: the dataset's samples (`append.read_stored`)."""
    dedup_copies: tuple[dict[str, Any], ...] = ()
    """``--append --dedup``: the new samples left out as exact copies of the dataset's."""


def plan_conversion(config: ConvertConfig) -> PlannedConversion:
    """Scan the source and plan the shards; nothing is written."""
    fmt = get_format(config.to)
    out = config.output()
    require_storage(fmt, out)
    check_out_outside_raw(config)
    base = append.open_base(out, config.to) if config.append else None
    if base is not None and config.resume:
        append_run.check_resumable(config, base)
    wanted = config.source
    view = unpacked_view(config.raw)
    if view is not None and config.engine.kind == "ray":
        raise SourceError(
            f"{display_path(config.raw)}: archives are read in place by the local engine only "
            "(Ray's workers on other nodes cannot see this machine's view of them); unpack "
            "them on the cluster's shared disk and convert that folder, or drop --engine ray"
        )
    source = open_source(view.root if view is not None else config.raw, wanted.kind, wanted)
    scan = source.scan()
    if not scan.items:
        raise SourceError(f"{config.raw}: the {source.kind} source holds no samples")
    scan = _with_classes(scan)
    if base is not None:
        scan = append.fit_scan(base, scan)
    kind = append.image_field(base) if base is not None else image_field_for(scan)
    image = replace(config.images, field=kind)
    recorded = config.output_options(image.field, source.kind)
    if base is not None:
        append.check_options(base, recorded)

    def planned(items: Scan) -> Plan:
        return make_plan(
            items,
            fmt=fmt,
            seed=config.shards.seed,
            val_fraction=config.shards.val_fraction,
            shard_bytes=config.shards.shard_bytes,
            options={
                **recorded,
                "image_col": wanted.image_col,
                "label_col": wanted.label_col,
                "image_root": wanted.image_root,
                "key_col": wanted.key_col,
                "label_from": wanted.label_from,
                **({"append_to": base.sha256} if base is not None else {}),
            },
            first_index=base.first_index() if base is not None else None,
        )

    worker = WorkerConfig(
        out=out,
        format=fmt.name,
        image=image,
        on_error=config.shards.on_error,
        num_classes=len(scan.classes) or None,
    )
    plan = planned(scan)
    groups: tuple[DuplicateGroup, ...] = ()
    stored: dict[tuple[str, str], append.StoredSample] | None = None
    copies: list[dict[str, Any]] = []
    if base is not None:
        append.check_labels(base, plan)
        stored = append.read_stored(base, image.field)
    if config.shards.dedup and stored is not None:
        groups, copies = append_run.dedup_pass(source, plan, worker, config.engine, base, stored)
        _, dropped = kept_and_dropped(groups)
        gone = {(m["split"], m["key"]) for c in copies for m in c["samples"][1:]}
        plan = planned(_without(scan, plan, set(dropped) | gone))
    elif config.shards.dedup:
        groups = _duplicates(source, plan, worker, config)
        _, dropped = kept_and_dropped(groups)
        plan = planned(_without(scan, plan, set(dropped)))
    if base is not None and stored is not None:
        append.check_nothing_left(base, plan, copies)
        append.check_keys(base, stored, plan)
    account: dict[str, Any] = {
        k: scan.description[k] for k in ("layout", "unused") if k in scan.description
    }
    account["kind"] = source.kind
    if "layout" not in account:
        named = wanted.kind != "auto"
        account["layout"] = "named by --source" if named else why_detected(source.root, source.kind)
    if view is not None:
        account["archives"] = view.report()
    return PlannedConversion(
        source=source,
        plan=replace(plan, source=account),
        worker=worker,
        options=recorded,
        description={
            **scan.description,
            **({"archives": account["archives"]} if view is not None else {}),
            "layout": account["layout"],
            "samples": len(scan.items),
        },
        scan=scan,
        dedup_groups=groups,
        base=base,
        stored=stored,
        dedup_copies=tuple(copies),
    )


def _duplicates(
    source: Any, plan: Plan, worker: WorkerConfig, config: ConvertConfig
) -> tuple[DuplicateGroup, ...]:
    """``--dedup``'s first pass: every image's fingerprints (read and decoded as the writing
    pass will), on the conversion's engine, nothing written; the duplicate groups."""
    engine = config.engine
    if engine.kind == "ray":
        results = run_ray(source, plan.tasks, worker, engine.ray_address, job=audit_task)
    else:
        results = run_local(source, plan.tasks, worker, engine.workers, job=audit_task)
    prints = [Fingerprint(r.split, *f) for r in results for f in r.fingerprints]
    return tuple(find_duplicates(prints, read=image_reader(source, plan.tasks)))


def _without(scan: Scan, plan: Plan, dropped: set[tuple[str, str]]) -> Scan:
    """`scan` less the items `dropped` names by (split, key) in `plan`."""
    gone = {id(it) for t in plan.tasks for it in t.items if (t.split, it.key) in dropped}
    return replace(scan, items=tuple(it for it in scan.items if id(it) not in gone))


def check_out_outside_raw(config: ConvertConfig) -> None:
    """Refuse an output folder that is the raw folder or inside it (compared as real paths).

    Writing there would put shards among the user's raw files, and the next scan would read
    the output as raw data (a new class, or new samples).
    """
    out = config.output()
    if storage.is_url(out):
        return
    raw = os.path.realpath(config.raw)
    same = os.path.realpath(storage.local_path(out)) == raw
    if not same and not (os.path.isdir(raw) and storage.is_within(out, raw)):
        return
    where = "is the raw folder itself" if same else f"is inside the raw folder {raw}"
    given = f"--out {out}" if config.out else f"the default output {out} (from DLPIPE_DATA_DIR)"
    suggestion = default_out(config.raw, config.to)
    if storage.is_within(suggestion, raw):
        suggestion = os.path.join(os.path.dirname(raw), f"{os.path.basename(raw)}-{config.to}")
    raise OutputInsideRawError(
        f"{given} {where}; dlpipe never writes into the data it reads (the next run would "
        f"read its shards as raw data): choose an output outside it, e.g. --out {suggestion}"
    )


def _with_classes(scan: Scan) -> Scan:
    labels = [it.label for it in scan.items if it.label is not None]
    if not labels or scan.classes:
        return scan
    if min(labels) < 0:
        raise SourceError(f"labels must be >= 0; found {min(labels)}")
    names = tuple(str(i) for i in range(max(labels) + 1))
    return replace(scan, classes=names)


def convert(
    raw: str | os.PathLike[str] | ConvertConfig,
    *,
    to: str | None = None,
    on_start: Callable[[Plan], None] | None = None,
    on_progress: Progress | None = None,
    **options: Any,
) -> ConvertResult:
    """Convert raw data into a prepared dataset: ``dlpipe convert`` as a Python call.

    Scan, plan, write the shards in parallel, then the manifest (see the module docstring)::

        result = dlpipe.convert("raw/", to="lmdb", out="data/pets-lmdb", max_side=256)
        dataset = dlpipe.open_dataset(result.out, "train")

    Args:
        raw: the raw folder or table (or a whole `ConvertConfig`, with no other option).
        to: the shard format: wds, lmdb or hdf5.
        on_start: called with the plan before any shard is written.
        on_progress: called with each finished shard's result.
        **options: the options of ``dlpipe convert``, by the names below (each flag's name
            with underscores; ``shard_bytes`` is ``--shard-size``):

        {options}

    Returns:
        The `ConvertResult`: the output folder, its manifest, the seconds taken, the samples
        read, skipped and re-encoded.

    Raises:
        ConvertOptionError: an unknown option or a bad value, with the message the CLI prints.
        SourceError, SampleError (``on_error="fail"``), EmptySplitError (a split lost every
        sample), OutputExistsError, ResumeError,
        DiskSpaceError, UnsupportedStorageError, OutputInsideRawError, OutputLockedError
        (another writer holds `out`), OutputFullError (the disk filled up while writing),
        WorkerDiedError: each with the fix in its message.
    """
    config = _config_of(raw, to, options)
    start = time.perf_counter()
    planned = plan_conversion(config)
    resume = config.command("--resume")
    fmt = get_format(planned.worker.format)
    try:
        with DatasetOutput(planned.worker.out, fmt) as output:
            return _run(config, planned, output, start, on_start, on_progress)
    except WorkerDiedError as exc:
        raise WorkerDiedError(f"{exc}; finish the conversion with `{resume}`") from None
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise OutputFullError(
            f"{_full_reason(exc, planned.worker.out)}; no manifest was written and finished "
            f"shards are kept: free space there, then finish with `{resume}` (or choose "
            "another --out on a bigger disk)"
        ) from None


def _config_of(
    raw: str | os.PathLike[str] | ConvertConfig, to: str | None, options: dict[str, Any]
) -> ConvertConfig:
    if isinstance(raw, ConvertConfig):
        if to is not None or options:
            raise ConvertOptionError(
                "give convert() a ConvertConfig alone, or raw, to= and options; not both"
            )
        return raw
    if to is None:
        raise ConvertOptionError(
            f"the argument --to is required: the shard format, one of {', '.join(sorted(FORMATS))}"
        )
    return ConvertConfig.from_options(raw, to, **options)


def _options_doc() -> str:
    lines = []
    for spec in option_specs():
        if spec.name not in ("raw", "to"):
            default = "" if "default" in spec.help else f", default {spec.default!r}"
            lines.append(f"            ``{spec.name}`` ({spec.flag}{default}): {spec.help}.")
    return "\n".join(lines).lstrip()


if convert.__doc__:  # absent under python -OO
    convert.__doc__ = convert.__doc__.replace("{options}", _options_doc())


def _full_reason(exc: OSError, out: str) -> str:
    if isinstance(exc, OutputFullError):
        return str(exc)
    what = os.path.basename(str(exc.filename)) if exc.filename else "the output"
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    return f"{out}: the disk filled up while writing {what} ({reason})"


def _run(
    config: ConvertConfig,
    planned: PlannedConversion,
    output: DatasetOutput,
    start: float,
    on_start: Callable[[Plan], None] | None,
    on_progress: Progress | None,
) -> ConvertResult:
    plan, worker = planned.plan, planned.worker
    discarded = 0
    if planned.base is not None:
        done, discarded = append_run.take_output(output, planned.base, plan, config)
    else:
        done = _prepare(output, plan, config)
    pending = [t for t in plan.tasks if t.name not in done]
    estimated = sum(it.size for t in pending for it in t.items)
    if config.images.seekable:  # restart markers and the standard Huffman tables
        estimated = estimated * 5 // 4  # (about 6 %; 15 % for progressive JPEGs, measured)
    check_disk(output.out, estimated)
    if not done:
        raw = config.raw if storage.is_url(config.raw) else os.path.abspath(config.raw)
        output.start_journal(plan_record(plan, raw=raw, args=config.option_args()))
    if on_start is not None:
        on_start(plan)
    engine = config.engine
    if engine.kind == "ray":
        results = run_ray(planned.source, pending, worker, engine.ray_address)
    else:
        results = run_local(planned.source, pending, worker, engine.workers)
    for result in results:
        output.add(result, record=result_record(result))
        done[result.name] = result
        if on_progress is not None:
            on_progress(result)
    ordered = [done[t.name] for t in plan.tasks]
    skipped = [s for r in ordered for s in r.skipped]
    if planned.base is not None:
        manifest = _finish_version(planned, output, ordered, skipped)
    else:
        manifest = _finish(planned, output, ordered, skipped, config_toml(config, omit=RUN_OPTIONS))
    return ConvertResult(
        out=output.out,
        manifest=manifest,
        seconds=time.perf_counter() - start,
        samples_in=sum(len(t.items) for t in plan.tasks),
        skipped=skipped,
        reencoded=sum(r.reencoded for r in ordered),
        payload_bytes=sum(r.payload_bytes for r in ordered),
        resumed_shards=len(plan.tasks) - len(pending),
        discarded_shards=discarded,
    )


def _prepare(output: DatasetOutput, plan: Plan, config: ConvertConfig) -> dict[str, TaskResult]:
    """Make the output ready; returns the shards an interrupted run already finished
    (``--resume``)."""
    out, names = output.out, output.entries()
    overwrite = config.command("--overwrite")
    if config.resume and output.journal_exists():
        check_plan(output.journal_plan(), plan, out, overwrite)
        return output.resume(result_of)
    if config.resume and MANIFEST_NAME in names:
        raise ResumeError(
            f"{out} is already a complete dataset; nothing to resume (to convert again, run "
            f"`{overwrite}`)"
        )
    if names and not config.overwrite and not config.resume:
        raise OutputExistsError(
            f"{out} is not empty ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); "
            f"finish an interrupted conversion with `{config.command('--resume')}`, replace "
            f"the dataset with `{overwrite}`, or choose another --out"
        )
    if names and config.resume:
        raise ResumeError(
            f"{out} holds files but no journal to resume from; start again with `{overwrite}`"
        )
    output.prepare(overwrite=True, planned=[t.name for t in plan.tasks])
    return {}


def check_disk(out: str, estimated_bytes: int) -> None:
    """Refuse when the target filesystem lacks room for the estimate plus a margin."""
    storage.require_free_space(out, int(estimated_bytes * 1.1) + (16 << 20))


def _finish(
    planned: PlannedConversion,
    output: DatasetOutput,
    ordered: list[TaskResult],
    skipped: list[dict[str, Any]],
    config_text: str,
) -> Manifest:
    """The duplicate audit, the shortened keys and the resolved config (`config_text`),
    handed with the shards' order and the dataset's description to the output's owner, which
    writes them and the manifest, last."""
    plan, scan = planned.plan, planned.scan
    duplicates, report = _audit(planned, ordered)
    shortened = _shortened_keys(plan, skipped)
    return output.finish(
        [t.name for t in plan.tasks],
        classes=plan.classes,
        options=planned.options,
        source={
            **planned.description,
            "skipped": len(skipped),
            "shortened_keys": len(shortened),
            "duplicates": report,
        },
        task=scan.task,
        field_schemas=scan.field_schemas,
        class_ids=scan.class_ids,
        lists={DUPLICATES_NAME: duplicates, KEYS_NAME: shortened},
        files={CONVERT_CONFIG_NAME: config_text.encode("utf-8")},
    )


def _finish_version(
    planned: PlannedConversion,
    output: DatasetOutput,
    ordered: list[TaskResult],
    skipped: list[dict[str, Any]],
) -> Manifest:
    """``--append``'s `_finish`: the audit (with the new samples that copy the dataset's),
    the shortened keys and this version's description, handed to the output's owner, which
    merges the lists and writes the new manifest, last."""
    plan, base = planned.plan, planned.base
    assert base is not None and planned.stored is not None
    duplicates, report = _audit(planned, ordered)
    copies = list(planned.dedup_copies)
    if planned.dedup_copies:
        for record in copies:
            record["kept"] = record["samples"][0]
        report["dropped"] += len(copies)
    else:
        copies = append_run.copies_written(base, planned.stored, planned.worker, ordered)
    report["of_existing"] = len(copies)
    shortened = _shortened_keys(plan, skipped)
    return output.finish_version(
        [t.name for t in plan.tasks],
        base.manifest,
        base.sha256,
        classes=plan.classes,
        class_ids=planned.scan.class_ids,
        source={
            **planned.description,
            "skipped": len(skipped),
            "shortened_keys": len(shortened),
            "duplicates": report,
        },
        lists={DUPLICATES_NAME: duplicates + copies, KEYS_NAME: shortened},
    )


def _audit(
    planned: PlannedConversion, ordered: list[TaskResult]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The duplicate audit (`dlpipe.converters.audit`): the records of ``duplicates.jsonl``
    (each group, and with ``--dedup`` the copy kept) and the manifest's report."""
    prints = [Fingerprint(r.split, *f) for r in ordered for f in r.fingerprints]
    read = image_reader(planned.source, planned.plan.tasks)
    groups = list(planned.dedup_groups) or find_duplicates(prints, read=read)
    kept, dropped = kept_and_dropped(groups) if planned.dedup_groups else ([], [])
    records = [g.to_json() for g in groups]
    for record, keep in zip(records, kept, strict=False):  # kept: with --dedup only
        record["kept"] = {"split": keep[0], "key": keep[1]}
    audited = len(prints) + len(dropped)
    return records, audit_report(groups, dropped=len(dropped), audited=audited)


def _shortened_keys(plan: Plan, skipped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"key", "original", "split"}`` for every written sample whose key was shortened."""
    dropped = {s["key"] for s in skipped}
    records = [
        {"key": it.key, "original": it.original, "split": t.split}
        for t in plan.tasks
        for it in t.items
        if it.original is not None and it.key not in dropped
    ]
    return sorted(records, key=lambda r: (r["key"], r["split"]))
