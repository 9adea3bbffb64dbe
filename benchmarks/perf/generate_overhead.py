"""Wall time of guarded vs plain ``generate`` on the same model: interleaved repeats, medians, their ratio.

Both generate exactly ``new_tokens`` tokens greedily from the same prompts (``min_new_tokens`` =
``max_new_tokens``), so they do the same model work; the guarded call must return the same sequences.

The ratio carries the machine's noise (calls of one variant vary by several percent here). Its size is measured in the
same run: the plain call is timed twice per turn, as two variants, and the ratio of their medians (``control_ratio``,
1 but for noise) says how far from 1 a ratio moves by chance. What the supervised heads themselves cost is measured
apart, without that noise: the wall time spent inside them (forward hooks on each head) during one more guarded call,
and its share of that call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hf_lsad.capture import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.generation import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, interleaved_medians, timed


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
            variants = {"plain": plain, "guarded": guarded_call, "plain_again": plain}
            timing = interleaved_medians(variants, settings.repeats)
        timing["ratio"] = timing["median_s"]["guarded"] / timing["median_s"]["plain"]
        timing["control_ratio"] = timing["median_s"]["plain_again"] / timing["median_s"]["plain"]
        timing["supervised_heads"] = time_inside_heads(guarded, guarded_call)
        results[f"batch_{batch_size}"] = timing
        heads = timing["supervised_heads"]
        print(
            f"batch {batch_size}: guarded / plain {timing['ratio']:.3f} (plain / plain {timing['control_ratio']:.3f}); "
            "inside the supervised heads "
            f"{heads['seconds'] * 1e3:.2f} ms of {heads['call_seconds']:.2f} s ({heads['calls']} calls)"
        )
    return {"environment": environment(model.device), "batches": results}


def time_inside_heads(guarded: GuardedModelForCausalLM, call) -> dict[str, Any]:
    """Calls of the guard's supervised heads during one ``call``, the seconds spent inside them and their share of
    the call's wall time."""
    inside = {"calls": 0, "seconds": 0.0}
    started: list[float] = []

    def before(module, args):
        started.append(time.perf_counter())

    def after(module, args, output):
        inside["seconds"] += time.perf_counter() - started.pop()
        inside["calls"] += 1

    heads = list(guarded.guard.heads.values())
    handles = [
        hook for head in heads for hook in (head.register_forward_pre_hook(before), head.register_forward_hook(after))
    ]
    try:
        with torch.no_grad():
            total = timed(call)
    finally:
        for handle in handles:
            handle.remove()
    return {**inside, "call_seconds": total, "share": inside["seconds"] / total}
