"""Antialiased bilinear resizing of many images of different sizes at once, as matrix products.

torch's ``interpolate(mode="bilinear", antialias=True)`` resizes one input size per call, so
the device decoder (`dlpipe.loading.device_decode`), whose crops all differ in size, paid
several kernel launches per image, each too small to fill a GPU. A resize along one axis is a
linear map, so here each image's is a matrix whose row o holds the weights torch's kernel gives
output pixel o over the input pixels (the same triangle filter widened by the scale, the same
integer support window, each row normalised), and a whole batch resizes in two batched matrix
products over the images stacked zero-padded: ``out = Wy @ X @ Wxᵀ``. A window kept after the
resize (the eval recipe's centre crop) and a horizontal flip fold into the matrices: rows for
the kept output pixels only, the column matrix's rows reversed.

The products run in float32 (a few kernels per chunk of images whatever their sizes); the
result matches ``interpolate`` on the same float input to float rounding (a test holds them
within 2e-3 of 255). Where the caller lets CUDA matrix products use TF32
(``torch.backends.cuda.matmul.allow_tf32``), the weights keep 10 bits of mantissa and a
rounded pixel can differ by one. Images go through in chunks of at most `CHUNK_BYTES` of
padded input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CHUNK_BYTES", "antialias_weights", "resize_many"]

CHUNK_BYTES = 128 << 20  # padded float32 input per chunk of images


def antialias_weights(
    axes: torch.Tensor, flips: torch.Tensor, count: int, length: int
) -> torch.Tensor:
    """The resize matrices of one axis for a batch of images.

    Args:
        axes: int64 (B, 3) on the target device: per image the resize's input extent, its
            output extent, and the first output pixel kept.
        flips: bool (B,): the kept output pixels in reverse order.
        count: output pixels kept per image.
        length: input pixels per row of the result (at least every input extent).

    Returns:
        float32 (B, count, length): row o of image b weighs output pixel ``first + o`` (or
        ``first + count - 1 - o`` flipped) over the input pixels, as torch's antialiased
        bilinear kernel does (zero past the image's input extent).
    """
    sizes = axes.to(torch.float32)
    source, target, first = (sizes[:, k, None, None] for k in range(3))
    scale = source / target
    support = torch.where(scale >= 1, scale, 1.0)  # bilinear: half its 2-pixel width, scaled
    inverse = torch.where(scale >= 1, 1.0 / scale, 1.0)
    out = torch.arange(count, device=axes.device, dtype=torch.float32)[None, :, None]
    out = torch.where(flips[:, None, None], count - 1 - out, out)
    centre = scale * (out + first + 0.5)
    low = (centre - support + 0.5).trunc().clamp(min=0)
    high = torch.minimum((centre + support + 0.5).trunc(), source)
    pixel = torch.arange(length, device=axes.device, dtype=torch.float32)[None, None, :]
    weights = (1.0 - ((pixel - centre + 0.5) * inverse).abs()).clamp(min=0)
    weights = torch.where((pixel >= low) & (pixel < high), weights, 0.0)
    return weights / weights.sum(-1, keepdim=True)


def resize_many(
    images: Sequence[torch.Tensor],
    rows: torch.Tensor,
    cols: torch.Tensor,
    flips: torch.Tensor,
    size: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Each image resized (bilinear, antialiased), the kept window cut, flipped where asked.

    Args:
        images: (C, h, w) tensors of any dtype on one device, the resizes' inputs (a crop's
            view, or a whole image).
        rows, cols: int64 (B, 3): per image and axis (input extent, output extent, first
            output pixel kept), as `antialias_weights` takes them.
        flips: bool (B,): flip horizontally.
        size: output pixels kept along each axis.
        chunk_bytes: the padded float32 input resized per chunk of images, at most.

    Returns:
        float32 (B, C, size, size) on the images' device, not rounded.
    """
    device = images[0].device
    rows, cols, flips = rows.to(device), cols.to(device), flips.to(device)
    channels = images[0].shape[0]
    out = torch.empty((len(images), channels, size, size), dtype=torch.float32, device=device)
    for part, height, width in _chunks(images, chunk_bytes):
        chunk = images[part]
        stacked = torch.zeros(
            (len(chunk), channels, height, width), dtype=torch.float32, device=device
        )
        for k, image in enumerate(chunk):
            stacked[k, :, : image.shape[-2], : image.shape[-1]] = image
        across = antialias_weights(cols[part], flips[part], size, width)
        down = antialias_weights(rows[part], torch.zeros_like(flips[part]), size, height)
        narrowed = stacked @ across.transpose(1, 2)[:, None]  # (b, C, height, size)
        out[part] = down[:, None] @ narrowed
    return out


def _chunks(images: Sequence[torch.Tensor], chunk_bytes: int) -> list[tuple[slice, int, int]]:
    """Consecutive runs of images whose zero-padded float32 stack stays within `chunk_bytes`
    (an image larger than that alone), each with the height and width it pads to."""
    found: list[tuple[slice, int, int]] = []
    start = 0
    while start < len(images):
        height = width = 0
        end = start
        while end < len(images):
            h = max(height, images[end].shape[-2])
            w = max(width, images[end].shape[-1])
            if end > start and (end - start + 1) * images[end].shape[0] * h * w * 4 > chunk_bytes:
                break
            height, width, end = h, w, end + 1
        found.append((slice(start, end), height, width))
        start = end
    return found
