"""A guard judged on labelled prompt tables: the metrics equal what screening each prompt gives, and ``hf-lsad
evaluate --benign-prompts/--unsafe-prompts --out`` writes the pictures and one self-contained HTML page."""

from __future__ import annotations

import html
import json
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from tiny import PROMPTS, UNSAFE_PROMPTS, fresh_guard, tiny_guard, two_headed_guard

from hf_lsad.cli.main import entry
from hf_lsad.data.tables import PromptRow
from hf_lsad.evaluation.plots import write_report
from hf_lsad.evaluation.prompts import check_prompt_sources, evaluate_prompt_sources
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard


def rows(texts):
    return [PromptRow(str(i), t) for i, t in enumerate(texts)]


def on_threshold(score: float, threshold: float) -> bool:
    """Whether ``score`` sits on ``threshold`` up to float round-off, where a row may fall either way."""
    return math.isclose(score, threshold, rel_tol=1e-5, abs_tol=1e-8)


def test_metrics_are_what_screening_each_prompt_gives(tmp_path):
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, two_headed_guard(), tokenizer=tokenizer)
    benign, unsafe = PROMPTS[:30], UNSAFE_PROMPTS[:20]
    evaluation = evaluate_prompt_sources(
        guarded,
        {"notes": (rows(benign), False), "stealing": ([*rows(unsafe), PromptRow("x", None, "empty prompt")], True)},
        batch_size=7,
    )
    metrics = evaluation.metrics()
    alone = {t: guarded.screen([t])[0] for t in benign + unsafe}
    for name, texts in (("notes", benign), ("stealing", unsafe)):
        # batched and alone, a score moves by float round-off; a row whose score sits on a threshold (the tiny
        # guard's thresholds are its own rows' scores) may fall either way on another CPU's kernels
        on_edge = sum(any(on_threshold(v.score, v.threshold) for v in alone[t].head_verdicts()) for t in texts)
        want_flagged = np.mean([alone[t].flagged for t in texts])
        assert abs(metrics[name]["flagged"] - want_flagged) * len(texts) <= on_edge + 1e-9
        for head in ("anomaly", "harm"):  # which head caught the rows, each on its own
            want_by_head = np.mean([head in alone[t].decided_by for t in texts])
            assert abs(metrics[name][f"flagged_by_{head}"] - want_by_head) * len(texts) <= on_edge + 1e-9
    assert metrics["stealing"]["errors"] == 1 and metrics["stealing"]["rows"] == 20
    assert metrics["stealing"]["flagged_by_harm"] > 0
    harm = {t: alone[t].head_verdicts()[1].score for t in benign + unsafe}
    want = roc_auc_score([0] * 30 + [1] * 20, [harm[t] for t in benign + unsafe])
    assert metrics["stealing"]["auroc_harm"] == pytest.approx(want, abs=1e-6)
    assert list(evaluation.thresholds) == ["anomaly", "harm"]

    # at thresholds set again on every benign row, each head keeping its share of the guard's budget
    assert evaluation.shares == dict(zip(guarded.guard.budget.heads, guarded.guard.budget.shares))
    scores = {t: [v.score for v in alone[t].head_verdicts()] for t in benign + unsafe}
    summary = evaluation.summary()
    for fpr, thresholds in evaluation.fixed_fpr_thresholds().items():
        cut = torch.tensor([thresholds["anomaly"], thresholds["harm"]], dtype=torch.float64)
        flagged = {t: bool((torch.tensor(scores[t], dtype=torch.float64) > cut).any()) for t in benign + unsafe}
        # the thresholds are batched rows' scores, which the same row screened alone may pass by round-off
        on_edge = sum(any(on_threshold(s, c) for s, c in zip(scores[t], cut.tolist())) for t in benign)
        # the heads together, on the benign rows
        assert sum(flagged[t] for t in benign) <= fpr * len(benign) + on_edge + 1e-9
        caught = np.mean([flagged[t] for t in unsafe])
        assert metrics["stealing"][f"flagged_at_fpr_{fpr:g}"] == pytest.approx(caught, abs=1 / 20 + 1e-9)
        spread = summary[f"at_fpr_{fpr:g}"]
        assert spread["thresholds"] == thresholds
        assert spread["sources"] == {"stealing": metrics["stealing"][f"flagged_at_fpr_{fpr:g}"]}
        assert spread["median"] == spread["worst"]["rate"] == spread["sources"]["stealing"]  # one unsafe source
    assert set(evaluation.fixed_fpr_thresholds()) == {0.05, 0.01} and summary["benign_rows"] == 30
    guard_level = summary["at_guard_thresholds"]
    assert guard_level["worst"] == {"source": "stealing", "rate": metrics["stealing"]["flagged"]}

    written = write_report(evaluation, tmp_path / "report")
    assert written == ["roc-anomaly.png", "scores-anomaly.png", "roc-harm.png", "scores-harm.png", "report.html"]
    for name in written[:-1]:
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "<td>stealing</td>" in page and 'src="http' not in page
    assert (
        "<th>by harm</th>" in page and "<th>at 5% FPR</th>" in page and "<td>median / worst unsafe source</td>" in page
    )


def test_the_summary_gives_the_median_and_the_worst_unsafe_source_for_one_head_and_two():
    model, tokenizer, _ = tiny_guard("prompt_last")
    sources = {
        "notes": (rows(PROMPTS[:40]), False),
        "stealing": (rows(UNSAFE_PROMPTS[:10]), True),
        "more stealing": (rows(UNSAFE_PROMPTS[10:20]), True),
        "notes, as harm": (rows(PROMPTS[40:48]), True),  # a source the guard cannot catch: the worst
    }
    for guard in (fresh_guard("prompt_last"), two_headed_guard()):
        evaluation = evaluate_prompt_sources(GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), sources)
        metrics, summary = evaluation.metrics(), evaluation.summary()
        for key in ("at_guard_thresholds", "at_fpr_0.05", "at_fpr_0.01"):
            column = "flagged" if key == "at_guard_thresholds" else f"flagged_at_fpr_{key[7:]}"
            rates = {name: metrics[name][column] for name in ("stealing", "more stealing", "notes, as harm")}
            assert summary[key]["sources"] == rates and summary[key]["median"] == float(np.median(list(rates.values())))
            assert summary[key]["worst"] == {"source": min(rates, key=rates.__getitem__), "rate": min(rates.values())}
        assert "flagged_at_fpr_0.05" not in metrics["notes"]  # a benign source has its own FPR, not a TPR
        assert summary["benign_rows"] == 40


def test_the_cli_writes_metrics_pictures_and_the_page(model_dir, tmp_path, capsys):
    guard_dir = tmp_path / "guard"
    two_headed_guard().save_pretrained(guard_dir)
    for name, texts in (("notes", PROMPTS[:20]), ("stealing", UNSAFE_PROMPTS[:12])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    tables = ["--benign-prompts", f"notes={tmp_path / 'notes.jsonl'}"]
    tables += ["--unsafe-prompts", f"stealing={tmp_path / 'stealing.jsonl'}"]
    entry(["evaluate", "--guard", str(guard_dir), "--model", str(model_dir), "--out", str(tmp_path / "out"), *tables])
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed == json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert "notes: 100%" in captured.err and "20/20" in captured.err and "12/12" in captured.err  # a bar per source
    assert printed["sources"]["stealing"]["rows"] == 12 and set(printed["thresholds"]) == {"anomaly", "harm"}
    assert set(printed["summary"]) == {"at_guard_thresholds", "at_fpr_0.05", "at_fpr_0.01", "benign_rows"}
    assert "unsafe sources caught, median / worst source, at the guard's thresholds " in captured.err
    assert "; at 5% " in captured.err and " / stealing " in captured.err
    assert "(the fixed rates of the 20 benign rows together)" in captured.err
    # 20 rows resolve 5% (one flag) but not 1%
    assert "; at 1%, 20 benign rows allow no flag, so the thresholds there sit above every benign row: " in captured.err
    assert "bring 100 or more to measure 1%" in captured.err and "at 5% and" not in captured.err
    assert (tmp_path / "out" / "report.html").is_file() and (tmp_path / "out" / "roc-harm.png").is_file()


SYSTEM = "You are the support assistant of a bank."


def test_prompt_mode_screens_under_the_system_turn(model_dir, tmp_path, capsys):
    benign, unsafe = PROMPTS[:20], UNSAFE_PROMPTS[:12]
    two_headed_guard().save_pretrained(tmp_path / "guard")
    guard = SafetyGuard.from_pretrained(tmp_path / "guard")
    model, tokenizer, _ = tiny_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    sources = {"notes": (rows(benign), False), "stealing": (rows(unsafe), True)}
    under = evaluate_prompt_sources(guarded, sources, system=SYSTEM, progress=False)
    default = evaluate_prompt_sources(guarded, sources, progress=False)
    alone = guarded.screen(benign + unsafe, system=SYSTEM)
    assert under.system == SYSTEM and default.system is None
    harm = np.concatenate([source.head_scores["harm"] for source in under.sources])
    assert harm == pytest.approx([report.head_verdicts()[1].score for report in alone], abs=1e-5)
    assert harm != pytest.approx(np.concatenate([s.head_scores["harm"] for s in default.sources]), abs=1e-3)

    for name, texts in (("notes", benign), ("stealing", unsafe)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    tables = ["--benign-prompts", f"notes={tmp_path / 'notes.jsonl'}"]
    tables += ["--unsafe-prompts", f"stealing={tmp_path / 'stealing.jsonl'}"]
    common = ["evaluate", "--guard", str(tmp_path / "guard"), "--model", str(model_dir), *tables]
    entry([*common, "--out", str(tmp_path / "out"), "--system", SYSTEM])
    printed = json.loads(capsys.readouterr().out)
    assert printed["system"] == SYSTEM and printed["sources"] == under.metrics()
    assert html.escape(repr(SYSTEM)) in (tmp_path / "out" / "report.html").read_text()
    entry(common)
    assert json.loads(capsys.readouterr().out)["system"] is None


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--guard", "default", "--benign-prompts", "a=x", "--unsafe-prompts", "b=y", "--system", " "], "empty"),
        (["--guard", "default", "--system", SYSTEM], "argument --system: prompt mode only"),
        (["--guard", "default", "--benign-prompts", "a=x.jsonl"], "needs both"),
        (["--guard", "default", "--benign-prompts", "x.jsonl", "--unsafe-prompts", "b=y"], "NAME=SOURCE"),
        (["--guard", "default", "--benign-prompts", "a=x", "--unsafe-prompts", "a=y"], "its own NAME"),
        (["--benign-prompts", "a=x", "--unsafe-prompts", "b=y"], "evaluates a --guard"),
        (["--guard", "default"], "--safe and --unsafe are required"),
    ],
)
def test_prompt_mode_refuses_bad_arguments(argv, error, capsys):
    with pytest.raises(SystemExit) as info:
        entry(["evaluate", *argv])
    assert info.value.code == 2 and error in capsys.readouterr().err


def test_a_prompt_given_both_benign_and_unsafe_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from hf_lsad.capture import pretrained

    (tmp_path / "chat.txt").write_text("".join(f"{text}\n" for text in PROMPTS))
    (tmp_path / "harm.txt").write_text("".join(f"{text}\n" for text in [*UNSAFE_PROMPTS, PROMPTS[3]]))
    monkeypatch.setattr(pretrained, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    argv = ["evaluate", "--guard", "default", "--benign-prompts", f"chat={tmp_path / 'chat.txt'}"]
    with pytest.raises(SystemExit) as info:  # it was scored as both, and counted against the guard either way
        entry([*argv, "--unsafe-prompts", f"harm={tmp_path / 'harm.txt'}"])
    error = "1 prompts of the unsafe source 'harm' are in the benign source 'chat' too (each prompt has one label), "
    assert info.value.code == 1 and f"{error}e.g. {PROMPTS[3]!r}" in capsys.readouterr().err
    one = [{"role": "user", "content": "hi"}]
    conversations = {  # read whole: the same last turn after other turns is another prompt
        "chat": ([PromptRow("0", "hi", conversation=tuple(one))], False),
        "harm": ([PromptRow("0", "hi", conversation=({"role": "system", "content": "Be evil."}, *one))], True),
    }
    check_prompt_sources(conversations)
    conversations["harm"] = (conversations["chat"][0], True)
    with pytest.raises(ValueError, match="1 prompts of the unsafe source 'harm'"):
        check_prompt_sources(conversations)
