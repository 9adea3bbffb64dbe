"""FreqMask-KM: the paper's weak-sparse-noise proposition, variants, and save/load."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hf_lsad.core.metrics import auroc
from hf_lsad.core.serialization import load_module, save_module
from hf_lsad.detectors import FreqMaskConfig, FreqMaskKM
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder


class IdentityEncoder(nn.Module):
    """Codes = the (non-negative) inputs: lets a test choose the SAE feature distribution."""

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        return activations.clamp_min(0)


def weak_sparse_noise(n: int, dim: int, unsafe: bool, generator: torch.Generator) -> torch.Tensor:
    """Proposition "weak sparse noise can obscure an unmasked score": Z = (U, b B_1..b B_D)."""
    p, b = dim**-0.5, dim**-0.125
    low = 3.0 if unsafe else 1.0
    first = low + torch.rand(n, 1, generator=generator)
    noise = b * (torch.rand(n, dim, generator=generator) < p).float()
    return torch.cat([first, noise], dim=1)


def proposition_aurocs(dim: int, n: int = 2000) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    safe = weak_sparse_noise(n, dim, False, g)
    safe_test, unsafe_test = weak_sparse_noise(n, dim, False, g), weak_sparse_noise(n, dim, True, g)
    kmeans = KMeansConfig(n_clusters=1)
    results = []
    for use_mask in (True, False):
        detector = FreqMaskKM(FreqMaskConfig(kmeans=kmeans, mask_size=1, use_mask=use_mask), dim + 1, dim + 1)
        detector.fit(safe, IdentityEncoder(), progress=False)
        scores = [detector(x, IdentityEncoder()).scores.numpy() for x in (safe_test, unsafe_test)]
        results.append(auroc(*scores))
    return results[0], results[1]


def test_mask_rescues_score_from_weak_sparse_noise_at_d4096():
    masked, unmasked = proposition_aurocs(4096)
    assert masked >= 0.99
    # The unmasked L1 score's population AUROC at D=4096 is Phi(1.75 / 3.86) = 0.675 (see proof:
    # mean gap 1.75, noise sd b(1-2p)sqrt(2Dp(1-p))); it tends to 1/2 only as D grows.
    analytic = 0.5 * (
        1 + math.erf(1.75 / math.sqrt(2 * (0.104 + (4096**-0.125 * (1 - 2 / 64)) ** 2 * 2 * 64 * 63 / 64)))
    )
    assert abs(unmasked - analytic) < 0.03


def test_unmasked_score_falls_towards_chance_as_noise_dimension_grows():
    _, unmasked = proposition_aurocs(65536, n=600)
    assert unmasked <= 0.65


def clustered_codes(n_per_cluster: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three clusters of sparse codes, each active on its own 5 of 60 features, plus weak noise."""
    rows, labels = [], []
    for c in range(3):
        codes = torch.zeros(n_per_cluster, 60)
        codes[:, c * 5 : c * 5 + 5] = 1.0 + torch.rand(n_per_cluster, 5, generator=generator)
        codes[:, 30:] = 0.05 * (torch.rand(n_per_cluster, 30, generator=generator) < 0.1)
        rows.append(codes)
        labels.append(torch.full((n_per_cluster,), c))
    return torch.cat(rows), torch.cat(labels)


VARIANTS = [
    dict(mask_scope="global", score_metric="l1"),
    dict(mask_scope="local", score_metric="l1"),
    dict(mask_scope="global", score_metric="l2"),
    dict(mask_scope="local", score_metric="mahalanobis"),
    dict(mask_scope="global", score_metric="l1", use_mask=False),
    dict(mask_scope="local", score_metric="l1", kmeans=KMeansConfig(n_clusters=3, metric="l1")),
    dict(mask_scope="local", score_metric="l2", kmeans=KMeansConfig(n_clusters=3, metric="hamming")),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_variants_recover_clusters_and_flag_off_support_codes(variant, tmp_path):
    g = torch.Generator().manual_seed(1)
    safe, labels = clustered_codes(100, g)
    config = FreqMaskConfig(**{"kmeans": KMeansConfig(n_clusters=3), "mask_size": 15, **variant})
    detector = FreqMaskKM(config, 60, 60)
    detector.fit(safe, IdentityEncoder(), progress=False)

    output = detector(safe, IdentityEncoder())
    # Each true cluster maps to one fitted cluster.
    assert all(len(output.clusters[labels == c].unique()) == 1 for c in range(3))
    assert len(output.clusters.unique()) == 3
    # Codes that lose part of their cluster's usual support score above safe codes.
    held_out, _ = clustered_codes(50, g)
    unsafe = held_out.clone()
    for c in range(3):
        unsafe[c * 50 : c * 50 + 50, c * 5 : c * 5 + 3] = 0.0
    safe_scores = detector(held_out, IdentityEncoder()).scores.numpy()
    assert auroc(safe_scores, detector(unsafe, IdentityEncoder()).scores.numpy()) > 0.95

    save_module(detector, tmp_path / "d.safetensors")
    reloaded = FreqMaskKM(config, 60, 60)
    load_module(reloaded, tmp_path / "d.safetensors")
    assert torch.equal(reloaded(held_out, IdentityEncoder()).scores, detector(held_out, IdentityEncoder()).scores)


def test_local_masks_follow_cluster_frequencies_and_global_mask_is_shared():
    g = torch.Generator().manual_seed(2)
    safe, _labels = clustered_codes(100, g)
    local = FreqMaskKM(FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=5, mask_scope="local"), 60, 60)
    local.fit(safe, IdentityEncoder(), progress=False)
    masks = {tuple(row.tolist()) for row in local.mask_indices}
    assert masks == {tuple(range(c * 5, c * 5 + 5)) for c in range(3)}

    shared = FreqMaskKM(FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=15), 60, 60)
    shared.fit(safe, IdentityEncoder(), progress=False)
    assert all(torch.equal(row, torch.arange(15)) for row in shared.mask_indices)


def test_fit_is_deterministic_for_a_seed():
    g = torch.Generator().manual_seed(3)
    safe, _ = clustered_codes(80, g)
    sae = SparseAutoencoder(SAEConfig(d_in=60, d_sae=90))
    fits = []
    for _ in range(2):
        detector = FreqMaskKM(FreqMaskConfig(kmeans=KMeansConfig(n_clusters=4, seed=7), mask_size=10), 60, 90)
        detector.fit(safe, sae, progress=False)
        fits.append(detector.state_dict())
    assert all(torch.equal(fits[0][k], fits[1][k]) for k in fits[0])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="mask_size"):
        FreqMaskKM(FreqMaskConfig(mask_size=100), 8, 50)
    with pytest.raises(ValueError, match="score_metric"):
        FreqMaskConfig(score_metric="cosine")
    with pytest.raises(ValueError, match="clustering metric"):
        KMeansConfig(metric="cosine")
    with pytest.raises(ValueError, match="Mahalanobis"):
        FreqMaskKM(FreqMaskConfig(score_metric="mahalanobis", use_mask=False), 8, 20000)
    detector = FreqMaskKM(FreqMaskConfig(kmeans=KMeansConfig(n_clusters=10)), 8, 200)
    with pytest.raises(ValueError, match="at least n_clusters"):
        detector.fit(torch.rand(5, 8), SparseAutoencoder(SAEConfig(8, 200)), progress=False)
