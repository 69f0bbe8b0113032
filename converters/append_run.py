"""The steps ``--append`` adds to a conversion (`dlpipe.converters.engine` calls them; the rules
are `dlpipe.converters.append`'s): the ``--dedup`` pass that finds the new samples copying the
dataset's, taking the output folder for a new version or back from an interrupted one, and,
without ``--dedup``, the copies found in the written shards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dlpipe.converters.append import (
    AppendBase,
    StoredSample,
    copies_of_stored,
    digest_task,
    shard_digests,
)
from dlpipe.converters.audit import DuplicateGroup, Fingerprint, find_duplicates
from dlpipe.converters.config import ConvertConfig, EngineConfig
from dlpipe.converters.executors import run_local, run_ray
from dlpipe.converters.journal import ResumeError, check_plan, result_of
from dlpipe.converters.plan import Plan
from dlpipe.converters.source import Source
from dlpipe.converters.worker import TaskResult, WorkerConfig, image_reader
from dlpipe.formats import get_format
from dlpipe.formats.output import DatasetOutput

__all__ = ["check_resumable", "copies_written", "dedup_pass", "take_output"]

Stored = Mapping[tuple[str, str], StoredSample]


def dedup_pass(
    source: Source,
    plan: Plan,
    worker: WorkerConfig,
    engine: EngineConfig,
    base: AppendBase,
    stored: Stored,
) -> tuple[tuple[DuplicateGroup, ...], list[dict[str, Any]]]:
    """``--append --dedup``'s first pass (`digest_task`, on the conversion's engine): the new
    samples that are exact copies of the dataset's, and the duplicate groups among the others."""
    if engine.kind == "ray":
        results = run_ray(source, plan.tasks, worker, engine.ray_address, job=digest_task)
    else:
        results = run_local(source, plan.tasks, worker, engine.workers, job=digest_task)
    prints = [(r.split, *f) for r in results for f in r.fingerprints]
    digests = {(split, key): digest for split, key, _, _, digest in prints}
    copies = copies_of_stored(stored, digests, base.manifest.version + 1)
    copied = {(m["split"], m["key"]) for c in copies for m in c["samples"][1:]}
    kept = [Fingerprint(*p[:4]) for p in prints if (p[0], p[1]) not in copied]
    return tuple(find_duplicates(kept, read=image_reader(source, plan.tasks))), copies


def check_resumable(config: ConvertConfig, base: AppendBase) -> None:
    """Refuse ``--append --resume`` with no journal, or after the append's manifest was
    written (only its journal was left): there is nothing to resume.

    Raises:
        ResumeError: naming why, and the command that appends anew.
    """
    output = DatasetOutput(base.out, get_format(config.to))
    if not output.journal_exists():
        raise ResumeError(
            f"{base.out} holds no unfinished append to resume (no journal); append with "
            f"`{config.command('')}`"
        )
    recorded = output.journal_plan().get("options")
    appended_to = recorded.get("append_to") if isinstance(recorded, dict) else None
    finished = [v.version for v in base.manifest.versions if v.appended_to == appended_to]
    if appended_to is not None and finished:
        raise ResumeError(
            f"{base.out}: the append to resume finished as version {finished[0]}; nothing to "
            "resume (its journal goes with the next --append)"
        )


def take_output(
    output: DatasetOutput, base: AppendBase, plan: Plan, config: ConvertConfig
) -> tuple[dict[str, TaskResult], int]:
    """The shards an interrupted append finished (``--resume``, whose plan must be this one),
    else none and the number of an unfinished append's shards deleted
    (`DatasetOutput.prepare_append`)."""
    if not config.resume:
        return {}, output.prepare_append(base.sha256, [t.name for t in plan.tasks])
    check_resumable(config, base)
    check_plan(output.journal_plan(), plan, output.out, config.command(""))
    return output.resume(result_of), 0


def copies_written(
    base: AppendBase, stored: Stored, worker: WorkerConfig, results: Sequence[TaskResult]
) -> list[dict[str, Any]]:
    """The written new samples that are exact copies of the dataset's (their shards read
    back, nothing decoded)."""
    digests = {}
    for result in results:
        if result.info is not None:
            found = shard_digests(
                worker.out, worker.format, result.info, result.fields, worker.image.field
            )
            digests.update({(result.split, key): d for key, d in found if d is not None})
    return copies_of_stored(stored, digests, base.manifest.version + 1)
