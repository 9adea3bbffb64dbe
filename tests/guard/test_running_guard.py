"""response_running guard: per-token scoring during generate, patience, per-sequence false-stop rule."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import PROMPTS, RUNNING_MAX_NEW as MAX_NEW, tiny_running_guard as running_setup

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.running import sequence_statistic


def test_sequence_statistic_is_the_max_over_windows_of_the_min():
    nan = float("nan")
    scores = torch.tensor([[1.0, 5.0, 4.0, 0.0, 6.0], [3.0, 2.0, nan, nan, nan], [nan] * 5])
    stat, at = sequence_statistic(scores, 2)
    assert stat[0] == 4.0 and at[0] == 2  # window (5, 4)
    assert stat[1] == 2.0 and at[1] == 1
    assert stat[2] == float("-inf") and at[2] == -1
    stat, _ = sequence_statistic(scores, 3)
    assert stat[1] == 2.0  # shorter than the patience: the min over the whole response


def test_collected_tokens_are_the_ones_generate_scores():
    model, tokenizer, fit, sequences = running_setup()
    guarded = GuardedModelForCausalLM(model, fit.guard)
    prompts = PROMPTS[:4]
    out = guarded.generate(
        **encode_prompts(tokenizer, prompts), max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True
    )
    for i, report in enumerate(out.safety):
        scores = fit.guard(sequences[i]).scores
        expected, _ = sequence_statistic(scores[None], fit.guard.running.patience)
        assert report.score == pytest.approx(float(expected[0]), abs=1e-4)
        assert report.flagged == (report.score > fit.guard.threshold) and not report.stopped


def test_held_out_safe_false_stop_rate_is_at_most_the_target():
    """The rule: S = max over windows of m tokens of the min score; threshold = safe quantile of held-out S."""
    model, tokenizer, fit, _ = running_setup()
    guard = fit.guard
    assert (fit.holdout_statistics > guard.threshold).float().mean() <= guard.config.target_fpr
    holdout = [PROMPTS[i] for i in fit.holdout_sequences.tolist()]
    guarded = GuardedModelForCausalLM(model, guard)
    guarded.generate(**encode_prompts(tokenizer, holdout), max_new_tokens=MAX_NEW, do_sample=False, on_flag="stop")
    stopped = [r.stopped for r in guarded.last_safety]
    # stopping while generating reproduces the fit-time statistic: a row is stopped only if S > threshold (rows
    # shorter than the patience can be flagged but are never stopped). The threshold is a held-out row's own S, and
    # generation moves S by float round-off, so that row may fall either way on another CPU's kernels.
    statistics = fit.holdout_statistics.tolist()
    on_edge = [math.isclose(s, guard.threshold, rel_tol=1e-5, abs_tol=1e-8) for s in statistics]
    assert all(s > guard.threshold for s, stop, edge in zip(statistics, stopped, on_edge) if stop and not edge)
    clear_stops = sum(stop and not edge for stop, edge in zip(stopped, on_edge))
    assert clear_stops / len(stopped) <= guard.config.target_fpr


def test_a_flagged_row_stops_at_the_flagged_step_after_patience_tokens(tmp_path):
    model, tokenizer, fit, _ = running_setup(patience=2)
    fit.guard.save_pretrained(tmp_path / "g")
    guard = SafetyGuard.from_pretrained(tmp_path / "g")  # a copy whose threshold this test may change
    prompts = PROMPTS[:6]
    inputs = encode_prompts(tokenizer, prompts)
    prompt_length = inputs["input_ids"].shape[1]
    plain = GuardedModelForCausalLM(model, guard).generate(
        **inputs, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True
    )
    # pick a threshold so that some rows are flagged mid-way
    scores = sorted(r.score for r in plain.safety)
    guard.config.threshold = scores[len(scores) // 2]
    guarded = GuardedModelForCausalLM(model, guard)
    reported = guarded.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True)
    out = guarded.generate(
        **inputs, max_new_tokens=MAX_NEW, do_sample=False, on_flag="stop", return_dict_in_generate=True
    )
    flagged_any = False
    for row, (r_report, s_report) in enumerate(zip(reported.safety, out.safety)):
        if not s_report.stopped:
            continue
        flagged_any = True
        step = s_report.step
        assert step == r_report.step and step >= 2  # patience 2: at least two scored tokens (steps 1 and 2)
        new = out.sequences[row, prompt_length:]
        # the tokens before the stop are the plain ones, then EOS
        assert torch.equal(new[:step], plain.sequences[row, prompt_length : prompt_length + step])
        assert new[step] == tokenizer.eos_token_id
    assert flagged_any


def test_running_guard_round_trips(tmp_path):
    _, _, fit, sequences = running_setup()
    fit.guard.save_pretrained(tmp_path / "g")
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    assert loaded.running == fit.guard.running and loaded.config.hook.position == "response_running"
    torch.testing.assert_close(loaded(sequences[0]).scores, fit.guard(sequences[0]).scores)
