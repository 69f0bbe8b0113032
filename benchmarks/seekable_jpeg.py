"""Benchmark: what ``dlpipe convert --seekable-jpeg`` costs in CPU and in stored bytes.

One run converts the same JPEG corpus (``benchmarks/corpus.py``, default 5,000 images in its
``imagenet`` encoding: the photo-like pixels, ~400x350 px, written as ImageNet's files are,
quality 75-95, 4:2:0, about six in ten baseline with the standard Huffman tables, three with
optimised tables and one progressive) with ``dlpipe convert CORPUS --to wds --source
imagefolder --out OUT --overwrite`` and with the same plus ``--seekable-jpeg``, as
subprocesses of the venv's ``dlpipe``, alternating which goes first round by round, so a slow
spell of a shared machine falls on both. Each conversion gives:

- its **CPU-seconds per image**: user + system time of the ``dlpipe`` process and every
  process it waited for (``resource.getrusage(RUSAGE_CHILDREN)`` before and after), over the
  corpus's images; start-up and imports are in both and cancel in the difference,
- its wall seconds,
- the **stored bytes**: the ``.jpg`` members of the output shards (the field the option
  rewrites), per kind of source file, and every shard file in all.

The table gives the median and the spread (min-max) over the rounds of the extra CPU per
image (each round's seekable minus that round's plain conversion) and of the bytes ratio.
The corpus is read once, untimed, before the first conversion; ``os.sync()`` runs before each
one and each output is deleted after it, both untimed.

Run from the repository root, in the venv where dlpipe is installed with the ``jpeg-region``
extra (about 6 minutes on 2 cores, plus 2 the first time, to make the corpus)::

    python benchmarks/seekable_jpeg.py        # writes benchmarks/results/seekable_jpeg.{json,md}
    python benchmarks/seekable_jpeg.py --images 500 --rounds 1 --out /tmp/seekable-check
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dlpipe.turbojpeg import region_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dlpipe_executable, generated_line, log, write_results  # siblings
from corpus import ENCODINGS, cached_corpus, corpus_files, jpeg_kind, jpeg_options
from machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = {"plain": (), "seekable": ("--seekable-jpeg",)}
KEY_INDEX = re.compile(r"(\d+)\.jpg$")


def children_cpu_s() -> float:
    """User + system seconds of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def convert(root: str, out: str, options: tuple[str, ...]) -> tuple[float, float]:
    """``dlpipe convert`` the corpus to wds; returns (wall seconds, CPU seconds)."""
    cmd = [dlpipe_executable(), "convert", root, "--to", "wds", "--source", "imagefolder"]
    cmd += ["--out", out, "--overwrite", *options]
    os.sync()
    cpu, start = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return wall, cpu


def stored_bytes(out: str, kind_of: Callable[[int], str]) -> dict[str, Any]:
    """Bytes of the output: ``jpg`` members per kind of source file, and all shard files."""
    per_kind: dict[str, int] = {}
    shards = sorted(p for p in Path(out).iterdir() if p.suffix == ".tar")
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                found = KEY_INDEX.search(member.name)
                if found:
                    kind = kind_of(int(found.group(1)))
                    per_kind[kind] = per_kind.get(kind, 0) + member.size
    return {
        "jpg_bytes": sum(per_kind.values()),
        "jpg_bytes_per_kind": per_kind,
        "shard_bytes": sum(p.stat().st_size for p in shards),
    }


def run_rounds(
    root: str,
    images: int,
    rounds: int,
    kind_of: Callable[[int], str],
    on_round: Callable[[list[dict[str, Any]]], None],
) -> None:
    """`rounds` rounds of both conversions, the first one alternating; after each round,
    `on_round` gets every conversion so far (so a run cut short keeps its whole rounds)."""
    work = tempfile.mkdtemp(prefix="dlpipe-bench-seekable-")
    found: list[dict[str, Any]] = []
    try:
        for round_ in range(rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                out = os.path.join(work, variant)
                wall, cpu = convert(root, out, VARIANTS[variant])
                row = {"round": round_, "variant": variant, "wall_s": wall, "cpu_s": cpu}
                row["cpu_ms_per_image"] = cpu / images * 1e3
                row.update(stored_bytes(out, kind_of))
                shutil.rmtree(out)
                log(
                    f"  round {round_ + 1} {variant:<8} {wall:6.1f} s wall, "
                    f"{row['cpu_ms_per_image']:6.2f} CPU-ms per image, {row['jpg_bytes']:,} B"
                )
                found.append(row)
            on_round(found)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round: seekable minus plain CPU per image and the bytes ratios; their spread."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["variant"]] = row
    pairs = [(r["plain"], r["seekable"]) for r in by_round.values()]
    kinds = sorted(pairs[0][0]["jpg_bytes_per_kind"])
    return {
        "extra_cpu_ms_per_image": _spread(
            [s["cpu_ms_per_image"] - p["cpu_ms_per_image"] for p, s in pairs]
        ),
        "cpu_ratio": _spread([s["cpu_s"] / p["cpu_s"] for p, s in pairs]),
        "plain_cpu_ms_per_image": _spread([p["cpu_ms_per_image"] for p, _ in pairs]),
        "seekable_cpu_ms_per_image": _spread([s["cpu_ms_per_image"] for _, s in pairs]),
        "jpg_bytes_ratio": pairs[0][1]["jpg_bytes"] / pairs[0][0]["jpg_bytes"],
        "shard_bytes_ratio": pairs[0][1]["shard_bytes"] / pairs[0][0]["shard_bytes"],
        "jpg_bytes_ratio_per_kind": {
            k: pairs[0][1]["jpg_bytes_per_kind"][k] / pairs[0][0]["jpg_bytes_per_kind"][k]
            for k in kinds
        },
        "bytes_same_every_round": all(
            p["jpg_bytes"] == pairs[0][0]["jpg_bytes"]
            and s["jpg_bytes"] == pairs[0][1]["jpg_bytes"]
            for p, s in pairs
        ),
    }


def _pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.1f} %"


def markdown(result: dict[str, Any]) -> str:
    m, c, s = result["machine"], result["corpus"], result["summary"]
    extra, rounds = s["extra_cpu_ms_per_image"], len(result["rows"]) // len(VARIANTS)
    kinds = result["kinds"]
    lines = [
        "# What `dlpipe convert --seekable-jpeg` costs",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"Python {m['python']}, dlpipe {m['dlpipe']}; load average at the start "
        f"{result['load_average'][0]:.2f}, at the end {result['load_average'][1]:.2f}.",
        "",
        f"Corpus (`benchmarks/corpus.py --encoding {c.get('encoding', 'q90')}`, seed "
        f"{c['seed']}): {c['images']:,} photo-like JPEGs, {c['total_bytes'] / 1e6:.1f} MB, "
        f"mean {c['mean_bytes'] / 1e3:.1f} KB, mean {c['mean_width']:.0f}x{c['mean_height']:.0f}"
        f" px; {', '.join(f'{n:,} {k}' for k, n in kinds.items())} files. Each round converts "
        "it to wds without and with `--seekable-jpeg` (the first alternating); CPU is the "
        "`dlpipe` process and its workers (user + system), over the images.",
        "",
        f"| measure | median of {rounds} round(s) | min | max |",
        "|---|---:|---:|---:|",
        f"| extra CPU per image, seekable - plain | {extra['median']:.2f} ms "
        f"| {extra['min']:.2f} ms | {extra['max']:.2f} ms |",
    ]
    for name in VARIANTS:
        v = s[f"{name}_cpu_ms_per_image"]
        lines.append(
            f"| CPU per image, {name} | {v['median']:.2f} ms | {v['min']:.2f} ms "
            f"| {v['max']:.2f} ms |"
        )
    ratio = s["cpu_ratio"]
    lines += [
        f"| CPU, seekable / plain | {ratio['median']:.2f}x | {ratio['min']:.2f}x "
        f"| {ratio['max']:.2f}x |",
        "",
        "Stored bytes (the same in every round: "
        f"{'yes' if s['bytes_same_every_round'] else '**no**'}):",
        "",
        "| files | JPEG bytes, seekable / plain |",
        "|---|---:|",
        f"| all {c['images']:,} | {s['jpg_bytes_ratio']:.3f} ({_pct(s['jpg_bytes_ratio'])}) |",
    ]
    for kind, r in s["jpg_bytes_ratio_per_kind"].items():
        lines.append(f"| {kinds.get(kind, 0):,} {kind} | {r:.3f} ({_pct(r)}) |")
    lines += [
        f"| shard files in all | {s['shard_bytes_ratio']:.3f} ({_pct(s['shard_bytes_ratio'])}) |",
        "",
        "## Every conversion",
        "",
        "| round | variant | wall s | CPU s | CPU ms per image | JPEG bytes | shard bytes |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['round'] + 1} | {r['variant']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
            f"| {r['cpu_ms_per_image']:.2f} | {r['jpg_bytes']:,} | {r['shard_bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, default=5000, help="corpus size (default 5000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both (default 5)")
    parser.add_argument("--encoding", choices=ENCODINGS, default="imagenet")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default 0)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if region_library() is None:
        print("error: --seekable-jpeg needs pip install 'dlpipe[jpeg-region]'", file=sys.stderr)
        return 2
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    root, corpus = cached_corpus(None, args.images, args.seed, args.encoding)
    files = corpus_files(root)
    for path in files:  # the page cache, untimed
        Path(path).read_bytes()

    def kind_of(index: int) -> str:
        return jpeg_kind(jpeg_options(args.seed, index, args.encoding))

    kinds: dict[str, int] = {}
    for i in range(args.images):
        kinds[kind_of(i)] = kinds.get(kind_of(i), 0) + 1
    from dlpipe import __version__

    def report(rows: list[dict[str, Any]]) -> None:
        result = {
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": {
                **{k: v for k, v in vars(args).items() if k != "out"},
                "command": "python benchmarks/seekable_jpeg.py"
                + (" " + " ".join(argv) if argv else ""),
                "json_name": "seekable_jpeg.json",
            },
            "machine": machine_info(dlpipe=__version__),
            "load_average": [load_start, os.getloadavg()[0]],
            "corpus": {k: v for k, v in corpus.items() if k not in ("per_class", "reused")},
            "kinds": kinds,
            "rows": rows,
            "summary": summarise(rows),
            "total_s": time.perf_counter() - started,
        }
        write_results(args.out, "seekable_jpeg", result, markdown)

    run_rounds(root, len(files), args.rounds, kind_of, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
