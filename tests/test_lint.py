"""The repository is lint-clean: ``ruff check`` with the rules of ``[tool.ruff]`` in pyproject.toml.

ruff is in the ``test`` extra, so a missing ruff fails this test rather than skipping it.
"""

from __future__ import annotations

import importlib.util
import os
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


# The pages whose Python blocks are type-checked, and the names each page's blocks leave to the reader (its data,
# or what the page's prose says was made before), declared so that the blocks type-check as written.
SNIPPET_PLACEHOLDERS = {
    "README.md": """
dosage_prompts: list[str]
my_ok_prompts: list[str]
""",
    "docs/usage.md": "",
    "docs/generation.md": """
from hf_lsad.capture import EncodedPrompts
from hf_lsad.detectors.freqmask import FreqMaskConfig
from hf_lsad.sae import SparseAutoencoder
safe_prompts: list[str]
many_prompts: list[str]
config: FreqMaskConfig
sae: SparseAutoencoder
inputs: EncodedPrompts
""",
    "docs/heads.md": """
from torch import Tensor
from hf_lsad import GuardedModelForCausalLM, SafetyGuard
from hf_lsad.capture import EncodedPrompts
guarded: GuardedModelForCausalLM
inputs: EncodedPrompts
guard: SafetyGuard
reads: dict[tuple[int, str], Tensor]
labels: Tensor
sources: list[str]
validation_chat_reads: dict[tuple[int, str], Tensor]
dosage_prompts: list[str]
my_ok_prompts: list[str]
my_benign_prompts: list[str]
""",
    "docs/saes-and-scale.md": "",
}


def python_blocks(page: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each Python block of ``page``: the line of the block's first code line."""
    text = (ROOT / page).read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def page_snippets(page: str) -> str:
    """A page's Python blocks, in order, as one module: each block uses the names the ones before it made, and a
    comment before it names the page and line a finding is on. The OpenAI client's blocks are left out: their types
    are openai's, not ours."""
    blocks = [
        f"# {page}, line {line}\n{code}" for line, code in python_blocks(page) if "from openai import" not in code
    ]
    return SNIPPET_PLACEHOLDERS[page] + "\n".join(blocks)


def test_every_page_with_snippets_is_checked():
    """A new page of Python examples, or a new block on a page, is type-checked like the rest."""
    pages = [p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    with_code = {page for page in pages if any("from openai import" not in b for _, b in python_blocks(page))}
    assert with_code == set(SNIPPET_PLACEHOLDERS)
    readme = page_snippets("README.md")
    assert "GuardedModelForCausalLM(" in readme and "add_head(" in readme and "push_to_hub(" in readme


def mypy_cache_dir(tmp_path: Path) -> Path:
    """mypy's incremental cache. In the virtual environment that runs the tests (``.venv``, ignored by git), so that
    a second run checks only what changed (the first reads torch and transformers: about 80 s on 2 cores, a few
    seconds after); outside one, a fresh folder each run. Nothing is written among the checkout's files."""
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "mypy-cache"
    return tmp_path / "mypy"


def test_mypy_is_clean(tmp_path):
    """The package, the examples and the snippets of the README and docs type-check (``[tool.mypy]`` in
    pyproject.toml): hf_lsad ships ``py.typed``, so a user's type checker takes its annotations at their word, and the
    examples and the pages call the public API as users do."""
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: it is a test dependency (pip install -e '.[test]')", pytrace=False)
    snippets = []
    for page in SNIPPET_PLACEHOLDERS:
        snippets.append(tmp_path / f"snippets_{Path(page).stem.replace('-', '_')}.py")
        snippets[-1].write_text(page_snippets(page))
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    command = [sys.executable, "-m", "mypy", "--cache-dir", str(mypy_cache_dir(tmp_path)), "--no-color-output"]
    paths = [*files, *map(str, snippets)]
    result = subprocess.run([*command, *paths], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(
            f"`python -m mypy {' '.join(files)} <the pages' snippets>` in {ROOT} exited {result.returncode} "
            f"(the snippets, page by page, in {tmp_path}; a comment before each block names its page and line):\n"
            f"{result.stdout}{result.stderr}",
            pytrace=False,
        )
