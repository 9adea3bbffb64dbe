"""The model check of the bundled guards through the bundled model loaded with each attention implementation.

A guard's fingerprint (:mod:`hf_lsad.guard.fingerprint`) was recorded through the bundled model as
:func:`hf_lsad.load_model` loads it (transformers' default attention, ``sdpa``). A user may load the same weights with
another kernel (``load_model("default", attn_implementation="eager")``): the activations then differ by round-off,
and the rows nearest the thresholds are where a verdict could change. This study reads each bundled guard's probes and
boundary rows through the model loaded with each of ``Settings.attention`` and records the probes' shift, the boundary
rows' estimate (recorded, estimated flag rate of the set) and whether the check refuses the model. It fits no head and
chooses nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hf_lsad import SafetyGuard, load_model
from hf_lsad.errors import ModelMismatchError
from hf_lsad.guard.fingerprint import boundary_flag_rate, check_fingerprint, score_shift


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guards: list[str] = field(
        default_factory=lambda: ["hf_lsad/guards/smollm2-135m-instruct", "hf_lsad/guards/smollm2-135m-instruct-paper"]
    )
    """The bundled guards, whose fingerprints keep the rows nearest their thresholds."""
    attention: list[str] = field(default_factory=lambda: ["sdpa", "eager"])
    """transformers' ``attn_implementation`` values the model is loaded with, the first the one the fingerprints
    were recorded through."""


def run(settings: Settings) -> dict[str, Any]:
    guards = {name: SafetyGuard.from_pretrained(name) for name in settings.guards}
    results: dict[str, Any] = {}
    for attention in settings.attention:
        model, _ = load_model(settings.model, attn_implementation=attention)
        loaded = model.config._attn_implementation
        for name, guard in guards.items():
            start = time.perf_counter()
            try:
                check_fingerprint(model, guard)
                refused = False
            except ModelMismatchError:
                refused = True
            recorded, estimated = boundary_flag_rate(model, guard)
            n_rows = guard.fingerprint.boundary.n_rows
            results.setdefault(name, {})[attention] = {
                "loaded_with": loaded,
                "shift": score_shift(model, guard),
                "recorded_flagged_rows": round(recorded * n_rows),
                "estimated_flagged_rows": round(estimated * n_rows),
                "n_rows": n_rows,
                "refused": refused,
                "check_seconds": time.perf_counter() - start,
            }
            print(attention, name, results[name][attention], flush=True)
        del model
    return results
