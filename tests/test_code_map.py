"""The code map in docs/design.md matches the tree: every package it names exists and every package is
in it, every module of a package is named in its row, every import (at module level or inside a
function) keeps to its stage's row, and every test file it names exists."""
from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"snapcompile.models": "models", "snapcompile.passes": "passes", "snapcompile.plugins": "plugins"}
FACADE = ROOT / "snapcompile" / "__init__.py"     # the public API: Engine, Request, loaded lazily


def code_map() -> dict[str, dict]:
    """stage -> {"folder", "imports" (stage names, or None for every stage), "tests"} from the table."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## Code map"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("stage", "---"):
            continue
        stage, folder, holds, imports, tests = cells
        names = None if imports == "every stage" else [
            f"snapcompile.{name.strip()}" for name in imports.split(",") if name.strip() and "(" not in name]
        rows[stage.strip("`")] = {"folder": folder.strip("`"), "imports": names,
                                  "modules": re.findall(r"`([\w*]+\.py)`", holds),
                                  "tests": re.findall(r"`(test_\w+\.py)`", tests)}
    return rows


def packages_in_tree() -> dict[str, Path]:
    """Every package of the installed snapcompile, by import name, with its folder."""
    found = {f"snapcompile.{p.parent.name}": p.parent for p in (ROOT / "snapcompile").glob("*/__init__.py")}
    found.update({name: ROOT / folder for name, folder in TOP_LEVEL.items()})
    return found


def stage_of(module: str, stages: set[str]) -> str:
    """The stage an imported module belongs to ("foundation" for snapcompile's top-level modules)."""
    parts = module.split(".")
    package = ".".join(parts[:2])
    return package if package in stages else "foundation"


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every snapcompile import in a file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "snapcompile":
            names = [node.module] if node.module != "snapcompile" else [f"snapcompile.{a.name}" for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "snapcompile"]
    return found


def test_every_package_is_in_the_code_map_and_every_one_named_exists():
    rows, tree = code_map(), packages_in_tree()
    assert set(rows) - {"foundation"} == set(tree)
    for stage, row in rows.items():
        folder = "snapcompile" if stage == "foundation" else row["folder"].rstrip("/")
        assert (ROOT / folder.replace("/*.py", "")).is_dir(), stage
        if stage != "foundation":
            assert ROOT / folder == tree[stage], (stage, folder)


def test_every_module_is_named_in_its_stages_row():
    """A newcomer finds any module's room from the table: each package's modules (but __init__.py)
    are named in the "holds" cell, by name or by a `prefix*.py` pattern."""
    rows, tree = code_map(), packages_in_tree()
    folders = {"foundation": ROOT / "snapcompile", **tree}
    missing = []
    for stage, folder in folders.items():
        patterns = rows[stage]["modules"]
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py" and not any(fnmatch.fnmatch(path.name, p) for p in patterns):
                missing.append(f"{stage}: {path.name}")
    assert not missing, "modules the code map does not name:\n" + "\n".join(missing)


def test_every_test_file_the_code_map_names_exists():
    for stage, row in code_map().items():
        assert row["tests"], f"{stage} names no test file"
        for name in row["tests"]:
            assert (ROOT / "tests" / name).is_file(), (stage, name)


def test_every_import_keeps_to_its_stage():
    rows, tree = code_map(), packages_in_tree()
    stages = set(tree)
    files = {"foundation": [p for p in (ROOT / "snapcompile").glob("*.py") if p != FACADE]}
    files.update({stage: list(folder.rglob("*.py")) for stage, folder in tree.items()})
    wrong = []
    for stage, paths in files.items():
        allowed = rows[stage]["imports"]
        for path in paths:
            for line, module in imports_of(path):
                target = stage_of(module, stages)
                if target in (stage, "foundation") or allowed is None or target in allowed:
                    continue
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({stage} may not import {target})")
    assert not wrong, "\n".join(wrong)


def test_the_foundation_imports_only_itself():
    stages = set(packages_in_tree())
    for path in (ROOT / "snapcompile").glob("*.py"):
        if path == FACADE:
            continue
        for line, module in imports_of(path):
            assert stage_of(module, stages) == "foundation", f"{path.name}:{line} imports {module}"
