"""Dependencies point one way: components and schedulers use the app, never the reverse, so the
app runs (and is tested) without TorchX's component and scheduler layers."""

import ast
import pathlib

import pytest

# Tier (tests/conftest.py): pure logic, fast.
TIER = "unit"

REPO = pathlib.Path(__file__).resolve().parent.parent
#: Packages above the app: what builds and submits jobs.
ABOVE_THE_APP = ("components", "schedulers", "torchx_plugins")


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every module ``path`` imports (absolute imports; relative ones stay in their package)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("path", sorted((REPO / "apps").rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_the_app_imports_nothing_above_it(path):
    upward = sorted(m for m in imported_modules(path) if m.split(".")[0] in ABOVE_THE_APP)
    assert not upward, f"{path.relative_to(REPO)} imports {upward}: move what it needs under apps/"
