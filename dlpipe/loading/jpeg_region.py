"""Region-of-interest JPEG decoding: only the rows and columns a crop box needs.

libjpeg-turbo 3's TurboJPEG API decodes a cropping region (``tj3SetCroppingRegion``): it skips
the inverse DCT, upsampling and colour conversion of the iMCU columns left and right of the
region and of the rows above it, and stops after the region's last row; combined with DCT
scaling (``tj3SetScalingFactor``). This is what DALI's ``decoders.image_random_crop`` and
FFCV's ``RandomResizedCropRGBImageDecoder`` do. The entropy decoding of everything above the
region's last row is still paid (JPEG has no random access without restart markers), so the
saving is the region's complement of the pixel work, not of the file.

The library is `dlpipe.turbojpeg`'s (an optional install); without it this module answers None
and the caller decodes through simplejpeg as before (a tested fallback).

Untrusted input: only 8-bit, lossy, YCbCr or greyscale JPEGs whose header this library reads
as the caller's own header parse does (the same width and height, checked against the pixel
limit before this is called) are decoded here; any warning stops the decode
(``TJPARAM_STOPONWARNING``) and any refusal answers None, so the full path names the error.
"""

from __future__ import annotations

import ctypes

import numpy as np

from dlpipe import turbojpeg as tj

__all__ = ["decode_jpeg_region"]

_PF_RGB = 0


def decode_jpeg_region(
    data: bytes, size: tuple[int, int], factor: int, box: tuple[int, int, int, int]
) -> tuple[np.ndarray, int, int] | None:
    """The part of a JPEG decoded at DCT scale 1/`factor` that covers `box`.

    Args:
        data: the JPEG bytes (already checked against the pixel limit).
        size: the (width, height) the caller's header parse read; a library that reads
            another size is not trusted with the bytes.
        factor: the DCT scale divisor (1, 2, 4 or 8).
        box: (top, left, height, width) in the image decoded at that scale, inside it.

    Returns:
        (uint8 RGB array (rows, cols, 3), first row, first column): the array's pixel (0, 0)
        is the scaled image's pixel (first row, first column); the array covers `box` (and one
        iMCU more on the left, right and bottom, where the image goes on). None when no
        TurboJPEG 3 library is here or it does not decode these bytes (another colour space
        or precision, a lossless JPEG, a warning): the caller decodes in full.
    """
    lib = tj.region_library()
    if lib is None:
        return None
    decoded = _decode(lib, tj.thread_handle(lib, tj.INIT_DECOMPRESS), data, size, factor, box)
    if decoded is None:  # a refused header can leave the decompressor unusable: a fresh one
        tj.drop_thread_handle(tj.INIT_DECOMPRESS)
    return decoded


def _decode(
    lib: ctypes.CDLL,
    pointer: int | None,
    data: bytes,
    size: tuple[int, int],
    factor: int,
    box: tuple[int, int, int, int],
) -> tuple[np.ndarray, int, int] | None:
    header = tj.read_header(lib, pointer, data)
    if header is None or header[:2] != tuple(size):
        return None
    width, height, mcu = header
    top, left, rows, cols = box
    step, lines = -(-mcu[0] // factor), -(-mcu[1] // factor)  # the scaled iMCU
    # the region's left edge sits on an iMCU boundary (the library's rule), and the region
    # goes one iMCU past the box on the left, right and bottom where the image goes on, so the
    # upsampled chroma at the box's edges has the neighbours the full decode gives it
    first = max(left - left % step - step, 0)
    right = min(left + cols + step, -(-width // factor))
    bottom = min(top + rows + lines, -(-height // factor))
    if lib.tj3SetScalingFactor(pointer, tj.Scaling(1, factor)) != 0:
        return None
    region = tj.Region(first, top, right - first, bottom - top)
    if lib.tj3SetCroppingRegion(pointer, region) != 0:
        return None
    out = np.empty((region.h, region.w, 3), dtype=np.uint8)
    if lib.tj3Decompress8(pointer, data, len(data), out.ctypes.data, region.w * 3, _PF_RGB):
        return None
    return out, top, first
