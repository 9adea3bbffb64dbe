"""Wall time of guarded vs plain ``generate`` on the same model: interleaved repeats, medians, their ratio.

Both generate exactly ``new_tokens`` tokens greedily from the same prompts (``min_new_tokens`` =
``max_new_tokens``), so they do the same model work; the guarded call must return the same sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hf_lsad.capture import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.generation import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, interleaved_medians


@dataclass
class Settings:
    model: str = "default"
    """Model to load (``default``: the bundled SmolLM2-135M-Instruct)."""
    guard: str = "default"
    """Guard folder or Hub repo (``default``: the bundled guard)."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    """Batch sizes timed, one after the other."""
    new_tokens: int = 32
    """Tokens generated per row."""
    repeats: int = 5
    """Timed calls per variant and batch size (after one warm-up each)."""


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(settings.guard))
    prompts = [p.text for p in load_pool("safe", limit=max(settings.batch_sizes), seed=1)]
    generation = dict(max_new_tokens=settings.new_tokens, min_new_tokens=settings.new_tokens, do_sample=False)
    results = {}
    for batch_size in settings.batch_sizes:
        inputs = encode_prompts(tokenizer, prompts[:batch_size])
        with torch.no_grad():
            plain = partial(model.generate, **inputs, **generation)
            guarded_call = partial(guarded.generate, **inputs, **generation)
            assert torch.equal(plain(), guarded_call())  # warm-up, and the same sequences
            timing = interleaved_medians({"plain": plain, "guarded": guarded_call}, settings.repeats)
        timing["ratio"] = timing["median_s"]["guarded"] / timing["median_s"]["plain"]
        results[f"batch_{batch_size}"] = timing
        print(f"batch {batch_size}: guarded / plain {timing['ratio']:.3f}")
    return {"environment": environment(model.device), "batches": results}
