"""The figures and the Markdown report of ``benchmarks/convert.py``.

Ratios compare rows measured in the same run: each dlpipe row against the one-pass reference
at the same worker count (the goal), and against the limit (the slower of a plain copy and
the draft decode). Seconds per 1 M images on 8, 32 and 64 cores are extrapolated from the
measured one-worker rate, scaled linearly at the measured 1 → 2 worker efficiency (and, more
cautiously, by an Amdahl fit of the one- and two-worker times), and never faster than the
measured fsync'd write bandwidth of the output disk allows.
"""

from __future__ import annotations

import statistics
from typing import Any

from common import generated_line, met  # sibling script

__all__ = ["FORMATS", "add_ratios", "detection_name", "dlpipe_name", "markdown", "verdicts"]

FORMATS = ("wds", "lmdb", "hdf5")
GOAL_VS_REFERENCE = 0.8  # each format >= 0.8x the one-pass reference at all workers
GOAL_SPEEDUP_1_TO_2 = 1.8  # near-linear: 1 -> 2 workers at least 1.8x
EXTRAPOLATE_CORES = (8, 32, 64)
REFERENCE = "read + draft decode + write"


def dlpipe_name(fmt: str) -> str:
    return f"dlpipe convert --to {fmt}"


def detection_name(fmt: str) -> str:
    return f"dlpipe convert --to {fmt} --source coco (detection)"


def _by(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["contender"], r["workers"]): r for r in rows}


def add_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The limit per worker count; each row's ratio to it and to the reference there."""
    by = _by(rows)
    limits: dict[str, dict[str, Any]] = {}
    for workers in sorted({r["workers"] for r in rows if r["kind"] == "limit part"}):
        parts = [r for r in rows if r["kind"] == "limit part" and r["workers"] == workers]
        slower = max(parts, key=lambda r: r["median_s"])
        limits[str(workers)] = {
            "seconds": slower["median_s"],
            "images_per_s": slower["images_per_s"],
            "MB_per_s": slower["MB_per_s"],
            "bound_by": slower["contender"],
        }
    for row in (r for r in rows if r["kind"] != "disk"):
        limit = limits.get(str(row["workers"]))
        row["ratio_to_limit"] = row["images_per_s"] / limit["images_per_s"] if limit else None
        ref = by.get((REFERENCE, row["workers"]))
        row["ratio_to_reference"] = ref["median_s"] / row["median_s"] if ref else None
        row["cpu_ratio_to_reference"] = ref["median_cpu_s"] / row["median_cpu_s"] if ref else None
        internal = [r["dlpipe_s"] for r in row["runs"] if "dlpipe_s" in r]
        if internal:
            row["dlpipe_median_s"] = statistics.median(internal)
    return limits


def _scaling(by: dict[tuple[str, int], dict[str, Any]], name: str, cores: int) -> dict[str, Any]:
    speedup = by[(name, 1)]["median_s"] / by[(name, cores)]["median_s"]
    return {"speedup": speedup, "efficiency": speedup / cores}


def extrapolate(
    by: dict[tuple[str, int], dict[str, Any]], name: str, cores: int, floor_s: float
) -> dict[str, Any]:
    """Seconds per 1 M images on `EXTRAPOLATE_CORES` cores, two ways (module docstring).

    ``linear``: the one-worker rate x cores x the measured 1 → `cores` efficiency.
    ``amdahl``: the one- and `cores`-worker times fitted as serial + parallel / workers (the
    serial part: start-up, scan and plan in the main process, the last shard's tail).
    Both are floored at `floor_s`, the disk's time to write 1 M images.
    """
    one, many = by[(name, 1)]["median_s"], by[(name, cores)]["median_s"]
    efficiency = min(1.0, one / many / cores)
    parallel = min(one, max(0.0, (one - many) * cores / (cores - 1))) if cores > 1 else one
    serial = one - parallel
    scale = 1e6 / by[(name, 1)]["images"]
    return {
        "serial_s": serial * scale,
        "linear": {str(c): max(scale * one / (c * efficiency), floor_s) for c in EXTRAPOLATE_CORES},
        "amdahl": {
            str(c): max(scale * (serial + parallel / c), floor_s) for c in EXTRAPOLATE_CORES
        },
    }


def verdicts(rows: list[dict[str, Any]], cores: int, corpus: dict[str, Any]) -> dict[str, Any]:
    """The two goals, met or not, with the figures behind them, and the extrapolations."""
    by = _by(rows)
    formats = [f for f in FORMATS if (dlpipe_name(f), cores) in by]
    vs_ref = {f: by[(dlpipe_name(f), cores)]["ratio_to_reference"] for f in formats}
    vs_ref_cpu = {f: by[(dlpipe_name(f), cores)]["cpu_ratio_to_reference"] for f in formats}
    names = [dlpipe_name(f) for f in formats] + [REFERENCE, "webdataset ShardWriter copy"]
    scaling = {n: _scaling(by, n, cores) for n in names if (n, 1) in by and (n, cores) in by}
    disk = by.get(("disk write + fsync", 1))
    floor_s = 1e6 * corpus["mean_bytes"] / (disk["MB_per_s"] * 1e6) if disk else 0.0
    per_million = {n: extrapolate(by, n, cores, floor_s) for n in scaling}
    dl_scaling = [s["speedup"] for n, s in scaling.items() if n.startswith("dlpipe")]
    detection = {
        w: by[(detection_name("wds"), w)]["ratio_to_reference"]
        for w in (cores, 1)
        if (detection_name("wds"), w) in by
    }
    detection_cpu = {
        w: by[(detection_name("wds"), w)]["cpu_ratio_to_reference"]
        for w in (cores, 1)
        if (detection_name("wds"), w) in by
    }
    return {
        "detection_vs_reference": detection,
        "detection_vs_reference_cpu": detection_cpu,
        "detection_met": bool(detection)
        and all(r >= GOAL_VS_REFERENCE for r in detection.values()),
        "goal_vs_reference": GOAL_VS_REFERENCE,
        "vs_reference_wall": vs_ref,
        "vs_reference_cpu": vs_ref_cpu,
        "vs_reference_met": bool(vs_ref) and all(r >= GOAL_VS_REFERENCE for r in vs_ref.values()),
        "goal_speedup": GOAL_SPEEDUP_1_TO_2,
        "scaling": scaling,
        "scaling_met": bool(dl_scaling) and all(s >= GOAL_SPEEDUP_1_TO_2 for s in dl_scaling),
        "seconds_per_million": per_million,
        "disk_write_MB_per_s": disk["MB_per_s"] if disk else None,
        "startup_s": {
            f"{f} workers={w}": by[(dlpipe_name(f), w)]["median_s"]
            - by[(dlpipe_name(f), w)].get("dlpipe_median_s", float("nan"))
            for f in formats
            for w in (cores, 1)
            if (dlpipe_name(f), w) in by
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| contender | kind | workers | seconds | images/s | MB/s | CPU s | x reference "
        "| x reference (CPU s) | xlimit | dlpipe s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['contender']} | {r['kind']} | {r['workers']} | {r['median_s']:.2f} "
            f"| {_fmt(r['images_per_s'] or None, ',.0f')} | {r['MB_per_s']:.0f} "
            f"| {r['median_cpu_s']:.2f} "
            f"| {_fmt(r.get('ratio_to_reference'), '.2f')} "
            f"| {_fmt(r.get('cpu_ratio_to_reference'), '.2f')} "
            f"| {_fmt(r.get('ratio_to_limit'), '.2f')} | {_fmt(r.get('dlpipe_median_s'), '.2f')} |"
        )
    for w, lim in result["limits"].items():
        lines.append(
            f"| **limit** (bound by {lim['bound_by']}) | limit | {w} | {lim['seconds']:.2f} "
            f"| {lim['images_per_s']:,.0f} | {lim['MB_per_s']:.0f} | - | - | - | 1.00 | - |"
        )
    return lines


def extrapolation_lines(v: dict[str, Any]) -> list[str]:
    disk = v["disk_write_MB_per_s"]
    cap = f"{disk:,.0f} MB/s" if disk else "not measured"
    cores = " | ".join(f"{c} cores" for c in EXTRAPOLATE_CORES)
    lines = [
        "## Seconds per 1 M images, extrapolated",
        "",
        "`linear`: the measured one-worker rate x cores x the measured 1 → 2 efficiency, "
        "assumed to hold at every core count. `Amdahl`: the one- and two-worker times fitted "
        "as a serial part (start-up, scanning and planning in the main process, the last "
        "shard's tail) plus a part that divides by the workers; the serial part is shown per "
        "1 M images. Both are floored at 1 M x the mean image size / the disk's fsync'd write "
        f"rate ({cap}). Reading the raw images from a cold disk or a network is not included.",
        "",
        f"| contender | 1 → 2 speedup | serial s | linear: {cores} | Amdahl: {cores} |",
        "|---|---:|---:|" + "---:|" * 2 * len(EXTRAPOLATE_CORES),
    ]
    for name, per in v["seconds_per_million"].items():
        cells = [
            f"{per[way][str(c)]:,.0f} s" for way in ("linear", "amdahl") for c in EXTRAPOLATE_CORES
        ]
        lines.append(
            f"| {name} | {v['scaling'][name]['speedup']:.2f}x | {per['serial_s']:,.0f} s "
            f"| {' | '.join(cells)} |"
        )
    return lines


def verdict_lines(v: dict[str, Any], cores: int) -> list[str]:
    wall = ", ".join(f"{f} {r:.2f}x" for f, r in v["vs_reference_wall"].items())
    cpu = ", ".join(f"{f} {r:.2f}x" for f, r in v["vs_reference_cpu"].items())
    scaling = ", ".join(f"{n} {s['speedup']:.2f}x" for n, s in v["scaling"].items())
    startup = ", ".join(f"{k} {s:.2f} s" for k, s in v["startup_s"].items())
    return [
        f"Goals: each format >= {v['goal_vs_reference']}x the one-pass reference (`{REFERENCE}`"
        f") at {cores} workers, and near-linear scaling, 1 → 2 workers >= "
        f"{v['goal_speedup']}x.",
        "",
        f"- vs the reference at {cores} workers: {met(v['vs_reference_met'])} on wall clock "
        f"({wall}); on CPU seconds (load-independent): {cpu}.",
        f"- Scaling 1 → {cores} workers: {met(v['scaling_met'])} ({scaling}; the reference and "
        "the plain copy for comparison).",
        "",
        f"Wall clock minus dlpipe's own time (interpreter start-up, imports, summary): {startup}.",
    ]


def round_loads(result: dict[str, Any]) -> str:
    """``; at each round's start: ...`` where the run recorded them (older runs did not)."""
    loads = result.get("load_rounds")
    if not loads:
        return ""
    return "; at each round's start: " + ", ".join(str(load) for load in loads)


def audit_lines(result: dict[str, Any]) -> list[str]:
    """The detection conversion against the reference, and the duplicate audit's own cost."""
    v, audit = result["verdict"], result.get("audit")
    lines = []
    if v.get("detection_vs_reference"):
        ratios = ", ".join(f"{w} workers {r:.2f}x" for w, r in v["detection_vs_reference"].items())
        cpu = ", ".join(
            f"{w} workers {r:.2f}x" for w, r in v.get("detection_vs_reference_cpu", {}).items()
        )
        parse = (audit or {}).get("instances_json_load_s")
        context = (
            f"; the reference reads no annotations: one `json.load` of the instances file "
            f"alone takes {parse:.2f} CPU s"
            if parse is not None
            else ""
        )
        lines.append(
            f"- COCO detection (`{detection_name('wds')}`, {result['coco_objects']:,} boxes in "
            f"one instances JSON): {met(v['detection_met'])} >= {v['goal_vs_reference']}x the "
            f"reference on wall clock ({ratios}); on CPU seconds {cpu or 'not recorded'}"
            f"{context}."
        )
    if audit and "grey_decode_us" in audit:
        share = audit["fingerprint_us"] / audit["grey_decode_us"]
        lines.append(
            f"- Duplicate audit, in every dlpipe row above: the difference hash adds "
            f"{audit['fingerprint_us']:.0f} µs of CPU per image ({100 * share:+.0f} %) to "
            f"convert's check, a grey 1/8-scale decode of {audit['grey_decode_us']:.0f} µs "
            f"(libjpeg-turbo through simplejpeg); check and hash together "
            f"{audit['with_fingerprints_us']:.0f} µs against the reference's colour draft "
            f"decode (Pillow) of {audit['draft_decode_us']:.0f} µs (one process, best of 3 "
            f"over {audit['images_timed']:,} images; a file's sha256 is taken only when its "
            f"group could be exact copies); grouping {audit['grouping_images']:,} "
            f"fingerprints: {audit['grouping_s']:.2f} CPU s."
        )
    return lines


def stage_lines(stages: dict[str, float]) -> list[str]:
    """Where the profiled conversion's time went, stage by stage."""
    total = sum(stages.values())
    lines = ["| stage | seconds | share |", "|---|---:|---:|"]
    for stage, seconds in sorted(stages.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {stage} | {seconds:.2f} | {100 * seconds / total:.0f}% |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    m, c, cfg, v = result["machine"], result["corpus"], result["config"], result["verdict"]
    lines = [
        "# `dlpipe convert` against a one-pass reference, other tools and the limit",
        "",
        generated_line(result),
        "",
        f"Machine: {m['cpus_usable']} usable CPUs ({m['cpu_count']} reported), {m['processor']}, "
        f"Python {m['python']}, Pillow {m['pillow']} (libjpeg-turbo {m['libjpeg_turbo']}), "
        f"dlpipe {m['dlpipe']}, webdataset {m['webdataset']}, litdata {m['litdata']}. Load "
        f"average before / after: {result['load_before']} / {result['load_after']}"
        f"{round_loads(result)}.",
        "",
        f"Corpus (`benchmarks/corpus.py`, seed {c['seed']}): {c['images']:,} photo-like JPEGs "
        f"(quality {c['jpeg_quality']}) in {c['classes']} classes, "
        f"{c['total_bytes'] / 1e6:,.1f} MB, mean {c['mean_bytes'] / 1e3:.1f} KB, "
        f"mean {c['mean_width']:.0f}x{c['mean_height']:.0f} px.",
        "",
        f"Median of {cfg['repeats']} rounds (each runs every contender once, in turn). Warm "
        "page cache (the corpus is read once before timing). Outputs go to the same disk and "
        "are deleted, untimed, after each run; "
        "`os.sync()` runs, untimed, before each. dlpipe fsyncs every shard; the other "
        "contenders do not. `CPU s` is user + system time of the contender and all its "
        "processes; `x reference` divides the reference's time at the same worker count by "
        "the row's (above 1 is faster). The plain copies (`webdataset ShardWriter copy`, "
        "`litdata optimize`) store the file bytes and the label and decode nothing, so they "
        "check less than dlpipe and the reference do.",
        "",
        *table(result),
    ]
    if result["litdata_note"]:
        lines += ["", result["litdata_note"]]
    lines += ["", *verdict_lines(v, cfg["cores"]), *audit_lines(result), ""]
    lines += extrapolation_lines(v)
    if result.get("profile"):
        lines += ["", "## Profile: in-process `dlpipe convert --to wds --workers 1` (cProfile)"]
        lines += ["", *stage_lines(result["profile_stages_s"]), "", "```", result["profile"], "```"]
    return "\n".join(lines) + "\n"
