"""SafetyGuard and SAE files: exact round trips and a clear error for each kind of bad input."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny import MIXED_BATCH, fresh_guard, tiny_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.core.serialization import GuardFormatError
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard, SafetyReport
from hf_lsad.sae.model import SparseAutoencoder
from hf_lsad.sae.training import SAETrainConfig, sae_stats, train_sae
from hf_lsad.testing import tiny_model


@pytest.fixture
def saved_guard(tmp_path):
    guard = fresh_guard()
    guard.save_pretrained(tmp_path / "guard")
    return guard, tmp_path / "guard"


def test_round_trip_gives_identical_scores(saved_guard):
    guard, path = saved_guard
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == [
        "config.json",
        "detector.safetensors",
        "sae/config.json",
        "sae/sae.safetensors",
        "threshold.safetensors",
    ]
    reloaded = SafetyGuard.from_pretrained(path)
    activations = torch.randn(7, guard.config.hook.hidden_size)
    assert torch.equal(reloaded(activations).scores, guard(activations).scores)
    assert reloaded.config == guard.config


def test_guarded_model_loads_a_guard_folder(saved_guard, tmp_path):
    _, path = saved_guard
    model, tokenizer, _ = tiny_guard()
    # saved under the name the guard records as its base model ("tiny-llama"), so the base-model check passes
    model.save_pretrained(tmp_path / "tiny-llama")
    guarded = GuardedModelForCausalLM.from_pretrained(tmp_path / "tiny-llama", guard=path)
    guarded.generate(**encode_prompts(tokenizer, MIXED_BATCH), max_new_tokens=3, do_sample=False)
    assert len(guarded.last_safety) == 3


def test_guard_for_another_hidden_size_is_refused(saved_guard):
    _, path = saved_guard
    other, _ = tiny_model("llama")
    other.config.hidden_size = 48
    with pytest.raises(ValueError, match=r"hidden size 32.*has hidden size 48"):
        GuardedModelForCausalLM(other, SafetyGuard.from_pretrained(path))


def test_guard_for_a_deeper_model_is_refused(saved_guard):
    guard, _ = saved_guard
    guard.config.hook.num_hidden_layers = 12
    model, _ = tiny_model("llama")
    with pytest.raises(ValueError, match=r"12 decoder layers.*has 4"):
        GuardedModelForCausalLM(model, guard)


def test_truncated_safetensors_is_refused(saved_guard):
    _, path = saved_guard
    data = (path / "detector.safetensors").read_bytes()
    (path / "detector.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(GuardFormatError, match=r"detector\.safetensors is not a readable safetensors file"):
        SafetyGuard.from_pretrained(path)


def test_missing_config_key_is_refused(saved_guard):
    _, path = saved_guard
    config = json.loads((path / "config.json").read_text())
    del config["guard"]["threshold"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(GuardFormatError, match=r"missing config key\(s\) \['threshold'\]"):
        SafetyGuard.from_pretrained(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(format_version=99), "format_version 99"),
        (lambda c: c["guard"].update(method="nope"), "unknown detector method 'nope'"),
        (lambda c: c["detector"].update(mask_size=8), "mask_indices.*shape"),
        (lambda c: c["guard"].update(surprise=1), "unknown config key"),
    ],
)
def test_inconsistent_configs_are_refused(saved_guard, edit, message):
    _, path = saved_guard
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        SafetyGuard.from_pretrained(path)


def test_missing_files_are_refused(saved_guard):
    _, path = saved_guard
    (path / "sae" / "sae.safetensors").unlink()
    with pytest.raises(GuardFormatError, match=r"missing file .*sae\.safetensors"):
        SafetyGuard.from_pretrained(path)
    with pytest.raises(FileNotFoundError):
        SafetyGuard.from_pretrained(path / "nowhere")


def test_nan_and_misshaped_activations_are_refused():
    guard = fresh_guard()
    bad = torch.randn(3, 32)
    bad[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or inf \(rows \[1\]"):
        guard(bad)
    with pytest.raises(ValueError, match="width 16, expected hidden size 32"):
        guard(torch.randn(3, 16))
    with pytest.raises(ValueError, match="empty"):
        guard(torch.randn(0, 32))


def test_sae_learns_a_sparse_code_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(0)
    dictionary = torch.randn(40, 16, generator=g)
    codes = torch.rand(2000, 40, generator=g) * (torch.rand(2000, 40, generator=g) < 0.1)
    activations = codes @ dictionary
    sae = train_sae(activations, 80, SAETrainConfig(epochs=100, l1_coefficient=3e-4), progress=False)
    stats = sae_stats(sae, activations)
    assert stats.fraction_variance_explained > 0.9
    assert stats.l0 < 40
    sae.save_pretrained(tmp_path / "sae")
    reloaded = SparseAutoencoder.from_pretrained(tmp_path / "sae")
    assert torch.equal(reloaded.encode(activations), sae.encode(activations))
    with pytest.raises(ValueError, match="NaN"):
        train_sae(torch.full((4, 16), float("nan")), 8, progress=False)


def test_p_values_survive_save_and_load_and_match_the_held_out_scores(tmp_path):
    guard = fresh_guard()
    assert guard.holdout_scores is not None and len(guard.holdout_scores) == guard.config.n_holdout
    guard.save_pretrained(tmp_path / "g")
    loaded = SafetyGuard.from_pretrained(tmp_path / "g")
    activations = torch.randn(32, guard.config.hook.hidden_size, generator=torch.Generator().manual_seed(3))
    reports = loaded.reports(activations)
    held_out = guard.holdout_scores
    for report in reports:
        expected = (1 + int((held_out >= torch.tensor(report.score, dtype=torch.float32)).sum())) / (len(held_out) + 1)
        assert report.p_value == pytest.approx(expected, abs=1e-12)
    assert [r.p_value for r in reports] == [r.p_value for r in guard.reports(activations)]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t[:-1], "expected float32"),
        (lambda t: t.flip(0), "sorted ascending"),
        (lambda t: t.double(), "expected float32"),
    ],
)
def test_bad_held_out_scores_are_refused(tmp_path, edit, message):
    from safetensors.torch import load_file, save_file

    fresh_guard().save_pretrained(tmp_path / "g")
    file = tmp_path / "g" / "threshold.safetensors"
    save_file({"holdout_scores": edit(load_file(str(file))["holdout_scores"]).contiguous()}, str(file))
    with pytest.raises(GuardFormatError, match=message):
        SafetyGuard.from_pretrained(tmp_path / "g")


def test_a_guard_without_held_out_scores_reports_no_p_value(tmp_path):
    guard = fresh_guard()
    guard.set_holdout_scores(None)
    guard.save_pretrained(tmp_path / "g")
    assert not (tmp_path / "g" / "threshold.safetensors").exists()
    reports = SafetyGuard.from_pretrained(tmp_path / "g").reports(torch.randn(2, guard.config.hook.hidden_size))
    assert all(r.p_value is None for r in reports)


@pytest.mark.parametrize(
    "report, line",
    [
        (SafetyReport(301.2, 230.5, True, 3, None, 0.002), "FLAGGED: score 301.2 > 230.5 (cluster 3, p-value 0.002)"),
        (SafetyReport(12.0, 230.5, False, 1, None), "ok: score 12 <= 230.5 (cluster 1)"),
        (
            SafetyReport(49.62, 0.7013, False, 17, 0.127, 0.375),
            "ok: P(unsafe) 0.127 <= 0.7013 (score 49.62, cluster 17, p-value 0.375)",
        ),
        (
            SafetyReport(9.5, 0.7013, True, 2, 0.91, 0.5),
            "FLAGGED: P(unsafe) 0.910 > 0.7013 (score 9.5, cluster 2, p-value 0.5)",
        ),
        (
            SafetyReport(float("nan"), 230.5, True, -1, None, error="NaN in the activation"),
            "FLAGGED: not scored (NaN in the activation)",
        ),
    ],
)
def test_report_describe_compares_what_decided_the_verdict_with_its_threshold(report, line):
    # A calibrated guard flags by probability: its line must not set the score against the probability threshold.
    assert report.describe() == line


def test_describe_agrees_with_the_reports_of_an_uncalibrated_guard():  # calibrated: test_calibration.py
    guard = fresh_guard()
    for report in guard.reports(torch.randn(6, guard.config.hook.hidden_size)):
        assert report.describe().startswith("FLAGGED: score" if report.flagged else "ok: score")
        assert f" {report.threshold:.4g} (cluster {report.cluster}" in report.describe()


def test_printing_a_guard_says_what_each_part_reads_and_how_it_flags():
    """``print(guard)`` showed the module tree and nothing else: no base model, layer, threshold or head settings."""
    from tiny import tiny_head, two_headed_guard

    guard = two_headed_guard()
    printed = repr(guard)
    head = guard.heads["harm"]
    assert f"base_model={guard.config.hook.base_model!r}, {guard.describe()}" in printed
    assert f"method={guard.config.method!r}, d_in={guard.config.hook.hidden_size}, d_sae=" in printed
    assert f"name='harm', fitted on {head.config.n_unsafe} unsafe and {head.config.n_safe} safe rows" in printed
    assert f"{head.config.probe.describe()}, width={head.probe.width}" in printed
    assert f"activation={guard.sae.config.activation!r}" in printed
    unset = fresh_guard("prompt_last")
    unset.add_head(copy.deepcopy(tiny_head("logistic")))
    assert unset.describe().endswith("No thresholds yet: set them with fit_budget")
