"""The dependency direction of DESIGN.md: converters → core ← loading ← train.

The core (``dlpipe/*.py``, ``dlpipe/formats/``) imports neither the converters, the loading
room nor the trainer, except the CLI and the demo recipe next to it, which wire the rooms with
imports inside their functions (and ``dlpipe/__init__.py``, which re-exports the loading room's
public names); the loading room never imports the converters or the trainer. Read from the
source with ``ast``, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dlpipe

PACKAGE = Path(dlpipe.__file__).parent
CORE = sorted(PACKAGE.glob("*.py")) + sorted((PACKAGE / "formats").glob("*.py"))
LOADING = sorted((PACKAGE / "loading").glob("*.py"))
WIRING = {"cli.py", "demo.py"}  # may import any room, inside functions only
# a subcommand's handler module, which only cli.py imports (inside a function): CLI wiring,
# allowed into what it names
HANDLERS = {"tune_command.py": ("dlpipe.loading",)}
ROOMS = ("dlpipe.converters", "dlpipe.train", "dlpipe.loading")


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module level) for every import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                package = path.parent.relative_to(PACKAGE.parent).parts
                base = ".".join([*package[: len(package) - node.level + 1], base]).rstrip(".")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def _into(name: str, rooms: tuple[str, ...]) -> bool:
    return any(name == room or name.startswith(room + ".") for room in rooms)


def test_the_walk_sees_every_room_and_catches_a_lazy_import(tmp_path) -> None:
    assert len(CORE) > 15 and len(LOADING) > 4
    probe = PACKAGE / "formats" / "__init__.py"
    assert any(name.startswith("dlpipe.formats") for name, _, _ in _imports(probe))
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from dlpipe.train import trainer\n")
    assert ("dlpipe.train", 2, False) in _imports(lazy)


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_imports_no_room_outside_the_cli_wiring(path: Path) -> None:
    allowed = HANDLERS.get(path.name, ("dlpipe.loading",) if path.name == "__init__.py" else ())
    for name, line, module_level in _imports(path):
        if not _into(name, ROOMS) or _into(name, allowed):
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        assert path.parent == PACKAGE and path.name in WIRING, where
        assert not module_level, f"{where} at module level; import it inside the function"


@pytest.mark.parametrize("path", LOADING, ids=lambda p: p.name)
def test_the_loading_room_never_imports_the_converters_or_the_trainer(path: Path) -> None:
    for name, line, _ in _imports(path):
        assert not _into(name, ("dlpipe.converters", "dlpipe.train")), f"{path.name}:{line} {name}"


def test_only_the_cli_imports_the_subcommand_handler_modules() -> None:
    for path in CORE + LOADING:
        for name, line, module_level in _imports(path):
            if name.removeprefix("dlpipe.") in {h.removesuffix(".py") for h in HANDLERS}:
                assert path.name == "cli.py" and not module_level, f"{path.name}:{line} {name}"


def test_importing_dlpipe_and_the_demo_loads_neither_converters_nor_trainer() -> None:
    code = (
        "import sys, dlpipe, dlpipe.demo, dlpipe.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('dlpipe.converters', "
        "'dlpipe.train'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    public = subprocess.run(
        [sys.executable, "-c", "import dlpipe; print(dlpipe.convert.__module__)"],
        capture_output=True,
        text=True,
    )
    assert public.stdout.strip() == "dlpipe.converters.engine", public.stderr


def test_the_loader_drives_both_sample_orders_through_one_contract() -> None:
    """`loader.py` names neither order, view nor dataset kind, and `PreparedLoader` branches
    on no type: map-style and stream loading differ only behind `PassOrder` and `plan_view`."""
    path = PACKAGE / "loading" / "loader.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = {"EpochSampler", "StreamOrder", "MapView", "StreamView", "MapDataset", "StreamDataset"}
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not named & kinds, f"loader.py names {sorted(named & kinds)}"
    loader = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PreparedLoader"
    )
    calls = [
        n.func.id
        for n in ast.walk(loader)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
    assert "isinstance" not in calls and "type" not in calls, "PreparedLoader branches on a type"


def test_reading_a_manifest_reaches_no_shard_format() -> None:
    """What ``import dlpipe.manifest`` runs (the package's ``__init__`` first), and what that
    imports in turn (inside functions too), never reaches ``dlpipe.formats``: the manifest knows
    the formats by name, suffix and version (``dlpipe.dataset_names``), so reading one loads
    neither lmdb nor h5py."""

    def type_checking_lines(path: Path) -> set[int]:  # imports there never run
        tree = ast.parse(path.read_text(encoding="utf-8"))
        blocks = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.If)
            and isinstance(n.test, ast.Name)
            and n.test.id == "TYPE_CHECKING"
        ]
        return {line for b in blocks for line in range(b.lineno, (b.end_lineno or b.lineno) + 1)}

    def path_of(name: str) -> Path | None:
        folder = PACKAGE.joinpath(*name.split(".")[1:])
        return next(
            (p for p in (folder / "__init__.py", folder.with_suffix(".py")) if p.is_file()), None
        )

    seen, todo = set(), ["dlpipe.manifest"]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        runs = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # parents first
        for module in (m for m in runs if m not in seen):
            path = path_of(module)
            if path is not None:
                seen.add(module)
                typing_only = type_checking_lines(path)
                todo += [
                    n
                    for n, line, _ in _imports(path)
                    if n.startswith("dlpipe") and line not in typing_only
                ]
    assert {"dlpipe", "dlpipe.unfinished", "dlpipe.dataset_names"} <= seen  # the walk follows
    assert not [n for n in seen if _into(n, ("dlpipe.formats",))], sorted(seen)


def test_no_module_but_the_entry_points_imports_the_cli(tmp_path) -> None:
    """Every room and the core reach argparse helpers, escaping and config through core modules
    (`dlpipe.options`, `dlpipe.text`); only ``dlpipe/cli.py`` and ``dlpipe/__main__.py`` name
    ``dlpipe.cli``, so no import circle runs through it. Every module of dlpipe, converters
    and train, at any nesting, inside functions too."""
    entry_points = {PACKAGE / "cli.py", PACKAGE / "__main__.py"}
    folders = (PACKAGE, PACKAGE.parent / "converters", PACKAGE.parent / "train")
    modules = sorted(p for folder in folders for p in folder.rglob("*.py"))
    assert len(modules) > 100 and not entry_points - set(modules)
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from dlpipe import cli\n")
    assert [n for n, _, _ in _imports(probe) if _into(n, ("dlpipe.cli",))]  # the walk sees it
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
        for path in modules
        if path not in entry_points
        for name, line, _ in _imports(path)
        if _into(name, ("dlpipe.cli",))
    ]
    assert not found, found
