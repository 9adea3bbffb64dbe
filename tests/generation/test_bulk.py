"""Screening a table into JSON lines: each row's verdict as alone, bad rows as errors, and resuming after a kill."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny import PROMPTS, UNSAFE_PROMPTS, tiny_guard, two_headed_guard

from hf_lsad.cli.main import entry
from hf_lsad.data.tables import PromptRow, read_prompt_table
from hf_lsad.generation.bulk import ScreenSummary, plan_batches, screen_to_jsonl
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

TEXTS = [*PROMPTS[:20], *UNSAFE_PROMPTS[:20], "hi", "a much longer prompt about baking bread at home, step by step"]


def guarded():
    model, tokenizer, _ = tiny_guard("prompt_last")
    return GuardedModelForCausalLM(model, two_headed_guard(), tokenizer=tokenizer)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(path):
    records = lines(path)
    assert len({r["id"] for r in records}) == len(records), "a row written twice"
    return {r["id"]: r for r in records}


def assert_same_verdicts(got, want):
    assert got.keys() == want.keys()
    for row_id, record in want.items():
        other = got[row_id]
        assert (other["flagged"], other.get("decided_by"), other["error"]) == (
            record["flagged"],
            record.get("decided_by"),
            record["error"],
        ), row_id
        for head, verdict in (record.get("heads") or {}).items():
            assert other["heads"][head]["score"] == pytest.approx(verdict["score"], abs=1e-4), (row_id, head)


def test_each_line_a_supervised_head_decided_names_the_words_behind_it(tmp_path):
    model = guarded()
    model.guard.budget.thresholds[0] = 1e9  # the anomaly head flags nothing: the harm head decides the unsafe rows
    rows = [PromptRow(f"r{i}", text) for i, text in enumerate(TEXTS)]
    screen_to_jsonl(model, rows, tmp_path / "out.jsonl", batch_size=8, explain=2, progress=False)
    got = by_id(tmp_path / "out.jsonl")
    named = [record for record in got.values() if record["decided_by"] == ["harm"]]
    assert named and all("tokens" not in record for record in got.values() if not record["decided_by"])
    for row in rows:
        (alone,) = model.screen([row.text], explain=True, top_k=2)  # alone: padding aside, the same tokens
        if alone.tokens is None:
            continue
        record = got[row.id]
        assert [(t["text"], t["token_id"], t["position"]) for t in record["tokens"]] == [
            (model.tokenizer.decode([t.token_id]), t.token_id, t.position) for t in alone.tokens
        ]
        # batched and alone, a contribution moves by float round-off (1.5e-6 of it on CPUs without AVX2)
        contributions = [t.contribution for t in alone.tokens]
        assert [t["contribution"] for t in record["tokens"]] == pytest.approx(contributions, rel=1e-5, abs=1e-7)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="explain must be a number of tokens"):
            screen_to_jsonl(model, rows, tmp_path / "bad.jsonl", explain=bad, progress=False)


def test_every_row_gets_the_verdict_it_gets_alone_and_bad_rows_their_error(tmp_path):
    model = guarded()
    rows = [PromptRow(f"r{i}", text) for i, text in enumerate(TEXTS)]
    rows += [PromptRow("empty", None, "empty prompt"), PromptRow("long", "word " * 2000)]
    summary = screen_to_jsonl(model, rows, tmp_path / "out.jsonl", batch_size=8, progress=False)
    got = by_id(tmp_path / "out.jsonl")
    for row in rows[: len(TEXTS)]:
        alone = model.screen([row.text])[0].to_json()
        assert_same_verdicts({row.id: got[row.id]}, {row.id: {"id": row.id, **alone}})
    read = {
        "model": None,
        "adapter": None,
        "dtype": "float32",
        "system": None,
        "chat_template": True,
        "conversation": False,
    }
    assert got["empty"] == {"id": "empty", "flagged": None, "error": "empty prompt", "read": read}
    assert all(record["read"] == read for record in got.values())
    assert got["long"]["flagged"] is None and "longer than the model's context" in got["long"]["error"]
    assert summary.rows == summary.written == len(rows) and summary.errors == 2 and summary.resumed == 0
    assert summary.flagged_by_head == {
        head: sum(head in r.get("decided_by", []) for r in got.values())
        for head in ("anomaly", "harm")
        if any(head in r.get("decided_by", []) for r in got.values())
    }
    assert summary.flagged_by_head.get("harm", 0) >= 15  # the tiny head's kind of harm


def test_a_token_budget_batches_rows_apart_for_the_same_verdicts(tmp_path):
    model = guarded()
    rows = [PromptRow(f"r{i}", text) for i, text in enumerate(TEXTS)] + [PromptRow("longer", "many words " * 60)]
    budget = 60
    planned, _ = plan_batches(model, rows, batch_size=8, max_batch_tokens=budget)
    sizes = [(len(batch.ids), max(map(len, batch.token_ids))) for batch in planned]
    assert all(n * longest <= budget or n == 1 for n, longest in sizes) and any(n < 8 for n, _ in sizes[:-1])
    screen_to_jsonl(model, rows, tmp_path / "budget.jsonl", batch_size=8, max_batch_tokens=budget, progress=False)
    screen_to_jsonl(model, rows, tmp_path / "fixed.jsonl", batch_size=8, max_batch_tokens=None, progress=False)
    assert_same_verdicts(by_id(tmp_path / "budget.jsonl"), by_id(tmp_path / "fixed.jsonl"))


@pytest.mark.parametrize(("size", "budget", "error"), [(0, None, "batch_size"), (4, 0, "max_batch_tokens")])
def test_bad_batching_is_refused_before_the_file_is_touched(tmp_path, size, budget, error):
    with pytest.raises(ValueError, match=error):
        screen_to_jsonl(
            guarded(), [PromptRow("a", "hi")], tmp_path / "out.jsonl", batch_size=size, max_batch_tokens=budget
        )
    assert not (tmp_path / "out.jsonl").exists()


def test_a_resumed_run_finishes_what_an_interrupted_one_left(tmp_path):
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)]
    screen_to_jsonl(model, rows, tmp_path / "whole.jsonl", batch_size=4, progress=False)
    whole = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(whole[:17]) + whole[17][:25])  # a kill mid-line
    summary = screen_to_jsonl(model, rows, cut, batch_size=4, progress=False)
    assert summary.resumed == 17 and summary.written == len(rows)
    assert_same_verdicts(by_id(cut), by_id(tmp_path / "whole.jsonl"))


@pytest.mark.skipif(sys.platform == "win32", reason="the output is held with flock")
def test_a_run_on_an_output_another_run_is_writing_is_refused_until_that_run_ends(tmp_path, model_dir, capsys):
    """Two screens on one --out (a job started again while the first ran) each screened the rows the other had not
    written yet: 416 lines for 400 rows."""
    import fcntl

    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows[:10], out, batch_size=4, progress=False)
    written = out.read_bytes()
    table = tmp_path / "prompts.txt"
    table.write_text("".join(text + "\n" for text in TEXTS))
    with out.open("a") as other_run:  # held as a run holds its output
        fcntl.flock(other_run.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=r"out\.jsonl is being written by another screening run: wait for it"):
            screen_to_jsonl(model, rows, out, batch_size=4, progress=False)
        with pytest.raises(SystemExit) as exit_:  # the command says so before it loads a model
            entry(["screen", str(table), "--model", str(model_dir), "--out", str(out)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --out: " in err and "is being written by another screening run" in err
        assert "loading" not in err
        assert out.read_bytes() == written
    assert screen_to_jsonl(model, rows, out, batch_size=4, progress=False).resumed == 10  # held no longer
    assert len(by_id(out)) == len(rows)


def test_an_output_in_a_folder_not_made_yet_is_made_and_a_folder_is_refused(tmp_path, model_dir, capsys):
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS[:4])]
    nested = tmp_path / "runs" / "today" / "out.jsonl"  # raised FileNotFoundError after the model loaded
    assert screen_to_jsonl(model, rows, nested, progress=False).written == 4 and len(by_id(nested)) == 4
    with pytest.raises(IsADirectoryError, match="is a folder; out is the JSON-lines file of verdicts"):
        screen_to_jsonl(model, rows, tmp_path, progress=False)
    table = tmp_path / "prompts.txt"
    table.write_text("".join(text + "\n" for text in TEXTS[:4]))
    with pytest.raises(SystemExit) as exit_:  # before a model is loaded
        entry(["screen", str(table), "--model", str(model_dir), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --out: " in err and "is a folder" in err and "loading" not in err


def test_a_run_on_an_output_another_guard_wrote_is_refused_rather_than_mixed(tmp_path):
    """Screening with a guard re-set by set-budget into the output of the first screen skipped every row and said
    "42 of 42 rows have a verdict (42 from an earlier run)": the old guard's verdicts, read as the new one's."""
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows[:10], out, batch_size=4, progress=False)
    assert screen_to_jsonl(model, rows, out, batch_size=4, progress=False).resumed == 10  # the same guard resumes
    written = out.read_bytes()
    model.guard.budget.thresholds[1] = 0.5
    with pytest.raises(ValueError, match=r"out\.jsonl:1 was screened at other thresholds \(anomaly .*, harm .*\) than"):
        screen_to_jsonl(model, rows, out, batch_size=4, progress=False)
    assert out.read_bytes() == written  # nothing appended
    base, tokenizer, anomaly_only = tiny_guard("prompt_last")
    single = GuardedModelForCausalLM(base, anomaly_only, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="screened at other thresholds"):  # a guard of other heads
        screen_to_jsonl(single, rows, out, batch_size=4, progress=False)
    screen_to_jsonl(single, rows[:5], tmp_path / "single.jsonl", batch_size=4, progress=False)
    assert screen_to_jsonl(single, rows, tmp_path / "single.jsonl", progress=False).resumed == 5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"system": "You are a support bot."}, "system turn the template's default here, 'You are a support bot.' in"),
        ({"chat_template": False}, "chat template True here, False in this run"),
        ("model", "model None here, 'another/model' in this run"),
        ("dtype", "dtype 'float32' here, 'bfloat16' in this run"),
        ("adapter", r"adapters no adapter here, the peft adapter sha256:[0-9a-f]{12} in this run"),
    ],
)
def test_a_run_that_reads_its_prompts_otherwise_is_refused_rather_than_mixed(tmp_path, change, message):
    """The same guard's thresholds on another model, adapter, dtype, system turn or without the chat template: every
    score moves, and resuming would have kept the first reading's verdicts as this one's."""
    import peft

    from hf_lsad.errors import AdapterWarning

    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows[:10], out, batch_size=4, progress=False)
    written = out.read_bytes()
    settings = change if isinstance(change, dict) else {}
    name = model.model.config.name_or_path
    try:
        if change == "model":
            model.model.config.name_or_path = "another/model"
        if change == "dtype":  # a copy: casting the shared tiny model there and back would round its weights
            model = GuardedModelForCausalLM(
                copy.deepcopy(model.model).to(torch.bfloat16), model.guard, tokenizer=model.tokenizer
            )
        if change == "adapter":
            adapted = peft.get_peft_model(model.model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
            with pytest.warns(AdapterWarning):
                model = GuardedModelForCausalLM(
                    adapted, model.guard, tokenizer=model.tokenizer, allow_adapter_mismatch=True
                )
        with pytest.raises(
            ValueError, match=rf"out\.jsonl:1 was read otherwise than this run reads its prompts \({message}"
        ):
            screen_to_jsonl(model, rows, out, batch_size=4, progress=False, **settings)
    finally:  # the tiny model is shared between tests
        model.model.config.name_or_path = name
        if change == "adapter":
            adapted.unload()
    assert out.read_bytes() == written  # nothing appended


def test_lines_written_before_lines_said_how_they_were_read_resume(tmp_path):
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows[:10], out, batch_size=4, progress=False)
    older = [{k: v for k, v in record.items() if k != "read"} for record in lines(out)]
    out.write_text("".join(json.dumps(record) + "\n" for record in older))
    assert (
        screen_to_jsonl(model, rows, out, batch_size=4, system="You are a support bot.", progress=False).resumed == 10
    )


CONVERSATIONS = [
    (
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "Sure, here it is."},
        {"role": "user", "content": "And another?"},
    ),
    ({"role": "user", "content": UNSAFE_PROMPTS[0]},),
    (
        {"role": "system", "content": "You are a support bot."},
        {"role": "user", "content": UNSAFE_PROMPTS[1]},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "Go on."},
    ),
]


def test_conversations_are_read_whole_as_a_chat_server_reads_them(tmp_path):
    """A row's conversation gives the verdict screen gives the ids the chat template makes of it (what the server
    reads for its next answer); a one-turn conversation reads as its prompt does."""
    model = guarded()
    tokenizer = model.tokenizer
    rows = [PromptRow(str(i), turns[-1]["content"], None, turns) for i, turns in enumerate(CONVERSATIONS)]
    rows.append(PromptRow("plain", UNSAFE_PROMPTS[0]))
    batches, errors = plan_batches(model, rows, batch_size=2)
    assert not errors
    token_ids = {row_id: ids for batch in batches for row_id, ids in zip(batch.ids, batch.token_ids)}
    for i, turns in enumerate(CONVERSATIONS):
        served = tokenizer.apply_chat_template(list(turns), add_generation_prompt=True, return_dict=True)
        assert token_ids[str(i)] == list(served["input_ids"])
    assert token_ids["1"] == token_ids["plain"]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows, out, batch_size=2, progress=False)
    got = by_id(out)
    for i, turns in enumerate(CONVERSATIONS):
        served = tokenizer.apply_chat_template([list(turns)], add_generation_prompt=True, return_dict=True)
        (want,) = model.screen(torch.tensor(served["input_ids"]))
        assert got[str(i)]["heads"]["harm"]["score"] == pytest.approx(want.heads[1].score, abs=1e-5)
        assert got[str(i)]["read"]["conversation"] is True
    with_system, _ = plan_batches(model, rows[:3], batch_size=8, system="Be brief.")
    system_ids = dict(zip(with_system[0].ids, with_system[0].token_ids))
    opened = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *CONVERSATIONS[0]], add_generation_prompt=True, return_dict=True
    )
    assert system_ids["0"] == list(opened["input_ids"]) and system_ids["2"] == token_ids["2"]  # its own turn kept
    with pytest.raises(ValueError, match="conversations are read under the chat template"):
        plan_batches(model, rows, batch_size=2, chat_template=False)


def test_a_conversation_run_does_not_resume_a_run_of_last_turns(tmp_path):
    model = guarded()
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, [PromptRow("0", "Go on.")], out, progress=False)
    rows = [PromptRow(str(i), turns[-1]["content"], None, turns) for i, turns in enumerate(CONVERSATIONS)]
    with pytest.raises(ValueError, match="whole conversations False here, True in this run"):
        screen_to_jsonl(model, rows, out, progress=False)
    older = [
        {**record, "read": {k: v for k, v in record["read"].items() if k != "conversation"}} for record in lines(out)
    ]
    out.write_text("".join(json.dumps(record) + "\n" for record in older))  # written before lines said so
    assert screen_to_jsonl(model, [PromptRow("0", "Go on."), PromptRow("1", "hi")], out, progress=False).resumed == 1


def test_an_output_that_is_not_ours_is_refused(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"something": "else"}\n')
    with pytest.raises(ValueError, match="not a verdict line"):
        screen_to_jsonl(guarded(), [PromptRow("0", "hi")], tmp_path / "out.jsonl", progress=False)


@pytest.mark.parametrize(
    "held",
    [b"id,notes\n1,keep this", b"keep this", b'{"id": "0", "flagged": false}\nkeep this', b"\xff\xfe binary"],
    ids=["table", "one-line", "verdicts-then-text", "binary"],
)
def test_an_output_of_something_else_is_left_as_it_was(tmp_path, model_dir, capsys, held):
    """A run cut off a last line without its newline, taken for a line a kill left, before it found the file was
    not its own: `screen prompts.txt --out notes.csv` lost the last row of notes.csv."""
    out = tmp_path / "notes.csv"
    out.write_bytes(held)
    with pytest.raises(ValueError, match=r"notes\.csv:\d+: not a verdict line of hf-lsad screen"):
        screen_to_jsonl(guarded(), [PromptRow("0", "hi")], out, progress=False)
    assert out.read_bytes() == held
    table = tmp_path / "prompts.txt"
    table.write_text("hi\n")
    with pytest.raises(SystemExit) as exit_:  # before a model is loaded
        entry(["screen", str(table), "--model", str(model_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --out: " in err and "not a verdict line" in err and "loading" not in err
    assert out.read_bytes() == held


def test_the_input_table_is_not_an_output(tmp_path, model_dir, capsys):
    table = tmp_path / "prompts.txt"
    table.write_bytes(b"How do I bake bread?\nWhat is the capital of France?")  # its last line lost before
    with pytest.raises(SystemExit) as exit_:
        entry(["screen", str(table), "--model", str(model_dir), "--out", str(table)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --out: " in err and "is the input table" in err
    assert table.read_bytes() == b"How do I bake bread?\nWhat is the capital of France?"


def test_a_line_a_kill_left_unfinished_is_cut_and_its_row_screened_again(tmp_path):
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS[:4])]
    out = tmp_path / "out.jsonl"
    screen_to_jsonl(model, rows[:2], out, progress=False)
    whole = out.read_bytes()
    for cut in (b'{"i', b'{"id": "2", "flagged": fal'):
        out.write_bytes(whole + cut)
        summary = screen_to_jsonl(model, rows[:2], out, progress=False)
        assert summary.resumed == 2 and out.read_bytes() == whole
    out.write_bytes(whole + b'{"id": "2", "flagged": fal')
    assert screen_to_jsonl(model, rows, out, progress=False).resumed == 2
    assert sorted(by_id(out)) == ["0", "1", "2", "3"]


def test_each_line_can_hold_its_prompt_to_read_the_rows_flagged(tmp_path, model_dir, capsys):
    model = guarded()
    rows = [PromptRow(str(i), text) for i, text in enumerate(TEXTS)] + [PromptRow("#99", None, error="empty prompt")]
    out = tmp_path / "with.jsonl"
    screen_to_jsonl(model, rows, out, batch_size=4, with_prompt=True, progress=False)
    written = by_id(out)
    assert {row_id: record["prompt"] for row_id, record in written.items()} == {row.id: row.text for row in rows}
    flagged = [record["prompt"] for record in written.values() if record["flagged"]]
    assert flagged and set(flagged) < set(TEXTS)  # the rows to read, from the output alone
    screen_to_jsonl(model, rows, tmp_path / "without.jsonl", batch_size=4, progress=False)
    assert_same_verdicts(written, by_id(tmp_path / "without.jsonl"))  # the same verdicts, with or without
    assert not any("prompt" in record for record in lines(tmp_path / "without.jsonl"))
    # a run that writes prompts does not resume one that wrote none, nor the other way round
    for path, with_prompt in ((tmp_path / "without.jsonl", True), (out, False)):
        with pytest.raises(ValueError, match="resuming would leave lines of both kinds"):
            screen_to_jsonl(model, rows, path, with_prompt=with_prompt, progress=False)
    # the command: --with-prompt
    text = tmp_path / "prompts.txt"
    text.write_text("".join(p + "\n" for p in TEXTS[:3]))
    cli, guard = tmp_path / "cli.jsonl", tmp_path / "guard"
    two_headed_guard().save_pretrained(guard)
    entry(["screen", str(text), "--model", str(model_dir), "--guard", str(guard), "--out", str(cli), "--with-prompt"])
    assert [record["prompt"] for record in lines(cli)] == TEXTS[:3] and "rows have a verdict" in capsys.readouterr().out


def test_killed_mid_run_and_started_again_nothing_lost_nothing_twice(model_dir, tmp_path):
    guard_dir = tmp_path / "guard"
    two_headed_guard().save_pretrained(guard_dir)
    n = 200
    table = tmp_path / "prompts.jsonl"
    table.write_text("".join(json.dumps({"prompt": f"{TEXTS[i % len(TEXTS)]} ({i})"}) + "\n" for i in range(n)))
    out = tmp_path / "verdicts.jsonl"
    argv = [sys.executable, "-m", "hf_lsad.cli", "screen", str(table), "--out", str(out)]
    argv += ["--model", str(model_dir), "--guard", str(guard_dir), "--batch-size", "1"]
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    with (tmp_path / "log").open("w") as log:  # not a pipe: a full pipe would stall the run
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < n // 3):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)  # no chance to clean up, as a machine that goes down
    process.wait()
    written_at_kill = len(out.read_bytes().splitlines())
    assert 0 < written_at_kill < n, "the run was not interrupted mid-way"
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"{n} of {n} rows have a verdict" in again.stdout
    model, tokenizer, _ = tiny_guard("prompt_last")
    fresh = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(guard_dir), tokenizer=tokenizer)
    screen_to_jsonl(fresh, read_prompt_table(table), tmp_path / "fresh.jsonl", batch_size=1, progress=False)
    assert_same_verdicts(by_id(out), by_id(tmp_path / "fresh.jsonl"))


def test_an_interrupted_screen_says_how_many_rows_it_left_to_the_next_run(model_dir, tmp_path):
    guard_dir = tmp_path / "guard"
    two_headed_guard().save_pretrained(guard_dir)
    n = 200
    table = tmp_path / "prompts.jsonl"
    table.write_text("".join(json.dumps({"prompt": f"{TEXTS[i % len(TEXTS)]} ({i})"}) + "\n" for i in range(n)))
    out = tmp_path / "verdicts.jsonl"
    # Ctrl-C as at a terminal, even where this suite runs with SIGINT ignored (which a child would inherit)
    start = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    start += "from hf_lsad.cli.main import entry; entry(sys.argv[1:])"
    argv = [sys.executable, "-c", start, "screen", str(table), "--out", str(out)]
    argv += ["--model", str(model_dir), "--guard", str(guard_dir), "--batch-size", "1"]
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    log = tmp_path / "log"
    with log.open("w") as sink:  # not a pipe: a full pipe would stall the run
        process = subprocess.Popen(argv, env=env, stdout=sink, stderr=sink)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_bytes().splitlines()) < n // 3):
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=120) == 130, log.read_text()
    written = len(by_id(out))
    assert 0 < written < n, "the run was not interrupted mid-way"
    assert f"note: {written} of {n} rows have a verdict in {out}; run the same command again" in log.read_text()


@pytest.mark.parametrize(
    ("written", "flagged", "failed_closed", "errors", "often"),
    [
        (100, 72, 0, 0, True),  # security questions against a 5% target
        (1000, 130, 0, 0, True),
        (1000, 110, 0, 0, False),  # above twice the target, within chance of it
        (60, 7, 0, 0, False),  # a small table's chance share: web-agent tasks, a kind flagged at 8%
        (1000, 130, 40, 0, False),  # rows that failed closed are flagged, not scored: 90 of 960
        (1000, 110, 0, 300, True),  # rows not screened are left out: 110 of 700
        (100, 0, 0, 100, False),  # nothing scored
    ],
)
def test_a_table_is_flagged_often_when_its_share_is_surely_above_twice_the_target(
    written, flagged, failed_closed, errors, often
):
    summary = ScreenSummary(
        rows=written, written=written, resumed=0, flagged=flagged, failed_closed=failed_closed, errors=errors
    )
    assert summary.flagged_often(0.05) is often


def test_the_summary_gives_the_shares_flagged_of_the_rows_screened():
    summary = ScreenSummary(
        rows=1000, written=1000, resumed=0, flagged=110, flagged_by_head={"harm": 100, "anomaly": 20}, errors=300
    )
    assert "flagged 110 of 700 screened (15.7%), by head: harm 14.3%, anomaly 2.9%; " in summary.describe()
    nothing = ScreenSummary(rows=2, written=2, resumed=0, flagged=0, errors=2)
    assert "flagged 0 of 0 screened (0.0%), by head: none; " in nothing.describe()
