"""Mixed-cluster inference of LearnedMask-LoRA: stacked adapter tensors vs peft mixed-adapter batches.

Every path computes ``D_c(m_c * E_c(a))`` for a batch whose rows belong to
different clusters, in one call:

- ``stacked_grouped`` (kept, :meth:`LearnedMaskLoRA.reconstruct`): the stacked
  per-cluster LoRA factors; rows are gathered by cluster id and each adapted
  cluster's rows go through its own rank-r factors;
- ``stacked_block_dense``: one matmul of every row against all K stacked factors,
  keeping each row's own cluster block (no Python loop, K times the LoRA flops);
- ``stacked_row_gather``: each row's factors gathered by cluster id, then ``bmm``;
- ``peft``: the same adapters as a peft ``PeftModel`` called with
  ``adapter_names=[...]`` (peft groups the rows by adapter and loops over the groups).

The two alternatives to the kept path are written out here, not in the library.

Uses the LearnedMask-LoRA guard written by ``benchmarks/smollm2_learned_mask.py`` and
the held-out safe activations it was thresholded on; rows are drawn at random, so a
batch mixes clusters as real traffic does. Timings are the median of ``--repeats``
calls after a warm-up, with ``--threads`` torch threads.

    python benchmarks/learned_mask_inference.py [--guard artifacts/smollm2/prompt_last/guards/learned-mask-lora]

Writes ``benchmarks/results/learned_mask_inference.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_lsad.core.splits import split_safe
from hf_lsad.data.store import load_activations
from hf_lsad.guard import SafetyGuard

RESULTS = Path(__file__).parent / "results"


def lora_block_dense(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, clusters: torch.Tensor
) -> torch.Tensor:
    k, r, _ = lora_a.shape
    rows = torch.arange(len(x))
    hidden = (x @ lora_a.reshape(k * r, -1).T).view(len(x), k, r)
    selected = torch.zeros_like(hidden)
    selected[rows, clusters] = hidden[rows, clusters]
    return selected.view(len(x), k * r) @ lora_b.reshape(k * r, -1)


def lora_row_gather(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, clusters: torch.Tensor
) -> torch.Tensor:
    hidden = torch.bmm(lora_a[clusters], x.unsqueeze(2)).squeeze(2)
    return torch.bmm(hidden.unsqueeze(1), lora_b[clusters]).squeeze(1)


def reconstruct_with(lora, detector, sae, batch: torch.Tensor, clusters: torch.Tensor) -> torch.Tensor:
    """The detector's reconstruction with ``lora`` in place of its grouped LoRA product."""
    pre = sae.encoder(batch) + lora(batch, detector.encoder_lora_A, detector.encoder_lora_B, clusters)
    masked = torch.relu(pre) * detector.masks[clusters]
    return sae.decoder(masked) + lora(masked, detector.decoder_lora_A, detector.decoder_lora_B, clusters)


def inference_paths(
    detector, sae, peft_model, batch: torch.Tensor, clusters: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """The reconstructions of ``batch`` to time, by name, each a call that takes no argument."""
    names = [f"cluster_{c}" if detector.state.cluster_ranks[c] else "__base__" for c in clusters.tolist()]
    return {
        "stacked_grouped": lambda: detector.reconstruct(batch, sae, clusters),
        "stacked_block_dense": lambda: reconstruct_with(lora_block_dense, detector, sae, batch, clusters),
        "stacked_row_gather": lambda: reconstruct_with(lora_row_gather, detector, sae, batch, clusters),
        # The mask gather is part of the peft path too: peft knows nothing of masks.
        "peft": lambda: peft_model(batch, detector.masks[clusters], adapter_names=names),
    }


def median_seconds(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each call; calls alternate so that load changes on a shared machine hit both alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass
class Settings:
    guard: Path = Path("artifacts/smollm2/prompt_last/guards/learned-mask-lora")
    """Guard."""
    safe: Path = Path("artifacts/smollm2/prompt_last/safe")
    """Safe."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 256, 1024])
    """Batch sizes."""
    repeats: int = 20
    """Repeats."""
    threads: int = 1
    """Threads."""


def run(args: Settings) -> dict[str, Any]:
    torch.set_num_threads(args.threads)

    guard = SafetyGuard.from_pretrained(args.guard)
    detector, sae = guard.detector, guard.sae
    safe = load_activations(args.safe).activations
    rows = safe[split_safe(len(safe), guard.config.n_holdout / len(safe), guard.config.seed).holdout]
    peft_model = detector.peft_model(sae)
    generator = torch.Generator().manual_seed(0)
    results = []
    with torch.no_grad():
        for batch_size in args.batch_sizes:
            batch = rows[torch.randint(len(rows), (batch_size,), generator=generator)]
            clusters = detector(batch, sae).clusters
            paths = inference_paths(detector, sae, peft_model, batch, clusters)
            kept = paths["stacked_grouped"]()
            difference = max((path() - kept).abs().max().item() for path in paths.values())
            seconds = median_seconds(paths, args.repeats)
            results.append(
                {
                    "batch_size": batch_size,
                    "distinct_clusters": len(set(clusters.tolist())),
                    "max_abs_difference_to_kept": difference,
                    **{f"{name}_ms": 1e3 * value for name, value in seconds.items()},
                }
            )
            print(json.dumps(results[-1]), flush=True)
    for entry in results:
        entry["fastest"] = min(paths, key=lambda name: entry[f"{name}_ms"])
        entry["peft_over_stacked_grouped"] = entry["peft_ms"] / entry["stacked_grouped_ms"]
    stages = detector.state.cluster_stages
    report = {
        "command": "python benchmarks/learned_mask_inference.py",
        "guard": str(args.guard),
        "clusters": len(stages),
        "adapted_clusters": stages.count(2),
        "ranks": sorted(set(detector.state.cluster_ranks) - {0}),
        "d_in": detector.d_in,
        "d_sae": detector.d_sae,
        "threads": args.threads,
        "load_average_at_start": os.getloadavg()[0],
        "repeats": args.repeats,
        "results": results,
        "kept": "stacked_grouped",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "learned_mask_inference.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
