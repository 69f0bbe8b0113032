"""Detection + scan + plan of a million-file ImageFolder: time, memory, and proof of one walk.

Builds N empty ``.jpg`` files in C class folders in a temporary folder (``os.open``/``close``
in a loop, progress on stderr), then, in a fresh child process each:

- **timed**: ``plan_conversion`` of ``dlpipe convert ROOT --to wds`` (auto-detection, the
  scan, the shard plan; nothing is written) — wall seconds, CPU seconds (user + system) and
  the child's peak RSS;
- **counted**: the same with ``os.scandir``, ``os.stat``, ``os.lstat`` and every directory
  entry's ``stat()`` wrapped and counted (slower, so not timed): how many times each folder
  was listed and how many stat calls each file cost.

Writes ``benchmarks/results/scan.json`` and ``scan.md`` and removes the files it built.

    python benchmarks/scan.py                      # 1,000,000 files in 1,000 classes
    python benchmarks/scan.py --files 10000        # a quick estimate of the build time
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import generated_line, log, write_results

from dlpipe.converters.engine import ConvertConfig, plan_conversion
from dlpipe.machine import usable_cpus

RESULTS = Path(__file__).resolve().parent / "results"


def build_tree(root: Path, files: int, classes: int) -> float:
    """`files` empty images spread over `classes` folders; returns the wall seconds."""
    start = time.perf_counter()
    per_class, extra = divmod(files, classes)
    step = max(files // 10, 1)
    made = 0
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(per_class + (c < extra)):
            os.close(os.open(folder / f"{i:07d}.jpg", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
            made += 1
            if made % step == 0:
                log(f"  built {made:,} / {files:,} files ({time.perf_counter() - start:.0f} s)")
    return time.perf_counter() - start


def _plan(root: str) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="scan-bench-out-")
    try:
        planned = plan_conversion(
            ConvertConfig.from_options(raw=root, to="wds", out=out, workers=1)
        )
    finally:
        shutil.rmtree(out)
    return {
        "source": planned.description["kind"],
        "samples": planned.description["samples"],
        "shards": len(planned.plan.tasks),
    }


class _CountedEntry:
    """A directory entry whose ``stat()`` calls are counted."""

    def __init__(self, entry: os.DirEntry[str], counts: collections.Counter[str]) -> None:
        self._entry, self._counts = entry, counts

    def stat(self, **kwargs: Any) -> os.stat_result:
        self._counts["dirent_stat"] += 1
        return self._entry.stat(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class _CountedScandir:
    def __init__(self, it: Any, counts: collections.Counter[str]) -> None:
        self._it, self._counts = it, counts

    def __enter__(self) -> _CountedScandir:
        return self

    def __exit__(self, *exc: object) -> None:
        self._it.close()

    def __iter__(self) -> Any:
        return (_CountedEntry(e, self._counts) for e in self._it)


def _counted_plan(root: str) -> dict[str, Any]:
    """`_plan` with the listing and stat calls under `root` counted."""
    counts: collections.Counter[str] = collections.Counter()
    listed: collections.Counter[str] = collections.Counter()
    real = {"scandir": os.scandir, "stat": os.stat, "lstat": os.lstat}

    def scandir(path: Any = ".") -> Any:
        if isinstance(path, int) or not os.fspath(path).startswith(root):
            return real["scandir"](path)
        listed[os.fspath(path)] += 1
        return _CountedScandir(real["scandir"](path), counts)

    def counter(name: str) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(path, int) and os.fspath(path).startswith(root):
                counts[name] += 1
            return real[name](path, *args, **kwargs)

        return call

    os.scandir, os.stat, os.lstat = scandir, counter("stat"), counter("lstat")  # type: ignore[assignment]
    try:
        result = _plan(root)
    finally:
        os.scandir, os.stat, os.lstat = real["scandir"], real["stat"], real["lstat"]  # type: ignore[assignment]
    return {
        **result,
        "scandir_calls": sum(listed.values()),
        "folders_listed": len(listed),
        "most_listings_of_one_folder": max(listed.values()),
        "dirent_stat_calls": counts["dirent_stat"],
        "os_stat_calls": counts["stat"],
        "os_lstat_calls": counts["lstat"],
    }


def measure(root: str, counted: bool) -> dict[str, Any]:
    """One measurement in this process (run as a child: a clean peak RSS)."""
    if counted:
        return _counted_plan(root)
    before = os.times()
    start = time.perf_counter()
    result = _plan(root)
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**result, "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak_mib}


def _child(root: Path, counted: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--measure", str(root)] + (["--counted"] if counted else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def markdown(result: dict[str, Any]) -> str:
    """The report: one row of timings, one of counts."""
    cfg, timed, counted = result["config"], result["timed"], result["counted"]
    files, folders = cfg["files"], cfg["classes"] + 1
    return "\n".join([
        f"# Scan of {files:,} empty files in {cfg['classes']:,} class folders",
        "",
        generated_line(result),
        "",
        f"Machine: {result['machine']}. The tree was built in {result['build_s']:.0f} s "
        "(not part of the figures). Detection + scan + shard plan of `dlpipe convert ROOT "
        "--to wds` (nothing written), each in a fresh process, warm page cache.",
        "",
        "| files | source | samples | shards | wall s | CPU s | peak RSS MiB | files/s (wall) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        f"| {files:,} | {timed['source']} | {timed['samples']:,} | {timed['shards']} "
        f"| {timed['wall_s']:.1f} | {timed['cpu_s']:.1f} | {timed['peak_rss_mib']:.0f} "
        f"| {files / timed['wall_s']:,.0f} |",
        "",
        "| folders | scandir calls | folders listed | most listings of one folder "
        "| DirEntry.stat | os.stat | os.lstat |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {folders:,} | {counted['scandir_calls']:,} | {counted['folders_listed']:,} "
        f"| {counted['most_listings_of_one_folder']} | {counted['dirent_stat_calls']:,} "
        f"| {counted['os_stat_calls']:,} | {counted['os_lstat_calls']:,} |",
        "",
        f"**One walk: {'met' if counted['most_listings_of_one_folder'] == 1 else 'not met'}** "
        f"(every folder listed once); {counted['dirent_stat_calls'] / (files + folders):.2f} "
        "DirEntry.stat per entry (the size of each file, the identity of each folder); "
        "os.stat/os.lstat calls do not grow with the files (the root, the class folders' "
        "`dlpipe.json` check, path resolution).",
        "",
    ])  # fmt: skip


def _machine() -> str:
    return f"{usable_cpus()} usable CPUs, {platform.machine()}, Python " + (
        platform.python_version()
    )


def run(files: int, classes: int, base: str | None, results: Path) -> dict[str, Any]:
    """Build, measure (timed, then counted), clean up, write the results."""
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="scan-bench-", dir=base))
    try:
        root = tmp / "raw"
        log(f"building {files:,} empty files in {classes:,} classes under {root}")
        build_s = build_tree(root, files, classes)
        log(f"built in {build_s:.0f} s; timing detection + scan + plan")
        timed = _child(root, counted=False)
        log(f"timed: {timed['wall_s']:.1f} s wall; counting calls")
        counted = _child(root, counted=True)
    finally:
        log("removing the tree")
        shutil.rmtree(tmp)
    command = "python benchmarks/scan.py" + (
        "" if (files, classes) == (1_000_000, 1000) else f" --files {files} --classes {classes}"
    )
    result = {
        "config": {
            "files": files,
            "classes": classes,
            "command": command,
            "json_name": "scan.json",
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(),
        "build_s": build_s,
        "timed": timed,
        "counted": counted,
    }
    result["total_s"] = time.perf_counter() - start
    write_results(results, "scan", result, markdown)
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the benchmark (or, as a child, one measurement)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--tmp", default=None, help="folder to build the tree in")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.counted)))
        return 0
    if args.files < args.classes or args.classes < 1:
        parser.error(f"--files {args.files} must be at least --classes {args.classes} (>= 1)")
    run(args.files, args.classes, args.tmp, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
