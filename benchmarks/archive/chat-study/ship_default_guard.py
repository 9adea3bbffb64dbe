"""Install a guard written by ``fit_default_guard.py`` as the bundled default guard, with its model card.

    python benchmarks/archive/chat-study/ship_default_guard.py --guard artifacts/tmp/newguard \\
        --results benchmarks/archive/chat-study/results/default_guard_smollm2.json

The card's metrics are the measured test-split rates of ``fit_default_guard.py`` (never fitted,
labelled or used for a threshold); nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from hf_lsad.guard import DEFAULT_GUARD, SafetyGuard

CATEGORIES = ("harmful", "harmful_vauban", "toxic", "jailbreak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guard", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args()
    record = json.loads(args.results.read_text())
    rates, headline = record["guard"], record["guard"]["auroc"]
    metrics = {c: {"flagged": rates[f"tpr_{c}"]} for c in CATEGORIES if f"tpr_{c}" in rates}
    metrics["harmful"] |= {"auroc": headline["auroc_chat"], "tpr_at_fpr": headline["tpr5_chat"]}
    note = (
        f"Test split of the chat study protocol (`benchmarks/archive/chat-study/study_data.py`). `flagged`: share flagged at the guard's "
        f"threshold. Benign test rows flagged: chat {rates['chat_test_flag_rate']:.3f}, task prompts "
        f"{rates['task_test_flag_rate']:.3f}, benign-OOD {rates['benign_ood_test_flag_rate']:.3f}. For `harmful`, "
        f"AUROC and TPR at 5% FPR are against held-out chat (harmful + vauban-harmful positives). "
        f"Command: `{record['env']['command']}`."
    )
    guard = SafetyGuard.from_pretrained(args.guard)
    rows = (
        "validation chat rows"
        if record["settings"].get("threshold_on", "chat") == "chat"
        else "all benign validation rows"
    )
    threshold = (
        f"per-cluster affine calibration from 1% labelled validation rows; probability threshold at 5% FPR on {rows}"
        if guard.calibration is not None
        else f"no labels; score threshold at 5% FPR on {rows}"
    )
    data = (
        "Fitted on the fit split (60%) of every benign domain bundled: task prompts (`safe` pool), chat "
        "(`chat` pool: ShareGPT first turns, vauban harmless, MT-Bench, WritingBench) and benign-OOD "
        f"(sarcasm headlines, wikiHow goals, sports, chit-chat); {threshold}."
    )
    shutil.rmtree(DEFAULT_GUARD)
    guard.save_pretrained(DEFAULT_GUARD)
    guard.model_card(metrics=metrics, metrics_note=note, data=data).save(DEFAULT_GUARD / "README.md")
    print(f"installed {args.guard} as {DEFAULT_GUARD}")


if __name__ == "__main__":
    main()
