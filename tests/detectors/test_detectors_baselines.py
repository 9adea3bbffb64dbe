"""Baselines: each on synthetic data with a known answer, plus save/load and guard round trips for every method."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.mixture import GaussianMixture
from sklearn.svm import OneClassSVM
from torch import nn

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.serialization import GuardFormatError, load_module, save_module
from hf_lsad.detectors import (
    CVDD,
    DETECTORS,
    CVDDConfig,
    DeepSVDD,
    DeepSVDDConfig,
    FreqMaskConfig,
    GaussianMixtureDetector,
    GMMConfig,
    KNNConfig,
    KNNDistance,
    LearnedMaskConfig,
    LinearProbe,
    LinearProbeConfig,
    Mahalanobis,
    MahalanobisConfig,
    OCSVMConfig,
    OCSVMState,
    OneClassSVMDetector,
    detector_class,
)
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder


class IdentityEncoder(nn.Module):
    """An 'SAE' whose codes are the non-negative inputs (d_sae = d_in)."""

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        return activations.clamp_min(0)


def gaussian(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def blobs(n: int, seed: int, d: int = 8) -> torch.Tensor:
    """Two Gaussian blobs at +-3 on the first axis, unit variance."""
    x = gaussian(n, d, seed)
    x[: n // 2, 0] += 3.0
    x[n // 2 :, 0] -= 3.0
    return x


def far_outliers(n: int, seed: int, d: int = 8, radius: float = 12.0) -> torch.Tensor:
    directions = gaussian(n, d, seed)
    return radius * directions / directions.norm(dim=1, keepdim=True)


# --- synthetic cases with a known answer ---------------------------------------------------------


def test_mahalanobis_ranks_a_five_sigma_point_on_the_minor_axis_above_all_inliers():
    # Strongly anisotropic, correlated 2-D Gaussian: major-axis sd 10, minor-axis sd 0.5.
    rotation = torch.tensor([[0.6, -0.8], [0.8, 0.6]])
    sd = torch.tensor([10.0, 0.5])
    safe = (gaussian(2000, 2, 0) * sd) @ rotation.T + torch.tensor([3.0, -1.0])
    detector = Mahalanobis(MahalanobisConfig(ridge=1e-5), 2)
    detector.fit(safe, None, progress=False)

    mean = safe.double().mean(0)
    centred = safe.double() - mean
    covariance = centred.T @ centred / len(safe)
    minor_sd = torch.linalg.eigvalsh(covariance)[0].sqrt()
    minor_axis = torch.linalg.eigh(covariance).eigenvectors[:, 0]
    outlier = (mean + 5 * minor_sd * minor_axis).float()[None]

    inlier_scores = detector(safe, None).scores
    outlier_score = detector(outlier, None).scores
    assert outlier_score.item() == pytest.approx(5.0, rel=1e-4)  # 5 sigma, up to the 1e-5 ridge
    assert outlier_score.item() > inlier_scores.max().item()
    # Euclidean distance to the mean would not flag it: most inliers lie further out.
    assert (centred.norm(dim=1) > 5 * minor_sd).float().mean() > 0.5
    # The score is sqrt(d^T (S + lambda I)^-1 d), checked on a few rows with numpy.
    precision = np.linalg.inv(covariance.numpy() + 1e-5 * np.eye(2))
    d = (safe[:5].double() - mean).numpy()
    expected = np.sqrt(np.einsum("bi,ij,bj->b", d, precision, d))
    np.testing.assert_allclose(inlier_scores[:5].numpy(), expected, rtol=1e-5)


def test_gmm_gives_a_point_between_separated_components_the_lowest_likelihood():
    safe = gaussian(600, 2, 1)
    safe[:300, 0] += 10.0
    safe[300:, 0] -= 10.0
    config = GMMConfig(n_components=2, seed=0)
    detector = GaussianMixtureDetector(config, 2)
    detector.fit(safe, None, progress=False)
    output = detector(safe, None)
    between = detector(torch.tensor([[0.0, 0.0]]), None).scores
    assert between.item() > output.scores.max().item()
    # Components are the blobs: each blob's rows share a cluster, the two clusters differ.
    assert len(output.clusters[:300].unique()) == 1 and len(output.clusters[300:].unique()) == 1
    assert output.clusters[0] != output.clusters[-1]
    # The torch NLL equals scikit-learn's on the standardized data, fitted the same way.
    x = safe.double().numpy()
    z = (x - x.mean(0)) / x.std(0)
    reference = GaussianMixture(2, covariance_type="diag", init_params="k-means++", random_state=0).fit(z)
    np.testing.assert_allclose(output.scores.double().numpy(), -reference.score_samples(z), rtol=1e-5)


@pytest.mark.parametrize("kernel", ["rbf", "linear"])
def test_ocsvm_matches_sklearn_decision_function(kernel):
    safe, test = blobs(300, 2, d=4), blobs(50, 3, d=4)
    config = OCSVMConfig(kernel=kernel, nu=0.1, gamma=0.1)
    detector = OneClassSVMDetector(config, 4)
    detector.fit(safe, None, progress=False)
    assert detector.config is config and config == OCSVMConfig(kernel=kernel, nu=0.1, gamma=0.1), "fit keeps its config"
    assert detector.state.n_support == len(detector.support_vectors) >= 0.1 * 300 - 1
    mean, sd = safe.double().numpy().mean(0), safe.double().numpy().std(0)
    reference = OneClassSVM(kernel=kernel, nu=0.1, gamma=0.1).fit((safe.double().numpy() - mean) / sd)
    expected = -reference.decision_function((test.double().numpy() - mean) / sd)
    np.testing.assert_allclose(detector(test, None).scores.double().numpy(), expected, rtol=1e-4, atol=1e-5)


def test_ocsvm_ranks_far_outliers_above_all_inliers_and_caps_its_sample():
    safe = blobs(400, 4)
    detector = OneClassSVMDetector(OCSVMConfig(nu=0.1, gamma=0.05, max_samples=200, seed=1), 8)
    detector.fit(safe, None, progress=False)
    assert detector.state.n_support <= 200
    assert detector(far_outliers(50, 5), None).scores.min() > detector(blobs(200, 6), None).scores.max()


SMALL_NET = dict(hidden_dims=(32,), rep_dim=8, epochs=8, pretrain_epochs=3, batch_size=64)
DEEP_CASES = {
    "deep-svdd one-class": (DeepSVDD, DeepSVDDConfig(**SMALL_NET)),
    "deep-svdd soft-boundary": (DeepSVDD, DeepSVDDConfig(**SMALL_NET, objective="soft-boundary", warm_up_epochs=2)),
    "cvdd": (CVDD, CVDDConfig(**SMALL_NET, n_contexts=4)),
}


@pytest.mark.parametrize("case", DEEP_CASES, ids=str)
def test_deep_one_class_methods_rank_far_outliers_above_inliers(case):
    cls, config = DEEP_CASES[case]
    detector = cls(config, 8)
    detector.fit(blobs(512, 7), None, progress=False)
    # Radius 30 is about 7x the inliers' typical norm (sqrt(8 + 9)).
    inliers, outliers = detector(blobs(200, 8), None), detector(far_outliers(50, 9, radius=30.0), None)
    assert outliers.scores.min() > inliers.scores.max()
    if cls is CVDD:  # clusters are the nearest contexts
        assert inliers.clusters.min() >= 0 and inliers.clusters.max() < config.n_contexts
    else:
        assert (inliers.clusters == -1).all()


def test_cvdd_temperature_is_annealed_geometrically():
    detector = CVDD(CVDDConfig(epochs=3, temperature_start=1.0, temperature_end=0.01), 4)
    assert [detector.temperature(e) for e in range(3)] == pytest.approx([1.0, 0.1, 0.01])


def test_linear_probe_separates_linearly_separable_classes_and_is_marked_supervised():
    d = 6
    direction = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.0, 0.0])
    points = gaussian(400, d, 10).abs()
    margin = points @ direction
    safe, unsafe = points[margin < -0.2], points[margin > 0.2]
    probe = LinearProbe(LinearProbeConfig(lr=0.05, epochs=30, batch_size=32), d, d)
    assert probe.supervised and probe.uses_sae
    with pytest.raises(TypeError, match="fit_supervised"):
        probe.fit(safe, IdentityEncoder())
    probe.fit_supervised(safe, unsafe, IdentityEncoder(), progress=False)
    safe_logits, unsafe_logits = probe(safe, IdentityEncoder()).scores, probe(unsafe, IdentityEncoder()).scores
    assert unsafe_logits.min() > safe_logits.max()
    assert (safe_logits < 0).all() and (unsafe_logits > 0).all()


def test_knn_score_is_the_mean_cosine_distance_to_the_k_nearest_centred_fit_rows():
    safe, inliers = blobs(60, 3), blobs(10, 4)
    safe[:, -1], inliers[:, -1] = 0.0, 0.0  # the safe rows span no variance along the last axis
    outliers = safe.mean(0) + 5.0 * torch.eye(D)[-1].repeat(3, 1) * torch.tensor([[1.0], [2.0], [-1.0]])
    x = torch.cat([inliers, outliers])
    detector = KNNDistance(KNNConfig(k=4), D)
    detector.fit(safe, progress=False)
    mean = safe.mean(0)

    def unit(v: torch.Tensor) -> torch.Tensor:
        return (v - mean) / (v - mean).norm(dim=1, keepdim=True)

    want = 1 - (unit(x) @ unit(safe).T).topk(4, dim=1).values.mean(1)
    got = detector(x).scores
    assert torch.allclose(got, want, atol=1e-6)
    assert got[-3:].min() > got[:10].max()  # off the safe rows' span: above every inlier (cosine ignores the norm)
    assert (detector(x).clusters == -1).all()
    # batch-invariant: each row alone scores as in the batch
    assert torch.allclose(torch.cat([detector(x[i : i + 1]).scores for i in range(len(x))]), got, atol=1e-6)


def test_knn_max_rows_keeps_a_seeded_subsample_and_k_is_checked():
    safe = blobs(50, 6)
    small = KNNDistance(KNNConfig(k=2, max_rows=20, seed=1), D)
    small.fit(safe, progress=False)
    again = KNNDistance(KNNConfig(k=2, max_rows=20, seed=1), D)
    again.fit(safe, progress=False)
    assert small.state.n_bank == 20 and small.bank.shape == (20, D) and torch.equal(small.bank, again.bank)
    with pytest.raises(ValueError, match="at least 5 safe rows"):
        KNNDistance(KNNConfig(k=5), D).fit(safe[:4], progress=False)
    with pytest.raises(ValueError, match="max_rows"):
        KNNConfig(k=5, max_rows=3)
    with pytest.raises(ValueError, match="k must be"):
        KNNConfig(k=0)


def test_only_the_probe_is_supervised():
    assert {name for name, cls in DETECTORS.items() if cls.supervised} == {"linear-probe"}
    assert {name for name, cls in DETECTORS.items() if not cls.uses_sae} >= {
        "mahalanobis",
        "gmm",
        "ocsvm",
        "deep-svdd",
        "cvdd",
        "knn",
    }


# --- every registered method: determinism, save/load, guard round trip ----------------------------

D = 8
CASES = {
    "mahalanobis": MahalanobisConfig(),
    "gmm": GMMConfig(n_components=3),
    "ocsvm": OCSVMConfig(gamma=0.1),
    "deep-svdd": DeepSVDDConfig(**{**SMALL_NET, "epochs": 2, "pretrain_epochs": 1}),
    "cvdd": CVDDConfig(**{**SMALL_NET, "epochs": 2, "pretrain_epochs": 1}, n_contexts=3),
    "linear-probe": LinearProbeConfig(epochs=2),
    "knn": KNNConfig(k=3),
    "freqmask-km": FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=4),
    "learned-mask-lora": LearnedMaskConfig(
        kmeans=KMeansConfig(n_clusters=2),
        lambdas=[1e-3, 1e-2],
        min_cluster_size=20,
        lora_min_cluster_size=40,
        lora_epochs=2,
    ),
}


def real_sae() -> SparseAutoencoder:
    """A seeded random SAE, for methods that adapt or decode through the SAE's layers."""
    torch.manual_seed(21)
    return SparseAutoencoder(SAEConfig(d_in=D, d_sae=2 * D))


SAES = {"learned-mask-lora": real_sae}
"""Methods whose case needs a real SAE; the others read :class:`IdentityEncoder` codes."""


def fitted(method: str) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    assert method in CASES, f"no synthetic case for registered method {method!r}: add one to CASES"
    cls = detector_class(method)
    sae = SAES.get(method, IdentityEncoder)() if cls.uses_sae else None
    d_sae = sae.config.d_sae if isinstance(sae, SparseAutoencoder) else D
    detector = cls(CASES[method], D, d_sae if cls.uses_sae else None)
    safe = blobs(120, 11)
    if cls.supervised:
        detector.fit_supervised(safe, far_outliers(40, 12), sae, progress=False)
    else:
        detector.fit(safe, sae, progress=False)
    return detector, sae


@pytest.mark.parametrize("method", sorted(m for m, cls in DETECTORS.items() if cls.__module__.startswith("hf_lsad.")))
def test_fit_is_deterministic_and_save_load_gives_identical_scores(method, tmp_path):
    detector, sae = fitted(method)
    again, _ = fitted(method)
    state, other = detector.state_dict(), again.state_dict()
    assert state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)

    save_module(detector, tmp_path / "d.safetensors")
    # Rebuild as a loader would: from the JSON form of the fitted detector's config and state.
    cls = type(detector)
    reloaded = cls.from_settings(json.loads(json.dumps(detector.settings_dict())), D, detector.d_sae, source="test")
    assert reloaded.config == detector.config and reloaded.state == detector.state
    load_module(reloaded, tmp_path / "d.safetensors")
    x = torch.cat([blobs(30, 13), far_outliers(5, 14)])
    assert torch.equal(reloaded(x, sae).scores, detector(x, sae).scores)
    assert torch.equal(reloaded(x, sae).clusters, detector(x, sae).clusters)


def hook(hidden_size: int) -> HookPoint:
    return HookPoint(
        base_model="synthetic",
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=4,
        layer=2,
        layer_module="model.layers.2",
        position="response_last",
    )


RAW_METHODS = [m for m in sorted(CASES) if not detector_class(m).uses_sae and not detector_class(m).supervised]


@pytest.mark.parametrize("method", RAW_METHODS)
def test_guard_without_sae_round_trips(method, tmp_path):
    result = fit_guard(blobs(150, 15), hook(D), method, CASES[method], None, progress=False)
    guard = result.guard
    assert guard.sae is None
    guard.save_pretrained(tmp_path / "guard")
    assert not (tmp_path / "guard" / "sae").exists()
    reloaded = SafetyGuard.from_pretrained(tmp_path / "guard")
    x = torch.cat([blobs(20, 16), far_outliers(5, 17)])
    assert torch.equal(reloaded(x).scores, guard(x).scores)
    assert torch.equal(reloaded(x).flagged, guard(x).flagged)
    assert reloaded.config == guard.config and reloaded.detector.config == guard.detector.config
    if method not in DIRECTION_ONLY:
        assert guard(far_outliers(5, 18)).flagged.all()


DIRECTION_ONLY = {"knn"}
"""Methods that score a row's direction, not its norm (cosine): a far outlier along a safe direction is not
unusual to them (their own tests check detection off the safe rows' span)."""


def test_ocsvm_strict_loading_checks_the_support_vector_count(tmp_path):
    detector = OneClassSVMDetector(OCSVMConfig(gamma=0.1), D)
    detector.fit(blobs(100, 19), None, progress=False)
    save_module(detector, tmp_path / "d.safetensors")
    wrong = OneClassSVMDetector(OCSVMConfig(gamma=0.1), D, state=OCSVMState(n_support=detector.state.n_support + 1))
    with pytest.raises(GuardFormatError, match=r"'(dual_coef|support_vectors)' has shape"):
        load_module(wrong, tmp_path / "d.safetensors")
    with pytest.raises(RuntimeError, match="not fitted"):
        OneClassSVMDetector(OCSVMConfig(), D)(blobs(3, 20), None)


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MahalanobisConfig(ridge=0.0), "ridge"),
        (lambda: GMMConfig(init_params="kmeans+++"), "init_params"),
        (lambda: GMMConfig(n_components=0), "n_components"),
        (lambda: OCSVMConfig(kernel="poly"), "kernel"),
        (lambda: OCSVMConfig(nu=0.0), "nu"),
        (lambda: OCSVMConfig(gamma="scale"), "gamma"),
        (lambda: DeepSVDDConfig(objective="hard"), "objective"),
        (lambda: DeepSVDDConfig(hidden_dims=(0,)), "hidden_dims"),
        (lambda: CVDDConfig(temperature_start=0.1, temperature_end=1.0), "temperature"),
        (lambda: CVDDConfig(n_contexts=0), "n_contexts"),
        (lambda: LinearProbeConfig(lr=0.0), "lr"),
    ],
)
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("method", RAW_METHODS)
def test_bad_activations_are_refused(method):
    detector = detector_class(method)(CASES[method], D, None)
    with pytest.raises(ValueError, match="width 5"):
        detector.fit(torch.randn(50, 5), None, progress=False)
    bad = torch.randn(50, D)
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        detector.fit(bad, None, progress=False)
    with pytest.raises(ValueError, match="at least"):
        detector.fit(torch.randn(1, D), None, progress=False)
