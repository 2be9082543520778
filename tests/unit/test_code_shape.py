"""No production file over 400 lines, no function over 60 lines of code (its docstring not counted): issue 51's bar
for files with one job and functions a reader holds in one screen. Derived from the source with `ast`, so a file or
function that grows past the bar fails here by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("ppoflow", "adaptations", "storage", "engines", "stages", "tasks", "runtime", "flows", "cli")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def production_files() -> list[Path]:
    return sorted(path for package in PACKAGES if (REPO / package).is_dir() for path in (REPO / package).rglob("*.py"))


def function_code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the `def` to the function's last line, less its docstring's lines (decorators not counted)."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_function_code_lines_leaves_out_the_docstring_only():
    tree = ast.parse('def f(x):\n    """Two\n    lines."""\n    y = x\n    return y\n\ndef g():\n    return 1\n')
    f, g = tree.body
    assert function_code_lines(f) == 3  # def, y = x, return y
    assert function_code_lines(g) == 2


def test_the_packages_exist():
    assert len(production_files()) > 100  # a renamed package would otherwise empty the checks below


@pytest.mark.parametrize("path", production_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_production_file_is_over_the_bar(path: Path):
    name = str(path.relative_to(REPO))
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{name} has {lines} lines (bar {MAX_FILE_LINES})"


def test_no_function_is_over_the_bar():
    long = []
    for path in production_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and function_code_lines(node) > MAX_FUNCTION_LINES
            ):
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({function_code_lines(node)} lines)")
    assert long == [], long
