"""Thresholds set again through a copy of the bundled model: does ``hf-lsad set-budget`` bring the released operating
point back on it?

``heads/quant_shift`` found that copies of the bundled model as far from its weights as the float weights it was
quantised from are refused by the released guard's fingerprint, and that at the released thresholds they flag less
chat and let some harm through. The remedy the refusal names is to set the thresholds through the copy
(:func:`hf_lsad.guard.heads.budget.fit_budget_on_prompts` on the bundled validation chat rows, the release's rule,
what ``hf-lsad set-budget --model COPY --guard default`` runs). This study does that for each float-like copy of
``heads/quant_shift`` (the same seeds) and screens the same draw of test rows through the copy with its own
thresholds: chat flagged and harm caught, against the bundled model with the released guard. The heads are not fitted
again: only the thresholds (and the fingerprint) move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_lsad import SafetyGuard, load_model
from hf_lsad.guard.heads.budget import fit_budget_on_prompts

from .dtype_shift import Settings as DrawSettings, _draw
from .quant_shift import _float_like_copy
from .score_shift import _measure, _screened
from .system_prompt import Settings as ScreenSettings


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard, whose thresholds are set again through each copy."""
    float_like_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of the float-like copies (those of heads/quant_shift)."""
    chat_rows: int = 200
    """Test rows of chat screened on each copy (the draw of heads/score_shift)."""
    rows_per_source: int = 10
    """Test rows per unsafe source screened on each copy."""
    seed: int = 0
    """Seed of the row draw."""


def run(settings: Settings) -> dict[str, Any]:
    draw = DrawSettings(chat_rows=settings.chat_rows, lookalike_rows=0, rows_per_source=settings.rows_per_source)
    screen = ScreenSettings(model=settings.model, guard=settings.guard, rows_per_source=settings.rows_per_source)
    rows = [row for row in _draw(draw, screen) if row[1] != "lookalike"]
    groups = [group for _, group, _ in rows]
    released = SafetyGuard.from_pretrained(settings.guard)
    model, tokenizer = load_model(settings.model)
    base = _screened(model, tokenizer, released, [text for _, _, text in rows], screen)
    results: dict[str, Any] = {
        "rows": {group: groups.count(group) for group in dict.fromkeys(groups)},
        "released": {
            "thresholds": released.budget.thresholds if released.budget is not None else None,
            "flagged": {
                group: sum(f for f, g in zip(base[0], groups) if g == group) for group in dict.fromkeys(groups)
            },
        },
        "copies": {},
    }
    for seed in settings.float_like_seeds:
        copied = _float_like_copy(model, seed)
        guard = SafetyGuard.from_pretrained(settings.guard)
        budget = fit_budget_on_prompts(copied, tokenizer, guard, None)
        entry = {
            "thresholds": budget.thresholds,
            "validation_chat_flagged": budget.measured_fpr,
            **_measure(copied, tokenizer, guard, rows, base, screen),
        }
        results["copies"][f"float-like seed {seed}"] = entry
        print(seed, entry, flush=True)
        del copied
    return results
