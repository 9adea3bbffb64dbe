"""Every data file of the package ships in its wheel: the package-data globs of pyproject.toml reach each one.

An editable install reads the source tree, so a file no glob reaches works in development and is missing only for
users who install the wheel (the bundled guard's head weights once were: ``heads/`` sat below every glob)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def shipped_files() -> set[Path]:
    """The files setuptools puts in the wheel beside the modules: each package's package-data globs, from its
    folder."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = set()
    for package, patterns in globs.items():
        folder = ROOT / package.replace(".", "/")
        for pattern in patterns:
            shipped |= {path.resolve() for path in folder.glob(pattern) if path.is_file()}
    return shipped


def data_files() -> set[Path]:
    """Every file of the package that is not Python source (following the link to the model card templates)."""
    found = set()
    for folder, _, names in os.walk(ROOT / "hf_lsad", followlinks=True):
        if Path(folder).name == "__pycache__":
            continue
        found |= {(Path(folder) / name).resolve() for name in names if not name.endswith((".py", ".pyc"))}
    return found


def test_every_data_file_is_in_the_wheel():
    missing = sorted(str(path.relative_to(ROOT)) for path in data_files() - shipped_files())
    assert not missing, f"no package-data glob in pyproject.toml reaches {missing}"


def test_the_bundled_guards_and_the_typing_marker_are_data_files():
    # the check above is only as good as its walk: the guards' weights must be among the files it sees, and the PEP 561
    # marker that lets a user's type checker read hf_lsad's annotations
    found = data_files()
    for guard in ("smollm2-135m-instruct", "smollm2-135m-instruct-paper"):
        weights = {path for path in found if path.is_relative_to(ROOT / "hf_lsad" / "guards" / guard)}
        assert any(path.name == "sae.safetensors" for path in weights), guard
    assert (ROOT / "hf_lsad/guards/smollm2-135m-instruct/heads/harm.safetensors").resolve() in found
    assert (ROOT / "hf_lsad/py.typed").resolve() in found
