"""Peer loaders for ``benchmarks/loader.py``: FFCV and NVIDIA DALI's CPU pipeline.

Both give what every other contender of the loader benchmark gives, read from the same JPEG
corpus folder (ImageFolder layout, ``root/<class>/<file>.jpg``, labels = index of the class
folder in sorted order, as torchvision's ``ImageFolder``): RandomResizedCrop(224) with scale
(0.08, 1) and ratio (3/4, 4/3), a horizontal flip with probability 0.5, uint8 batches of shape
(64, 3, 224, 224) (contiguous NCHW; FFCV's own recipe: channels-last memory, as dlpipe's) and
int64 labels of shape (64,), in a random order, full batches only, epoch after epoch.

- **FFCV** (``ffcv_loader``): the corpus is written once to a ``.beton`` file whose image field
  holds each original JPEG file byte for byte (no decode, no re-encode, no resize), then read
  by ``ffcv.loader.Loader`` with ``RandomResizedCropRGBImageDecoder`` (libjpeg-turbo decode of
  the whole image, then OpenCV crop + resize), ``RandomHorizontalFlip``, ``ToTensor`` and
  ``ToTorchImage(channels_last=False)``; ``workers`` threads (numba), order RANDOM,
  ``os_cache=True``, ``drop_last=True``.
- **FFCV, its own recipe** (``ffcv_recipe_loader``): what FFCV's ImageNet example
  (``libffcv/ffcv-imagenet``: ``write_imagenet.py`` through ``./write_dataset.sh 400 0.10 90``,
  and ``train_imagenet.py``'s ``create_train_loader``) does, with uint8 output on the CPU: the
  .beton written from torchvision's ``ImageFolder`` with ``RGBImageField(write_mode=
  "proportion", max_resolution=400, compress_probability=0.10, jpeg_quality=90)`` (each image
  shrunk to at most 400 px a side, then 90 % stored as raw RGB pixels and 10 % re-encoded as
  quality-90 JPEGs), read with order ``QUASI_RANDOM`` (its choice when not distributed),
  ``os_cache=True`` (``in_memory=1``), ``drop_last=True``, ``batches_ahead=3`` (the default)
  and the pipeline ``RandomResizedCropRGBImageDecoder`` → ``RandomHorizontalFlip`` →
  ``ToTensor`` → ``ToTorchImage()`` (channels-last memory, as dlpipe's batches), leaving out
  only ``ToDevice`` and ``NormalizeImage`` (the GPU's part). Its batches differ from the
  others' in what they start from: images of at most 400 px a side.
- **DALI** (``dali_loader``): a CPU-only pipeline (``device_id=None``): ``fn.readers.file``
  over the ImageFolder's files and labels (global reshuffle every epoch),
  ``fn.decoders.image_random_crop(device="cpu")`` (libjpeg-turbo decode of the crop window
  only), ``fn.resize`` (bilinear, antialiased) and ``fn.crop_mirror_normalize`` (horizontal
  flip on a ``fn.random.coin_flip``, HWC to CHW, uint8), with ``workers`` threads, iterated by
  ``nvidia.dali.plugin.pytorch.DALIGenericIterator`` (partial last batch dropped).

How the outputs differ from torchvision's ``RandomResizedCrop(224)`` + ``RandomHorizontalFlip``
(same crop and flip parameters; the pixels differ a little):

- FFCV samples crops with a copy of torchvision's algorithm (area uniform, aspect ratio
  log-uniform, 10 attempts, centred fallback) but resizes with OpenCV's ``INTER_AREA`` (a box
  filter when shrinking) instead of bilinear, after a libjpeg-turbo decode with the fast
  integer IDCT (``TJFLAG_FASTDCT``). Measured on 40 corpus images, whole frame to 224 x 224:
  decode differs from Pillow's by 1.0 on average (at most 6), decode + resize by 2.7.
  Its batches live in buffers that FFCV reuses a few batches later: copy a batch to keep it.
- DALI's crop generator draws the same way, but its fallback (after 10 misses, rare for
  photo-like aspect ratios) clamps the whole frame to the ratio range at a random anchor
  rather than a centred crop. Its decode equals Pillow's; decode + resize differs by 0.2
  on average. Its file order is reshuffled every epoch from a fixed seed (the same
  sequence of orders in every run); crops and flips follow the pipeline's random seed.

Install (Debian 12, Python 3.11, torch 2.14.1 left unchanged by both; a venv of its own beside
dlpipe's works too: a ``.pth`` file that ``site.addsitedir``-s dlpipe's venv lends it torch and
dlpipe, and ``pip install wheel setuptools`` first lets ``--no-build-isolation`` build)::

    pip install nvidia-dali-cuda130        # DALI 2.4.0; CPU pipelines need no GPU or driver

    apt-get install -y --no-install-recommends libturbojpeg0-dev libopencv-dev pkg-config
    pip install --no-build-isolation ffcv==1.0.2   # builds ffcv._libffcv; pulls numba,
                                                   # opencv-python, pytorch-pfn-extras, ...

``nvidia-dali-cuda130`` pins ``packaging<=26.3`` (it downgraded 26.4 here). ``ffcv`` 1.0.2 has
no wheel: pip builds it from the sdist, whose ``setup.py`` needs the ``opencv4`` and
``libturbojpeg`` pkg-config entries from the apt packages above.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)

__all__ = [
    "FFCV_RECIPE",
    "dali_available",
    "dali_loader",
    "ffcv_available",
    "ffcv_loader",
    "ffcv_recipe_loader",
]

# FFCV's ImageNet example's write settings (``./write_dataset.sh 400 0.10 90``)
FFCV_RECIPE = {
    "write_mode": "proportion",
    "max_resolution": 400,
    "compress_probability": 0.10,
    "jpeg_quality": 90,
}


# ----------------------------------------------------------------------------------- common


def _samples(corpus_root: str) -> list[tuple[str, int]]:
    """(path, label) of every image, as torchvision's ImageFolder lists them."""
    from torchvision.datasets import ImageFolder

    return list(ImageFolder(corpus_root).samples)


def _reason(package: str, exc: BaseException) -> str:
    """One line on why `package` cannot be used, from the exception its import raised."""
    if isinstance(exc, ModuleNotFoundError) and exc.name in (package, package.split(".")[0]):
        return f"{package} is not installed (see benchmarks/peers.py for how to install it)"
    detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return f"{package} does not import here: {detail}"


# ----------------------------------------------------------------------------------- FFCV


def ffcv_available() -> str | None:
    """Whether FFCV can be used here.

    Returns:
        None when ``ffcv`` and its compiled ``_libffcv`` import, else a one-line reason.
    """
    try:  # ffcv.libffcv loads the compiled extension (ctypes); the loader needs numba
        for module in ("ffcv.libffcv", "ffcv.loader", "ffcv.fields.decoders"):
            importlib.import_module(module)
    except Exception as exc:
        return _reason("ffcv", exc)
    return None


def _store_jpeg(destination: Any, value: tuple[bytes, int, int], malloc: Any) -> None:
    """``RGBImageField.encode`` for a JPEG file kept as-is: ``value`` = (bytes, width, height).

    Writes what FFCV's own ``jpg`` mode writes (mode, width, height, pointer to the JPEG
    bytes), minus its decode-and-re-encode with OpenCV.
    """
    import numpy as np
    from ffcv.fields.rgb_image import IMAGE_MODES

    data, width, height = value
    destination["mode"] = IMAGE_MODES["jpg"]
    destination["width"], destination["height"] = width, height
    destination["data_ptr"], storage = malloc(len(data))
    storage[:] = np.frombuffer(data, dtype=np.uint8)


def _jpeg_field() -> Any:
    """An FFCV ``RGBImageField`` whose ``encode`` is `_store_jpeg`.

    Set on the instance, not in a subclass, so the .beton records a plain ``RGBImageField``
    (any FFCV loader reads it, no ``custom_fields``), and the field still pickles for the
    writer's processes whatever their start method (`_store_jpeg` is module-level).
    """
    from ffcv.fields import RGBImageField

    field = RGBImageField(write_mode="jpg")
    field.encode = _store_jpeg
    return field


class _JpegFiles:
    """Indexable (JPEG bytes, width, height), label: what ``DatasetWriter`` reads."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[tuple[bytes, int, int], int]:
        from PIL import Image

        path, label = self.samples[index]
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(path) as image:  # reads the header only
            width, height = image.size
        return (data, width, height), label


def _beton(samples: list[tuple[str, int]], work_dir: str, recipe: bool = False) -> str:
    """The .beton of `samples` in `work_dir`, written once (named by a hash of the file list):
    the JPEG files as they are, or (`recipe`) written as FFCV's ImageNet example writes."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter
    from torchvision.datasets import ImageFolder

    key = hashlib.sha1(b"recipe" if recipe else b"")
    for path, label in samples:
        stat = os.stat(path)
        key.update(f"{path}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    kind = "recipe-" if recipe else ""
    path = os.path.join(work_dir, f"ffcv-{kind}{key.hexdigest()[:16]}.beton")
    if os.path.exists(path):
        return path
    os.makedirs(work_dir, exist_ok=True)
    image = RGBImageField(**FFCV_RECIPE) if recipe else _jpeg_field()
    partial = f"{path}.partial-{os.getpid()}"
    writer = DatasetWriter(
        partial,
        {"image": image, "label": IntField()},
        num_workers=min(4, os.cpu_count() or 1),  # processes; a one-off, not timed
    )
    root = os.path.dirname(os.path.dirname(samples[0][0]))
    writer.from_indexed_dataset(ImageFolder(root) if recipe else _JpegFiles(samples))
    os.replace(partial, path)
    return path


def ffcv_loader(
    corpus_root: str, work_dir: str, workers: int, batch_size: int = 64, size: int = 224
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """FFCV's loader over the corpus, with the benchmark's train transform.

    The first call writes ``work_dir/ffcv-<hash>.beton`` (the hash covers every file's path,
    label, size and mtime, so a changed corpus gets a new file); later calls reuse it. The
    .beton stores each original JPEG file byte for byte (FFCV's ``jpg`` mode with the encode
    step replaced by a copy): no re-encoding, no resizing, so FFCV decodes exactly the bytes
    the other contenders read from the files.

    Args:
        corpus_root: ImageFolder-layout folder of JPEGs (``root/<class>/<file>.jpg``).
        work_dir: Folder for the .beton (made if missing).
        workers: FFCV's ``num_workers``: threads that decode and transform batches (at
            least 1; 0 gives 1).
        batch_size: Samples per batch.
        size: Side of the square crop.

    Returns:
        An ``ffcv.loader.Loader``; each pass over it is one epoch (random order, last partial
        batch dropped) of ``(uint8 (batch_size, 3, size, size), int64 (batch_size,))``. The
        tensors sit in buffers FFCV reuses a few batches later.
    """
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    path = _beton(_samples(corpus_root), work_dir)
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=max(1, workers),
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=True,
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((size, size), scale=SCALE, ratio=RATIO),
                RandomHorizontalFlip(0.5),
                ToTensor(),
                ToTorchImage(channels_last=False),
            ],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )


def ffcv_recipe_loader(
    corpus_root: str, work_dir: str, workers: int, batch_size: int = 64, size: int = 224
) -> Any:
    """FFCV's loader as FFCV's ImageNet example sets it up, with uint8 output on the CPU.

    The first call writes ``work_dir/ffcv-<hash>.beton`` with `FFCV_RECIPE` (the module's
    docstring: at most 400 px a side, 90 % raw pixels, 10 % quality-90 JPEGs); later calls
    reuse it.

    Args:
        corpus_root: ImageFolder-layout folder of JPEGs (``root/<class>/<file>.jpg``).
        work_dir: Folder for the .beton (made if missing).
        workers: FFCV's ``num_workers`` threads (at least 1).
        batch_size: Samples per batch.
        size: Side of the square crop.

    Returns:
        An ``ffcv.loader.Loader``; each pass is one epoch (order QUASI_RANDOM, last partial
        batch dropped) of ``(uint8 (batch_size, 3, size, size) channels-last,
        int64 (batch_size,))``, in buffers FFCV reuses a few batches later.
    """
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.decoders import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor, ToTorchImage

    path = _beton(_samples(corpus_root), work_dir, recipe=True)
    return Loader(
        path,
        batch_size=batch_size,
        num_workers=max(1, workers),
        order=OrderOption.QUASI_RANDOM,
        os_cache=True,
        drop_last=True,
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((size, size)),
                RandomHorizontalFlip(),
                ToTensor(),
                ToTorchImage(),
            ],
            "label": [IntDecoder(), ToTensor(), Squeeze()],
        },
    )


# ----------------------------------------------------------------------------------- DALI


def dali_available() -> str | None:
    """Whether DALI's CPU pipelines can be used here.

    Returns:
        None when ``nvidia.dali`` and its PyTorch plugin import, else a one-line reason.
    """
    try:
        for module in ("nvidia.dali.fn", "nvidia.dali.plugin.pytorch"):
            importlib.import_module(module)
    except Exception as exc:
        return _reason("nvidia.dali", exc)
    return None


class _DaliEpochs:
    """Iterable over DALIGenericIterator epochs, yielding (images, int64 labels)."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def __len__(self) -> int:
        return len(self.iterator)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for (batch,) in self.iterator:  # one pipeline: a list of one dict
            yield batch["images"], batch["labels"].view(-1).to(torch.int64)


def dali_loader(
    corpus_root: str, workers: int, batch_size: int = 64, size: int = 224
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """DALI's CPU pipeline over the corpus, with the benchmark's train transform.

    Args:
        corpus_root: ImageFolder-layout folder of JPEGs (``root/<class>/<file>.jpg``).
        workers: The pipeline's ``num_threads`` (at least 1; 0 gives 1).
        batch_size: Samples per batch.
        size: Side of the square crop.

    Returns:
        An iterable; each pass over it is one epoch (files reshuffled every epoch, last
        partial batch dropped) of ``(uint8 (batch_size, 3, size, size), int64 (batch_size,))``
        CPU tensors.
    """
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    samples = _samples(corpus_root)
    pipe = Pipeline(batch_size=batch_size, num_threads=max(1, workers), device_id=None)
    with pipe:
        jpegs, labels = fn.readers.file(
            files=[path for path, _ in samples],
            labels=[label for _, label in samples],
            shuffle_after_epoch=True,
            name="reader",
        )
        crops = fn.decoders.image_random_crop(
            jpegs,
            device="cpu",
            output_type=types.DALIImageType.RGB,
            random_area=list(SCALE),
            random_aspect_ratio=list(RATIO),
            num_attempts=10,
        )
        resized: Any = fn.resize(  # one output (no save_attrs)
            crops,
            resize_x=size,
            resize_y=size,
            interp_type=types.DALIInterpType.INTERP_LINEAR,
            antialias=True,
        )
        images = fn.crop_mirror_normalize(
            resized,
            dtype=types.DALIDataType.UINT8,
            output_layout="CHW",
            mirror=fn.random.coin_flip(probability=0.5),
        )
        pipe.set_outputs(images, labels)
    pipe.build()
    iterator = DALIGenericIterator(
        pipe,
        ["images", "labels"],
        reader_name="reader",
        last_batch_policy=LastBatchPolicy.DROP,
        auto_reset=True,
    )
    return _DaliEpochs(iterator)
