"""How much a calibrated guard depends on WHICH rows were labelled, and what averaging over clusterings buys (issue 13).

The shipped guard is calibrated on one 1% draw (``study_data.calibration_sample``, seed 0: 16 unsafe
rows). This benchmark repeats the calibration for ``--draws`` draws of the same budget and reports, per draw,
on the same protocol as the chat study (``benchmarks/archive/chat-study/study_data.py``):

* **single**: the shipped configuration (one k-means clustering, seed 0), calibrated on the draw;
* **ensemble**: ``--ensemble`` clusterings (k-means seeds 0..E-1) on the same SAE codes, each calibrated on
  the SAME labelled rows, their calibrated probabilities averaged (no extra labels);
* **probe at the same budget** (supervised, for reference): a logistic regression trained on the draw's
  labelled rows alone (``study_data.probe_scores(labelled=...)``), on raw activations and on the SAE codes:
  what the same 16 unsafe labels buy without the detector;

validation and test AUROC (harmful vs chat), TPR at 5% chat FPR, the test-chat flag rate, and the verdict on
the README's demo harmful prompt (a test row: never fitted, labelled or used for a threshold). The supervised
probe's verdict on the same row is given for reference. Benchmark only: the package ships no ensemble.
Also reported: where each group's rows fall among the clusters (``occupancy``). Variants: ``--stratified``,
``--unsafe-pools toxic jailbreak`` (a harm category that no label covers), ``--budget B`` (a label-budget
curve), ``--model qwen05``, ``--mean-pooled``; each results file names its command in its header.

    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. python benchmarks/archive/chat-study/calibration_variance.py \
        --layer 12 --K 20 --mask 100 --scope global --draws 10 --ensemble 10
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import study_data as sd
import torch
from chat_study import CodesAsInput, fit_freqmask, freqmask_variant, l1_for, local_residual_scores, score_detector

from hf_lsad.evaluation.diagnostics import clusters_holding
from hf_lsad.guard.calibration import fit_affine_calibration, importance_weights

RESULTS = Path(__file__).parent / "results"
METRICS = ("val_auroc_chat", "val_tpr5_chat", "auroc_chat", "tpr5_chat", "chat_test_flag_rate")


def member_scores(
    codes, rows, sae, K: int, mask: int, scope: str, score: str, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(score, cluster) per row of one FreqMask-KM clustering (k-means ``seed``)."""
    det = freqmask_variant(
        fit_freqmask(codes, torch.from_numpy(np.flatnonzero(rows.fit_mask)), K, seed=seed), mask, scope
    )
    scores, clusters = score_detector(det, codes, CodesAsInput())
    if score == "off_support_l1":
        scores, _ = local_residual_scores(det, codes, clusters, rows.X, sae)
    return scores, clusters


def verdicts(values: np.ndarray, rows: sd.Rows, drawn: np.ndarray, demo: int | None) -> dict[str, float]:
    """The draw's metrics; ``demo``: index of the README's harmful demo row, None where the store lacks it."""
    full = sd.headline(values, rows, exclude=drawn)
    out = {k: full[k] for k in METRICS}
    if demo is not None:
        out["demo_flagged"] = float(values[demo] > full["threshold"])
    return out


def occupancy(clusters: np.ndarray, rows: sd.Rows, K: int) -> dict[str, dict[str, float]]:
    """Per group: the fewest clusters holding half its rows, and the share of chat and task rows in those clusters.

    The count of the paper's appendix B ("between 2 and 9 clusters are enough" for half of the unsafe points):
    the concentration that lets a per-cluster calibration learn where unsafe inputs fall.
    """
    groups = {
        "harmful requests": rows.m("harmful") | rows.m("harmful_vauban"),
        "toxic": rows.m("toxic"),
        "jailbreak": rows.m("jailbreak"),
        "chat": rows.m("chat"),
        "task prompts": rows.m("safe"),
    }
    out = {}
    for name, mask in groups.items():
        if not mask.any():
            continue
        counts = np.bincount(clusters[mask], minlength=K)
        need = clusters_holding(torch.from_numpy(counts / counts.sum()))
        inside = np.isin(clusters, np.argsort(-counts, kind="stable")[:need])
        out[name] = {
            "rows": int(mask.sum()),
            "clusters_for_half": need,
            "chat_share": float((inside & rows.m("chat")).sum() / rows.m("chat").sum()),
            "task_share": float((inside & rows.m("safe")).sum() / rows.m("safe").sum()),
        }
    return out


def summary(per_draw: list[dict[str, float]]) -> dict[str, Any]:
    keys = METRICS + (("demo_flagged",) if "demo_flagged" in per_draw[0] else ())
    return {
        k: {
            "median": float(np.median([d[k] for d in per_draw])),
            "min": float(min(d[k] for d in per_draw)),
            "max": float(max(d[k] for d in per_draw)),
        }
        for k in keys
    } | {"demo_flagged_draws": int(sum(d.get("demo_flagged", 0) for d in per_draw))}


def markdown(record: dict[str, Any]) -> str:
    s = record["settings"]
    position = "prompt_mean (benchmark only)" if s["mean_pooled"] else "prompt_last"
    pools = s.get("unsafe_pools", list(sd.SPLIT_UNSAFE_POOLS))
    drawn_from = "1% of each unsafe pool" if s["stratified"] else "drawn from all unsafe pools together"
    if tuple(pools) != sd.SPLIT_UNSAFE_POOLS:
        drawn_from = f"drawn from the {' and '.join(pools)} pools only"
        drawn_from += "" if "harmful" in pools else ": no label covers harmful requests"
    lines = [
        f"# Calibration draws and clustering ensembles: {s.get('model', 'smollm2')} {position} layer {s['layer']}",
        "",
        f"Command: `{record['env']['command']}` ({record['env']['utc']}, wall {record['wall_seconds']} s).",
        "",
        f"FreqMask-KM K={s['K']}, mask {s['mask']} ({s['scope']}), score {s['score']}; SAE {record['sae']['d_sae']} "
        f"(L1 {record['sae']['l1']}). {s['draws']} labelled draws of the {100 * s.get('budget', sd.BUDGET):g}% budget "
        f"({record['n_labelled_unsafe']} unsafe rows each, {drawn_from}, "
        f"validation split only); ensemble = {s['ensemble']} "
        "k-means seeds calibrated on the same draw, probabilities averaged. Test rows only in the test columns.",
        "",
        "| draw | labelled unsafe (harmful / toxic / jailbreak) | clusters with labelled unsafe | "
        "labelled unsafe in the demo row's cluster | single: val AUROC | test AUROC | TPR@5% chat | chat flag rate | "
        "demo flagged | "
        "ensemble: val AUROC | test AUROC | TPR@5% chat | chat flag rate | demo flagged |",
        "|---" * 14 + "|",
    ]
    for i, (a, b, n) in enumerate(zip(record["single"], record["ensemble"], record["labelled_unsafe"])):
        cells = [
            " / ".join(str(v) for v in n.values()),
            f"{a['clusters_with_labelled_unsafe']} of {s['K']}",
            sd.fmt(a["labelled_unsafe_in_demo_cluster"]),
        ]
        cells += [
            sd.fmt(x.get(k))
            for x in (a, b)
            for k in ("val_auroc_chat", "auroc_chat", "tpr5_chat", "chat_test_flag_rate", "demo_flagged")
        ]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Supervised probe trained on the same labelled draw only (no detector):",
        "",
        "| draw | raw: val AUROC | test AUROC | TPR@5% chat | chat flag rate | demo flagged | "
        "SAE codes: val AUROC | test AUROC | TPR@5% chat | chat flag rate | demo flagged |",
        "|---" * 11 + "|",
    ]
    for i, (a, b) in enumerate(zip(record["probe_budget_raw"], record["probe_budget_codes"])):
        cells = [
            sd.fmt(x.get(k))
            for x in (a, b)
            for k in ("val_auroc_chat", "auroc_chat", "tpr5_chat", "chat_test_flag_rate", "demo_flagged")
        ]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    for name in ("single", "ensemble", "probe_budget_raw", "probe_budget_codes"):
        m = record["summary"][name]
        lines.append(
            f"\n**{name}**: test AUROC median {m['auroc_chat']['median']:.3f} (range {m['auroc_chat']['min']:.3f}-"
            f"{m['auroc_chat']['max']:.3f}); TPR@5% chat median {m['tpr5_chat']['median']:.3f} (range "
            f"{m['tpr5_chat']['min']:.3f}-{m['tpr5_chat']['max']:.3f}); "
            + (
                f"demo prompt flagged in {m['demo_flagged_draws']} of {s['draws']} draws."
                if record["has_demo"]
                else "the demo prompt is not in this store."
            )
        )
    lines += [
        "",
        f"Where each group falls (the single clustering, all splits): the fewest of the {s['K']} clusters that hold "
        "half of its rows, and the share of all chat and task-prompt rows in those clusters.",
        "",
        "| group | rows | clusters for half | chat rows in them | task rows in them |",
        "|---" * 5 + "|",
    ]
    lines += [
        f"| {name} | {o['rows']} | {o['clusters_for_half']} | {o['chat_share']:.1%} | {o['task_share']:.1%} |"
        for name, o in record["occupancy"].items()
    ]
    if record["has_demo"]:
        lines.append(
            f"\nSupervised probe (raw activations, trained on validation rows): demo prompt flagged = "
            f"{bool(record['probe_demo_flagged'])}."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(sd.MODEL_DIRS))
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--K", type=int, default=20)
    parser.add_argument("--mask", type=int, default=100)
    parser.add_argument("--scope", default="global", choices=["global", "local"])
    parser.add_argument("--score", default="centroid_l1", choices=["centroid_l1", "off_support_l1"])
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument(
        "--budget",
        type=float,
        default=sd.BUDGET,
        help="labelled fraction of the unsafe rows (the protocol's 1%%; other values for a label-budget curve)",
    )
    parser.add_argument("--ensemble", type=int, default=10)
    parser.add_argument("--d-sae", type=int, default=2304)
    parser.add_argument("--l1-rel", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument(
        "--stratified",
        action="store_true",
        help="1%% of EACH unsafe pool per draw (default: 1%% of all, drawn together)",
    )
    parser.add_argument(
        "--unsafe-pools",
        nargs="+",
        default=list(sd.SPLIT_UNSAFE_POOLS),
        choices=sd.SPLIT_UNSAFE_POOLS,
        help="draw the labelled unsafe rows from these pools only (a harm category no label covers)",
    )
    parser.add_argument(
        "--mean-pooled",
        action="store_true",
        help="the rows of benchmarks/archive/chat-study/mean_pool.py (collected with 2 shards)",
    )
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    if args.mean_pooled and args.model != "smollm2":
        parser.error("--mean-pooled rows exist for smollm2 only (benchmarks/archive/chat-study/mean_pool.py)")
    start = time.time()
    record: dict[str, Any] = {"env": sd.environment(), "settings": dict(vars(args))}
    if args.mean_pooled:
        from mean_pool import mean_pooled_rows

        rows, position = mean_pooled_rows(args.layer, num_shards=2), "prompt_mean"
    else:
        rows, position = sd.load_rows(args.model, "prompt_last", args.layer), "prompt_last"
    sae, record["sae"] = sd.get_sae(
        rows, f"{args.model}/{position}/layer{args.layer}", args.d_sae, l1_for(rows, args.l1_rel), args.epochs
    )
    codes = sd.encode(sae, rows.X)
    demo_rows = np.flatnonzero(rows.demo & (rows.pool == "harmful"))
    demo = int(demo_rows[0]) if len(demo_rows) else None
    record["has_demo"] = demo is not None
    members = [
        member_scores(codes, rows, sae, args.K, args.mask, args.scope, args.score, seed)
        for seed in range(args.ensemble)
    ]
    record["occupancy"] = occupancy(members[0][1], rows, args.K)
    record["single"], record["ensemble"], record["labelled_unsafe"] = [], [], []
    record["probe_budget_raw"], record["probe_budget_codes"] = [], []
    for draw in range(args.draws):
        index, labels, groups = sd.calibration_sample(
            rows, draw, stratified=args.stratified, unsafe_pools=tuple(args.unsafe_pools), budget=args.budget
        )
        weights = importance_weights(groups, args.budget)
        drawn = np.zeros(len(rows.ids), bool)
        drawn[index] = True
        probabilities = []
        for scores, clusters in members:
            cal = fit_affine_calibration(scores[index], clusters[index], labels, weights, args.K, seed=draw)
            probabilities.append(
                cal.probabilities(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(clusters)).numpy()
            )
        record["single"].append(verdicts(probabilities[0], rows, drawn, demo))
        record["ensemble"].append(verdicts(np.mean(probabilities, 0), rows, drawn, demo))
        for name, features in (("probe_budget_raw", rows.X), ("probe_budget_codes", codes)):
            record[name].append(
                verdicts(sd.probe_scores(features.numpy(), rows, labelled=(index, labels)), rows, drawn, demo)
            )
        pools = rows.pool[index[labels == 1]]
        record["labelled_unsafe"].append({pool: int((pools == pool).sum()) for pool in sd.SPLIT_UNSAFE_POOLS})
        unsafe_clusters = members[0][1][
            index[labels == 1]
        ]  # the single clustering's clusters of the labelled unsafe rows
        record["single"][-1]["clusters_with_labelled_unsafe"] = len(set(unsafe_clusters.tolist()))
        record["single"][-1]["labelled_unsafe_in_demo_cluster"] = (
            int((unsafe_clusters == members[0][1][demo]).sum()) if demo is not None else None
        )
        print(
            f"[{time.strftime('%H:%M:%S')}] draw {draw}: single {record['single'][-1]} ensemble "
            f"{record['ensemble'][-1]}",
            flush=True,
        )
    record["n_labelled_unsafe"] = int(labels.sum())
    record["summary"] = {
        name: summary(record[name]) for name in ("single", "ensemble", "probe_budget_raw", "probe_budget_codes")
    }
    probe = sd.probe_scores(rows.X.numpy(), rows)
    record["probe_demo_flagged"] = (
        float(probe[demo] > sd.headline(probe, rows)["threshold"]) if demo is not None else None
    )
    record["wall_seconds"] = round(time.time() - start)
    variant = ("_prompt_mean" if args.mean_pooled else "") + ("_stratified" if args.stratified else "")
    if tuple(args.unsafe_pools) != sd.SPLIT_UNSAFE_POOLS:
        variant += "_labels_" + "_".join(args.unsafe_pools)
    if args.budget != sd.BUDGET:
        variant += f"_budget{args.budget:g}"
    name = args.name or f"calibration_variance_{args.model}{variant}_l{args.layer}_{args.score}"
    sd.write_json(RESULTS / f"{name}.json", record)
    (RESULTS / f"{name}.md").write_text(markdown(record))
    print(markdown(record))


if __name__ == "__main__":
    main()
