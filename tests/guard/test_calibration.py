"""Per-cluster affine calibration: weights, anchor, inverted clusters, unlabelled clusters, guard round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tiny import MIXED_BATCH, fresh_guard, reports_of, tiny_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.cli.main import main
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.metrics import auroc
from hf_lsad.core.serialization import GuardFormatError
from hf_lsad.data.store import save_activations
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.calibration import (
    AffineCalibration,
    _newton,
    coupled_budget_sample,
    fit_affine_calibration,
    importance_weights,
)
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder

# Per cluster: (safe mean, unsafe mean, spread). Cluster 2 is inverted: its unsafe rows sit closer to
# the centroid (lower score) than its safe rows. Cluster 3 appears at test time only.
CLUSTERS = [(1.0, 2.0, 0.3), (5.0, 8.0, 1.0), (3.0, 1.5, 0.3), (2.0, 4.0, 0.5)]


def sample(n_safe: int, n_unsafe: int, clusters: list[int], rng: np.random.Generator):
    scores, cluster_ids, labels = [], [], []
    for c in clusters:
        safe_mean, unsafe_mean, spread = CLUSTERS[c]
        for label, mean, n in ((0, safe_mean, n_safe), (1, unsafe_mean, n_unsafe)):
            scores.append(rng.normal(mean, spread, n))
            cluster_ids.append(np.full(n, c))
            labels.append(np.full(n, label))
    return np.concatenate(scores), np.concatenate(cluster_ids), np.concatenate(labels).astype(float)


def test_importance_weights_are_inverse_sampling_fractions():
    weights = importance_weights(["safe", "unsafe", "benign_ood", "safe"], 0.01)
    assert np.allclose(weights, [2.0, 100.0, 100.0, 2.0])
    with pytest.raises(ValueError, match="unknown groups"):
        importance_weights(["harmful"], 0.01)
    with pytest.raises(ValueError, match="budget"):
        importance_weights(["safe"], 0.0)


def test_coupled_budget_sample_is_disjoint_seeded_and_refuses_empty_groups():
    split = coupled_budget_sample({"safe": 101, "unsafe": 1000, "benign_ood": 300}, 0.01, seed=3)
    assert [len(split[g][0]) for g in ("safe", "unsafe", "benign_ood")] == [50, 10, 3]
    for calibration, evaluation in split.values():
        assert not set(calibration) & set(evaluation)
    again = coupled_budget_sample({"safe": 101, "unsafe": 1000, "benign_ood": 300}, 0.01, seed=3)
    assert all(np.array_equal(split[g][0], again[g][0]) for g in split)
    with pytest.raises(ValueError, match="0 calibration rows of 40 benign_ood"):
        coupled_budget_sample({"safe": 100, "unsafe": 1000, "benign_ood": 40}, 0.01, seed=0)


@pytest.mark.parametrize("penalty, centre", [(1e-3, (0.0, 0.0)), (10.0, (1.0, -2.0)), (1000.0, (-0.5, 0.5))])
def test_newton_solution_is_stationary(penalty, centre):
    rng = np.random.default_rng(0)
    s, _, y = sample(200, 20, [0, 1], rng)
    w = np.where(y == 1, 50.0, 2.0)
    centre = np.array(centre)
    theta = _newton(s, y, w, penalty, centre)
    p = 1 / (1 + np.exp(-(theta[0] * s + theta[1])))
    gradient = np.array([np.sum(w * (p - y) * s), np.sum(w * (p - y))]) + 2 * penalty * (theta - centre)
    assert np.abs(gradient).max() < 1e-6 * np.sum(w)


def test_separable_cluster_with_large_scores_fits_without_overflow_warnings():
    # Unstandardised scores in the hundreds and a steep anchor give logits past +-709, where
    # exp overflows; the sigmoid must stay finite and silent (a user fitting a guard sees no RuntimeWarning).
    s = np.concatenate([np.linspace(0, 400, 40), np.linspace(600, 1000, 10)])
    y = np.concatenate([np.zeros(40), np.ones(10)])
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # underflow to 0 is harmless
        theta = _newton(s, y, np.ones_like(s), 1e-3, np.array([2.0, -1000.0]))
    assert np.all(np.isfinite(theta)) and theta[0] > 0


@pytest.mark.parametrize("standardize", [True, False])
def test_inverted_cluster_gets_a_negative_slope_and_auroc_rises_while_unlabelled_cluster_keeps_the_anchor(standardize):
    rng = np.random.default_rng(0)
    budget = 0.1
    s, c, y = sample(150, 30, [0, 1, 2], rng)  # no labelled point of cluster 3
    groups = np.where(y == 1, "unsafe", "safe")
    calibration = fit_affine_calibration(
        s, c, y, importance_weights(groups, budget), 4, seed=0, standardize=standardize
    )

    assert calibration.slopes[2] < 0 < min(calibration.slopes[0], calibration.slopes[1])
    assert calibration.labelled == [180, 180, 180, 0]
    assert calibration.labelled_unsafe == [30, 30, 30, 0]
    coverage = "4 clusters: 3 with labelled unsafe rows; 1 without any label, on the pooled anchor"
    assert calibration.coverage() == coverage
    assert (calibration.slopes[3], calibration.intercepts[3]) == tuple(calibration.anchor)
    assert calibration.lam in (1.0, 10.0, 100.0)

    test_s, test_c, test_y = sample(1000, 200, [0, 1, 2, 3], rng)
    logits = calibration.logits(torch.from_numpy(test_s), torch.from_numpy(test_c)).numpy()
    raw = auroc(test_s[test_y == 0], test_s[test_y == 1])
    calibrated = auroc(logits[test_y == 0], logits[test_y == 1])
    assert calibrated > 0.95 and calibrated > raw + 0.1
    inverted = test_c == 2
    assert auroc(logits[inverted & (test_y == 0)], logits[inverted & (test_y == 1)]) > 0.99
    # Cluster 3 is scored by the anchor map exactly.
    unlabelled = torch.from_numpy(test_s[test_c == 3])
    expected = calibration.anchor[0] * unlabelled.double() + calibration.anchor[1]
    assert torch.equal(calibration.logits(unlabelled, torch.full((len(unlabelled),), 3)), expected)


BAD_COUNTS = [
    (dict(labelled_unsafe=[1, 0]), "labelled_unsafe has 2 entries for 3 clusters"),
    (dict(labelled_unsafe=[1, 4, 0]), "exceeds labelled"),
    (dict(labelled=[5, -1, 0], labelled_unsafe=[]), "non-negative"),
]


@pytest.mark.parametrize("change, message", BAD_COUNTS)
def test_bad_label_counts_are_clear_errors(change, message):
    settings = dict(
        slopes=[1.0] * 3,
        intercepts=[0.0] * 3,
        anchor=[1.0, 0.0],
        lam=1.0,
        labelled=[5, 3, 0],
        labelled_unsafe=[1, 2, 0],
    )
    with pytest.raises(ValueError, match=message):
        AffineCalibration(**(settings | change))


def test_coverage_of_a_calibration_saved_without_unsafe_counts():
    calibration = AffineCalibration(
        slopes=[1.0] * 3, intercepts=[0.0] * 3, anchor=[1.0, 0.0], lam=1.0, labelled=[5, 3, 0]
    )
    assert calibration.coverage() == "3 clusters, 1 without any label, on the pooled anchor"


def test_rows_without_a_cluster_use_the_anchor():
    calibration = AffineCalibration(slopes=[2.0], intercepts=[1.0], anchor=[0.5, -1.0], lam=10.0)
    logits = calibration.logits(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, -1, 7]))
    assert logits.tolist() == [3.0, -0.5, -0.5]


BAD_SAMPLES = [
    (dict(labels=np.zeros(4)), "both unsafe"),
    (dict(labels=np.array([0, 1, 2, 0])), "labels must be"),
    (dict(weights=np.array([1.0, 0.0, 1.0, 1.0])), "weights"),
    (dict(scores=np.array([0.0, np.nan, 1.0, 2.0])), "finite"),
    (dict(clusters=np.zeros(3)), "differ in length"),
]


@pytest.mark.parametrize("change, message", BAD_SAMPLES)
def test_bad_labelled_samples_are_clear_errors(change, message):
    arguments = dict(scores=np.arange(4.0), clusters=np.zeros(4), labels=np.array([0, 1, 0, 1]), weights=np.ones(4))
    arguments |= change
    with pytest.raises(ValueError, match=message):
        fit_affine_calibration(arguments["scores"], arguments["clusters"], arguments["labels"], arguments["weights"], 1)


def calibrated_tiny_guard() -> SafetyGuard:
    guard = fresh_guard()
    # Cluster 1 inverted, as calibration of an inverted cluster produces.
    calibration = AffineCalibration(
        slopes=[0.8, -0.6, 1.3], intercepts=[-3.0, 2.0, -4.5], anchor=[0.9, -3.2], lam=10.0, labelled=[5, 3, 0]
    )
    guard.set_calibration(calibration)
    return guard


def test_calibrated_guard_reports_probabilities_and_flags_by_them():
    guard = calibrated_tiny_guard()
    model, tokenizer, _ = tiny_guard("response_last")
    guarded = GuardedModelForCausalLM(model, guard)
    guarded.generate(**encode_prompts(tokenizer, MIXED_BATCH), max_new_tokens=4, do_sample=False)
    for report in guarded.last_safety:
        a, b = guard.calibration.slopes[report.cluster], guard.calibration.intercepts[report.cluster]
        assert math.isclose(report.probability, 1 / (1 + math.exp(-(a * report.score + b))), rel_tol=1e-6)
        assert report.flagged == (report.probability > 0.5) and report.threshold == 0.5
        assert report.describe().startswith(
            f"{'FLAGGED' if report.flagged else 'ok'}: P(unsafe) {report.probability:.3f}"
        )


def test_calibration_survives_save_and_load_and_generate(tmp_path):
    guard = calibrated_tiny_guard()
    guard.save_pretrained(tmp_path)
    loaded = SafetyGuard.from_pretrained(tmp_path)
    assert loaded.calibration == guard.calibration
    model, tokenizer, _ = tiny_guard("response_last")
    inputs = encode_prompts(tokenizer, MIXED_BATCH)
    reports = reports_of(model, (guard, loaded), inputs)
    assert reports[0] == reports[1] and all(r.probability is not None for r in reports[0])


def test_uncalibrated_guards_write_no_calibration_and_load_without_one(tmp_path):
    fresh_guard().save_pretrained(tmp_path)
    assert "calibration" not in json.loads((tmp_path / "config.json").read_text())
    assert SafetyGuard.from_pretrained(tmp_path).calibration is None


def test_calibration_is_loaded_strictly(tmp_path):
    calibrated_tiny_guard().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["calibration"]["scale"] = 2.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GuardFormatError, match=r"unknown config key.*scale"):
        SafetyGuard.from_pretrained(tmp_path)
    del raw["calibration"]["scale"]
    raw["calibration"]["slopes"] = [1.0, 1.0]
    raw["calibration"]["intercepts"] = [0.0, 0.0]
    raw["calibration"]["labelled"] = []
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GuardFormatError, match="calibration has 2 clusters"):
        SafetyGuard.from_pretrained(tmp_path)


def test_calibration_must_match_the_detectors_clusters():
    guard = fresh_guard()
    with pytest.raises(ValueError, match="calibration has 2 clusters, the freqmask-km detector 3"):
        guard.set_calibration(AffineCalibration(slopes=[1.0, 1.0], intercepts=[0.0, 0.0], anchor=[1.0, 0.0], lam=1.0))


def test_cli_calibrates_a_guard(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    hook = HookPoint(
        base_model="synthetic",
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=4,
        layer=2,
        layer_module="model.layers.2",
        position="prompt_last",
    )
    stores = {
        "safe": torch.randn(400, 16, generator=g),
        "unsafe": 3 + torch.randn(300, 16, generator=g),
        "ood": 2 * torch.randn(200, 16, generator=g),
    }
    for name, rows in stores.items():
        save_activations(tmp_path / name, rows, [{"id": i} for i in range(len(rows))], hook)
    torch.manual_seed(0)
    SparseAutoencoder(SAEConfig(16, 48)).save_pretrained(tmp_path / "sae")
    main(
        [
            "fit",
            "--activations",
            str(tmp_path / "safe"),
            "--sae",
            str(tmp_path / "sae"),
            "--kmeans.n-clusters",
            "3",
            "--mask-size",
            "8",
            "--out",
            str(tmp_path / "guard"),
        ]
    )
    main(
        [
            "calibrate",
            "--guard",
            str(tmp_path / "guard"),
            "--safe",
            str(tmp_path / "safe"),
            "--unsafe",
            str(tmp_path / "unsafe"),
            "--benign-ood",
            str(tmp_path / "ood"),
            "--budget",
            "0.05",
            "--out",
            str(tmp_path / "calibrated"),
        ]
    )
    calibration = SafetyGuard.from_pretrained(tmp_path / "calibrated").calibration
    assert calibration is not None and calibration.n_clusters == 3
    assert sum(calibration.labelled) == 40 + 15 + 10  # half of 80 held-out safe, 5% of 300 unsafe and of 200 OOD
    assert sum(calibration.labelled_unsafe) == 15
    assert f"{calibration.coverage()}; wrote" in capsys.readouterr().out

    # evaluate reports the flag rate the calibrated guard applies (by probability, not by score threshold)
    calibrated = SafetyGuard.from_pretrained(tmp_path / "calibrated")
    capsys.readouterr()
    main(
        [
            "evaluate",
            "--guard",
            str(tmp_path / "calibrated"),
            "--safe",
            str(tmp_path / "safe"),
            "--unsafe",
            str(tmp_path / "unsafe"),
            "--benign-ood",
            str(tmp_path / "ood"),
        ]
    )
    rows = json.loads(capsys.readouterr().out)
    for name, store in (("unsafe", "unsafe"), ("benign_ood", "ood")):
        assert rows[name]["flagged"] == pytest.approx(calibrated(stores[store]).flagged.double().mean().item())
