"""The manual is README.md plus docs/*.md: every command and code block in it runs, or is checked.

Each ```bash and ```python block of every page is claimed by exactly one rule below: run on the
demo's output (commands, and Python blocks with what they must print), or checked against what
it stands for (the quick start and Development against `.ci/run`; the multi-node rehearsal by
`tests/test_multinode.py`; the plain-webdataset reader by `tests/test_annotations.py`). A block
no rule claims fails `test_every_block_is_run_or_checked`. A command that cannot run in a test
(a Ray cluster, a cluster-wide torchrun) is an indented block, which is not a fenced block.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}: {self.text.splitlines()[0][:60]}"


def page_text(name: str) -> str:
    return (ROOT / name).read_text()


def blocks(language: str | None = None) -> list[Block]:
    """Every fenced block of the manual, README first, then docs/ by name."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if language is None or lang == language:
                found.append(Block(str(page.relative_to(ROOT)), lang, body))
    return found


def block(language: str, containing: str) -> Block:
    """The one block of the manual in `language` that holds `containing`."""
    (found,) = [b for b in blocks(language) if containing in b.text]
    return found


def commands_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def is_command_block(b: Block) -> bool:
    commands = commands_of(b.text)
    dlpipe_only = all(c.startswith("dlpipe ") for c in commands)
    return b.language == "bash" and bool(commands) and dlpipe_only


# A Python block's unique text -> (the folder it runs in, under the demo's; code appended; a
# pattern its output must match). The demo folder also holds `cat1.jpg`, which the writer reads.
PYTHON_RUNS = {
    "for step, (images, labels) in zip(range(4), loader)": ("", "", r"^step 3: loss \d+\.\d{3}\n$"),
    "dlpipe.DatasetWriter(": ("", "", r"^1 \('cat', 'dog'\)\n$"),
    "resumed.load_state_dict(state)": ("", "", r"^torch\.Size\(\[64, 3, 64, 64\]\) \[\d"),
    "min_crop_scale=0.35": ("", "", r"^\d+ \d+ torch\.Size\(\[\d+, 3, 64, 64\]\)\n$"),
    '"engine": "threads"': ("", "", r"^\d+ torch\.Size\(\[64, 3, 64, 64\]\)\n$"),
    "dlpipe.convert(": ("", "", r"^shapes-lmdb \d+ \d+\.\d s\n$"),
    'lmdb.open("train-000000.lmdb"': (
        "dlpipe-demo/shapes-lmdb",
        "\nprint(sorted(sample), sample['jpg'][:2])",
        r"^\['__key__', 'cls', 'jpg'\] b'\\xff\\xd8'\n$",
    ),
    'h5py.File("train-000000.h5")': (
        "dlpipe-demo/shapes-hdf5",
        "\nprint(label in range(8), jpg_bytes[:2])",
        r"^True b'\\xff\\xd8'\n$",
    ),
}

# Blocks another test runs or checks: (the block's unique text, that test's file, its name).
CHECKED_ELSEWHERE = [
    ("c10d", "tests/test_multinode.py", "test_two_nodes_on_loopback_checkpoint_and_the_run"),
    ('sample["boxes.json"]', "tests/test_annotations.py", "test_the_manual_reads_boxes_with_plain"),
    ("pip install . && dlpipe demo", "tests/test_readme.py", "test_quick_start_is_install"),
    (". .venv/bin/activate\nruff", "tests/test_readme.py", "test_development_commands_are_what"),
]


def how_checked(b: Block) -> list[str]:
    """The rules that claim a block (exactly one should)."""
    rules = ["run on the demo output"] if is_command_block(b) else []
    if b.language == "python":
        rules += [f"run: {key}" for key in PYTHON_RUNS if key in b.text]
    rules += [f"{file}::{name}" for key, file, name in CHECKED_ELSEWHERE if key in b.text]
    return rules


def test_every_block_is_run_or_checked() -> None:
    code = [b for b in blocks() if b.language in ("bash", "python")]
    assert len(code) >= 14, [str(b) for b in code]
    unclaimed = {str(b): how_checked(b) for b in code if len(how_checked(b)) != 1}
    assert not unclaimed, f"each block needs exactly one rule that runs or checks it: {unclaimed}"
    for _key, file, name in CHECKED_ELSEWHERE:
        assert f"def {name}" in (ROOT / file).read_text(), (file, name)
    for key in PYTHON_RUNS:
        assert len([b for b in blocks("python") if key in b.text]) == 1, key


def test_every_page_has_code_and_no_fence_is_left_open() -> None:
    for page in PAGES:
        text = page.read_text()
        assert text.count("\n```") % 2 == 0, page
    pages_with_code = {b.page for b in blocks() if b.language in ("bash", "python")}
    for name in ("loading", "converting", "training", "formats"):
        assert f"docs/{name}.md" in pages_with_code


BIN = Path(sys.executable).parent
ENV = {"PATH": f"{BIN}:/usr/bin:/bin"}  # the venv's commands, as an activated shell has them


def _run(command: str | list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, shell=isinstance(command, str), cwd=cwd, capture_output=True, text=True, env=ENV
    )


@pytest.fixture(scope="module")
def demo_cwd(tmp_path_factory) -> Path:
    """A folder where `dlpipe demo` has run, as the manual's examples assume."""
    from dlpipe.synthetic import synthetic_samples

    cwd = tmp_path_factory.mktemp("manual")
    demo = _run(["dlpipe", "demo", "--per-class", "10"], cwd)
    assert demo.returncode == 0, demo.stderr
    (cwd / "cat1.jpg").write_bytes(next(synthetic_samples(1))["jpg"])
    return cwd


@pytest.fixture(scope="module")
def command_runs(demo_cwd) -> dict[str, subprocess.CompletedProcess]:
    """Every `dlpipe` command of the manual, run once each, in page order, on the demo output."""
    runs: dict[str, subprocess.CompletedProcess] = {}
    for b in filter(is_command_block, blocks("bash")):
        for command in commands_of(b.text):
            if command not in runs:
                runs[command] = _run(command, demo_cwd)
    return runs


def test_the_commands_run_on_the_demo_output(command_runs) -> None:
    assert len(command_runs) >= 5
    for name in ("convert", "bench-loader", "train", "inspect", "verify"):
        assert any(c.startswith(f"dlpipe {name} ") for c in command_runs), name
    for command, done in command_runs.items():
        assert done.returncode == 0, (command, done.stderr)


def test_the_documented_train_output_is_what_train_prints(command_runs) -> None:
    (command,) = [c for c in command_runs if c.startswith("dlpipe train ")]
    shown = page_text("docs/training.md").split(f"{command}\n```\n", 1)[1].split("\n\n")[1]
    lines = [line.strip() for line in shown.splitlines()]
    printed = command_runs[command].stdout + command_runs[command].stderr
    assert lines[0] in printed and lines[1] in printed, (lines, printed)
    (loader,) = [line for line in printed.splitlines() if line.startswith("train loader ")]
    assert "(profile measured at batch 32, 64 px" in loader, "train uses what bench-loader saved"
    assert lines[2].startswith("train loader ") and "(profile " in lines[2]
    assert "epoch 2/2 | step 4 | train loss " in printed


@pytest.mark.parametrize("key", list(PYTHON_RUNS))
def test_the_python_blocks_run_on_the_demo_output(demo_cwd, key) -> None:
    folder, appended, expected = PYTHON_RUNS[key]
    (b,) = [b for b in blocks("python") if key in b.text]
    done = _run([sys.executable, "-c", b.text + appended], demo_cwd / folder)
    assert done.returncode == 0, done.stderr
    assert re.search(expected, done.stdout), (b.page, done.stdout)


def test_layout_snippets_match_the_code() -> None:
    """The documented readers use exactly the names the formats write."""
    from dlpipe.formats import hdf5, lmdb

    formats = page_text("docs/formats.md")
    assert 'f["jpg.offsets"]' in formats and "jpg.offsets" in (hdf5.__doc__ or "")
    assert 'b"dlpipe.meta"' in formats and lmdb.META_KEY == b"dlpipe.meta"


def test_the_manifest_example_is_the_manifest_schema() -> None:
    from dlpipe.manifest import SCHEMA_VERSION

    example = json.loads(block("json", '"schema": "dlpipe.manifest"').text)
    assert example["schema_version"] == SCHEMA_VERSION
    assert block("json", '"schema"').page == "docs/formats.md"
    assert f"`dlpipe.json` (schema version {SCHEMA_VERSION})" in page_text("docs/formats.md")


def test_the_training_config_example_loads(tmp_path) -> None:
    from dlpipe.train.config import load_config, plan_batches

    (toml,) = blocks("toml")
    assert toml.page == "docs/training.md"
    (tmp_path / "run.toml").write_text(toml.text)
    config = load_config(str(tmp_path / "run.toml"), {})
    assert config.model.name == "resnet50" and config.run.micro_batch == 128
    assert plan_batches(config.run.batch_size, 8, config.run.micro_batch).accumulation == 1


def test_the_source_table_lists_every_source_in_detection_order() -> None:
    from dlpipe.converters.sources import SOURCE_KINDS

    converting = page_text("docs/converting.md")
    table = converting.split("| source | raw layout | samples |", 1)[1].split("\n\n", 1)[0]
    kinds = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M)
    assert kinds == list(SOURCE_KINDS)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_and_anchor_resolves() -> None:
    links = 0
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), (page.name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, (page.name, target)
            links += 1
    assert links >= 20


def test_design_benchmark_and_error_figures_stay_in_the_manual() -> None:
    """Facts the README used to hold, each on its page (a guard against losing them in a move)."""
    expected = {
        "docs/benchmarks.md": ["| `dlpipe train` | 191.0 | 164.0 |", "| limit: draft decode alone"],
        "docs/security.md": ["ProfileSaveError", "| `bus error` / `DataLoader worker"],
        "docs/commands.md": [
            "`dlpipe doctor [--data-dir DIR] [--data URL] [--json]`",
            "0 when it finishes",
        ],
        "docs/formats.md": ["| 600 \u00d7 99 KB JPEGs | vlen |", "**No pickle anywhere.**"],
        "docs/loading.md": ["| another seed, shuffle, dataset or split |", "`--plot out.png`"],
        "docs/converting.md": ["| `--engine local\\|ray`, `--ray-address` |", "ray start --head"],
        "docs/training.md": ["**Early stopping:**", "`--nproc-per-node N` launches `torchrun`"],
    }
    for page, facts in expected.items():
        for fact in facts:
            assert fact in page_text(page), (page, fact)


@pytest.mark.parametrize("command", ["train", "bench-loader", "demo"])
def test_every_flag_a_command_takes_is_in_its_commands_row(command) -> None:
    """The flags are generated from the config's fields (`dlpipe.options`): a new option is
    documented in docs/commands.md, or this fails naming it."""
    from dlpipe.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {f for a in sub.choices[command]._actions for f in a.option_strings}
    flags -= {"-h", "--help"}
    row = next(
        line
        for line in (ROOT / "docs" / "commands.md").read_text().splitlines()
        if line.startswith(f"| `dlpipe {command} ")
    )
    documented = set(re.findall(r"--[a-z0-9-]+", row.replace("--[no-]", "--no-").split("` |")[0]))
    documented |= {f.replace("--no-", "--") for f in documented if f.startswith("--no-")}
    assert sorted(flags - documented) == [], f"undocumented {command} flags"
