"""What a conversion keeps in its journal, so ``--resume`` can finish it.

The journal (``<out>/.dlpipe-journal/``) is the output folder owner's
(`dlpipe.formats.output.DatasetOutput`): a plan record, an intent before each shard is
published and a record of each finished shard, each a separate object written atomically, so it
works the same on a local disk and on object storage, where files cannot be appended to. This
module says what a conversion's records hold: the plan's fingerprint and what went into it
(options, classes, sample count, raw folder, format and option flags), so a refused ``--resume``
can say what changed and a reader of the unfinished folder can print the resume command; and
each finished shard's `TaskResult`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from dlpipe.converters.plan import OPTION_FLAGS, Plan
from dlpipe.converters.worker import TaskResult
from dlpipe.errors import DlpipeError
from dlpipe.manifest import ShardInfo

__all__ = ["ResumeError", "check_plan", "plan_record", "result_of", "result_record"]

_FLAGS = {**OPTION_FLAGS, "format": "--to", "image_field": "the image type"}


class ResumeError(DlpipeError, ValueError):
    """``--resume`` cannot continue this output (no journal, or a different plan)."""


def plan_record(plan: Plan, raw: str, args: list[str]) -> dict[str, Any]:
    """The record of the plan a conversion follows, its raw folder, format and option flags
    `args` (from which a reader of the unfinished folder prints the resume command)."""
    return {**_plan_record(plan), "raw": raw, "format": plan.options.get("format"), "args": args}


def check_plan(recorded: dict[str, Any], plan: Plan, out: str, overwrite_command: str) -> None:
    """Refuse to resume with a plan other than the interrupted run's (`recorded`), naming what
    changed.

    Raises:
        ResumeError: the fingerprints differ (the message lists the changed options and
            classes, and gives `overwrite_command` to start again).
    """
    if recorded.get("fingerprint") == plan.fingerprint:
        return
    raise ResumeError(
        f"{out}: the input or the options differ from the interrupted run's "
        f"({_changes(recorded, plan)}), so its shards cannot be reused; run the same "
        f"command as before with --resume, or start again with `{overwrite_command}`"
    )


def result_record(result: TaskResult) -> dict[str, Any]:
    """A finished shard's journal record (`result_of` reads it back): `asdict`'s record,
    without its deep copy of every fingerprint (the record is written as JSON at once)."""
    record = {f.name: getattr(result, f.name) for f in fields(result)}
    record["info"] = asdict(result.info) if result.info is not None else None
    return record


def result_of(record: dict[str, Any]) -> TaskResult:
    """The `TaskResult` a journal record holds."""
    info = ShardInfo(**record["info"]) if record["info"] else None
    return TaskResult(**{**record, "info": info})


def _plan_record(plan: Plan) -> dict[str, Any]:
    return {
        "fingerprint": plan.fingerprint,
        "options": plan.options,
        "classes": list(plan.classes),
        "samples": sum(len(t.items) for t in plan.tasks),
    }


def _changes(recorded: dict[str, Any], plan: Plan) -> str:
    """What differs between the recorded plan and `plan`, in the user's words."""
    now = json.loads(json.dumps(_plan_record(plan), sort_keys=True, default=str))
    changes = []
    before_options = recorded.get("options")
    if isinstance(before_options, dict):
        for key in sorted(set(before_options) | set(now["options"])):
            old, new = before_options.get(key), now["options"].get(key)
            if old != new:
                changes.append(f"{_FLAGS.get(key, key)} was {old!r}, now {new!r}")
    before_classes = recorded.get("classes")
    if isinstance(before_classes, list) and before_classes != now["classes"]:
        changes.append(_class_change(before_classes, now["classes"]))
    if not changes and recorded.get("samples") not in (None, now["samples"]):
        changes.append(f"the raw data held {recorded['samples']} samples, now {now['samples']}")
    return "; ".join(changes) or "the raw files changed"


def _class_change(before: list[Any], now: list[Any]) -> str:
    added = [c for c in now if c not in before]
    removed = [c for c in before if c not in now]
    parts = [f"added {', '.join(map(repr, added))}" if added else ""]
    parts.append(f"removed {', '.join(map(repr, removed))}" if removed else "")
    described = "; ".join(p for p in parts if p) or "their order changed"
    return f"the classes changed ({described})"
