"""The repository is lint-clean: ``ruff check`` with the rules of ``[tool.ruff]`` in pyproject.toml.

ruff is in the ``test`` extra, so a missing ruff fails this test rather than skipping it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

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


# Names the README's snippets leave to the reader (their data), declared so the snippets type-check as written.
README_PLACEHOLDERS = "dosage_prompts: list[str]\nmy_ok_prompts: list[str]\n"


def readme_snippets() -> str:
    """The README's Python blocks, in order, as one module: each block uses the names the ones before it made.
    The OpenAI client's block is left out: its types are openai's, not ours."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return README_PLACEHOLDERS + "\n".join(block for block in blocks if "from openai import" not in block)


def test_readme_snippets_are_found():
    snippets = readme_snippets()
    assert "GuardedModelForCausalLM(" in snippets and "add_head(" in snippets and "push_to_hub(" in snippets


def test_mypy_is_clean(tmp_path):
    """The package, the examples and the README's snippets type-check (``[tool.mypy]`` in pyproject.toml): hf_lsad
    ships ``py.typed``, so a user's type checker takes its annotations at their word, and the examples and the README
    call the public API as users do."""
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: it is a test dependency (pip install -e '.[test]')", pytrace=False)
    readme = tmp_path / "readme_snippets.py"
    readme.write_text(readme_snippets())
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    # the cache goes to tmp_path: nothing is written into the checkout
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy"), "--no-color-output"]
    result = subprocess.run([*command, *files, str(readme)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(
            f"`python -m mypy {' '.join(files)} <README snippets>` in {ROOT} exited {result.returncode} "
            f"(the README's snippets: {readme}):\n{result.stdout}{result.stderr}",
            pytrace=False,
        )
