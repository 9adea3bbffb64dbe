"""The words behind the released guard's flags on held-out chat: what its supervised head keys on, per hand label.

The chat audit (:mod:`studies.chat_audit`) labelled by hand, blind, the test chat rows the released guard flags and
as many unflagged ones (harmful, risky, benign). This study screens the same rows through the bundled model with the
released guard, ``explain=True``, and for every row the supervised head flags takes the prompt tokens that raise its
logit most (:meth:`hf_lsad.guard.heads.SupervisedHead.explain_tokens`: how much the logit falls when the token's
residual leaves the prompt's mean). It counts those words per hand label and shows a few rows of each.

It fits, chooses and changes nothing. The flags come from screening the prompts (batched by a token budget), not
from the audit's stores (fixed batches): a row on the threshold may land on the other side by float round-off, so
the flagged counts per label are reported beside the audit's.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, load_model
from hf_lsad.data import load_pool

from .chat_audit import LABELS


@dataclass
class Settings:
    model: str = "default"
    """The model the guard reads (the bundled SmolLM2-135M-Instruct)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard whose flags are explained."""
    pool: str = "chat"
    """The pool the audited rows come from."""
    labels: str = "benchmarks/studies/chat_audit_labels.jsonl"
    """The chat audit's hand labels (one JSON object per line: ``id``, ``label``, ``why``): the rows screened."""
    head: str = "harm"
    """The supervised head whose flags are explained."""
    top_k: int = 3
    """Tokens named per flagged row."""
    examples: int = 5
    """Rows shown per label, in the labels file's order."""
    batch_size: int = 16
    """Prompts per forward pass."""


def _word(text: str) -> str:
    return text.strip().lower() or repr(text)


def run(settings: Settings) -> dict[str, Any]:
    records = [json.loads(line) for line in Path(settings.labels).read_text(encoding="utf-8").splitlines()]
    text_of = {prompt.id: prompt.text for prompt in load_pool(settings.pool)}
    missing = [r["id"] for r in records if r["id"] not in text_of]
    if missing:
        raise ValueError(f"{len(missing)} audited rows are not in the {settings.pool} pool, e.g. {missing[:3]}")
    model, tokenizer = load_model(settings.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(settings.guard), tokenizer=tokenizer)
    texts = [text_of[r["id"]] for r in records]
    reports = []
    for start in range(0, len(texts), settings.batch_size):
        reports += guarded.screen(texts[start : start + settings.batch_size], explain=True, top_k=settings.top_k)
    per_label: dict[str, Any] = {}
    for label in LABELS:
        rows = [(r, text, report) for r, text, report in zip(records, texts, reports) if r["label"] == label]
        by_head = [(r, text, report) for r, text, report in rows if report.explained_head == settings.head]
        first: Counter[str] = Counter()
        named: Counter[str] = Counter()
        for _, _, report in by_head:
            words = [_word(t.text(tokenizer)) for t in report.tokens or ()]
            first.update(words[:1])
            named.update(words)
        per_label[label] = {
            "rows": len(rows),
            "flagged": sum(report.flagged for _, _, report in rows),
            "flagged_by_head": sum(settings.head in report.decided_by for _, _, report in rows),
            "explained_by_head": len(by_head),
            "first_word": first.most_common(10),
            "named_words": named.most_common(15),
            "examples": [
                {
                    "id": r["id"],
                    "why": r.get("why", ""),
                    "opening": " ".join(text.split())[:80],
                    "score": next(h.score for h in report.heads if h.name == settings.head),
                    "words": [[t.text(tokenizer), round(t.contribution, 3)] for t in report.tokens or ()],
                }
                for r, text, report in by_head[: settings.examples]
            ],
        }
    result = {"rows": len(records), "flagged": sum(r.flagged for r in reports), "labels": per_label}
    print(json.dumps(result, indent=1))
    return result
