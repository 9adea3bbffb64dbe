"""The prompt files of ``add-head --unsafe/--safe``, ``set-budget --benign`` and ``teach --benign``: a table read as
``screen`` reads it (its ``--column``, by default ``prompt`` or the last user turn of ``messages``), any other file one
prompt per line; and a text file for ``screen``."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from tiny import fresh_guard

from hf_lsad.cli.commands import read_prompt_file
from hf_lsad.cli.main import entry

PROMPTS = ["How do I bake bread?", "Tell me a joke"]


def write_table(path, suffix, column="prompt"):
    rows = [{"id": str(i), column: text} for i, text in enumerate(PROMPTS)]
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif suffix == ".csv":
        path.write_text(f"id,{column}\n" + "".join(f"{row['id']},{row[column]}\n" for row in rows))
    else:
        Dataset.from_list(rows).to_parquet(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".JSON"])
@pytest.mark.parametrize("column", ["prompt", "text"])
def test_a_table_gives_its_prompt_column(tmp_path, suffix, column):
    """A CSV or a JSON array was read one line a prompt: its header, brackets and ids became prompts of the head."""
    write_table(tmp_path / f"prompts{suffix}", suffix.lower(), column)
    assert read_prompt_file(str(tmp_path / f"prompts{suffix}"), column) == PROMPTS


def test_a_table_of_chats_gives_each_rows_last_user_turn(tmp_path):
    """As ``screen`` reads the table: ``add-head``, ``set-budget`` and ``teach`` read a table ``screen`` reads."""
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}]} for p in PROMPTS]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert read_prompt_file(str(tmp_path / "chats.jsonl")) == PROMPTS


def test_a_text_file_has_no_column_to_choose(tmp_path):
    (tmp_path / "p.txt").write_text("How do I bake bread?\n")
    with pytest.raises(ValueError, match=r"p\.txt: a text file holds one prompt per line and has no column 'text'"):
        read_prompt_file(str(tmp_path / "p.txt"), "text")


@pytest.mark.parametrize("suffix", [".txt", ""])
def test_any_other_file_gives_one_prompt_per_line(tmp_path, suffix):
    (tmp_path / f"prompts{suffix}").write_text("How do I bake bread?\r\n\n  \nTell me a joke\r\n", encoding="utf-8-sig")
    assert read_prompt_file(str(tmp_path / f"prompts{suffix}")) == PROMPTS  # without the byte order mark


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"p\.txt: not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8"):
        read_prompt_file(str(tmp_path / "p.txt"))


def test_a_table_row_without_its_prompt_is_the_files_error(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "fine"}, {"prompt": ""}]))
    with pytest.raises(ValueError, match=r"p\.json: row 1: empty prompt"):
        read_prompt_file(str(tmp_path / "p.json"))


@pytest.mark.parametrize("command", ["add-head", "set-budget", "teach"])
def test_a_table_without_the_prompt_column_names_the_flag_that_chooses_it(tmp_path, capsys, command):
    """``screen`` read a table's ``prompt`` column, these commands its ``text`` column: the sample ``screen`` had
    read, ``teach`` refused."""
    (tmp_path / "p.csv").write_text("id,text\n1,hello\n")
    flag = "--unsafe" if command == "add-head" else "--benign"
    argv = [command, "--guard", "default", flag, str(tmp_path / "p.csv"), "--out", str(tmp_path / "g")]
    with pytest.raises(SystemExit) as exit_info:  # read before any model
        entry([*argv, *(["--name", "mine"] if command == "add-head" else [])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (
        f"argument {flag}: {tmp_path / 'p.csv'}: no column 'prompt' (columns: ['id', 'text']); choose one with" in err
    )


@pytest.mark.parametrize(
    ("flags", "remedy"),
    [([], "choose one with --column"), (["--column", "text", "--id-column", "key"], "choose one with --id-column")],
)
def test_screen_names_the_flag_that_chooses_a_missing_column(tmp_path, capsys, flags, remedy):
    (tmp_path / "p.csv").write_text("id,text\n1,hello\n")
    argv = ["screen", str(tmp_path / "p.csv"), "--out", str(tmp_path / "v.jsonl"), "--model", "no-such-org/model"]
    with pytest.raises(SystemExit) as exit_info:  # the table is read before any model
        entry([*argv, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.strip().endswith("(run with --debug for the traceback)")
    assert f"(columns: ['id', 'text']); {remedy}" in err


@pytest.mark.parametrize("command", ["screen", "evaluate", "add-head"])
def test_a_table_without_rows_is_refused_before_any_model(tmp_path, capsys, command):
    # screen wrote no file and said "0 of 0 rows"; evaluate loaded its model, then found no row to screen
    (tmp_path / "p.csv").write_text("id,prompt\n")
    table, other = str(tmp_path / "p.csv"), str(tmp_path / "u.txt")
    (tmp_path / "u.txt").write_text("".join(f"{text} {i}\n" for i in range(10) for text in PROMPTS))
    argv = {
        "screen": ["screen", table, "--out", str(tmp_path / "v.jsonl")],
        "evaluate": [
            "evaluate",
            "--guard",
            "default",
            "--benign-prompts",
            f"a={table}",
            "--unsafe-prompts",
            f"u={other}",
        ],
        "add-head": ["add-head", "--guard", "default", "--name", "x", "--unsafe", table, "--out", str(tmp_path / "g")],
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        entry([*argv, "--model", "no-such-org/model"])  # a Hub id: loading it here would fail otherwise
    assert exit_info.value.code in (1, 2) and f"{table} holds no rows" in capsys.readouterr().err
    assert not (tmp_path / "v.jsonl").exists()


def test_screen_reads_a_text_file_one_prompt_per_line(model_dir, tmp_path, capsys):
    """The file ``add-head`` reads, ``screen`` read as "not a .jsonl, .json, .csv or .parquet file"."""
    fresh_guard("prompt_last").save_pretrained(tmp_path / "guard")
    (tmp_path / "p.txt").write_text("How do I bake bread?\n\nTell me a joke\n")
    out = tmp_path / "v.jsonl"
    entry(
        [
            "screen",
            str(tmp_path / "p.txt"),
            "--out",
            str(out),
            "--model",
            str(model_dir),
            "--guard",
            str(tmp_path / "guard"),
        ]
    )
    verdicts = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(v["id"] for v in verdicts) == ["0", "1"] and all(v["error"] is None for v in verdicts)
    assert "screening 2 rows of" in capsys.readouterr().err
