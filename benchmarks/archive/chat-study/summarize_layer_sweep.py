"""Summarise the extraction-layer sweep: one row per layer from each ``layer*/results.json``.

    python benchmarks/summarize_layer_sweep.py reports/smollm2/layer_sweep

Reads the reports that ``bash benchmarks/archive/task-prompt-study/smollm2_report.sh sweep`` wrote with
``hf-lsad evaluate`` (one folder per layer) and writes ``layer_sweep.md`` and
``layer_sweep.json`` next to that folder: per layer and method, the test AUROC
and TPR@5%FPR per category and their mean (selected on validation), the
selected settings, the benign-OOD FPR, the layer's SAE L0 / FVE and the d90
diagnostics of FreqMask-KM. Numbers are copied from the reports, not recomputed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def layer_rows(folder: Path) -> list[dict]:
    """One dict per (layer, method) from the per-layer reports, in layer order."""
    rows = []
    reports = sorted(folder.glob("layer*/results.json"), key=lambda p: int(re.sub(r"\D", "", p.parent.name)))
    for path in reports:
        report = json.loads(path.read_text())
        layer = report["hook"]["layer"]
        sae = report.get("sae") or {}
        diagnostics = report["results"]["diagnostics"]
        for name, method in report["results"]["methods"].items():
            test = method["test"]
            row = {
                "layer": layer,
                "method": name,
                "categories": report["categories"],
                "auroc": {c: test[c]["auroc"][0] for c in [*report["categories"], "mean"]},
                "tpr_at_5fpr": {c: test[c]["tpr_at_fpr"][0] for c in [*report["categories"], "mean"]},
                "benign_ood_fpr": test.get("benign_ood_fpr", [None])[0],
                "selected": method["selected"],
                "validation_auroc": method["selected_validation_auroc"],
                "sae_l0": sae.get("validation", {}).get("l0"),
                "sae_fve": sae.get("validation", {}).get("fraction_variance_explained"),
                "sae_l1": (sae.get("training") or {}).get("l1_coefficient"),
            }
            if name in diagnostics:
                dims = diagnostics[name]["effective_dimension"]
                row["d90"] = {
                    "raw_sae": dims["raw_sae"],
                    "global_mask": dims["global_mask"],
                    "per_cluster_median": dims["per_cluster_summary"]["median"],
                    "per_cluster_eligible": dims["per_cluster_eligible"],
                }
            rows.append(row)
    return rows


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "No layer reports found.\n"
    categories = rows[0]["categories"]
    lines = [
        "# SmolLM2-135M-Instruct: extraction-layer sweep (prompt_last)",
        "",
        "Regenerate with `bash benchmarks/archive/task-prompt-study/smollm2_report.sh sweep` (stores from `python "
        "benchmarks/collect_layer_sweep.py`).",
        "Each layer: a fresh SAE (d_sae 2304, 30 epochs, L1 scaled by the layer's activation RMS relative to layer 20) "
        "on the safe fit split; hyperparameters selected on the validation split; test metrics, one seed. "
        "Full reports per layer in `layer_sweep/layer*/report.md`.",
        "",
        "| layer | method | "
        + " | ".join(f"{c} AUROC" for c in categories)
        + " | mean AUROC | mean TPR@5%FPR | benign-OOD FPR | selected | SAE L1 / L0 / FVE"
        + " | d90 raw / global / per-cluster median |",
        "|---:|---|" + "---:|" * (len(categories) + 3) + "---|---|---|",
    ]
    for row in rows:
        d90 = row.get("d90")
        d90_text = (
            f"{d90['raw_sae']} / {d90['global_mask']} / "
            + (
                f"{d90['per_cluster_median']:.1f} ({d90['per_cluster_eligible']} clusters)"
                if d90["per_cluster_median"] is not None
                else "–"
            )
            if d90
            else "–"
        )
        lines.append(
            f"| {row['layer']} | {row['method']} | "
            + " | ".join(_fmt(row["auroc"][c]) for c in categories)
            + f" | {_fmt(row['auroc']['mean'])} | {_fmt(row['tpr_at_5fpr']['mean'])} | {_fmt(row['benign_ood_fpr'])} | "
            + ", ".join(f"{k}={v}" for k, v in row["selected"].items())
            + f" | {_fmt(row['sae_l1'], 3)} / {_fmt(row['sae_l0'], 1)} / {_fmt(row['sae_fve'], 3)} | {d90_text} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the folder holding layer*/results.json")
    args = parser.parse_args()
    rows = layer_rows(args.folder)
    (args.folder.parent / "layer_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = markdown(rows)
    (args.folder.parent / "layer_sweep.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
