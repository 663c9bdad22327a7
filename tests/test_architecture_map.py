"""docs/architecture.md is the living map: its tables name every package file, and nothing else.

A table's first column lists files in backticks, relative to the folder its section heading names
(a heading of the form "### `prefill/`")."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "prefill", "decode", "bootstrap", "kvtransfer")
HEADING = re.compile(r"^#+ `([\w/]+/)`\s*$")
NAME = re.compile(r"`([\w/]+\.py)`")


def listed_files(text: str) -> list[str]:
    """Every file a table row of the map names, as a path from the repository root."""
    return [path for files, _ in rows(text) for path in files]


def package_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_the_map_lists_every_package_file_once_and_no_other():
    listed = listed_files((ROOT / "docs" / "architecture.md").read_text())
    assert sorted(set(listed) - package_files()) == []  # named, but not in the tree
    assert sorted(package_files() - set(listed)) == []  # in the tree, but not on the map
    assert len(listed) == len(set(listed))


def test_the_parser_reads_folders_from_headings():
    text = "### `a/b/`\n\n| file | owns |\n|---|---|\n| `x.py`, `c/y.py` | `z.py` in prose |\n## Other\n| `w.py` | |\n"
    assert listed_files(text) == ["a/b/x.py", "a/b/c/y.py"]


PROCESSES = {"front", "worker", "router", "registry", "cli", "tests", "any"}
TORCH_FREE = {"front", "router", "registry"}  # processes that never import torch (they start fast)


def rows(text: str) -> list[tuple[list[str], set[str]]]:
    """(the files of a row, as paths from the root; the processes its "runs in" cell names)."""
    folder, found = None, []
    for line in text.splitlines():
        heading = HEADING.match(line)
        if heading:
            folder = heading.group(1)
        elif line.startswith("#"):
            folder = None
        elif line.startswith("| `") and folder is not None:
            cells = line.split("|")
            found.append(([folder + name for name in NAME.findall(cells[1])], {p.strip() for p in cells[2].split(",")}))
    return found


def test_every_row_names_the_processes_it_runs_in():
    found = rows((ROOT / "docs" / "architecture.md").read_text())
    assert len(found) > 100
    assert [(files, procs) for files, procs in found if not procs or procs - PROCESSES] == []
    assert {proc for _, procs in found for proc in procs} == PROCESSES


def test_files_of_the_torch_free_processes_import_without_torch():
    """Every file a torch-free process runs (a row that names front, router, registry or any) is
    imported in a fresh interpreter: torch must not load. Those processes start fast and stay small."""
    found = rows((ROOT / "docs" / "architecture.md").read_text())
    modules = sorted(
        path[:-3].replace("/", ".").removesuffix(".__init__") for files, procs in found
        if procs & (TORCH_FREE | {"any"}) for path in files)
    assert "disagg.dp.controller" in modules and "disagg.router.proxy" in modules and "disagg.worker.roles" in modules
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_row_parser_reads_processes():
    text = "### `a/`\n\n| file | runs in | owns |\n|---|---|---|\n| `x.py`, `y.py` | front, worker | what |\n"
    assert rows(text) == [(["a/x.py", "a/y.py"], {"front", "worker"})]
