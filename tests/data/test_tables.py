"""Reading a user's table of prompts: every format, every bad row a per-row error, whole-table errors up front."""

from __future__ import annotations

import json

import pytest

from hf_lsad.data.tables import PromptRow, read_prompt_table

ROWS = [
    {"id": "a", "prompt": "How do I bake bread?"},
    {"id": "b", "prompt": ""},
    {"id": "c", "prompt": 42},
    {"id": "d", "prompt": "  "},
    {"id": "e", "prompt": "Tell me a joke"},
]
EXPECTED = [
    PromptRow("a", "How do I bake bread?"),
    PromptRow("b", None, "empty prompt"),
    PromptRow("c", None, "the prompt is not text (int)"),
    PromptRow("d", None, "empty prompt"),
    PromptRow("e", "Tell me a joke"),
]


def write_jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def test_jsonl_rows_with_their_ids_and_errors(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS, ["{not json\n", "[1, 2]\n", "\n"])
    rows = read_prompt_table(path, id_column="id")
    assert rows[:5] == EXPECTED
    assert [r.error for r in rows[5:]] == [
        "line 6 is not JSON (Expecting property name enclosed in double quotes)",
        "line 7 is not an object",
    ]
    assert [r.id for r in read_prompt_table(path, limit=2)] == ["0", "1"]  # positions, first rows only


def test_a_row_without_its_id_or_its_column_is_that_rows_error(tmp_path):
    """Only the first row's columns are checked up front; a later row that lacks one fails alone, saying which."""
    rows = [{"id": 0, "text": "hi"}, {"text": "no id"}, {"id": None, "text": "null id"}, {"id": "d", "body": "x"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert read_prompt_table(path, column="text", id_column="id") == [
        PromptRow("0", "hi"),
        PromptRow("#1", None, "no id in column 'id'"),
        PromptRow("#2", None, "no id in column 'id'"),
        PromptRow("d", None, "no column 'text'"),
    ]
    plain = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "hi"}, {"body": "x"}])
    assert read_prompt_table(plain)[1] == PromptRow("1", None, "no column 'prompt' or 'messages'")
    (tmp_path / "short.csv").write_text("id,prompt\na,hi\n\nb\n,empty id\n")
    assert read_prompt_table(tmp_path / "short.csv", id_column="id") == [
        PromptRow("a", "hi"),
        PromptRow("b", None, "the prompt is not text (NoneType)"),
        PromptRow("#2", None, "no id in column 'id'"),
    ]


def test_csv_parquet_and_a_saved_dataset_read_alike(tmp_path):
    from datasets import Dataset

    text_rows = [r for r in ROWS if isinstance(r["prompt"], str)]
    want = [row for row in EXPECTED if row.id != "c"]
    (tmp_path / "p.csv").write_text("id,prompt\n" + "".join(f'{r["id"]},"{r["prompt"]}"\n' for r in text_rows))
    Dataset.from_list(text_rows).to_parquet(tmp_path / "p.parquet")
    Dataset.from_list(text_rows).save_to_disk(tmp_path / "saved")
    for source in ("p.csv", "p.parquet", "saved"):
        assert read_prompt_table(tmp_path / source, id_column="id") == want, source


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_column_or_line(tmp_path, suffix):
    """Excel and Notepad start UTF-8 files with a byte order mark. Read as plain UTF-8, it hid a CSV's first column
    (``--id-column id`` found no column ``id``) and made a JSONL file's first line not JSON."""
    rows = [{"id": "a", "prompt": "How do I bake bread?"}, {"id": "b", "prompt": "Tell me a joke"}]
    if suffix == ".csv":
        text = "id,prompt\r\n" + "".join(f"{r['id']},{r['prompt']}\r\n" for r in rows)
    else:
        text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / f"plain{suffix}").write_text(text, encoding="utf-8")
    (tmp_path / f"marked{suffix}").write_text(text, encoding="utf-8-sig")
    want = [PromptRow("a", "How do I bake bread?"), PromptRow("b", "Tell me a joke")]
    assert read_prompt_table(tmp_path / f"plain{suffix}", id_column="id") == want
    assert read_prompt_table(tmp_path / f"marked{suffix}", id_column="id") == want


def test_text_that_is_not_utf8_is_named_with_its_file_or_line(tmp_path):
    """A file saved as Latin-1 (as Excel's plain CSV is on many systems): a JSONL line is that row's error, a CSV
    the whole file's, naming it (it was a bare UnicodeDecodeError)."""
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n{"prompt": "Tell me a joke"}\n')
    assert read_prompt_table(tmp_path / "p.jsonl") == [
        PromptRow("0", None, "line 1 is not UTF-8 text (byte 0xe9 at offset 15)"),
        PromptRow("1", "Tell me a joke"),
    ]
    (tmp_path / "p.csv").write_bytes(b"prompt\ncaf\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"p\.csv: not UTF-8 text \(byte 0xe9 at offset 10\)"):
        read_prompt_table(tmp_path / "p.csv")


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "indented"])
def test_a_json_file_holding_an_array_of_objects_reads_as_its_rows(tmp_path, indent):
    """The most common shape of a ``.json`` file; read as JSON lines, every line of it was an error."""
    (tmp_path / "p.json").write_text(json.dumps([*ROWS, "not an object"], indent=indent))
    assert read_prompt_table(tmp_path / "p.json", id_column=None) == [
        PromptRow(str(i), row.text, row.error) for i, row in enumerate(EXPECTED)
    ] + [PromptRow("5", None, "item 5 is not an object")]
    assert read_prompt_table(tmp_path / "p.json", id_column="id", limit=2) == EXPECTED[:2]
    write_jsonl(tmp_path / "lines.json", ROWS)  # a .json file of JSON lines reads as before
    assert read_prompt_table(tmp_path / "lines.json", id_column="id") == EXPECTED
    (tmp_path / "broken.json").write_text('[{"prompt": "a"},')
    with pytest.raises(ValueError, match=r"broken\.json: not a JSON array \(Expecting value at line 1 column 18\)"):
        read_prompt_table(tmp_path / "broken.json")


def test_the_last_user_turn_of_messages_when_there_is_no_prompt_column(tmp_path):
    turns = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": turns}, {"messages": turns[:1]}, {"messages": "x"}])
    assert read_prompt_table(path) == [
        PromptRow("0", "second"),
        PromptRow("1", None, "'messages' holds no user turn"),
        PromptRow("2", None, "'messages' is not a list of turns"),
    ]


def test_whole_conversations_with_each_malformed_one_its_rows_error(tmp_path):
    turns = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    records = [
        {"messages": turns},
        {"messages": turns[:3]},  # ends with the assistant's turn
        {"messages": [{"role": "tool", "content": "x"}, turns[1]]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": []},
        {"messages": "not json"},
        {"messages": json.dumps(turns[1:2])},  # a CSV cell holds the list as JSON text
    ]
    rows = read_prompt_table(write_jsonl(tmp_path / "m.jsonl", records), conversation=True)
    assert rows[0] == PromptRow("0", "second", None, tuple(turns))
    assert rows[6] == PromptRow("6", "first", None, (turns[1],))
    assert [row.error for row in rows[1:6]] == [
        "'messages': the conversation does not end with a user turn that holds text",
        "'messages': turn 0 is not a {'role', 'content'} turn of a role in "
        "('system', 'developer', 'user', 'assistant')",
        "'messages': turn 0 (user) has no text content",
        "'messages': not a non-empty list of turns",
        "'messages' is not a list of turns (not JSON)",
    ]
    # JSON's \\ud800 escape decodes to a lone surrogate, which no tokenizer encodes (the batch failed on it)
    (tmp_path / "s.jsonl").write_text('{"prompt": "a\\ud800b"}\n')
    assert read_prompt_table(tmp_path / "s.jsonl")[0] == PromptRow(
        "0", None, "the prompt is not Unicode text: a lone surrogate (U+D800) at character 1"
    )
    (tmp_path / "t.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\\udfff"}, '
        '{"role": "user", "content": "and?"}]}\n'
    )
    assert read_prompt_table(tmp_path / "t.jsonl", conversation=True)[0].error == (
        "'messages': turn 1 (assistant) is not Unicode text: a lone surrogate (U+DFFF) at character 0"
    )
    developer = [{"role": "developer", "content": "be kind"}, *turns[1:]]  # an OpenAI chat log's system turn
    assert read_prompt_table(write_jsonl(tmp_path / "d.jsonl", [{"messages": developer}]), conversation=True) == [
        PromptRow("0", "second", None, tuple(developer))
    ]
    other = write_jsonl(tmp_path / "c.jsonl", [{"chat": turns}])
    assert read_prompt_table(other, column="chat", conversation=True)[0].conversation == tuple(turns)
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="one prompt per line, not conversations"):
        read_prompt_table(tmp_path / "p.txt", conversation=True)


@pytest.mark.parametrize(
    ("kwargs", "rows", "error"),
    [
        ({"column": "text"}, ROWS, "no column 'text'"),
        ({"id_column": "key"}, ROWS, "no id column 'key'"),
        ({"id_column": "id"}, [*ROWS, {"id": "a", "prompt": "again"}], "id 'a' appears twice"),
        ({"limit": 0}, ROWS, "limit must be a positive integer"),
    ],
)
def test_whole_table_errors(tmp_path, kwargs, rows, error):
    with pytest.raises(ValueError, match=error):
        read_prompt_table(write_jsonl(tmp_path / "p.jsonl", rows), **kwargs)


def test_a_missing_column_is_a_typed_error_that_names_no_command_flag(tmp_path):
    """The reader serves screen, evaluate and the prompt files of add-head, set-budget and teach: only screen and
    evaluate have ``--column``, so each command names its own remedy."""
    from hf_lsad import MissingColumnError

    with pytest.raises(MissingColumnError) as caught:
        read_prompt_table(write_jsonl(tmp_path / "p.jsonl", ROWS), column="text")
    assert (caught.value.column, caught.value.columns) == ("text", ["id", "prompt"])
    assert "--" not in str(caught.value)


def test_a_file_of_another_kind_is_refused(tmp_path):
    (tmp_path / "p.md").write_text("hello\n")
    with pytest.raises(ValueError, match=r"not a \.jsonl, \.json, \.csv, \.parquet or \.txt file"):
        read_prompt_table(tmp_path / "p.md")


def test_a_text_file_is_one_prompt_per_non_blank_line(tmp_path):
    """What ``add-head`` reads, ``screen`` and ``evaluate`` read too (a ``.txt`` file was refused): Windows line
    ends, a byte order mark, blank lines between prompts; the ids count the prompts."""
    (tmp_path / "p.txt").write_bytes(b"\xef\xbb\xbfHow do I bake bread?\r\n\r\n   \r\n  Tell me a joke \r\nLast line")
    assert read_prompt_table(tmp_path / "p.txt") == [
        PromptRow("0", "How do I bake bread?"),
        PromptRow("1", "  Tell me a joke "),
        PromptRow("2", "Last line"),
    ]
    assert read_prompt_table(tmp_path / "p.txt", limit=1) == [PromptRow("0", "How do I bake bread?")]
    for columns in ({"column": "text"}, {"id_column": "id"}):
        with pytest.raises(ValueError, match=r"p\.txt: a \.txt file holds one prompt per line and has no columns"):
            read_prompt_table(tmp_path / "p.txt", **columns)
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_prompt_table(tmp_path / "latin.txt")
