"""Shared test data: small samples of every field type, made on the fly from the demo generator."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.synthetic import SHAPE_CLASSES, synthetic_samples

FORMAT_NAMES = sorted(dlpipe.FORMATS)
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True, scope="session")
def _own_user_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The suite's user cache (saved profiles, archive views, shard caches) is its own folder,
    for every test and the processes they start: never the user's, never a data folder the
    environment names."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))
    patch.delenv("DLPIPE_DATA_DIR", raising=False)
    yield
    patch.undo()


def mixed_samples(count: int, seed: int = 0) -> list[dict]:
    """Samples carrying every codec: jpg, png, cls, txt, json, npy."""
    out = []
    for i, base in enumerate(synthetic_samples(count, seed=seed)):
        png = io.BytesIO()
        Image.open(io.BytesIO(base["jpg"])).convert("L").resize((16, 12)).save(png, "PNG")
        out.append(
            {
                "__key__": base["__key__"],
                "jpg": base["jpg"],
                "png": png.getvalue(),
                "cls": base["cls"],
                "txt": f"sample {i}: ünïcode".encode(),
                "json": json.dumps({"i": i, "tags": ["a", "b"][: i % 3]}).encode(),
                "npy": dlpipe.encode_field("npy", np.arange(i % 5 + 1, dtype=np.float32) * i),
            }
        )
    return out


@pytest.fixture(scope="session")
def samples() -> list[dict]:
    return mixed_samples(40)


def write_dataset(
    out: Path | str,
    fmt: str,
    splits: dict[str, list[dict]],
    *,
    max_shard_samples: int | None = 8,
) -> str:
    limits = dlpipe.ShardLimits(max_shard_samples=max_shard_samples)
    with dlpipe.DatasetWriter(
        out=str(out), format=fmt, classes=SHAPE_CLASSES, limits=limits
    ) as writer:
        for split, items in splits.items():
            for sample in items:
                writer.write(split, sample)
    return str(out)


@pytest.fixture
def make_dataset(tmp_path: Path, samples: list[dict]) -> Callable[..., str]:
    """make_dataset(fmt) -> path of a dataset of `samples` (train: 32, val: 8), 8 per shard."""

    def make(fmt: str, **kwargs: object) -> str:
        return write_dataset(
            tmp_path / fmt, fmt, {"train": samples[:32], "val": samples[32:]}, **kwargs
        )

    return make


@pytest.fixture
def spawn_masks(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The signal mask of this process at each spawn of a multiprocessing child (what the
    child starts with), recorded from here on."""
    import multiprocessing.popen_spawn_posix as popen
    import signal

    masks: list[set[int]] = []
    launch = popen.Popen._launch

    def recording_launch(self: object, process_obj: object) -> object:
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, set()))
        return launch(self, process_obj)  # type: ignore[arg-type]

    monkeypatch.setattr(popen.Popen, "_launch", recording_launch)
    return masks


def batch_list(loader: Any, count: int | None = None) -> list[tuple[Any, Any]]:
    """The (images, labels) batches of one pass (the first `count`), copied: a loader may
    reuse its buffers."""
    out = []
    for i, (images, labels) in enumerate(loader):
        if count is not None and i == count:
            break
        out.append((images.clone(), labels.clone()))
    return out


def per_sample(batches: list) -> list[tuple[int, bytes]]:
    """Each sample's (label, pixels), whatever batch and layout it came in."""
    return sorted(
        (int(label), image.contiguous().numpy().tobytes())
        for images, labels in batches
        for image, label in zip(images, labels, strict=True)
    )


def resumed_rest(make: Callable[[], Any], taken: int) -> tuple[list, list]:
    """The batches after the first `taken` of one uninterrupted pass, and the batches a new
    loader yields after loading the state saved there."""
    reference = make()
    iterator = iter(reference)
    for _ in range(taken):
        next(iterator)
    state = reference.state_dict()
    rest = [(images.clone(), labels.clone()) for images, labels in iterator]
    resumed = make()
    resumed.load_state_dict(state)
    return rest, batch_list(resumed)


def rank_keys(path: str, rank: int, workers: Any = "auto") -> list[str]:
    """The sample keys, in order, that `rank` of 2 reads in one pass of raw batches of 4."""
    config = dlpipe.LoaderConfig(batch_size=4, transform=None)
    loader = dlpipe.make_loader(path, "train", config, workers=workers, rank=rank, world_size=2)
    return [str(sample["__key__"]) for batch in loader for sample in batch]


def error_records(out: Path | str) -> list[dict]:
    """The records of a conversion's ``errors.jsonl`` (its skipped samples)."""
    return [json.loads(line) for line in (Path(out) / "errors.jsonl").read_text().splitlines()]


def one_error_line(err: str) -> str:
    """The one ``error:`` line of a failed command's stderr, which holds no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    """`one_error_line` of what a command printed, with no traceback on stdout either."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out, captured.out
    return one_error_line(captured.err)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo_ranks(code: str, arg: str, world_size: int, out: str) -> list[Any]:
    """Run ``python -c code arg`` as `world_size` processes joined by torch.distributed on
    127.0.0.1 (gloo: RANK, WORLD_SIZE, MASTER_ADDR/PORT set), wait for them (each must exit 0,
    else the test fails with their stderr), and load what each saved to ``{out}.{rank}``."""
    import torch

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"] = str(world_size)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, arg],
            env={**env, "RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    errors = [rank.communicate(timeout=240)[1] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), errors
    return [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(world_size)]


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 and the environment that points clients at it."""
    port = free_port()
    server = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield env
    finally:
        server.terminate()
        server.wait(timeout=10)
