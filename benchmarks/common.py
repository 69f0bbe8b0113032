"""Helpers every benchmark shares: the dlpipe command, converting a corpus, writing results."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["convert_corpus", "dlpipe_executable", "write_results"]


def dlpipe_executable() -> str:
    """The venv's ``dlpipe`` console script."""
    exe = Path(sys.executable).parent / "dlpipe"
    found = str(exe) if exe.exists() else shutil.which("dlpipe")
    if not found:
        raise FileNotFoundError("no dlpipe console script; run `pip install -e .` in this venv")
    return found


def convert_corpus(root: str, fmt: str, out: str) -> float:
    """``dlpipe convert`` an ImageFolder corpus; returns the wall-clock seconds."""
    cmd = [dlpipe_executable(), "convert", root, "--to", fmt, "--source", "imagefolder"]
    cmd += ["--out", out, "--overwrite"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    return time.perf_counter() - start


def write_results(
    out: Path, stem: str, result: dict[str, Any], markdown: Callable[[dict[str, Any]], str]
) -> None:
    """``<out>/<stem>.json`` (raw numbers) and ``<stem>.md`` (the table), and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / f"{stem}.md").write_text(text)
    print(text)
