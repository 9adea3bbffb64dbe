"""How a benign domain the head never saw is flagged as the number of benign domains in its fit grows.

Leave-one-benign-domain-out (:mod:`hf_lsad.evaluation.sources`) holds one benign domain out of the supervised head's
fit and measures its flag rate at thresholds set on held-out chat. Here the other benign domains are also taken out,
all but ``k`` of them, for every ``k``: the curve of that flag rate against ``k`` says how much each benign domain the
fit knows buys on one it does not, and so what kind of data the leave-one-domain-out target asks for. The study
chooses nothing.

- **Held out** is one domain of ``held_out_domains``; its ``evaluate_on`` rows give the flag rate.
- **The fit** holds the fit rows of every unsafe source and of ``k`` benign domains. Chat, on which the thresholds
  are set, is always one of them unless it is the domain held out; the others are subsets of the remaining domains
  (all of them when few, else ``subsets_per_count`` drawn with ``seed``).
- **Thresholds** are set at 5% and 1% on validation chat; when chat is held out, on the validation rows of the
  benign domains in the fit (with all of them, this is the protocol's own reference).
- **Harm caught** at the same thresholds: the share of the unsafe ``evaluate_on`` rows flagged, per source, with the
  median over sources. Every unsafe source is in the fit, so this is seen harm: a check that the head still catches
  what it was taught, not a figure for a new source.

With every domain in the fit (the largest ``k``) the flag rates are the supervised head's leave-one-domain-out figures
of the protocol.
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import (
    BENIGN_DOMAINS,
    EVAL_DOMAINS,
    THRESHOLD_DOMAIN,
    SourceRows,
    load_source_rows,
    threshold_at,
)

from .two_heads import fit_supervised, probe_config


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]]
    )
    """The supervised head's reads."""
    inverse_regularisation: float = 1.0
    """A ``logistic`` head's ``C``."""
    kind: str = "mlp"
    """The supervised head's kind: ``logistic`` or ``mlp`` (:class:`hf_lsad.guard.heads.ProbeConfig`)."""
    mlp_units: int = 256
    """An ``mlp`` head's hidden ReLU units."""
    mlp_alpha: float = 0.1
    """An ``mlp`` head's L2 penalty."""
    mlp_members: int = 3
    """An ``mlp`` head's fits whose logits are averaged."""
    held_out_domains: list[str] = field(default_factory=lambda: list(EVAL_DOMAINS))
    """The benign domains held out one at a time."""
    subsets_per_count: int = 4
    """At most this many subsets of the other benign domains for each ``k`` (drawn with ``seed`` if there are more)."""
    evaluate_on: str = "validation"
    """The split whose rows of the held-out domain and of the unsafe sources are counted."""
    seed: int = 0
    """Seed of the row splits and of the subsets drawn."""


def subsets(domains: list[str], fixed: list[str], limit: int, rng: random.Random) -> list[list[str]]:
    """Every benign-domain set of the fit: ``fixed`` plus ``k`` of ``domains`` for each ``k`` (at least one domain in
    all), at most ``limit`` of each size, drawn by ``rng`` when there are more."""
    out = []
    for k in range(0, len(domains) + 1):
        if not fixed and k == 0:
            continue
        choices = [list(c) for c in itertools.combinations(domains, k)]
        if len(choices) > limit:
            choices = rng.sample(choices, limit)
        out.extend(sorted(fixed + c) for c in choices)
    return out


def reference_rows(rows: SourceRows, held_out: str, fit_domains: list[str]) -> SourceRows:
    """Validation chat; with chat held out, the validation rows of the benign domains in the fit."""
    if held_out != THRESHOLD_DOMAIN:
        return rows.select(rows.where(split="validation", domain=THRESHOLD_DOMAIN))
    return rows.select([s == "validation" and d in fit_domains for s, d in zip(rows.splits, rows.domains)])


def run(settings: Settings) -> dict[str, Any]:
    config = probe_config(settings)
    rows = load_source_rows(settings.folder, settings.pools, config.reads, seed=settings.seed)
    domains = sorted({BENIGN_DOMAINS[p] for p in settings.pools if p in BENIGN_DOMAINS})
    rng = random.Random(settings.seed)
    evaluated_unsafe = rows.select(rows.where(split=settings.evaluate_on, label=1))
    unsafe_sources = sorted(set(evaluated_unsafe.sources))
    result: dict[str, Any] = {"rows": len(rows), "domains": domains, "held_out": {}}
    for held_out in settings.held_out_domains:
        others = [d for d in domains if d not in (held_out, THRESHOLD_DOMAIN)]
        fixed = [THRESHOLD_DOMAIN] if held_out != THRESHOLD_DOMAIN else []
        evaluated = rows.select(rows.where(split=settings.evaluate_on, domain=held_out))
        entries = []
        for fit_domains in subsets(others, fixed, settings.subsets_per_count, rng):
            train = rows.select(
                [s == "fit" and (d == "unsafe" or d in fit_domains) for s, d in zip(rows.splits, rows.domains)]
            )
            head = fit_supervised(train, config)
            reference = head(reference_rows(rows, held_out, fit_domains).features)
            held_out_scores, unsafe_scores = head(evaluated.features), head(evaluated_unsafe.features)
            entry: dict[str, Any] = {"fit_domains": fit_domains, "k": len(fit_domains)}
            for fpr in (0.05, 0.01):
                (threshold,) = threshold_at(reference, fpr)
                caught = unsafe_scores > threshold
                per_source = {
                    source: float(caught[torch.tensor(evaluated_unsafe.where(source=source))].double().mean())
                    for source in unsafe_sources
                }
                entry[f"fpr@{fpr:g}"] = float((held_out_scores > threshold).double().mean())
                entry[f"seen_harm_median_tpr@{fpr:g}"] = statistics.median(per_source.values())
                entry[f"seen_harm_worst_tpr@{fpr:g}"] = min(per_source.values())
            entries.append(entry)
            print(
                f"  {held_out} held out, fit on {'+'.join(fit_domains)}: flagged {entry['fpr@0.05']:.1%} "
                f"(seen harm median {entry['seen_harm_median_tpr@0.05']:.2f})",
                flush=True,
            )
        result["held_out"][held_out] = {
            "rows": len(evaluated),
            "subsets": entries,
            "mean_fpr_by_k": {
                str(k): statistics.mean(e["fpr@0.05"] for e in entries if e["k"] == k)
                for k in sorted({e["k"] for e in entries})
            },
        }
    counts = sorted({k for entry in result["held_out"].values() for k in map(int, entry["mean_fpr_by_k"])})
    result["median_over_domains_by_k"] = {
        str(k): statistics.median(
            entry["mean_fpr_by_k"][str(k)] for entry in result["held_out"].values() if str(k) in entry["mean_fpr_by_k"]
        )
        for k in counts
    }
    print(f"median over held-out domains of the mean flag rate at 5%, by k: {result['median_over_domains_by_k']}")
    return result
