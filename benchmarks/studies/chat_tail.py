"""Where the released guard's chat flags fall, split by split: is the test split's chat hotter than chance allows?

The released default guard (its heads and thresholds as shipped, nothing fitted here) scores every row of the chat
pool. For each split it reports the rows, the share flagged (by either head, and by each), and the share of rows
whose supervised score lies above a ladder of levels: the tail the threshold sits in. Two tests compare the
validation split (the thresholds were set on it) with the test split (the report reads it), rows the head never saw
in either case: Fisher's exact test on the flagged counts, and the two-sample Kolmogorov-Smirnov test on the whole
distribution of the supervised score. The fit split's rows taught the head, so its figures are in-sample.

Persona and role-play openings ("act as", "pretend", "from now on", ...) look like the jailbreak templates the head
learnt from; their share and flag rate per split say whether the test split's tail is made of them. Rows sharing
their opening (near-duplicates) are counted too: clusters of them would make the splits vary more than independent
rows do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import fisher_exact, ks_2samp

from hf_lsad.evaluation.sources import load_source_rows
from hf_lsad.guard import SafetyGuard

PERSONA = re.compile(
    r"\b(act as|act like|pretend|you are (now )?(a|an|my)|role-?play|role play|from now on|i want you to act|"
    r"imagine you|forget|ignore (all|any|previous)|disregard|jailbreak)\b",
    re.IGNORECASE,
)
"""Openings that cast the assistant in a persona or set its rules aside, as jailbreak templates do."""


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard whose flags are counted (every read it needs must be collected under ``folder``)."""
    pool: str = "chat"
    """The pool whose splits are compared."""
    head: str = "harm"
    """The supervised head whose score distribution is compared."""
    levels: list[float] = field(default_factory=lambda: [0.2, 0.3, 0.4, 0.48, 0.6, 0.8, 0.9, 0.99])
    """Score levels of ``head`` at which the share of rows above is reported."""
    seed: int = 0
    """Seed of the row splits."""


def _opening(text: str) -> str:
    """A row's first 40 characters, lower case, punctuation and spacing folded: rows that share one are near-duplicate
    requests (a template filled in twice, a prompt pasted with a different ending)."""
    return re.sub(r"\W+", " ", text.lower()).strip()[:40]


def run(settings: Settings) -> dict[str, Any]:
    guard = SafetyGuard.from_pretrained(settings.guard)
    rows = load_source_rows(settings.folder, [settings.pool], guard.reads, seed=settings.seed)
    output = guard(rows.features)
    head_flags = {
        name: output.head_scores[name] > threshold for name, threshold in zip(guard.head_names, guard.budget.thresholds)
    }
    score = output.head_scores[settings.head]
    persona = torch.tensor([bool(PERSONA.search(text)) for text in rows.texts])
    result: dict[str, Any] = {"thresholds": dict(zip(guard.head_names, guard.budget.thresholds)), "splits": {}}
    for split in ("fit", "validation", "test"):
        mask = torch.tensor(rows.where(split=split))
        flagged = output.flagged[mask]
        result["splits"][split] = {
            "rows": int(mask.sum()),
            "flagged": int(flagged.sum()),
            "flag_rate": float(flagged.double().mean()),
            **{f"flagged_by_{name}": int(flags[mask].sum()) for name, flags in head_flags.items()},
            "above": {f"{level:g}": float((score[mask] > level).double().mean()) for level in settings.levels},
            "persona_rows": int(persona[mask].sum()),
            "persona_flag_rate": float(output.flagged[mask & persona].double().mean()),
            "other_flag_rate": float(output.flagged[mask & ~persona].double().mean()),
        }
    openings: dict[str, list[int]] = {}
    for i, text in enumerate(rows.texts):
        openings.setdefault(_opening(text), []).append(i)
    repeated = [members for members in openings.values() if len(members) > 1]
    result["repeated_openings"] = {
        "clusters": len(repeated),
        "rows": sum(len(members) for members in repeated),
        "flagged": sum(int(output.flagged[i]) for members in repeated for i in members),
        "of_rows": len(rows),
    }
    validation, test = result["splits"]["validation"], result["splits"]["test"]
    table = [
        [validation["flagged"], validation["rows"] - validation["flagged"]],
        [test["flagged"], test["rows"] - test["flagged"]],
    ]
    fisher = fisher_exact(table)
    result["fisher_validation_vs_test"] = {"odds_ratio": float(fisher.statistic), "p_value": float(fisher.pvalue)}
    scores_of = {split: score[torch.tensor(rows.where(split=split))].numpy() for split in ("validation", "test")}
    ks = ks_2samp(scores_of["validation"], scores_of["test"])
    result["ks_validation_vs_test"] = {"statistic": float(ks.statistic), "p_value": float(ks.pvalue)}
    for split, entry in result["splits"].items():
        print(
            f"{split}: {entry['flagged']} of {entry['rows']} flagged ({entry['flag_rate']:.2%}); "
            f"persona {entry['persona_rows']} rows at {entry['persona_flag_rate']:.1%}, "
            f"others at {entry['other_flag_rate']:.1%}"
        )
    print(f"repeated openings: {result['repeated_openings']}")
    print(f"Fisher validation vs test: {result['fisher_validation_vs_test']}; KS: {result['ks_validation_vs_test']}")
    return result
