"""GPU check: what dlpipe needs of a GPU machine, in one run under 5 minutes, written to JSON.

    python benchmarks/gpu_check.py     # writes benchmarks/results/gpu_check.{json,md}

Each check runs on its own and records its figures or its error, so one failure never hides
the others:

1. **amp**: ResNet-50 train steps at 224 px, batch 64, channels-last: bf16 autocast, and fp16
   autocast with a GradScaler; finite losses, steps/s (after warm-up, synchronised).
2. **copies**: host-to-device GB/s of a 9.6 MB uint8 batch (64 x 3 x 224 x 224) from pinned
   memory (``non_blocking``) and from pageable memory.
3. **nccl**: a one-rank NCCL process group on this GPU (TCP rendezvous on 127.0.0.1): an
   ``all_reduce`` and a ``broadcast`` give the expected values.
4. **decode**: the corpus's JPEGs (photo-like, ~100 KB, ~400 x 350 px) decoded in batches of
   256 by ``torchvision.io.decode_jpeg(device="cuda")`` (nvJPEG), images/s, against
   simplejpeg on one CPU core; and dlpipe's device decoder (decode + crop + resize + flip),
   with its crop + resize + flip alone and how busy the host's CPU is meanwhile; and the
   device decoder on 2,560 of those JPEGs plain against ``--seekable-jpeg`` (each worker
   sends its train box's window): images/s and host CPU per image.
5. **bench_loader**: the corpus converted to lmdb, then ``dlpipe bench-loader --device cuda``
   on it, as a user runs it before training: the settings and the decode (CPU or GPU) it
   picks by measurement, its verdict, and the profile it saves beside the data.
6. **train**: ``dlpipe train`` ResNet-50, 224 px, batch 256, bf16, three epochs of that data
   with the workers the profile holds, with the CPU loader (``--decode cpu``) and with GPU
   decode (``--decode cuda``): samples/s and data wait of the last epoch (from
   ``metrics.jsonl``), over the whole epoch and without its first batch (the workers'
   start-up, which a 40-step epoch weighs 125 times more than an ImageNet epoch of 5,005
   steps). The goal is data wait < 5 %.

Without CUDA every check records ``skipped`` (the script itself still runs: CI can import
it). ``--images`` sets the corpus size (default 10,240: 40 steps of 256 per epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import convert_corpus, dlpipe_executable, generated_line, log, write_results
from corpus import cached_corpus, corpus_files
from machine import machine_info

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GOAL_DATA_WAIT = 0.05


def _sync() -> None:
    torch.cuda.synchronize()


def check_amp() -> dict[str, Any]:
    import torchvision

    out: dict[str, Any] = {}
    x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device="cuda")
    for name, dtype in (("bf16", torch.bfloat16), ("fp16_gradscaler", torch.float16)):
        model = torchvision.models.resnet50(num_classes=1000).cuda()
        model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        losses, times = [], []
        for step in range(25):
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss))  # synchronises
            if step >= 5:
                times.append(time.perf_counter() - start)
        out[name] = {
            "finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "steps_per_s": len(times) / sum(times),
            "samples_per_s": 64 * len(times) / sum(times),
        }
    return out


def check_copies() -> dict[str, Any]:
    batch = torch.randint(0, 255, (64, 3, 224, 224), dtype=torch.uint8)
    pinned = batch.pin_memory()
    out: dict[str, Any] = {"bytes": batch.numel()}
    for name, source, non_blocking in (("pinned", pinned, True), ("pageable", batch, False)):
        for _ in range(3):
            source.to("cuda", non_blocking=non_blocking)
        _sync()
        start = time.perf_counter()
        for _ in range(50):
            copy = source.to("cuda", non_blocking=non_blocking)
        _sync()
        seconds = time.perf_counter() - start
        out[f"{name}_gb_per_s"] = 50 * batch.numel() / seconds / 1e9
        out[f"{name}_equal"] = bool(torch.equal(copy.cpu(), batch))
    return out


def check_nccl() -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        value = torch.arange(4, device="cuda", dtype=torch.float32)
        dist.all_reduce(value)
        source = torch.full((3,), 7.0, device="cuda")
        dist.broadcast(source, src=0)
        _sync()
        return {
            "backend": dist.get_backend(),
            "all_reduce_ok": value.tolist() == [0.0, 1.0, 2.0, 3.0],
            "broadcast_ok": source.tolist() == [7.0, 7.0, 7.0],
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
        }
    finally:
        dist.destroy_process_group()


def check_decode(files: list[str]) -> dict[str, Any]:
    import simplejpeg
    from torchvision.io import ImageReadMode, decode_jpeg

    from dlpipe.loading.device_decode import DeviceDecoder, PlannedTransform, collate_planned
    from dlpipe.loading.transforms import ImageTransform

    blobs = [Path(p).read_bytes() for p in files]
    datas = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    out: dict[str, Any] = {"images": len(blobs)}
    decode_jpeg(datas[:256], mode=ImageReadMode.RGB, device="cuda")  # warm-up (nvJPEG init)
    _sync()
    start = time.perf_counter()
    for i in range(0, len(datas), 256):
        decode_jpeg(datas[i : i + 256], mode=ImageReadMode.RGB, device="cuda")
    _sync()
    out["nvjpeg_images_per_s"] = len(datas) / (time.perf_counter() - start)
    start = time.perf_counter()
    for b in blobs[:500]:
        simplejpeg.decode_jpeg(b)
    out["simplejpeg_images_per_s_one_core"] = min(500, len(blobs)) / (time.perf_counter() - start)
    planner = PlannedTransform(ImageTransform("train", 224, "jpg"))
    decoder = DeviceDecoder(torch.device("cuda"), 224)
    planned = [planner({"jpg": b, "cls": b"0"}, 0, i) for i, b in enumerate(blobs)]
    batches = [collate_planned(planned[i : i + 256]) for i in range(0, len(planned), 256)]
    decoder(batches[0])
    _sync()
    start = time.perf_counter()
    for batch in batches:
        decoder(batch)
    _sync()
    out["device_decoder_images_per_s"] = len(planned) / (time.perf_counter() - start)
    out.update(_finish_alone(decoder, [planned for planned, _ in batches[:8]]))
    out.update(_seekable_against_plain(decoder, planner, blobs[:2560]))
    return out


def _seekable_against_plain(decoder: Any, planner: Any, blobs: list[bytes]) -> dict[str, Any]:
    """The device decoder on the same JPEGs plain and as ``convert --seekable-jpeg`` stores
    them (the workers send each train box's window), alternating: images/s and the host CPU
    seconds per image (nvJPEG's Huffman stage runs on the host for small images)."""
    from multiprocessing import Pool

    from dlpipe.jpeg_seek import add_restart_markers
    from dlpipe.loading.device_decode import collate_planned

    with Pool() as pool:
        rewritten = pool.map(add_restart_markers, blobs)
    seekable = [s or b for s, b in zip(rewritten, blobs, strict=True)]
    kinds = {"plain": blobs, "seekable": seekable}
    batches = {}
    for kind, datas in kinds.items():
        planned = [planner({"jpg": b, "cls": b"0"}, 0, i) for i, b in enumerate(datas)]
        batches[kind] = [collate_planned(planned[i : i + 256]) for i in range(0, len(planned), 256)]
        decoder(batches[kind][0])
    wall, cpu = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0.0)
    for _ in range(3):
        for kind, todo in batches.items():
            _sync()
            start, started_cpu = time.perf_counter(), time.process_time()
            for batch in todo:
                decoder(batch)
            _sync()
            wall[kind] += time.perf_counter() - start
            cpu[kind] += time.process_time() - started_cpu
    count = 3 * len(blobs)
    out: dict[str, Any] = {}
    for kind in kinds:
        out[f"device_decoder_{kind}_images_per_s"] = count / wall[kind]
        out[f"device_decoder_{kind}_host_cpu_us_per_image"] = 1e6 * cpu[kind] / count
    out["seekable_bytes_sent_share"] = sum(
        int(b[0].offsets[-1]) for b in batches["seekable"]
    ) / max(sum(int(b[0].offsets[-1]) for b in batches["plain"]), 1)
    return out


def _finish_alone(decoder: Any, batches: list[Any]) -> dict[str, Any]:
    """The device decoder's crop + resize + flip alone, on batches decoded beforehand:
    images/s, and the share of that time the host's CPU was busy (near 1: the kernels'
    launches, one image at a time, bound it, not the GPU)."""
    decoded = [(decoder.decode(planned), planned.plans) for planned in batches]
    decoder.finish(*decoded[0])
    _sync()
    start, cpu = time.perf_counter(), time.process_time()
    for images, plans in decoded:
        decoder.finish(images, plans)
    _sync()
    seconds = time.perf_counter() - start
    count = sum(len(images) for images, _ in decoded)
    return {
        "finish_images_per_s": count / seconds,
        "finish_host_cpu_share": (time.process_time() - cpu) / seconds,
    }


def _train(data: str, decode: str, work: str) -> dict[str, Any]:
    run = os.path.join(work, f"run-{decode}")
    cmd = [dlpipe_executable(), "train", data, "--model", "resnet50", "--epochs", "3"]
    cmd += ["--batch-size", "256", "--image-size", "224", "--precision", "bf16"]
    cmd += ["--channels-last", "--val-split", "", "--decode", decode, "--resume", "none"]
    cmd += ["--out", run]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    if proc.returncode != 0:
        raise RuntimeError(f"dlpipe train --decode {decode} failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        epochs = [r for r in map(json.loads, f) if r.get("event") == "epoch"]
    last = epochs[-1]
    return {
        "samples_per_s": last["samples_per_s"],
        "data_wait": last["data_wait"],
        "data_wait_after_first": last["data_wait_after_first"],
        "first_batch_wait_s": last["first_batch_wait_s"],
        "goal_met": last["data_wait"] < GOAL_DATA_WAIT,
        "goal_met_after_first": last["data_wait_after_first"] < GOAL_DATA_WAIT,
        "epochs": [
            {k: e[k] for k in ("samples_per_s", "data_wait", "data_wait_after_first")}
            for e in epochs
        ],
        "wall_s": time.perf_counter() - start,
        "output_tail": proc.stdout[-1500:],
    }


def _converted(root: str, work: str) -> tuple[str, float | None]:
    """The corpus as lmdb in `work` (converted once), and the seconds that took (None: there
    already)."""
    data = os.path.join(work, "corpus-lmdb")
    if os.path.exists(os.path.join(data, "dlpipe.json")):
        return data, None
    return data, convert_corpus(root, "lmdb", data)


def check_train(root: str, work: str) -> dict[str, Any]:
    data, convert_s = _converted(root, work)
    out: dict[str, Any] = {"convert_s": convert_s}
    for decode in ("cpu", "cuda"):  # the workers bench-loader saved, if it ran
        try:
            out[decode] = _train(data, decode, work)
        except Exception as exc:  # the other decode still runs
            out[decode] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    return out


def check_bench_loader(root: str, work: str) -> dict[str, Any]:
    """``bench-loader --device cuda`` as a user runs it before training: the profile it saves
    beside the data is what the train check's runs use."""
    data, convert_s = _converted(root, work)
    cmd = [dlpipe_executable(), "bench-loader", data, "--device", "cuda", "--batch-size", "256"]
    cmd += ["--image-size", "224", "--budget", "60", "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        raise RuntimeError(f"dlpipe bench-loader failed:\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    out = {k: report[k] for k in ("best", "bottleneck", "advice", "saved", "stages", "trials")}
    return {"convert_s": convert_s, "wall_s": time.perf_counter() - start, **out}


def _run(name: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    start = time.perf_counter()
    try:
        result = check()
    except Exception:
        result = {"error": traceback.format_exc()[-2000:]}
    result["seconds"] = time.perf_counter() - start
    log(f"  {name}: {json.dumps(result)[:300]}")
    return result


def _figure(checks: dict[str, Any], path: str, form: str) -> str:
    """``checks[a][b]...`` (path ``a.b...``) formatted, or what stopped its check."""
    value: Any = checks
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return "skipped" if "skipped" in value else "error (below)"
        value = value[part]
    return form.format(value)


SUMMARY = [  # (what, path in checks, format)
    ("ResNet-50 bf16 autocast, batch 64: samples/s", "amp.bf16.samples_per_s", "{:,.0f}"),
    (
        "ResNet-50 fp16 + GradScaler, batch 64: samples/s",
        "amp.fp16_gradscaler.samples_per_s",
        "{:,.0f}",
    ),
    ("host-to-device, pinned: GB/s", "copies.pinned_gb_per_s", "{:.1f}"),
    ("host-to-device, pageable: GB/s", "copies.pageable_gb_per_s", "{:.1f}"),
    ("NCCL all_reduce and broadcast correct", "nccl.all_reduce_ok", "{}"),
    ("nvJPEG batched decode: images/s", "decode.nvjpeg_images_per_s", "{:,.0f}"),
    (
        "dlpipe device decoder (decode + crop + resize + flip): images/s",
        "decode.device_decoder_images_per_s",
        "{:,.0f}",
    ),
    ("... its crop + resize + flip alone: images/s", "decode.finish_images_per_s", "{:,.0f}"),
    ("... host CPU busy during it", "decode.finish_host_cpu_share", "{:.0%}"),
    *[
        row
        for kind in ("plain", "seekable")
        for row in (
            (
                f"device decoder, 2,560 {kind} JPEGs: images/s",
                f"decode.device_decoder_{kind}_images_per_s",
                "{:,.0f}",
            ),
            (
                f"... host CPU per image ({kind}): µs",
                f"decode.device_decoder_{kind}_host_cpu_us_per_image",
                "{:,.0f}",
            ),
        )
    ],
    (
        "... bytes the seekable windows carry, of the plain",
        "decode.seekable_bytes_sent_share",
        "{:.0%}",
    ),
    ("simplejpeg, one CPU core: images/s", "decode.simplejpeg_images_per_s_one_core", "{:,.0f}"),
    *[
        row
        for decode, name in (("cpu", "CPU"), ("cuda", "GPU"))
        for row in (
            (
                f"`dlpipe train` ResNet-50 b256, {name} decode: samples/s",
                f"train.{decode}.samples_per_s",
                "{:,.0f}",
            ),
            ("... data wait, whole last epoch", f"train.{decode}.data_wait", "{:.1%}"),
            (
                "... data wait after the epoch's first batch",
                f"train.{decode}.data_wait_after_first",
                "{:.1%}",
            ),
            ("... first batch wait: s", f"train.{decode}.first_batch_wait_s", "{:.2f}"),
        )
    ],
    ("`bench-loader --device cuda` picks: decode", "bench_loader.best.decode", "{}"),
    ("... engine", "bench_loader.best.engine", "{}"),
    ("... workers", "bench_loader.best.num_workers", "{}"),
    ("... samples/s", "bench_loader.best.samples_per_s", "{:,.0f}"),
]


def markdown(result: dict[str, Any]) -> str:
    lines = ["# GPU check", "", generated_line(result), "", f"Device: {result['device']}.", ""]
    lines += ["| check | figure |", "| --- | ---: |"]
    lines += [
        f"| {what} | {_figure(result['checks'], path, form)} |" for what, path, form in SUMMARY
    ]
    advice = result["checks"].get("bench_loader", {}).get("advice")
    if advice:
        lines += ["", f"`bench-loader`'s verdict: {advice}"]
    lines += [""]
    for name, figures in result["checks"].items():
        lines += [f"## {name}", "", "```json", json.dumps(figures, indent=2), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, default=10240, help="corpus size (10,240)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="dlpipe-gpu-check-") as work:
        root = ""
        if torch.cuda.is_available():
            root, _ = cached_corpus(None, args.images, 0)
        checks["amp"] = _run("amp", check_amp)
        checks["copies"] = _run("copies", check_copies)
        checks["nccl"] = _run("nccl", check_nccl)
        checks["decode"] = _run("decode", lambda: check_decode(corpus_files(root)))
        checks["bench_loader"] = _run("bench_loader", lambda: check_bench_loader(root, work))
        checks["train"] = _run("train", lambda: check_train(root, work))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    result = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "images": args.images,
            "command": "python benchmarks/gpu_check.py",
            "json_name": "gpu_check.json",
        },
        "machine": machine_info(torch=torch.__version__, cuda=torch.version.cuda),
        "device": device,
        "checks": checks,
        "total_s": time.perf_counter() - started,
    }
    write_results(args.out, "gpu_check", result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
