"""The README is the user's manual: its quick start is what CI runs, its commands run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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


BIN = Path(sys.executable).parent
ENV = {"PATH": f"{BIN}:/usr/bin:/bin"}  # the venv's commands, as an activated shell has them


def _run(command: str | list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, shell=isinstance(command, str), cwd=cwd, capture_output=True, text=True, env=ENV
    )


@pytest.fixture(scope="module")
def demo_cwd(tmp_path_factory) -> Path:
    """A folder where `dlpipe demo` has run, as the README's examples assume."""
    cwd = tmp_path_factory.mktemp("readme")
    demo = _run(["dlpipe", "demo", "--per-class", "10"], cwd)
    assert demo.returncode == 0, demo.stderr
    return cwd


def test_python_api_example_runs(tmp_path) -> None:
    from dlpipe.synthetic import synthetic_samples

    (tmp_path / "cat1.jpg").write_bytes(next(synthetic_samples(1))["jpg"])
    done = _run([sys.executable, "-c", _blocks("python")[1]], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 ('cat', 'dog')" in done.stdout


def test_loader_example_runs_on_the_demo_output(demo_cwd) -> None:
    done = _run([sys.executable, "-c", _blocks("python")[2]], demo_cwd)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([64, 3, 64, 64])" in done.stdout


def test_convert_api_example_runs_on_the_demo_output(demo_cwd) -> None:
    block = _blocks("python")[5]
    assert "dlpipe.convert(" in block
    done = _run([sys.executable, "-c", block], demo_cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("shapes-lmdb ") and done.stdout.strip().endswith(" s")


def test_loader_config_example_runs_on_the_demo_output(demo_cwd) -> None:
    block = _blocks("python")[3]
    assert "LoaderConfig(" in block and "WorkerSettings(" in block
    done = _run([sys.executable, "-c", block], demo_cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(", 3, 64, 64])")


def test_thread_engine_example_runs_on_the_demo_output(demo_cwd) -> None:
    block = _blocks("python")[4]
    assert 'engine="threads"' in block
    done = _run([sys.executable, "-c", block], demo_cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("torch.Size([64, 3, 64, 64])")


def test_ten_line_training_loop_runs_on_the_demo_output(demo_cwd) -> None:
    done = _run([sys.executable, "-c", _blocks("python")[0]], demo_cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("step 3: loss ")


def test_commands_on_the_demo_output_run(demo_cwd) -> None:
    blocks = [b.strip().splitlines() for b in _blocks("bash")[1:]]
    commands = [c for block in blocks if block[0].startswith("dlpipe ") for c in block]
    assert len(commands) >= 3 and all(c.startswith("dlpipe ") for c in commands)
    for command in commands:
        done = _run(command, demo_cwd)
        assert done.returncode == 0, (command, done.stderr)


def test_layout_snippets_match_the_code() -> None:
    """The documented readers use exactly the names the formats write."""
    from dlpipe.formats import hdf5, lmdb

    assert 'f["jpg.offsets"]' in README and "jpg.offsets" in hdf5.__doc__
    assert 'b"dlpipe.meta"' in README and lmdb.META_KEY == b"dlpipe.meta"


def test_the_training_config_example_loads(tmp_path) -> None:
    from dlpipe.train.config import load_config, plan_batches

    (toml,) = _blocks("toml")
    (tmp_path / "run.toml").write_text(toml)
    config = load_config(str(tmp_path / "run.toml"), {})
    assert config.model.name == "resnet50" and config.run.micro_batch == 128
    assert plan_batches(config.run.batch_size, 8, config.run.micro_batch).accumulation == 1


def test_the_source_table_lists_every_source_in_detection_order() -> None:
    from dlpipe.converters.sources import SOURCE_KINDS

    table = README.split("| source | raw layout | samples |", 1)[1].split("\n\n", 1)[0]
    kinds = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M)
    assert kinds == list(SOURCE_KINDS)
