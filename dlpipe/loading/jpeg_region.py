"""Region-of-interest JPEG decoding: only the rows and columns a crop box needs.

libjpeg-turbo 3's TurboJPEG API decodes a cropping region (``tj3SetCroppingRegion``): it skips
the inverse DCT, upsampling and colour conversion of the iMCU columns left and right of the
region and of the rows above it, and stops after the region's last row; combined with DCT
scaling (``tj3SetScalingFactor``). This is what DALI's ``decoders.image_random_crop`` and
FFCV's ``RandomResizedCropRGBImageDecoder`` do. The entropy decoding of everything above the
region's last row is still paid (JPEG has no random access without restart markers), so the
saving is the region's complement of the pixel work, not of the file.

The library comes from a pip install where one exists: the ``turbojpeg`` wheel (``pip install
'dlpipe[jpeg-region]'``: Linux x86-64, macOS, Windows) bundles libjpeg-turbo 3; otherwise a
system ``libturbojpeg`` that exports the version 3 API (Homebrew, conda-forge, recent Linux
distributions). Debian 12's libturbojpeg 2.1 has no cropping region, so without either this
module answers None and the caller decodes through simplejpeg as before (a tested fallback).
Set ``DLPIPE_JPEG_REGION=0`` to turn it off.

Untrusted input: only 8-bit, lossy, YCbCr or greyscale JPEGs whose header this library reads
as the caller's own header parse does (the same width and height, checked against the pixel
limit before this is called) are decoded here; any warning stops the decode
(``TJPARAM_STOPONWARNING``) and any refusal answers None, so the full path names the error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import threading
from pathlib import Path

import numpy as np

__all__ = ["INSTALL_HINT", "REGION_ENV", "decode_jpeg_region", "region_library"]

REGION_ENV = "DLPIPE_JPEG_REGION"
INSTALL_HINT = (  # what bench-loader and doctor tell a machine without the library
    "pip install 'dlpipe[jpeg-region]' (or a system libturbojpeg 3) so that train crops "
    "decode only the box's region: the same pixels, 5-12 % less CPU per sample measured on "
    "ImageNet-sized photos"
)

# turbojpeg.h (libjpeg-turbo 3): enum TJPARAM, TJCS and TJSAMP values, tjMCUWidth per TJSAMP
_INIT_DECOMPRESS = 1
_STOPONWARNING, _SUBSAMP, _JPEGWIDTH, _JPEGHEIGHT, _PRECISION, _COLORSPACE = 0, 4, 5, 6, 7, 8
_LOSSLESS = 15
_CS_YCBCR, _CS_GRAY = 1, 2
_PF_RGB = 0
_MCU = {0: (8, 8), 1: (16, 8), 2: (16, 16), 3: (8, 8), 4: (8, 16), 5: (32, 8), 6: (8, 32)}
# ^ tjMCUWidth, tjMCUHeight per TJSAMP: 444 422 420 GRAY 440 411 441


class _Scaling(ctypes.Structure):
    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class _Region(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


def _candidates() -> list[str]:
    """Library files to try, the pip-installed wheel's bundled copy first."""
    found: list[str] = []
    spec = importlib.util.find_spec("turbojpeg")
    if spec is not None and spec.origin and not spec.origin.endswith(".py"):
        module = Path(spec.origin)  # the wheel's extension module, linked to its bundled copy
        folders = ("turbojpeg.libs", "turbojpeg.dylibs", ".dylibs")  # auditwheel, delvewheel,
        for folder in (module.parent / name for name in folders):  # delocate's folders
            found += sorted(str(p) for p in folder.glob("*turbojpeg*"))
        found.append(str(module))  # dlsym through the module also finds its dependencies
    system = ctypes.util.find_library("turbojpeg")
    found += [system] if system else []
    return found


def _bind(path: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if not hasattr(lib, "tj3SetCroppingRegion"):  # libjpeg-turbo 2.x: no cropping region
        return None
    lib.tj3Init.restype, lib.tj3Init.argtypes = ctypes.c_void_p, [ctypes.c_int]
    lib.tj3Destroy.restype, lib.tj3Destroy.argtypes = None, [ctypes.c_void_p]
    lib.tj3Set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tj3Get.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.tj3DecompressHeader.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, _Scaling]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, _Region]
    buffer, size, pointer, number = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    lib.tj3Decompress8.argtypes = [pointer, buffer, size, pointer, number, number]
    return lib


_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # [] until looked up once per process


def region_library() -> ctypes.CDLL | None:
    """The TurboJPEG 3 library this process decodes regions with, or None (not installed, a
    2.x library only, or ``DLPIPE_JPEG_REGION=0``)."""
    if os.environ.get(REGION_ENV, "1") == "0":
        return None
    if _library:  # looked up already: no lock on the per-sample path
        return _library[0]
    with _lock:
        if not _library:
            bound = (_bind(path) for path in _candidates())
            _library.append(next((lib for lib in bound if lib is not None), None))
        return _library[0]


class _Handle:
    """One decompressor per thread (a TurboJPEG handle is not thread-safe)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib, self.pointer = lib, lib.tj3Init(_INIT_DECOMPRESS)
        if self.pointer:
            lib.tj3Set(self.pointer, _STOPONWARNING, 1)

    def __del__(self) -> None:
        if self.pointer:
            self.lib.tj3Destroy(self.pointer)


_local = threading.local()


def _handle(lib: ctypes.CDLL) -> _Handle:
    handle: _Handle | None = getattr(_local, "handle", None)
    if handle is None or handle.lib is not lib:
        handle = _local.handle = _Handle(lib)
    return handle


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
    lib = region_library()
    if lib is None:
        return None
    decoded = _decode(lib, _handle(lib).pointer, data, size, factor, box)
    if decoded is None:  # a refused header can leave the decompressor unusable: a fresh one
        _local.handle = None
    return decoded


def _decode(
    lib: ctypes.CDLL,
    pointer: int | None,
    data: bytes,
    size: tuple[int, int],
    factor: int,
    box: tuple[int, int, int, int],
) -> tuple[np.ndarray, int, int] | None:
    if not pointer or lib.tj3DecompressHeader(pointer, data, len(data)) != 0:
        return None
    width, height = lib.tj3Get(pointer, _JPEGWIDTH), lib.tj3Get(pointer, _JPEGHEIGHT)
    mcu = _MCU.get(lib.tj3Get(pointer, _SUBSAMP))
    if (
        (width, height) != tuple(size)
        or mcu is None
        or lib.tj3Get(pointer, _PRECISION) != 8
        or lib.tj3Get(pointer, _LOSSLESS) != 0
        or lib.tj3Get(pointer, _COLORSPACE) not in (_CS_YCBCR, _CS_GRAY)
    ):
        return None
    top, left, rows, cols = box
    step, lines = -(-mcu[0] // factor), -(-mcu[1] // factor)  # the scaled iMCU
    # the region's left edge sits on an iMCU boundary (the library's rule), and the region
    # goes one iMCU past the box on the left, right and bottom where the image goes on, so the
    # upsampled chroma at the box's edges has the neighbours the full decode gives it
    first = max(left - left % step - step, 0)
    right = min(left + cols + step, -(-width // factor))
    bottom = min(top + rows + lines, -(-height // factor))
    if lib.tj3SetScalingFactor(pointer, _Scaling(1, factor)) != 0:
        return None
    region = _Region(first, top, right - first, bottom - top)
    if lib.tj3SetCroppingRegion(pointer, region) != 0:
        return None
    out = np.empty((region.h, region.w, 3), dtype=np.uint8)
    if lib.tj3Decompress8(pointer, data, len(data), out.ctypes.data, region.w * 3, _PF_RGB):
        return None
    return out, top, first
