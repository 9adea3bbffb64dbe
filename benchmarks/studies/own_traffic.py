"""Traffic the guard never saw: thresholds on bundled chat, or on a sample of that traffic itself.

A user whose traffic is unlike every bundled benign domain meets the guard as leave-one-domain-out measures it: a
held-out benign domain is flagged at 13-53% at thresholds set on chat (``heads/report``). The remedy a user has
without refitting is :meth:`hf_lsad.guard.SafetyGuard.fit_budget` on a sample of their own benign traffic. This
study measures what that gives and what it costs. For each benign domain ``D`` held out:

- the two-headed guard is fitted as shipped but without ``D``: the supervised head on the fit rows of every other
  pool, the anomaly head the paper guard as shipped, the anomaly head's share of the budget as shipped;
- **bundled chat**: thresholds on validation chat with the shipped budget (for ``D`` = chat, on the other benign
  domains' validation rows, as the protocol of :mod:`hf_lsad.evaluation.sources` does);
- **your traffic**: thresholds on ``D``'s validation rows, the same budget (and with the plain quantile, for a
  domain with too few rows for the confidence: the budget refuses those, and the entry says so);
- **your traffic in the fit** (``fit_on_sample``): the supervised head fitted again with ``D``'s validation rows
  beside the fit rows of every other pool (``D``'s sources weighed as every source is), thresholds on bundled chat
  as in the first rule: the same sample taught to the head instead of used for the thresholds;
- **part of your traffic in the fit** (``fit_on_sample_part``): the sample cut in two by the hash of the row splits
  with seed ``seed + 1`` (its ``fit`` part, about 60%, into the head's fit as above; the rest sets the thresholds,
  with the budget's confidence and with the plain quantile): both remedies at once, each on its own rows;
- under each, the flag rate of ``D``'s test rows, of the test chat rows, and the TPR of each unsafe source's test
  rows. The unsafe sources are all in the fit (only the benign domain is held out), so these TPRs say what moving
  the thresholds costs on familiar harm; leave-one-source-out says what to expect of an unfamiliar source.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from hf_lsad.core.splits import split_of
from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import (
    EVAL_DOMAINS,
    EVAL_SOURCES,
    THRESHOLD_DOMAIN,
    SourceRows,
    load_source_rows,
    threshold_at,
    threshold_reference,
)
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import drawn_fit_rows
from hf_lsad.guard.threshold import union_flag_rate

from .two_heads import anomaly_lookup, anomaly_scores, fit_supervised, probe_config, two_headed


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    anomaly_guard: str = "hf_lsad/guards/smollm2-135m-instruct-paper"
    """The paper's guard whose detector is the anomaly head (its read must be collected under ``folder``)."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"]]
    )
    """The supervised head's reads (by default the three reads shipped before ``heads/two_heads_deep_reads4``; the
    experiments of the shipped guard set its four)."""
    kind: str = "mlp"
    """The supervised head's kind (the shipped one)."""
    mlp_units: int = 256
    """An ``mlp`` head's hidden ReLU units (the shipped width)."""
    mlp_alpha: float = 0.1
    """An ``mlp`` head's L2 penalty (the shipped one)."""
    mlp_members: int = 1
    """An ``mlp`` head's fits whose logits are averaged (``ProbeConfig.mlp_members``)."""
    inverse_regularisation: float = 1.0
    """A ``logistic`` head's ``C``."""
    anomaly_share: float = 0.1
    """The anomaly head's share of the budget (the shipped one)."""
    target_fpr: float = 0.05
    """The budget: the combined flag rate on the rows the thresholds are set on."""
    confidence: float | None = 0.95
    """The budget's confidence (the shipped one; ``None``: the plain quantile)."""
    fit_on_sample: bool = False
    """Also fit the supervised head with the domain's validation rows (the user's sample) and set the thresholds on
    bundled chat (the rule ``your traffic in the fit``)."""
    fit_on_sample_part: bool = False
    """Also fit the supervised head with about 60% of the domain's validation rows and set the thresholds on the rest
    (the rules ``part of your traffic in the fit``)."""
    rows_per_pool: int | None = None
    """With ``fit_on_sample_part``: beside the taught part, only the fit rows of each other pool that ``hf-lsad teach
    --rows-per-pool`` draws with ``--seed`` equal to ``seed`` (``drawn_fit_rows``; ``None``: every fit row, as
    released)."""
    domains: list[str] = field(default_factory=lambda: list(EVAL_DOMAINS))
    """The benign domains held out one at a time, each playing the user's own traffic."""
    sources: list[str] = field(default_factory=lambda: list(EVAL_SOURCES))
    """The unsafe sources whose test rows give the TPR."""
    seed: int = 0
    """Seed of the row splits."""


def run(settings: Settings) -> dict[str, Any]:
    if settings.rows_per_pool is not None and not settings.fit_on_sample_part:
        raise ValueError("rows_per_pool draws the fit rows of the rule fit_on_sample_part, which is not asked for")
    guard = SafetyGuard.from_pretrained(settings.anomaly_guard)
    config = probe_config(settings)
    rows = load_source_rows(
        settings.folder, settings.pools, sorted({guard.reads[0], *config.reads}), seed=settings.seed
    )
    anomaly_of = anomaly_lookup(dict(zip(rows.ids, anomaly_scores(guard, rows.features, "probability").tolist())))
    shares = [settings.anomaly_share, 1 - settings.anomaly_share]
    test_chat = rows.select(rows.where(split="test", domain=THRESHOLD_DOMAIN))
    results: dict[str, Any] = {"domains": {}}
    for domain in settings.domains:
        print(f"hold out domain {domain}", flush=True)
        train = rows.select([s == "fit" and d != domain for s, d in zip(rows.splits, rows.domains)])
        scorers = {"held out": two_headed(anomaly_of, fit_supervised(train, config))}
        bundled = threshold_reference(rows, domain)
        own = rows.select(rows.where(split="validation", domain=domain))
        rules = [
            ("bundled chat", "held out", bundled, settings.confidence),
            ("your traffic", "held out", own, settings.confidence),
            ("your traffic, quantile", "held out", own, None),
        ]
        if settings.fit_on_sample:
            print("  fit again with the sample", flush=True)
            sample_in_fit = [
                (s == "fit" and d != domain) or (s == "validation" and d == domain)
                for s, d in zip(rows.splits, rows.domains)
            ]
            scorers["sample in fit"] = two_headed(anomaly_of, fit_supervised(rows.select(sample_in_fit), config))
            rules.append(("your traffic in the fit", "sample in fit", bundled, settings.confidence))
        if settings.fit_on_sample_part:
            print("  fit again with part of the sample", flush=True)
            part = [split_of(i, settings.seed + 1) == "fit" for i in rows.ids]
            drawn = None
            if settings.rows_per_pool is not None:
                drawn = {
                    p.id for pool in settings.pools for p in drawn_fit_rows(pool, settings.rows_per_pool, settings.seed)
                }
            part_in_fit = [
                (s == "fit" and d != domain and (drawn is None or i in drawn))
                or (s == "validation" and d == domain and taught)
                for i, s, d, taught in zip(rows.ids, rows.splits, rows.domains, part)
            ]
            scorers["part in fit"] = two_headed(anomaly_of, fit_supervised(rows.select(part_in_fit), config))
            rest = rows.select(
                [
                    s == "validation" and d == domain and not taught
                    for s, d, taught in zip(rows.splits, rows.domains, part)
                ]
            )
            rules.append(("part of your traffic in the fit", "part in fit", rest, settings.confidence))
            rules.append(("part of your traffic in the fit, quantile", "part in fit", rest, None))
        domain_test = rows.select(rows.where(split="test", domain=domain))
        source_test = {source: rows.select(rows.where(split="test", source=source)) for source in settings.sources}
        entry: dict[str, Any] = {"validation_rows": len(own), "test_rows": len(domain_test)}
        for rule, fitted, reference, confidence in rules:
            entry[rule] = measure_rule(
                scorers[fitted], reference, settings.target_fpr, shares, confidence, domain_test, test_chat, source_test
            )
            print(f"  {rule}: {describe_rule(entry[rule], domain)}", flush=True)
        results["domains"][domain] = entry
    return results


def measure_rule(
    scores: Callable[[SourceRows], Tensor],
    reference: SourceRows,
    target_fpr: float,
    shares: list[float],
    confidence: float | None,
    domain_test: SourceRows,
    test_chat: SourceRows,
    source_test: dict[str, SourceRows],
) -> dict[str, Any]:
    """Thresholds set on ``reference`` rows by the budget (``target_fpr`` split by ``shares``, with ``confidence``),
    and at them: the held-out domain's test rows flagged, the test chat flagged and each unsafe source's TPR. A
    reference with too few rows for the confidence gives the budget's refusal instead: said, not worked around."""
    try:
        thresholds = threshold_at(scores(reference), target_fpr, shares, confidence)
    except ValueError as error:
        return {"threshold_rows": len(reference), "error": str(error)}
    tprs = {source: union_flag_rate(scores(values), thresholds) for source, values in source_test.items()}
    return {
        "thresholds": thresholds,
        "threshold_rows": len(reference),
        "confidence": confidence,
        "domain_fpr": union_flag_rate(scores(domain_test), thresholds),
        "chat_fpr": union_flag_rate(scores(test_chat), thresholds),
        "sources": tprs,
        "median_tpr": statistics.median(tprs.values()),
        "worst_tpr": min(tprs.values()),
    }


def describe_rule(entry: dict[str, Any], domain: str) -> str:
    """One line of progress for a :func:`measure_rule` entry."""
    if "error" in entry:
        return entry["error"]
    return (
        f"{domain} flagged {entry['domain_fpr']:.3f}, test chat {entry['chat_fpr']:.3f}, "
        f"TPR median {entry['median_tpr']:.2f} / worst {entry['worst_tpr']:.2f}"
    )
