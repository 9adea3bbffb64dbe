"""The released guards on a source found after every choice was made: what a user meets the first time.

Every figure of ``heads/report`` comes from rows of the bundled pools, whose test split several releases have read.
The ``unseen_harmful`` and ``unseen_benign`` pools (spikee's harmful instructions, its general finance questions
and its requests for personal investment advice; ``scripts/build_data.py --unseen``) were added after the last
release, and no fit, threshold or choice has read them. This study screens them through the public path a user
takes (:meth:`hf_lsad.generation.model.GuardedModelForCausalLM.screen` on the bundled model, each bundled guard as
released) and reports per source the share flagged, with its Wilson 95% interval, and which head decided.

Two more columns say what the figures mean:

- **the model alone**: the share of rows the bundled model itself refuses (greedy decoding of ``refusal_tokens`` new
  tokens, judged by :func:`hf_lsad.data.refusal.is_refusal`), and the guard's flag rate on the rows it does not
  refuse: the harm the guard stops that the model would have answered;
- **near-copies**: rows whose words overlap a row of the guard's training pools by a Jaccard index of at least
  ``near_copy`` (a harmful instruction that rewords an AdvBench one was not really unseen), and the flag rate of the
  others.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import binomtest

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import GUARD_POOLS, load_pool
from hf_lsad.data.refusal import is_refusal
from hf_lsad.data.tables import PromptRow
from hf_lsad.generation.bulk import PromptBatch, plan_batches
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard


@dataclass
class Settings:
    pools: list[str] = field(default_factory=lambda: ["unseen_harmful", "unseen_benign"])
    """The pools screened (rows of their sources are reported apart)."""
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


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z]+", text.lower()))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def wilson_share(count: int, rows: int) -> dict[str, Any]:
    """``count`` of ``rows`` with the share and its Wilson 95% interval."""
    if rows == 0:
        return {"count": 0, "rows": 0, "rate": None, "wilson_95": None}
    interval = binomtest(count, rows).proportion_ci(method="wilson")
    return {"count": count, "rows": rows, "rate": count / rows, "wilson_95": [interval.low, interval.high]}


@torch.no_grad()
def _refusals(model: Any, tokenizer: Any, batches: list[PromptBatch], settings: Settings) -> dict[str, bool]:
    """Whether the model itself refuses each row, by id (greedy decoding, :func:`is_refusal`)."""
    refused = {}
    for batch in batches:
        input_ids, attention_mask = batch.tensors(tokenizer)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=settings.refusal_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row_id, tokens in zip(batch.ids, output[:, input_ids.shape[1] :]):
            refused[row_id] = is_refusal(tokenizer.decode(tokens, skip_special_tokens=True))
    return refused


def screen_texts(guarded: GuardedModelForCausalLM, texts: dict[str, str], batch_size: int) -> dict[str, Any]:
    """Each prompt's report by id: :meth:`GuardedModelForCausalLM.screen` in passes of at most ``batch_size`` prompts
    in order of token length, as ``hf-lsad screen`` batches them; a row that could not be scored is an error."""
    reports = dict(zip(texts, guarded.screen(list(texts.values()), batch_size=batch_size)))
    errors = [report.error for report in reports.values() if report.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows could not be scored, e.g. {errors[0]}")
    return reports


def screen_batches(guarded: GuardedModelForCausalLM, tokenizer: Any, batches: list[PromptBatch]) -> dict[str, Any]:
    """Each row's report by id, screened batch by batch; a row that could not be scored is an error."""
    reports = {}
    for batch in batches:
        reports.update(zip(batch.ids, guarded.screen(*batch.tensors(tokenizer))))
    errors = [report.error for report in reports.values() if report.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rows could not be scored, e.g. {errors[0]}")
    return reports


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model)
    loaded = [(pool, prompt) for pool in settings.pools for prompt in load_pool(pool)]
    rows = {prompt.id: prompt for _, prompt in loaded}
    pool_of = {prompt.source: pool for pool, prompt in loaded}
    members_of: dict[str, list[str]] = {}
    for prompt in rows.values():
        members_of.setdefault(prompt.source, []).append(prompt.id)

    training = [_words(p.text) for pool in GUARD_POOLS for p in load_pool(pool)]
    overlap = {i: max(_jaccard(_words(p.text), seen) for seen in training) for i, p in rows.items()}
    near = {i: value >= settings.near_copy for i, value in overlap.items()}

    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    # Tokenised and batched by length once, as hf-lsad screen does; every pass below reads the same batches.
    batches, unreadable = plan_batches(
        next(iter(guarded.values())),
        [PromptRow(i, p.text) for i, p in rows.items()],
        batch_size=settings.batch_size,
    )
    if unreadable:
        raise RuntimeError(f"{len(unreadable)} rows cannot be screened, e.g. {unreadable[0]}")

    print(f"the model's own refusals on {len(rows)} rows", flush=True)
    refused = _refusals(model, tokenizer, batches, settings) if settings.refusal_tokens else None

    results: dict[str, Any] = {"rows": len(rows), "sources": {}}
    for source, members in members_of.items():
        entry: dict[str, Any] = {
            "pool": pool_of[source],
            "category": rows[members[0]].category,
            "rows": len(members),
            "near_copies": sum(near[i] for i in members),
            "near_copy_examples": [rows[i].text for i in sorted(members, key=lambda i: -overlap[i]) if near[i]][:5],
        }
        if refused is not None:
            entry["model_refuses"] = wilson_share(sum(refused[i] for i in members), len(members))
        results["sources"][source] = entry

    for name, model_with_guard in guarded.items():
        print(f"screening with the {name} guard", flush=True)
        reports = screen_batches(model_with_guard, tokenizer, batches)
        for source, members in members_of.items():
            flagged = [i for i in members if reports[i].flagged]
            entry = {
                "flagged": wilson_share(len(flagged), len(members)),
                "decided_by": dict(Counter("+".join(reports[i].decided_by) or "anomaly" for i in flagged)),
                "flagged_without_near_copies": wilson_share(
                    sum(reports[i].flagged for i in members if not near[i]), sum(not near[i] for i in members)
                ),
            }
            if rows[members[0]].category != "safe":
                entry["missed"] = [rows[i].text for i in members if not reports[i].flagged]
            else:
                entry["flagged_rows"] = [rows[i].text for i in flagged]
            if refused is not None:
                answered = [i for i in members if not refused[i]]
                entry["flagged_of_rows_the_model_answers"] = wilson_share(
                    sum(reports[i].flagged for i in answered), len(answered)
                )
            results["sources"][source][name] = entry
    return results
