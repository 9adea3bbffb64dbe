"""A deployment's system turn through ``generate``, ``screen`` and ``explain``, and a chat log's whole conversations
through ``screen --conversation``: the prompts read as the deployment sends them, and the refusals."""

from __future__ import annotations

import json

import pytest
from tiny import fresh_guard, tiny_guard

from hf_lsad.cli.main import entry
from hf_lsad.core.prompt_inputs import InputProfile
from hf_lsad.generation.model import GuardedModelForCausalLM

SYSTEM = "You are the support assistant of a bank."
PROMPTS = ["How do I bake bread?", "Tell me a joke about the weather"]


@pytest.fixture
def guard_dir(tmp_path):
    fresh_guard("prompt_last").save_pretrained(tmp_path / "guard")
    return tmp_path / "guard"


def screened(system: str | None) -> list[str]:
    """Each prompt's report line, screened in Python under ``system``."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, fresh_guard("prompt_last"), tokenizer=tokenizer)
    return [report.describe() for report in guarded.screen(PROMPTS, system=system)]


def test_generate_reads_the_prompts_under_the_system_turn(model_dir, guard_dir, capsys):
    common = ["generate", "--model", str(model_dir), "--guard", str(guard_dir), "--max-new-tokens", "2"]
    entry([*common, "--system", SYSTEM, *PROMPTS])
    out = capsys.readouterr().out
    assert all(f"safety:   {line}" in out for line in screened(SYSTEM))  # a prompt_last verdict is screen's
    assert not any(f"safety:   {line}" in out for line in screened(None))


def test_screen_reads_the_prompts_under_the_system_turn(model_dir, guard_dir, tmp_path):
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    common = ["screen", str(tmp_path / "p.txt"), "--model", str(model_dir), "--guard", str(guard_dir)]
    entry([*common, "--out", str(tmp_path / "under.jsonl"), "--system", SYSTEM])
    entry([*common, "--out", str(tmp_path / "default.jsonl")])
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, fresh_guard("prompt_last"), tokenizer=tokenizer)
    written = {}
    for name, system in (("under", SYSTEM), ("default", None)):
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        written[name] = [line["heads"]["anomaly"]["score"] for line in sorted(lines, key=lambda line: int(line["id"]))]
        assert written[name] == pytest.approx([r.score for r in guarded.screen(PROMPTS, system=system)], abs=1e-5)
    assert written["under"] != pytest.approx(written["default"], abs=1e-3)


def test_explain_reads_the_prompts_under_the_system_turn(model_dir, guard_dir, capsys):
    common = ["explain", "--model", str(model_dir), "--guard", str(guard_dir), "--top-k", "2"]
    entry([*common, "--system", SYSTEM, PROMPTS[0]])
    assert screened(SYSTEM)[0] in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["generate", "--system", " ", "hi"], "argument --system: empty"),
        (["screen", "p.txt", "--out", "v.jsonl", "--raw", "--system", SYSTEM], "which --raw leaves out"),
        (["explain", "--system", "", "hi"], "argument --system: empty"),
    ],
)
def test_an_empty_system_turn_or_one_without_the_template_is_refused(argv, error, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(SystemExit) as info:
        entry(argv)
    assert info.value.code == 2 and error in capsys.readouterr().err


def test_a_row_under_another_turn_than_the_guards_warns_in_one_line(model_dir, tmp_path, capsys):
    guard = fresh_guard("prompt_last")
    guard.inputs = InputProfile("chat_template", 200)  # thresholds set under the template's default turn
    guard.save_pretrained(tmp_path / "profiled")
    common = ["generate", "--model", str(model_dir), "--guard", str(tmp_path / "profiled"), "--max-new-tokens", "1"]
    entry([*common, *PROMPTS])
    assert "warning" not in capsys.readouterr().err
    entry([*common, "--system", SYSTEM, *PROMPTS])
    err = capsys.readouterr().err
    assert "hf-lsad: warning: UserWarning: rows [0, 1] open with another system turn" in err
    assert "the chat template's default" in err and ".py:" not in err  # the command's voice, not a traceback's


def test_screen_reads_a_chat_logs_whole_conversations_when_asked(model_dir, guard_dir, tmp_path):
    """``--conversation``: each row's turns read as the server reads them for its next answer; without it, the last
    user turn alone."""
    turns = [
        {"role": "user", "content": PROMPTS[0]},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": PROMPTS[1]},
    ]
    (tmp_path / "log.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    common = ["screen", str(tmp_path / "log.jsonl"), "--model", str(model_dir), "--guard", str(guard_dir)]
    entry([*common, "--out", str(tmp_path / "whole.jsonl"), "--conversation"])
    entry([*common, "--out", str(tmp_path / "last.jsonl")])
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, fresh_guard("prompt_last"), tokenizer=tokenizer)
    served = tokenizer.apply_chat_template([turns], add_generation_prompt=True, return_dict=True, return_tensors="pt")
    want = {"whole": guarded.screen(**served)[0].score, "last": guarded.screen([PROMPTS[1]])[0].score}
    for name, score in want.items():
        (line,) = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert line["heads"]["anomaly"]["score"] == pytest.approx(score, abs=1e-5)
        assert line["read"]["conversation"] is (name == "whole")
    assert want["whole"] != pytest.approx(want["last"], abs=1e-3)


def test_conversations_without_the_template_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "log.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as info:
        entry(["screen", "log.jsonl", "--out", "v.jsonl", "--conversation", "--raw"])
    assert info.value.code == 2 and "argument --conversation" in capsys.readouterr().err
