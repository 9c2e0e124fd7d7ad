"""Lint: ``ruff check`` (pyproject.toml's ``[tool.ruff]``: pycodestyle errors and warnings, pyflakes, lines of
120) passes on every folder of the repository, and no test module imports another (shared helpers live in
``shared.py``, ``parity.py`` and the ``*_models.py`` modules)."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

@pytest.mark.parametrize("folder", ["cp_passes", "model_specs", "tests", "benchmarks", "examples"])
def test_ruff_check_passes(folder):
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", folder], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check {folder} exited {done.returncode}:\n{done.stdout}{done.stderr}"


def test_no_test_module_imports_another():
    tests = {path.stem for path in (ROOT / "tests").glob("test_*.py")}
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[-1] in tests or name.startswith("tests.test_")]
    assert not found, "a helper two test modules need goes to shared.py or parity.py:\n" + "\n".join(found)
