"""Batching the forward pass by a token budget against batching a fixed number of prompts, on the fit prompts
``hf-lsad teach`` collects on the bundled model.

The prompts are the ``fit`` rows of every pool of :data:`hf_lsad.data.GUARD_POOLS` (the README's demo prompts out),
read at the default guard's reads, as :func:`hf_lsad.guard.heads.training.teach_traffic` collects them.

1. Counted over all of them (no forward pass): batches and padded tokens (prompts times the longest, per batch) of
   ``batch_size`` prompts in order of character length (the release's batching) and of the token budget.
2. Timed: :func:`hf_lsad.capture.collect.collect_prompt_features` both ways on two slices of the release's batches.
   ``tail``: its last ``tail_batches`` batches (the longest prompts, where the time of a teach goes), one run each.
   ``middle``: ``middle_batches`` batches from the middle of its order (ordinary prompts), interleaved repeats.
   Each slice's prompts are the same for both ways; the largest difference between their features is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_lsad.capture.collect import collect_prompt_features, prompt_token_lengths
from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.batching import length_batches
from hf_lsad.core.splits import split_of
from hf_lsad.data import GUARD_POOLS, is_reserved, load_pool
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, interleaved_medians, load_average, timed


@dataclass
class Settings:
    batch_size: int = 16
    """Prompts per forward pass, the most for both ways."""
    max_batch_tokens: int = 4096
    """The token budget: padded tokens per forward pass."""
    tail_batches: int = 3
    """The release's last batches timed (its longest prompts)."""
    middle_batches: int = 20
    """The release's batches timed from the middle of its order."""
    repeats: int = 3
    """Interleaved repeats of the middle slice (the tail runs once each: it takes tens of minutes)."""


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model("default")
    reads = list(SafetyGuard.from_pretrained("default").reads)
    prompts = [
        p.text for pool in GUARD_POOLS for p in load_pool(pool) if split_of(p.id) == "fit" and not is_reserved(p.text)
    ]
    tokens = prompt_token_lengths(tokenizer, prompts)
    release = length_batches([len(p) for p in prompts], settings.batch_size)
    budget = length_batches(tokens, settings.batch_size, settings.max_batch_tokens)
    counted = {
        "prompts": len(prompts),
        "tokens": sum(tokens),
        "longest_tokens": max(tokens),
        "release": _plan(release, tokens),
        "budget": _plan(budget, tokens),
    }

    middle_start = len(release) // 2 - settings.middle_batches // 2
    slices = {
        "tail": [i for batch in release[-settings.tail_batches :] for i in batch],
        "middle": [i for batch in release[middle_start : middle_start + settings.middle_batches] for i in batch],
    }
    timings = {}
    for name, rows in slices.items():
        chosen = [prompts[i] for i in rows]
        outputs: dict[str, Any] = {}

        def collect(way: str, max_batch_tokens: int | None, chosen: list[str] = chosen, outputs: dict = outputs):
            outputs[way] = collect_prompt_features(
                model,
                tokenizer,
                chosen,
                reads,
                batch_size=settings.batch_size,
                max_batch_tokens=max_batch_tokens,
                progress=False,
            )[0]

        variants = {
            "release": lambda: collect("release", None),
            "budget": lambda: collect("budget", settings.max_batch_tokens),
        }
        if name == "tail":
            before = load_average()
            seconds = {way: timed(fn) for way, fn in variants.items()}
            timed_result = {"seconds": seconds, "load_average": {"before": before, "after": load_average()}}
        else:
            timed_result = interleaved_medians(variants, settings.repeats)
            seconds = timed_result["median_s"]
        slice_tokens = [tokens[i] for i in rows]
        timings[name] = {
            "prompts": len(rows),
            "tokens": sum(slice_tokens),
            "longest_tokens": max(slice_tokens),
            "release": _plan(length_batches([len(p) for p in chosen], settings.batch_size), slice_tokens),
            "budget": _plan(length_batches(slice_tokens, settings.batch_size, settings.max_batch_tokens), slice_tokens),
            **timed_result,
            "speedup": seconds["release"] / seconds["budget"],
            "max_abs_feature_difference": max(
                float((outputs["release"][read] - outputs["budget"][read]).abs().max()) for read in reads
            ),
        }
    return {"environment": environment(torch.device("cpu")), "reads": reads, "counted": counted, "timed": timings}


def _plan(batches: list[list[int]], tokens: list[int]) -> dict[str, int]:
    """Batches, padded tokens and the largest batch's padded tokens of a plan over prompts of ``tokens`` lengths."""
    padded = [len(batch) * max(tokens[i] for i in batch) for batch in batches]
    return {"batches": len(batches), "padded_tokens": sum(padded), "largest_batch_tokens": max(padded)}
