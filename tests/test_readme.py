"""The README is the manual's first page: what dlpipe is, install and the demo (what CI runs),
your data in three commands and ten lines of Python, then links to docs/. Its blocks, and every
page's, are run or checked by `tests/test_docs.py`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_quick_start_is_install_and_demo_then_install_dev_and_test() -> None:
    first = _blocks("bash")[0].strip().splitlines()
    assert first[0].endswith("pip install . && dlpipe demo")
    assert first[1].endswith("pip install -e '.[dev]' && pytest")
    steps = [step for line in CI.splitlines() for step in line.split(" && ")]
    wanted = first[1].split(" && ")
    at = [steps.index(step) for step in wanted]
    assert at == sorted(at), ".ci/run must run the README's test command's steps, in order"


def test_development_commands_are_what_ci_runs() -> None:
    (block,) = re.findall(r"```bash\n(\. \.venv/bin/activate\n.*?)```", README, flags=re.S)
    checks = [c for line in block.splitlines()[1:] for c in line.split(" && ")]
    assert checks == [
        "ruff check .",
        "ruff format --check .",
        "mypy dlpipe converters train",
        "pytest",
    ]
    steps = [step for line in CI.splitlines() for step in line.split(" && ")]
    at = [steps.index(check) for check in checks]  # ValueError: .ci/run does not run it
    assert at == sorted(at), ".ci/run runs the lint, format and type checks before pytest"


def test_the_readme_is_at_most_300_lines() -> None:
    assert len(README.splitlines()) <= 300


def test_the_first_screen_is_install_demo_then_your_data_in_three_commands_and_python() -> None:
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings[:2] == ["Quick start", "Your data in three commands"]
    three = _blocks("bash")[1].strip().splitlines()
    assert [line.split()[1] for line in three] == ["convert", "bench-loader", "train"]
    converted = three[0].split("--out ")[1].split()[0]
    assert three[1].split()[2] == converted and three[2].split()[2] == converted
    ten = _blocks("python")[0].strip().splitlines()
    assert len([line for line in ten if line]) <= 11 and README.index(ten[0]) < README.index(
        "\n## Speed\n"
    )


def test_one_speed_table_with_the_peers_linked_to_the_benchmark() -> None:
    speed = _section("Speed")
    tables = re.findall(r"^\| contender .*?(?=\n\n|\Z)", speed, flags=re.S | re.M)
    assert len(tables) == 1
    for peer in ("ImageFolder", "FFCV", "DALI", "`make_loader` lmdb"):
        assert peer in tables[0]
    assert "(benchmarks/results/loader.md)" in speed and "(docs/benchmarks.md)" in speed
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    assert tables[0] in table, "the README's table is the benchmark page's, figure for figure"


def test_the_readme_links_every_docs_page() -> None:
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert {"loading.md", "converting.md", "training.md", "formats.md"} <= set(pages)
    assert {"security.md", "benchmarks.md", "design.md"} <= set(pages)
    for page in pages:
        assert f"(docs/{page})" in README, f"README.md does not link docs/{page}"


def test_the_commands_table_names_every_subcommand() -> None:
    from dlpipe.cli import build_parser

    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if a.dest == "command"]
    table = _section("Commands")
    commands = (ROOT / "docs" / "commands.md").read_text()
    for name in subparsers.choices:
        assert f"| `dlpipe {name}" in table and f"| `dlpipe {name}" in commands, name
