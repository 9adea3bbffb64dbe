"""Do the tokens a supervised head names carry its verdict through the whole model? A deletion test.

A token's contribution (:meth:`hf_lsad.guard.heads.SupervisedHead.explain_tokens`) is read off the head alone: the
logit lost when the token's residual leaves the prompt's mean. It does not see what the token did to the later tokens'
residuals through attention. This study asks whether the named tokens matter to the model's verdict all the same:
for every test row of the bundled unsafe pools that the released guard's harm head flags, it deletes one token from
the prompt's ids and screens the shortened prompt again through the model, three ways:

- ``named``: the token the head names first (largest contribution);
- ``random``: a token drawn (seeded) among those an explanation may name (the template's opening and the first token
  are never deleted);
- ``last_named``: the token with the smallest contribution among those.

It reports, per way, the median fall of the harm head's logit and the share of rows it stops flagging. If the
explanation points at what the model uses, deleting the named token lowers the score far more than a random one.
It fits, chooses and changes nothing.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, encode_prompts, load_model
from hf_lsad.guard.heads.bundled import release_rows

WAYS = ("named", "random", "last_named")


@dataclass
class Settings:
    model: str = "default"
    """The model the guard reads (the bundled SmolLM2-135M-Instruct)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard."""
    pools: list[str] = field(
        default_factory=lambda: ["harmful", "harmful_vauban", "harmful_contrast", "toxic", "toxic_text", "jailbreak"]
    )
    """The bundled unsafe pools whose test rows are read."""
    head: str = "harm"
    """The supervised head whose verdicts are tested."""
    limit: int = 300
    """Flagged rows tested at most (a seeded draw when there are more)."""
    seed: int = 0
    """Seed of the draw of rows and of the random tokens."""


def _logit(probability: float) -> float:
    p = min(max(probability, 1e-7), 1 - 1e-7)
    return math.log(p / (1 - p))


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model)
    guard = SafetyGuard.from_pretrained(settings.guard)
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    head_index = guard.head_names.index(settings.head)
    threshold = guard.budget.thresholds[head_index]
    texts = [p.text for pool in settings.pools for p in release_rows(pool, "test")]
    flagged: list[tuple[str, Any]] = []
    for start in range(0, len(texts), 16):
        batch = texts[start : start + 16]
        for text, report in zip(batch, guarded.screen(batch, explain=True, top_k=None)):
            if settings.head in report.decided_by and report.explained_head == settings.head and report.tokens:
                flagged.append((text, report))
    rng = random.Random(settings.seed)
    chosen = flagged if len(flagged) <= settings.limit else rng.sample(flagged, settings.limit)
    falls: dict[str, list[float]] = {way: [] for way in WAYS}
    unflagged = dict.fromkeys(WAYS, 0)
    for text, report in chosen:
        ids = encode_prompts(tokenizer, [text])["input_ids"][0]  # one row: no padding, positions index it directly
        named = [t.position for t in report.tokens]  # largest contribution first
        positions = {"named": named[0], "random": rng.choice(named), "last_named": named[-1]}
        before = _logit(report.heads[head_index].score)
        for way, position in positions.items():
            shortened = torch.cat([ids[:position], ids[position + 1 :]])[None]
            (after,) = guarded.screen(shortened, torch.ones_like(shortened))
            score = after.heads[head_index].score
            falls[way].append(before - _logit(score))
            unflagged[way] += score <= threshold
    result = {
        "test_rows": len(texts),
        "flagged_by_head": len(flagged),
        "tested": len(chosen),
        "median_logit_fall": {way: statistics.median(values) for way, values in falls.items()},
        "mean_logit_fall": {way: statistics.fmean(values) for way, values in falls.items()},
        "unflagged_share": {way: unflagged[way] / len(chosen) for way in WAYS},
        "named_falls_more_than_random": sum(a > b for a, b in zip(falls["named"], falls["random"])) / len(chosen),
    }
    print(json.dumps(result, indent=1))
    return result
