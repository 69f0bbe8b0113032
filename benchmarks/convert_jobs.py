"""The work each contender of ``benchmarks/convert.py`` does, as functions a fork pool runs.

The one-pass reference and the limit's parts (copy, draft decode), a plain WebDataset
``ShardWriter`` copy, LitData's ``optimize`` (run in a subprocess), the fsync'd disk write, and
the CPU-time and pool helpers they share. See ``benchmarks/convert.py`` for what each measures.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import resource
from collections.abc import Callable, Sequence
from typing import Any

from corpus import corpus_files  # sibling script
from PIL import Image

DISK_FILE_BYTES = 64 << 20
DISK_MAX_BYTES = 1 << 30


# ----------------------------------------------------------------------------------- baselines


def copy_file(job: tuple[str, str]) -> int:
    src, dst = job
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data)
    return len(data)


def draft_decode(path: str) -> int:
    with open(path, "rb") as f:
        data = f.read()
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
    image.load()
    return len(data)


def copy_and_decode(job: tuple[str, str]) -> int:
    src, dst = job
    with open(src, "rb") as f:
        data = f.read()
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
    image.load()
    with open(dst, "wb") as f:
        f.write(data)
    return len(data)


def warm_up(files: Sequence[str]) -> None:
    """Read every file once, so that every contender starts with the corpus in page cache."""
    for path in files:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass


def pool_map(fn: Callable[[Any], int], jobs: Sequence[Any], workers: int) -> int:
    """`fn` over `jobs` in `workers` forked processes (in this one when 1); total bytes."""
    if workers == 1:
        return sum(fn(job) for job in jobs)
    chunk = max(1, len(jobs) // (workers * 8))
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return sum(pool.map(fn, jobs, chunksize=chunk))


# ----------------------------------------------------------------------------------- other tools


def cpu_seconds() -> float:
    """User + system seconds of this process and of every child it has waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def label_of(path: str) -> int:
    """The corpus's label of an image: its class folder ``class_NNN``."""
    return int(os.path.basename(os.path.dirname(path)).rsplit("_", 1)[1])


def webdataset_copy(job: tuple[list[str], str, int]) -> int:
    """One plain ``webdataset.ShardWriter`` over a slice of the files; total bytes."""
    import webdataset

    files, pattern, shard_bytes = job
    total = 0
    with webdataset.ShardWriter(pattern, maxsize=shard_bytes, verbose=0) as sink:
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            key = os.path.relpath(path, os.path.dirname(os.path.dirname(path)))[:-4]
            sink.write({"__key__": key.replace("/", "_"), "jpg": data, "cls": label_of(path)})
            total += len(data)
    return total


def disk_files(total_bytes: int) -> int:
    """How many 64 MB files `disk_write` writes for a corpus of `total_bytes` (1 GB at most)."""
    return max(1, min(total_bytes, DISK_MAX_BYTES) // DISK_FILE_BYTES)


def disk_write(folder: str, files: int, block: bytes) -> int:
    """`files` files of `block` (64 MB) written, each fsync'ed; bytes written."""
    written = 0
    for index in range(files):
        with open(os.path.join(folder, f"{index}.bin"), "wb") as f:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
        written += len(block)
    return written


# ----------------------------------------------------------------------------------- litdata


def litdata_version() -> str | None:
    try:
        import litdata
    except Exception:  # ImportError, or a broken install
        return None
    return str(getattr(litdata, "__version__", "unknown"))


def litdata_sample(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    return {"image": data, "label": label_of(path)}


def litdata_main(root: str, out: str, workers: int) -> int:
    from litdata import optimize

    optimize(
        fn=litdata_sample,
        inputs=corpus_files(root),
        output_dir=out,
        num_workers=workers,
        chunk_bytes="64MB",
        verbose=False,
    )
    return 0
