"""Guards that ship inside the package (fitted with benchmarks/fit_default_guard.sh)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_GUARD = Path(__file__).parent / "guards" / "smollm2-135m-instruct"
"""FreqMask-KM guard for SmolLM2-135M-Instruct, fitted on the bundled safe pool."""


def resolve_guard(name_or_path: str | os.PathLike) -> str | os.PathLike:
    """``default`` means :data:`DEFAULT_GUARD`; anything else is a folder or Hub repo id."""
    return DEFAULT_GUARD if str(name_or_path) == "default" else name_or_path
