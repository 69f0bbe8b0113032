"""The conversion journal: one small record per finished shard, so ``--resume`` can finish.

Kept in ``<out>/.dlpipe-journal/`` as separate objects (``plan.json`` and one
``<shard>.json`` per finished shard), each written atomically, so it works the same on a
local disk and on object storage, where files cannot be appended to. It is removed once the
manifest is written.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

from dlpipe import storage
from dlpipe.converters.worker import TaskResult
from dlpipe.errors import DlpipeError
from dlpipe.manifest import ShardInfo

__all__ = ["JOURNAL_DIR", "Journal", "ResumeError"]

JOURNAL_DIR = ".dlpipe-journal"


class ResumeError(DlpipeError, ValueError):
    """``--resume`` cannot continue this output (no journal, or a different plan)."""


class Journal:
    def __init__(self, out: str) -> None:
        self.folder = storage.join(out, JOURNAL_DIR)

    def exists(self) -> bool:
        return storage.exists(storage.join(self.folder, "plan.json"))

    def start(self, fingerprint: str) -> None:
        storage.makedirs(self.folder)
        data = json.dumps({"fingerprint": fingerprint}).encode()
        storage.atomic_write_bytes(storage.join(self.folder, "plan.json"), data)

    def check_plan(self, fingerprint: str, out: str) -> None:
        recorded = json.loads(storage.read_bytes(storage.join(self.folder, "plan.json")))
        if recorded.get("fingerprint") != fingerprint:
            raise ResumeError(
                f"{out}: the input or the options differ from the interrupted run's, so its "
                "shards cannot be reused; run the same command as before with --resume, or "
                "start again with --overwrite"
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
            if name == "plan.json" or not name.endswith(".json"):
                continue
            data = json.loads(storage.read_bytes(storage.join(self.folder, name)))
            info = ShardInfo(**data["info"]) if data["info"] else None
            results[data["name"]] = TaskResult(**{**data, "info": info})
        return results

    def remove(self) -> None:
        if not storage.is_url(self.folder):
            shutil.rmtree(storage.local_path(self.folder), ignore_errors=True)
            return
        for name in storage.listdir(self.folder):
            storage.remove(storage.join(self.folder, name))
