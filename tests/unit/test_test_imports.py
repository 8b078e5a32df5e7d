"""Tests import no other test module: what several test modules share lives in tests/support/ or a conftest.py
(docs/testing.md), so a test module can move, shrink or go without breaking another."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def is_test_module(name: str) -> bool:
    return name.split(".")[-1].startswith("test_") and (name.startswith("tests.") or "." not in name)


def test_no_module_under_tests_imports_a_test_module():
    offenders = {
        str(path.relative_to(TESTS)): sorted(filter(is_test_module, imported_modules(path)))
        for path in sorted(TESTS.rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    module = tmp_path / "test_x.py"
    module.write_text(
        "from tests.unit.test_reward import trajectory\nimport test_envs\nfrom tests.support import drill\n"
    )
    assert sorted(filter(is_test_module, imported_modules(module))) == ["test_envs", "tests.unit.test_reward"]
