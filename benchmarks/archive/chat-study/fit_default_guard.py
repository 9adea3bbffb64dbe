"""Fit the shipped SmolLM2 guard with the configuration the chat study selected (issue 13).

* SAE and detector fitted on the fit split of ALL benign domains (task prompts, chat,
  benign_ood); the SAE is the study's (same settings, same fit rows: read from the study
  cache under ``artifacts/study`` when it exists);
* threshold at 5% FPR on the validation rows of all benign domains, or (``--threshold-on chat``,
  uncalibrated) of the chat pool;
* ``--calibrate``: per-cluster affine calibration (paper appendix B) at a 1% labelled
  budget drawn from the validation split only (seed 0; never the README demo prompts),
  with the probability threshold at 5% FPR on the benign validation rows not drawn;
* saved with ``SafetyGuard.save_pretrained`` into ``--out``;
* reported, on the TEST split (rows never fitted, labelled or used for a threshold):
  the chat flag rate, the flag rate of task prompts and benign_ood, and the TPR of
  harmful, harmful_vauban, toxic and jailbreak at the guard's threshold; next to the
  SUPERVISED probe (logistic regression on the same features, trained on the validation
  split) at the same test-chat FPR (its threshold set on the test chat scores to flag the
  same fraction) and at its own threshold (95th percentile of validation chat scores).

Protocol details: ``benchmarks/archive/chat-study/study_data.py``.

    PYTHONPATH=. python benchmarks/archive/chat-study/fit_default_guard.py --out artifacts/study/default_guard \
        --layer 20 --method freqmask-km --K 20 --mask 100 --scope global --calibrate
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import study_data as sd
import torch
from chat_study import l1_for

from hf_lsad.core.prompt_inputs import InputProfile
from hf_lsad.data.store import TensorRows, load_activations
from hf_lsad.detectors import detector_class
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.detectors.freqmask import FreqMaskConfig
from hf_lsad.detectors.gmm import GMMConfig
from hf_lsad.detectors.knn import KNNConfig
from hf_lsad.detectors.learned_mask import LearnedMaskConfig
from hf_lsad.detectors.mahalanobis import MahalanobisConfig
from hf_lsad.guard import GuardConfig, SafetyGuard
from hf_lsad.guard.calibration import fit_affine_calibration, importance_weights

CATEGORIES = ("harmful", "harmful_vauban", "toxic", "jailbreak")


def detector_config(args) -> Any:
    if args.method == "freqmask-km":
        return FreqMaskConfig(
            kmeans=KMeansConfig(n_clusters=args.K, seed=0), mask_size=args.mask, mask_scope=args.scope
        )
    if args.method == "learned-mask-lora":
        return LearnedMaskConfig(
            kmeans=KMeansConfig(n_clusters=args.K, seed=0), min_cluster_size=20, lora_min_cluster_size=50
        )
    if args.method == "mahalanobis":
        return MahalanobisConfig(ridge=args.ridge)
    if args.method == "knn":
        return KNNConfig(k=args.k)
    if args.method == "gmm":
        return GMMConfig(n_components=args.K)
    raise ValueError(args.method)


def input_profile(ids: list[str]) -> InputProfile:
    """How the study's stores were collected (chat template, as ``encode_prompts``) and the longest of these prompts."""
    from hf_lsad.capture.pretrained import load_tokenizer
    from hf_lsad.data import POOLS, load_pool

    tokenizer = load_tokenizer("default")
    wanted = set(ids)
    texts = [p.text for pool in POOLS for p in load_pool(pool) if p.id in wanted]
    templated = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    longest = max(len(ids) for ids in tokenizer(templated, add_special_tokens=False)["input_ids"])
    return InputProfile("chat_template", longest)


def rates(flags: np.ndarray, rows: sd.Rows) -> dict[str, float]:
    out = {
        "chat_test_flag_rate": float(flags[rows.m("chat", "test")].mean()),
        "task_test_flag_rate": float(flags[rows.m("safe", "test")].mean()),
        "benign_ood_test_flag_rate": float(flags[rows.m("benign_ood", "test")].mean()),
    }
    for cat in CATEGORIES:
        mask = rows.m(cat, "test")
        if mask.any():
            out[f"tpr_{cat}"] = float(flags[mask].mean())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--position", default="prompt_last")
    parser.add_argument("--layer", type=int, default=20)
    parser.add_argument(
        "--method", default="freqmask-km", choices=["freqmask-km", "learned-mask-lora", "mahalanobis", "gmm", "knn"]
    )
    parser.add_argument("--k", type=int, default=10, help="kNN neighbours")
    parser.add_argument("--K", type=int, default=20, help="clusters (FreqMask-KM, LearnedMask-LoRA) or GMM components")
    parser.add_argument("--mask", type=int, default=100)
    parser.add_argument("--scope", default="global")
    parser.add_argument("--ridge", type=float, default=1e-5)
    parser.add_argument("--d-sae", type=int, default=2304)
    parser.add_argument("--l1-rel", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument(
        "--threshold-on",
        "--calibrated-threshold-on",
        dest="threshold_on",
        choices=["chat", "benign"],
        help="validation rows whose 95th percentile sets the threshold (score or, for a calibrated "
        "guard, probability; the score threshold of a calibrated guard is always set on all benign "
        "validation rows); default: chat when calibrated, benign when not",
    )
    parser.add_argument("--name", default="default_guard_smollm2")
    args = parser.parse_args()
    args.threshold_on = args.threshold_on or ("chat" if args.calibrate else "benign")
    start = time.time()
    rows = sd.load_rows(args.model, args.position, args.layer)
    hook = load_activations(sd.store_dir(args.model, args.position, args.layer, "harmful")).hook
    fit_rows = torch.from_numpy(np.flatnonzero(rows.fit_mask))
    cls = detector_class(args.method)
    sae = None
    if cls.uses_sae:
        sae, sae_meta = sd.get_sae(
            rows, f"{args.model}/{args.position}/layer{args.layer}", args.d_sae, l1_for(rows, args.l1_rel), args.epochs
        )
    detector = cls(detector_config(args), hook.hidden_size, sae.config.d_sae if sae else None)
    detector.fit_rows(TensorRows(rows.X), sae, rows=fit_rows, progress=False)
    detector.eval()
    with torch.no_grad():
        outs = [detector(rows.X[i : i + 2048], sae) for i in range(0, len(rows.X), 2048)]
    scores = torch.cat([o.scores for o in outs]).double().numpy()
    clusters = torch.cat([o.clusters for o in outs]).numpy()
    val_benign = rows.m(sd.BENIGN_POOLS, "val") & ~rows.demo
    # The rows the score threshold is set on (and reports' p-values read): all benign validation rows, or,
    # uncalibrated with --threshold-on chat, the chat ones (the traffic users send).
    held_out = rows.m("chat", "val") & ~rows.demo if args.threshold_on == "chat" and not args.calibrate else val_benign
    threshold = sd.threshold_at(scores[held_out])
    config = GuardConfig(
        hook=hook,
        method=args.method,
        threshold=threshold,
        target_fpr=sd.TARGET_FPR,
        n_fit=len(fit_rows),
        n_holdout=int(held_out.sum()),
        seed=sd.SPLIT_SEED,
    )
    guard = SafetyGuard(config, detector, sae).eval()
    guard.set_holdout_scores(torch.as_tensor(scores[held_out]).float())  # reports' conformal p-values
    guard.inputs = input_profile(np.asarray(rows.ids, dtype=object)[rows.fit_mask | val_benign].tolist())
    record: dict[str, Any] = {
        "env": sd.environment(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "protocol": sd.__doc__,
        "n_fit": len(fit_rows),
        "n_threshold_rows": int(val_benign.sum()),
        "score_threshold": threshold,
    }
    if sae is not None:
        record["sae"] = sae_meta
    if args.calibrate:
        index, labels, groups = sd.calibration_sample(rows, seed=0)
        n_clusters = detector.n_clusters
        cal = fit_affine_calibration(
            scores[index], clusters[index], labels, importance_weights(groups, sd.BUDGET), n_clusters, seed=0
        )
        g = cal.logits(torch.as_tensor(scores), torch.as_tensor(clusters)).numpy()
        drawn = np.zeros(len(scores), bool)
        drawn[index] = True
        # The probability threshold: 5% FPR on the validation rows of the domain chosen (chat: the traffic
        # users send; benign: all benign validation rows, where chat is a minority).
        threshold_rows = rows.m("chat", "val") & ~rows.demo if args.threshold_on == "chat" else val_benign
        g_thr = sd.threshold_at(g[threshold_rows & ~drawn])
        cal.threshold = float(1.0 / (1.0 + np.exp(-g_thr)))
        guard.set_calibration(cal)
        record["calibration"] = {
            "lambda": cal.lam,
            "n_labelled_unsafe": int(labels.sum()),
            "n_labelled_benign": int((1 - labels).sum()),
            "probability_threshold": cal.threshold,
        }
    guard.save_pretrained(args.out)
    # Evaluate what the saved guard flags (reloaded, as a user would).
    loaded = SafetyGuard.from_pretrained(args.out)
    with torch.no_grad():
        flags = torch.cat([loaded(rows.X[i : i + 2048]).flagged for i in range(0, len(rows.X), 2048)]).numpy()
    record["guard"] = rates(flags, rows)
    record["guard"]["auroc"] = sd.headline(
        g if args.calibrate else scores, rows, exclude=drawn if args.calibrate else None
    )
    # SUPERVISED probe on the same features.
    features = sd.encode(sae, rows.X).numpy() if sae is not None else rows.X.numpy()
    p = sd.probe_scores(features, rows)
    chat_test = rows.m("chat", "test")
    target = record["guard"]["chat_test_flag_rate"]
    p_thr_same = float(np.quantile(p[chat_test], 1 - target)) if target > 0 else float(p[chat_test].max())
    record["probe_same_chat_fpr"] = {"threshold": p_thr_same, **rates(p > p_thr_same, rows)}
    p_thr_own = sd.threshold_at(p[rows.m("chat", "val")])
    record["probe_own_threshold"] = {"threshold": p_thr_own, **rates(p > p_thr_own, rows)}
    record["probe_auroc"] = sd.headline(p, rows)
    record["wall_seconds"] = round(time.time() - start)
    record["saved_to"] = str(args.out)
    sd.write_json(sd.RESULTS / f"{args.name}.json", record)
    lines = [
        f"# Default guard ({args.model} {args.position} layer {args.layer}, {args.method})",
        "",
        f"Command: `{record['env']['command']}` ({record['env']['utc']}, wall {record['wall_seconds']} s). Saved to "
        f"`{args.out}`.",
        "",
        "Test split only (never fitted, labelled or used for a threshold).",
        "",
        "| | chat flag rate | task flag rate | benign_ood flag rate | harmful TPR | harmful_vauban TPR | toxic TPR | "
        "jailbreak TPR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (
        ("guard" + (" (calibrated)" if args.calibrate else ""), record["guard"]),
        ("probe (SUPERVISED), same test chat FPR", record["probe_same_chat_fpr"]),
        ("probe (SUPERVISED), own threshold (val chat 95th pct)", record["probe_own_threshold"]),
    ):
        lines.append(
            f"| {name} | "
            + " | ".join(
                sd.fmt(r.get(k))
                for k in (
                    "chat_test_flag_rate",
                    "task_test_flag_rate",
                    "benign_ood_test_flag_rate",
                    "tpr_harmful",
                    "tpr_harmful_vauban",
                    "tpr_toxic",
                    "tpr_jailbreak",
                )
            )
            + " |"
        )
    (sd.RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
