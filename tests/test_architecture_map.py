"""docs/architecture.md is the living map: its tables name every package file, and nothing else.

A table's first column lists files in backticks, relative to the folder its section heading names
(a heading of the form "### `prefill/`")."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "prefill", "decode", "bootstrap", "kvtransfer")
HEADING = re.compile(r"^#+ `([\w/]+/)`\s*$")
NAME = re.compile(r"`([\w/]+\.py)`")


def listed_files(text: str) -> list[str]:
    """Every file a table row of the map names, as a path from the repository root."""
    folder, found = None, []
    for line in text.splitlines():
        heading = HEADING.match(line)
        if heading:
            folder = heading.group(1)
        elif line.startswith("#"):
            folder = None
        elif line.startswith("|") and folder is not None:
            first_cell = line.split("|")[1]
            found += [folder + name for name in NAME.findall(first_cell)]
    return found


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
