"""The report folder of a grid evaluation: ``results.json``, ``report.md`` (Table-2 layout) and plots."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..guard.card import BENIGN_OOD_WARNING_FPR, benign_ood_warning
from ..version import environment, library_versions
from .diagnostics import save_plots
from .grid import GridConfig
from .protocol import EvalData, make_splits


def package_versions() -> dict[str, str]:
    """Python, platform, threads and the versions of the packages that change the numbers."""
    env = environment()
    return {
        "python": env["python"],
        "platform": env["platform"],
        **library_versions("hf_lsad", "torch", "transformers", "scikit-learn", "faiss", "numpy"),
        "torch_threads": env["torch_threads"],
    }


def _pm(value: Sequence[float]) -> str:
    return f"{value[0]:.3f} ± {value[1]:.3f}"


def _table2(results: Mapping[str, Any], categories: Sequence[str], metric: str, title: str) -> list[str]:
    columns = [*categories, "mean"]
    lines = [
        f"**{title}** (↑)",
        "",
        "| Method | Local | " + " | ".join(columns) + " |",
        "|---|:-:|" + "---:|" * len(columns),
    ]
    methods = results["methods"]
    unsupervised = [name for name, m in methods.items() if not m["supervised"]]
    ranks: dict[str, list[str]] = {}
    for column in columns:
        ranked = sorted(unsupervised, key=lambda n: -methods[n]["test"][column][metric][0])
        ranks[column] = ranked[:2]
    for name in [n for n, m in methods.items() if m["supervised"]] + unsupervised:
        m = methods[name]
        cells = []
        for column in columns:
            cell = _pm(m["test"][column][metric])
            if not m["supervised"] and ranks[column] and name == ranks[column][0]:
                cell = f"**{cell}**"
            elif not m["supervised"] and len(ranks[column]) > 1 and name == ranks[column][1]:
                cell = f"<u>{cell}</u>"
            cells.append(cell)
        label = f"{name} (SUPERVISED reference)" if m["supervised"] else name
        lines.append(f"| {label} | {'●' if m['local'] else '–'} | " + " | ".join(cells) + " |")
    return lines


def _settings(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


def render_report(report: Mapping[str, Any]) -> str:
    """The Markdown report of :func:`write_report`'s ``results.json`` content."""
    results, protocol = report["results"], report["protocol"]
    methods = results["methods"]
    categories = report["categories"]
    fpr = protocol["target_fpr"]
    lines = [
        f"# {report['title']}",
        "",
        "Regenerate with:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Hook point: `{report['hook'].get('base_model')}` {report['hook'].get('layer_module')} "
        f"({report['hook'].get('position')}). Rows: " + ", ".join(f"{k} {v}" for k, v in report["rows"].items()) + ".",
        "",
        "## Protocol",
        "",
        protocol["text"],
        "",
        "## Main results (Table 2 layout)",
        "",
        f"Test split; mean ± sample std over seeds {report['seeds']} (deterministic methods run once, std 0). "
        f"Columns are unsafe categories and their mean. Bold: best unsupervised, underlined: second; "
        f"the supervised linear probe is a reference trained on unsafe labels and is excluded from the ranking.",
        "",
        *_table2(results, categories, "auroc", "AUROC"),
        "",
        *_table2(results, categories, "tpr_at_fpr", f"TPR@{fpr:.0%}FPR"),
        "",
        *(
            [*_table2(results, categories, "auroc_pooled", "AUROC, pooled negatives (test safe + benign OOD)"), ""]
            if "auroc_pooled" in next(iter(methods.values()))["test"]["mean"]
            else []
        ),
        "## Operating point, benign OOD and selection",
        "",
        f"Benign-OOD FPR: fraction of benign-OOD rows flagged at the threshold that flags {fpr:.0%} of the test safe "
        f"rows. "
        "Pooled AUROC: negatives are test safe + benign-OOD rows. FPR@95%TPR and pooled AUROC are category means.",
        "",
        "| Method | selected (validation) | val. AUROC | benign-OOD FPR | pooled AUROC | FPR@95%TPR | fit s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        test = m["test"]
        ood = _pm(test["benign_ood_fpr"]) if "benign_ood_fpr" in test else "–"
        pooled = _pm(test["mean"]["auroc_pooled"]) if "auroc_pooled" in test["mean"] else "–"
        label = f"{name} (supervised)" if m["supervised"] else name
        lines.append(
            f"| {label} | {_settings(m['selected'])} | {m['selected_validation_auroc']:.3f} | {ood} | {pooled} | "
            f"{_pm(test['mean']['fpr_at_tpr'])} | {m['fit_seconds']:.1f} |"
        )
    warned = [
        (name, m["test"]["benign_ood_fpr"][0])
        for name, m in methods.items()
        if "benign_ood_fpr" in m["test"] and benign_ood_warning(m["test"]["benign_ood_fpr"][0])
    ]
    if warned:
        lines += [
            "",
            f"> **Warning:** {', '.join(f'{name} flags {rate:.0%}' for name, rate in warned)} of benign "
            f"out-of-distribution prompts at the {fpr:.0%}-safe-FPR threshold (more than "
            f"{BENIGN_OOD_WARNING_FPR:.0%}). These scores measure how unlike the safe pool a prompt is; "
            "calibrate per cluster (`hf-lsad calibrate`) or broaden the safe pool before deploying.",
        ]
    if results["ablations"]:
        lines += [
            "",
            "## Ablations",
            "",
            "One field of the selected configuration varied at a time; test metrics "
            f"(seeds {report['ablation_seeds']}). They describe the design space and select nothing.",
            "",
        ]
        for ablation in results["ablations"]:
            lines += [
                f"### {ablation['name']} ({ablation['method']}, `{ablation['key']}`; selected: "
                f"{_settings(ablation['base'])})",
                "",
                "| value | val. AUROC | "
                + " | ".join(f"{c} AUROC" for c in categories)
                + " | mean AUROC | mean TPR@5%FPR |",
                "|---|---:|" + "---:|" * (len(categories) + 2),
            ]
            for row in ablation["rows"]:
                mark = " (selected)" if row["value"] == ablation["selected_value"] else ""
                cells = [f"{row['test'][c]['auroc'][0]:.3f}" for c in categories]
                lines.append(
                    f"| {row['value']}{mark} | {row['validation']['mean']['auroc'][0]:.3f} | "
                    + " | ".join(cells)
                    + f" | {row['test']['mean']['auroc'][0]:.3f} | {row['test']['mean']['tpr_at_fpr'][0]:.3f} |"
                )
            lines.append("")
    for name, diag in results["diagnostics"].items():
        dims, occ = diag["effective_dimension"], diag["occupancy"]
        summary = dims["per_cluster_summary"]
        lines += [
            f"## Diagnostics: {name} ({_settings(diag['settings'])}, seed {diag['seed']})",
            "",
            f"Effective dimension d90 on the safe fit rows: raw SAE {dims['raw_sae']} (of {dims['raw_sae_dim']}), "
            f"global mask {dims['global_mask']} (k={dims['mask_size']}); per cluster (own top-k mask, clusters with "
            f">= {dims['per_cluster_min_size']} members: {dims['per_cluster_eligible']} of "
            f"{dims['per_cluster_total']}): "
            + (
                f"median {summary['median']:.1f}, min {summary['min']:.0f}, max {summary['max']:.0f}."
                if summary["n"]
                else "no eligible cluster."
            ),
            "",
            "| set | rows | TV distance to train occupancy | clusters holding half | empty clusters |",
            "|---|---:|---:|---:|---:|",
        ]
        for set_name, entry in occ["sets"].items():
            lines.append(
                f"| {set_name} | {entry['n']} | {entry['tv_to_reference']:.3f} | {entry['clusters_holding_half']} | "
                f"{entry['empty_clusters']} |"
            )
        if "support_overlap" in diag:
            overlap = diag["support_overlap"]
            counts, jac = overlap["counts"], overlap["jaccard_summary"]
            lines += [
                "",
                f"Within-cluster active support (features on > 50% of the population, restricted to the cluster's "
                f"mask; "
                f"test safe vs pooled test unsafe, {overlap['clusters_compared']} clusters with both): both "
                f"{counts['both']}, "
                f"safe only {counts['safe_only']}, unsafe only {counts['unsafe_only']}, neither {counts['neither']}; "
                + (
                    f"Jaccard median {jac['median']:.2f} (min {jac['min']:.2f}, {jac['n']} clusters)."
                    if jac["n"]
                    else "no Jaccard defined."
                ),
            ]
        if "threshold" in diag["scores"]:
            t = diag["scores"]["threshold"]
            lines += [
                "",
                f"Per-cluster scores (full summaries in results.json): of {t['clusters_eligible']} clusters with >= "
                f"{t['min_safe']} "
                f"test safe rows, the global threshold {t['value']:.4g} is above every safe score in "
                f"{t['above_every_safe_score']} "
                f"and below the median safe score in {t['below_median_safe_score']}.",
            ]
        lines.append("")
    lines += ["## Plots", "", report["plots"], "", "## Versions", ""]
    lines += [f"- {k}: {v}" for k, v in report["versions"].items()]
    if report.get("sae"):
        lines += ["", "## SAE", "", "```json", json.dumps(report["sae"], indent=2), "```"]
    return "\n".join(lines) + "\n"


PROTOCOL_TEXT = (
    "Safe rows are cut (seeded) into fit / validation / test ({fit:.0%} / {val:.0%} / {test:.0%}); each unsafe "
    "category "
    "into probe / validation / test ({probe:.0%} / {uval:.0%} / {utest:.0%}). The SAE and every detector are fitted on "
    "the safe fit rows only; the supervised linear probe also sees the unsafe *probe* rows. **Hyperparameters are "
    "selected "
    "on the validation split only**: for each method, the grid point with the highest AUROC of validation safe "
    "(negatives) "
    "vs validation unsafe (positives), averaged over categories and seeds. Test rows and benign-OOD rows select "
    "nothing. "
    "Benign-OOD rows are all used as test negatives."
)


def write_report(
    folder: str | os.PathLike,
    results: Mapping[str, Any],
    *,
    data: EvalData,
    config: GridConfig,
    command: str,
    title: str,
    sae_info: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``results.json``, ``report.md`` (and PNGs when matplotlib is installed) into ``folder``."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    splits = make_splits(len(data.safe), {c: len(x) for c, x in data.unsafe.items()}, config)
    plot_lines = []
    for name, diag in results["diagnostics"].items():
        written, reason = save_plots(diag, path / "plots" / name.lower().replace(" ", "-"))
        files = ", ".join(f"`plots/{name.lower().replace(' ', '-')}/{w}`" for w in written)
        plot_lines.append(f"- {name}: {files or reason}")
    rows: dict[str, int | str] = {
        "safe fit": len(splits.safe_fit),
        "safe validation": len(splits.safe_validation),
        "safe test": len(splits.safe_test),
    }
    for category in data.unsafe:
        rows[f"{category} probe/val/test"] = "/".join(
            str(len(s[category])) for s in (splits.unsafe_probe, splits.unsafe_validation, splits.unsafe_test)
        )
    if data.benign_ood is not None:
        rows["benign_ood"] = len(data.benign_ood)
    utest = 1 - config.unsafe_probe_fraction - config.unsafe_validation_fraction
    report = {
        "title": title,
        "command": command,
        "hook": data.hook,
        "sources": data.sources,
        "categories": list(data.unsafe),
        "rows": rows,
        "seeds": config.seeds,
        "ablation_seeds": config.ablation_seeds or config.seeds[:1],
        "grid": dataclasses.asdict(config),
        "protocol": {
            "target_fpr": config.target_fpr,
            "text": PROTOCOL_TEXT.format(
                fit=1 - config.test_fraction - config.validation_fraction,
                val=config.validation_fraction,
                test=config.test_fraction,
                probe=config.unsafe_probe_fraction,
                uval=config.unsafe_validation_fraction,
                utest=utest,
            ),
        },
        "versions": package_versions(),
        "sae": dict(sae_info) if sae_info else None,
        "plots": "\n".join(plot_lines) or "no diagnostics, no plots",
        "results": results,
    }
    (path / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (path / "report.md").write_text(render_report(report))
    return path
