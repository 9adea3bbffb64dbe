"""FreqMask-KM on SmolLM2-135M-Instruct with the bundled data: AUROC and TPR@5%FPR per unsafe category.

Reads the activation stores written by ``benchmarks/collect_smollm2.sh`` (layer 20,
``prompt_last`` and ``response_last``), and for each position: trains the SAE on
the 0.8 fit split of the safe store, fits FreqMask-KM on the same split, sets
the threshold at 5% FPR on the 0.2 held-out safe split, and scores every unsafe
category with those held-out safe rows as negatives (the paper's protocol).
Settings are fixed a priori (K=50, k=100, d_sae=2304), not tuned on these numbers.

    python benchmarks/archive/task-prompt-study/smollm2_freqmask.py [--stores artifacts/smollm2] [--save-guard POSITION]

Writes ``benchmarks/results/smollm2_freqmask.{json,md}``; ``--save-guard`` also
saves the guard of that position as the package's default guard.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from hf_lsad.core.metrics import auroc, tpr_at_fpr
from hf_lsad.core.splits import split_safe
from hf_lsad.data import UNSAFE_POOLS
from hf_lsad.data.store import load_activations
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import DEFAULT_GUARD
from hf_lsad.guard.card import describe_records
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.training import SAETrainConfig, sae_stats, train_sae

D_SAE = 2304
SAE_TRAINING = SAETrainConfig(l1_coefficient=1.0, epochs=30, seed=0)
DETECTOR = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=50, seed=0), mask_size=100)
RESULTS = Path(__file__).parent / "results"


def run_position(stores: Path, position: str) -> tuple[dict, object]:
    safe = load_activations(stores / position / "safe")
    split = split_safe(len(safe.activations), 0.2, seed=0)
    start = time.perf_counter()
    sae = train_sae(safe.activations[split.fit], D_SAE, SAE_TRAINING)
    sae_seconds = time.perf_counter() - start
    start = time.perf_counter()
    result = fit_guard(safe.activations, safe.hook, "freqmask-km", DETECTOR, sae, target_fpr=0.05, seed=0)
    fit_seconds = time.perf_counter() - start
    guard, negatives = result.guard, result.holdout_scores.numpy()
    row = {
        "n_safe_fit": len(split.fit),
        "n_safe_holdout": len(split.holdout),
        "sae_heldout": sae_stats(sae, safe.activations[split.holdout])._asdict(),
        "sae_train_seconds": sae_seconds,
        "fit_seconds": fit_seconds,
        "threshold": guard.threshold,
        "categories": {},
    }
    # Every store is loaded and scored once; pooled negatives add the benign-OOD rows (paper, Table 5).
    scores = {
        pool: guard(load_activations(stores / position / pool).activations).scores.numpy()
        for pool in (*UNSAFE_POOLS, "benign_ood")
        if (stores / position / pool / "index.json").is_file()
    }
    pooled_negatives = np.concatenate([negatives, scores["benign_ood"]]) if "benign_ood" in scores else None
    for pool, pool_scores in scores.items():
        row["categories"][pool] = {
            "n": len(pool_scores),
            "auroc": auroc(negatives, pool_scores),
            "tpr_at_5fpr": tpr_at_fpr(negatives, pool_scores, 0.05),
            "flagged_at_threshold": float((pool_scores > guard.threshold).mean()),
        }
        if pooled_negatives is not None and pool != "benign_ood":
            row["categories"][pool]["pooled_auroc"] = auroc(pooled_negatives, pool_scores)
    unsafe = [p for p in UNSAFE_POOLS if p in scores]
    row["mean_auroc"] = sum(row["categories"][p]["auroc"] for p in unsafe) / len(unsafe)
    row["mean_tpr_at_5fpr"] = sum(row["categories"][p]["tpr_at_5fpr"] for p in unsafe) / len(unsafe)
    if pooled_negatives is not None:
        row["pooled_auroc_all_unsafe"] = auroc(pooled_negatives, np.concatenate([scores[p] for p in unsafe]))
    return row, (guard, safe.records)


def markdown(results: dict) -> str:
    lines = [
        "| position | "
        + " | ".join(f"{p} AUROC / TPR@5%FPR" for p in UNSAFE_POOLS)
        + " | mean | pooled AUROC (safe + benign-OOD negatives) | benign-OOD flagged |",
        "|---" * (len(UNSAFE_POOLS) + 4) + "|",
    ]
    for position, row in results.items():
        cells = [
            f"{row['categories'][p]['auroc']:.3f} / {row['categories'][p]['tpr_at_5fpr']:.3f}"
            if p in row["categories"]
            else "-"
            for p in UNSAFE_POOLS
        ]
        ood = row["categories"].get("benign_ood", {}).get("flagged_at_threshold")
        lines.append(
            f"| {position} | "
            + " | ".join(cells)
            + f" | {row['mean_auroc']:.3f} / {row['mean_tpr_at_5fpr']:.3f} | "
            + (f"{row['pooled_auroc_all_unsafe']:.3f}" if "pooled_auroc_all_unsafe" in row else "-")
            + " | "
            + (f"{ood:.3f}" if ood is not None else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", type=Path, default=Path("artifacts/smollm2"))
    parser.add_argument("--positions", nargs="+", default=["prompt_last", "response_last"])
    parser.add_argument("--save-guard", choices=["prompt_last", "response_last"], default=None)
    args = parser.parse_args()
    results, guards = {}, {}
    for position in args.positions:
        results[position], guards[position] = run_position(args.stores, position)
        print(position, json.dumps(results[position], indent=2))
    RESULTS.mkdir(exist_ok=True)
    settings = {
        "d_sae": D_SAE,
        "sae_training": SAE_TRAINING.__dict__,
        "detector": DETECTOR.__dict__ | {"kmeans": DETECTOR.kmeans.__dict__},
    }
    path = RESULTS / "smollm2_freqmask.json"
    if path.is_file():  # positions not run this time keep their earlier results
        earlier = json.loads(path.read_text())
        if earlier["settings"] == json.loads(json.dumps(settings)):
            results = {**earlier["results"], **results}
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    (RESULTS / "smollm2_freqmask.md").write_text(markdown(results))
    print(markdown(results))
    if args.save_guard:
        guard, records = guards[args.save_guard]
        row = results[args.save_guard]["categories"]
        metrics = {
            pool: {k: row[pool][k] for k in ("auroc", "pooled_auroc", "tpr_at_5fpr") if k in row[pool]}
            for pool in UNSAFE_POOLS
            if pool in row
        }
        if "benign_ood" in row:
            metrics["benign_ood"] = {"flagged": row["benign_ood"]["flagged_at_threshold"]}
        data = describe_records(records, what="safe prompts of the bundled pool (hf_lsad.data, `safe`)")
        guard.save_pretrained(DEFAULT_GUARD, metrics=metrics, data=data, license="apache-2.0")
        print(f"saved the {args.save_guard} guard to {DEFAULT_GUARD}")


if __name__ == "__main__":
    main()
