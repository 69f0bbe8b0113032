"""The CLI under hostile text, bad flags, Ctrl-C, decompression bombs and unwritable profiles.

Each test does what a user, an attacker or a cluster does: names folders with rich markup,
passes out-of-range flags, sends SIGINT to the process (group), ships a 20000 x 20000 PNG of a
few KB, makes the profile location unwritable, and checks the exit code, the one ``error:``
line, that no traceback reaches the user and that memory stays bounded.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shlex
import signal
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from convert_hold import HANG_S, ConvertHold
from PIL import Image, ImageFile

import dlpipe
from dlpipe import codecs
from dlpipe.cli import main
from dlpipe.codecs import ImageTooLargeError, PixelLimitError
from dlpipe.converters.images import ImagePolicy, prepare_image
from dlpipe.inspection import print_description
from dlpipe.loading import profile as profiles
from dlpipe.loading.transforms import ImageTransform, decode_rgb

DLPIPE = str(Path(sys.executable).parent / "dlpipe")
BOMB_SIDE = 20000  # 400 M pixels: 1.2 GB as RGB, about 50 KB as a 1-bit PNG


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich wraps at 80 columns under capture; long tmp paths must stay on one line."""
    monkeypatch.setenv("COLUMNS", "400")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def jpeg(seed: int, size: int = 20) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (seed * 40 % 256, 80, 160)).save(buffer, "JPEG")
    return buffer.getvalue()


def write_classes(root: Path, classes: dict[str, int]) -> Path:
    for name, count in classes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            (root / name / f"{i:03d}.jpg").write_bytes(jpeg(i))
    return root


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A valid 1-bit greyscale PNG of side x side zeros: tiny on disk, huge decoded."""
    row = b"\0" * (1 + (side + 7) // 8)
    compressor = zlib.compressobj(9)
    rows_per_chunk = 1000
    body = b"".join(compressor.compress(row * rows_per_chunk) for _ in range(side // 1000))
    body += compressor.compress(row * (side % rows_per_chunk)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", body)
        + png_chunk(b"IEND", b"")
    )


def bomb_jpeg(width: int = 30000, height: int = 30000) -> bytes:
    """A real JPEG whose frame header is rewritten to claim width x height."""
    data = bytearray(jpeg(1, 16))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# 1. user text is never rich markup ------------------------------------------------------------


def test_markup_in_paths_and_class_names_is_printed_literally(tmp_path, capsys) -> None:
    raw = write_classes(tmp_path / "raw[" / "b]", {"[bold]cat": 3, "[red]dog[": 3})
    out = tmp_path / "out[" / "b]"
    assert main(["convert", str(raw), "--to", "lmdb", "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr()
    assert f"{raw} → {out}" in printed.out and f"wrote {out}" in printed.out
    assert "Traceback" not in printed.err
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "[bold]cat" in printed and "[red]dog[" in printed
    assert main(["verify", str(out), "--decode"]) == 0
    assert f"ok: {out}: 1 shards, 6 samples decoded" in capsys.readouterr().out
    bench = ["--batch-size", "2", "--image-size", "16", "--budget", "1", "--max-workers", "0"]
    assert main(["bench-loader", str(out), *bench]) == 0
    assert f"saved the profile to {out}/dlpipe-profiles.json" in capsys.readouterr().out


def test_error_lines_with_markup_stay_plain(tmp_path, capsys) -> None:
    missing = tmp_path / "no[" / "b]data"
    assert main(["inspect", str(missing)]) == 2
    assert str(missing) in one_error_line(capsys.readouterr().err)


def test_doctor_prints_a_markup_data_dir_literally(tmp_path, capsys) -> None:
    data = tmp_path / "disk[" / "b]"
    data.mkdir(parents=True)
    assert main(["doctor", "--data-dir", str(data)]) in (0, 1)
    assert f"data dir {data}" in capsys.readouterr().out


def test_inspect_never_raises_on_odd_class_counts(capsys) -> None:
    from rich.console import Console

    info = {
        "path": "x[/b]",
        "format": "wds",
        "format_version": 1,
        "dlpipe_version": "[/i]",
        "samples": 3,
        "bytes": 10,
        "fields": {"jpg": "image", "cls": "int"},
        "classes": ["a", "[/]", "c"],
        "splits": {"train": {"samples": 3, "shards": 1, "bytes": 10, "class_counts": [3]}},
    }
    print_description(info, Console(width=200))
    out = capsys.readouterr().out
    assert out.startswith("x[/b]: wds v1, 3 samples") and "(written by dlpipe [/i])" in out
    rows = [line.replace("│", " ").split() for line in out.splitlines() if "│" in line]
    assert ["0", "a", "3"] in rows and ["1", "[/]", "-"] in rows and ["2", "c", "-"] in rows


# 2. one error: line for a bad command-line value ----------------------------------------------

BAD_FLAGS = [
    (["bench-loader", "D", "--max-workers", "-1"], "--max-workers", "-1", "at least 0"),
    (["bench-loader", "D", "--batch-size", "0"], "--batch-size", "0", "at least 1"),
    (["bench-loader", "D", "--budget", "0"], "--budget", "0", "above 0"),
    (["bench-loader", "D", "--budget", "nan"], "--budget", "nan", "above 0"),
    (["bench-loader", "D", "--image-size", "0"], "--image-size", "0", "at least 1"),
    (["convert", "R", "--to", "wds", "--workers", "0"], "--workers", "0", "at least 1"),
    (["convert", "R", "--to", "wds", "--quality", "0"], "--quality", "0", "1..100"),
    (["convert", "R", "--to", "wds", "--quality", "101"], "--quality", "101", "1..100"),
    (["convert", "R", "--to", "wds", "--max-side", "0"], "--max-side", "0", "at least 8"),
    (["convert", "R", "--to", "wds", "--workers", "two"], "--workers", "'two'", "at least 1"),
]


@pytest.mark.parametrize("argv, flag, value, rule", BAD_FLAGS)
def test_a_bad_flag_value_is_one_error_line(argv, flag, value, rule, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    printed = capsys.readouterr()
    line = one_error_line(printed.err)
    assert flag in line and f" {value} " in line and rule in line
    assert line.endswith(f"see dlpipe {argv[0]} --help") and "usage:" not in printed.err
    assert printed.out == ""


def test_a_missing_argument_is_one_error_line_too(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "raw/"])
    assert exit_info.value.code == 2
    assert "--to" in one_error_line(capsys.readouterr().err)


# 3. Ctrl-C: one line, exit 130, and the printed command finishes the dataset -------------------


def _journal_entries(out: Path) -> int:
    folder = out / ".dlpipe-journal"
    return len([n for n in os.listdir(folder) if n != "plan.json"]) if folder.exists() else 0


def _interrupt_and_resume(tmp_path: Path, workers: int, to_group: bool) -> None:
    """Ctrl-C once a shard is journalled and the next is held (not after the end, however fast
    the machine: `ConvertHold`)."""
    raw = write_classes(tmp_path / "raw", {f"c{i}": 6 for i in range(4)})
    out, hold = tmp_path / "out", ConvertHold(tmp_path / "hold")
    command = [DLPIPE, "convert", str(raw), "--to", "wds", "--out", str(out)]
    with _ctrl_c_not_ignored():
        proc = subprocess.Popen(
            [*command, "--shard-size", "1", "--workers", str(workers)],  # one sample per shard
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=hold.env,
            start_new_session=True,
        )
    try:
        hold.wait(proc)
        wait_until(lambda: _journal_entries(out) >= 1, proc)
        (os.killpg if to_group else os.kill)(proc.pid, signal.SIGINT)
        hold.release()  # worker processes finish the shards in hand; the main process stops
        stdout, stderr = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    (line,) = stderr.strip().splitlines()
    assert line.startswith("interrupted; finish with: dlpipe convert ") and "--to wds" in line
    assert not (out / "dlpipe.json").exists(), "the interrupt came after the end"
    kept = _journal_entries(out)
    assert 1 <= kept < 24
    resume = shlex.split(line.split("finish with: ", 1)[1])
    done = subprocess.run([DLPIPE, *resume[1:]], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    assert "resumed" in done.stdout, done.stdout
    assert main(["verify", str(out)]) == 0
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 24


@contextlib.contextmanager
def _ctrl_c_not_ignored() -> Iterator[None]:
    """Start children with SIGINT not ignored, as a terminal does. A script's background job
    (``pytest &``, some CI runners) inherits SIGINT ignored, and so would the conversion: with
    ``--workers 1`` it would then never see the Ctrl-C this test sends."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


def wait_until(predicate, proc: subprocess.Popen) -> None:
    """Wait for a state the running conversion is sure to reach (a bound only on a hang)."""
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert proc.poll() is None, f"the conversion ended (exit {proc.returncode})"
        assert time.monotonic() < deadline, "the state never came"
        time.sleep(0.01)


@pytest.mark.slow
def test_ctrl_c_to_the_main_process_is_one_line_and_resumable(tmp_path) -> None:
    _interrupt_and_resume(tmp_path, workers=2, to_group=False)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_is_one_line_and_resumable(tmp_path) -> None:
    _interrupt_and_resume(tmp_path, workers=1, to_group=True)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_with_worker_processes(tmp_path) -> None:
    _interrupt_and_resume(tmp_path, workers=2, to_group=True)


def test_ctrl_c_in_a_handler_is_one_line(monkeypatch, capsys) -> None:
    import dlpipe.inspection

    def interrupted(path: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dlpipe.inspection, "describe_dataset", interrupted)
    assert main(["inspect", "anything"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


# 4. dlpipe logger warnings are warning: lines -------------------------------------------------


def test_logger_warnings_are_printed_as_warning_lines(tmp_path, capsys) -> None:
    raw = write_classes(tmp_path / "raw", {"a": 2, "b": 2})
    out = tmp_path / "out[" / "b]"
    assert main(["convert", str(raw), "--to", "hdf5", "--out", str(out), "--workers", "1"]) == 0
    bad = out / "dlpipe-profiles.json"
    bad.write_text("{broken")
    capsys.readouterr()
    handlers = list(logging.getLogger("dlpipe").handlers)
    bench = ["--batch-size", "2", "--image-size", "16", "--budget", "1", "--max-workers", "0"]
    assert main(["bench-loader", str(out), *bench]) == 0
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"warning: replacing an unreadable profiles file: {bad} is not valid")
    assert logging.getLogger("dlpipe").handlers == handlers  # removed after the command
    assert json.loads(bad.read_text())["profiles"]  # and the fix happened


# 5. one pixel limit on every decode path ------------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = bomb_png()
    assert len(data) < 100_000
    assert codecs.image_size(data) == (BOMB_SIDE, BOMB_SIDE)
    return data


def _bomb_dataset(out: Path, bomb: bytes) -> str:
    with dlpipe.DatasetWriter(out=str(out), format="lmdb", classes=("a",)) as writer:
        writer.write("train", {"__key__": "bomb", "png": bomb, "cls": b"0"})
    return str(out)


def test_the_loader_refuses_a_decompression_bomb_in_bounded_memory(tmp_path, bomb) -> None:
    path = _bomb_dataset(tmp_path / "bomb", bomb)
    script = textwrap.dedent(
        f"""
        import resource, sys
        import dlpipe, torch, torchvision.io
        from dlpipe.codecs import ImageTooLargeError
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        cap = vm + (1 << 30)  # 1 GiB more than the interpreter with torch: RGB needs 1.2 GB
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        config = dlpipe.LoaderConfig(batch_size=1, transform="eval", image_size=16)
        loader = dlpipe.make_loader({path!r}, "train", config, workers=0, profile=None)
        try:
            next(iter(loader))
        except ImageTooLargeError as exc:
            print("refused:", exc)
            sys.exit(0)
        sys.exit("decoded the bomb")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{BOMB_SIDE}x{BOMB_SIDE}" in done.stdout and "89,478,485" in done.stdout
    assert "'bomb'" in done.stdout and "DLPIPE_MAX_IMAGE_PIXELS" in done.stdout


def test_verify_decode_refuses_a_decompression_bomb(tmp_path, bomb, capsys) -> None:
    path = _bomb_dataset(tmp_path / "bomb", bomb)
    assert main(["verify", path]) == 0  # the bytes are what the manifest says
    assert main(["verify", path, "--decode"]) == 1
    out = capsys.readouterr().out
    assert f"{BOMB_SIDE}x{BOMB_SIDE}" in out and "pixel limit" in out and "FAILED" in out


def test_convert_skips_a_decompression_bomb_naming_it(tmp_path, bomb, capsys) -> None:
    raw = write_classes(tmp_path / "raw", {"a": 2, "b": 2})
    (raw / "a" / "huge.png").write_bytes(bomb)
    out = tmp_path / "out"
    assert main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]) == 0
    assert "skipped 1 samples" in capsys.readouterr().out
    (entry,) = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert "huge.png" in entry["error"] and f"{BOMB_SIDE}x{BOMB_SIDE}" in entry["error"]
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 4


def test_a_lying_jpeg_header_is_refused_before_decoding() -> None:
    data = bomb_jpeg()
    with pytest.raises(ImageTooLargeError, match="30000x30000"):
        decode_rgb(data)
    with pytest.raises(ImageTooLargeError, match="30000x30000"):
        dlpipe.decode_field("jpg", data)
    with pytest.raises(dlpipe.DlpipeError, match="30000x30000"):
        prepare_image(data, ImagePolicy(), "raw/a/x.jpg")


def test_a_webp_canvas_bomb_is_refused() -> None:
    buffer = io.BytesIO()
    Image.new("RGBA", (8, 8)).save(buffer, "WEBP")  # VP8X: the canvas size is in the header
    data = bytearray(buffer.getvalue())
    assert data[12:16] == b"VP8X"
    data[24:30] = (29999).to_bytes(3, "little") + (29999).to_bytes(3, "little")
    with pytest.raises(ImageTooLargeError, match="30000x30000"):
        decode_rgb(bytes(data))


def test_the_limit_is_configurable_and_reaches_the_transform(monkeypatch) -> None:
    small = jpeg(1, 64)
    assert decode_rgb(small).shape == (3, 64, 64)
    monkeypatch.setenv("DLPIPE_MAX_IMAGE_PIXELS", "1000")
    with pytest.raises(ImageTooLargeError, match="4,096 pixels, over the pixel limit of 1,000"):
        decode_rgb(small)
    monkeypatch.setenv("DLPIPE_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(PixelLimitError, match="DLPIPE_MAX_IMAGE_PIXELS='lots'"):
        decode_rgb(small)
    monkeypatch.delenv("DLPIPE_MAX_IMAGE_PIXELS")
    codecs.set_max_image_pixels(100)
    try:
        transform = ImageTransform("eval", 16, "jpg")
    finally:
        codecs.set_max_image_pixels(None)
    import pickle  # the transform as a spawned DataLoader worker receives it

    shipped = pickle.loads(pickle.dumps(transform))
    with pytest.raises(ImageTooLargeError, match="sample 'k' field 'jpg'"):
        shipped({"__key__": "k", "jpg": small, "cls": b"0"})
    with pytest.raises(PixelLimitError):
        codecs.set_max_image_pixels(0)
    assert isinstance(decode_rgb(small), torch.Tensor)


def _noise(kind: str) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((512, 384), 60).convert("RGB").save(buffer, kind)
    return buffer.getvalue()


@pytest.mark.parametrize("kind", ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"])
def test_header_reading_decodes_no_pixels(kind, monkeypatch) -> None:
    """The pixel limit costs a header read, not a decode: no decoder runs (counted, not
    timed), and the kinds dlpipe parses itself need only the bytes up to their size field."""
    data = _noise(kind)
    decodes: list[str] = []
    for cls in (Image.Image, ImageFile.ImageFile):  # every Pillow decode goes through load()
        monkeypatch.setattr(cls, "load", _counted(cls.load, decodes))
    assert codecs.check_image_pixels(data) == (512, 384)
    assert decodes == []
    header = {"PNG": 24, "WEBP": 30}.get(kind)  # PNG's IHDR, WebP's canvas: fixed places
    if kind == "JPEG":  # up to the end of the start-of-frame segment
        header = next(end for m, _, end in codecs.jpeg_segments(data) if m in codecs.SOF_MARKERS)
    if header is not None:
        assert header < len(data) // 100
        assert codecs.check_image_pixels(data[:header]) == (512, 384)
    with Image.open(io.BytesIO(data)) as image:
        assert image.convert("RGB").size == (512, 384)
    assert decodes, "the negative control: a Pillow decode is counted"


def _counted(load, calls: list[str]):
    def counted(image: Image.Image):
        calls.append(image.format or "?")
        return load(image)

    return counted


# 6. errors.jsonl is the same run to run -------------------------------------------------------


def test_errors_jsonl_holds_no_memory_addresses(tmp_path, capsys) -> None:
    raw = write_classes(tmp_path / "raw", {"a": 2, "b": 2})
    (raw / "a" / "text.jpg").write_text("not an image at all")
    (raw / "b" / "cut.jpg").write_bytes(jpeg(3)[:60])
    runs = []
    for name in ("one", "two"):
        out = tmp_path / name
        assert main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"]) == 0
        runs.append((out / "errors.jsonl").read_text())
    assert runs[0] == runs[1] and "0x" not in runs[0]
    assert len(runs[0].splitlines()) == 2 and "cannot identify image file" in runs[0]


# 7. bench-loader: unwritable profile location, hostile profiles files -------------------------


@pytest.fixture
def small_dataset(tmp_path) -> str:
    raw = write_classes(tmp_path / "raw", {"a": 3, "b": 3})
    out = tmp_path / "data"
    assert main(["convert", str(raw), "--to", "lmdb", "--out", str(out), "--workers", "1"]) == 0
    return str(out)


def _read_only_bind(folder: str, where: Path) -> str:
    """`folder` seen through a read-only bind mount (root ignores file modes, not EROFS)."""
    where.mkdir()
    try:
        subprocess.run(["mount", "--bind", folder, str(where)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("cannot bind-mount here (needs root and mount)")
    remount = ["mount", "-o", "remount,bind,ro", str(where)]
    if subprocess.run(remount, capture_output=True).returncode != 0:
        _unmount(str(where))
        pytest.skip("cannot remount read-only here")
    return str(where)


def _unmount(where: str) -> None:
    """Lazily: the loader may still hold an LMDB map of a file in there."""
    subprocess.run(["umount", "-l", where], check=True, capture_output=True)


def test_bench_loader_shows_results_when_the_profile_cannot_be_saved(
    small_dataset, tmp_path, monkeypatch, capsys
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "sub"))
    view = _read_only_bind(small_dataset, tmp_path / "ro")
    try:
        capsys.readouterr()
        bench = ["--batch-size", "2", "--image-size", "16", "--budget", "1", "--max-workers", "0"]
        assert main(["bench-loader", view, *bench]) == 1
    finally:
        _unmount(view)
    printed = capsys.readouterr()
    assert "chosen: engine=processes num_workers=0" in printed.out and "verdict:" in printed.out
    line = one_error_line(printed.err)
    assert f"could not save the loader profile to {view}/dlpipe-profiles.json" in line
    assert str(blocker / "sub") in line and "Not a directory" in line
    assert "XDG_CACHE_HOME" in line and "--no-save" in line


def test_a_read_only_dataset_saves_its_profile_in_the_cache(small_dataset, tmp_path) -> None:
    view = _read_only_bind(small_dataset, tmp_path / "ro")
    try:
        mine = profiles.LoaderProfile(
            settings=dlpipe.WorkerSettings(num_workers=1),
            samples_per_s=1.0,
            machine=profiles.machine_key(),
            loader=profiles.loader_key("train", _EVAL_16),
        )
        where = profiles.save_profile(view, mine)
    finally:
        _unmount(view)
    assert where == profiles.cache_file(view) and where.startswith(str(tmp_path / "cache"))


def test_a_bad_plot_path_does_not_hide_the_results(small_dataset, tmp_path, capsys) -> None:
    capsys.readouterr()
    bench = ["--batch-size", "2", "--image-size", "16", "--budget", "1", "--max-workers", "0"]
    plot = tmp_path / "missing" / "plot.png"
    assert main(["bench-loader", small_dataset, *bench, "--plot", str(plot)]) == 1
    printed = capsys.readouterr()
    assert "chosen:" in printed.out and str(plot) in one_error_line(printed.err)


_EVAL_16 = dlpipe.LoaderConfig(batch_size=2, transform="eval", image_size=16)


def _fifo(path: str) -> None:
    os.mkfifo(path)


def _dev_zero(path: str) -> None:
    os.symlink("/dev/zero", path)


def _huge(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b" " * (2 << 20))


def _fork_bomb(path: str) -> None:
    profile = {
        "num_workers": 100000,
        "prefetch_factor": 2,
        "pin_memory": False,
        "persistent_workers": True,
        "samples_per_s": 1.0,
        "machine": profiles.machine_key(),
        "loader": profiles.loader_key("train", _EVAL_16),
        "created_by": "0",
    }
    document = {"schema": profiles.SCHEMA_NAME, "schema_version": 1, "profiles": [profile]}
    with open(path, "w") as f:
        json.dump(document, f)


def _deep(path: str) -> None:
    with open(path, "w") as f:
        f.write("[" * 200_000)


@pytest.mark.parametrize(
    "plant, reason",
    [
        (_fifo, "not a regular file"),
        (_dev_zero, "not a regular file"),
        (_huge, "over 1048576 bytes"),
        (_fork_bomb, "num_workers 100000"),
        (_deep, "nested too deeply"),
    ],
)
def test_a_hostile_profiles_file_is_one_warning_and_the_defaults(
    small_dataset, plant, reason, caplog
) -> None:
    bad = os.path.join(small_dataset, profiles.PROFILES_NAME)
    plant(bad)
    config = dlpipe.LoaderConfig(batch_size=2, transform="eval", image_size=16)
    for explicit in ({}, {"num_workers": 0, "prefetch_factor": 3, "pin_memory": False}):
        caplog.clear()
        loader = dlpipe.make_loader(small_dataset, "train", config, workers=explicit)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and bad in warnings[0].getMessage()
        assert reason in warnings[0].getMessage() and "bench-loader" in warnings[0].getMessage()
        assert loader.num_workers == explicit.get("num_workers", max(1, (os.cpu_count() or 1) - 1))
