"""How the commands echo a prompt beside its verdict."""

from __future__ import annotations

SHOWN_PROMPT_CHARACTERS = 300


def shown_prompt(prompt: str, *, quoted: bool = False) -> str:
    """The prompt as ``hf-lsad generate`` and ``explain`` echo it (``quoted``: as a Python string literal): a long one
    cut to its start, saying how long it is.

    The echo only says which prompt a verdict belongs to; an 8,000-token prompt printed whole would bury it.
    """
    start = prompt[:SHOWN_PROMPT_CHARACTERS]
    shown = repr(start) if quoted else start
    return shown if len(prompt) <= SHOWN_PROMPT_CHARACTERS else f"{shown} ... [{len(prompt):,} characters]"
