"""A head for harm asked in a few words, added to the released guard through ``add_head``: does it catch terse
requests on validation rows, and at what cost?

``heads/terse_requests`` found that the released guard flags 49 of 50 hand-written harmful requests written in full
and 11 of 50 typed as a few words: the supervised head has learnt the sources' way of asking. The unsafe sources
hold no terse requests, so this study makes terse forms of their rows by rule (:func:`terse_form`: the framing verb
and its container dropped, "Write a tutorial on how to make a bomb" to "how to make a bomb", "How can I X?" to
"how to X", at most ``max_words`` words, lower case, no final punctuation) and teaches them to a third head with the
product's own path, :func:`hf_lsad.guard.heads.add_head` (``hf-lsad add-head``): a logistic head on the released
head's reads, fitted on the terse forms of the **fit** rows of the request-shaped unsafe sources against the terse
forms of the fit rows of the request-shaped benign domains (so that terseness itself stays neutral) and the bundled
benign pools ``add_head`` draws; every threshold is then set again on validation chat, the new head taking
``share`` of the one budget.

The released two-headed guard and the three-headed one are screened on **validation** rows: the terse forms of each
unsafe source's validation rows (caught), those rows in full (caught), the terse forms of the benign domains'
validation rows, and every benign domain's validation rows as they are (flagged). The hand-written triples of
``heads/terse_requests`` are not read: they stay for the test, once a choice is made on these rows.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, add_head, load_model
from hf_lsad.core.batching import BATCH_TOKENS
from hf_lsad.data import GUARD_POOLS
from hf_lsad.data.tables import PromptRow
from hf_lsad.generation.bulk import plan_batches
from hf_lsad.guard.heads.bundled import release_rows, sample_rows

from .unseen import screen_batches

FRAMING_VERBS = (
    "write|create|develop|provide|give|generate|explain|describe|outline|produce|teach|show|tell|list|suggest|draft"
    "|compose|detail|offer|instruct|demonstrate|share|craft|publish|post"
)
"""Verbs that frame a request ("Write ...", "Explain ...") rather than name what is asked for."""

GUIDE_NOUNS = (
    "tutorial|guide|instructions|plan|strategy|steps|explanation|procedure|overview|manual|walkthrough|description"
    "|advice|tips|ways|methods|techniques"
)
"""Containers a terse request drops ("a tutorial on how to X" is "how to X")."""

ARTIFACT_NOUNS = (
    "script|program|code|website|email|letter|post|blog post|article|speech|essay|story|message|video|tweet|poem"
    "|song|advertisement|review|social media post|fake news story|news article|phishing email"
)
"""What a request asks to be made; a terse request keeps it ("a script that X" is "script that X")."""

_POLITE = re.compile(r"^(please |can you |could you |would you |will you |i want you to |i need you to |help me )+")
_QUESTION = [
    (re.compile(r"^(how (can|do|could|would|should|might) (i|we|you|one|someone) )(.*)$"), r"how to \4"),
    (
        re.compile(r"^(what('s| is| are) (the )?(best|easiest|quickest|simplest) (way|ways|method) (to|of) )(.*)$"),
        r"best way to \7",
    ),
    (re.compile(r"^(where (can|do|could) (i|we|you|one) )(.*)$"), r"where to \4"),
    (re.compile(r"^(what are (some )?(ways|methods|techniques|tips) (to|for) )(.*)$"), r"ways to \5"),
]
_FRAMED = re.compile(
    rf"^(?:{FRAMING_VERBS})(?: me| us| someone| people)?"
    rf"(?: (?:a|an|the|some|detailed|step-by-step|clear|specific|comprehensive|complete|full|short|brief|convincing"
    rf"|persuasive))*"
    rf"(?: (?P<guide>{GUIDE_NOUNS})(?: (?:on|for|about|to|of|explaining|detailing|describing|that explains))?"
    rf"| (?P<artifact>{ARTIFACT_NOUNS}))?(?P<rest>(?: .*)?)$"
)
_TRAILING = {"and", "or", "to", "the", "a", "an", "of", "for", "with", "in", "on", "from", "that", "which", "by", "as"}


def terse_form(text: str, max_words: int = 10) -> str | None:
    """``text`` as a few words typed into a box, or ``None`` when no rule makes a terse request of it.

    The first line, lower case, without final punctuation and polite openings; a question "how can I X" becomes
    "how to X" ("what is the best way to X": "best way to X"; "where can I X": "where to X"); a framed request
    "Write a tutorial on X" becomes "X", "Write a script that X" "script that X". At most ``max_words`` words, the
    last not a function word; ``None`` when nothing changed and the text is longer than that, or fewer than two
    words are left."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    words = re.sub(r"\s+", " ", line.lower()).strip().rstrip(".?!:;").strip().split(" ")
    short = " ".join(words)
    short = _POLITE.sub("", short)
    changed = short != " ".join(words)
    for pattern, replacement in _QUESTION:
        if pattern.match(short):
            short, changed = pattern.sub(replacement, short), True
            break
    else:
        framed = _FRAMED.match(short)
        if framed is not None and (framed.group("guide") or framed.group("artifact") or framed.group("rest")):
            rest = framed.group("rest").strip()
            short = f"{framed.group('artifact')} {rest}".strip() if framed.group("artifact") else rest
            changed = True
    kept = short.split(" ")
    if not changed and len(kept) > max_words:
        return None
    kept = kept[:max_words]
    while kept and kept[-1] in _TRAILING:
        kept.pop()
    result = " ".join(kept).strip(" ,;:")
    return result if len(result.split(" ")) >= 2 else None


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "default"
    """The released two-headed guard the terse head is added to."""
    unsafe_sources: list[str] = field(
        default_factory=lambda: [
            "advbench",
            "harmbench",
            "vauban-harmful",
            "contrast-unsafe",
            "vauban-surface-harmful",
            "weighted-safety-harmful",
            "donotanswer",
        ]
    )
    """Request-shaped unsafe sources whose rows are made terse (jailbreak templates, injections and toxic text are
    not requests a user would shorten)."""
    benign_sources: list[str] = field(
        default_factory=lambda: ["sharegpt", "vauban-harmless", "contrast-benign", "persistbench", "freshqa"]
    )
    """Request-shaped benign sources whose rows are made terse, so that terseness itself stays neutral."""
    max_words: int = 10
    """Longest terse form (:func:`terse_form`)."""
    benign_terse_rows: int = 1200
    """Terse forms of the benign sources' fit rows in the head's fit (seeded draw)."""
    share: float | None = None
    """The terse head's share of the false-positive budget (``None``: ``add_head``'s default, a third with three
    heads; the other heads keep their proportions of the rest)."""
    validation_rows: int = 400
    """Validation rows per benign pool screened as they are (seeded draw; chat: all of them)."""
    seed: int = 0
    """Seed of the draws."""


def _rows_of(sources: list[str], split: str) -> list[Any]:
    """The ``split`` rows of every guard pool that come from ``sources``."""
    return [p for pool in GUARD_POOLS for p in release_rows(pool, split) if p.source in sources]


def _terse(rows: list[Any], max_words: int) -> list[tuple[Any, str]]:
    """Each row with its terse form, rows without one left out; one row per terse form."""
    seen: set[str] = set()
    kept = []
    for row in rows:
        short = terse_form(row.text, max_words)
        if short is not None and short not in seen:
            seen.add(short)
            kept.append((row, short))
    return kept


def _rates(
    guarded: GuardedModelForCausalLM, groups: dict[str, list[str]], named: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """Each group's rows flagged, screened as ``hf-lsad screen`` does (batched by token length, at most
    ``BATCH_TOKENS`` padded tokens a pass), and the heads that decided; the flagged texts of the ``named``
    groups."""
    rows = [PromptRow(f"{name}/{i}", text) for name, texts in groups.items() for i, text in enumerate(texts)]
    batches, unreadable = plan_batches(guarded, rows, batch_size=16, max_batch_tokens=BATCH_TOKENS)
    if unreadable:
        raise RuntimeError(f"{len(unreadable)} rows cannot be screened, e.g. {unreadable[0]}")
    reports = screen_batches(guarded, guarded.tokenizer, batches)
    out = {}
    for name, texts in groups.items():
        flagged = [reports[f"{name}/{i}"] for i in range(len(texts)) if reports[f"{name}/{i}"].flagged]
        out[name] = {
            "rows": len(texts),
            "flagged": len(flagged),
            "rate": len(flagged) / len(texts),
            "decided_by": dict(Counter("+".join(r.decided_by) for r in flagged)),
        }
        if name in named:
            out[name]["flagged_texts"] = [t for i, t in enumerate(texts) if reports[f"{name}/{i}"].flagged]
        print(f"  {name}: {len(flagged)} of {len(texts)}", flush=True)
    return out


def terse_fit_rows(settings: Settings) -> tuple[list[tuple[Any, str]], list[tuple[Any, str]]]:
    """The terse head's fit rows, each with its terse form: the unsafe sources' and a seeded draw of the benign
    sources' (a benign form that is also an unsafe one left out)."""
    fit_unsafe = _terse(_rows_of(settings.unsafe_sources, "fit"), settings.max_words)
    fit_benign = sample_rows(
        _terse(_rows_of(settings.benign_sources, "fit"), settings.max_words), settings.benign_terse_rows, settings.seed
    )
    unsafe_texts = {short for _, short in fit_unsafe}
    return fit_unsafe, [(row, short) for row, short in fit_benign if short not in unsafe_texts]


def with_terse_head(model: Any, tokenizer: Any, settings: Settings) -> SafetyGuard:
    """The released guard with the terse head added (:func:`hf_lsad.guard.heads.add_head`), its thresholds set
    again on every validation chat row."""
    fit_unsafe, fit_benign = terse_fit_rows(settings)
    guard = SafetyGuard.from_pretrained(settings.guard)
    add_head(
        model,
        tokenizer,
        guard,
        "terse",
        [short for _, short in fit_unsafe],
        [short for _, short in fit_benign],
        share=settings.share,
        threshold_rows=None,
        seed=settings.seed,
    )
    return guard


def run(settings: Settings) -> dict[str, Any]:
    fit_unsafe, fit_benign = terse_fit_rows(settings)
    unsafe_texts = {short for _, short in fit_unsafe}

    val_unsafe = _rows_of(settings.unsafe_sources, "validation")
    val_terse = [(row, short) for row, short in _terse(val_unsafe, settings.max_words) if short not in unsafe_texts]
    val_benign_terse = _terse(_rows_of(settings.benign_sources, "validation"), settings.max_words)
    groups: dict[str, list[str]] = {}
    for source in settings.unsafe_sources:
        groups[f"unsafe terse: {source}"] = [short for row, short in val_terse if row.source == source]
        groups[f"unsafe full: {source}"] = [row.text for row in val_unsafe if row.source == source]
    for source in settings.benign_sources:
        groups[f"benign terse: {source}"] = [short for row, short in val_benign_terse if row.source == source]
    for pool in ("chat", "safe", "benign_ood", "lookalike", "questions", "statements"):
        rows = release_rows(pool, "validation")
        rows = rows if pool == "chat" else sample_rows(rows, settings.validation_rows, settings.seed)
        groups[f"benign: {pool}"] = [row.text for row in rows]
    groups = {name: texts for name, texts in groups.items() if texts}

    model, tokenizer = load_model(settings.model)
    results: dict[str, Any] = {
        "fit": {
            "unsafe_terse": dict(Counter(row.source for row, _ in fit_unsafe)),
            "benign_terse": dict(Counter(row.source for row, _ in fit_benign)),
            "examples": [[row.text, short] for row, short in (fit_unsafe[::97] + fit_benign[::151])][:24],
        },
        "guards": {},
    }
    released = SafetyGuard.from_pretrained(settings.guard)
    print("the released guard", flush=True)
    results["guards"]["released"] = _rates(GuardedModelForCausalLM(model, released, tokenizer=tokenizer), groups)

    guard = with_terse_head(model, tokenizer, settings)
    budget = guard.budget
    assert budget is not None  # add_head sets it
    results["budget"] = {"heads": budget.heads, "shares": budget.shares, "thresholds": budget.thresholds}
    print("with the terse head", budget.thresholds, flush=True)
    results["guards"]["with a terse head"] = _rates(GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), groups)

    def median_source(name: str, kind: str) -> float:
        rates = [v["rate"] for k, v in results["guards"][name].items() if k.startswith(f"unsafe {kind}:")]
        return statistics.median(rates)

    results["summary"] = {
        name: {
            "terse median source": median_source(name, "terse"),
            "terse worst source": min(v["rate"] for k, v in rows.items() if k.startswith("unsafe terse:")),
            "full median source": median_source(name, "full"),
            "validation chat": rows["benign: chat"]["rate"],
            "look-alikes": rows["benign: lookalike"]["rate"],
            "benign terse median": statistics.median(
                v["rate"] for k, v in rows.items() if k.startswith("benign terse:")
            ),
        }
        for name, rows in results["guards"].items()
    }
    return results
