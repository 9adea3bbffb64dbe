"""Serving a guarded model over HTTP, compatible with the OpenAI API (:mod:`hf_lsad.serving.app`).

Needs the ``serve`` extra (``pip install 'hf-lsad[serve]'``: FastAPI and uvicorn); importing this package without it
raises an ``ImportError`` that says so.
"""

from __future__ import annotations

SERVE_EXTRA = "pip install 'hf-lsad[serve]'"
"""The install line for what serving needs."""

try:
    from .app import ServeConfig, create_app, raw_prompt_note
except ModuleNotFoundError as err:  # fastapi or uvicorn missing
    if err.name not in ("fastapi", "starlette", "uvicorn", "pydantic"):
        raise
    raise ImportError(f"serving needs FastAPI and uvicorn, which are not installed: {SERVE_EXTRA}") from err

__all__ = ["SERVE_EXTRA", "ServeConfig", "create_app", "raw_prompt_note"]
