"""How much a guard taught a user's traffic depends on the sample the user brings.

``hf-lsad teach`` (:func:`hf_lsad.guard.heads.training.teach_traffic`) cuts the user's prompts in two by a seeded
permutation: ``fit_fraction`` of them join the supervised head's fit, the rest set the thresholds at the guard's
budget. :mod:`studies.own_traffic` measures that rule (``part of your traffic in the fit``) once, with every
validation row of the held-out domain as the sample. A user brings a few hundred prompts, and at 95% confidence
the thresholds on a few hundred rows are set by their top one or two scores. This study measures the spread. For
each benign domain ``D`` held out and each sample size ``n``:

- ``draws`` samples of ``n`` rows of ``D``'s validation split, each drawn by a seeded permutation (seed ``draw``),
  playing the prompts a user brings;
- each sample cut by ``teach_traffic``'s own cut (:func:`hf_lsad.guard.heads.training.cut_traffic`, the first
  ``round(fit_fraction * n)`` rows of a seeded permutation taught, seed ``draw``);
- the supervised head fitted on the fit rows of every pool but ``D`` and the taught rows (``D``'s sources weighed
  as every source is), the anomaly head the paper guard as shipped, the thresholds on the rows held back with the
  shipped budget and confidence;
- under each draw, as in :mod:`studies.own_traffic`: the thresholds, the flag rate of ``D``'s test rows and of the
  test chat, and the TPR of each unsafe source's test rows; and over the draws, the lowest, median and highest of
  each figure. A size larger than ``D``'s validation split is skipped and the entry says so; a draw whose rows
  held back are too few for the confidence gives the budget's refusal.

With ``remedy = "set_budget"`` the same draws measure ``hf-lsad set-budget``
(:meth:`hf_lsad.guard.SafetyGuard.fit_budget` on the user's prompts): the supervised head fitted once per held-out
domain on the fit rows of every other pool, and the thresholds of each draw set on the whole sample.

It chooses nothing and changes no release: it says how many prompts a user should bring to ``teach`` and to
``set-budget``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

from hf_lsad.core.splits import seeded_parts
from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import EVAL_SOURCES, THRESHOLD_DOMAIN, load_source_rows
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.training import cut_traffic

from .own_traffic import describe_rule, measure_rule
from .two_heads import anomaly_lookup, anomaly_scores, fit_supervised, probe_config, two_headed

SPREAD_FIGURES = ("domain_fpr", "chat_fpr", "median_tpr", "worst_tpr")
"""The figures whose lowest, median and highest over the draws are reported."""


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    anomaly_guard: str = "hf_lsad/guards/smollm2-135m-instruct-paper"
    """The paper's guard whose detector is the anomaly head (its read must be collected under ``folder``)."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]]
    )
    """The supervised head's reads (the shipped four)."""
    kind: str = "mlp"
    """The supervised head's kind (the shipped one)."""
    mlp_units: int = 256
    """An ``mlp`` head's hidden ReLU units (the shipped width)."""
    mlp_alpha: float = 0.1
    """An ``mlp`` head's L2 penalty (the shipped one)."""
    mlp_members: int = 3
    """An ``mlp`` head's fits whose logits are averaged (the shipped three)."""
    inverse_regularisation: float = 1.0
    """A ``logistic`` head's ``C``."""
    anomaly_share: float = 0.05
    """The anomaly head's share of the budget (the shipped one)."""
    target_fpr: float = 0.05
    """The budget: the combined flag rate on the rows held back (``teach``'s default, the guard's)."""
    confidence: float | None = 0.95
    """The budget's confidence (the shipped one, which ``teach`` keeps; ``None``: the plain quantile)."""
    remedy: Literal["teach", "set_budget"] = "teach"
    """What the user does with the sample: ``teach`` (part taught to the head, the rest sets the thresholds) or
    ``set_budget`` (the whole sample sets the thresholds of the head fitted without the domain)."""
    fit_fraction: float = 0.6
    """The part of each sample taught to the head under ``teach`` (its default)."""
    sample_sizes: list[int] = field(default_factory=lambda: [300, 1000])
    """How many prompts the user brings."""
    draws: int = 5
    """Samples drawn for each size (seeds ``0 .. draws - 1``)."""
    domains: list[str] = field(default_factory=lambda: ["chat", "task_prompts", "benign_ood"])
    """The benign domains held out one at a time, each playing the user's own traffic."""
    sources: list[str] = field(default_factory=lambda: list(EVAL_SOURCES))
    """The unsafe sources whose test rows give the TPR."""
    seed: int = 0
    """Seed of the row splits and of the head's fits."""


def run(settings: Settings) -> dict[str, Any]:
    if settings.remedy not in ("teach", "set_budget"):
        raise ValueError(f"remedy must be 'teach' or 'set_budget', got {settings.remedy!r}")
    guard = SafetyGuard.from_pretrained(settings.anomaly_guard)
    config = probe_config(settings)
    rows = load_source_rows(
        settings.folder, settings.pools, sorted({guard.reads[0], *config.reads}), seed=settings.seed
    )
    anomaly_of = anomaly_lookup(dict(zip(rows.ids, anomaly_scores(guard, rows.features, "probability").tolist())))
    shares = [settings.anomaly_share, 1 - settings.anomaly_share]
    test_chat = rows.select(rows.where(split="test", domain=THRESHOLD_DOMAIN))
    source_test = {source: rows.select(rows.where(split="test", source=source)) for source in settings.sources}
    results: dict[str, Any] = {"domains": {}}
    for domain in settings.domains:
        own = [i for i, (s, d) in enumerate(zip(rows.splits, rows.domains)) if s == "validation" and d == domain]
        domain_test = rows.select(rows.where(split="test", domain=domain))
        entry: dict[str, Any] = {"validation_rows": len(own), "test_rows": len(domain_test), "sizes": {}}
        without_domain = [s == "fit" and d != domain for s, d in zip(rows.splits, rows.domains)]
        if settings.remedy == "set_budget":  # one head for every draw: only the thresholds move with the sample
            print(f"hold out {domain}: fit without it", flush=True)
            held_out_scores = two_headed(anomaly_of, fit_supervised(rows.select(without_domain), config))
        for size in settings.sample_sizes:
            if size > len(own):
                entry["sizes"][str(size)] = {"error": f"{domain} has {len(own)} validation rows, fewer than {size}"}
                continue
            draws = []
            for draw in range(settings.draws):
                print(f"hold out {domain}: {size} prompts, draw {draw}", flush=True)
                sample = [own[i] for i in seeded_parts(len(own), [size], draw)[0].tolist()]
                if settings.remedy == "set_budget":
                    taught, held_back = set(), set(sample)
                    scores = held_out_scores
                else:
                    taught, held_back = map(set, cut_traffic(sample, settings.fit_fraction, draw))
                    in_fit = [without_domain[i] or i in taught for i in range(len(rows))]
                    scores = two_headed(anomaly_of, fit_supervised(rows.select(in_fit), config))
                reference = rows.select([i in held_back for i in range(len(rows))])
                measured = measure_rule(
                    scores,
                    reference,
                    settings.target_fpr,
                    shares,
                    settings.confidence,
                    domain_test,
                    test_chat,
                    source_test,
                )
                print(f"  {describe_rule(measured, domain)}", flush=True)
                draws.append({"draw": draw, "taught_rows": len(taught), **measured})
            entry["sizes"][str(size)] = {"draws": draws, "spread": spread(draws)}
        results["domains"][domain] = entry
    return results


def spread(draws: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the draws whose thresholds could be set: the lowest, median and highest of each figure and of each
    head's threshold, and how many draws the budget refused."""
    measured = [d for d in draws if "error" not in d]
    out: dict[str, Any] = {"refused": len(draws) - len(measured)}
    if not measured:
        return out
    columns = {name: [d[name] for d in measured] for name in SPREAD_FIGURES}
    for head, _ in enumerate(measured[0]["thresholds"]):
        columns[f"threshold_{head}"] = [d["thresholds"][head] for d in measured]
    for name, values in columns.items():
        out[name] = {"lowest": min(values), "median": statistics.median(values), "highest": max(values)}
    return out
