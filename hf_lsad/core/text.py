"""Text a tokenizer can encode.

A Python ``str`` can hold a lone surrogate (half of a UTF-16 pair) that no encoding writes: JSON's ``\\ud800`` escape
decodes to one, and so does a byte that is not UTF-8 in a command-line argument (``surrogateescape``). A tokenizer
given one fails with ``TextEncodeInput must be Union[...]``; every place that takes text from a user asks
:func:`unencodable` first and names the character. Imports nothing heavy: the command line's parser reads tables.
"""

from __future__ import annotations


def unencodable(text: str) -> str | None:
    """Why ``text`` is not Unicode text a tokenizer can encode, ``None`` when it is: it holds a lone surrogate."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"not Unicode text: a lone surrogate (U+{ord(text[err.start]):04X}) at character {err.start}"
    return None
