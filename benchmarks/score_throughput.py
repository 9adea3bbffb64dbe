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

import argparse
import statistics
import time

import torch

from common import (
    environment,
    load_average,
    mean_l0,
    set_threads,
    sparse_random_sae,
    synthetic_activations,
    write_result,
)
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA work (a no-op on the CPU), so wall time covers the computation."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def score_all(guard: SafetyGuard, activations: torch.Tensor, batch_size: int) -> None:
    """Score every row of ``activations`` in batches of ``batch_size``."""
    for start in range(0, len(activations), batch_size):
        guard(activations[start : start + batch_size])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="results file name (without .json)")
    parser.add_argument("--d-model", type=int, default=576)
    parser.add_argument("--d-sae", type=int, default=4608)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--score-metric", default="l1", choices=["l1", "l2", "mahalanobis"])
    parser.add_argument("--mask-scope", default="global", choices=["global", "local"])
    parser.add_argument("--l0", type=float, default=60.0)
    parser.add_argument("--fit-rows", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=16384, help="rows scored per timing")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256, 4096])
    parser.add_argument("--max-rows-batch-1", type=int, default=1024, help="rows scored at batch size 1 (slow)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch and faiss (default: one per core)")
    args = parser.parse_args()
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
    print(write_result(args.name, record))


if __name__ == "__main__":
    main()
