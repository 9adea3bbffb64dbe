"""Streaming FreqMask-KM fit: same result from a store as from a tensor, as the dense fit, bounded batches."""

from __future__ import annotations

import pytest
import torch

import hf_lsad.detectors.freqmask as freqmask
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import ActivationStore, load_activations, save_activations
from hf_lsad.detectors import FreqMaskConfig, FreqMaskKM
from hf_lsad.detectors.clustering import KMeansConfig, assign_clusters, cluster_space, fit_kmeans, training_sample
from hf_lsad.detectors.masks import top_k_mask
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder

D_IN, D_SAE, K = 32, 128, 4
HOOK = HookPoint("test/model", "llama", D_IN, 4, 2, "model.layers.2", "prompt_last")


def sparse_sae() -> SparseAutoencoder:
    """A random SAE whose bias leaves about 10 of 128 features active per row."""
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(D_IN, D_SAE))
    with torch.no_grad():
        sae.encoder.bias.fill_(-0.9)
    return sae.eval()


def mixture(n: int, seed: int) -> torch.Tensor:
    """``n`` activations around K well separated centres."""
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(K, D_IN, generator=torch.Generator().manual_seed(99))
    return centres[torch.randint(K, (n,), generator=g)] + torch.randn(n, D_IN, generator=g)


def dense_reference(detector: FreqMaskKM, activations: torch.Tensor, sae: SparseAutoencoder) -> None:
    """The pre-streaming fit: every code in memory, float32 sums (the algorithm the streaming fit must reproduce)."""
    config = detector.config
    codes = sae.encode(activations)
    space = cluster_space(codes, config.kmeans.metric)
    members = assign_clusters(space, fit_kmeans(space, config.kmeans), config.kmeans.metric)
    sizes = torch.bincount(members, minlength=K)
    one_hot = torch.nn.functional.one_hot(members, K).float()
    per_cluster = sizes.clamp_min(1).unsqueeze(1).float()
    detector.cluster_sizes.copy_(sizes)
    detector.centroids.copy_(one_hot.T @ codes / per_cluster)
    detector.cluster_frequency.copy_(one_hot.T @ (codes > 0).float() / per_cluster)
    pooled = (codes > 0).float().mean(0)
    for c in range(K):
        frequency = pooled if config.mask_scope == "global" or sizes[c] == 0 else detector.cluster_frequency[c]
        detector.mask_indices[c] = top_k_mask(frequency, config.mask_size)
    if config.score_metric == "mahalanobis":
        eye = torch.eye(config.mask_size)
        for c in range(K):
            diff = detector._masked_difference(codes[members == c], torch.full_like(members[members == c], c))
            covariance = diff.T @ diff / max(len(diff), 1) + config.ridge * eye
            detector.precision[c] = torch.cholesky_inverse(torch.linalg.cholesky(covariance))


VARIANTS = {
    "global-l1": FreqMaskConfig(kmeans=KMeansConfig(n_clusters=K, seed=3), mask_size=20),
    "local-mahalanobis": FreqMaskConfig(
        kmeans=KMeansConfig(n_clusters=K, seed=3), mask_size=12, mask_scope="local", score_metric="mahalanobis"
    ),
    "l1-clusters": FreqMaskConfig(kmeans=KMeansConfig(n_clusters=K, metric="l1", seed=3), mask_size=20),
    "hamming-local-l2": FreqMaskConfig(
        kmeans=KMeansConfig(n_clusters=K, metric="hamming", seed=3), mask_size=20, mask_scope="local", score_metric="l2"
    ),
}


@torch.no_grad()
@pytest.mark.parametrize("name", VARIANTS)
def test_streaming_fit_reproduces_the_dense_fit(name):
    config, sae = VARIANTS[name], sparse_sae()
    safe, test = mixture(600, seed=1), mixture(200, seed=2)
    reference = FreqMaskKM(config, D_IN, D_SAE)
    dense_reference(reference, safe, sae)
    streamed = FreqMaskKM(config, D_IN, D_SAE)
    # One batch encodes exactly as the dense fit does; the small batches below then only change float64 sums.
    streamed.fit(safe, sae, progress=False, batch_size=len(safe))
    assert torch.equal(streamed.cluster_sizes, reference.cluster_sizes)
    assert torch.equal(streamed.mask_indices, reference.mask_indices)
    assert torch.equal(streamed.cluster_frequency, reference.cluster_frequency)
    torch.testing.assert_close(streamed.centroids, reference.centroids, rtol=1e-5, atol=1e-6)
    expected, got = reference(test, sae), streamed(test, sae)
    assert torch.equal(got.clusters, expected.clusters)
    torch.testing.assert_close(got.scores, expected.scores, rtol=1e-4, atol=1e-5)

    batched = FreqMaskKM(config, D_IN, D_SAE)
    batched.fit(safe, sae, progress=False, batch_size=64)
    assert torch.equal(batched.mask_indices, reference.mask_indices)
    torch.testing.assert_close(batched(test, sae).scores, expected.scores, rtol=1e-4, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("name", ["global-l1", "local-mahalanobis"])
def test_fit_from_a_store_equals_the_in_memory_fit(name, tmp_path):
    config, sae = VARIANTS[name], sparse_sae()
    safe, test = mixture(700, seed=4), mixture(100, seed=5)
    # Shards of 150 rows and batches of 64: batches straddle shard boundaries.
    save_activations(tmp_path, safe, [{"id": i} for i in range(len(safe))], HOOK, shard_size=150)
    in_memory, streamed = FreqMaskKM(config, D_IN, D_SAE), FreqMaskKM(config, D_IN, D_SAE)
    in_memory.fit(safe, sae, progress=False, batch_size=64)
    streamed.fit_rows(ActivationStore(tmp_path), sae, progress=False, batch_size=64)
    assert all(torch.equal(value, streamed.state_dict()[key]) for key, value in in_memory.state_dict().items())
    assert torch.equal(streamed(test, sae).scores, in_memory(test, sae).scores)


def test_fit_guard_from_a_store_equals_fit_guard_from_a_tensor(tmp_path):
    sae, safe = sparse_sae(), mixture(500, seed=6)
    save_activations(tmp_path, safe, [{"id": i} for i in range(len(safe))], HOOK, shard_size=128)
    config = VARIANTS["global-l1"]
    from_tensor = fit_guard(safe, HOOK, "freqmask-km", config, sae, progress=False, batch_size=50)
    from_store = fit_guard(ActivationStore(tmp_path), HOOK, "freqmask-km", config, sae, progress=False, batch_size=50)
    assert from_store.guard.threshold == from_tensor.guard.threshold
    assert torch.equal(from_store.holdout_scores, from_tensor.holdout_scores)
    assert torch.equal(from_store.guard.detector.centroids, from_tensor.guard.detector.centroids)


class CountingEncoder:
    """Wraps an SAE's encode and records the rows of every call."""

    def __init__(self, sae: SparseAutoencoder) -> None:
        self.sae, self.calls = sae, []

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(activations))
        return self.sae.encode(activations)


@torch.no_grad()
@pytest.mark.parametrize("name", ["global-l1", "local-mahalanobis"])
def test_fit_encodes_in_batches_and_trains_kmeans_on_the_sample_only(name, monkeypatch):
    config = VARIANTS[name]
    kmeans = KMeansConfig(n_clusters=K, seed=3, max_points_per_centroid=25)
    config = FreqMaskConfig(**{**vars(config), "kmeans": kmeans})
    trained_on = []

    def recording_fit_kmeans(vectors, kmeans_config):
        trained_on.append(tuple(vectors.shape))
        return fit_kmeans(vectors, kmeans_config)

    monkeypatch.setattr(freqmask, "fit_kmeans", recording_fit_kmeans)
    encoder, safe = CountingEncoder(sparse_sae()), mixture(1000, seed=7)
    detector = FreqMaskKM(config, D_IN, D_SAE)
    detector.fit(safe, encoder, progress=False, batch_size=64)
    assert trained_on == [(25 * K, D_SAE)]
    assert max(encoder.calls) <= 64
    passes = 2 if config.score_metric == "mahalanobis" else 1
    assert sum(encoder.calls) == 25 * K + passes * len(safe)
    assert detector.cluster_sizes.sum() == len(safe)


def test_training_sample_is_all_rows_up_to_the_cap_then_a_seeded_subset():
    assert torch.equal(training_sample(80, KMeansConfig(n_clusters=4, max_points_per_centroid=20)), torch.arange(80))
    config = KMeansConfig(n_clusters=4, max_points_per_centroid=20, seed=5)
    sample = training_sample(1000, config)
    assert len(sample) == 80 and torch.equal(sample, sample.sort().values) and len(sample.unique()) == 80
    assert torch.equal(sample, training_sample(1000, config))
    other_seed = KMeansConfig(n_clusters=4, max_points_per_centroid=20, seed=6)
    assert not torch.equal(sample, training_sample(1000, other_seed))


def test_activation_store_reads_rows_across_shards(tmp_path):
    safe = mixture(300, seed=8)
    save_activations(tmp_path, safe, [{"id": i} for i in range(len(safe))], HOOK, shard_size=70)
    store = ActivationStore(tmp_path)
    assert len(store) == 300 and store.width == D_IN and store.hook == HOOK
    rows = torch.tensor([0, 5, 69, 70, 71, 139, 140, 250, 299])
    assert torch.equal(store.take(rows), load_activations(tmp_path).activations[rows])
    with pytest.raises(IndexError, match="ascending"):
        store.take(torch.tensor([5, 3]))
    with pytest.raises(IndexError, match="ascending"):
        store.take(torch.tensor([300]))


def test_scatter_and_matmul_accumulation_agree():
    """The CPU (scatter) and CUDA (one-hot matmul) accumulations give the same totals."""
    codes = torch.relu(torch.randn(300, 50, generator=torch.Generator().manual_seed(9)) - 1.0)
    clusters = torch.randint(K, (300,), generator=torch.Generator().manual_seed(10))
    totals = []
    for scatter in (True, False):
        sums, counts = torch.zeros(K, 50, dtype=torch.float64), torch.zeros(K, 50, dtype=torch.float64)
        freqmask._accumulate(sums, counts, clusters, codes, scatter=scatter)
        totals.append((sums, counts))
    torch.testing.assert_close(totals[0][0], totals[1][0], rtol=1e-6, atol=1e-6)
    assert torch.equal(totals[0][1], totals[1][1])
    assert totals[0][1].sum() == (codes > 0).sum()
