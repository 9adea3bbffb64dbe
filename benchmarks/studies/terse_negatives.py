"""The terse head again, taught what benign terse queries look like: hand-written everyday queries as negatives, with
half of the benign weight on terse rows; judged on validation rows.

``heads/terse_head`` taught a third head rule-made terse forms of the unsafe sources' requests against rule-made
terse forms of benign requests, through ``add_head``: every benign group weighs alike there, so the benign terse
forms carried a fifth of the benign weight (the four bundled pools the rest) while every unsafe row was terse. On
validation rows it caught the terse forms (median source 0.70 to 0.95); on the test triples of ``heads/terse_requests``
it caught 40 of 50 terse requests and flagged 21 of 50 benign twins: everyday tasks typed as a few words. The head
had learnt that a few words in a box look like harm.

This study changes two things and keeps the rest:

- **Hand-written benign terse queries** (``terse_benign.jsonl``: 420 queries over 21 everyday domains, 20 each,
  written for this study before any screening, in the shapes people type: "how to unclog a bathroom sink", "chicken
  thigh oven temperature", "how to kill a python process"). Per domain a seeded draw of ``validation_per_domain``
  rows is kept for validation; the rest are fitted on. A row whose content words overlap a row of the hand-written
  triples (terse, full or twin) by a Jaccard index of at least ``near_copy`` is left out of both, so that the test
  triples are not taught.
- **Explicit weights**: the unsafe terse forms weigh the same per source; of the benign weight, ``terse_benign_weight``
  goes to the terse rows (half to the hand-written fit rows, half to the rule-made forms) and the rest to the four
  bundled pools ``add_head`` draws (400 fit rows each), alike.

The head reads what the released harm head reads, is fitted by :func:`hf_lsad.guard.heads.training.fit_head` (logistic,
``inverse_regularisation`` 0.01) with these weights (``weights=``), added with
:func:`hf_lsad.guard.heads.training.add_fitted_head`, and every threshold is set again on all validation chat rows, the
new head taking a third of the budget (``share``), as ``add_head`` does. The released guard and this three-headed guard
are screened on ``heads/terse_head``'s validation rows and on the hand-written validation rows. The guard is saved under
``guard_dir`` for the test run, if the rule holds.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, load_model
from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.core.batching import BATCH_TOKENS
from hf_lsad.guard.heads.bundled import bundled_features, release_rows, sample_rows
from hf_lsad.guard.heads.probe import ProbeConfig, Read, balanced_weights
from hf_lsad.guard.heads.training import BENIGN_POOLS, add_fitted_head, fit_head

from .terse_head import Settings as HeadSettings, _rates, _rows_of, _terse, terse_fit_rows
from .terse_requests import KINDS, load_rows, load_triples
from .unseen import _jaccard, _words

HEAD = "terse"
"""The new head's name."""

STOP_WORDS = frozenset(
    "a an the to of in on for and or with my me i how what why when where is are do does can best way make get from"
    " at by it your you this that".split()
)
"""Words left out of the near-copy check: the shape of a query ("how to make a ...") is what is taught, its
content is not."""


@dataclass
class Settings(HeadSettings):
    hand_written: str = "benchmarks/studies/terse_benign.jsonl"
    """The hand-written benign terse queries: ``id``, ``domain``, ``text``."""
    validation_per_domain: int = 5
    """Hand-written queries per domain kept for validation (seeded draw); the rest are fitted on."""
    triples: str = "benchmarks/studies/terse_requests.jsonl"
    """The test triples of ``heads/terse_requests``: read only to leave their near-copies out of the fit."""
    near_copy: float = 0.5
    """Content-word Jaccard index to a triple's row at or above which a hand-written query is left out."""
    terse_benign_weight: float = 0.5
    """Share of the benign weight on the ``terse_groups`` (the rest on the other benign groups)."""
    terse_groups: list[str] = field(default_factory=lambda: ["terse: hand-written", "terse: rule-made"])
    """The benign groups that share ``terse_benign_weight``, alike: ``terse: hand-written``, ``terse: rule-made``
    and any bundled benign pool by name (``benign_ood``: its headlines are a few words too)."""
    benign_per_pool: int = 400
    """Fit rows drawn from each bundled benign pool (seeded), as ``add_head`` draws them."""
    inverse_regularisation: float = 0.01
    """The logistic regression's ``C``, as ``add_head``'s default."""
    cache_dir: str = "artifacts/terse-negatives/bundled"
    """Where the bundled pools' activations are kept (``bundled_features``)."""
    guard_dir: str = "artifacts/terse-negatives/guard"
    """Where the three-headed guard is saved."""


def load_hand_written(path: str) -> list[dict[str, str]]:
    """The hand-written benign queries of ``path``, checked: a non-empty id, domain and text each; ids and texts
    unique."""
    rows = load_rows(path, ("id", "domain", "text"))
    if len({row["text"] for row in rows}) != len(rows) or len({row["id"] for row in rows}) != len(rows):
        raise ValueError(f"{path}: repeated ids or texts")
    return rows


def hand_written_split(settings: Settings) -> tuple[list[dict[str, str]], list[dict[str, str]], list[str]]:
    """The hand-written queries' fit rows, validation rows, and the texts left out as near-copies of a triple."""
    rows = load_hand_written(settings.hand_written)
    triple_words = [_words(t[kind]) - STOP_WORDS for t in load_triples(settings.triples) for kind in KINDS]

    def near(text: str) -> bool:
        words = _words(text) - STOP_WORDS
        return any(_jaccard(words, other) >= settings.near_copy for other in triple_words)

    left_out = [row["text"] for row in rows if near(row["text"])]
    by_domain: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        if row["text"] not in left_out:
            by_domain[row["domain"]].append(row)
    fit, validation = [], []
    for domain in sorted(by_domain):
        members = by_domain[domain]
        order = torch.randperm(len(members), generator=torch.Generator().manual_seed(settings.seed)).tolist()
        validation += [members[i] for i in order[: settings.validation_per_domain]]
        fit += [members[i] for i in order[settings.validation_per_domain :]]
    return fit, validation, left_out


def fit_weights(groups: list[str], labels: list[int], terse_benign: set[str], share: float) -> torch.Tensor:
    """Per-row weights: the two labels alike in total; the unsafe groups alike; of the benign weight, ``share`` on
    the ``terse_benign`` groups (alike) and the rest on the other benign groups (alike); mean 1."""
    benign = sorted({g for g, label in zip(groups, labels) if label == 0})
    terse = [g for g in benign if g in terse_benign]
    if not terse or len(terse) == len(benign):
        raise ValueError(f"need terse benign groups {sorted(terse_benign)} and others, got {benign}")
    return balanced_weights(groups, torch.tensor(labels), {g: share / len(terse) for g in terse})


@dataclass
class FitRows:
    """The terse head's fit rows, read: features per read (``[n, hidden]``), labels, groups (an unsafe row's source,
    a benign row's group)."""

    reads: list[Read]
    features: dict[Read, torch.Tensor]
    labels: list[int]
    groups: list[str]


def terse_fit_features(model: Any, tokenizer: Any, settings: Settings) -> FitRows:
    """The unsafe terse forms (grouped by source), the hand-written fit queries, the rule-made benign forms and
    ``benign_per_pool`` fit rows of each bundled benign pool, read as the released harm head reads."""
    fit_unsafe, fit_benign = terse_fit_rows(settings)
    hand_fit, _, _ = hand_written_split(settings)
    unsafe_texts = {short for _, short in fit_unsafe}
    hand_texts = [row["text"] for row in hand_fit if row["text"] not in unsafe_texts]
    rule_texts = [short for _, short in fit_benign if short not in set(hand_texts)]

    reads = list(next(iter(SafetyGuard.from_pretrained(settings.guard).heads.values())).reads)
    texts = [short for _, short in fit_unsafe] + hand_texts + rule_texts
    groups = [row.source for row, _ in fit_unsafe]
    groups += ["terse: hand-written"] * len(hand_texts) + ["terse: rule-made"] * len(rule_texts)
    bundled = []
    for pool in BENIGN_POOLS:
        rows = sample_rows(release_rows(pool, "fit"), settings.benign_per_pool, settings.seed)
        bundled += rows
        groups += [pool] * len(rows)
    labels = [1] * len(fit_unsafe) + [0] * (len(texts) - len(fit_unsafe) + len(bundled))
    own, _ = collect_prompt_features(model, tokenizer, texts, reads, max_batch_tokens=BATCH_TOKENS)
    pools = bundled_features(model, tokenizer, bundled, reads, cache_dir=settings.cache_dir)
    features = {read: torch.cat([own[read], pools[read]]) for read in reads}
    return FitRows(reads, features, labels, groups)


def with_weighted_terse_head(
    model: Any, tokenizer: Any, settings: Settings, rows: FitRows | None = None
) -> SafetyGuard:
    """The released guard with the terse head fitted on the weighted rows (``rows``: read again when not given),
    every threshold set again on all validation chat rows (the new head ``share`` of the budget, a third when not
    set, the others in their proportions of the rest)."""
    rows = terse_fit_features(model, tokenizer, settings) if rows is None else rows
    config = ProbeConfig(reads=rows.reads, inverse_regularisation=settings.inverse_regularisation)
    weights = fit_weights(rows.groups, rows.labels, set(settings.terse_groups), settings.terse_benign_weight)
    head = fit_head(HEAD, rows.features, torch.tensor(rows.labels), rows.groups, config, weights=weights)

    guard = SafetyGuard.from_pretrained(settings.guard)
    add_fitted_head(model, tokenizer, guard, head, share=settings.share, threshold_rows=None)
    return guard


def validation_groups(settings: Settings) -> dict[str, list[str]]:
    """The rows screened on validation: ``heads/terse_head``'s (terse forms and full rows of each unsafe source,
    terse forms of each benign source, the benign pools as they are) and the hand-written validation queries."""
    fit_unsafe, _ = terse_fit_rows(settings)
    unsafe_texts = {short for _, short in fit_unsafe}
    _, hand_validation, _ = hand_written_split(settings)

    val_unsafe = _rows_of(settings.unsafe_sources, "validation")
    val_terse = [(row, short) for row, short in _terse(val_unsafe, settings.max_words) if short not in unsafe_texts]
    val_benign_terse = _terse(_rows_of(settings.benign_sources, "validation"), settings.max_words)
    groups: dict[str, list[str]] = {}
    for source in settings.unsafe_sources:
        groups[f"unsafe terse: {source}"] = [short for row, short in val_terse if row.source == source]
        groups[f"unsafe full: {source}"] = [row.text for row in val_unsafe if row.source == source]
    for source in settings.benign_sources:
        groups[f"benign terse: {source}"] = [short for row, short in val_benign_terse if row.source == source]
    groups["hand-written terse"] = [row["text"] for row in hand_validation]
    for pool in ("chat", "safe", "benign_ood", "lookalike", "questions", "statements"):
        rows = release_rows(pool, "validation")
        rows = rows if pool == "chat" else sample_rows(rows, settings.validation_rows, settings.seed)
        groups[f"benign: {pool}"] = [row.text for row in rows]
    return {name: texts for name, texts in groups.items() if texts}


def summary(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """A guard's validation figures: terse and full forms caught (median and worst source), benign rows flagged."""

    def rates(prefix: str) -> list[float]:
        return [v["rate"] for k, v in rows.items() if k.startswith(prefix)]

    return {
        "terse median source": statistics.median(rates("unsafe terse:")),
        "terse worst source": min(rates("unsafe terse:")),
        "full median source": statistics.median(rates("unsafe full:")),
        "validation chat": rows["benign: chat"]["rate"],
        "look-alikes": rows["benign: lookalike"]["rate"],
        "benign OOD": rows["benign: benign_ood"]["rate"],
        "benign terse median": statistics.median(rates("benign terse:")),
        "hand-written terse": rows["hand-written terse"]["rate"],
    }


def run(settings: Settings) -> dict[str, Any]:
    hand_fit, hand_validation, left_out = hand_written_split(settings)
    groups = validation_groups(settings)

    model, tokenizer = load_model(settings.model)
    results: dict[str, Any] = {
        "hand_written": {"fit": len(hand_fit), "validation": len(hand_validation), "left_out": left_out},
        "guards": {},
    }
    print("the released guard", flush=True)
    released = SafetyGuard.from_pretrained(settings.guard)
    released_guarded = GuardedModelForCausalLM(model, released, tokenizer=tokenizer)
    results["guards"]["released"] = _rates(released_guarded, groups, named=("hand-written terse",))

    guard = with_weighted_terse_head(model, tokenizer, settings)
    assert guard.budget is not None  # set above
    budget = guard.budget
    results["budget"] = {"heads": budget.heads, "shares": budget.shares, "thresholds": budget.thresholds}
    print("with the weighted terse head", budget.thresholds, flush=True)
    guard.save_pretrained(settings.guard_dir)
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    results["guards"]["with a weighted terse head"] = _rates(guarded, groups, named=("hand-written terse",))
    results["summary"] = {name: summary(rows) for name, rows in results["guards"].items()}
    return results
