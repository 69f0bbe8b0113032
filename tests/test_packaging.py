"""The wheel carries every module: setuptools silently drops an unlisted sub-package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_holds_core_converters_and_train_modules(tmp_path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            "-q",
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("dlpipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"dlpipe/{p.relative_to(ROOT / 'dlpipe')}" for p in (ROOT / "dlpipe").rglob("*.py")}
    for part in ("converters", "train"):
        expected |= {f"dlpipe/{part}/{p.name}" for p in (ROOT / part).glob("*.py")}
        assert not [p for p in (ROOT / part).iterdir() if p.is_dir() and p.name != "__pycache__"], (
            f"{part}/ must stay flat (no sub-packages)"
        )
    assert expected - names == set()
    assert "dlpipe/py.typed" in names
    assert "dlpipe/converters/__init__.py" in names and "dlpipe/train/__init__.py" in names


def test_mapped_packages_import_under_dlpipe() -> None:
    import dlpipe.converters
    import dlpipe.train

    assert Path(dlpipe.converters.__file__).parent.name == "converters"
    assert Path(dlpipe.train.__file__).parent.name == "train"
