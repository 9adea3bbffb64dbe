"""The ``hf-lsad`` command (``python -m hf_lsad.cli`` and ``accelerate launch -m hf_lsad.cli`` run it too)."""

from .main import COMMANDS, build_parser, entry, main

__all__ = ["COMMANDS", "build_parser", "entry", "main"]
