"""Which statistic of a fingerprint's probe scores tracks what the released thresholds do on another copy of the
model, on validation rows.

``heads/quant_shift`` found a gap in the fingerprint check: the bundled weights quantised again in Q8_0 pass it
(shift 0.07, tolerance 0.15) while every probe's harm logit rises by 0.35-0.65 and more test chat is flagged. The
shift divides the median change of a head's probe scores by their spread, which the probes' extremes make wide
(the harm head's logits run from -16 to +11). This study measures, for each copy of the bundled model, several
statistics of the same probe scores beside what the released thresholds do on a seeded draw of **validation** rows
(``chat_rows`` of chat, ``rows_per_source`` per unsafe source): rows flagged, verdicts changed against the bundled
model, how far the harm logit moved. The statistics, per head (``d``: the change of each probe's raw score):

- ``median_abs_over_std``: ``median |d| / std(recorded)``, the check's shift today;
- ``abs_mean_over_std``: ``|mean d| / std(recorded)``, the systematic part of the change;
- ``median_abs``: ``median |d|`` in the head's own units (log-odds for a supervised head);
- ``median_abs_over_mad``: ``median |d|`` over the median absolute deviation of the recorded scores, a spread the
  extremes weigh less.

Copies: float16 and bfloat16 (the statistics only: screening rounded weights is slow on this CPU), Gaussian noise at
``noise_levels`` of each matrix's standard deviation, the requantised and float-like copies of ``heads/quant_shift``.
It fits no head, chooses nothing and changes no tolerance; a later change of the check would be chosen on these
validation figures and measured again on test rows.
"""

from __future__ import annotations

import copy
import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad import SafetyGuard, load_model
from hf_lsad.core.splits import split_of
from hf_lsad.data import load_pool
from hf_lsad.data.pools import is_reserved
from hf_lsad.evaluation.sources import EVAL_SOURCES
from hf_lsad.guard.fingerprint import _read_probes

from .quant_shift import _float_like_copy, _quantised_weights, _requantised_copy
from .score_shift import _screened
from .system_prompt import Settings as ScreenSettings


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard (its fingerprint recorded through the bundled model)."""
    dtypes: list[str] = field(default_factory=lambda: ["float16", "bfloat16"])
    """The bundled weights rounded to these dtypes."""
    noise_levels: list[float] = field(default_factory=lambda: [0.005, 0.01, 0.02])
    """Gaussian noise added to every quantised matrix, as a fraction of its standard deviation (seed 0)."""
    quant_types: list[str] = field(default_factory=lambda: ["Q8_0", "Q5_1", "Q5_0", "Q4_0"])
    """Requantised copies (as heads/quant_shift)."""
    float_like_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Float-like copies (as heads/quant_shift)."""
    chat_rows: int = 200
    """Validation rows of chat screened on each copy (seeded draw)."""
    rows_per_source: int = 10
    """Validation rows per unsafe source screened on each copy."""
    seed: int = 0
    """Seed of the draws and of the noise."""


def _validation_rows(settings: Settings, screen: ScreenSettings) -> list[tuple[str, str, str]]:
    """``(source, group, text)``: a seeded draw of validation chat rows, then of each unsafe source's."""
    rng = random.Random(settings.seed)
    chat = [p for p in load_pool("chat") if split_of(p.id) == "validation" and not is_reserved(p.text)]
    rows = [(p.source, "chat", p.text) for p in rng.sample(chat, settings.chat_rows)]
    for source in EVAL_SOURCES:
        candidates = [
            p
            for pool in screen.unsafe_pools
            for p in load_pool(pool)
            if p.source == source and split_of(p.id) == "validation" and not is_reserved(p.text)
        ]
        rows += [(p.source, "unsafe", p.text) for p in rng.sample(candidates, settings.rows_per_source)]
    return rows


def _statistics(model: Any, guard: SafetyGuard) -> dict[str, dict[str, float]]:
    fingerprint = guard.fingerprint
    assert fingerprint is not None, "the released guard carries a fingerprint"
    recorded = fingerprint.scores  # [heads, probes]
    change = _read_probes(model, guard, fingerprint.input_ids, fingerprint.attention_mask) - recorded
    std = recorded.std(dim=1)
    mad = (recorded - recorded.median(dim=1, keepdim=True).values).abs().median(dim=1).values
    median_abs = change.abs().median(dim=1).values
    table = {
        "median_abs_over_std": median_abs / std,
        "abs_mean_over_std": change.mean(dim=1).abs() / std,
        "median_abs": median_abs,
        "median_abs_over_mad": median_abs / mad,
    }
    return {name: dict(zip(fingerprint.heads, values.tolist())) for name, values in table.items()}


def _copies(model: Any, settings: Settings) -> list[tuple[str, Any]]:
    """``(label, make)``: each copy of ``model`` the study measures, made when asked for."""

    def rounded(dtype: str) -> Any:
        return copy.deepcopy(model).to(getattr(torch, dtype))

    def noisy(level: float) -> Any:
        copied, generator = copy.deepcopy(model), torch.Generator().manual_seed(settings.seed)
        with torch.no_grad():
            for _, weight, _ in _quantised_weights(copied):
                weight.add_(torch.randn(weight.shape, generator=generator) * weight.std() * level)
        return copied

    return [
        *[(dtype, lambda d=dtype: rounded(d)) for dtype in settings.dtypes],
        *[(f"noise {level:g}", lambda v=level: noisy(v)) for level in settings.noise_levels],
        *[(f"requantised {kind}", lambda k=kind: _requantised_copy(model, k)) for kind in settings.quant_types],
        *[(f"float-like seed {seed}", lambda s=seed: _float_like_copy(model, s)) for seed in settings.float_like_seeds],
    ]


def run(settings: Settings) -> dict[str, Any]:
    screen = ScreenSettings(model=settings.model, guard=settings.guard, rows_per_source=settings.rows_per_source)
    rows = _validation_rows(settings, screen)
    texts, groups = [text for _, _, text in rows], [group for _, group, _ in rows]
    guard = SafetyGuard.from_pretrained(settings.guard)
    model, tokenizer = load_model(settings.model)
    base_flags, base_harm = _screened(model, tokenizer, guard, texts, screen)

    def counted(flags: list[bool]) -> dict[str, int]:
        return {group: sum(f for f, g in zip(flags, groups) if g == group) for group in dict.fromkeys(groups)}

    results: dict[str, Any] = {
        "rows": {group: groups.count(group) for group in dict.fromkeys(groups)},
        "base": {"flagged": counted(base_flags)},
        "copies": {},
    }
    for label, make in _copies(model, settings):
        copied = make()
        entry: dict[str, Any] = {"statistics": _statistics(copied, guard)}
        if label not in settings.dtypes:  # rounded weights are slow on this CPU: heads/dtype_shift screened bfloat16
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the ScoreShiftWarning: the shift is what is measured
                flags, harm = _screened(copied, tokenizer, guard, texts, screen)
            moved = harm - base_harm
            entry |= {
                "flagged": counted(flags),
                "verdicts_changed": sum(a != b for a, b in zip(flags, base_flags)),
                "harm_logit_moved_median": float(moved.abs().median()),
                "harm_logit_moved_mean": float(moved.mean()),
            }
        results["copies"][label] = entry
        print(label, entry, flush=True)
        del copied
    return results
