"""Prompts from a user's table: a JSONL, JSON, CSV or Parquet file, a text file (one prompt per line), or a dataset
the ``datasets`` library loads.

What ``hf-lsad screen`` reads. Every row comes back, in input order, with an id and either its prompt or the
reason it has none (an empty cell, a number, a malformed JSON line): a bad row is the row's problem, not the run's.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..core.text import unencodable
from ..errors import MissingColumnError

DEFAULT_COLUMN = "prompt"
"""The column read by default; a table without it but with a ``messages`` column gives its last user turn."""
MESSAGES_COLUMN = "messages"
TABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
"""The files read as a table (a folder or a name goes to ``datasets``)."""
TEXT_SUFFIX = ".txt"
"""The files read one prompt per non-blank line, without columns."""


@dataclass(frozen=True)
class PromptRow:
    """One input row: its id and its prompt, or why it has none."""

    id: str
    """The row's ``--id-column`` value as a string, or its 0-based position in the input (``#<position>`` for a row
    whose id cannot be read, which then has an ``error``)."""
    text: str | None
    """The prompt (``None`` when ``error`` is set); of a conversation, its last user turn."""
    error: str | None = None
    """Why the row has no prompt (empty, not text, unreadable)."""
    conversation: tuple[dict[str, str], ...] | None = None
    """The whole conversation, ``{"role", "content"}`` turns ending with a user turn, when the table was read with
    ``conversation=True`` (``None`` otherwise): what a chat server reads for its next answer."""


CONVERSATION_ROLES = ("system", "developer", "user", "assistant")
"""The roles a conversation's turns may have (``developer``: the OpenAI API's newer name for the system turn, in
the chat logs it exports)."""


def chat_role(role: str) -> str:
    """The role a chat template knows for a turn's ``role``: ``developer`` is the system turn."""
    return "system" if role == "developer" else role


def conversation_problem(turns: object) -> str | None:
    """Why ``turns`` is not a conversation a guard can read for the next answer, or ``None``: a non-empty list of
    ``{"role", "content"}`` turns, roles of :data:`CONVERSATION_ROLES`, text content (Unicode text:
    :func:`~hf_lsad.core.text.unencodable`), the last a user turn that holds text."""
    if isinstance(turns, str):
        return "a string, not a list of turns"
    if not isinstance(turns, (list, tuple)) or not turns:
        return "not a non-empty list of turns"
    for number, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or turn.get("role") not in CONVERSATION_ROLES:
            return f"turn {number} is not a {{'role', 'content'}} turn of a role in {CONVERSATION_ROLES}"
        if not isinstance(turn.get("content"), str):
            return f"turn {number} ({turn['role']}) has no text content"
        why = unencodable(turn["content"])
        if why:
            return f"turn {number} ({turn['role']}) is {why}"
    if turns[-1]["role"] != "user" or not turns[-1]["content"].strip():
        return "the conversation does not end with a user turn that holds text"
    return None


def read_prompt_table(
    source: str | Path,
    *,
    column: str = DEFAULT_COLUMN,
    id_column: str | None = None,
    limit: int | None = None,
    split: str = "train",
    conversation: bool = False,
) -> list[PromptRow]:
    """The prompts of a table, one :class:`PromptRow` per row, in input order.

    Args:
        source: A ``.jsonl`` (one object per line), ``.json`` (an array of objects, or one object per line),
            ``.csv`` or ``.txt`` file (one prompt per non-blank line, ids counting them; no columns to name) in
            UTF-8 (with or without the byte order mark Excel and Notepad write); a ``.parquet`` file; a folder
            written by ``Dataset.save_to_disk``; or anything else ``datasets.load_dataset`` accepts (a local dataset
            folder, a Hub name when online).
        column: The column holding the prompt. When it is the default and absent, a ``messages`` column (a list of
            ``{"role", "content"}`` turns) gives its last user turn.
        id_column: The column holding each row's id (default: the row's 0-based position). Ids must be unique:
            they are what a resumed run skips. A row without one (absent, null or empty), like a line that is not a
            JSON object, is ``#<position>`` with an error.
        limit: Read only the first ``limit`` rows.
        split: The split of a ``datasets`` dataset.
        conversation: Read each row's whole conversation (:attr:`PromptRow.conversation`) from ``column``, or from
            ``messages`` when ``column`` is the default: ``{"role", "content"}`` turns (roles ``system``, ``user``,
            ``assistant``) ending with a user turn. A row whose turns are not so is that row's error.

    Raises:
        FileNotFoundError: a file path that does not exist.
        MissingColumnError: no such column (or id column).
        ValueError: duplicate ids, or a file that cannot be read as a table.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit}")
    if conversation and column == DEFAULT_COLUMN:
        column = MESSAGES_COLUMN
    if Path(source).suffix.lower() == TEXT_SUFFIX and Path(source).is_file():
        if conversation:
            raise ValueError(f"{source}: a {TEXT_SUFFIX} file holds one prompt per line, not conversations")
        if column != DEFAULT_COLUMN or id_column is not None:
            raise ValueError(f"{source}: a {TEXT_SUFFIX} file holds one prompt per line and has no columns to choose")
        return [PromptRow(str(index), text) for index, text in enumerate(text_lines(Path(source))[:limit])]
    records = _records(Path(source) if Path(source).exists() else source, split, limit)
    first = next((r for r in records if not isinstance(r, _Unreadable)), None)
    if first is not None:
        _check_columns(first, column, id_column, source)
    rows, seen = [], set()
    for index, record in enumerate(records):
        if isinstance(record, _Unreadable):
            row = PromptRow(str(index) if id_column is None else f"#{index}", None, record.reason)  # no id to read
        elif id_column is not None and _missing(record.get(id_column)):
            row = PromptRow(f"#{index}", None, f"no id in column {id_column!r}")
        else:
            row_id = str(record[id_column]) if id_column is not None else str(index)
            if conversation:
                turns, error = _conversation_of(record, column)
                last = turns[-1]["content"] if turns is not None else None
                row = PromptRow(row_id, last, error, turns)
            else:
                text, error = _prompt_of(record, column)
                row = PromptRow(row_id, text, error)
        if row.id in seen:
            raise ValueError(f"{source}: id {row.id!r} appears twice in column {id_column!r}; ids must be unique")
        seen.add(row.id)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _Unreadable:
    """A line of a JSONL file that is not a JSON object."""

    reason: str


def _records(source: str | Path, split: str, limit: int | None) -> list[Any]:
    """The rows as dicts (or :class:`_Unreadable` for a JSON line or array item that cannot be a row)."""
    if isinstance(source, Path) and source.is_file():
        suffix = source.suffix.lower()
        if suffix == ".json" and _starts_with(source, b"["):
            return _json_array(source, limit)
        if suffix in (".jsonl", ".json"):
            return _json_lines(source, limit)
        if suffix == ".csv":
            try:
                with source.open(newline="", encoding="utf-8-sig") as handle:
                    return list(itertools.islice(csv.DictReader(handle), limit))
            except UnicodeDecodeError as err:  # a CSV cannot be read past a bad byte: the whole table's error
                raise ValueError(f"{source}: {not_utf8(err)}; save it as UTF-8 (Excel: CSV UTF-8)") from None
        if suffix == ".parquet":
            return _dataset_rows(_load_dataset("parquet", data_files=str(source), split="train"), limit)
        raise ValueError(f"{source}: not a {', '.join(TABLE_SUFFIXES)} or {TEXT_SUFFIX} file")
    if isinstance(source, Path) and (source / "dataset_info.json").is_file():
        from datasets import load_from_disk

        return _dataset_rows(load_from_disk(str(source)), limit)
    return _dataset_rows(_load_dataset(str(source), split=split), limit)


def _json_lines(path: Path, limit: int | None) -> list[Any]:
    """The rows of a JSON-lines file; a line that is not UTF-8, not JSON or not an object is that row's error."""
    records: list[Any] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if limit is not None and len(records) >= limit:
                break
            try:  # the byte order mark Excel and Notepad write is not part of the first line
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                records.append(_Unreadable(f"line {number} is {not_utf8(err)}"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                records.append(_Unreadable(f"line {number} is not JSON ({err.msg})"))
                continue
            records.append(record if isinstance(record, dict) else _Unreadable(f"line {number} is not an object"))
    return records


def text_lines(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file, as they are; a byte that is not UTF-8 is the file's error."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: {not_utf8(err)}; save it as UTF-8") from None
    return [line for line in text.splitlines() if line.strip()]


def _starts_with(path: Path, prefix: bytes) -> bool:
    """Whether the file's first bytes after a byte order mark and whitespace are ``prefix``."""
    with path.open("rb") as handle:
        head = handle.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()
    return head.startswith(prefix)


def _json_array(path: Path, limit: int | None) -> list[Any]:
    """The rows of a ``.json`` file holding one array of objects; an item that is not an object is that row's error."""
    try:
        items = json.loads(path.read_text(encoding="utf-8-sig"))  # a list: the text starts with "["
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: {not_utf8(err)}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a JSON array ({err.msg} at line {err.lineno} column {err.colno})") from None
    return [
        item if isinstance(item, dict) else _Unreadable(f"item {number} is not an object")
        for number, item in enumerate(items[:limit])
    ]


def not_utf8(err: UnicodeDecodeError) -> str:
    """What a :class:`UnicodeDecodeError` of a user's file says, in words: which byte is not UTF-8."""
    return f"not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start})"


def _load_dataset(path: str, **kwargs: Any) -> Any:
    from datasets import load_dataset

    return load_dataset(path, **kwargs)


def _dataset_rows(dataset: Any, limit: int | None) -> list[dict[str, Any]]:
    if hasattr(dataset, "keys") and not hasattr(dataset, "column_names"):  # a DatasetDict: no split chosen
        raise ValueError(f"the dataset has splits {list(dataset.keys())}; choose one with --split")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return list(dataset)


def _check_columns(record: dict[str, Any], column: str, id_column: str | None, source: str | Path) -> None:
    keys = list(record)
    if column not in record and not (column == DEFAULT_COLUMN and MESSAGES_COLUMN in record):
        raise MissingColumnError(f"{source}: no column {column!r} (columns: {keys})", column, keys)
    if id_column is not None and id_column not in record:
        raise MissingColumnError(f"{source}: no id column {id_column!r} (columns: {keys})", id_column, keys)


def _missing(value: Any) -> bool:
    """An id cell with nothing in it: absent, null, or blank text (a short CSV line, an empty cell)."""
    return value is None or (isinstance(value, str) and not value.strip())


def _prompt_of(record: dict[str, Any], column: str) -> tuple[str | None, str | None]:
    """The row's prompt, or why it has none."""
    if column in record:
        value = record[column]
    elif column != DEFAULT_COLUMN or MESSAGES_COLUMN not in record:
        return None, f"no column {column!r}" + (f" or {MESSAGES_COLUMN!r}" if column == DEFAULT_COLUMN else "")
    else:  # the default column is absent: the last user turn of the messages
        turns = record.get(MESSAGES_COLUMN)
        if not isinstance(turns, list):
            return None, f"{MESSAGES_COLUMN!r} is not a list of turns"
        users = [t.get("content") for t in turns if isinstance(t, dict) and t.get("role") == "user"]
        if not users:
            return None, f"{MESSAGES_COLUMN!r} holds no user turn"
        value = users[-1]
    if not isinstance(value, str):
        return None, f"the prompt is not text ({type(value).__name__})"
    if not value.strip():
        return None, "empty prompt"
    why = unencodable(value)
    if why:
        return None, f"the prompt is {why}"
    return value, None


def _conversation_of(record: dict[str, Any], column: str) -> tuple[tuple[dict[str, str], ...] | None, str | None]:
    """The row's conversation, or why it has none (:func:`conversation_problem`)."""
    turns = record.get(column)
    if isinstance(turns, str):  # a CSV cell holds the list as JSON text
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            return None, f"{column!r} is not a list of turns (not JSON)"
    problem = conversation_problem(turns)
    if problem is not None:
        return None, f"{column!r}: {problem}"
    checked = cast(list, turns)  # a list of turns, with no problem
    return tuple({"role": str(turn["role"]), "content": str(turn["content"])} for turn in checked), None
