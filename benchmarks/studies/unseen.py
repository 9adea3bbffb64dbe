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
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import binomtest

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.data.refusal import is_refusal
from hf_lsad.evaluation.sources import GUARD_POOLS
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


def _share(count: int, rows: int) -> dict[str, Any]:
    """``count`` of ``rows`` with the share and its Wilson 95% interval."""
    if rows == 0:
        return {"count": 0, "rows": 0, "rate": None, "wilson_95": None}
    interval = binomtest(count, rows).proportion_ci(method="wilson")
    return {"count": count, "rows": rows, "rate": count / rows, "wilson_95": [interval.low, interval.high]}


def _by_length(texts: list[str], batch_size: int) -> list[list[int]]:
    """Row indices in batches of similar length (less padding)."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


@torch.no_grad()
def _refusals(model: Any, tokenizer: Any, texts: list[str], settings: Settings) -> list[bool]:
    """Whether the model itself refuses each prompt (greedy decoding, :func:`is_refusal`)."""
    refused = [False] * len(texts)
    for batch in _by_length(texts, settings.batch_size):
        inputs = encode_prompts(tokenizer, [texts[i] for i in batch])
        output = model.generate(
            **inputs, max_new_tokens=settings.refusal_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        for i, tokens in zip(batch, output[:, inputs["input_ids"].shape[1] :]):
            refused[i] = is_refusal(tokenizer.decode(tokens, skip_special_tokens=True))
    return refused


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model)
    loaded = [(pool, prompt) for pool in settings.pools for prompt in load_pool(pool)]
    rows = [prompt for _, prompt in loaded]
    pool_of = {prompt.source: pool for pool, prompt in loaded}
    texts = [prompt.text for prompt in rows]
    sources = sorted({prompt.source for prompt in rows}, key=[p.source for p in rows].index)

    training = [_words(p.text) for pool in GUARD_POOLS for p in load_pool(pool)]
    overlap = [max(_jaccard(_words(text), seen) for seen in training) for text in texts]
    near = [value >= settings.near_copy for value in overlap]

    print(f"the model's own refusals on {len(rows)} rows", flush=True)
    refused = _refusals(model, tokenizer, texts, settings) if settings.refusal_tokens else None

    results: dict[str, Any] = {"rows": len(rows), "sources": {}}
    for source in sources:
        members = [i for i, p in enumerate(rows) if p.source == source]
        entry: dict[str, Any] = {
            "pool": pool_of[source],
            "category": rows[members[0]].category,
            "rows": len(members),
            "near_copies": sum(near[i] for i in members),
            "near_copy_examples": [texts[i] for i in sorted(members, key=lambda i: -overlap[i]) if near[i]][:5],
        }
        if refused is not None:
            entry["model_refuses"] = _share(sum(refused[i] for i in members), len(members))
        results["sources"][source] = entry

    for name in settings.guards:
        guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        print(f"screening with the {name} guard", flush=True)
        reports: list[Any] = [None] * len(rows)
        for batch in _by_length(texts, settings.batch_size):
            for i, report in zip(batch, guarded.screen([texts[i] for i in batch])):
                reports[i] = report
        errors = [i for i, report in enumerate(reports) if report.error]
        if errors:
            raise RuntimeError(f"{len(errors)} rows could not be scored, e.g. {reports[errors[0]].error}")
        for source in sources:
            members = [i for i, p in enumerate(rows) if p.source == source]
            unsafe = rows[members[0]].category != "safe"
            flagged = [i for i in members if reports[i].flagged]
            decided: dict[str, int] = {}
            for i in flagged:
                key = "+".join(reports[i].decided_by) or "anomaly"
                decided[key] = decided.get(key, 0) + 1
            entry = {
                "flagged": _share(len(flagged), len(members)),
                "decided_by": decided,
                "flagged_without_near_copies": _share(
                    sum(reports[i].flagged for i in members if not near[i]), sum(not near[i] for i in members)
                ),
            }
            if unsafe:
                entry["missed"] = [texts[i] for i in members if not reports[i].flagged]
            else:
                entry["flagged_rows"] = [texts[i] for i in flagged]
            if refused is not None:
                answered = [i for i in members if not refused[i]]
                entry["flagged_of_rows_the_model_answers"] = _share(
                    sum(reports[i].flagged for i in answered), len(answered)
                )
            results["sources"][source][name] = entry
    return results
