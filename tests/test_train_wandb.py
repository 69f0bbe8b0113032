"""RunLogger against the real ``wandb`` package, offline: what a W&B run would upload.

``WANDB_MODE=offline`` writes each run to ``<run_dir>/wandb/offline-run-*/run-<id>.wandb``
(what ``wandb sync`` uploads later) with no network and no login. That file is a LevelDB-style
log of ``wandb_internal_pb2.Record`` protobufs (7-byte header ``:W&B`` + magic + version, then
32 KiB blocks of chunks: CRC32C, length, type); the test reads it back with the package's own
protobuf classes and checks the run, its config and the logged history.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb
from test_train_metrics import CLASSES, log_a_run, small_result
from wandb.proto import wandb_internal_pb2

from dlpipe.train.reporting import RunLogger

BLOCK_BYTES, FILE_HEADER_BYTES, CHUNK_HEADER_BYTES = 32768, 7, 7
FULL, LAST = 1, 4


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B offline, every folder it writes under `tmp_path`, no prompts."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        folder = tmp_path / "wandb-home" / name.lower()
        folder.mkdir(parents=True)
        monkeypatch.setenv(name, str(folder))
    yield
    wandb.teardown()  # ends the wandb-core service process this test started


def wandb_records(run_file: Path) -> list[Any]:
    """Every protobuf record of an offline run's ``.wandb`` file, in order."""
    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, chunks, pos = [], [], FILE_HEADER_BYTES
    while pos + CHUNK_HEADER_BYTES <= len(data):
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        if left < CHUNK_HEADER_BYTES:  # a block's tail too short for a chunk is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER_BYTES])
        start = pos + CHUNK_HEADER_BYTES
        chunks.append(data[start : start + length])
        pos = start + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def history(records: list[Any]) -> list[dict[str, Any]]:
    """The logged rows (``run.log`` calls), W&B's own ``_``-keys left out."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            rows.append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
    return rows


def offline_runs(run_dir: Path) -> list[Path]:
    """The offline runs' ``.wandb`` files under `run_dir`, once W&B has written them whole:
    ``finish()`` hands the run to the wandb-core service, which closes the file in its own
    time; ending the service (``wandb.teardown``) waits for that."""
    wandb.teardown()
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.usefixtures("offline_wandb")
def test_wandb_run_holds_the_config_and_the_logged_numbers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    log_a_run(run_dir, wandb_project="dlpipe-test", config={"lr": 0.1, "model": "resnet18"})
    run_id = (run_dir / "wandb-id.txt").read_text().strip()

    (run_file,) = offline_runs(run_dir)
    assert run_file.name == f"run-{run_id}.wandb"
    records = wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project) == (run_id, "dlpipe-test")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert (config["lr"], config["model"]) == (0.1, "resnet18")
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished

    first, second = history(records)  # W&B merges what is logged at one step into a row
    assert first == {"_step": 1, "train/loss": 2.5, "train/lr": 0.1}
    assert second["_step"] == 2 and (second["train/loss"], second["train/lr"]) == (2.0, 0.1)
    assert second["val/top1"] == 2 / 6 and second["val/top5"] == 4 / 6
    assert second["val/loss"] == pytest.approx(small_result().loss)
    assert second["epoch/train_loss"] == 2.25 and "epoch/samples_per_s" not in second
    assert second["val_class/bird"] == 0.5 and "val_class/fish" not in second
    assert second["val/confusion/_type"] == "image-file"
    assert (run_file.parent / "files" / second["val/confusion/path"]).is_file()

    with RunLogger(str(run_dir), enabled=True, classes=CLASSES, wandb_project="p") as log:
        log.step(3, {"loss": 1.0})
        log.close()  # closing twice finishes the W&B run once
    _, resumed = offline_runs(run_dir)  # a resumed run logs to the same W&B run
    assert resumed.name == run_file.name
    assert history(wandb_records(resumed)) == [{"_step": 3, "train/loss": 1.0}]
