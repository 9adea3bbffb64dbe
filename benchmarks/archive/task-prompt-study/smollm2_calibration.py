"""Per-cluster calibration against the coupled budget on SmolLM2-135M-Instruct
(paper, appendix "Per-Cluster Calibration").

Protocol (paper): for a coupled budget p, the labelled sample holds a fraction p of
the unsafe rows (harmful, toxic and jailbreak when collected, pooled), the same
fraction p of the benign out-of-distribution rows and half of the held-out safe
rows, importance-weighted (1/p, 1/p, 2); everything not drawn is the evaluation
set. Per detector, budget and seed (5 seeds) it reports, before and after
calibration on the same evaluation rows:

- AUROC with negatives = evaluation safe + evaluation benign-OOD, positives = evaluation unsafe;
- recall (TPR) at the threshold costing 5% false positives on the evaluation safe rows;
- benign-OOD FPR: the fraction of evaluation benign-OOD rows above that same threshold.

"after" uses the default calibration on standardised scores; "after_raw_units" the paper's
literal raw-score parametrisation (see :mod:`hf_lsad.guard.calibration` for why they differ).

The budget grid is the paper's {3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 2e-2}, keeping the
values that give at least one labelled row per group (``round(p n) >= 1``); on the bundled
pools (500 benign-OOD rows) that leaves p >= 3e-3. ``--extra-budgets`` adds larger values,
reported separately as outside the paper's grid.

Reads the guards saved by ``benchmarks/archive/task-prompt-study/smollm2_learned_mask.py`` (run it first) from
``<stores>/<position>/guards/`` and the activation stores; fits no detector.

    python benchmarks/archive/task-prompt-study/smollm2_calibration.py [--stores artifacts/smollm2] [--position prompt_last]

Writes ``benchmarks/results/smollm2_calibration.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from hf_lsad.core.metrics import auroc, flag_rate, mean_std
from hf_lsad.core.splits import split_safe
from hf_lsad.data import UNSAFE_POOLS
from hf_lsad.data.store import load_activations
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.calibration import coupled_budget_sample, fit_affine_calibration, importance_weights
from hf_lsad.guard.threshold import fpr_threshold

PAPER_BUDGETS = (3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 2e-2)
SEEDS = (0, 1, 2, 3, 4)
GUARDS = {
    "FreqMask-KM": "freqmask-km",
    "LearnedMask (Stage 1 only)": "learned-mask",
    "LearnedMask-LoRA": "learned-mask-lora",
}
RESULTS = Path(__file__).parent / "results"


def metrics(safe: np.ndarray, ood: np.ndarray, unsafe: np.ndarray) -> dict[str, float]:
    threshold = fpr_threshold(torch.from_numpy(safe), 0.05)
    return {
        "auroc": auroc(np.concatenate([safe, ood]), unsafe),
        "recall_at_5fpr": flag_rate(unsafe, threshold),
        "benign_ood_fpr": flag_rate(ood, threshold),
    }


def evaluate_guard(guard: SafetyGuard, groups: dict[str, torch.Tensor], budgets: list[float]) -> dict:
    with torch.no_grad():
        outputs = {g: guard(acts) for g, acts in groups.items()}
    scores = {g: o.scores.double().numpy() for g, o in outputs.items()}
    clusters = {g: o.clusters.numpy() for g, o in outputs.items()}
    n_clusters = guard.detector.config.kmeans.n_clusters
    table = {}
    for budget in budgets:
        per_seed: dict[str, list[float]] = {}
        lambdas, negative_slopes = [], []
        for seed in SEEDS:
            split = coupled_budget_sample({g: len(s) for g, s in scores.items()}, budget, seed)
            names = np.concatenate([[g] * len(split[g][0]) for g in scores])
            calibrations = {
                kind: fit_affine_calibration(
                    np.concatenate([scores[g][split[g][0]] for g in scores]),
                    np.concatenate([clusters[g][split[g][0]] for g in scores]),
                    (names == "unsafe").astype(float),
                    importance_weights(names, budget),
                    n_clusters,
                    seed=seed,
                    standardize=kind == "after",
                )
                for kind in ("after", "after_raw_units")
            }
            lambdas.append(calibrations["after"].lam)
            negative_slopes.append(sum(a < 0 for a in calibrations["after"].slopes))

            def evaluation(g: str, kind: str, split=split, calibrations=calibrations) -> np.ndarray:
                rows = split[g][1]
                if kind == "before":
                    return scores[g][rows]
                s, c = torch.from_numpy(scores[g][rows]), torch.from_numpy(clusters[g][rows])
                return calibrations[kind].logits(s, c).numpy()

            for kind in ("before", "after", "after_raw_units"):
                values = metrics(*(evaluation(g, kind) for g in ("safe", "benign_ood", "unsafe")))
                for key, value in values.items():
                    per_seed.setdefault(f"{kind}/{key}", []).append(value)
        table[f"{budget:g}"] = {
            "labelled": {g: len(split[g][0]) for g in scores},
            "selected_lambdas": lambdas,
            "negative_slopes": negative_slopes,
            **{key: dict(zip(("mean", "std"), mean_std(values))) for key, values in per_seed.items()},
        }
        print(f"{guard.config.method} p={budget:g}", json.dumps(table[f"{budget:g}"]), flush=True)
    return table


def markdown(results: dict, command: str, paper: list[float]) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "Mean (std) over 5 seeds. AUROC: negatives = evaluation safe + benign-OOD; recall and benign-OOD FPR "
        "at the 5% FPR threshold of the evaluation safe rows. `*` marks budgets outside the paper's grid. "
        "before -> after (standardised scores, the default) [after in the paper's raw-score units].",
        "",
        "| method | p | labelled (safe / unsafe / OOD) | AUROC | recall@5% safe FPR | benign-OOD FPR | neg. slopes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, table in results.items():
        for budget, row in table.items():
            cells = []
            for key in ("auroc", "recall_at_5fpr", "benign_ood_fpr"):
                before, after, raw = row[f"before/{key}"], row[f"after/{key}"], row[f"after_raw_units/{key}"]
                cells.append(
                    f"{before['mean']:.3f} ({before['std']:.3f}) -> {after['mean']:.3f} ({after['std']:.3f}) "
                    f"[{raw['mean']:.3f}]"
                )
            n = row["labelled"]
            mark = "" if float(budget) in paper else "*"
            lines.append(
                f"| {name} | {budget}{mark} | {n['safe']} / {n['unsafe']} / {n['benign_ood']} | "
                + " | ".join(cells)
                + f" | {np.mean(row['negative_slopes']):.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", type=Path, default=Path("artifacts/smollm2"))
    parser.add_argument("--position", default="prompt_last")
    parser.add_argument("--extra-budgets", type=float, nargs="*", default=[0.05, 0.1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.stores / args.position
    safe = load_activations(folder / "safe").activations
    unsafe_pools = [p for p in UNSAFE_POOLS if (folder / p / "index.json").is_file()]
    groups = {
        "unsafe": torch.cat([load_activations(folder / p).activations for p in unsafe_pools]),
        "benign_ood": load_activations(folder / "benign_ood").activations,
    }
    sizes = {g: len(a) for g, a in groups.items()}
    paper = [p for p in PAPER_BUDGETS if min(round(p * n) for n in sizes.values()) >= 1]
    results, holdout_size = {}, None
    for name, sub in GUARDS.items():
        guard = SafetyGuard.from_pretrained(folder / "guards" / sub)
        holdout = split_safe(len(safe), guard.config.n_holdout / len(safe), guard.config.seed).holdout
        holdout_size = len(holdout)
        results[name] = evaluate_guard(guard, {"safe": safe[holdout], **groups}, paper + list(args.extra_budgets))
    command = ("python benchmarks/archive/task-prompt-study/smollm2_calibration.py " + " ".join(sys.argv[1:])).strip()
    RESULTS.mkdir(exist_ok=True)
    report = {
        "command": command,
        "position": args.position,
        "unsafe_pools": unsafe_pools,
        "sizes": {"safe_holdout": holdout_size, **sizes},
        "paper_budgets_kept": paper,
        "extra_budgets": list(args.extra_budgets),
        "seeds": list(SEEDS),
        "results": results,
    }
    (RESULTS / "smollm2_calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "smollm2_calibration.md").write_text(markdown(results, command, paper))
    print(markdown(results, command, paper))


if __name__ == "__main__":
    main()
