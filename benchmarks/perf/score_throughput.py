"""Scoring throughput of a FreqMask-KM guard on precomputed activations (rows per second).

    # SmolLM2 shape (576 -> 4608), on the CPU
    python benchmarks/score_throughput.py --d-model 576 --d-sae 4608 --name score_throughput_smollm2_shape_cpu
    # paper shape (4096 -> 16384), on the CPU and on a GPU
    python benchmarks/score_throughput.py --d-model 4096 --d-sae 16384 --name score_throughput_paper_cpu
    python benchmarks/score_throughput.py --d-model 4096 --d-sae 16384 --device cuda --name score_throughput_paper_gpu

A guard (random SAE with about ``--l0`` active features per row, FreqMask-KM
with K clusters and a mask of 100 features) is fitted on ``--fit-rows``
synthetic activations, then ``guard(batch)`` -- the public call, input checks
included -- scores ``--rows`` other activations already on the device, batch by
batch. Each batch size is timed ``--repeats`` times; the median gives rows/s.
Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from perf.harness import (
    environment,
    load_average,
    mean_l0,
    set_threads,
    sparse_random_sae,
    synthetic_activations,
)


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work (a no-op on the CPU), so wall time covers the computation."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def score_all(guard: SafetyGuard, activations: torch.Tensor, batch_size: int) -> None:
    """Score every row of ``activations`` in batches of ``batch_size``."""
    for start in range(0, len(activations), batch_size):
        guard(activations[start : start + batch_size])


@dataclass
class Settings:
    d_model: int = 576
    """D model."""
    d_sae: int = 4608
    """D sae."""
    clusters: int = 100
    """Clusters."""
    score_metric: str = "l1"
    """Score metric."""
    mask_scope: str = "global"
    """Mask scope."""
    l0: float = 60.0
    """L0."""
    fit_rows: int = 8192
    """Fit rows."""
    rows: int = 16384
    """Rows scored per timing."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 32, 256, 4096])
    """Batch sizes."""
    max_rows_batch_1: int = 1024
    """Rows scored at batch size 1 (slow)."""
    repeats: int = 5
    """Repeats."""
    device: str = "cpu"
    """Device."""
    seed: int = 0
    """Seed."""
    threads: int | None = None
    """CPU threads for torch and faiss (default: one per core)."""


def run(args: Settings) -> dict[str, Any]:
    set_threads(args.threads)
    device = torch.device(args.device)

    safe = synthetic_activations(args.fit_rows + args.rows, args.d_model, args.seed)
    fit, scored = safe[: args.fit_rows], safe[args.fit_rows :].to(device)
    sae = sparse_random_sae(fit[: min(2048, len(fit))], args.d_sae, args.l0, args.seed).to(device)
    hook = HookPoint("synthetic", "llama", args.d_model, 1, 0, "model.layers.0", "prompt_last")
    detector = FreqMaskConfig(
        kmeans=KMeansConfig(n_clusters=args.clusters, seed=args.seed, max_points_per_centroid=256),
        mask_size=100,
        mask_scope=args.mask_scope,
        score_metric=args.score_metric,
    )
    guard = fit_guard(fit.to(device), hook, "freqmask-km", detector, sae, seed=args.seed, progress=False).guard
    results = {}
    for batch_size in args.batch_sizes:
        rows = scored[: args.max_rows_batch_1] if batch_size == 1 else scored
        score_all(guard, rows[: 2 * batch_size], batch_size)  # warm-up
        load_before, seconds = load_average(), []
        for _ in range(args.repeats):
            synchronize(device)
            start = time.perf_counter()
            score_all(guard, rows, batch_size)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
        results[f"batch_{batch_size}"] = {
            "rows": len(rows),
            "median_s": statistics.median(seconds),
            "rows_per_s": len(rows) / statistics.median(seconds),
            "seconds": seconds,
            "load_average_before": load_before,
            "load_average_after": load_average(),
        }
        print(batch_size, results[f"batch_{batch_size}"], flush=True)
    record = {
        **environment(device),
        "note": "shared 2-core CPU: read rows/s with the load averages" if device.type == "cpu" else "",
        "settings": {k: v for k, v in vars(args).items() if k != "name"},
        "sae_l0_on_scored_rows": mean_l0(sae, scored[:2048]),
        "results": results,
    }
    return record
