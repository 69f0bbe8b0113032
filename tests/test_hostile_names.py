"""Names that would drive the terminal: control characters in file, class, column and tar member
names are printed escaped (``\\x1b``, ``\\u202e``) on every line dlpipe prints, and kept as they
are in what it writes (the manifest, ``errors.jsonl``: they are data).

Every command runs as a user runs it (`dlpipe.cli.main`, its output captured); a line that
reaches the terminal with a raw ESC could clear the screen, retitle the window, or move the
cursor up and erase an earlier warning.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import unicodedata
from pathlib import Path

import pytest
from conftest import error_records, one_error
from PIL import Image
from rich.table import Table

import dlpipe
from dlpipe.cli import TerminalConsole, main
from dlpipe.text import printable, shown

HOSTILE = "\x1b[2J\x1b]0;owned\x07\r\x1b[1A\x1b[2K\x08\x7f\x85\x9b\u202e\u2066\u2028"
"""Clear the screen, retitle the window, go back up and erase the line before, backspace,
DEL, C1 controls (NEL, CSI), a right-to-left override, a bidi isolate, a line separator."""
ESCAPED = "\\x1b[2J\\x1b]0;owned\\x07\\r\\x1b[1A\\x1b[2K\\x08\\x7f\\x85\\x9b\\u202e\\u2066\\u2028"


def raw_controls(text: str) -> list[str]:
    """The terminal control characters in `text` besides its line breaks."""
    return [c for c in text if c != "\n" and printable(c) != c]


def jpeg(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (9, 7), (seed * 61 % 256, 120, 30)).save(out, "JPEG")
    return out.getvalue()


def convert(raw: Path, out: Path, *flags: str) -> int:
    return main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *flags])


# --- printable: one rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("char", "shown"),
    [
        ("\x1b", "\\x1b"),
        ("\r", "\\r"),
        ("\n", "\\n"),
        ("\t", "\\t"),
        ("\x07", "\\x07"),
        ("\x08", "\\x08"),
        ("\x00", "\\x00"),
        ("\x7f", "\\x7f"),
        ("\x80", "\\x80"),
        ("\x9b", "\\x9b"),
        ("\x9f", "\\x9f"),
        ("\u061c", "\\u061c"),
        ("\u200e", "\\u200e"),
        ("\u202a", "\\u202a"),
        ("\u202e", "\\u202e"),
        ("\u2067", "\\u2067"),
        ("\u2069", "\\u2069"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
        ("\ufeff", "\\ufeff"),
        ("\U000e0041", "\\U000e0041"),
        ("\udcff", "\\xff"),  # a byte that was not UTF-8, as display_path shows it
        ("\ud800", "\\ud800"),
    ],
)
def test_printable_escapes_every_terminal_control(char: str, shown: str) -> None:
    assert printable(f"a{char}b") == f"a{shown}b"
    assert printable(printable(f"a{char}b")) == f"a{shown}b"  # escaping twice changes nothing


def test_printable_escapes_every_c0_and_c1_control() -> None:
    for code in [*range(0x20), *range(0x7F, 0xA0)]:
        assert printable(chr(code)) == {9: "\\t", 10: "\\n", 13: "\\r"}.get(code, f"\\x{code:02x}")


@pytest.mark.parametrize(
    "text",
    [
        "plain.jpg",
        "日本語/画像.png",
        "café au lait",
        "👨\u200d👩\u200d👧",
        "a\\x1b.jpg",
        "tab-free ok",
    ],
)
def test_printable_leaves_text_alone(text: str) -> None:
    assert printable(text) == text


def test_printable_keeps_what_it_is_asked_to() -> None:
    assert printable("a\nb\x1bc", keep="\n") == "a\nb\\x1bc"


def test_the_console_escapes_text_and_keeps_its_own_styles() -> None:
    """`TerminalConsole` is the net under every print: text a caller forgot to escape comes
    out escaped (rich itself drops only CR, BEL and backspace), and rich's styles still work.
    A table measures its cells before the net escapes them: names go through `shown`."""
    out = io.StringIO()
    console = TerminalConsole(file=out, force_terminal=True, color_system="standard", width=400)
    console.print(f"[red]class[/red] {HOSTILE}", highlight=False)
    table = Table("name", title=f"wrote {shown(HOSTILE)}")
    table.add_row(f"cell {HOSTILE}")  # forgotten: cut to its measured width, still escaped
    console.print(table)
    text = out.getvalue()
    assert "\x1b[31m" in text  # rich's own colour
    no_rich_strips = ESCAPED.replace("\\x07", "").replace("\\r", "").replace("\\x08", "")
    assert text.splitlines()[0].endswith(f"class\x1b[0m {no_rich_strips}"), text
    assert "\\x1b[2J\\x1b]0;owned\\x07" in text  # the title, escaped by `shown` first
    for raw in ("\x1b[2J", "\x1b]0;", "\x1b[1A", "\x7f", "\x85", "\x9b", "\u202e", "\u2028"):
        assert raw not in text, repr(raw)


# --- error and warning lines -----------------------------------------------------------------


def _table(root: Path, header: str, rows: list[str]) -> Path:
    root.mkdir(parents=True)
    (root / "labels.csv").write_text(header + "\n" + "".join(r + "\n" for r in rows))
    return root


def test_an_error_line_naming_columns_is_escaped(tmp_path: Path, capsys) -> None:
    raw = _table(tmp_path / "raw", f'"pic{HOSTILE}",label', ["a.jpg,0"])
    assert convert(raw / "labels.csv", tmp_path / "out", "--source", "table") == 2
    line = one_error(capsys)
    assert f"pic{ESCAPED}" in line and not raw_controls(line)


@pytest.mark.parametrize("where", ["flag", "path"])
def test_an_error_line_naming_a_users_value_is_escaped(tmp_path, capsys, where) -> None:
    if where == "flag":
        with pytest.raises(SystemExit):
            main(["convert", str(tmp_path), "--to", f"wds{HOSTILE}"])
    else:
        assert convert(tmp_path / f"missing{HOSTILE}", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert ESCAPED in err and not raw_controls(err)
    assert err.count("\n") == 1  # one line: a U+2028 or CR in the value cannot start another


def test_warning_lines_are_escaped_and_cannot_erase_each_other(tmp_path: Path, capsys) -> None:
    """A FIFO named to move the cursor up and erase the line before, and an empty class
    folder named to clear the screen: two warning lines, both whole, nothing raw."""
    raw = tmp_path / "raw"
    for name in ("cat", "dog"):
        (raw / name).mkdir(parents=True)
        for i in range(2):
            (raw / name / f"{i}.jpg").write_bytes(jpeg(i + (name == "dog") * 5))
    os.mkfifo(raw / "cat" / f"x{HOSTILE}.jpg")
    (raw / f"empty{HOSTILE}").mkdir()
    assert convert(raw, tmp_path / "out", "--keep-empty-classes") == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert any("skipped 1 entries" in w and f"x{ESCAPED}.jpg" in w for w in warnings), err
    assert any("kept 1 class folders" in w and f"empty{ESCAPED}" in w for w in warnings), err
    assert not raw_controls(err)
    classes = dlpipe.read_manifest(str(tmp_path / "out")).classes
    assert f"empty{HOSTILE}" in classes  # the manifest keeps the real name


# --- what convert, inspect and verify print --------------------------------------------------


@pytest.fixture
def hostile_dataset(tmp_path: Path) -> tuple[Path, Path]:
    """A table whose class names, an image path and the output folder carry control
    characters; one row names a missing file (a skipped sample). Returns (raw, out)."""
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    rows = []
    for i in range(6):
        name = f"images/{i}{HOSTILE}.jpg" if i == 0 else f"images/{i}.jpg"
        (raw / name).write_bytes(jpeg(i))
        rows.append({"image": name, "label": f"cat{HOSTILE}" if i % 2 else "dog"})
    rows.append({"image": f"images/gone{HOSTILE}.jpg", "label": "dog"})
    (raw / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return raw, tmp_path / f"out{HOSTILE}"


def test_the_convert_summary_prints_names_escaped(hostile_dataset, capsys) -> None:
    raw, out = hostile_dataset
    assert convert(raw, out) == 0
    captured = capsys.readouterr()
    assert not raw_controls(captured.out), captured.out
    assert not raw_controls(captured.err), captured.err
    assert f"→ {out.parent}/out{ESCAPED}" in captured.out  # the first line
    assert f"wrote {out.parent}/out{ESCAPED}" in captured.out.replace("\n", "")  # the table
    assert f"e.g. labels.jsonl row 6 (images/gone{ESCAPED}.jpg)" in captured.out
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == (f"cat{HOSTILE}", "dog")  # data keeps the real names
    (record,) = error_records(out)
    assert f"images/gone{HOSTILE}.jpg" in record["error"]


def test_inspect_prints_names_escaped_and_json_keeps_them(hostile_dataset, capsys) -> None:
    raw, out = hostile_dataset
    assert convert(raw, out) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not raw_controls(printed)
    cells = "".join(line.split("│")[2].strip() for line in printed.splitlines() if "│" in line)
    assert f"cat{ESCAPED[:30]}" in cells  # the class column (cut to the terminal's width)
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["classes"] == [f"cat{HOSTILE}", "dog"] and info["path"] == str(out)


def test_verify_prints_the_path_escaped(hostile_dataset, capsys) -> None:
    raw, out = hostile_dataset
    assert convert(raw, out) == 0
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"ok: {out.parent}/out{ESCAPED}: ") and not raw_controls(printed)


def test_tar_member_names_in_messages_are_escaped(tmp_path: Path, capsys) -> None:
    """WebDataset shards read in place: a member named with '..' and control characters is a
    skipped sample; the summary names it escaped."""
    raw = tmp_path / "raw"
    raw.mkdir()
    members = [("a.jpg", jpeg(1)), ("a.cls", b"0"), (f"b{HOSTILE}.jpg", jpeg(2)),
               (f"b{HOSTILE}.cls", b"1"), (f"../evil{HOSTILE}.jpg", jpeg(3))]  # fmt: skip
    with tarfile.open(raw / "train-000000.tar", "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert convert(raw, tmp_path / "out") == 0
    captured = capsys.readouterr()
    assert f"../evil{ESCAPED}" in captured.out and not raw_controls(captured.out + captured.err)
    (record,) = error_records(tmp_path / "out")
    assert "sample '../evil" in record["error"]


def test_no_raw_control_reaches_the_terminal_for_any_category() -> None:
    """The rule covers whole Unicode categories, not a list: every Cc, Cf (but the joiners),
    Zl and Zp character of the Basic Multilingual Plane is escaped."""
    for code in range(0x10000):
        char = chr(code)
        kind = unicodedata.category(char)
        if kind in ("Cc", "Zl", "Zp") or (kind == "Cf" and char not in "\u200c\u200d"):
            assert "\\" in printable(char), hex(code)
