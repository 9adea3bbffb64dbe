"""What the fingerprint check costs when a guarded model is built: the wrap with and without it, beside loading the
model and one guarded ``generate``.

``GuardedModelForCausalLM(model, guard)`` reads the guard's 16 probe prompts through the model once, then, for a
fingerprint that keeps them, the rows nearest its thresholds (:func:`hf_lsad.guard.fingerprint.check_fingerprint`);
nothing after that. For each guard of ``guards``, interleaved medians of ``repeats`` (after one warm-up): loading the
bundled model (``load_model("default")``, its GGUF conversion cached), wrapping it with the guard (the check
included), with the probes alone (where it keeps rows), without its fingerprint (no check), and one guarded
``generate`` of ``batch`` chat prompts for ``new_tokens`` greedy tokens, for scale.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, interleaved_medians


@dataclass
class Settings:
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """Bundled guards (``default``: two heads, reads to layer 28; ``paper``: the anomaly head alone, layer 12)."""
    repeats: int = 5
    """Timed runs per variant, after one warm-up."""
    batch: int = 8
    """Prompts of the guarded ``generate`` timed for scale (the shortest of the chat pool)."""
    new_tokens: int = 32
    """Greedy tokens of that ``generate``."""


def _variants(model: Any, tokenizer: Any, guard: SafetyGuard, inputs: Any, settings: Settings) -> dict[str, Any]:
    """What is timed for one guard: the model's load, the wrap with and without the check, one guarded generate."""
    unchecked = copy.deepcopy(guard)
    unchecked.set_fingerprint(None)
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    probes_only = {}
    if guard.fingerprint is not None and guard.fingerprint.boundary is not None:
        without_rows = copy.deepcopy(guard)
        without_rows.set_fingerprint(guard.fingerprint._replace(boundary=None))
        probes_only["wrap_probes_only"] = lambda: GuardedModelForCausalLM(model, without_rows, tokenizer=tokenizer)
    return {
        "load_model": lambda: load_model("default"),
        "wrap_with_check": lambda: GuardedModelForCausalLM(model, guard, tokenizer=tokenizer),
        **probes_only,
        "wrap_without_check": lambda: GuardedModelForCausalLM(model, unchecked, tokenizer=tokenizer),
        "generate": lambda: guarded.generate(
            **inputs, max_new_tokens=settings.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        ),
    }


@torch.no_grad()
def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model("default")
    prompts = sorted((p.text for p in load_pool("chat")), key=len)[: settings.batch]
    inputs = encode_prompts(tokenizer, prompts)
    results: dict[str, Any] = {"environment": environment(model.device), "guards": {}}
    for name in settings.guards:
        variants = _variants(model, tokenizer, SafetyGuard.from_pretrained(name), inputs, settings)
        for fn in variants.values():  # the warm-up
            fn()
        timing = interleaved_medians(variants, settings.repeats)
        median = timing["median_s"]
        check = median["wrap_with_check"] - median["wrap_without_check"]
        timing["check_s"] = check
        if "wrap_probes_only" in median:  # the rows nearest the thresholds, read after the probes pass
            timing["boundary_rows_s"] = median["wrap_with_check"] - median["wrap_probes_only"]
        timing["check_over_load_and_wrap"] = check / (median["load_model"] + median["wrap_without_check"])
        timing["check_over_generate"] = check / median["generate"]
        results["guards"][name] = timing
    return results
