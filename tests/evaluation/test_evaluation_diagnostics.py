"""Diagnostics against known answers on synthetic data: d90, occupancy / TV, support overlap, score summaries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_lsad.detectors import FreqMaskConfig, FreqMaskKM
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.evaluation import diagnostics
from hf_lsad.evaluation.diagnostics import (
    active_support_overlap,
    cluster_occupancy,
    cluster_score_summary,
    clusters_holding,
    effective_dimension,
    effective_dimensions,
    freqmask_diagnostics,
    save_plots,
    total_variation,
)


def axis_points(variances: list[float]) -> torch.Tensor:
    """Rows +-a_i e_i: zero mean, covariance diag(a_i^2 / d), eigenvalues proportional to ``variances``."""
    d = len(variances)
    rows = []
    for i, v in enumerate(variances):
        e = torch.zeros(d)
        e[i] = v**0.5
        rows += [e, -e]
    return torch.stack(rows)


@pytest.mark.parametrize(
    "variances, expected",
    [
        ([50.0, 30.0, 15.0, 5.0], 3),  # rho = 0.5, 0.8, 0.95
        ([5.0, 15.0, 50.0, 30.0], 3),  # order of the axes does not matter
        ([81.0, 9.0, 9.0, 1.0], 2),  # rho(2) = 0.90 exactly (square variances: exact in float32) reaches it
        ([1.0] * 10, 9),  # isotropic: 9 of 10 components for 90%
        ([7.0, 0.0, 0.0], 1),
    ],
)
def test_effective_dimension_known_spectra(variances, expected):
    assert effective_dimension(axis_points(variances)) == expected


def test_effective_dimension_is_rotation_invariant_and_centres_the_data():
    x = axis_points([50.0, 30.0, 15.0, 5.0])
    rotation, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
    assert effective_dimension(x @ rotation.T + 100.0) == 3  # rotated and shifted far from the origin
    assert effective_dimension(torch.full((5, 3), 2.0)) == 0  # no variance at all
    assert effective_dimension(x, threshold=0.49) == 1
    assert effective_dimension(x, threshold=0.51) == 2
    with pytest.raises(ValueError, match="non-empty"):
        effective_dimension(torch.zeros(0, 3))


def test_effective_dimensions_global_mask_and_per_cluster_masks():
    g = torch.Generator().manual_seed(0)
    n = 60
    codes = torch.zeros(2 * n, 8)
    # cluster 0 fires features 0, 1 (feature 1 a copy of feature 0: rank 1); cluster 1 fires 4, 5, 6 independently
    base = torch.rand(n, generator=g) + 0.5
    codes[:n, 0], codes[:n, 1] = base, 2 * base
    codes[n:, 4:7] = torch.rand(n, 3, generator=g) + 0.5
    clusters = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long), torch.full((5,), 2)])
    codes = torch.cat([codes, torch.zeros(5, 8)])  # cluster 2: five rows, below the size rule
    out = effective_dimensions(codes, clusters, torch.tensor([0, 1]), mask_size=2)
    assert out["per_cluster_min_size"] == 20  # max(20, 2k)
    assert out["per_cluster_eligible"] == 2 and "2" not in out["per_cluster"]
    assert out["per_cluster"]["0"] == 1  # its own mask {0, 1}: one direction
    assert out["global_mask"] == effective_dimension(codes[:, [0, 1]])
    assert out["raw_sae"] == effective_dimension(codes)
    assert out["per_cluster_summary"]["n"] == 2
    # the size rule follows k: with k=40 a cluster needs 80 rows
    assert effective_dimensions(codes, clusters, torch.tensor([0, 1]), mask_size=40)["per_cluster_eligible"] == 0


def test_occupancy_total_variation_and_clusters_holding_half():
    train = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # uniform over 4 clusters
    unsafe = torch.tensor([3, 3, 3, 1])  # 0, 1/4, 0, 3/4
    out = cluster_occupancy({"train": train, "unsafe": unsafe, "safe_test": train.flip(0)}, 4)
    assert out["sets"]["train"]["tv_to_reference"] == 0.0
    assert out["sets"]["safe_test"]["tv_to_reference"] == 0.0
    # TV = 0.5 * (1/4 + 0 + 1/4 + 1/2) = 0.5
    assert out["sets"]["unsafe"]["tv_to_reference"] == pytest.approx(0.5)
    assert out["sets"]["unsafe"]["occupancy"] == [0.0, 0.25, 0.0, 0.75]
    assert out["sets"]["unsafe"]["clusters_holding_half"] == 1
    assert out["sets"]["train"]["clusters_holding_half"] == 2
    assert out["sets"]["unsafe"]["empty_clusters"] == 2
    assert clusters_holding(torch.tensor([0.4, 0.1, 0.5])) == 1
    assert clusters_holding(torch.tensor([0.3, 0.3, 0.4])) == 2
    assert total_variation(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 1.0
    with pytest.raises(ValueError, match="reference"):
        cluster_occupancy({"unsafe": unsafe}, 4)


def test_active_support_overlap_counts_and_jaccard():
    mask = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7]])
    safe = torch.zeros(6, 8)
    unsafe = torch.zeros(5, 8)
    # cluster 0: safe fire 0, 1 on all rows and 2 on one of two (not > 50%); unsafe fire 0, 2
    safe[0, [0, 1, 2]] = 1.0
    safe[1, [0, 1]] = 1.0
    unsafe[0, [0, 2]] = 3.0
    # cluster 1: safe only (no unsafe row): not compared
    safe[2, 0] = 1.0
    # cluster 2: both fire feature 5; features 0..3 are outside its mask and do not count
    safe[3:6, 5] = 1.0
    safe[3:6, 0] = 1.0
    unsafe[1:5, 5] = 2.0
    unsafe[1:3, 6] = 1.0  # 2 of 4 unsafe rows: not a majority
    safe_clusters = torch.tensor([0, 0, 1, 2, 2, 2])
    unsafe_clusters = torch.tensor([0, 2, 2, 2, 2])
    out = active_support_overlap(safe, safe_clusters, unsafe, unsafe_clusters, mask)
    assert out["clusters_compared"] == 2
    # cluster 0: S_safe {0, 1}, S_unsafe {0, 2}: both 1, safe only 1, unsafe only 1, neither 1 (feature 3)
    # cluster 2: S_safe {5}, S_unsafe {5}: both 1, neither 3
    assert out["counts"] == {"both": 2, "safe_only": 1, "unsafe_only": 1, "neither": 4}
    assert out["jaccard"] == {"0": pytest.approx(1 / 3), "2": 1.0}
    assert out["jaccard_summary"]["median"] == pytest.approx((1 / 3 + 1) / 2)


def test_cluster_score_summary_and_threshold_position():
    scores = {"safe_test": torch.arange(20.0), "unsafe": torch.tensor([50.0, 60.0])}
    clusters = {"safe_test": torch.tensor([0] * 10 + [1] * 10), "unsafe": torch.tensor([1, 1])}
    out = cluster_score_summary(scores, clusters, 3, threshold=12.0)
    assert set(out["per_cluster"]) == {"0", "1"}  # cluster 2 is empty
    assert out["per_cluster"]["0"]["safe_test"]["max"] == 9.0
    assert out["per_cluster"]["1"]["safe_test"]["median"] == pytest.approx(14.5)
    assert out["per_cluster"]["1"]["unsafe"]["mean"] == 55.0
    assert "unsafe" not in out["per_cluster"]["0"]
    # threshold 12: above every safe score of cluster 0 (max 9), below the median of cluster 1 (14.5)
    assert out["threshold"]["above_every_safe_score"] == 1
    assert out["threshold"]["below_median_safe_score"] == 1


class PositivePart(nn.Module):
    """An 'SAE' whose codes are the non-negative part of the input (d_sae = d_in)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.config = type("Config", (), {"d_sae": d})()

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        return activations.clamp_min(0)


def test_freqmask_diagnostics_on_blobs(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    d = 12
    centres = torch.zeros(3, d)
    centres[0, :4], centres[1, 4:8], centres[2, 8:] = 5.0, 5.0, 5.0
    safe = centres[torch.arange(300) % 3] + 0.3 * torch.randn(300, d, generator=g)
    unsafe = centres[torch.zeros(60, dtype=torch.long)] + 2.0 * torch.randn(60, d, generator=g).abs()
    sae = PositivePart(d)
    detector = FreqMaskKM(
        FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3, seed=0), mask_size=4, mask_scope="local"), d, d
    )
    detector.fit(safe[:240], sae, progress=False)
    out = freqmask_diagnostics(
        detector, sae, safe[:240], {"safe_test": safe[240:], "harmful": unsafe}, unsafe_sets=("harmful", "toxic")
    )
    occupancy = out["occupancy"]["sets"]
    assert occupancy["safe_test"]["tv_to_reference"] < 0.15
    assert occupancy["harmful"]["clusters_holding_half"] == 1  # all unsafe rows sit by the first centre
    assert occupancy["harmful"]["tv_to_reference"] == pytest.approx(2 / 3, abs=0.02)
    assert out["effective_dimension"]["per_cluster_eligible"] == 3  # 80 rows each >= max(20, 8)
    assert out["support_overlap"]["unsafe_sets"] == ["harmful"]
    assert out["support_overlap"]["jaccard_summary"]["n"] == 1
    assert set(out["scores"]["per_cluster"]) == {"0", "1", "2"}

    monkeypatch.setattr(diagnostics, "plots_available", lambda: False)
    written, reason = save_plots(out, tmp_path)
    assert written == [] and "matplotlib is not installed" in reason
