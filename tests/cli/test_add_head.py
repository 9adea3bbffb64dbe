"""``hf-lsad add-head``: a head for the user's own category from a file of prompts, and its refusals."""

from __future__ import annotations

import json
import shlex

import pytest
from tiny import fresh_guard

from hf_lsad.cli.main import entry, parse
from hf_lsad.guard import SafetyGuard

CATEGORY = [f"what is the internal codename of project bluebird, version {i}?" for i in range(40)]
NO_CHECK = ["--domain-check", "0", "--harm-check", "0"]
"""What a new head does to the bundled benign domains and harm is read in the first test alone (the harm rows hold
jailbreaks of thousands of characters, which the tiny model's tokenizer reads a token each)."""


@pytest.fixture
def guard_dir(tmp_path):
    path = tmp_path / "guard"
    fresh_guard("prompt_last").save_pretrained(path)
    return path


def test_add_head_writes_a_guard_with_the_new_head(model_dir, guard_dir, tmp_path, capsys):
    unsafe = tmp_path / "secrets.jsonl"
    unsafe.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in CATEGORY))  # as hf-lsad screen reads it
    out = tmp_path / "mine"
    head = ["--name", "secrets", "--unsafe", str(unsafe), "--share", "0.4"]
    sampling = ["--benign-per-pool", "60", "--threshold-rows", "200", "--domain-check", "1", "--harm-check", "1"]
    entry(["add-head", "--guard", str(guard_dir), "--model", str(model_dir), *head, *sampling, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "added head 'secrets' (40 unsafe, 0 own safe prompts)" in printed and "secrets: share 0.40" in printed
    # what the new head did to the other benign domains and its share of the budget to the bundled harm
    # (--domain-check, --harm-check; its thresholds were set on chat, which is not checked)
    assert "  bundled validation benign domains (at most 1 rows of each): the new guard flags task prompts " in printed
    assert (
        "  bundled validation harm (at most 1 rows of each of 10 sources and pools): the new guard catches " in printed
    )
    assert "bundled validation chat (" not in printed
    guard = SafetyGuard.from_pretrained(out)
    assert guard.head_names == ["anomaly", "secrets"] and guard.budget.shares == pytest.approx([0.6, 0.4])
    assert guard.budget.n_rows == 200 and 0.0 < guard.budget.measured_fpr <= guard.budget.target_fpr
    boundary = guard.fingerprint.boundary  # the bundled rows nearest the thresholds, whose text the folder may carry
    assert boundary is not None and boundary.n_rows == 200 and boundary.rows == "validation chat"
    assert SafetyGuard.from_pretrained(guard_dir).head_names == ["anomaly"]  # --out: the source folder is kept
    card = (out / "README.md").read_text()
    assert "| `secrets` |" in card and "This guard has 2 heads" in card and "add-head" in card
    assert "# hf-lsad guard: anomaly (freqmask-km) + secrets (logistic) on " in card  # the title names every head
    assert f"Derived from `{guard_dir}`, whose card did not describe its data. Then: head 'secrets' added" in card

    # its examples are not in the guard, so teach refuses it before a model loads; a screen it flags often advises
    # adding it again with the table as its safe prompts, not teaching it
    table = tmp_path / "codenames.txt"
    table.write_text("".join(f"what is the internal codename of project bluebird, release {i}?\n" for i in range(40)))
    taught = ["teach", "--guard", str(out), "--head", "secrets", "--benign", str(table), "--out", str(tmp_path / "t")]
    with pytest.raises(SystemExit) as info:
        entry(taught)
    assert info.value.code == 2
    assert "argument --head: head 'secrets' was added from your own unsafe examples" in capsys.readouterr().err
    entry(["screen", str(table), "--model", str(model_dir), "--guard", str(out), "--out", str(tmp_path / "v.jsonl")])
    err = capsys.readouterr().err
    assert "Head 'secrets', which flagged most of them, was added from your own unsafe examples" in err
    advised = shlex.split(err.split("add it again with them as its safe prompts (")[1].split("; docs/heads.md")[0])
    assert advised[:2] == ["hf-lsad", "add-head"] and "teach" not in err
    _, args = parse(advised[1:])
    assert (args.name, args.safe, args.model, args.out) == ("secrets", str(table), str(model_dir), "my-guard")


def test_a_derived_guards_card_continues_the_card_of_the_guard_it_came_from(model_dir, guard_dir, tmp_path, capsys):
    """add-head, set-budget on its output, add-head again: each card keeps what the one before said the guard was
    fitted on, and add-head prints the threshold each head had before it gave up budget."""
    SafetyGuard.from_pretrained(guard_dir).save_pretrained(guard_dir, data="The tiny benign prompts.")
    unsafe, traffic = tmp_path / "secrets.txt", tmp_path / "traffic.txt"
    unsafe.write_text("".join(t + "\n" for t in CATEGORY))
    traffic.write_text("".join(f"how do I reset the password of my own account number {i}?\n" for i in range(60)))
    model, mine, budgeted = ["--model", str(model_dir)], tmp_path / "mine", tmp_path / "budgeted"
    head = ["--name", "secrets", "--unsafe", str(unsafe), "--benign-per-pool", "30", "--threshold-rows", "100"]
    entry(["add-head", "--guard", str(guard_dir), *model, *head, *NO_CHECK, "--out", str(mine)])
    assert "had been set on" not in capsys.readouterr().err  # the anomaly head's own threshold: nothing to reset
    entry(
        [
            "set-budget",
            "--guard",
            str(mine),
            *model,
            "--benign",
            str(traffic),
            "--chat-check",
            "0",
            *NO_CHECK,
            "--out",
            str(budgeted),
        ]
    )
    card = (budgeted / "README.md").read_text()
    training = card.split("## Training data", 1)[1].split("\n## ", 1)[0]
    assert training.index(f"Derived from `{mine}`:") < training.index(f"Derived from `{guard_dir}`:")
    assert training.index("The tiny benign prompts.") < training.index("Then: head 'secrets' added")
    assert training.index("Then: head 'secrets' added") < training.index("Then: thresholds set with `hf-lsad")

    capsys.readouterr()
    codes = ["--name", "codes", "--unsafe", str(unsafe), "--benign-per-pool", "30", "--threshold-rows", "100"]
    entry(["add-head", "--guard", str(budgeted), *model, *codes, *NO_CHECK, "--out", str(tmp_path / "more")])
    before = SafetyGuard.from_pretrained(budgeted).budget
    captured = capsys.readouterr()
    printed = captured.out.splitlines()
    # its thresholds had been set on the traffic, and are set on bundled chat again: said once, before the model loads
    assert "warning: the guard's thresholds had been set on the user's own benign prompts, traffic.txt;" in captured.err
    assert captured.err.count("had been set on") == 1 and "ThresholdsResetWarning" not in captured.err
    for name, threshold in zip(before.heads, before.thresholds):  # the heads that were there give up budget
        (line,) = [line for line in printed if line.startswith(f"  {name}: share ")]
        assert line.endswith(f" (was {threshold:.4g})"), line
    (line,) = [line for line in printed if line.startswith("  codes: share ")]
    assert "(was" not in line
    assert "Then: head 'codes' added" in (tmp_path / "more" / "README.md").read_text()


def test_add_head_weighs_the_safe_prompts_as_asked_and_the_card_says_so(model_dir, guard_dir, tmp_path, capsys):
    unsafe, safe = tmp_path / "secrets.txt", tmp_path / "ok.txt"
    unsafe.write_text("".join(t + "\n" for t in CATEGORY))
    safe.write_text("".join(f"what is the public name of project bluebird, version {i}?\n" for i in range(20)))
    head = ["--name", "secrets", "--unsafe", str(unsafe), "--safe", str(safe), "--safe-weight", "0.6"]
    sampling = ["--benign-per-pool", "30", "--threshold-rows", "100", *NO_CHECK]
    out = tmp_path / "mine"
    entry(["add-head", "--guard", str(guard_dir), "--model", str(model_dir), *head, *sampling, "--out", str(out)])
    assert "added head 'secrets' (40 unsafe, 20 own safe prompts)" in capsys.readouterr().out
    assert SafetyGuard.from_pretrained(out).heads["secrets"].config.balance == "given"
    assert "20 of the user's own safe prompts (carrying 60% of the benign weight)" in (out / "README.md").read_text()


@pytest.mark.parametrize(
    ("lines", "flags", "error"),
    [
        ([], [], "holds no prompts"),
        (["\n", "  \n"], [], "holds no prompts"),
        (CATEGORY[:5], [], "at least 10 examples"),
        (CATEGORY, ["--safe", "SAME"], "in --unsafe too"),
        (["{not json"], [], "not JSON"),
        (CATEGORY, ["--name", "has space"], "argument --name"),
        (CATEGORY, ["--name", "Anomaly"], "argument --name: the guard already has a head named 'anomaly': 'Anomaly'"),
        (CATEGORY, ["--share", "1.0"], "argument --share"),
        (CATEGORY, ["--safe-weight", "0.5"], "argument --safe-weight: weighs the --safe prompts"),
        (CATEGORY, ["--safe-weight", "1.0"], "argument --safe-weight: 1.0 is not"),
        (CATEGORY, ["--guard", "default"], "argument --out: needed"),
        (CATEGORY, ["--unsafe", "missing.txt"], "no file"),
        (CATEGORY, ["--cache", "SAME"], "argument --cache: "),  # a file, not a folder
        (CATEGORY, ["--system", ""], "argument --system: empty"),
    ],
)
def test_add_head_refuses_bad_input_before_loading_a_model(lines, flags, error, guard_dir, tmp_path, capsys):
    suffix = ".jsonl" if lines == ["{not json"] else ".txt"
    unsafe = tmp_path / f"unsafe{suffix}"
    unsafe.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    flags = [str(unsafe) if f == "SAME" else str(tmp_path / f) if f == "missing.txt" else f for f in flags]
    argv = ["add-head", "--guard", str(guard_dir), "--name", "mine", "--unsafe", str(unsafe)]
    with pytest.raises(SystemExit) as info:
        entry([*argv, *flags])  # later flags win: --name, --guard and --unsafe above are replaced
    assert info.value.code == 2 and error in capsys.readouterr().err


def test_add_head_under_a_system_turn_formats_every_prompt_under_it(model_dir, guard_dir, tmp_path, capsys):
    unsafe = tmp_path / "secrets.txt"
    unsafe.write_text("".join(t + "\n" for t in CATEGORY))
    turn = "You are the assistant of the Bluebird team."
    head = ["--name", "secrets", "--unsafe", str(unsafe), "--benign-per-pool", "60", "--threshold-rows", "200"]
    argv = ["add-head", "--guard", str(guard_dir), "--model", str(model_dir), *head, *NO_CHECK]
    entry([*argv, "--out", str(tmp_path / "default")])
    entry([*argv, "--out", str(tmp_path / "turned"), "--system", turn])
    assert f"200 rows of validation chat, under the system turn {turn!r}" in capsys.readouterr().out
    default, turned = (SafetyGuard.from_pretrained(tmp_path / name) for name in ("default", "turned"))
    assert turned.inputs.system == turn and default.inputs.system is None  # the thresholds' turn, recorded
    assert repr(turn) in (tmp_path / "turned" / "README.md").read_text()
    # the examples and bundled rows reached the new head under the turn: another fit
    weights = [guard.heads["secrets"].state_dict()["probe.mean"] for guard in (default, turned)]
    assert weights[0].shape == weights[1].shape and not weights[0].equal(weights[1])
