"""Chat study (issue 13, item 3): request-vs-request separation of the paper's detectors.

One row per method x position x layer: AUROC of harmful requests (bundled harmful test +
all of harmful_vauban) vs held-out chat, AUROC vs held-out task prompts, TPR at 5% chat
FPR, each uncalibrated and with the paper's per-cluster affine calibration at a 1%
labelled budget (validation rows only), next to a SUPERVISED linear probe on the same
features (the ceiling). Protocol (splits, selection, calibration, probe): see
``benchmarks/archive/chat-study/study_data.py``; selection of each method's hyperparameters is by
validation AUROC (harmful val vs chat val), every reported number is on test.

Two benchmark-only scores test the paper's mechanism directly on the FreqMask-KM clusters
and local masks: the SAE code mass outside the row's cluster mask (``off-support L1``) and
the reconstruction residual ``||a - D(m_c * z)||`` with only the mask's features.

Methods (SAE codes from an SAE trained here on the benign fit split of the layer):
FreqMask-KM with a global mask and with local (per-cluster) masks, LearnedMask-LoRA
(``--learned-layers`` only: it is slow on this CPU), Mahalanobis and GMM (raw
activations), kNN-10 (mean cosine distance to the 10 nearest fit rows, centred
features; on raw activations and on SAE codes: implemented here, not in the package).

``--sweep`` runs the mechanism sweep instead, at the given layer(s): SAE width x L1,
FreqMask-KM K x mask size x scope, all uncalibrated and calibrated.

FreqMask-KM variants that share an SAE and K share one k-means fit: the variant's masks
are recomputed from the fitted cluster frequencies and sizes (the same top-k rule as the
package, ties to the lower index) instead of re-running k-means.

    PYTHONPATH=. python benchmarks/archive/chat-study/chat_study.py --model smollm2 --position prompt_last \
        --layers 4 8 12 16 20 24 28 --learned-layers 16 20
    PYTHONPATH=. python benchmarks/archive/chat-study/chat_study.py --model smollm2 --position prompt_last --sweep --layers 20
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np
import study_data as sd
import torch

from hf_lsad.data.store import TensorRows
from hf_lsad.detectors import detector_class
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.detectors.freqmask import FreqMaskConfig
from hf_lsad.detectors.gmm import GMMConfig
from hf_lsad.detectors.learned_mask import LearnedMaskConfig
from hf_lsad.detectors.mahalanobis import MahalanobisConfig


class CodesAsInput:
    """Stands in for the SAE when the detector is handed precomputed SAE codes: ``encode`` is the identity."""

    def encode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes


def _top_k(frequency: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(frequency, descending=True, stable=True).indices
    return order[:k].sort().values


@torch.no_grad()
def score_detector(detector: Any, X: torch.Tensor, sae: Any, batch: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    scores, clusters = [], []
    for i in range(0, len(X), batch):
        out = detector(X[i : i + batch], sae)
        scores.append(out.scores.double())
        clusters.append(out.clusters)
    return torch.cat(scores).numpy(), torch.cat(clusters).numpy()


def fit_freqmask(codes: torch.Tensor, fit_rows: torch.Tensor, K: int, seed: int = 0) -> Any:
    """FreqMask-KM (global mask 100) fitted on precomputed codes; variants are derived from it."""
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=K, seed=seed), mask_size=100, mask_scope="global")
    det = detector_class("freqmask-km")(config, codes.shape[1], codes.shape[1])
    det.fit_rows(TensorRows(codes), CodesAsInput(), rows=fit_rows, progress=False)
    return det


@torch.no_grad()
def freqmask_variant(base: Any, mask_size: int, scope: str) -> Any:
    config = dataclasses.replace(base.config, mask_size=mask_size, mask_scope=scope)
    det = detector_class("freqmask-km")(config, base.d_in, base.d_sae)
    det.centroids.copy_(base.centroids)
    det.cluster_frequency.copy_(base.cluster_frequency)
    det.cluster_sizes.copy_(base.cluster_sizes)
    sizes = base.cluster_sizes.double()
    pooled = (base.cluster_frequency.double() * sizes[:, None]).sum(0) / sizes.sum()
    for c in range(len(sizes)):
        freq = base.cluster_frequency[c].double() if (scope == "local" and sizes[c] > 0) else pooled
        det.mask_indices[c] = _top_k(freq, mask_size)
    return det


@torch.no_grad()
def local_residual_scores(
    det: Any,
    codes: torch.Tensor,
    clusters: np.ndarray,
    X: torch.Tensor,
    sae: Any,
    eval_skip: np.ndarray | None = None,
    batch: int = 2048,
) -> tuple[np.ndarray, np.ndarray]:
    """Benchmark-only scores of the paper's mechanism on the FreqMask-KM masks of each row's cluster ``c``:
    ``off_support_l1 = ||z * (1 - m_c)||_1`` (code mass outside the cluster's mask) and
    ``masked_residual = ||a - D(m_c * z)||_2`` (reconstruction residual with only the mask's features)."""
    off, res = np.full(len(codes), np.nan), np.full(len(codes), np.nan)
    todo = np.flatnonzero(~eval_skip) if eval_skip is not None else np.arange(len(codes))
    cl = torch.as_tensor(clusters)
    for i in range(0, len(todo), batch):
        idx = torch.from_numpy(todo[i : i + batch])
        z, c = codes[idx], cl[idx]
        dense = torch.zeros_like(z).scatter_(1, det.mask_indices[c], 1.0)
        off[todo[i : i + batch]] = (z * (1 - dense)).sum(1).double().numpy()
        res[todo[i : i + batch]] = (X[idx] - sae.decode(z * dense)).norm(dim=1).double().numpy()
    return off, res


def eval_freqmask_grid(codes, rows, fit_rows, Ks, masks, scopes, sae=None) -> list[dict[str, Any]]:
    """FreqMask-KM grid; with ``sae``, also the two local-residual scores of :func:`local_residual_scores`."""
    out = []
    for K in Ks:
        t = time.time()
        base = fit_freqmask(codes, fit_rows, K)
        kmeans_s = time.time() - t
        for scope in scopes:
            for mask in masks:
                if mask > codes.shape[1]:
                    continue
                det = freqmask_variant(base, mask, scope)
                scores, clusters = score_detector(det, codes, CodesAsInput())
                out.append(
                    {
                        "config": {"K": K, "mask": mask, "scope": scope, "score": "centroid_l1"},
                        "fit_seconds": round(kmeans_s, 1),
                        **sd.evaluate_scores(scores, clusters, K, rows),
                    }
                )
                if sae is not None and scope == "local":
                    for score_name, extra in zip(
                        ("off_support_l1", "masked_residual"),
                        local_residual_scores(det, codes, clusters, rows.X, sae, rows.fit_mask),
                    ):
                        out.append(
                            {
                                "config": {"K": K, "mask": mask, "scope": scope, "score": score_name},
                                "fit_seconds": round(kmeans_s, 1),
                                **sd.evaluate_scores(extra, clusters, K, rows),
                            }
                        )
    return out


def eval_raw_detector(
    method: str, config: Any, rows: sd.Rows, fit_rows: torch.Tensor, n_clusters: int
) -> dict[str, Any]:
    t = time.time()
    det = detector_class(method)(config, rows.X.shape[1], None)
    det.fit_rows(TensorRows(rows.X), None, rows=fit_rows, progress=False)
    seconds = time.time() - t
    scores, clusters = score_detector(det, rows.X, None)
    return {
        "fit_seconds": round(seconds, 1),
        **sd.evaluate_scores(scores, clusters if n_clusters > 1 else None, n_clusters, rows),
    }


def eval_learned(sae, rows, fit_rows, K: int, stage1_only: bool = False) -> dict[str, Any]:
    config = LearnedMaskConfig(
        kmeans=KMeansConfig(n_clusters=K, seed=0),
        min_cluster_size=20,
        lora_min_cluster_size=50,
        stage1_only=stage1_only,
    )
    t = time.time()
    det = detector_class("learned-mask-lora")(config, rows.X.shape[1], sae.config.d_sae)
    det.fit_rows(TensorRows(rows.X), sae, rows=fit_rows, progress=False)
    seconds = time.time() - t
    scores, clusters = score_detector(det, rows.X, sae, batch=1024)
    return {
        "config": {"K": K, "stage1_only": stage1_only},
        "fit_seconds": round(seconds, 1),
        **sd.evaluate_scores(scores, clusters, K, rows),
    }


def select(configs: list[dict[str, Any]]) -> int:
    return int(np.argmax([c["uncal"].get("val_auroc_chat", -1) for c in configs]))


def l1_for(rows: sd.Rows, rel: float) -> float:
    rms = rows.X[torch.from_numpy(rows.fit_mask)].pow(2).mean().sqrt().item()
    return round(rel * rms, 4)


def run_layer(args, layer: int, rows: sd.Rows | None = None) -> dict[str, Any]:
    """The main table at one layer, on ``rows`` (default: the stores of ``args.model`` / ``args.position``)."""
    rows = rows if rows is not None else sd.load_rows(args.model, args.position, layer)
    fit_rows = torch.from_numpy(np.flatnonzero(rows.fit_mask))
    key = f"{args.model}/{args.position}/layer{layer}"
    l1 = l1_for(rows, args.l1_rel)
    sae, meta = sd.get_sae(rows, key, args.d_sae, l1, args.epochs, lr=args.lr)
    meta["l1_rel"] = args.l1_rel
    codes = sd.encode(sae, rows.X)
    counts = {
        f"{p}/{s}": int(rows.m(p, s).sum()) for p in sd.ALL_POOLS for s in ("fit", "val", "test") if rows.m(p, s).sum()
    }
    layer_out: dict[str, Any] = {"sae": meta, "counts": counts, "missing_pools": rows.missing_pools, "methods": {}}
    methods = layer_out["methods"]

    def log(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] layer {layer} {name}", flush=True)

    log("probe")
    for name, F in (("probe (raw)", rows.X.numpy()), ("probe (SAE codes)", codes.numpy())):
        t = time.time()
        methods[name] = {
            "configs": [
                {
                    "config": {},
                    "fit_seconds": round(time.time() - t, 1),
                    **sd.evaluate_scores(sd.probe_scores(F, rows), None, 1, rows),
                }
            ],
            "supervised": True,
            "features": "raw" if "raw" in name else "sae",
        }
        methods[name]["configs"][0]["fit_seconds"] = round(time.time() - t, 1)

    log("freqmask")
    grid = eval_freqmask_grid(codes, rows, fit_rows, [20, 50], [100, 400], ["global", "local"], sae=sae)
    for scope, score, name in (
        ("global", "centroid_l1", "FreqMask-KM (global)"),
        ("local", "centroid_l1", "FreqMask-KM (local)"),
        ("local", "off_support_l1", "off-support L1, local mask (benchmark-only)"),
        ("local", "masked_residual", "masked residual, local mask (benchmark-only)"),
    ):
        methods[name] = {
            "configs": [c for c in grid if c["config"]["scope"] == scope and c["config"]["score"] == score],
            "features": "sae",
        }

    log("mahalanobis")
    methods["Mahalanobis"] = {
        "features": "raw",
        "configs": [
            {"config": {"ridge": r}, **eval_raw_detector("mahalanobis", MahalanobisConfig(ridge=r), rows, fit_rows, 1)}
            for r in (1e-5, 1e-3, 1e-1)
        ],
    }
    log("gmm")
    methods["GMM"] = {
        "features": "raw",
        "configs": [
            {"config": {"n_components": k}, **eval_raw_detector("gmm", GMMConfig(n_components=k), rows, fit_rows, k)}
            for k in (5, 10)
        ],
    }
    log("knn")
    for name, F, feats in (("kNN-10 (raw)", rows.X, "raw"),):
        t = time.time()
        scores = sd.knn_scores(F, rows.fit_mask)
        methods[name] = {
            "features": feats,
            "configs": [
                {
                    "config": {"k": 10},
                    "fit_seconds": round(time.time() - t, 1),
                    **sd.evaluate_scores(scores, None, 1, rows),
                }
            ],
        }
    if layer in args.learned_layers:
        log("learned-mask-lora")
        methods["LearnedMask-LoRA"] = {"features": "sae", "configs": [eval_learned(sae, rows, fit_rows, 20)]}
    for entry in methods.values():
        entry["selected"] = select(entry["configs"])
    return layer_out


def run_learned_only(args, layer: int) -> dict[str, Any]:
    rows = sd.load_rows(args.model, args.position, layer)
    fit_rows = torch.from_numpy(np.flatnonzero(rows.fit_mask))
    sae, meta = sd.get_sae(
        rows,
        f"{args.model}/{args.position}/layer{layer}",
        args.d_sae,
        l1_for(rows, args.l1_rel),
        args.epochs,
        lr=args.lr,
    )
    print(f"[{time.strftime('%H:%M:%S')}] layer {layer} learned-mask-lora", flush=True)
    meta["l1_rel"] = args.l1_rel
    entry = {"features": "sae", "configs": [eval_learned(sae, rows, fit_rows, 20)]}
    entry["selected"] = 0
    return {"sae": meta, "methods": {"LearnedMask-LoRA": entry}}


def merge(name: str, parts: list[str]) -> None:
    """Merge the results files ``parts`` (stems) into ``<name>.json``: whole layers are added, a layer
    already there gets the part's methods (e.g. ``--learned-only`` runs); rewrites the markdown."""
    import json

    main_path = sd.RESULTS / f"{name}.json"
    record = json.loads(main_path.read_text()) if main_path.is_file() else None
    for part in parts:
        extra = json.loads((sd.RESULTS / f"{part}.json").read_text())
        if record is None:
            record = extra
            record["env"]["command"] = f"merge of: {extra['env']['command']}"
            continue
        for layer, lo in extra["layers"].items():
            if layer in record["layers"]:
                record["layers"][layer]["methods"].update(lo["methods"])
            else:
                record["layers"][layer] = lo
        record.setdefault("merged_commands", []).append(f"{extra['env']['command']} (status {extra.get('status')})")
    record["layers"] = dict(sorted(record["layers"].items(), key=lambda t: int(t[0])))
    sd.write_json(main_path, record)
    (sd.RESULTS / f"{name}.md").write_text(markdown(record))


def run_sweep(args, layer: int, out: dict[str, Any], save) -> dict[str, Any]:
    rows = sd.load_rows(args.model, args.position, layer)
    fit_rows = torch.from_numpy(np.flatnonzero(rows.fit_mask))
    key = f"{args.model}/{args.position}/layer{layer}"
    out["saes"] = []
    for d_sae in args.widths:
        for rel in args.l1_rels:
            l1 = l1_for(rows, rel)
            print(f"[{time.strftime('%H:%M:%S')}] sweep layer {layer} SAE {d_sae} l1_rel {rel}", flush=True)
            sae, meta = sd.get_sae(rows, key, d_sae, l1, args.epochs, lr=args.lr)
            meta["l1_rel"] = rel
            codes = sd.encode(sae, rows.X)
            grid = eval_freqmask_grid(codes, rows, fit_rows, args.ks, args.masks, ["global", "local"], sae=sae)
            entry = {"sae": meta, "freqmask": grid}
            entry["probe (SAE codes)"] = sd.evaluate_scores(sd.probe_scores(codes.numpy(), rows), None, 1, rows)
            if args.learned_layers and layer in args.learned_layers:
                entry["LearnedMask-LoRA"] = [eval_learned(sae, rows, fit_rows, K) for K in (20,)]
            out["saes"].append(entry)
            save()
    return out


# ----------------------------------------------------------------------------- markdown

COLS = ("auroc_chat", "auroc_task", "tpr5_chat")


def cell(entry: dict[str, Any], key: str) -> str:
    u, c = entry["uncal"].get(key), entry["cal"].get(key)
    return f"{sd.fmt(u)} / {sd.fmt(c)}"


def calibrated_selection(record: dict[str, Any], names: list[str]) -> list[str]:
    """Per unsupervised method, the layer and config (every config tried, not only the uncalibrated pick)
    with the best *calibrated* validation AUROC harmful vs chat: the rule the shipped guard is chosen by."""
    lines = [
        "",
        "Best layer and config per method with the paper's calibration (by calibrated validation AUROC "
        "harmful vs chat, over every config tried; test numbers calibrated):",
        "",
        "| method | layer | config | val AUROC chat | val TPR@5% chat | AUROC chat | AUROC task | TPR@5% chat | "
        "test chat flag rate | probe AUROC chat (same features, that layer) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        candidates = [
            (layer, lo, e)
            for layer, lo in record["layers"].items()
            if name in lo["methods"] and not lo["methods"][name].get("supervised")
            for e in lo["methods"][name]["configs"]
            if e.get("cal")
        ]
        if not candidates:
            continue
        layer, lo, e = max(candidates, key=lambda t: t[2]["cal"].get("val_auroc_chat", -1))
        probes = {m["features"]: m["configs"][0] for m in lo["methods"].values() if m.get("supervised")}
        p = probes.get(lo["methods"][name]["features"], {"uncal": {}})["uncal"]
        c = e["cal"]
        lines.append(
            f"| {name} | {layer} | {e['config']} | {sd.fmt(c.get('val_auroc_chat'))} | "
            f"{sd.fmt(c.get('val_tpr5_chat'))} | "
            f"{sd.fmt(c.get('auroc_chat'))} | {sd.fmt(c.get('auroc_task'))} | {sd.fmt(c.get('tpr5_chat'))} | "
            f"{sd.fmt(c.get('chat_test_flag_rate'))} | {sd.fmt(p.get('auroc_chat'))} |"
        )
    return lines


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# Chat study: {record['model']} {record['position']}",
        "",
        f"Command: `{record['env']['command']}` ({record['env']['utc']}, wall {record.get('wall_seconds', '-')} s, "
        f"load average {record['env']['load_average']}). {record.get('status', '')}",
        "",
        *[f"Merged with: `{c}`" for c in record.get("merged_commands", [])],
        "",
        "Protocol: `benchmarks/archive/chat-study/study_data.py` (fit on the fit split of all benign domains; hyperparameters selected "
        "by validation AUROC harmful vs chat; all numbers on test). Positives: harmful test + harmful_vauban. "
        "Cells: uncalibrated / calibrated (per-cluster affine, 1% budget from validation rows, mean of 3 draws). "
        "TPR@5% chat FPR: threshold at the 95th percentile of validation chat scores. Probe: SUPERVISED "
        "logistic regression on the same features, trained on validation rows.",
        "",
    ]
    if "layers" in record:
        lines += [
            "| layer | method | features | selected config | val AUROC chat | AUROC harmful vs chat | AUROC vs task | "
            "TPR@5% chat FPR | test chat flag rate | probe AUROC chat | probe AUROC task | probe TPR@5% |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for layer, lo in record["layers"].items():
            probes = {
                m["features"]: m["configs"][m["selected"]] for n, m in lo["methods"].items() if m.get("supervised")
            }
            for name, m in lo["methods"].items():
                e = m["configs"][m["selected"]]
                p = probes.get(m["features"], {"uncal": {}})["uncal"]
                lines.append(
                    f"| {layer} | {name} | {m['features']} | {e['config']} | "
                    f"{sd.fmt(e['uncal'].get('val_auroc_chat'))} | "
                    f"{cell(e, 'auroc_chat')} | {cell(e, 'auroc_task')} | {cell(e, 'tpr5_chat')} | "
                    f"{cell(e, 'chat_test_flag_rate')} | {sd.fmt(p.get('auroc_chat'))} | "
                    f"{sd.fmt(p.get('auroc_task'))} | "
                    f"{sd.fmt(p.get('tpr5_chat'))} |"
                )
        lines += [
            "",
            "SAE per layer (trained on the benign fit split; L0 / FVE / dead fraction on benign validation rows):",
            "",
            "| layer | d_sae | L1 (rel. to RMS) | epochs | n fit | L0 | FVE | dead | train s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for layer, lo in record["layers"].items():
            s = lo["sae"]
            lines.append(
                f"| {layer} | {s['d_sae']} | {s['l1']} ({s['l1_rel']}) | {s['epochs']} | {s['n_fit']} | {s['val_l0']} "
                f"| "
                f"{s['val_fve']} | {s['val_dead_fraction']} | {s['train_seconds']} |"
            )
        lines += [
            "",
            "Best layer per method (by validation AUROC harmful vs chat, uncalibrated):",
            "",
            "| method | layer | config | AUROC chat | AUROC task | TPR@5% chat | probe AUROC chat (same features, "
            "that layer) |",
            "|---|---|---|---|---|---|---|",
        ]
        names = []
        for lo in record["layers"].values():
            names += [n for n in lo["methods"] if n not in names]
        for name in names:
            best = max(
                ((layer, lo["methods"][name]) for layer, lo in record["layers"].items() if name in lo["methods"]),
                key=lambda t: t[1]["configs"][t[1]["selected"]]["uncal"].get("val_auroc_chat", -1),
            )
            layer, m = best
            e = m["configs"][m["selected"]]
            probes = {
                mm["features"]: mm["configs"][0]
                for mm in record["layers"][layer]["methods"].values()
                if mm.get("supervised")
            }
            p = probes.get(m["features"], {"uncal": {}})["uncal"]
            lines.append(
                f"| {name} | {layer} | {e['config']} | {cell(e, 'auroc_chat')} | {cell(e, 'auroc_task')} | "
                f"{cell(e, 'tpr5_chat')} | {sd.fmt(p.get('auroc_chat'))} |"
            )
        lines += calibrated_selection(record, names)
    if "sweep" in record:
        for layer, so in record["sweep"].items():
            lines += [
                "",
                f"## Mechanism sweep, layer {layer}",
                "",
                "| d_sae | L1 (rel) | L0 | FVE | method | K | mask | scope | val AUROC chat (uncal / cal) | AUROC "
                "chat | AUROC task | TPR@5% chat |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for entry in so.get("saes", []):
                s = entry["sae"]
                head = f"| {s['d_sae']} | {s['l1']} ({s['l1_rel']}) | {s['val_l0']} | {s['val_fve']} "
                for e in entry["freqmask"]:
                    c = e["config"]
                    label = "FreqMask-KM" if c.get("score", "centroid_l1") == "centroid_l1" else c["score"]
                    lines.append(
                        head + f"| {label} | {c['K']} | {c['mask']} | {c['scope']} | "
                        f"{sd.fmt(e['uncal'].get('val_auroc_chat'))} / {sd.fmt(e['cal'].get('val_auroc_chat'))} | "
                        f"{cell(e, 'auroc_chat')} | {cell(e, 'auroc_task')} | {cell(e, 'tpr5_chat')} |"
                    )
                for e in entry.get("LearnedMask-LoRA", []):
                    lines.append(
                        head + f"| LearnedMask-LoRA | {e['config']['K']} | learned | local | "
                        f"{sd.fmt(e['uncal'].get('val_auroc_chat'))} / {sd.fmt(e['cal'].get('val_auroc_chat'))} | "
                        f"{cell(e, 'auroc_chat')} | {cell(e, 'auroc_task')} | {cell(e, 'tpr5_chat')} |"
                    )
                for name in ("probe (SAE codes)",):
                    e = entry[name]
                    lines.append(
                        head + f"| {name} | - | - | - | {sd.fmt(e['uncal'].get('val_auroc_chat'))} | "
                        f"{cell(e, 'auroc_chat')} | {cell(e, 'auroc_task')} | {cell(e, 'tpr5_chat')} |"
                    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(sd.MODEL_DIRS))
    parser.add_argument("--position", default="prompt_last", choices=["prompt_last", "response_last"])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 28])
    parser.add_argument("--learned-layers", type=int, nargs="*", default=[])
    parser.add_argument("--d-sae", type=int, default=2304)
    parser.add_argument(
        "--l1-rel", type=float, default=0.1, help="SAE L1 coefficient = this x RMS of the fit activations"
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sweep", action="store_true", help="mechanism sweep at --layers instead of the main table")
    parser.add_argument("--widths", type=int, nargs="+", default=[2304, 4608])
    parser.add_argument("--l1-rels", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--ks", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--masks", type=int, nargs="+", default=[50, 100, 400])
    parser.add_argument(
        "--learned-only", action="store_true", help="only LearnedMask-LoRA at --layers, into <name>_learned.json"
    )
    parser.add_argument(
        "--merge-from", nargs="+", default=None, help="merge these results stems into <name>.json and exit"
    )
    parser.add_argument(
        "--name", default=None, help="results file stem (default chat_study_<model>_<position>[_sweep])"
    )
    args = parser.parse_args()
    # threads: torch's default (OMP_NUM_THREADS when set); one per job when several share the 2 cores
    name = args.name or f"chat_study_{args.model}_{args.position}" + ("_sweep" if args.sweep else "")
    if args.merge_from:
        merge(name, args.merge_from)
        return
    if args.learned_only:
        name += "_learned"
    record: dict[str, Any] = {
        "model": args.model,
        "position": args.position,
        "env": sd.environment(),
        "settings": {k: v for k, v in vars(args).items()},
        "protocol": sd.__doc__,
    }
    start = time.time()
    section = "sweep" if args.sweep else "layers"
    record[section] = {}

    def save() -> None:
        record["wall_seconds"] = round(time.time() - start)
        sd.write_json(sd.RESULTS / f"{name}.json", record)
        (sd.RESULTS / f"{name}.md").write_text(markdown(record))

    for layer in args.layers:
        record["status"] = f"PARTIAL: running layer {layer}"
        if args.sweep:
            record[section][str(layer)] = {}
            run_sweep(args, layer, record[section][str(layer)], save)
        elif args.learned_only:
            record[section][str(layer)] = run_learned_only(args, layer)
        else:
            record[section][str(layer)] = run_layer(args, layer)
        save()
    record["status"] = "complete"
    record["wall_seconds"] = round(time.time() - start)
    sd.write_json(sd.RESULTS / f"{name}.json", record)
    (sd.RESULTS / f"{name}.md").write_text(markdown(record))
    print((sd.RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
