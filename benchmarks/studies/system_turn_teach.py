"""A harm head fitted under the deployment's own system turn: what teaching the head under that turn gives back.

``heads/system_turns_budget`` measured the released guard under system turns it was never fitted or thresholded
under: thresholds re-set under the turn (``hf-lsad set-budget --system``) bring the chat rate back, not all the harm
caught (under a support bot's validation turn, do-not-answer 0.30). A head fitted under many turns learnt the turn
as a feature instead. What is left is what ``hf-lsad teach`` does for a user's traffic, done for the user's turn:
fit the head again with every bundled row formatted under the one turn the deployment uses.

For each judged turn ``T`` this study fits the release's configuration (:data:`~.system_turns.HARM_PROBE`) on a
seeded ``share`` of each source's fit rows (each source still weighs alike), twice:

- **default turn**: the picked rows as the stores hold them, under the template's default turn (one fit, judged
  under every turn: the released recipe on fewer rows, so that the comparison below differs in the turn alone);
- **under the turn**: the same rows, each formatted under ``T`` (collected here, one fit per turn).

Each decides beside the released anomaly head at the released budget, with the thresholds set on the validation chat
under ``T`` (as ``set-budget --system`` would set them), and is judged on the rows :func:`~.system_turns.judged_rows`
picks (every chat and look-alike row, a seeded draw of each unsafe source) under ``T``: each source's TPR, median and
worst, and the look-alikes' and chat's flag rates. Under a validation turn the chat that sets the thresholds is the
judged chat, flagged at the budget's rate by construction; under a test turn it is the validation chat under ``T``
and the judged chat is the test split's. The released head at the same thresholds is reported beside both, and the
"default turn" head under the default turn gives the level the recipe reaches where it was fitted.

The features under a turn are kept in the cache of ``heads/system_turns`` (its judged rows are read from there).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import Read, SourceRows, load_source_rows, threshold_at, threshold_reference
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads import SupervisedHead
from hf_lsad.guard.heads.training import fit_head
from hf_lsad.guard.threshold import union_flag_rate

from . import system_turns
from .system_turns import HARM_PROBE, TurnCollector, cached_reads, judged_rows, load_turns, rates
from .two_heads import anomaly_scores


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """The stores of every pool under the template's default turn (``<folder>/<pool>/layer<L>-<position>``)."""
    cache: str = "artifacts/system_turns"
    """Where the features of rows under a system turn are kept between runs (shared with ``heads/system_turns``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools fitted on and judged (the release's)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard: its anomaly head, its budget, and its harm head for reference."""
    model: str = "default"
    """The model read (the bundled SmolLM2-135M-Instruct)."""
    turns: str = "benchmarks/studies/system_turns.json"
    """The system turns: ``validation`` and ``test`` lists (``train`` is not read here)."""
    test_turns: list[int] = field(default_factory=lambda: [1])
    """Which of the ``test`` turns are judged (indices; each costs a collection of the picked fit rows)."""
    share: float = 0.2
    """Share of each source's fit rows both heads are fitted on (seeded; at least one row per source)."""
    rows_per_source: int = 60
    """Rows drawn per unsafe source for each judged split (seeded; those ``heads/system_turns`` cached)."""
    judged_domains: list[str] = field(default_factory=lambda: ["chat", "lookalike"])
    """The benign domains whose every row of a judged split is judged under each turn."""
    max_batch_tokens: int = 4096
    """Padded tokens a forward pass holds at most."""
    seed: int = 0
    """Seed of the picked fit rows and of the draws."""


def _turn_settings(settings: Settings) -> system_turns.Settings:
    """The settings under which ``heads/system_turns`` collected and cached the judged rows (the same draws)."""
    return system_turns.Settings(
        folder=settings.folder,
        cache=settings.cache,
        pools=list(settings.pools),
        guard=settings.guard,
        model=settings.model,
        turns=settings.turns,
        rows_per_source=settings.rows_per_source,
        judged_domains=list(settings.judged_domains),
        max_batch_tokens=settings.max_batch_tokens,
        seed=settings.seed,
    )


def picked_fit_rows(rows: SourceRows, share: float, seed: int) -> list[int]:
    """Row indices of a seeded ``share`` of each source's fit rows (at least one per source), in row order."""
    rng = random.Random(f"{seed}-teach")
    picks: list[int] = []
    for source in sorted(set(rows.sources)):
        index = [i for i, (s, split) in enumerate(zip(rows.sources, rows.splits)) if s == source and split == "fit"]
        if index:
            picks += rng.sample(index, max(1, round(share * len(index))))
    return sorted(picks)


def run(settings: Settings) -> dict[str, Any]:
    if not 0 < settings.share <= 1:
        raise ValueError(f"share must be in (0, 1], got {settings.share}")
    turn_settings = _turn_settings(settings)
    turns = load_turns(turn_settings)
    judged_turns = {"validation": turns["validation"], "test": [turns["test"][i] for i in settings.test_turns]}
    guard = SafetyGuard.from_pretrained(settings.guard)
    if guard.budget is None:
        raise ValueError(f"{settings.guard} has no budget")
    budget = guard.budget
    reads = cached_reads(guard)
    rows = load_source_rows(settings.folder, settings.pools, reads, seed=settings.seed)
    collect = TurnCollector(turn_settings, reads)
    picks = picked_fit_rows(rows, settings.share, settings.seed)
    picked = rows.select(set_of(picks, len(rows)))
    print(f"fit rows picked: {len(picks)} of {sum(split == 'fit' for split in rows.splits)}", flush=True)
    results: dict[str, Any] = {"fit_rows": len(picks), "turns": judged_turns, "splits": {}}

    def fit(features: dict[Read, torch.Tensor]) -> SupervisedHead:
        """The release's configuration on the picked rows (``features`` in their order)."""
        return fit_head("harm", features, picked.labels, picked.sources, HARM_PROBE)

    def scores(head: SupervisedHead, features: dict[Read, torch.Tensor]) -> torch.Tensor:
        """``[n, 2]``: the released anomaly head's calibrated probability beside ``head``'s score."""
        with torch.no_grad():
            return torch.stack([anomaly_scores(guard, features, "probability"), head(features).float()], dim=1)

    def thresholds_on(head: SupervisedHead, features: dict[Read, torch.Tensor]) -> list[float]:
        """The thresholds the released budget (target, shares, confidence) sets on these benign rows."""
        return threshold_at(scores(head, features), budget.target_fpr, budget.shares, budget.confidence)

    def judge(
        head: SupervisedHead, index: list[int], features: dict[Read, torch.Tensor], thresholds: list[float]
    ) -> dict[str, Any]:
        flagged = (scores(head, features) > torch.tensor(thresholds)).any(1)
        return {"thresholds": thresholds, **rates(rows, index, flagged)}

    default_head = fit(picked.features)
    released = cast(SupervisedHead, guard.heads["harm"])
    chat = threshold_reference(rows)
    chat_index = [i for i, (s, d) in enumerate(zip(rows.splits, rows.domains)) if s == "validation" and d == "chat"]
    for split in ("validation", "test"):
        index = judged_rows(rows, split, turn_settings)
        default_features = {read: rows.features[read][index] for read in reads}
        default_thresholds = thresholds_on(default_head, chat.features)
        entry: dict[str, Any] = {
            "default turn head, under the default turn": judge(
                default_head, index, default_features, default_thresholds
            )
        }
        for turn in judged_turns[split]:
            features = collect(rows, index, turn, split)
            if split == "validation":  # the judged chat under the turn sets the thresholds
                at = {i: k for k, i in enumerate(index)}
                reference = {read: v[[at[i] for i in chat_index]] for read, v in features.items()}
            else:
                reference = collect(rows, chat_index, turn, "reference")
            turned_head = fit(collect(rows, picks, turn, "teach"))
            heads = {"released": released, "default turn": default_head, "under the turn": turned_head}
            entry[turn] = {
                name: judge(head, index, features, thresholds_on(head, reference)) for name, head in heads.items()
            }
            entry[turn]["under the turn"]["validation_chat_fpr"] = union_flag_rate(
                scores(turned_head, reference), entry[turn]["under the turn"]["thresholds"]
            )
            print(
                f"{split} {turn[:40]!r}: "
                + json.dumps({n: [r["median_tpr"], r["worst_tpr"], r["domains"]] for n, r in entry[turn].items()}),
                flush=True,
            )
        for name in ("released", "default turn", "under the turn"):
            under = [entry[t][name] for t in judged_turns[split]]
            entry.setdefault("summary over turns", {})[name] = {
                "mean_worst_tpr": statistics.mean(r["worst_tpr"] for r in under),
                "mean_median_tpr": statistics.mean(r["median_tpr"] for r in under),
                "highest_fpr": {d: max(r["domains"][d]["fpr"] for r in under) for d in settings.judged_domains},
            }
        results["splits"][split] = entry
    return results


def set_of(index: list[int], n: int) -> list[bool]:
    """``[n]`` booleans: ``True`` at the rows of ``index``."""
    chosen = set(index)
    return [i in chosen for i in range(n)]
