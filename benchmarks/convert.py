"""Benchmark: ``dlpipe convert`` (imagefolder → wds / lmdb / hdf5) at a size where users are.

One run measures, on the same photo-like JPEG corpus from ``benchmarks/corpus.py`` (default
20,000 images of ~100 KB, ~2 GB, 10 classes; made once, cached and reused across runs), with
all cores and with one worker:

1. **The one-pass reference**, ``read + draft decode + write``: each file read once, decoded
   with Pillow's reduced-scale draft mode (``im.draft("RGB", (w // 8, h // 8)); im.load()``,
   the cheapest decode that still entropy-decodes all the compressed data, so it proves every
   image whole) and written, unchanged, to an output folder, in a ``fork`` process pool (its
   start-up is timed). A conversion that checks every image cannot do less work. The goal:
   dlpipe at all workers >= 0.8x the reference at all workers.
2. **The limit**: the slower of ``copy`` (every file read and written, nothing fsync'ed) and
   ``draft decode`` (every file read and draft-decoded), each at the same worker count. It
   assumes copying and decoding overlap for free, which CPU-bound cores do not give.
3. ``dlpipe convert CORPUS --to FMT --source imagefolder --out OUT --overwrite --workers W``
   for each format, as a subprocess of the venv's ``dlpipe`` console script, timed by wall
   clock (start-up and imports included); the ``N samples in S s`` line it prints is kept
   (``dlpipe s``).
4. **A plain WebDataset copy**: ``webdataset.ShardWriter`` writing ``{"__key__", "jpg": file
   bytes, "cls": label}`` with dlpipe's shard size, one writer per worker over a contiguous
   slice of the files (fork pool). It decodes nothing.
5. **Detection**: the same images laid out as COCO ships them, with a seeded 7.3 boxes per
   image in ``annotations/instances_train.json`` (``benchmarks/convert_detection.py``),
   converted by ``dlpipe convert VIEW --to wds --source coco`` (the JSON streamed, every box
   checked against its image), against the same reference (``--no-detection`` skips it).
   The duplicate audit's own cost (each image's difference hash beside the draft decode, and
   the grouping of every fingerprint) is timed in this process.
6. LitData's ``optimize`` (when ``litdata`` imports) at all workers, writing ``{"image": file
   bytes, "label": int}`` with ``chunk_bytes="64MB"``, as a subprocess. It decodes nothing.
7. ``disk write + fsync``: 64 MB files written and fsync'ed on the output disk (up to 1 GB in
   all): the write bandwidth that caps the extrapolation to many cores.

Every row records wall seconds, images/s, MB/s and CPU seconds (user + system of this
process and of every child it waited for). Images/s per core at one worker, scaled linearly
at the measured 1 → 2 efficiency and capped by the disk, gives the seconds per 1 M images on
8, 32 and 64 cores (see ``convert_report.py``).

The page cache cannot be dropped without root, so the corpus is read once, untimed, before any
measurement: the figures are CPU and page-cache costs, not cold-disk reads. ``os.sync()`` runs
before each timed run and each output is deleted after it, both untimed, so no contender pays
for another's write-back and the disk holds the corpus plus one output at a time. Each figure
is the median of 3 repeats (1 with ``--quick``).

Run from the repository root, in the venv where dlpipe is installed; at the default 20,000
images it takes about 14 minutes on 2 quiet cores with 3 repeats (about 9 with ``--repeats
2``; plus about 10 the first time, to make the corpus) and needs about 4.5 GB free under /tmp
(the 2 GB corpus and one output at a time)::

    python benchmarks/convert.py                  # writes benchmarks/results/convert.{json,md}
    python benchmarks/convert.py --quick          # 200 images, 1 repeat: convert_quick.*
    python benchmarks/convert.py --n 3000 --repeats 1 --out /tmp/convert-check

``--profile`` adds a cProfile of an in-process ``--workers 1`` wds conversion (the top
functions, by cumulative and by own time) to the Markdown file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import PIL
from PIL import features

from dlpipe.machine import usable_cpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dlpipe_executable, write_results  # sibling scripts
from convert_detection import audit_cost, coco_view, instances_parse_s
from convert_jobs import (
    DISK_FILE_BYTES,
    copy_and_decode,
    copy_file,
    cpu_seconds,
    disk_files,
    disk_write,
    draft_decode,
    litdata_main,
    litdata_version,
    pool_map,
    warm_up,
    webdataset_copy,
)
from convert_report import FORMATS, add_ratios, detection_name, dlpipe_name, markdown, verdicts
from corpus import DEFAULT_CORPUS, cached_corpus, corpus_files
from machine import machine_info as shared_machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_IMAGES = 20_000
SUMMARY = re.compile(r"(\d+) samples in ([0-9.]+) s \(([0-9.]+) samples/s, ([0-9.]+) MB/s\)")


# ----------------------------------------------------------------------------------- contenders


class Bench:
    """The corpus, the scratch folder and the timing protocol shared by every contender."""

    def __init__(self, corpus: dict[str, Any], work: str, repeats: int, cores: int) -> None:
        self.root = corpus["root"]
        self.files = corpus_files(self.root)
        self.total_bytes = sum(os.path.getsize(p) for p in self.files)
        self.work = work
        self.repeats = repeats
        self.cores = cores
        self.rows: list[dict[str, Any]] = []
        self.coco_root: str | None = None  # the COCO view, made when first needed
        self.coco_objects = 0

    def out_dir(self, name: str) -> str:
        path = os.path.join(self.work, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def copy_jobs(self, out: str) -> list[tuple[str, str]]:
        jobs = []
        for src in self.files:
            rel = os.path.relpath(src, self.root)
            os.makedirs(os.path.join(out, os.path.dirname(rel)), exist_ok=True)
            jobs.append((src, os.path.join(out, rel)))
        return jobs

    def measure(
        self,
        contender: str,
        workers: int,
        run: Callable[[str], dict[str, Any] | None],
        kind: str,
        *,
        images: int | None = None,
        total_bytes: int | None = None,
    ) -> dict[str, Any]:
        """`run(out)` once, with a fresh output folder deleted after it; the contender's row
        gathers its rounds (`run_all` runs every contender once per round)."""
        out = self.out_dir("out")
        os.sync()
        c0, t0 = cpu_seconds(), time.perf_counter()
        extra = run(out)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        shutil.rmtree(out, ignore_errors=True)
        row = self._row(contender, workers, kind)
        row["seconds"].append(seconds)
        row["cpu_s"].append(cpu)
        row["runs"].append(extra or {})
        median = statistics.median(row["seconds"])
        count = len(self.files) if images is None else images
        row.update(
            median_s=median,
            median_cpu_s=statistics.median(row["cpu_s"]),
            images=count,
            images_per_s=count / median,
            MB_per_s=(self.total_bytes if total_bytes is None else total_bytes) / 1e6 / median,
        )
        print(
            f"  {contender:<28} workers={workers:<2} {seconds:7.2f} s "
            f"{count / seconds:7.0f} img/s  {cpu:7.2f} CPU s",
            file=sys.stderr,
            flush=True,
        )
        return row

    def _row(self, contender: str, workers: int, kind: str) -> dict[str, Any]:
        for row in self.rows:
            if (row["contender"], row["workers"]) == (contender, workers):
                return row
        row = {"contender": contender, "kind": kind, "workers": workers}
        row.update(seconds=[], cpu_s=[], runs=[])
        self.rows.append(row)
        return row

    def baselines(self, workers: int) -> None:
        def copy(out: str) -> None:
            assert pool_map(copy_file, self.copy_jobs(out), workers) == self.total_bytes

        def decode(out: str) -> None:
            assert pool_map(draft_decode, self.files, workers) == self.total_bytes

        def fused(out: str) -> None:
            assert pool_map(copy_and_decode, self.copy_jobs(out), workers) == self.total_bytes

        self.measure("read + draft decode + write", workers, fused, "reference")
        self.measure("copy", workers, copy, "limit part")
        self.measure("draft decode", workers, decode, "limit part")

    def webdataset(self, workers: int) -> None:
        from dlpipe.converters.plan import default_shard_bytes

        shard_bytes = default_shard_bytes(self.total_bytes)
        step = -(-len(self.files) // workers)

        def run(out: str) -> None:
            os.makedirs(out)
            jobs = [
                (self.files[i : i + step], os.path.join(out, f"w{i // step}-%06d.tar"), shard_bytes)
                for i in range(0, len(self.files), step)
            ]
            assert pool_map(webdataset_copy, jobs, workers) == self.total_bytes

        self.measure("webdataset ShardWriter copy", workers, run, "other tool")

    def dlpipe(self, fmt: str, workers: int) -> None:
        exe = dlpipe_executable()

        def run(out: str) -> dict[str, Any]:
            cmd = [exe, "convert", self.root, "--to", fmt, "--source", "imagefolder"]
            cmd += ["--out", out, "--overwrite", "--workers", str(workers)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
            return parse_summary(proc.stdout, len(self.files))

        self.measure(dlpipe_name(fmt), workers, run, "dlpipe")

    def coco(self, fmt: str, workers: int) -> None:
        """The same images as COCO ships them (`convert_detection.coco_view`), boxes and all."""
        exe = dlpipe_executable()
        if self.coco_root is None:
            self.coco_root, self.coco_objects = coco_view(self.files, self.work)

        def run(out: str) -> dict[str, Any]:
            cmd = [exe, "convert", str(self.coco_root), "--to", fmt, "--source", "coco"]
            cmd += ["--out", out, "--overwrite", "--workers", str(workers)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
            return parse_summary(proc.stdout, len(self.files))

        self.measure(detection_name(fmt), workers, run, "dlpipe")

    def litdata(self, workers: int) -> None:
        def run(out: str) -> None:
            cmd = [sys.executable, __file__, "_litdata", self.root, out, str(workers)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"litdata optimize failed ({proc.returncode}):\n{proc.stderr}")

        self.measure("litdata optimize", workers, run, "other tool")

    def disk(self) -> None:
        files, block = disk_files(self.total_bytes), os.urandom(DISK_FILE_BYTES)  # untimed

        def run(out: str) -> None:
            os.makedirs(out)
            disk_write(out, files, block)

        written = files * DISK_FILE_BYTES
        self.measure("disk write + fsync", 1, run, "disk", images=0, total_bytes=written)


def parse_summary(stdout: str, images: int) -> dict[str, Any]:
    """dlpipe's own ``N samples in S s (R samples/s, M MB/s)`` line."""
    match = SUMMARY.search(stdout)
    if not match:
        raise RuntimeError(f"no summary line in dlpipe's output:\n{stdout}")
    samples, seconds, rate, mb_rate = match.groups()
    if int(samples) != images:
        raise RuntimeError(f"dlpipe wrote {samples} samples, the corpus holds {images}")
    return {
        "summary": match.group(0),
        "dlpipe_s": float(seconds),
        "dlpipe_samples_per_s": float(rate),
        "dlpipe_MB_per_s": float(mb_rate),
    }


# ----------------------------------------------------------------------------------- profile


STAGES = {  # cProfile's name of a C call → the stage of a conversion it is
    # simplejpeg's decode is a Cython function, which cProfile does not see: its time is the
    # own time of the function that calls it (the header read and array hand-over beside it)
    "_quick_jpeg_draft": "JPEG draft decode (libjpeg-turbo)",
    "<method 'decode' of 'ImagingDecoder' objects>": "JPEG draft decode (libjpeg-turbo)",
    "<method 'update' of '_hashlib.HASH' objects>": "sha256",
    "<built-in method posix.fsync>": "fsync",
    "<method 'read' of '_io.BufferedReader' objects>": "file reads",
    "<method 'readinto' of '_io.BufferedReader' objects>": "file reads",
    "<built-in method posix.read>": "file reads",
    "<built-in method posix.pread>": "file reads",  # raw files are read from their descriptor
    "<method 'write' of '_io.BufferedWriter' objects>": "file writes",
    "<method 'flush' of '_io.BufferedWriter' objects>": "file writes",
    "<method 'close' of '_io.BufferedWriter' objects>": "file writes",
    "<built-in method posix.mkdir>": "folders and renames",
    "<built-in method posix.rmdir>": "folders and renames",
    "<built-in method posix.replace>": "folders and renames",
    "<built-in method posix.remove>": "folders and renames",
}


def profile_dlpipe(root: str, work: str, top: int = 18) -> tuple[str, dict[str, float]]:
    """cProfile of an in-process ``dlpipe convert --to wds --workers 1``: the top functions,
    and the seconds of each stage (`STAGES`; the rest is Python around them)."""
    from dlpipe.cli import main as dlpipe_main

    out = os.path.join(work, "profile-wds")
    argv = ["convert", root, "--to", "wds", "--source", "imagefolder", "--out", out]
    argv += ["--overwrite", "--workers", "1"]
    profiler = cProfile.Profile()
    profiler.enable()
    dlpipe_main(argv)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stages: dict[str, float] = dict.fromkeys(dict.fromkeys(STAGES.values()), 0.0)
    for (_, _, function), (_, _, own_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if function in STAGES:
            stages[STAGES[function]] += own_s
    stages["everything else (Python, other calls)"] = stats.total_tt - sum(stages.values())  # type: ignore[attr-defined]
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return "\n".join(line.rstrip() for line in text.getvalue().splitlines()), stages


# ----------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    from dlpipe import __version__ as dlpipe_version

    return shared_machine_info(
        pillow=PIL.__version__,
        libjpeg_turbo=features.version("jpg") if features.check("libjpeg_turbo") else None,
        dlpipe=dlpipe_version,
        webdataset=package_version("webdataset") or "not installed",
        litdata=litdata_version() or "not installed",
    )


def package_version(name: str) -> str | None:
    try:
        module = __import__(name)
    except Exception:  # ImportError, or a broken install
        return None
    return str(getattr(module, "__version__", "unknown"))


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--n",
        "--images",
        dest="n",
        type=int,
        help=f"corpus size in images (default {DEFAULT_IMAGES:,}; --quick 200)",
    )
    parser.add_argument("--quick", action="store_true", help="small corpus, 1 repeat")
    parser.add_argument("--repeats", type=int, help="timed repeats (default 3; --quick 1)")
    parser.add_argument(
        "--corpus",
        help=f"corpus folder (default {DEFAULT_CORPUS}/<n>-s<seed>, reused when it matches)",
    )
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    parser.add_argument("--work", help="scratch folder for outputs (default: a temp folder)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--no-litdata", action="store_true", help="skip LitData's optimize")
    parser.add_argument("--no-webdataset", action="store_true", help="skip the ShardWriter copy")
    parser.add_argument(
        "--no-detection", action="store_true", help="skip the COCO detection conversion"
    )
    parser.add_argument("--profile", action="store_true", help="add a cProfile of --workers 1")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    args.n = args.n or (200 if args.quick else DEFAULT_IMAGES)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.n < 1 or args.repeats < 1:
        parser.error("--n and --repeats must be at least 1")
    return args


def run_all(bench: Bench, args: argparse.Namespace, loads: list[list[float] | None]) -> str:
    """Every contender once per round (all cores, then one worker), so that a change in the
    machine's load falls on every contender alike; the load average at the start of each
    round goes to `loads`. Returns the note on the other tools."""
    with_wds = not args.no_webdataset and package_version("webdataset") is not None
    with_litdata = not args.no_litdata and litdata_version() is not None
    for _ in range(bench.repeats):
        loads.append(load_average())
        for workers in (bench.cores, 1):
            bench.baselines(workers)
            if with_wds:
                bench.webdataset(workers)
            for fmt in args.formats:
                bench.dlpipe(fmt, workers)
            if not args.no_detection:
                bench.coco("wds", workers)
        bench.disk()
        if with_litdata:
            bench.litdata(bench.cores)
    notes = [] if with_wds else ["webdataset: skipped or not installed (`pip install webdataset`)."]
    if not with_litdata:
        notes.append("LitData: skipped (--no-litdata) or not installed (`pip install litdata`).")
    return " ".join(notes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_litdata"]:  # the LitData subprocess (see Bench.litdata)
        return litdata_main(argv[1], argv[2], int(argv[3]))
    args = parse_args(argv)
    started = time.perf_counter()
    cores = usable_cpus()
    root, corpus = cached_corpus(args.corpus, args.n, args.seed)
    print(f"corpus {root} ({'reused' if corpus['reused'] else 'made'})", file=sys.stderr)
    if args.work:
        os.makedirs(args.work, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dlpipe-bench-convert-", dir=args.work)
    load_before = load_average()
    round_loads: list[list[float] | None] = []
    try:
        bench = Bench(corpus, work, args.repeats, cores)
        t0 = time.perf_counter()
        warm_up(bench.files)
        warmup_s = time.perf_counter() - t0
        notes = run_all(bench, args, round_loads)
        audit = audit_cost(bench.files)
        if bench.coco_root is not None:
            audit["instances_json_load_s"] = instances_parse_s(bench.coco_root)
        profile, stages = profile_dlpipe(bench.root, work) if args.profile else (None, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    limits = add_ratios(bench.rows)
    stem = "convert_quick" if args.quick else "convert"
    command = "python benchmarks/convert.py" + (" " + " ".join(argv) if argv else "")
    stats = {k: v for k, v in corpus.items() if k not in ("per_class", "reused")}
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "images": args.n,
            "repeats": args.repeats,
            "cores": cores,
            "formats": args.formats,
            "quick": args.quick,
            "command": command,
            "json_name": f"{stem}.json",
        },
        "machine": machine_info(),
        "corpus": stats,
        "warmup_read_s": warmup_s,
        "load_before": load_before,
        "load_after": load_average(),
        "load_rounds": round_loads,
        "rows": bench.rows,
        "limits": limits,
        "verdict": verdicts(bench.rows, cores, stats),
        "litdata_note": notes,
        "audit": audit,
        "coco_objects": bench.coco_objects,
        "profile": profile,
        "profile_stages_s": stages,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.out, stem, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
