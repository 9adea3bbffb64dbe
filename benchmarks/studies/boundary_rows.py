"""A fingerprint that keeps the benign rows nearest the thresholds: does it refuse the copies of the bundled model
that move the operating point, and pass those that do not? Validation rows only.

``heads/fingerprint_statistics`` found that no statistic of the 16 probes catches the bundled weights requantised in
Q8_0, which more than doubles the validation chat flagged (14 of 200 against 6): the probes sit far from the
thresholds, and a change that lifts every harm logit by half a unit carries across only the rows that sat just below.
This study keeps exactly those rows. For each bundled guard, the chat pool's validation rows (what the default
guard's thresholds were set on) are read through the bundled model, and of them the ``per_side`` rows nearest each
head's threshold on either side (:func:`hf_lsad.guard.fingerprint.boundary_indices`) are kept with their verdicts.
Read again through a copy of the model, the verdicts that change estimate the copy's flag rate on all those rows
(:func:`hf_lsad.guard.fingerprint.boundary_flag_rate`); the check would refuse a copy whose estimate moves by more
than a tolerance, relative to the recorded rate.

The tolerance is chosen by a rule stated before the run: the smallest of ``tolerances`` at which, with
``chosen_per_side`` rows a side, both bundled guards pass every copy in ``keeping`` (float16 and bfloat16, the same
weights rounded; Gaussian noise at 0.5% and 1% of each matrix's spread, which changed 3 of 270 validation verdicts,
as bfloat16 changed 3 of 310 test verdicts in ``heads/dtype_shift``). The copies (those of
``heads/fingerprint_statistics``) are then read at that tolerance, refused by the boundary rows or by the probes'
shift. Other ``per_side`` values are measured beside it, descriptive. The cost of reading the boundary rows, which a
guarded model pays once when it is built, is timed.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from hf_lsad import SafetyGuard, load_model
from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.guard.fingerprint import SHIFT_TOLERANCE, boundary_flag_rate, record_fingerprint, score_shift
from hf_lsad.guard.heads.budget import released_threshold_prompts

from .fingerprint_statistics import Settings as CopySettings, _copies


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guards: list[str] = field(
        default_factory=lambda: ["hf_lsad/guards/smollm2-135m-instruct", "hf_lsad/guards/smollm2-135m-instruct-paper"]
    )
    """The bundled guards (thresholds as released; only their fingerprints are recorded again, in memory)."""
    per_side: list[int] = field(default_factory=lambda: [8, 16, 32])
    """Rows kept on each side of each head's threshold."""
    chosen_per_side: int = 16
    """The rows a side the tolerance is chosen at (stated before the run; the others are descriptive)."""
    tolerances: list[float] = field(default_factory=lambda: [0.10, 0.15, 0.20, 0.25, 0.33, 0.50])
    """Candidate tolerances: the largest relative change of the estimated flag rate a copy may make."""
    keeping: list[str] = field(default_factory=lambda: ["float16", "bfloat16", "noise 0.005", "noise 0.01"])
    """Copies that keep the operating point, which the chosen tolerance must pass (labels of the copies)."""
    max_batch_tokens: int = 4096
    """Padded tokens a forward pass holds at most, reading the validation chat."""


def _relative(recorded: float, estimated: float) -> float:
    return abs(estimated - recorded) / recorded


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model(settings.model)
    prompts = released_threshold_prompts()
    guards = {path.rsplit("/", 1)[-1]: SafetyGuard.from_pretrained(path) for path in settings.guards}
    reads = sorted({read for guard in guards.values() for read in guard.reads})
    started = time.perf_counter()
    features, _ = collect_prompt_features(
        model, tokenizer, prompts, reads, max_batch_tokens=settings.max_batch_tokens, progress=False
    )
    results: dict[str, Any] = {
        "rows": len(prompts),
        "read_seconds": time.perf_counter() - started,
        "guards": {},
        "copies": {},
    }
    fingerprinted: dict[tuple[str, int], SafetyGuard] = {}
    for name, guard in guards.items():
        entry: dict[str, Any] = {}
        for per_side in settings.per_side:
            kept = copy.deepcopy(guard)
            fingerprint = record_fingerprint(
                model,
                tokenizer,
                kept,
                benign_prompts=prompts,
                benign_features={read: features[read] for read in kept.reads},
                rows="validation chat",
                per_side=per_side,
            )
            boundary = fingerprint.boundary
            assert boundary is not None
            started = time.perf_counter()
            same = boundary_flag_rate(model, kept)
            entry[str(per_side)] = {
                "kept_rows": int(boundary.input_ids.shape[0]),
                "kept_flagged": int(boundary.flagged.sum()),
                "tokens": int(boundary.attention_mask.sum()),
                "flagged_rows": boundary.flagged_rows,
                "check_seconds": time.perf_counter() - started,
                "same_model": same,
            }
            fingerprinted[(name, per_side)] = kept
        results["guards"][name] = entry
        print(name, entry, flush=True)

    for label, make in _copies(model, CopySettings()):
        copied = make()
        entry = {}
        for name in guards:
            shift = score_shift(copied, fingerprinted[(name, settings.per_side[0])])
            rates = {}
            for per_side in settings.per_side:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    rate = boundary_flag_rate(copied, fingerprinted[(name, per_side)])
                assert rate is not None
                rates[str(per_side)] = {"recorded": rate[0], "estimated": rate[1], "relative": _relative(*rate)}
            entry[name] = {"shift": shift, "shift_refuses": not max(shift.values()) <= SHIFT_TOLERANCE, "rates": rates}
        results["copies"][label] = entry
        print(label, entry, flush=True)
        del copied

    chosen = str(settings.chosen_per_side)
    passing = [
        tolerance
        for tolerance in settings.tolerances
        if all(
            results["copies"][label][name]["rates"][chosen]["relative"] <= tolerance
            for label in settings.keeping
            for name in guards
        )
    ]
    tolerance = min(passing) if passing else None
    results["chosen"] = {"per_side": settings.chosen_per_side, "tolerance": tolerance}
    if tolerance is not None:
        results["refused_at_chosen"] = {
            label: {
                name: {
                    "by_boundary": not entry[name]["rates"][chosen]["relative"] <= tolerance,  # nan is refused
                    "by_shift": entry[name]["shift_refuses"],
                }
                for name in guards
            }
            for label, entry in results["copies"].items()
        }
    return results
