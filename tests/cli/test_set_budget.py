"""``hf-lsad set-budget`` and :func:`fit_budget_on_prompts`: thresholds on the user's own traffic, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
from tiny import HELD_OUT, SAMPLE, TRAFFIC, fresh_guard, refused_to_another_run, tiny_guard, two_headed_guard

from hf_lsad import load_model
from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.cli.commands import harm_advice
from hf_lsad.cli.main import entry
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.errors import ThresholdsResetWarning
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fingerprint import boundary_flag_rate
from hf_lsad.guard.heads import bundled_checks
from hf_lsad.guard.heads.budget import fit_budget_on_prompts, taught_budget_warning
from hf_lsad.guard.heads.bundled import KEPT_CACHE, bundled_features, read_folder, release_rows
from hf_lsad.guard.threshold import allowed_flags

NO_CHECKS = ["--chat-check", "0", "--domain-check", "0", "--harm-check", "0"]
"""What a changed guard does to bundled chat, the other benign domains and harm is read in the first test alone (the
harm rows hold jailbreaks of thousands of characters, which the tiny model's tokenizer reads a token each)."""


def flag_rate(guard: SafetyGuard, prompts: list[str]) -> float:
    model, tokenizer, _ = tiny_guard("prompt_last")
    reads, _ = collect_prompt_features(model, tokenizer, prompts, guard.reads, progress=False)
    return float(guard(reads).flagged.double().mean())


@pytest.fixture
def guard_dir(tmp_path):
    path = tmp_path / "guard"
    two_headed_guard(target_fpr=0.1).save_pretrained(path)
    return path


def test_set_budget_writes_a_guard_whose_thresholds_pass_the_traffic(
    model_dir, guard_dir, tmp_path, capsys, monkeypatch
):
    sample = tmp_path / "traffic.jsonl"
    sample.write_text("".join(json.dumps({"text": t}) + "\n" for t in SAMPLE))  # read with --column text
    out = tmp_path / "mine"
    before = SafetyGuard.from_pretrained(guard_dir)
    assert flag_rate(before, HELD_OUT) == 1.0  # the traffic the heads never saw: all of it flagged

    argv = ["set-budget", "--guard", str(guard_dir), "--model", str(model_dir), "--benign", str(sample)]
    cache = tmp_path / "cache"
    checks = ["--domain-check", "2", "--harm-check", "1", "--cache", str(cache)]
    held_during_checks = []

    def spied(*args, **kwargs):  # the checks collect into the cache's sub-folders: is the cache still held?
        held_during_checks.append(refused_to_another_run(cache))
        return bundled_features(*args, **kwargs)

    monkeypatch.setattr(bundled_checks, "bundled_features", spied)
    entry([*argv, "--column", "text", "--out", str(out), *checks])
    assert held_during_checks == [True, True, True] and not refused_to_another_run(cache)
    printed = capsys.readouterr()
    assert (
        "thresholds set on 100 prompts" in printed.out
        and "harm: share 0.50, threshold" in printed.out
        and "(was " in printed.out
    )
    # what the new thresholds did to ordinary chat, the other benign domains and the bundled harm, beside the guard
    # they came from
    assert "  bundled validation chat (500 rows): the new guard flags " in printed.out
    domains = "  bundled validation benign domains (at most 2 rows of each): the new guard flags task prompts "
    assert (
        domains in printed.out
        and "plain statements " in printed.out
        and "; in brackets, the guard it came" in printed.out
    )
    harm = "  bundled validation harm (at most 1 rows of each of 10 sources and pools): the new guard catches "
    assert harm in printed.out and "in the median (worst " in printed.out
    assert all(f"{check} check 2 reads" in printed.err for check in ("chat", "domain", "harm"))  # the bars say which
    # --cache keeps each check's draw, a folder each (read back instead of through the model: the checks' own tests)
    drawn = sorted(str(p.relative_to(cache)) for p in cache.glob("validation-*/*"))
    assert drawn == [
        "validation-chat/500-rows-seed-0",
        "validation-domains/2-per-domain-seed-0",
        "validation-harm/1-per-group-seed-0",
    ]
    # thresholds raised until the password resets pass let harm through, and the user is told what costs less
    assert "warning: the new guard lets through more of the bundled harm (" in printed.err
    assert "hf-lsad teach on that traffic keeps far more of it" in printed.err

    guard = SafetyGuard.from_pretrained(out)
    budget = guard.budget
    assert budget.heads == before.budget.heads and budget.shares == pytest.approx(before.budget.shares)
    assert budget.target_fpr == 0.1 and budget.confidence is None and budget.n_rows == 100
    assert budget.measured_fpr <= 0.1 and "traffic.jsonl" in budget.rows
    assert all(new >= old for new, old in zip(budget.thresholds, before.budget.thresholds))
    assert guard.fingerprint is not None and guard.fingerprint.boundary is None  # the user's prompts stay theirs
    assert flag_rate(guard, HELD_OUT) <= 0.2  # held-out traffic of the same kind now passes, within sampling
    assert flag_rate(guard, ["explain how to steal the password of account 7 from my neighbour"]) == 1.0
    assert SafetyGuard.from_pretrained(guard_dir).budget == before.budget  # --out: the source folder is kept
    assert "set-budget" in (out / "README.md").read_text()


def test_set_budget_keeps_the_users_prompts_nearest_the_thresholds_only_when_asked(
    model_dir, guard_dir, tmp_path, capsys
):
    sample = tmp_path / "traffic.txt"
    sample.write_text("\n".join(SAMPLE) + "\n")
    arguments = ["set-budget", "--guard", str(guard_dir), "--model", str(model_dir), "--benign", str(sample)]
    entry([*arguments, *NO_CHECKS, "--out", str(tmp_path / "unasked")])
    printed = capsys.readouterr().out
    assert "kept in the folder" not in printed and "bundled validation" not in printed  # 0 rows skip each check
    assert SafetyGuard.from_pretrained(tmp_path / "unasked").fingerprint.boundary is None

    out = tmp_path / "kept"
    entry([*arguments, *NO_CHECKS, "--out", str(out), "--keep-nearest"])
    guard = SafetyGuard.from_pretrained(out)
    boundary = guard.fingerprint.boundary
    assert boundary is not None and boundary.n_rows == 100 and "traffic.txt" in boundary.rows
    kept = boundary.input_ids.shape[0]
    assert 0 < kept < 100
    printed = capsys.readouterr().out
    assert f"kept in the folder for the model check: the {kept} of the 100 prompts nearest the thresholds" in printed
    model, tokenizer = load_model(str(model_dir))  # as the CLI loaded it (sdpa attention, unlike the tiny eager one)
    # the user's own prompts, as read (the tiny tokenizer's characters decode apart)
    texts = [t.replace(" ", "") for t in tokenizer.batch_decode(boundary.input_ids, skip_special_tokens=True)]
    assert all(any(prompt.replace(" ", "") in text for prompt in SAMPLE) for text in texts)
    assert boundary_flag_rate(model, guard) == (boundary.flagged_rows / 100,) * 2  # the same model: the rate recorded


def test_set_budget_sets_the_thresholds_under_the_deployments_system_turn(model_dir, guard_dir, tmp_path, capsys):
    sample = tmp_path / "traffic.txt"
    sample.write_text("\n".join(SAMPLE) + "\n")
    system = "You are the support assistant of a bank."
    out = tmp_path / "mine"
    arguments = ["--guard", str(guard_dir), "--model", str(model_dir), "--benign", str(sample), "--out", str(out)]
    entry(["set-budget", *arguments, *NO_CHECKS, "--system", system])
    budget = SafetyGuard.from_pretrained(out).budget
    assert repr(system) in budget.rows and repr(system) in (out / "README.md").read_text()
    assert SafetyGuard.from_pretrained(out).inputs.system == system  # what generate and screen check rows against

    model, tokenizer, _ = tiny_guard("prompt_last")
    under = fit_budget_on_prompts(model, tokenizer, SafetyGuard.from_pretrained(guard_dir), SAMPLE, system=system)
    default = fit_budget_on_prompts(model, tokenizer, SafetyGuard.from_pretrained(guard_dir), SAMPLE)
    assert budget.thresholds == pytest.approx(under.thresholds, rel=1e-5)  # the prompts as the deployment sends them
    assert budget.thresholds != pytest.approx(default.thresholds, rel=1e-3)
    again = tmp_path / "default"
    entry(
        [
            "set-budget",
            "--guard",
            str(out),
            "--model",
            str(model_dir),
            "--benign",
            str(sample),
            *NO_CHECKS,
            "--out",
            str(again),
        ]
    )
    assert SafetyGuard.from_pretrained(again).inputs.system is None  # set again under the template's own turn
    with pytest.raises(SystemExit):
        entry(["set-budget", "--guard", str(guard_dir), "--benign", str(sample), "--out", str(out), "--system", " "])
    assert "argument --system: empty" in capsys.readouterr().err


def test_fit_budget_on_prompts_keeps_or_sets_the_confidence():
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard(target_fpr=0.1)
    kept = fit_budget_on_prompts(model, tokenizer, guard, SAMPLE, progress=False)
    assert kept.confidence is None and kept.target_fpr == 0.1
    assert kept.rows == "the user's own benign prompts"
    strict = fit_budget_on_prompts(
        model, tokenizer, guard, TRAFFIC, target_fpr=0.1, confidence=0.9, rows="mine", progress=False
    )
    assert strict.confidence == 0.9 and strict.rows == "mine" and strict.measured_fpr <= kept.measured_fpr
    with pytest.raises(ValueError, match="need at least"):  # before any forward pass
        fit_budget_on_prompts(model, tokenizer, guard, SAMPLE[:5], confidence=0.95, progress=False)
    with pytest.raises(ValueError, match="empty"):
        fit_budget_on_prompts(model, tokenizer, guard, ["fine", "  "], progress=False)
    with pytest.raises(ValueError, match="reads the response"):
        fit_budget_on_prompts(model, tokenizer, fresh_guard("response_last"), SAMPLE, progress=False)


TAUGHT_ROWS = "the user's own benign prompts, a.txt (50 held back; 50 more taught to head 'harm')"
"""The rows of a budget ``teach`` set, teaching head ``harm``."""


def test_setting_the_thresholds_of_a_taught_guard_again_warns():
    """teach set the thresholds on the part of the sample it held back: set again on the prompts it taught, they
    would flag more of that traffic than the budget allows; on the bundled chat, they no longer bound it."""
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = two_headed_guard(target_fpr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ThresholdsResetWarning)  # a guard not taught: nothing to say
        fit_budget_on_prompts(model, tokenizer, guard, SAMPLE, progress=False)
    taught = guard.budget = dataclasses.replace(guard.budget, rows=TAUGHT_ROWS)
    with pytest.warns(ThresholdsResetWarning, match=r"set by hf-lsad teach \(the user's own .*if these prompts") as w:
        fit_budget_on_prompts(model, tokenizer, guard, SAMPLE, progress=False)
    assert w[0].filename == __file__  # attributed to the caller's line
    assert "set again on the bundled validation chat" in taught_budget_warning(taught, own_prompts=False)
    assert taught_budget_warning(dataclasses.replace(taught, rows="validation chat"), own_prompts=True) == ""
    assert taught_budget_warning(None, own_prompts=True) == ""


def test_set_budget_says_before_the_model_loads_that_the_guard_was_taught(model_dir, tmp_path, capsys):
    guard = two_headed_guard(target_fpr=0.1)
    guard.budget = dataclasses.replace(guard.budget, rows=TAUGHT_ROWS)
    guard.save_pretrained(tmp_path / "taught")
    (tmp_path / "traffic.txt").write_text("".join(t + "\n" for t in SAMPLE))
    argv = ["set-budget", "--guard", str(tmp_path / "taught"), "--model", str(model_dir), *NO_CHECKS]
    entry([*argv, "--benign", str(tmp_path / "traffic.txt"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert f"warning: the guard's thresholds were set by hf-lsad teach ({TAUGHT_ROWS}); if these prompts" in err
    assert err.count("set by hf-lsad teach") == 1 and "ThresholdsResetWarning" not in err  # not said twice
    assert err.index("set by hf-lsad teach") < err.index("collect ")  # before the forward passes


@pytest.mark.parametrize(
    ("lines", "flags", "error"),
    [
        ([], [], "holds no prompts"),
        (["\n", "  \n"], [], "holds no prompts"),
        (SAMPLE[:20], ["--confidence", "0.95"], "20 prompts: 20 held-out safe rows cannot bound the rate at 0.1"),
        (["{not json"], [], "not JSON"),
        (SAMPLE, ["--confidence", "1.5"], "argument --confidence"),
        (SAMPLE, ["--target-fpr", "0"], "argument --target-fpr"),
        (SAMPLE, ["--guard", "default"], "argument --out: needed"),
        (SAMPLE, ["--benign", "missing.txt"], "no file"),
        (SAMPLE, ["--guard", "RESPONSE"], "reads the response"),
        (SAMPLE, ["--keep-bundled", "nonesuch"], "argument --keep-bundled: invalid choice: 'nonesuch'"),
        (SAMPLE, ["--keep-bundled", "chat", "chat"], "argument --keep-bundled: keep_bundled takes distinct pools"),
        (  # 300 prompts bound the rate at 2% with 95% confidence; the 87 look-alikes cannot on their own
            TRAFFIC * 2,
            ["--keep-bundled", "lookalike", "--target-fpr", "0.02", "--confidence", "0.95"],
            "argument --keep-bundled: 87 held-out safe rows cannot bound the rate",
        ),
    ],
)
def test_set_budget_refuses_bad_input_before_loading_a_model(lines, flags, error, guard_dir, tmp_path, capsys):
    suffix = ".jsonl" if lines == ["{not json"] else ".txt"
    benign = tmp_path / f"benign{suffix}"
    benign.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    if "RESPONSE" in flags:
        fresh_guard("response_last").save_pretrained(tmp_path / "response-guard")
    renamed = {"missing.txt": str(tmp_path / "missing.txt"), "RESPONSE": str(tmp_path / "response-guard")}
    flags = [renamed.get(f, f) for f in flags]
    with pytest.raises(SystemExit) as info:
        entry(["set-budget", "--guard", str(guard_dir), "--benign", str(benign), *flags])
    assert info.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--target-fpr", "0.001"], ["--target-fpr", "0.002", "--confidence", "0.9999"]])
def test_a_rate_the_bundled_chat_cannot_bound_names_the_flag_that_asked_for_it(capsys, tmp_path, flags):
    # without --benign the rows are the bundled validation chat: the error named --benign, which was not given
    with pytest.raises(SystemExit) as info:
        entry(["set-budget", "--guard", "default", "--out", str(tmp_path / "guard"), *flags])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and error.startswith("hf-lsad set-budget: error: argument --target-fpr: the bundled")
    assert "validation chat's 1338 prompts: 1338 held-out safe rows cannot bound the rate" in error


@pytest.mark.parametrize(
    ("command", "two_headed", "advice"),
    [
        ("set-budget", True, "hf-lsad teach on that traffic keeps far more of it"),
        ("set-budget", False, "this guard has no supervised head to teach that traffic"),  # the paper's guard
        ("teach", True, "about a thousand prompts hold them steadier"),
        ("add-head", False, "a smaller --share leaves them more"),
    ],
)
def test_the_harm_warning_advises_what_the_guard_can_do(command, two_headed, advice):
    guard = two_headed_guard() if two_headed else fresh_guard("prompt_last")
    assert advice in harm_advice(command, guard)
    # a sample's own harm, taken as benign, raises thresholds set on it: said after both commands that set them so
    assert ("take the harm out" in harm_advice(command, guard)) is (command != "add-head")


def test_fit_budget_on_prompts_keeps_each_bundled_pool_within_the_budget(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    guard, cache = two_headed_guard(target_fpr=0.1), tmp_path / "cache"
    kept = ["questions", "statements"]  # the shortest pools: "chat" is read the same way
    budget = fit_budget_on_prompts(model, tokenizer, guard, SAMPLE, keep_bundled=kept, cache_dir=cache, progress=False)
    questions, statements = (len(release_rows(pool, "validation")) for pool in kept)
    assert budget.rows == (
        f"the user's own benign prompts, and the bundled validation rows of questions ({questions:,}), statements "
        f"({statements:,}), each kind within the budget"
    )
    assert budget.n_rows == len(SAMPLE) + questions + statements
    # the heads together flag at most the budget of each kind of rows on its own: the prompts, and each kept pool
    # as the cache keeps its rows (a folder per pool)
    own, _ = collect_prompt_features(model, tokenizer, SAMPLE, guard.reads, progress=False)
    groups = {"prompts": own} | {
        pool: {
            read: load_activations(cache / KEPT_CACHE / pool / read_folder(read)).activations for read in guard.reads
        }
        for pool in kept
    }
    for name, reads in groups.items():
        rows = len(next(iter(reads.values())))
        assert int(guard(reads).flagged.sum()) <= allowed_flags(rows, 0.1), name
    # read back from the cache, not the model: activations changed there change the thresholds
    for folder in (cache / KEPT_CACHE / "questions").iterdir():
        store = load_activations(folder)
        save_activations(folder, store.activations * 0.0, store.records, store.hook, inputs=store.inputs)
    again = fit_budget_on_prompts(
        model, tokenizer, two_headed_guard(target_fpr=0.1), SAMPLE, keep_bundled=kept, cache_dir=cache, progress=False
    )
    assert again.thresholds != budget.thresholds


@pytest.mark.parametrize(
    ("prompts", "keep_bundled", "options", "error"),
    [
        (SAMPLE, "chat", {}, "a list of pool names"),
        (SAMPLE, ["nonesuch"], {}, "keep_bundled takes distinct pools of"),
        (SAMPLE, ["chat", "chat"], {}, "keep_bundled takes distinct pools of"),
        (None, ["chat"], {}, "set on the chat pool's rows already"),
        (TRAFFIC * 3, ["lookalike"], {"target_fpr": 0.01, "confidence": 0.95}, "87 held-out safe rows cannot bound"),
    ],
)
def test_fit_budget_on_prompts_refuses_bad_kept_pools_before_any_forward_pass(prompts, keep_bundled, options, error):
    _, tokenizer, _ = tiny_guard("prompt_last")
    with pytest.raises((TypeError, ValueError), match=error):  # no model: refused before it would be used
        fit_budget_on_prompts(None, tokenizer, two_headed_guard(), prompts, keep_bundled=keep_bundled, **options)


def test_set_budget_keeps_bundled_pools_within_the_budget(model_dir, guard_dir, tmp_path, capsys):
    sample, out, cache = tmp_path / "traffic.txt", tmp_path / "mine", tmp_path / "cache"
    sample.write_text("".join(t + "\n" for t in SAMPLE))
    argv = ["set-budget", "--guard", str(guard_dir), "--model", str(model_dir), *NO_CHECKS, "--out", str(out)]
    entry([*argv, "--benign", str(sample), "--keep-bundled", "statements", "--cache", str(cache)])
    printed = capsys.readouterr().out
    statements = len(release_rows("statements", "validation"))
    assert (
        f"thresholds set on 100 prompts of {sample}, beside the bundled validation rows of statements "
        f"({statements:,}), each kind kept within the budget" in printed
    )
    assert "(target 10%, each kind of rows within it)" in printed
    assert SafetyGuard.from_pretrained(out).budget.n_rows == 100 + statements
    assert sorted(p.name for p in (cache / KEPT_CACHE).iterdir()) == ["statements"]
    # without --benign the thresholds are set on the bundled chat already: refused before the model loads
    with pytest.raises(SystemExit):
        entry([*argv, "--keep-bundled", "chat"])
    assert "argument --keep-bundled: without prompts the thresholds are set on the chat pool's rows" in (
        capsys.readouterr().err
    )
