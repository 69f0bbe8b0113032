"""Benchmark: ``dlpipe convert`` reading archives as downloaded, against the unpacked folder.

The photo-like corpus of ``benchmarks/corpus.py`` (default 20,000 JPEGs of ~100 KB, 10 class
folders) is packed once, as users download such datasets, into a ``.zip`` (deflated, as
Kaggle's are) and a ``.tar.gz`` (gzip's default level 6, as ``tar czf`` makes it), both
cached beside the corpus. Then, with all
cores, each is converted to wds by the venv's ``dlpipe`` as a subprocess (``--source
imagefolder``), timed by wall clock with the CPU seconds of the child:

1. the unpacked folder (the reference: 1.00x);
2. each archive with an empty cache: the listing (for ``.tar.gz``, one decompression of the
   whole stream to take its seek points) plus the conversion;
3. each archive again, its listing cached (``$XDG_CACHE_HOME/dlpipe/raw-views``): what a
   resumed or repeated conversion pays.

The outputs are checked byte for byte against the folder's. Run from the repository root::

    python benchmarks/convert_archives.py            # benchmarks/results/convert_archives.*
    python benchmarks/convert_archives.py --n 2000   # a quick check
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dlpipe_executable, generated_line, log, write_results  # sibling scripts
from corpus import cached_corpus, corpus_files
from machine import machine_info

from dlpipe.machine import usable_cpus

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pack(root: str, files: list[str], kind: str) -> str:
    """The corpus as one archive beside it (made once): class folders at its top."""
    path = f"{root.rstrip(os.sep)}.{kind}"
    if os.path.exists(path):
        return path
    log(f"packing {len(files)} images into {path} (once)")
    staging = f"{path}.tmp"
    if kind == "zip":
        with zipfile.ZipFile(staging, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in files:
                zf.write(name, os.path.relpath(name, root))
    else:
        with tarfile.open(staging, "w:gz", compresslevel=6) as tar:
            for name in files:
                tar.add(name, os.path.relpath(name, root), recursive=False)
    os.replace(staging, path)
    return path


def convert(raw: str, out: str, cache: str, workers: int) -> dict[str, float]:
    """One timed ``dlpipe convert RAW --to wds``; wall and CPU seconds (of the child)."""
    command = [dlpipe_executable(), "convert", raw, "--to", "wds", "--source", "imagefolder"]
    command += ["--out", out, "--overwrite", "--workers", str(workers)]
    environment = {**os.environ, "XDG_CACHE_HOME": cache}
    os.sync()
    cpu, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=environment)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr}")
    return {"wall_s": wall, "cpu_s": cpu}


def shards_digest(out: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        if name.endswith(".tar"):
            with open(os.path.join(out, name), "rb") as f:
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def run(images: int, seed: int, workers: int, work: str) -> dict[str, Any]:
    root, _ = cached_corpus(None, images, seed)
    files = corpus_files(root)
    total = sum(os.path.getsize(p) for p in files)
    raws = {"folder": root, "zip": pack(root, files, "zip"), "tar.gz": pack(root, files, "tar.gz")}
    for path in [raws["zip"], raws["tar.gz"], *files]:  # the page cache holds what is read
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    convert(root, os.path.join(work, "warm-up"), os.path.join(work, "cache-warm"), workers)
    shutil.rmtree(os.path.join(work, "warm-up"))  # imports and the listing path, untimed
    rows: list[dict[str, Any]] = []
    reference = None
    for name, raw in raws.items():
        cache = os.path.join(work, f"cache-{name.replace('.', '')}")
        runs = [("", False)] if name == "folder" else [("listing + ", False), ("", True)]
        for prefix, warm in runs:
            if not warm:
                shutil.rmtree(cache, ignore_errors=True)
            out = os.path.join(work, "out")
            log(f"dlpipe convert {name}{' (listing cached)' if warm else ''}")
            timed = convert(raw, out, cache, workers)
            digest = shards_digest(out)
            shutil.rmtree(out)
            reference = reference or digest
            rows.append(
                {
                    "contender": f"{prefix}convert {name}" + (" (listing cached)" if warm else ""),
                    "archive_bytes": os.path.getsize(raw) if os.path.isfile(raw) else total,
                    **timed,
                    "images_per_s": images / timed["wall_s"],
                    "images_per_cpu_s": images / timed["cpu_s"],
                    "same_output": digest == reference,
                }
            )
    base = rows[0]["wall_s"]
    for row in rows:
        row["speed_vs_folder"] = base / row["wall_s"]
    return {"images": images, "corpus_bytes": total, "workers": workers, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Converting archives as downloaded",
        "",
        f"{result['images']} JPEGs ({result['corpus_bytes'] / 1e9:.2f} GB) converted to wds "
        f"with {result['workers']} workers (`--workers {result['workers']}`, all cores used), "
        "from the folder, a deflated `.zip` and a `.tar.gz`; every output byte-identical to "
        "the folder's (`same output`).",
        "",
        "| contender | wall s | CPU s | images/s | images/CPU-s | vs folder | same output |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['contender']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | "
            f"{row['images_per_s']:.0f} | {row['images_per_cpu_s']:.0f} | "
            f"{row['speed_vs_folder']:.2f}x | {'yes' if row['same_output'] else '**no**'} |"
        )
    lines += ["", generated_line(result), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=20_000, help="images (default 20,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=usable_cpus())
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlpipe-archives-") as work:
        result = run(args.n, args.seed, args.workers, work)
    stem = "convert_archives" if args.n == 20_000 else f"convert_archives_{args.n}"
    result.update(
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        total_s=time.perf_counter() - started,
        machine=machine_info(),
        config={
            "command": "python benchmarks/convert_archives.py"
            + (f" --n {args.n}" if args.n != 20_000 else ""),
            "json_name": f"{stem}.json",
        },
    )
    write_results(args.out, stem, result, markdown)
    return 0 if all(row["same_output"] for row in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
