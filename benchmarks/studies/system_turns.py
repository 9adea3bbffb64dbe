"""A harm head fitted under many system turns: does its separation hold under system turns it never saw?

``heads/system_prompt`` found the released guard's verdicts moved by the system turn before the user's: under "You
are a helpful assistant." it lets 43% of do-not-answer's test rows through, and thresholds re-set under the turn
bring the chat rate back but not the harm caught (``heads/system_prompt_budget``). The released head was fitted on
prompts under the template's default turn only. This study fits the same head (the release's configuration,
:data:`HARM_PROBE`) twice on the fit rows of every pool, beside the released one:

- **default**: as released, every row under the template's default system turn (the stores under ``folder``);
- **released**: the bundled guard's own head, for reference (the stores were collected again since the release,
  and the refit's logits differ from it by ``refit_deviation`` on validation rows);
- **many turns**: the same rows plus a seeded ``augment_share`` of each source's fit rows again (``lookalike_share``
  of each benign look-alike source's), each under a system turn drawn from the ``train`` turns of ``turns``
  (collected here; each source weighs alike as before, so the copies change a source's style, not its weight).

Each decides beside the released anomaly head at the released budget: thresholds on validation chat under the
default turn (5%, shares 0.05 / 0.95, confidence 0.95), as the release sets them. Each is judged on the chat and
look-alike rows and a seeded draw of ``rows_per_source`` rows of each unsafe source, of the validation split under
each ``validation`` turn and of the test split under each ``test`` turn (no turn of either is a training turn), and
under the default turn (from the stores): the chat and look-alike flag rates and each source's TPR, median and
worst. Under the default turn, on validation rows, it also reports every benign domain's flag rate.

With ``reset_thresholds``, each turn's rows are also judged at thresholds re-set on validation chat under that
turn, as a deployment that sets its budget under its own turn would (``hf-lsad set-budget --system``).

The features of rows under a turn are collected once into ``artifacts/system_turns/`` (one file per split and
turn, named by a hash of the turn, the rows' ids and the reads) and read back on the next run.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import (
    EVAL_SOURCES,
    Read,
    SourceRows,
    load_source_rows,
    threshold_at,
    threshold_reference,
)
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads import ProbeConfig, SupervisedHead
from hf_lsad.guard.heads.training import fit_head
from hf_lsad.guard.threshold import union_flag_rate

from .two_heads import anomaly_scores

HERE = Path(__file__).resolve().parent
HARM_PROBE = ProbeConfig(
    reads=[(16, "prompt_mean"), (20, "prompt_mean"), (24, "prompt_mean"), (28, "prompt_mean")],
    kind="mlp",
    mlp_units=256,
    mlp_alpha=0.1,
    mlp_members=3,
)
"""The released harm head's configuration (``scripts/release_default_guard.py``)."""


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """The stores of every pool under the template's default turn (``<folder>/<pool>/layer<L>-<position>``)."""
    cache: str = "artifacts/system_turns"
    """Where the features of rows under a system turn are kept between runs."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools fitted on and judged (the release's)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard: its anomaly head, its budget, and its harm head for a check of the refit."""
    model: str = "default"
    """The model read (the bundled SmolLM2-135M-Instruct)."""
    turns: str = "benchmarks/studies/system_turns.json"
    """The system turns: ``train``, ``validation`` and ``test`` lists."""
    augment_share: float = 0.3
    """Share of each source's fit rows copied under a training turn (at least one row per source)."""
    rows_per_source: int = 60
    """Rows drawn per unsafe source for each judged split (seeded)."""
    judged_domains: list[str] = field(default_factory=lambda: ["chat", "lookalike"])
    """The benign domains whose every row of a judged split is judged under each turn."""
    max_batch_tokens: int = 4096
    """Padded tokens a forward pass holds at most."""
    seed: int = 0
    """Seed of the copies, their turns, and the draws."""
    lookalike_share: float | None = None
    """Share of each benign look-alike source's fit rows copied (``None``: ``augment_share``). The copies beyond
    ``augment_share`` are drawn after the others, with a generator of their own, so the others stay as they were."""
    reset_thresholds: bool = False
    """Also judge each turn's rows at thresholds re-set on the validation chat rows under that turn, as ``hf-lsad
    set-budget --system`` sets them (the released budget's target, shares and confidence): under a validation turn
    those are the judged chat rows themselves, so their flag rate is the budget's by construction; under a test turn,
    the validation chat collected under it."""


def cached_reads(guard: SafetyGuard) -> list[Read]:
    """The reads the cache of features under a turn holds (and is keyed by): the released guard's anomaly read and
    the harm head's."""
    return sorted({guard.reads[0], *HARM_PROBE.reads})


def load_turns(settings: Settings) -> dict[str, list[str]]:
    turns = json.loads((Path.cwd() / settings.turns).read_text())
    seen: set[str] = set()
    for split in ("train", "validation", "test"):
        for turn in turns[split]:
            if not turn.strip() or turn in seen:
                raise ValueError(f"{settings.turns}: turn {turn[:40]!r} is empty or repeated")
            seen.add(turn)
    return turns


def _augment_picks(rows: SourceRows, settings: Settings, n_turns: int) -> dict[int, list[int]]:
    """``{train turn index: row indices}``: a seeded ``augment_share`` of each source's fit rows, each given a turn."""
    rng = random.Random(settings.seed)
    by_turn: dict[int, list[int]] = {}
    for source in sorted(set(rows.sources)):
        index = [i for i, (s, split) in enumerate(zip(rows.sources, rows.splits)) if s == source and split == "fit"]
        if not index:
            continue
        for i in sorted(rng.sample(index, max(1, round(settings.augment_share * len(index))))):
            by_turn.setdefault(rng.randrange(n_turns), []).append(i)
    return by_turn


def _lookalike_picks(rows: SourceRows, settings: Settings, n_turns: int, taken: set[int]) -> dict[int, list[int]]:
    """``{train turn index: row indices}``: the look-alike fit rows copied beyond ``augment_share`` (none of
    ``taken``), up to ``lookalike_share`` of each look-alike source, each given a turn."""
    if settings.lookalike_share is None or settings.lookalike_share <= settings.augment_share:
        return {}
    rng = random.Random(f"{settings.seed}-lookalike")
    by_turn: dict[int, list[int]] = {}
    for source in sorted({s for s, d in zip(rows.sources, rows.domains) if d == "lookalike"}):
        index = [i for i, (s, split) in enumerate(zip(rows.sources, rows.splits)) if s == source and split == "fit"]
        free = [i for i in index if i not in taken]
        wanted = round(settings.lookalike_share * len(index)) - (len(index) - len(free))
        for i in sorted(rng.sample(free, max(0, min(wanted, len(free))))):
            by_turn.setdefault(rng.randrange(n_turns), []).append(i)
    return by_turn


def copies_under_turns(rows: SourceRows, settings: Settings, collect: TurnCollector) -> SourceRows:
    """The fit rows :func:`_augment_picks` draws, each again under its training turn: rows of split ``fit`` with the
    source, domain and label of the row copied, and ids ``<id>@<turn index>``."""
    turns = load_turns(settings)["train"]
    picks = _augment_picks(rows, settings, len(turns))
    taken = {i for index in picks.values() for i in index}
    groups = [("fit", picks), ("fit-lookalike", _lookalike_picks(rows, settings, len(turns), taken))]
    parts = []
    for name, by_turn in groups:
        for t, index in sorted(by_turn.items()):
            chosen = set(index)
            copied = rows.select([i in chosen for i in range(len(rows))])  # in row order, as index is sorted
            copied.features = collect(rows, index, turns[t], name)
            copied.ids = [f"{row_id}@{t}" for row_id in copied.ids]
            parts.append(copied)
    out = parts[0]
    for part in parts[1:]:
        out = join_rows(out, part)
    return out


def join_rows(first: SourceRows, second: SourceRows) -> SourceRows:
    """The rows of ``first`` then those of ``second`` (the same reads)."""
    if set(first.features) != set(second.features):
        raise ValueError(f"rows of other reads: {sorted(first.features)} and {sorted(second.features)}")
    return SourceRows(
        features={read: torch.cat([values, second.features[read]]) for read, values in first.features.items()},
        ids=first.ids + second.ids,
        texts=first.texts + second.texts,
        sources=first.sources + second.sources,
        domains=first.domains + second.domains,
        labels=torch.cat([first.labels, second.labels]),
        splits=first.splits + second.splits,
    )


def judged_rows(rows: SourceRows, split: str, settings: Settings) -> list[int]:
    """Row indices judged on ``split``: every row of the judged domains, then a seeded draw of each unsafe source."""
    domains = settings.judged_domains
    picks = [i for i, (s, d) in enumerate(zip(rows.splits, rows.domains)) if s == split and d in domains]
    rng = random.Random(settings.seed)
    for source in EVAL_SOURCES:
        index = [i for i, (s, src) in enumerate(zip(rows.splits, rows.sources)) if s == split and src == source]
        if not index:
            raise ValueError(f"no {split} row of source {source}")
        picks += sorted(rng.sample(index, min(settings.rows_per_source, len(index))))
    return picks


class TurnCollector:
    """Features of rows under a system turn: read from the cache, or collected with one model loaded once."""

    def __init__(self, settings: Settings, reads: list[Read]) -> None:
        self.settings, self.reads = settings, reads
        self.model: Any = None

    def __call__(self, rows: SourceRows, index: list[int], turn: str, name: str) -> dict[Read, torch.Tensor]:
        ids = [rows.ids[i] for i in index]
        key = hashlib.sha256(json.dumps([turn, ids, self.reads]).encode()).hexdigest()[:12]
        path = Path(self.settings.cache) / f"{name}-{key}.safetensors"
        if path.is_file():
            stored = load_file(str(path))
            return {read: stored[f"layer{read[0]}-{read[1]}"] for read in self.reads}
        if self.model is None:
            self.model, self.tokenizer = load_model(self.settings.model)
        print(f"collect {name}: {len(ids)} rows under {turn[:50]!r}", flush=True)
        features, _ = collect_prompt_features(
            self.model,
            self.tokenizer,
            [rows.texts[i] for i in index],
            self.reads,
            max_batch_tokens=self.settings.max_batch_tokens,
            system=turn,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({f"layer{r[0]}-{r[1]}": v.contiguous() for r, v in features.items()}, str(path), {"turn": turn})
        return features


def rates(rows: SourceRows, index: list[int], flagged: torch.Tensor) -> dict[str, Any]:
    """The flag rate of each benign domain and the TPR of each unsafe source among the rows ``index``."""
    out: dict[str, Any] = {"domains": {}, "sources": {}}
    for domain in sorted({rows.domains[i] for i in index} - {"unsafe"}):
        hits = [bool(f) for i, f in zip(index, flagged) if rows.domains[i] == domain]
        out["domains"][domain] = {"rows": len(hits), "fpr": sum(hits) / len(hits)}
    for source in EVAL_SOURCES:
        hits = [bool(f) for i, f in zip(index, flagged) if rows.sources[i] == source and rows.domains[i] == "unsafe"]
        out["sources"][source] = {"rows": len(hits), "tpr": sum(hits) / len(hits)}
    tprs = [v["tpr"] for v in out["sources"].values()]
    out["median_tpr"], out["worst_tpr"] = statistics.median(tprs), min(tprs)
    return out


def _summary(under_turns: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """Over the turns of a split: the mean worst and median source TPR, the highest and lowest benign flag rates."""
    return {
        "mean_worst_tpr": statistics.mean(r["worst_tpr"] for r in under_turns),
        "mean_median_tpr": statistics.mean(r["median_tpr"] for r in under_turns),
        "highest_fpr": {d: max(r["domains"][d]["fpr"] for r in under_turns) for d in settings.judged_domains},
        "lowest_fpr": {d: min(r["domains"][d]["fpr"] for r in under_turns) for d in settings.judged_domains},
    }


def run(settings: Settings) -> dict[str, Any]:
    turns = load_turns(settings)
    guard = SafetyGuard.from_pretrained(settings.guard)
    if guard.budget is None:
        raise ValueError(f"{settings.guard} has no budget")
    budget = guard.budget
    reads = cached_reads(guard)
    rows = load_source_rows(settings.folder, settings.pools, reads, seed=settings.seed)
    collect = TurnCollector(settings, reads)

    copies = copies_under_turns(rows, settings, collect)
    fit = rows.select(rows.where(split="fit"))
    augmented = join_rows(fit, copies)
    results: dict[str, Any] = {"fit_rows": len(fit), "copies": len(copies), "heads": {}}
    print(f"fit rows {len(fit)}, copies under a training turn {len(copies)}", flush=True)
    heads: dict[str, SupervisedHead] = {
        "default": fit_head("harm", fit.features, fit.labels, fit.sources, HARM_PROBE),
        "many turns": fit_head("harm", augmented.features, augmented.labels, augmented.sources, HARM_PROBE),
    }
    heads["released"] = cast(SupervisedHead, guard.heads["harm"])
    validation = rows.select(rows.where(split="validation"))
    with torch.no_grad():
        deviation = (heads["default"](validation.features) - heads["released"](validation.features)).abs()
    results["refit_deviation"] = {"largest": float(deviation.max()), "median": float(deviation.median())}
    print(f"refit against the released head, logit deviation on validation rows: {results['refit_deviation']}")

    def scores(head: SupervisedHead, features: dict[Read, torch.Tensor]) -> torch.Tensor:
        """``[n, 2]``: the released anomaly head's calibrated probability beside ``head``'s score."""
        with torch.no_grad():
            return torch.stack([anomaly_scores(guard, features, "probability"), head(features).float()], dim=1)

    def flags(head: SupervisedHead, features: dict[Read, torch.Tensor], thresholds: list[float]) -> torch.Tensor:
        """``[n]``: rows either head flags."""
        return (scores(head, features) > torch.tensor(thresholds)).any(1)

    chat = threshold_reference(rows)
    judged = {split: judged_rows(rows, split, settings) for split in ("validation", "test")}
    turned: dict[tuple[str, str], dict[Read, torch.Tensor]] = {}
    for split, names in (("validation", turns["validation"]), ("test", turns["test"])):
        for turn in names:
            turned[(split, turn)] = collect(rows, judged[split], turn, split)

    chat_index = [i for i, (s, d) in enumerate(zip(rows.splits, rows.domains)) if s == "validation" and d == "chat"]
    reference: dict[tuple[str, str], dict[Read, torch.Tensor]] = {}
    if settings.reset_thresholds:  # the validation chat under each turn, where set-budget --system would set them
        if "chat" not in settings.judged_domains:
            raise ValueError("reset_thresholds sets the thresholds on the judged validation chat: judge 'chat'")
        at = {i: k for k, i in enumerate(judged["validation"])}
        for turn in turns["validation"]:
            features = turned[("validation", turn)]
            reference[("validation", turn)] = {r: v[[at[i] for i in chat_index]] for r, v in features.items()}
        for turn in turns["test"]:
            reference[("test", turn)] = collect(rows, chat_index, turn, "reference")

    def thresholds_on(head: SupervisedHead, features: dict[Read, torch.Tensor]) -> list[float]:
        """The thresholds the released budget (target, shares, confidence) sets on these benign rows."""
        return threshold_at(scores(head, features), budget.target_fpr, budget.shares, budget.confidence)

    for name, head in heads.items():
        thresholds = thresholds_on(head, chat.features)
        entry: dict[str, Any] = {
            "thresholds": thresholds,
            "validation_chat_fpr": union_flag_rate(scores(head, chat.features), thresholds),
        }
        every_row = list(range(len(validation)))
        entry["validation, default turn, every row"] = rates(
            validation, every_row, flags(head, validation.features, thresholds)
        )
        for split in ("validation", "test"):
            index = judged[split]
            default = {read: rows.features[read][index] for read in reads}
            entry[split] = {"(default turn)": rates(rows, index, flags(head, default, thresholds))}
            for turn in turns[split]:
                entry[split][turn] = rates(rows, index, flags(head, turned[(split, turn)], thresholds))
                if settings.reset_thresholds:
                    reset = thresholds_on(head, reference[(split, turn)])
                    entry[split][turn]["reset"] = {"thresholds": reset}
                    entry[split][turn]["reset"].update(rates(rows, index, flags(head, turned[(split, turn)], reset)))
            under_turns = [entry[split][t] for t in turns[split]]
            entry[split]["summary over turns"] = _summary(under_turns, settings)
            if settings.reset_thresholds:
                entry[split]["summary over turns, thresholds re-set"] = _summary(
                    [r["reset"] for r in under_turns], settings
                )
            print(f"{name} {split}: {json.dumps(entry[split]['summary over turns'])}", flush=True)
        results["heads"][name] = entry
    return results
