"""The examples import ddpkit before torch, which it imports without the warning torch prints
where numpy is missing (an import sorter once moved ddpkit after torch, and the warning came back)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def _first_import_line(tree: ast.Module, package: str) -> int:
    lines = [10**9]
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == package or n.startswith(package + ".") for n in names):
            lines.append(node.lineno)
    return min(lines)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_imports_ddpkit_before_torch(path):
    tree = ast.parse(path.read_text())
    assert _first_import_line(tree, "ddpkit") < _first_import_line(tree, "torch"), path.name
