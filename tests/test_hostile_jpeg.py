"""Hostile JPEGs, written as an attacker would: a seekable JPEG whose restart index lies
consistently, and every subsampling and colour space libjpeg-turbo decodes.

1. A seekable JPEG (``convert --seekable-jpeg``) whose index is shifted by a whole cycle of
   eight restart numbers (eight empty intervals appended after the last MCU, the first entry
   swallowing nine intervals) decodes whole to the right pixels, yet its index names the wrong
   MCUs. Each entry point refuses or rebuilds it: the loader's crop (and the device plan) decode
   it whole, ``verify --decode`` names it, ``convert --seekable-jpeg`` rebuilds its index. Its
   neighbours (an interval holding two MCUs, one byte more or less, bytes after the end of
   image) are refused, or cut windows that decode exactly as the whole file does.
2. TurboJPEG's whole subsampling list (4:4:4, 4:2:2, 4:2:0, grey, 4:4:0, 4:1:1, 4:4:1) in
   YCbCr, grey and RGB, and CMYK/YCCK, goes through every transform path (the train crop with
   and without the region decoder, seekable, full, eval, the device plan on the CPU), and
   subsamplings no library writes (crafted by `dc_only_jpeg`) decode or are a named error.
"""

from __future__ import annotations

import functools
import io
import struct
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch
from conftest import write_dataset
from PIL import Image
from test_crop_decode import photo

import dlpipe
from dlpipe import jpeg_seek, turbojpeg
from dlpipe.cli import main
from dlpipe.codecs import jpeg_colorspace, jpeg_segments
from dlpipe.errors import FieldDecodeError
from dlpipe.jpeg_seek import (
    add_restart_markers,
    cut_window,
    has_index,
    index_problem,
    restart_layout,
    seek_window,
)
from dlpipe.loading import transforms as transforms_module
from dlpipe.loading.device_decode import (
    DeviceDecoder,
    EncodedImage,
    PlannedTransform,
    collate_planned,
)
from dlpipe.loading.transforms import ImageTransform, jpeg_header

needs_library = pytest.mark.skipif(
    turbojpeg.region_library() is None,
    reason="no TurboJPEG 3 here: pip install 'dlpipe[jpeg-region]'",
)
_INDEX_ID = b"dlpipe restart intervals\0"


DECODERS = ["region", "whole"]


def use_decoder(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on, the region decoder (the ``jpeg-region`` extra) or none: the install
    without the extra, simulated as tests/test_crop_decode.py does (seekable JPEGs are made
    before this: their rewrite needs the library)."""
    if decoder == "whole":
        monkeypatch.setattr(turbojpeg, "_library", [None])
    elif turbojpeg.region_library() is None:
        pytest.skip("no TurboJPEG 3 library here: pip install 'dlpipe[jpeg-region]'")


@pytest.fixture(params=DECODERS)
def jpeg_decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    use_decoder(request.param, monkeypatch)
    return str(request.param)


def pixels(data: bytes) -> np.ndarray:
    """Pillow's whole decode (lenient: libjpeg's warnings are not errors)."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


# --- 1. a seekable JPEG's index that lies consistently -----------------------------------------


def intervals(seekable: bytes) -> tuple[bytes, list[bytes]]:
    """The header (up to the entropy-coded data) and each restart interval's bytes."""
    layout = restart_layout(seekable)
    assert layout is not None
    pairs = zip(layout.starts.tolist(), layout.ends.tolist(), strict=True)
    return seekable[: layout.scan], [seekable[a:b] for a, b in pairs]


def assemble(head: bytes, parts: list[bytes], lengths: list[int] | None = None) -> bytes:
    """A seekable JPEG of `parts` joined by RST0..7 in turn, its index set to `lengths` (as
    many entries as the header's MCUs), default each part's length."""
    lengths = [len(part) for part in parts] if lengths is None else lengths
    at = head.index(_INDEX_ID) + len(_INDEX_ID)
    index = np.asarray(lengths, "<u2").tobytes()
    body = b"".join(
        (bytes([0xFF, 0xD0 + (k - 1) % 8]) if k else b"") + part for k, part in enumerate(parts)
    )
    return head[:at] + index + head[at + len(index) :] + body + b"\xff\xd9"


def shifted_by_cycles(seekable: bytes, cycles: int = 1, filler: bytes = b"") -> bytes:
    """The attack: 8 * `cycles` intervals of `filler` (empty: none) appended after the last
    MCU, and the index's first entry swallowing the first 8 * `cycles` + 1 intervals (restart
    markers numbered 0..7 in turn land where the index says), so entry k names the MCU
    k + 8 * `cycles`. Empty, it decodes whole exactly as `seekable` does (strictly: a decoder
    stops after the header's MCU count, and restart markers there are no warning)."""
    head, parts = intervals(seekable)
    skip = 8 * cycles
    lengths = [len(part) for part in parts]
    first = sum(lengths[: skip + 1]) + 2 * skip  # the swallowed intervals and their markers
    lying = [first, *lengths[skip + 1 :], *([len(filler)] * skip)]
    assert len(lying) == len(parts)
    return assemble(head, [*parts, *([filler] * skip)], lying)


ORIGINALS = {
    "4:2:0": lambda: photo(400, 300, seed=1),
    "4:4:4": lambda: photo(333, 217, seed=2, subsampling=0),
    "4:2:2": lambda: photo(256, 200, seed=3, subsampling=1),
    "greyscale": lambda: photo(300, 260, seed=4, mode="L"),
}


@functools.cache
def honest_and_lying(kind: str, cycles: int = 1) -> tuple[bytes, bytes]:
    honest = add_restart_markers(ORIGINALS[kind]())
    assert honest is not None and restart_layout(honest) is not None
    return honest, shifted_by_cycles(honest, cycles)


@needs_library
@pytest.mark.parametrize("cycles", [1, 2])
@pytest.mark.parametrize("kind", list(ORIGINALS))
def test_a_shifted_index_decodes_whole_correctly_and_is_refused(kind: str, cycles: int) -> None:
    honest, lying = honest_and_lying(kind, cycles)
    assert has_index(lying) and len(lying) == len(honest) + 16 * cycles
    whole = simplejpeg.decode_jpeg(honest)  # strict: any libjpeg warning raises
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(lying), whole)
    np.testing.assert_array_equal(pixels(lying), pixels(honest))
    assert restart_layout(lying) is None
    assert cut_window(lying, (100, 100, 50, 50)) is None  # the loader's crop: no window
    padded = shifted_by_cycles(honest, cycles, filler=b"\x00")  # no empty interval to tell
    np.testing.assert_array_equal(pixels(padded), pixels(honest))  # (lenient: extra bytes)
    assert restart_layout(padded) is None and cut_window(padded, (0, 0, 9, 9)) is None


@needs_library
def test_without_the_scan_proof_the_shifted_index_gives_wrong_crops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control: the attack is real, the test above can fail. With the check of
    the scan's markers switched off, the lying index is trusted and train crops go wrong."""
    honest = add_restart_markers(ORIGINALS["4:2:0"]())
    assert honest is not None
    lying = shifted_by_cycles(honest, filler=b"\x00")  # no interval is empty
    assert restart_layout(lying) is None
    monkeypatch.setattr(jpeg_seek, "_only_these_markers", lambda *args: True)
    assert restart_layout(lying) is not None
    transform = ImageTransform("train", 64, "jpg")
    worst = 0
    for index in range(12):
        got, _ = transform({"jpg": lying}, 0, index)
        want, _ = transform({"jpg": honest}, 0, index)
        worst = max(worst, int((got.int() - want.int()).abs().max()))
    assert worst > 100


@needs_library
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("kind", list(ORIGINALS))
def test_the_loaders_crop_of_a_shifted_index_is_the_honest_files(
    kind: str, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train crop, with and without the region decoder, gives the honest file's pixels:
    the lying file is decoded as a plain JPEG (no window is cut), never through its index."""
    honest, lying = honest_and_lying(kind)
    use_decoder(decoder, monkeypatch)
    windows: list[bool] = []
    real = transforms_module.cut_window

    def counted(data: bytes, *args: object) -> object:
        window = real(data, *args)  # type: ignore[arg-type]
        windows.append(data == lying and window is not None)
        return window

    monkeypatch.setattr(transforms_module, "cut_window", counted)
    transform = ImageTransform("train", 48, "jpg", min_scale=0.08)
    for index in range(10):
        got, _ = transform({"jpg": lying}, 1, index)
        want, _ = transform({"jpg": honest}, 1, index)
        assert torch.equal(got, want), index
    assert windows and not any(windows)
    planned = PlannedTransform(ImageTransform("train", 48, "jpg"))
    for index in range(4):  # the device plan sends the whole JPEG, not a window of it
        payload, _ = planned({"jpg": lying, "__key__": "k"}, 0, index)
        assert isinstance(payload, EncodedImage) and payload.data == lying


@needs_library
def test_a_loader_over_lying_indexes_gives_the_honest_batches(tmp_path: Path) -> None:
    """Through `make_loader` (the train transform in the loader's own path): a dataset of
    shifted indexes yields the batches of the same dataset with honest ones."""
    honest, lying = [], []
    for i, kind in enumerate(ORIGINALS):
        for cycles in (1, 2):
            pair = honest_and_lying(kind, cycles)
            for out, data in zip((honest, lying), pair, strict=True):
                out.append({"__key__": f"s{i}{cycles}", "jpg": data, "cls": str(i).encode()})

    def batches(name: str, samples: list[dict[str, object]]) -> list[torch.Tensor]:
        path = write_dataset(tmp_path / name, "lmdb", {"train": samples})
        config = dlpipe.LoaderConfig(batch_size=4, image_size=40, shuffle=True, seed=5)
        loader = dlpipe.make_loader(
            path, "train", config=config, workers=dlpipe.WorkerSettings(num_workers=0)
        )
        return [images for images, _ in loader]

    for got, want in zip(batches("lying", lying), batches("honest", honest), strict=True):
        assert torch.equal(got, want)


def damaged_kinds(honest: bytes) -> dict[str, bytes]:
    """Lies that keep the interval count: an interval with two MCUs (and a one-byte interval
    at the end to keep the count), one byte more, one byte less, bytes after the end."""
    head, parts = intervals(honest)
    return {
        "two MCUs in one interval": assemble(
            head, [*parts[:5], parts[5] + parts[6], *parts[7:], b"\x00"]
        ),
        "a byte more": assemble(head, [*parts[:3], parts[3] + b"\x00", *parts[4:]]),
        "a byte less": assemble(head, [*parts[:3], parts[3][:-1], *parts[4:]]),
        "bytes after the end": honest + b"trailing",
        "a marker inside the scan": assemble(
            head, [*parts[:2], parts[2] + b"\xff\xfe", *parts[3:]]
        ),
    }


@needs_library
def test_damaged_intervals_are_refused_or_cut_windows_that_decode_as_the_whole_file() -> None:
    """Whatever a window holds, it decodes to the whole file's pixels of the box (libjpeg's
    lenient whole decode: the same garbage), or it is refused (a warning: the loader then
    decodes the file whole); the crop never trusts an interval the decoder reads otherwise."""
    honest = add_restart_markers(photo(160, 96, seed=5))
    assert honest is not None
    rng = np.random.default_rng(0)
    for name, data in damaged_kinds(honest).items():
        layout = restart_layout(data)
        if layout is None:
            assert name in ("bytes after the end", "a marker inside the scan"), name
            assert index_problem(data) is not None
            continue
        with pytest.raises(ValueError):  # it does not decode whole without a warning
            simplejpeg.decode_jpeg(data)
        assert index_problem(data) is not None, name
        whole, agreed = pixels(data), 0
        for _ in range(40):
            h, w = int(rng.integers(1, 97)), int(rng.integers(1, 161))
            box = (int(rng.integers(0, 97 - h)), int(rng.integers(0, 161 - w)), h, w)
            window = seek_window(data, layout, box)
            if window is None:
                continue
            try:
                part = simplejpeg.decode_jpeg(window[0])
            except ValueError:
                continue  # refused: the loader decodes the whole file
            top, left = box[0] - window[2], box[1] - window[3]
            got = part[top : top + h, left : left + w]
            want = whole[box[0] : box[0] + h, box[1] : box[1] + w]
            np.testing.assert_array_equal(got, want, err_msg=name)
            agreed += 1
        assert agreed, name  # windows away from the damage are cut and decode


@needs_library
@pytest.mark.parametrize("decoder", DECODERS)
def test_damaged_seekable_jpegs_train_or_name_the_sample(
    decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = add_restart_markers(photo(160, 96, seed=5))
    assert honest is not None
    use_decoder(decoder, monkeypatch)
    transform = ImageTransform("train", 32, "jpg")
    full = ImageTransform("train", 32, "jpg", decode="full")
    for name, data in damaged_kinds(honest).items():
        for index in range(6):
            sample = {"jpg": data, "__key__": "bad"}
            try:
                got, _ = transform(sample, 0, index)
            except FieldDecodeError as exc:
                assert "sample 'bad' field 'jpg'" in str(exc)
                with pytest.raises(FieldDecodeError):  # as the whole decode names it
                    full(sample, 0, index)
                continue
            assert got.dtype == torch.uint8 and got.shape == (3, 32, 32), name


@needs_library
def test_convert_rebuilds_every_index_it_is_given(tmp_path: Path) -> None:
    """``convert --seekable-jpeg`` never keeps an index found in its input: the shifted one is
    rebuilt (the honest file's very bytes), one it cannot rebuild is stored without an index,
    an honest one comes out unchanged; without the switch, verify names the liars."""
    honest, lying = honest_and_lying("4:2:0")
    other = add_restart_markers(photo(200, 150, seed=9))
    assert other is not None
    damaged = damaged_kinds(other)["two MCUs in one interval"]
    raw = tmp_path / "raw"
    files = {"a/lying.jpg": lying, "a/honest.jpg": honest, "b/damaged.jpg": damaged}
    files["b/plain.jpg"] = photo(120, 90, seed=7)
    for name, data in files.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_bytes(data)
    cli = ["convert", str(raw), "--to", "wds", "--workers", "1"]
    assert main([*cli, "--out", str(tmp_path / "seekable"), "--seekable-jpeg"]) == 0
    stored = [bytes(s["jpg"]) for s in dlpipe.open_dataset(str(tmp_path / "seekable"), "train")]
    assert len(stored) == 4 and stored.count(honest) == 2  # the liar, rebuilt; the honest one
    assert all(restart_layout(data) is not None for data in stored if has_index(data))
    (kept,) = [data for data in stored if not has_index(data)]  # the one it cannot rebuild
    assert kept == damaged[:2] + damaged[4 + _u16(damaged, 4) :]
    np.testing.assert_array_equal(pixels(kept), pixels(damaged))
    assert sum(restart_layout(data) is not None for data in stored) == 3
    assert main(["verify", str(tmp_path / "seekable"), "--decode"]) == 0

    assert main([*cli, "--out", str(tmp_path / "as-is")]) == 0
    assert main(["verify", str(tmp_path / "as-is"), "--decode"]) == 1
    for name, data in files.items():  # the raw files are the user's: untouched
        assert (raw / name).read_bytes() == data


def _u16(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 2], "big")


@needs_library
@pytest.mark.parametrize("lie", ["shifted", "two MCUs in one interval", "a byte less"])
def test_verify_decode_names_a_lying_index(
    lie: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    honest, shifted = honest_and_lying("4:2:0")
    lying = shifted if lie == "shifted" else damaged_kinds(honest)[lie]
    good = [{"__key__": f"k{i}", "jpg": honest, "cls": b"0"} for i in range(3)]
    bad = {"__key__": "liar", "jpg": lying, "cls": b"1"}
    path = write_dataset(tmp_path / "ds", "wds", {"train": [*good, bad]})
    assert main(["verify", path]) == 0  # the bytes are what the manifest says
    capsys.readouterr()
    assert main(["verify", path, "--decode"]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out and "FAILED" in out
    (line,) = [line for line in out.splitlines() if "'liar'" in line]
    assert "field 'jpg'" in line and "index" in line and "--seekable-jpeg" in line
    clean = write_dataset(tmp_path / "clean", "wds", {"train": good})
    assert main(["verify", clean, "--decode"]) == 0


@needs_library
def test_an_honest_index_passes_the_verify_proof_for_every_kind() -> None:
    for kind in ORIGINALS:
        honest, _ = honest_and_lying(kind)
        assert index_problem(honest) is None, kind
    assert index_problem(photo(64, 48)) is None  # no index: nothing to prove


# --- 2. every subsampling and colour space libjpeg-turbo decodes --------------------------------

SUBSAMPLINGS = ["Y444", "Y422", "Y420", "GRAY", "Y440", "Y411", "Y441"]


def photo_pixels(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    rgb = pixels(photo(width, height, seed=seed, quality=98))
    if channels == 4:  # a CMYK picture: K from the darkness, CMY the rest
        k = 255 - rgb.max(axis=2, keepdims=True)
        return np.concatenate([255 - rgb - k, k], axis=2).astype(np.uint8)
    return np.ascontiguousarray(rgb)


def turbo_jpeg(subsampling: str, colorspace: str, width: int = 133, height: int = 97) -> bytes:
    """A JPEG written by TurboJPEG (the ``jpeg-region`` extra's wheel writes every kind)."""
    tj = pytest.importorskip("turbojpeg")
    channels = 4 if colorspace in ("CMYK", "YCCK") else 3
    image = photo_pixels(width, height, seed=len(subsampling + colorspace), channels=channels)
    fmt = tj.PF.CMYK if channels == 4 else tj.PF.RGB
    return bytes(
        tj.compress(
            image,
            92,
            getattr(tj.SAMP, subsampling),
            colorspace=getattr(tj.CS, colorspace),
            pixelformat=fmt,
        )
    )


VARIANTS = {
    f"{s}-{c}": (s, c)
    for c in ("YCbCr", "GRAY", "RGB", "CMYK", "YCCK")
    for s in SUBSAMPLINGS
    if not (c in ("CMYK", "YCCK") and s == "GRAY")  # TurboJPEG: no greyscale CMYK
}
EXPECTED_SPACE = {"YCbCr": "YCbCr", "GRAY": "Gray", "RGB": "RGB", "CMYK": "CMYK", "YCCK": "YCCK"}


def every_path(data: bytes, key: str = "k") -> dict[str, torch.Tensor]:
    """The sample through each transform path: the train crop, the full-decode train, eval,
    and the device plan decoded on the CPU; each output (3, 40, 40) uint8."""
    sample = {"__key__": key, "jpg": data, "cls": b"0"}
    out = {}
    for name, transform in {
        "crop": ImageTransform("train", 40, "jpg"),
        "full": ImageTransform("train", 40, "jpg", decode="full"),
        "eval": ImageTransform("eval", 40, "jpg"),
    }.items():
        out[name] = transform(sample, 0, 3)[0]
        planned = PlannedTransform(transform)
        batch = collate_planned([planned(sample, 0, 3)])
        out[f"{name} planned"] = DeviceDecoder(torch.device("cpu"), 40)(batch)[0][0]
    for name, image in out.items():
        assert image.dtype == torch.uint8 and image.shape == (3, 40, 40), name
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_subsampling_and_colour_space_goes_through_every_path(
    variant: str, jpeg_decoder: str
) -> None:
    subsampling, colorspace = VARIANTS[variant]
    data = turbo_jpeg(subsampling, colorspace)
    header = jpeg_header(data)
    assert header is not None and header[:2] == (97, 133)
    assert header[2] == jpeg_colorspace(data) == EXPECTED_SPACE[colorspace]
    out = every_path(data)
    for name in ("full", "crop planned", "full planned"):
        assert mean_diff(out[name], out["crop"]) < 3, name
    assert mean_diff(out["eval planned"], out["eval"]) < 3


def mean_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean())


@needs_library
@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if VARIANTS[v][1] in ("YCbCr", "GRAY")])
def test_every_subsampling_is_made_seekable_and_cropped_to_the_same_pixels(
    variant: str, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    subsampling, colorspace = VARIANTS[variant]
    data = turbo_jpeg(subsampling, colorspace, 261, 203)
    seekable = add_restart_markers(data)
    assert seekable is not None and restart_layout(seekable) is not None
    use_decoder(decoder, monkeypatch)
    assert index_problem(seekable) is None
    np.testing.assert_array_equal(simplejpeg.decode_jpeg(seekable), simplejpeg.decode_jpeg(data))
    for size in (12, 64):  # DCT scales 1/4 and 1/8, then 1/1 and 1/2
        transform = ImageTransform("train", size, "jpg", min_scale=0.05)
        for index in range(8):
            want, _ = transform({"jpg": data}, 2, index)
            got, _ = transform({"jpg": seekable}, 2, index)
            assert torch.equal(got, want), (size, index)


@needs_library
@pytest.mark.parametrize("colorspace", ["RGB", "CMYK", "YCCK"])
def test_what_the_rewrite_does_not_take_is_stored_as_it_is(colorspace: str) -> None:
    for subsampling in ("Y444", "Y420", "Y441"):
        assert add_restart_markers(turbo_jpeg(subsampling, colorspace)) is None


def test_the_colour_space_is_read_as_libjpeg_reads_it() -> None:
    """`jpeg_colorspace` (used where simplejpeg has no name for the subsampling) against
    simplejpeg's own answer, over JFIF and Adobe markers and component ids, wherever
    simplejpeg answers without a warning."""
    jfif = b"\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"

    def adobe(transform: int) -> bytes:
        return b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00" + bytes([transform])

    checked = 0
    for colorspace in ("YCbCr", "RGB", "GRAY", "CMYK", "YCCK"):
        bare = _without_app_markers(turbo_jpeg("Y444", colorspace, 24, 16))
        for extra in (b"", jfif, adobe(0), adobe(1), adobe(2), jfif + adobe(0), jfif + adobe(2)):
            for ids in (None, b"\x01\x02\x03", b"RGB", b"\x07\x08\x09"):
                data = bare[:2] + extra + bare[2:]
                if ids is not None:
                    data = _component_ids(data, ids)
                    if data is None:
                        continue
                try:
                    want = simplejpeg.decode_jpeg_header(data)[2]
                except ValueError:
                    continue  # a warning (an Adobe transform that does not fit)
                assert jpeg_colorspace(data) == want, (colorspace, extra, ids)
                checked += 1
    assert checked > 40


def _without_app_markers(data: bytes) -> bytes:
    for marker, start, end in reversed(list(jpeg_segments(data))):
        if 0xE0 <= marker <= 0xEF:
            data = data[:start] + data[end:]
    return data


def _component_ids(data: bytes, ids: bytes) -> bytes | None:
    """`data` with its 3 components renamed `ids` in the frame and scan headers."""
    out = bytearray(data)
    for marker, start, _ in jpeg_segments(data):
        if marker == 0xC0:
            if out[start + 9] != 3:
                return None
            out[start + 10 : start + 19 : 3] = ids
        elif marker == 0xDA:
            out[start + 5 : start + 11 : 2] = ids
    return bytes(out)


# --- crafted: sampling factors no library writes --------------------------------------------------

DC_BITS = (  # ITU T.81 Annex K.3: the luminance and chrominance DC tables
    bytes([0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]),
    bytes([0, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]),
)


def _codes(bits: bytes) -> dict[int, tuple[int, int]]:
    """The canonical Huffman codes of DC categories 0..11: symbol -> (code, length)."""
    codes, code, symbol = {}, 0, 0
    for length in range(1, 17):
        for _ in range(bits[length - 1]):
            codes[symbol] = (code, length)
            code, symbol = code + 1, symbol + 1
        code <<= 1
    return codes


class _BitWriter:
    def __init__(self) -> None:
        self.out, self.acc, self.count = bytearray(), 0, 0

    def put(self, code: int, length: int) -> None:
        self.acc, self.count = (self.acc << length) | code, self.count + length
        while self.count >= 8:
            self.count -= 8
            byte = (self.acc >> self.count) & 0xFF
            self.out += b"\xff\x00" if byte == 0xFF else bytes([byte])

    def flush(self) -> bytes:
        if self.count:
            self.put((1 << (8 - self.count)) - 1, 8 - self.count)  # padded with ones
        data, self.out = bytes(self.out), bytearray()
        return data


def dc_only_jpeg(
    width: int, height: int, sampling: list[tuple[int, int]], seed: int = 0, seekable: bool = False
) -> bytes:
    """A valid baseline JPEG of 2 or 3 components with any sampling factors: each block's DC
    a smooth shade plus a little noise, its AC all zero (each AC table codes only
    end-of-block, in one bit). With `seekable`, an interval per MCU and dlpipe's index, as
    `add_restart_markers` lays them."""
    rng = np.random.default_rng(seed)
    h_max, v_max = max(h for h, _ in sampling), max(v for _, v in sampling)
    mcus = -(-width // (8 * h_max)) * -(-height // (8 * v_max))
    out = bytearray(b"\xff\xd8")
    for table in (0, 1):
        out += b"\xff\xdb" + struct.pack(">HB", 67, table) + bytes([4] * 64)
        out += b"\xff\xc4" + struct.pack(">HB", 31, table) + DC_BITS[table] + bytes(range(12))
        out += b"\xff\xc4" + struct.pack(">HB", 20, 0x10 | table) + bytes([1] + [0] * 15) + b"\0"
    count = len(sampling)
    out += b"\xff\xc0" + struct.pack(">HBHHB", 8 + 3 * count, 8, height, width, count)
    for i, (h, v) in enumerate(sampling):
        out += bytes([i + 1, h << 4 | v, int(i > 0)])
    codes = [_codes(DC_BITS[int(i > 0)]) for i in range(count)]
    bits, parts, last = _BitWriter(), [], [0] * count
    columns = -(-width // (8 * h_max))
    for mcu in range(mcus):
        y, x = divmod(mcu, columns)
        for i, (h, v) in enumerate(sampling):
            row, col = np.mgrid[y * v : (y + 1) * v, x * h : (x + 1) * h]
            shade = 40 * np.sin(col * h_max / h * 0.3 + i) + 40 * np.cos(row * v_max / v * 0.2)
            for dc in (shade + rng.integers(-4, 5, shade.shape)).astype(int).ravel().tolist():
                diff, last[i] = dc - last[i], dc
                size = abs(diff).bit_length()
                bits.put(*codes[i][size])
                bits.put(diff if diff >= 0 else diff + (1 << size) - 1, size)
                bits.put(0, 1)  # end of block
        if seekable:
            parts.append(bits.flush())
            last = [0] * count
    if seekable:
        out += b"\xff\xdd\x00\x04\x00\x01"
    out += b"\xff\xda" + struct.pack(">HB", 6 + 2 * count, count)
    out += b"".join(bytes([i + 1, 0x11 * int(i > 0)]) for i in range(count)) + b"\x00\x3f\x00"
    if not seekable:
        return bytes(out) + bits.flush() + b"\xff\xd9"
    index = _INDEX_ID + np.asarray([len(p) for p in parts], "<u2").tobytes()
    app15 = b"\xff\xef" + struct.pack(">H", len(index) + 2) + index
    return assemble(b"\xff\xd8" + app15 + bytes(out[2:]), parts)


CRAFTED = {
    "4:4:1 (1x4)": [(1, 4), (1, 1), (1, 1)],  # TurboJPEG's TJSAMP_441, crafted too
    "3x1 luma": [(3, 1), (1, 1), (1, 1)],  # TJSAMP_UNKNOWN from here on
    "1x3 luma": [(1, 3), (1, 1), (1, 1)],
    "4:1:0 (4x2)": [(4, 2), (1, 1), (1, 1)],
    "chroma finer than luma": [(1, 1), (2, 2), (1, 1)],
}


@pytest.mark.parametrize("seekable", [False, True], ids=["plain", "seekable"])
@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_sampling_factors_decode_on_every_path(
    name: str, seekable: bool, jpeg_decoder: str
) -> None:
    plain = dc_only_jpeg(157, 121, CRAFTED[name], seed=1)
    data = dc_only_jpeg(157, 121, CRAFTED[name], seed=1, seekable=True) if seekable else plain
    reference = pixels(plain)  # libjpeg through Pillow: every one of these decodes
    assert reference.shape == (121, 157, 3)
    if seekable:
        assert restart_layout(data) is not None and index_problem(data) is None
        np.testing.assert_array_equal(pixels(data), reference)
    out = every_path(data)
    assert mean_diff(out["crop"], out["full"]) < 3
    assert mean_diff(out["eval planned"], out["eval"]) < 3
    if seekable:  # the window's crop is the plain file's crop
        transform = ImageTransform("train", 40, "jpg")
        for index in range(6):
            got, _ = transform({"jpg": data}, 0, index)
            want, _ = transform({"jpg": plain}, 0, index)
            assert torch.equal(got, want), index


@pytest.mark.parametrize(
    "sampling",
    [[(3, 1), (2, 1), (1, 1)], [(2, 1), (1, 1)]],
    ids=["fractional sampling", "two components"],
)
def test_what_libjpeg_refuses_is_a_named_error_on_every_path(
    sampling: list[tuple[int, int]], jpeg_decoder: str
) -> None:
    """Luma 3x1 over chroma 2x1 (libjpeg: "fractional sampling not implemented"), two
    components (no colour space): each path names the sample and field instead of crashing."""
    for seekable in (False, True):
        data = dc_only_jpeg(64, 48, sampling, seekable=seekable)
        for recipe, decode in (("train", "crop"), ("train", "full"), ("eval", "crop")):
            transform = ImageTransform(recipe, 16, "jpg", decode=decode)
            with pytest.raises(FieldDecodeError, match="sample 'odd' field 'jpg'"):
                transform({"__key__": "odd", "jpg": data}, 0, 0)
