"""Where faiss k-means runs: the GPU when faiss has its GPU API, else the CPU; a GPU request without one fails.

On a CPU machine the GPU path is exercised with a stand-in for faiss's GPU API whose
``index_cpu_to_gpu`` returns the CPU index, so the centroids must equal the CPU path's.
"""

from __future__ import annotations

import faiss
import pytest
import torch

from hf_lsad.core.runtime import GuardFitRuntime
from hf_lsad.detectors import clustering
from hf_lsad.detectors.clustering import KMeansConfig, faiss_gpu_count, fit_kmeans, kmeans_device, use_kmeans_device


def points() -> torch.Tensor:
    return torch.randn(300, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fake_gpu_faiss(monkeypatch):
    """faiss with a GPU API that reports one GPU; records the indexes moved to the GPU."""
    moved = []

    def index_cpu_to_gpu(resources, device, index):
        moved.append((type(resources).__name__, device, index.metric_type))
        return index

    class StandardGpuResources:
        pass

    monkeypatch.setattr(faiss, "StandardGpuResources", StandardGpuResources, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", index_cpu_to_gpu, raising=False)
    return moved


def test_without_faiss_gpus_auto_is_the_cpu_and_gpu_is_an_error(monkeypatch):
    monkeypatch.delattr(faiss, "StandardGpuResources", raising=False)  # a faiss-cpu build
    assert faiss_gpu_count() == 0
    assert kmeans_device("auto") == "cpu" and kmeans_device("cpu") == "cpu"
    with pytest.raises(RuntimeError, match=r"GPU k-means was requested but faiss .* has no GPU API .*faiss-gpu"):
        kmeans_device("gpu")
    with pytest.raises(RuntimeError, match="GPU k-means"), use_kmeans_device("gpu"):
        pytest.fail("the block must not run")
    with pytest.raises(ValueError, match="unknown k-means device 'tpu'"):
        kmeans_device("tpu")


def test_a_gpu_api_without_gpus_is_an_error_for_gpu(monkeypatch, fake_gpu_faiss):
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0)
    assert kmeans_device("auto") == "cpu"
    with pytest.raises(RuntimeError, match="sees no GPU"):
        kmeans_device("gpu")


@pytest.mark.parametrize("metric", ["l2", "l1"])
def test_with_faiss_gpus_auto_and_gpu_train_on_the_gpu_index(fake_gpu_faiss, metric):
    config = KMeansConfig(n_clusters=4, metric=metric, seed=3)
    assert kmeans_device("auto") == "gpu"
    on_gpu = fit_kmeans(points(), config)  # auto
    expected_metric = faiss.METRIC_L1 if metric == "l1" else faiss.METRIC_L2
    assert fake_gpu_faiss == [("StandardGpuResources", 0, expected_metric)]
    with use_kmeans_device("cpu") as chosen:
        assert chosen == "cpu"
        on_cpu = fit_kmeans(points(), config)
    assert len(fake_gpu_faiss) == 1  # pinned to the CPU: the GPU API was not used
    torch.testing.assert_close(on_gpu, on_cpu)  # the stand-in GPU index is the CPU one
    with use_kmeans_device("gpu"):
        fit_kmeans(points(), config)
    assert len(fake_gpu_faiss) == 2


def test_the_device_pin_ends_with_its_block(fake_gpu_faiss):
    with use_kmeans_device("cpu"):
        assert clustering._KMEANS_DEVICE.get() == "cpu"
    assert clustering._KMEANS_DEVICE.get() == "auto"
    assert GuardFitRuntime().kmeans_device == "auto"
