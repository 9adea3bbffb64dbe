"""Leave-one-domain-out (issue 13, item 2): the unseen-domain false-positive rate of each method.

For each benign domain D with at least ``--min-rows`` rows (``chat`` as one domain: all
rows of the chat pool; benign_ood's sarcasm_headlines, wikihow_goals, sports, chitchat;
each task family of the ``safe`` pool), every method is fitted on the fit split of all
benign domains except D, its threshold is set at 5% FPR on the held-out (validation
split) rows of the other benign domains, and the script reports

* D's flag rate over all of D's rows (none of them fitted or used for the threshold): its
  *unseen-domain FPR*;
* the TPR per unsafe category at that threshold, on the test split (harmful, harmful_vauban,
  toxic, jailbreak);
* per method, the median and the worst unseen-domain FPR over the domains.

Methods: FreqMask-KM (the configuration selected by ``chat_study.py``, on SAE codes; also with the
paper's per-cluster calibration from the 1% labelled validation sample without D's rows, as the
shipped guard is calibrated: "FreqMask-KM (calibrated)", its threshold on the calibrated logits),
LearnedMask-LoRA (K=20; Stage 1 only with ``--learned-stage1-only``), Mahalanobis, GMM and
the kNN distance (``hf_lsad.detectors.knn``; raw activations). The SAE: with ``--refit-sae`` a fresh SAE is trained
without D for every
D (as the deployed pipeline would); without it, the SAE of the full benign fit split is
shared (it has seen D's fit rows: only the detector is fitted without D). The JSON records
which. Splits and ids: ``benchmarks/archive/chat-study/study_data.py``.

    PYTHONPATH=. python benchmarks/archive/chat-study/leave_one_domain_out.py --model smollm2 --position prompt_last --layer 20
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import study_data as sd
import torch
from chat_study import CodesAsInput, fit_freqmask, freqmask_variant, l1_for, score_detector

from hf_lsad.data.store import TensorRows
from hf_lsad.detectors import detector_class
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.detectors.gmm import GMMConfig
from hf_lsad.detectors.knn import KNNConfig
from hf_lsad.detectors.learned_mask import LearnedMaskConfig
from hf_lsad.detectors.mahalanobis import MahalanobisConfig
from hf_lsad.guard.calibration import fit_affine_calibration, importance_weights

CATEGORIES = ("harmful", "harmful_vauban", "toxic", "jailbreak")


def lodo_metrics(scores: np.ndarray, rows: sd.Rows, domain: str) -> dict[str, Any]:
    held_in = rows.m(sd.BENIGN_POOLS, "val") & (rows.group != domain)
    thr = sd.threshold_at(scores[held_in])
    in_d = rows.m(sd.BENIGN_POOLS) & (rows.group == domain)
    out = {
        "threshold": thr,
        "unseen_fpr": float((scores[in_d] > thr).mean()),
        "n_domain": int(in_d.sum()),
        "held_in_test_fpr": float((scores[rows.m(sd.BENIGN_POOLS, "test") & (rows.group != domain)] > thr).mean()),
    }
    for cat in CATEGORIES:
        mask = rows.m(cat, "test")
        if mask.any():
            out[f"tpr_{cat}"] = float((scores[mask] > thr).mean())
    return out


def calibrated_without(
    scores: np.ndarray, clusters: np.ndarray, n_clusters: int, rows: sd.Rows, domain: str
) -> np.ndarray:
    """The paper's per-cluster calibration (1% labelled validation sample, seed 0) with D's rows left out of the
    sample, as the shipped guard is calibrated; the calibrated logits take the scores' place."""
    index, labels, groups = sd.calibration_sample(rows, seed=0)
    keep = rows.group[index] != domain
    cal = fit_affine_calibration(
        scores[index][keep],
        clusters[index][keep],
        labels[keep],
        importance_weights([g for g, k in zip(groups, keep) if k], sd.BUDGET),
        n_clusters,
        seed=0,
    )
    return cal.logits(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(clusters)).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--position", default="prompt_last")
    parser.add_argument("--layer", type=int, default=20)
    parser.add_argument("--d-sae", type=int, default=2304)
    parser.add_argument("--l1-rel", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--K", type=int, default=20, help="FreqMask-KM clusters")
    parser.add_argument("--mask", type=int, default=100, help="FreqMask-KM mask size")
    parser.add_argument("--scope", default="global", choices=["global", "local"])
    parser.add_argument("--gmm-components", type=int, default=5)
    parser.add_argument("--ridge", type=float, default=1e-5)
    parser.add_argument("--knn-k", type=int, default=10)
    parser.add_argument(
        "--methods", nargs="+", default=["FreqMask-KM", "LearnedMask-LoRA", "Mahalanobis", "GMM", "kNN"]
    )
    parser.add_argument("--learned-stage1-only", action="store_true")
    parser.add_argument("--refit-sae", action="store_true")
    parser.add_argument("--min-rows", type=int, default=150)
    parser.add_argument("--domains", nargs="*", default=None, help="only these domains (default: all with >= min rows)")
    parser.add_argument("--name", default="leave_one_domain_out")
    args = parser.parse_args()
    # threads: torch's default (OMP_NUM_THREADS when set); one per job when several share the 2 cores
    start = time.time()
    rows = sd.load_rows(args.model, args.position, args.layer)
    benign = rows.m(sd.BENIGN_POOLS)
    groups, counts = np.unique(rows.group[benign], return_counts=True)
    domains = [g for g, n in zip(groups, counts) if n >= args.min_rows]
    if args.domains:
        domains = [d for d in domains if d in args.domains]
    key = f"{args.model}/{args.position}/layer{args.layer}"
    record: dict[str, Any] = {
        "env": sd.environment(),
        "settings": vars(args),
        "protocol": sd.__doc__,
        "domain_rows": {g: int(n) for g, n in zip(groups, counts)},
        "domains": domains,
        "sae_refitted_without_domain": bool(args.refit_sae),
        "results": {},
    }
    l1 = l1_for(rows, args.l1_rel)
    if not args.refit_sae:
        shared_sae, record["shared_sae"] = sd.get_sae(rows, key, args.d_sae, l1, args.epochs)
        shared_codes = sd.encode(shared_sae, rows.X)

    def save() -> None:
        record["wall_seconds"] = round(time.time() - start)
        summary = {}
        for method in args.methods:
            fprs = [
                record["results"][d][method]["unseen_fpr"] for d in record["results"] if method in record["results"][d]
            ]
            if fprs:
                worst = max(record["results"], key=lambda d: record["results"][d].get(method, {}).get("unseen_fpr", -1))
                summary[method] = {
                    "median_unseen_fpr": float(np.median(fprs)),
                    "worst_unseen_fpr": float(max(fprs)),
                    "worst_domain": worst,
                    "n_domains": len(fprs),
                }
        record["summary"] = summary
        sd.write_json(sd.RESULTS / f"{args.name}.json", record)
        (sd.RESULTS / f"{args.name}.md").write_text(markdown(record, args.methods))

    for domain in domains:
        fit_mask = rows.fit_mask & (rows.group != domain)
        fit_rows = torch.from_numpy(np.flatnonzero(fit_mask))
        if args.refit_sae:
            sae, _ = sd.get_sae(rows, key, args.d_sae, l1, args.epochs, fit_mask=fit_mask)
            codes = sd.encode(sae, rows.X)
        else:
            sae, codes = shared_sae, shared_codes
        out = record["results"].setdefault(domain, {})
        for method in args.methods:
            t = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] without {domain}: {method}", flush=True)
            if method in ("FreqMask-KM", "FreqMask-KM (calibrated)"):
                det = freqmask_variant(fit_freqmask(codes, fit_rows, args.K), args.mask, args.scope)
                scores, clusters = score_detector(det, codes, CodesAsInput())
                if method == "FreqMask-KM (calibrated)":
                    scores = calibrated_without(scores, clusters, det.n_clusters, rows, domain)
            elif method == "LearnedMask-LoRA":
                config = LearnedMaskConfig(
                    kmeans=KMeansConfig(n_clusters=20, seed=0),
                    min_cluster_size=20,
                    lora_min_cluster_size=50,
                    stage1_only=args.learned_stage1_only,
                )
                det = detector_class("learned-mask-lora")(config, rows.X.shape[1], sae.config.d_sae)
                det.fit_rows(TensorRows(rows.X), sae, rows=fit_rows, progress=False)
                scores, _ = score_detector(det, rows.X, sae, batch=1024)
            else:
                config, name = {
                    "Mahalanobis": (MahalanobisConfig(ridge=args.ridge), "mahalanobis"),
                    "GMM": (GMMConfig(n_components=args.gmm_components), "gmm"),
                    "kNN": (KNNConfig(k=args.knn_k), "knn"),
                }[method]
                det = detector_class(name)(config, rows.X.shape[1], None)
                det.fit_rows(TensorRows(rows.X), None, rows=fit_rows, progress=False)
                scores, _ = score_detector(det, rows.X, None)
            out[method] = {**lodo_metrics(scores, rows, domain), "seconds": round(time.time() - t, 1)}
            save()
    record["status"] = "complete"
    save()
    print((sd.RESULTS / f"{args.name}.md").read_text())


def markdown(record: dict[str, Any], methods: list[str]) -> str:
    s = record["settings"]
    lines = [
        f"# Leave-one-domain-out: {s['model']} {s['position']} layer {s['layer']}",
        "",
        f"Command: `{record['env']['command']}` ({record['env']['utc']}, wall {record.get('wall_seconds')} s). "
        f"Status: {record.get('status', 'PARTIAL')}. SAE refitted without D: {record['sae_refitted_without_domain']}.",
        "",
        "Cells: unseen-domain FPR (flag rate over all of D's rows at the threshold giving 5% FPR on the validation "
        "rows "
        "of the other benign domains) / TPR harmful / TPR harmful_vauban / TPR toxic / TPR jailbreak (test split).",
        "",
        "| domain (rows) | " + " | ".join(methods) + " |",
        "|---|" + "---|" * len(methods),
    ]
    for d, res in record["results"].items():
        cells = []
        for m in methods:
            r = res.get(m)
            cells.append(
                "-"
                if r is None
                else " / ".join(
                    sd.fmt(r.get(k))
                    for k in ("unseen_fpr", "tpr_harmful", "tpr_harmful_vauban", "tpr_toxic", "tpr_jailbreak")
                )
            )
        lines.append(f"| {d} ({record['domain_rows'][d]}) | " + " | ".join(cells) + " |")
    lines += ["", "| method | median unseen-domain FPR | worst (domain) | domains |", "|---|---|---|---|"]
    for m, v in record.get("summary", {}).items():
        lines.append(
            f"| {m} | {sd.fmt(v['median_unseen_fpr'])} | {sd.fmt(v['worst_unseen_fpr'])} ({v['worst_domain']}) | "
            f"{v['n_domains']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
