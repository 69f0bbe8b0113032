"""What ``dlpipe bench-loader`` says in plain words: the bottleneck and what to do about it,
and why the CPU or the GPU decodes. The figures come from `dlpipe.loading.tune`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlpipe.turbojpeg import INSTALL_HINT, region_library

if TYPE_CHECKING:  # tune builds these and imports this module
    from dlpipe.loading.tune_search import Trial
    from dlpipe.loading.tune_stages import StageRates

__all__ = ["crop_verdict", "decode_verdict", "verdict"]

# why each detection and segmentation recipe decodes the whole image
_SCALED = (
    "it keeps every pixel of the image; with an image_size at most half a JPEG's sides it is "
    "decoded at libjpeg's DCT scale 1/2, 1/4 or 1/8 before the resize"
)
_WHOLE_DECODE = {
    "segmentation train": "its random resize scales the whole image before the crop, so a "
    "region decoded alone and resized would not give the same pixels",
    "detection ssdlite": "its IoU crop is drawn inside torchvision's op, from the boxes; "
    "dlpipe does not draw it before the decode yet",
    "detection ssd": "its zoom-out pads the image before the crop",
    "detection hflip": _SCALED,
    "detection train": _SCALED,
    "detection eval": _SCALED,
}


def crop_verdict(recipe: str) -> str:
    """Whether crop-aware decode applies to a detection or segmentation `recipe` (``"task
    recipe"``; empty for classification's, whose train crop decodes only its box)."""
    if not recipe:
        return ""
    why = _WHOLE_DECODE.get(recipe, "it keeps every pixel of the image")
    return (
        f"; crop-aware decode does not apply to the {recipe} recipe ({why}): the whole "
        "image is decoded"
    )


def decode_verdict(trials: list[Trial]) -> str:
    """Why the GPU or the CPU decodes (empty when GPU decode was not measured)."""
    measured = [t for t in trials if not t.skipped]
    gpu = [t for t in measured if t.settings.decode == "cuda"]
    if not gpu:
        return ""
    cpu = max((t for t in measured if t.settings.decode == "cpu"), key=lambda t: t.samples_per_s)
    fast = max(gpu, key=lambda t: t.samples_per_s)
    ratio = fast.samples_per_s / max(cpu.samples_per_s, 1e-9)
    kept = "GPU decode kept" if ratio > 1 else "CPU decode kept"
    return (
        f"; {kept}: decoding each batch on the GPU gave {fast.samples_per_s:.0f} samples/s, "
        f"{ratio:.2f}x the {cpu.samples_per_s:.0f} of decoding in the workers"
    )


def verdict(stages: StageRates, best: Trial, cores: int, image_size: int | None) -> tuple[str, str]:
    """(bottleneck, advice in plain words); `image_size` None: images keep their sizes."""
    costs = stages.costs()
    total = sum(costs.values())
    stage = max(costs, key=lambda k: costs[k])
    share = 100 * costs[stage] / total
    single = stages.collate
    rate = f"{best.samples_per_s:.0f} samples/s with {best.describe()}"
    if stage == "read":
        advice = (
            f"I/O-bound: reading is {share:.0f}% of the per-sample time "
            f"({stages.read_mb_per_s:.0f} MB/s on one process); move the data to local "
            "NVMe (DLPIPE_DATA_DIR) or give the loader more workers"
        )
    elif stage == "decode":
        advice = (
            f"decode-bound: decoding is {share:.0f}% of the per-sample time; re-convert "
            f"with --max-side {max(2 * (image_size or 400), 160)} to store smaller images"
        )
        if stages.crop_decode and region_library() is None:
            advice += f", or {INSTALL_HINT}"
        elif stages.crop_decode and stages.seekable_share < 0.5:
            advice += (
                ", or re-convert with --seekable-jpeg so that train crops entropy-decode only "
                "their box (the same pixels, about 12 % less CPU a sample on ImageNet-sized "
                "photos)"
            )
    elif stage == "transform":
        advice = (
            f"transform-bound: crop and resize are {share:.0f}% of the per-sample time; "
            "a smaller --image-size, or augmentation on the GPU, would help"
        )
    else:
        advice = f"collate-bound: batching is {share:.0f}% of the per-sample time"
    if best.samples_per_s < 0.7 * single * cores and best.settings.num_workers >= cores:
        advice += (
            f"; the loader reaches {rate}, {best.samples_per_s / (single * cores):.0%} of "
            f"{cores} cores x one process's {single:.0f} samples/s"
        )
    return stage, f"{advice} (best: {rate})"
