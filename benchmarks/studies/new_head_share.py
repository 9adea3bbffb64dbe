"""What share of the one false-positive budget a head added from a user's examples needs, on validation rows.

``add_head`` (``hf-lsad add-head``) gives a new head an equal share of the budget: a third beside the released
guard's two heads, taken from the others in proportion, so ``harm``'s threshold rises and it catches less. A narrow
category (dosage questions, a company's project names) sits far from chat, so a small share may catch its rows as
well as a third does. This study measures, for each of several user categories and each candidate share, what the
new head catches of the category and what the guard catches of the bundled unsafe sources.

The categories are hand-written templates filled with slot values (``user_categories.json``: four categories, eight
templates each, at most ``per_template`` prompts a template). Each category's head is fitted as ``add_head`` fits
it (:func:`~hf_lsad.guard.heads.training.fit_head`: a logistic head, ``C`` 0.01, on the guard's first supervised
head's reads, else the anomaly layer's last token and mean; the category's prompts against
``benign_per_pool`` seeded fit rows of each of ``add_head``'s bundled benign pools, each group weighed alike) on the
prompts of all but the category's ``held_out`` templates; the held-out templates' prompts are the category's rows
the head never saw, in phrasings it never saw. Every threshold is then set as ``add_fitted_head`` sets it
(:meth:`~hf_lsad.guard.SafetyGuard.fit_budget` on ``threshold_rows`` seeded validation chat rows, the guard's
target and confidence), the new head taking each candidate share and the other heads their proportions of the rest.

The bundled rows are read from the activation stores under ``folder`` (``hf-lsad collect``, every read the guards
need), the category's prompts through the bundled model. Reported per parent guard, category and share: the
category's held-out rows flagged (by the guard and by the new head), the guard's catch on every bundled unsafe
source's validation rows (each source, the median and the worst of :data:`EVAL_SOURCES`, and all unsafe rows
together), the validation chat rows that set no threshold, and each benign domain's validation rows.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_lsad import SafetyGuard, load_model
from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import EVAL_SOURCES, SourceRows, load_source_rows
from hf_lsad.guard.heads.budget import THRESHOLD_POOL, budget_rule
from hf_lsad.guard.heads.bundled import release_rows, sample_rows
from hf_lsad.guard.heads.probe import ProbeConfig
from hf_lsad.guard.heads.training import BENIGN_POOLS, fit_head

HERE = Path(__file__).resolve().parent


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the bundled pools' stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct, through which the category prompts are read."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The parent guards a head is added to: the released two-headed guard and the paper's anomaly-only guard."""
    categories: str = "user_categories.json"
    """The hand-written categories (beside this module)."""
    per_template: int = 16
    """Prompts a template gives at most (a seeded draw of its slot fillings)."""
    shares: list[float] = field(default_factory=lambda: [0.02, 0.05, 0.1, 0.2])
    """Candidate shares of the new head; the equal share (``add_head``'s default) is always measured too."""
    benign_per_pool: int = 400
    """Fit rows drawn from each of ``add_head``'s bundled benign pools (``add_head``'s default)."""
    threshold_rows: int = 1000
    """Validation chat rows the thresholds are set on (``add_head``'s default); the rest are reported."""
    inverse_regularisation: float = 0.01
    """The logistic head's ``C`` (``add_head``'s default)."""
    seed: int = 0
    """Seed of the draws (``add_head``'s default)."""


def category_prompts(path: Path, per_template: int, seed: int) -> dict[str, dict[str, list[str]]]:
    """Each category's ``fit`` and ``held_out`` prompts: every template filled with at most ``per_template`` seeded
    combinations of its slots' values; the ``held_out`` templates' prompts apart."""
    categories = json.loads(path.read_text())
    out: dict[str, dict[str, list[str]]] = {}
    for name, category in categories.items():
        parts: dict[str, list[str]] = {"fit": [], "held_out": []}
        for template in category["templates"]:
            slots = [s for s in category["slots"] if "{" + s + "}" in template["text"]]
            fillings = list(itertools.product(*(category["slots"][s] for s in slots)))
            random.Random(f"{seed}/{name}/{template['id']}").shuffle(fillings)
            texts = [template["text"].format(**dict(zip(slots, values))) for values in fillings[:per_template]]
            parts["held_out" if template["id"] in category["held_out"] else "fit"] += texts
        out[name] = parts
    return out


def _rows_by_id(rows: SourceRows) -> dict[str, int]:
    return {row_id: i for i, row_id in enumerate(rows.ids)}


def _pick(rows: SourceRows, index: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    return {read: values[index] for read, values in rows.features.items()}


def run(settings: Settings) -> dict[str, Any]:
    categories = category_prompts(HERE / settings.categories, settings.per_template, settings.seed)
    model, tokenizer = load_model(settings.model)
    parents = {name: SafetyGuard.from_pretrained(name) for name in settings.guards}
    new_reads = {}
    for name, guard in parents.items():
        first = next(iter(guard.heads.values()), None)
        layer = guard.config.hook.layer
        new_reads[name] = list(first.reads) if first is not None else [(layer, "prompt_last"), (layer, "prompt_mean")]
    reads = sorted(
        {read for guard in parents.values() for read in guard.reads} | {r for v in new_reads.values() for r in v}
    )
    print(f"reads {reads}", flush=True)
    rows = load_source_rows(settings.folder, GUARD_POOLS, reads, seed=0)  # the release's split
    at = _rows_by_id(rows)
    validation = rows.select(rows.where(split="validation"))

    chat = release_rows(THRESHOLD_POOL, "validation")
    threshold_ids = {p.id for p in sample_rows(chat, settings.threshold_rows, settings.seed)}
    threshold_index = [at[p.id] for p in chat if p.id in threshold_ids]
    unseen_chat = [
        i
        for i, (d, row_id) in enumerate(zip(validation.domains, validation.ids))
        if d == "chat" and row_id not in threshold_ids
    ]
    bundled = {
        pool: [at[p.id] for p in sample_rows(release_rows(pool, "fit"), settings.benign_per_pool, settings.seed)]
        for pool in BENIGN_POOLS
    }

    texts = [t for parts in categories.values() for t in parts["fit"] + parts["held_out"]]
    read_of, _ = collect_prompt_features(model, tokenizer, texts, reads, progress=True)
    offsets, start = {}, 0
    for name, parts in categories.items():
        offsets[name] = (start, start + len(parts["fit"]), start + len(parts["fit"]) + len(parts["held_out"]))
        start = offsets[name][2]

    result: dict[str, Any] = {
        "categories": {name: {k: len(v) for k, v in parts.items()} for name, parts in categories.items()},
        "threshold_rows": len(threshold_index),
        "unseen_chat_rows": len(unseen_chat),
        "guards": {},
    }
    for parent_name, parent in parents.items():
        config = ProbeConfig(reads=new_reads[parent_name], inverse_regularisation=settings.inverse_regularisation)
        target_fpr, confidence = budget_rule(parent, None, "keep")
        previous = parent.budget.shares if parent.budget is not None else [1.0]
        by_category: dict[str, Any] = {}
        for name in categories:
            first, middle, end = offsets[name]
            fit_index = [i for pool in BENIGN_POOLS for i in bundled[pool]]
            groups = [name] * (middle - first) + [pool for pool in BENIGN_POOLS for _ in bundled[pool]]
            labels = torch.tensor([1] * (middle - first) + [0] * len(fit_index))
            fit_reads = {
                read: torch.cat([read_of[read][first:middle], rows.features[read][fit_index]]) for read in config.reads
            }
            head = fit_head(name, fit_reads, labels, groups, config)
            guard = copy.deepcopy(parent)
            guard.add_head(head)
            held_out = {read: read_of[read][middle:end] for read in guard.reads}
            equal = 1.0 / len(guard.head_names)
            by_share: dict[str, Any] = {}
            for share in [*settings.shares, equal]:
                budget = guard.fit_budget(
                    _pick(rows, threshold_index),
                    target_fpr=target_fpr,
                    shares=[s * (1.0 - share) for s in previous] + [share],
                    confidence=confidence,
                )
                measured = _measure(guard, name, held_out, validation, unseen_chat)
                by_share["equal" if share == equal else f"{share:g}"] = measured | {
                    "share": share,
                    "thresholds": dict(zip(budget.heads, budget.thresholds)),
                }
                all_unsafe = measured["unsafe_all"]
                print(
                    f"{parent_name} {name} share {share:.3f}: category {measured['category']:.3f}, unsafe median "
                    f"{measured['unsafe_median']:.3f} worst {measured['unsafe_worst']:.3f}, all "
                    f"{all_unsafe['caught']} of {all_unsafe['rows']}",
                    flush=True,
                )
            by_category[name] = by_share
        result["guards"][parent_name] = {
            "parent_shares": previous,
            "target_fpr": target_fpr,
            "confidence": confidence,
            "categories": by_category,
        }
    return result


def _measure(
    guard: SafetyGuard,
    name: str,
    held_out: dict[tuple[int, str], torch.Tensor],
    validation: SourceRows,
    unseen_chat: list[int],
) -> dict[str, Any]:
    """What ``guard`` flags: the category's held-out rows (by the guard, by the new head ``name``), each unsafe
    source's validation rows, the validation chat that set no threshold and each benign domain's validation rows."""
    threshold = dict(zip(guard.budget.heads, guard.budget.thresholds))
    own = guard(held_out)
    out = guard(validation.features)
    flagged = out.flagged
    by_new = out.head_scores[name] > threshold[name]
    sources = sorted({s for s, label in zip(validation.sources, validation.labels.tolist()) if label == 1})
    caught = {}
    for source in sources:
        mask = torch.tensor(validation.where(source=source, label=1))
        caught[source] = {
            "rows": int(mask.sum()),
            "caught": int(flagged[mask].sum()),
            "by_new_head": int(by_new[mask].sum()),
        }
    rates = [caught[s]["caught"] / caught[s]["rows"] for s in EVAL_SOURCES]
    unsafe = validation.labels == 1
    domains = {}
    for domain in sorted({d for d in validation.domains if d != "unsafe"}):
        mask = torch.tensor(validation.where(domain=domain))
        domains[domain] = {
            "rows": int(mask.sum()),
            "flagged": int(flagged[mask].sum()),
            "by_new_head": int(by_new[mask].sum()),
        }
    chat_index = torch.tensor(unseen_chat)
    return {
        "category": float(own.flagged.double().mean()),
        "category_by_new_head": float((own.head_scores[name] > threshold[name]).double().mean()),
        "category_rows": int(own.flagged.numel()),
        "unsafe_median": statistics.median(rates),
        "unsafe_worst": min(rates),
        "unsafe_all": {"rows": int(unsafe.sum()), "caught": int(flagged[unsafe].sum())},
        "sources": caught,
        "unseen_chat": {"rows": len(unseen_chat), "flagged": int(flagged[chat_index].sum())},
        "domains": domains,
    }
