"""`BenchLoaderConfig`: everything ``dlpipe bench-loader`` takes, one option per field.

The options that say what the batches are (``batch_size``, ``transform``, ``image_size``,
``base_size``, ``min_crop_scale``) make the one `LoaderConfig` ``dlpipe train`` builds from the
same values (`dlpipe.tune_command`), so the saved profile is found by the training run it was
measured for.
Plain data: importing it imports neither torch nor the loading room.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlpipe.options import (
    Checked,
    area_share,
    non_negative_int,
    option,
    positive_float,
    positive_int,
)

__all__ = ["CONFIG_SUFFIX", "BenchLoaderConfig"]

CONFIG_SUFFIX = ".bench-loader.toml"
"""The resolved options are written beside the saved profile, named after it with this suffix
(``dlpipe-profiles.bench-loader.toml`` in the dataset folder, or in the user cache)."""


@dataclass(frozen=True, kw_only=True)
class BenchLoaderConfig(Checked):
    """Everything ``dlpipe bench-loader`` takes (its flags, ``--config`` keys and resolved
    file); the command turns it into the tuner's `BenchConfig` and its `LoaderConfig`."""

    data: str = option("dataset folder or URL", flag="data")
    split: str = option("the split measured", default="train")
    batch_size: int = option("samples per batch", default=64, parse=positive_int)
    transform: str = option(
        "the recipe (auto: train for the train split, else eval; detection also has hflip, "
        "ssd and ssdlite)",
        default="auto",
        choices=("auto", "train", "eval", "hflip", "ssd", "ssdlite"),
    )
    image_size: int | None = option(
        "the side of the batches' images (default: the task's: 224 for classification, 480 "
        "for segmentation; detection images keep their sizes)",
        default=None,
        parse=positive_int,
    )
    base_size: int | None = option(
        "segmentation: the side the eval recipe resizes to (default: image size x 520/480)",
        default=None,
        parse=positive_int,
    )
    min_crop_scale: float = option(
        "smallest train crop's area share, as dlpipe train's --min-crop-scale",
        default=0.08,
        parse=area_share,
    )
    budget: float = option("seconds for the whole search", default=60.0, parse=positive_float)
    max_workers: int | None = option(
        "largest num_workers tried (2x cores)", default=None, parse=non_negative_int
    )
    device: str = option(
        "where batches go (cuda also tries pin_memory and decoding on the GPU)",
        default="cpu",
        choices=("cpu", "cuda"),
    )
    json: bool = option("print the report as JSON", default=False)
    plot: str | None = option("write a PNG of samples/s per trial here", default=None)
    save: bool = option(
        f"save the winning profile, and these options beside it (*{CONFIG_SUFFIX})", default=True
    )
