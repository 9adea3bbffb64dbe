r"""FreqMask-KM fit time and peak memory versus the number of safe activations.

    # paper shape (d_model 4096, d_sae 16384, K 100), synthetic activations in memory
    python benchmarks/fit_scaling.py --rows 10000 50000 200000 --d-model 4096 --d-sae 16384 \
        --name fit_scaling_paper_cpu
    # CPU acceptance case of issue 6: 200k x 576, d_sae 4608, K 100, from a tensor and streamed from a store
    python benchmarks/fit_scaling.py --rows 200000 --d-model 576 --d-sae 4608 --sources tensor store \
        --name fit_acceptance_cpu
    # real activations: a store written by benchmarks/collect_smollm2.sh
    python benchmarks/fit_scaling.py --store artifacts/smollm2/prompt_last/safe --d-sae 4608 --name fit_smollm2_cpu
    # on a GPU (SAE encoding and accumulation on CUDA, k-means with faiss on the CPU)
    python benchmarks/fit_scaling.py --rows 200000 --d-model 4096 --d-sae 16384 --device cuda \
        --name fit_scaling_paper_gpu

Every fit runs in a fresh subprocess that reports its peak resident set size
(``VmHWM``; :func:`peak_rss_bytes` says why not ``ru_maxrss``); a subprocess
that only imports torch, faiss and hf_lsad gives the idle baseline, and
``net`` is the peak minus that baseline. With
``--sources tensor`` the activations are in that process's memory (and in its
peak); with ``store`` they are written to a temporary activation store first
and the fit streams them from disk. The SAE is random with its bias set so that
about ``--l0`` features fire per row (fit time depends on shapes and sparsity,
not on what the features mean); k-means trains on ``--max-points-per-centroid``
x K rows (faiss's default of 256). Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data.store import ActivationStore, TensorRows, save_activations
from hf_lsad.detectors import FreqMaskConfig, FreqMaskKM
from hf_lsad.detectors.clustering import KMeansConfig, training_sample
from perf.harness import (
    environment,
    load_average,
    mean_l0,
    set_threads,
    sparse_random_sae,
    synthetic_activations,
)

MIB = 2**20
CALIBRATION_ROWS = 2048


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/self/status has no {field}")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``).

    Not ``ru_maxrss``: on Linux that is carried over ``execve`` from the memory the
    process had before it, which for a ``subprocess`` child is the parent's (vfork),
    so a child started by a parent that once held a large tensor reports that peak.
    """
    return proc_status_bytes("VmHWM")


def current_rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``)."""
    return proc_status_bytes("VmRSS")


def run_idle() -> dict[str, Any]:
    """Peak RSS of a process that imported torch, faiss and hf_lsad and ran one small matmul."""
    torch.ones(256, 256) @ torch.ones(256, 256)
    return {"peak_rss_bytes": peak_rss_bytes()}


@torch.no_grad()
def run_fit(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit as described by ``spec``; timings and memory of this process."""
    device = torch.device(spec["device"])
    if spec["store"]:
        source = ActivationStore(spec["store"])
        activation_bytes = len(source) * source.width * 4
    else:
        activations = synthetic_activations(spec["rows"], spec["d_model"], spec["seed"])
        source = TensorRows(activations)
        activation_bytes = activations.numel() * activations.element_size()
    # Calibrate the SAE bias on random rows, measure its L0 on other random rows.
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(spec["seed"]))
    calibration = order[:CALIBRATION_ROWS].sort().values
    heldout = order[CALIBRATION_ROWS : 2 * CALIBRATION_ROWS].sort().values
    sae = sparse_random_sae(source.take(calibration), spec["d_sae"], spec["l0"], spec["seed"]).to(device)
    l0 = mean_l0(sae, source.take(heldout))
    kmeans = KMeansConfig(
        n_clusters=spec["clusters"], seed=spec["seed"], max_points_per_centroid=spec["max_points_per_centroid"]
    )
    config = FreqMaskConfig(kmeans=kmeans, mask_size=spec["mask_size"])
    detector = FreqMaskKM(config, source.width, spec["d_sae"]).to(device)
    rss_before = current_rss_bytes()
    load_before = load_average()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    detector.fit_rows(source, sae, progress=False, batch_size=spec["batch_size"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    result = {
        "rows": len(source),
        "d_model": source.width,
        "fit_s": seconds,
        "load_average_before_fit": load_before,
        "load_average_after_fit": load_average(),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_fit_bytes": rss_before,
        "activation_matrix_bytes": activation_bytes,
        "sae_bytes": sum(p.numel() * p.element_size() for p in sae.parameters()),
        "kmeans_training_rows": len(training_sample(len(source), kmeans)),
        "sae_l0_on_heldout_rows": l0,
        "nonempty_clusters": int((detector.cluster_sizes > 0).sum()),
    }
    if device.type == "cuda":
        result["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def in_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` in a fresh Python process; its result is the last line of its output."""
    output = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def add_derived(run: dict[str, Any], idle_peak_bytes: int) -> None:
    """Add the peak net of the idle baseline, its ratio to the activation matrix, and MiB values."""
    run["net_peak_rss_bytes"] = run["peak_rss_bytes"] - idle_peak_bytes
    run["net_peak_over_activation_matrix"] = run["net_peak_rss_bytes"] / run["activation_matrix_bytes"]
    run["fit_rss_increase_bytes"] = run["peak_rss_bytes"] - run["rss_before_fit_bytes"]
    for key in ("peak_rss", "net_peak_rss", "fit_rss_increase", "activation_matrix"):
        run[f"{key}_mib"] = run[f"{key}_bytes"] / MIB


def write_synthetic_store(directory: Path, rows: int, d_model: int, seed: int) -> None:
    """The synthetic activations of a ``tensor`` run, saved as an activation store."""
    activations = synthetic_activations(rows, d_model, seed)
    hook = HookPoint("synthetic", "llama", d_model, 1, 0, "model.layers.0", "prompt_last")
    save_activations(directory, activations, [{"row": i} for i in range(rows)], hook)


@dataclass
class Settings:
    rows: list[int] = field(default_factory=lambda: [10_000, 50_000, 200_000])
    """Activation counts N fitted, one fresh process each."""
    d_model: int = 4096
    """Width of the synthetic activations."""
    d_sae: int = 16384
    """SAE features."""
    clusters: int = 100
    """k-means clusters K."""
    mask_size: int = 100
    """Mask features."""
    l0: float = 60.0
    """Target active SAE features per row."""
    max_points_per_centroid: int = 256
    """k-means training sample per centroid (faiss's default)."""
    batch_size: int = 4096
    """Rows per encoding batch."""
    sources: list[str] = field(default_factory=lambda: ["tensor"])
    """``tensor`` (activations in memory) and/or ``store`` (streamed from an activation store on disk)."""
    store: str | None = None
    """Fit on this activation store (real activations) instead of synthetic rows."""
    device: str = "cpu"
    """Where the fit runs."""
    seed: int = 0
    """Seed of the synthetic rows, the SAE and k-means."""
    threads: int | None = None
    """torch/faiss threads (``None``: one per core)."""


def run(args: Settings) -> dict[str, Any]:
    common = {
        "kind": "fit",
        "device": args.device,
        "d_model": args.d_model,
        "d_sae": args.d_sae,
        "clusters": args.clusters,
        "mask_size": args.mask_size,
        "l0": args.l0,
        "max_points_per_centroid": args.max_points_per_centroid,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "threads": args.threads,
    }
    set_threads(args.threads)
    idle = in_subprocess({"kind": "idle", "threads": args.threads})["peak_rss_bytes"]
    runs = []
    if args.store:
        result = in_subprocess({**common, "store": args.store, "rows": None})
        runs.append({"source": "store (real activations)", "store_path": args.store, **result})
    else:
        for rows in args.rows:
            for source in args.sources:
                if source == "store":
                    with tempfile.TemporaryDirectory(prefix="hf-lsad-fit-scaling-") as tmp:
                        write_synthetic_store(Path(tmp), rows, args.d_model, args.seed)
                        runs.append({"source": source, **in_subprocess({**common, "rows": rows, "store": tmp})})
                else:
                    runs.append({"source": source, **in_subprocess({**common, "rows": rows, "store": None})})
                print(json.dumps(runs[-1]), flush=True)
    for fit in runs:
        add_derived(fit, idle)
    return {
        "environment": environment(torch.device(args.device)),
        "idle_baseline_peak_rss_bytes": idle,
        "idle_baseline_peak_rss_mib": idle / MIB,
        "runs": runs,
    }


def child(spec_json: str) -> None:
    """One measurement in this fresh process (:func:`in_subprocess`); prints its result as the last line."""
    spec = json.loads(spec_json)
    set_threads(spec["threads"])
    print(json.dumps(run_idle() if spec["kind"] == "idle" else run_fit(spec)))


if __name__ == "__main__":  # the fresh process of in_subprocess
    child(sys.argv[1])
