"""The README is the user's manual: its quick start is what CI runs, its commands run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_quick_start_is_install_and_demo_then_install_dev_and_test() -> None:
    first = _blocks("bash")[0].strip().splitlines()
    assert first[0].endswith("pip install . && dlpipe demo")
    assert first[1].endswith("pip install -e '.[dev]' && pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    assert first[1] in ci.splitlines(), ".ci/run must run exactly the README's test command"


def test_python_api_example_runs(tmp_path) -> None:
    from dlpipe.synthetic import synthetic_samples

    (tmp_path / "cat1.jpg").write_bytes(next(synthetic_samples(1))["jpg"])
    code = _blocks("python")[0]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "1 ('cat', 'dog')" in done.stdout


def test_loader_example_runs_on_the_demo_output(tmp_path) -> None:
    bindir = Path(sys.executable).parent
    demo = subprocess.run(
        [str(bindir / "dlpipe"), "demo", "--per-class", "10"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert demo.returncode == 0, demo.stderr
    code = _blocks("python")[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "torch.Size([64, 3, 64, 64])" in done.stdout


def test_commands_on_the_demo_output_run(tmp_path) -> None:
    bindir = Path(sys.executable).parent
    env_path = f"{bindir}:/usr/bin:/bin"
    demo = subprocess.run(
        ["dlpipe", "demo", "--per-class", "5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": env_path},
    )
    assert demo.returncode == 0, demo.stderr
    blocks = [b.strip().splitlines() for b in _blocks("bash")[1:]]
    commands = [c for block in blocks if block[0].startswith("dlpipe ") for c in block]
    assert len(commands) >= 3 and all(c.startswith("dlpipe ") for c in commands)
    for command in commands:
        done = subprocess.run(
            command,
            shell=True,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={"PATH": env_path},
        )
        assert done.returncode == 0, (command, done.stderr)


def test_layout_snippets_match_the_code() -> None:
    """The documented readers use exactly the names the formats write."""
    from dlpipe.formats import hdf5, lmdb

    assert 'f["jpg.offsets"]' in README and "jpg.offsets" in hdf5.__doc__
    assert 'b"dlpipe.meta"' in README and lmdb.META_KEY == b"dlpipe.meta"
