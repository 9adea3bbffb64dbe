"""Time one FreqMask-KM grid point of ``hf_lsad.evaluation.run_grid`` on 20k safe rows (CPU).

No real store has 20k rows, so the activations are synthetic: 576-wide (SmolLM2's
hidden size), 20,000 safe rows from a seeded 50-component Gaussian mixture with the
residual stream's scale, two unsafe categories and a benign-OOD set of 1,000 rows each
(shifted mixtures). The SAE (d_sae 2304) is trained beforehand for one epoch and is
not part of the timing: a grid reuses one cached SAE. Timed: one grid point
(K=50, k=100, one seed) = fit on the 12,000 fit rows (SAE encoding, faiss k-means,
centroids, mask) and scoring of validation, test, unsafe and benign-OOD rows with all
metrics; then the FreqMask-KM diagnostics of that point, separately.

    python benchmarks/grid_point_timing.py   # writes benchmarks/results/grid_point_timing.json
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from hf_lsad.evaluation import EvalData, GridConfig, MethodSpec, make_splits, package_versions, run_grid
from hf_lsad.sae.training import SAETrainConfig, train_sae

N_SAFE, D, D_SAE, N_OTHER = 20_000, 576, 2304, 1_000
RESULTS = Path(__file__).parent / "results"


def mixture(n: int, seed: int, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.randn(50, D, generator=torch.Generator().manual_seed(1234))
    return centres[torch.randint(0, 50, (n,), generator=g)] + torch.randn(n, D, generator=g) + shift


def main() -> None:
    data = EvalData(
        mixture(N_SAFE, 0),
        {"harmful": mixture(N_OTHER, 1, 0.5), "toxic": mixture(N_OTHER, 2, 0.3)},
        mixture(N_OTHER, 3, 0.2),
        {},
        {"all": f"synthetic Gaussian mixture, {N_SAFE} safe rows x {D}"},
    )
    point = GridConfig(
        methods=[MethodSpec("FreqMask-KM", "freqmask-km", base={"kmeans.n_clusters": 50, "mask_size": 100})],
        diagnostics=False,
    )
    splits = make_splits(N_SAFE, {c: len(x) for c, x in data.unsafe.items()}, point)
    start = time.perf_counter()
    sae = train_sae(data.safe[splits.safe_fit], D_SAE, SAETrainConfig(l1_coefficient=1.0, epochs=1), progress=False)
    sae_seconds = time.perf_counter() - start

    wall, cpu = time.perf_counter(), time.process_time()
    result = run_grid(data, point, sae, splits=splits, progress=False)
    grid_point = {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}
    run = result["methods"]["FreqMask-KM"]["runs"][0]
    grid_point.update(fit_seconds=run["fit_seconds"], score_seconds=run["score_seconds"])

    point.diagnostics = True
    wall, cpu = time.perf_counter(), time.process_time()
    run_grid(data, point, sae, splits=splits, progress=False)
    with_diagnostics = {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}

    out = {
        "setup": {
            "n_safe": N_SAFE,
            "n_fit": len(splits.safe_fit),
            "n_validation": len(splits.safe_validation),
            "n_test": len(splits.safe_test),
            "unsafe_rows_per_category": N_OTHER,
            "benign_ood_rows": N_OTHER,
            "hidden_size": D,
            "d_sae": D_SAE,
            "n_clusters": 50,
            "mask_size": 100,
            "seeds": 1,
            "cpu_count": os.cpu_count(),
            "load_average_1min_at_end": os.getloadavg()[0],
        },
        "sae_training_seconds_not_timed": sae_seconds,
        "grid_point": grid_point,
        "grid_point_with_diagnostics": with_diagnostics,
        "test_mean_auroc": result["methods"]["FreqMask-KM"]["test"]["mean"]["auroc"][0],
        "versions": package_versions(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grid_point_timing.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
