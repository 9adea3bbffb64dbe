"""The prompt files of ``add-head --unsafe/--safe``, ``set-budget --benign`` and ``teach --benign``: a table by its
``text`` column, any other file one prompt per line; and a text file for ``screen``."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from tiny import fresh_guard

from hf_lsad.cli.commands import read_prompt_file
from hf_lsad.cli.main import entry

PROMPTS = ["How do I bake bread?", "Tell me a joke"]


def write_table(path, suffix):
    rows = [{"id": str(i), "text": text} for i, text in enumerate(PROMPTS)]
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    elif suffix == ".csv":
        path.write_text("id,text\n" + "".join(f"{row['id']},{row['text']}\n" for row in rows))
    else:
        Dataset.from_list(rows).to_parquet(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".JSON"])
def test_a_table_gives_its_text_column(tmp_path, suffix):
    """A CSV or a JSON array was read one line a prompt: its header, brackets and ids became prompts of the head."""
    write_table(tmp_path / f"prompts{suffix}", suffix.lower())
    assert read_prompt_file(str(tmp_path / f"prompts{suffix}")) == PROMPTS


@pytest.mark.parametrize("suffix", [".txt", ""])
def test_any_other_file_gives_one_prompt_per_line(tmp_path, suffix):
    (tmp_path / f"prompts{suffix}").write_text("How do I bake bread?\r\n\n  \nTell me a joke\r\n", encoding="utf-8-sig")
    assert read_prompt_file(str(tmp_path / f"prompts{suffix}")) == PROMPTS  # without the byte order mark


def test_a_text_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "p.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"p\.txt: not UTF-8 text \(byte 0xe9 at offset 3\); save it as UTF-8"):
        read_prompt_file(str(tmp_path / "p.txt"))


def test_a_table_row_without_its_text_is_the_files_error(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([{"text": "fine"}, {"text": ""}]))
    with pytest.raises(ValueError, match=r"p\.json: row 1: empty prompt"):
        read_prompt_file(str(tmp_path / "p.json"))


def test_a_table_without_a_text_column_says_where_the_prompts_go(tmp_path):
    """It said "choose one with --column", a flag these commands do not have."""
    (tmp_path / "p.csv").write_text("id,prompt\n1,hello\n")
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['id', 'prompt'\]\): a table of") as e:
        read_prompt_file(str(tmp_path / "p.csv"))
    assert "--column" not in str(e.value)


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
