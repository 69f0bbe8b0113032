"""The TurboJPEG 3 library (libjpeg-turbo 3), bound through ctypes where one is installed.

Two things use it: train crops decode only their box's region (`dlpipe.loading.jpeg_region`),
and ``dlpipe convert --seekable-jpeg`` rewrites JPEGs losslessly with a restart marker after
every MCU (`dlpipe.jpeg_seek`). Both are optional: without the library a crop decodes the
whole image through simplejpeg, and convert refuses the switch, naming the install.

The library comes from a pip install where one exists: the ``turbojpeg`` wheel (``pip install
'dlpipe[jpeg-region]'``: Linux x86-64, macOS, Windows) bundles libjpeg-turbo 3; otherwise a
system ``libturbojpeg`` that exports the version 3 API (Homebrew, conda-forge, recent Linux
distributions). Debian 12's libturbojpeg 2.1 has no cropping region, so it is not used.
Set ``DLPIPE_JPEG_REGION=0`` to turn it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import threading
from pathlib import Path

__all__ = [
    "INSTALL_HINT",
    "REGION_ENV",
    "Region",
    "Scaling",
    "Transform",
    "read_header",
    "region_library",
    "thread_handle",
]

REGION_ENV = "DLPIPE_JPEG_REGION"
INSTALL_HINT = (  # what bench-loader and doctor tell a machine without the library
    "pip install 'dlpipe[jpeg-region]' (or a system libturbojpeg 3) so that train crops "
    "decode only the box's region: the same pixels, 5-12 % less CPU per sample measured on "
    "ImageNet-sized photos"
)

# turbojpeg.h (libjpeg-turbo 3): enum TJINIT, TJPARAM, TJCS values, tjMCUWidth per TJSAMP
INIT_DECOMPRESS, INIT_TRANSFORM = 1, 2
STOPONWARNING, SUBSAMP, JPEGWIDTH, JPEGHEIGHT, PRECISION, COLORSPACE = 0, 4, 5, 6, 7, 8
OPTIMIZE, PROGRESSIVE, ARITHMETIC, LOSSLESS = 11, 12, 14, 15
CS_YCBCR, CS_GRAY = 1, 2
MCU = {0: (8, 8), 1: (16, 8), 2: (16, 16), 3: (8, 8), 4: (8, 16), 5: (32, 8), 6: (8, 32)}
# ^ tjMCUWidth, tjMCUHeight per TJSAMP: 444 422 420 GRAY 440 411 441


class Scaling(ctypes.Structure):
    """tjscalingfactor"""

    _fields_ = [("num", ctypes.c_int), ("denom", ctypes.c_int)]


class Region(ctypes.Structure):
    """tjregion"""

    _fields_ = [("x", ctypes.c_int), ("y", ctypes.c_int), ("w", ctypes.c_int), ("h", ctypes.c_int)]


class Transform(ctypes.Structure):
    """tjtransform (no custom filter)"""

    _fields_ = [
        ("r", Region),
        ("op", ctypes.c_int),
        ("options", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("customFilter", ctypes.c_void_p),
    ]


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
    lib.tj3SetScalingFactor.argtypes = [ctypes.c_void_p, Scaling]
    lib.tj3SetCroppingRegion.argtypes = [ctypes.c_void_p, Region]
    buffer, size, pointer, number = ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
    lib.tj3Decompress8.argtypes = [pointer, buffer, size, pointer, number, number]
    lib.tj3Transform.argtypes = [
        pointer,
        buffer,
        size,
        number,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(Transform),
    ]
    lib.tj3Free.restype, lib.tj3Free.argtypes = None, [ctypes.c_void_p]
    return lib


_lock = threading.Lock()
_library: list[ctypes.CDLL | None] = []  # [] until looked up once per process


def _fresh_lock() -> None:
    """A forked child's own lock (a parent thread may hold it at the fork)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)


def region_library() -> ctypes.CDLL | None:
    """The TurboJPEG 3 library this process uses, or None (not installed, a 2.x library
    only, or ``DLPIPE_JPEG_REGION=0``)."""
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
    """One TurboJPEG instance (not thread-safe: one per thread and kind)."""

    def __init__(self, lib: ctypes.CDLL, kind: int) -> None:
        self.lib, self.pointer = lib, lib.tj3Init(kind)
        if self.pointer:
            lib.tj3Set(self.pointer, STOPONWARNING, 1)

    def __del__(self) -> None:
        if self.pointer:
            self.lib.tj3Destroy(self.pointer)


_local = threading.local()


def thread_handle(lib: ctypes.CDLL, kind: int) -> int | None:
    """This thread's TurboJPEG instance of `kind` (`INIT_DECOMPRESS` or `INIT_TRANSFORM`)."""
    handles: dict[int, _Handle] = _local.__dict__.setdefault("handles", {})
    handle = handles.get(kind)
    if handle is None or handle.lib is not lib:
        handle = handles[kind] = _Handle(lib, kind)
    return handle.pointer


def read_header(
    lib: ctypes.CDLL, pointer: int | None, data: bytes
) -> tuple[int, int, tuple[int, int]] | None:
    """(width, height, MCU size in pixels) of a JPEG this library takes: 8-bit, lossy, YCbCr
    or greyscale, a subsampling it names; None for anything else or a header it refuses."""
    if not pointer or lib.tj3DecompressHeader(pointer, data, len(data)) != 0:
        return None
    mcu = MCU.get(lib.tj3Get(pointer, SUBSAMP))
    if (
        mcu is None
        or lib.tj3Get(pointer, PRECISION) != 8
        or lib.tj3Get(pointer, LOSSLESS) != 0
        or lib.tj3Get(pointer, COLORSPACE) not in (CS_YCBCR, CS_GRAY)
    ):
        return None
    return lib.tj3Get(pointer, JPEGWIDTH), lib.tj3Get(pointer, JPEGHEIGHT), mcu


def drop_thread_handle(kind: int) -> None:
    """Forget this thread's instance of `kind`: a refused header can leave it unusable."""
    _local.__dict__.get("handles", {}).pop(kind, None)
