"""The timing harness shared by every performance experiment: the machine record, load averages, threads,
medians of interleaved repeats, synthetic activations and a random sparse SAE.

Experiments run through ``python benchmarks/run.py perf/NAME`` (:mod:`run`), which records the command and the
commit beside what a module's ``run(settings)`` returns.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import torch
import transformers

import hf_lsad
from hf_lsad.sae.model import SAEConfig, SparseAutoencoder


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (or ``platform.processor()`` elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The accelerator's name for a CUDA device, the CPU model and core count otherwise."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (other jobs share this machine: read timings with them)."""
    return [round(x, 2) for x in os.getloadavg()]


def environment(device: torch.device) -> dict[str, Any]:
    """Device, versions and time of a benchmark run (the runner adds the command and the commit)."""
    return {
        "device": device_name(device),
        "versions": {
            "hf_lsad": hf_lsad.__version__,
            "torch": torch.__version__,
            "faiss": faiss.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch_threads": torch.get_num_threads(),
    }


def set_threads(threads: int | None) -> None:
    """Use ``threads`` intra-op threads in torch and faiss (``None``: their defaults, one per core)."""
    if threads is not None:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Any]:
    """Time each variant ``repeats`` times, taking turns (drift on a shared machine falls on all alike);
    returns each variant's seconds and median, and the load averages before and after."""
    before = load_average()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            seconds[name].append(timed(fn))
    return {
        "median_s": {name: statistics.median(values) for name, values in seconds.items()},
        "seconds": seconds,
        "load_average": {"before": before, "after": load_average()},
    }


def synthetic_activations(n: int, d_model: int, seed: int, *, modes: int = 64, chunk: int = 16_384) -> torch.Tensor:
    """``[n, d_model]`` float32 rows from a mixture of ``modes`` Gaussians (unit noise, standard normal centres).

    Written chunk by chunk into one preallocated tensor, so making them costs the tensor and one chunk.
    """
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(modes, d_model, generator=generator)
    out = torch.empty(n, d_model)
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        labels = torch.randint(modes, (rows,), generator=generator)
        torch.randn(rows, d_model, generator=generator, out=out[start : start + rows])
        out[start : start + rows] += centres[labels]
    return out


@torch.no_grad()
def sparse_random_sae(calibration: torch.Tensor, d_sae: int, l0: float, seed: int) -> SparseAutoencoder:
    """A randomly initialised SAE whose encoder bias makes about ``l0`` features fire per row.

    Each feature's bias is minus its ``1 - l0/d_sae`` quantile of pre-activations on ``calibration``,
    so each fires on a fraction ``l0/d_sae`` of such rows. Fit and scoring time depend on the
    shapes and the sparsity, not on what the features mean, so no training is needed.
    """
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SAEConfig(calibration.shape[1], d_sae)).eval()
    pre = calibration @ sae.encoder.weight.T
    k = max(1, min(len(pre), round(len(pre) * (1.0 - l0 / d_sae))))
    sae.encoder.bias.copy_(-pre.kthvalue(k, dim=0).values)
    return sae


@torch.no_grad()
def mean_l0(sae: SparseAutoencoder, activations: torch.Tensor) -> float:
    """Mean number of active features per row of ``activations``."""
    device = sae.encoder.weight.device
    return (sae.encode(activations.to(device)) > 0).sum(-1).float().mean().item()
