"""The repository is lint-clean: ``ruff check`` with the rules of ``[tool.ruff]`` in pyproject.toml.

ruff is in the ``test`` extra, so a missing ruff fails this test rather than skipping it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["hf_lsad", "tests", "examples", "scripts", "benchmarks"]


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: it is a test dependency (pip install -e '.[test]')", pytrace=False)
    # --no-cache: nothing is written into the checkout
    command = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *CHECKED]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(
            f"`python -m ruff check {' '.join(CHECKED)}` in {ROOT} exited {result.returncode}:\n"
            f"{result.stdout}{result.stderr}",
            pytrace=False,
        )


def test_ruff_format_is_clean():
    """The formatter lays the code out: no hand-packed lines, and no marker that turns it off."""
    command = [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *CHECKED]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"`ruff format --check` would reformat:\n{result.stdout}{result.stderr}", pytrace=False)
    marker = "fmt: " + "skip"  # spelled apart so this file does not carry it
    skips = [str(p) for folder in CHECKED for p in (ROOT / folder).rglob("*.py") if marker in p.read_text()]
    assert not skips, f"{marker!r} in {skips}"


def test_mypy_is_clean(tmp_path):
    """The package and the examples type-check (``[tool.mypy]`` in pyproject.toml): hf_lsad ships ``py.typed``, so
    a user's type checker takes its annotations at their word, and the examples call the public API as users do."""
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: it is a test dependency (pip install -e '.[test]')", pytrace=False)
    # the cache goes to tmp_path: nothing is written into the checkout
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy"), "--no-color-output"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(
            f"`python -m mypy` in {ROOT} exited {result.returncode}:\n{result.stdout}{result.stderr}", pytrace=False
        )
