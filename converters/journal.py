"""The conversion journal: one small record per finished shard, so ``--resume`` can finish.

Kept in ``<out>/.dlpipe-journal/`` as separate objects (``plan.json``, one ``<shard>.json``
per finished shard and one ``<shard>.intent`` per shard about to be published), each written
atomically, so it works the same on a local disk and on object storage, where files cannot
be appended to. ``plan.json`` records the plan's fingerprint and what went into it (options,
classes, sample count), so a refused ``--resume`` can say what changed. The journal is
removed once the manifest is written.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from dlpipe import storage
from dlpipe.converters.plan import OPTION_FLAGS, Plan
from dlpipe.converters.worker import TaskResult
from dlpipe.errors import DlpipeError
from dlpipe.formats.writer import JOURNAL_DIR, remove_journal
from dlpipe.manifest import ShardInfo

__all__ = ["JOURNAL_DIR", "Journal", "ResumeError"]

_PLAN_NAME = "plan.json"
_FLAGS = {**OPTION_FLAGS, "format": "--to", "image_field": "the image type"}


class ResumeError(DlpipeError, ValueError):
    """``--resume`` cannot continue this output (no journal, or a different plan)."""


class Journal:
    """The journal of the conversion into `out`."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.folder = storage.join(out, JOURNAL_DIR)

    def exists(self) -> bool:
        return storage.exists(storage.join(self.folder, _PLAN_NAME))

    def start(self, plan: Plan, raw: str, args: list[str]) -> None:
        """Record the plan this conversion follows, and its raw folder, format and option
        flags `args` (from which a reader of the unfinished folder prints the resume command).
        """
        storage.makedirs(self.folder)
        record = {
            **_plan_record(plan),
            "raw": raw,
            "format": plan.options.get("format"),
            "args": args,
        }
        data = json.dumps(record, sort_keys=True, default=str).encode()
        storage.atomic_write_bytes(storage.join(self.folder, _PLAN_NAME), data)

    def check_plan(self, plan: Plan, overwrite_command: str) -> None:
        """Refuse to resume with a plan other than the interrupted run's, naming what changed.

        Raises:
            ResumeError: the fingerprints differ (the message lists the changed options and
                classes, and gives `overwrite_command` to start again).
        """
        try:
            recorded = json.loads(storage.read_bytes(storage.join(self.folder, _PLAN_NAME)))
        except (OSError, ValueError, RecursionError):
            recorded = {}
        if not isinstance(recorded, dict):
            recorded = {}
        if recorded.get("fingerprint") == plan.fingerprint:
            return
        raise ResumeError(
            f"{self.out}: the input or the options differ from the interrupted run's "
            f"({_changes(recorded, plan)}), so its shards cannot be reused; run the same "
            f"command as before with --resume, or start again with `{overwrite_command}`"
        )

    def record(self, result: TaskResult) -> None:
        data = asdict(result)
        path = storage.join(self.folder, f"{result.name}.json")
        # not fsynced: a record lost in a power cut only means that shard is written again
        storage.atomic_write_bytes(path, json.dumps(data, sort_keys=True).encode(), durable=False)

    def finished(self) -> dict[str, TaskResult]:
        """Results of the shards finished so far, by shard name."""
        results = {}
        for name in storage.listdir(self.folder):
            if name == _PLAN_NAME or not name.endswith(".json"):
                continue
            data = json.loads(storage.read_bytes(storage.join(self.folder, name)))
            info = ShardInfo(**data["info"]) if data["info"] else None
            results[data["name"]] = TaskResult(**{**data, "info": info})
        return results

    def remove(self) -> None:
        remove_journal(self.out)


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
