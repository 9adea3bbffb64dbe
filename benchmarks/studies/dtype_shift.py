"""The released guard on the bundled model loaded in another dtype: how far bfloat16 weights move its operating point.

The guard was fitted and thresholded on the residual stream of the float32 model; on a GPU the same model is usually
served in bfloat16 (``hf-lsad generate --dtype bf16``, ``load_model(dtype=torch.bfloat16)``). The guard itself stays
in float32 and reads the residual stream the bfloat16 model makes (docs/usage.md, "dtype"). This study screens the
same test rows through the model in each of ``Settings.dtypes`` with the released guard and compares, row by row,
each head's score with the float32 model's, and the verdicts.

Rows: a seeded draw of ``chat_rows`` test rows of chat and ``lookalike_rows`` of the look-alikes, and
``rows_per_source`` per unsafe source (the sources and pools of ``heads/system_prompt``). bfloat16 matrix products are
slow on this CPU (1.5 s a row against 0.26 s in float32, in its run), hence the small draw. It fits no head and
chooses nothing.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, load_model

from .system_prompt import Settings as ScreenSettings, _rows, _screen


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard."""
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    """The model's dtypes, the first the reference (the one the guard was fitted and thresholded in)."""
    chat_rows: int = 200
    """Test rows of chat drawn (seeded)."""
    lookalike_rows: int = 40
    """Test rows of the benign look-alikes drawn (seeded)."""
    rows_per_source: int = 10
    """Test rows drawn per unsafe source."""
    batch_size: int = 16
    """Rows a forward pass holds at most."""
    max_batch_tokens: int = 4096
    """Padded tokens a forward pass holds at most."""
    seed: int = 0
    """Seed of the draws."""


def _draw(settings: Settings, screen: ScreenSettings) -> list[tuple[str, str, str]]:
    rows = _rows(screen)  # every test row of chat and the look-alikes, then rows_per_source per unsafe source
    rng = random.Random(settings.seed)
    chat = [r for r in rows if r[1] == "chat"]
    lookalike = [r for r in rows if r[1] == "lookalike"]
    unsafe = [r for r in rows if r[1] == "unsafe"]
    return rng.sample(chat, settings.chat_rows) + rng.sample(lookalike, settings.lookalike_rows) + unsafe


def _logit(p: torch.Tensor) -> torch.Tensor:
    return torch.logit(p.double().clamp(1e-12, 1 - 1e-12))


def run(settings: Settings) -> dict[str, Any]:
    screen = ScreenSettings(
        model=settings.model,
        guard=settings.guard,
        rows_per_source=settings.rows_per_source,
        batch_size=settings.batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        seed=settings.seed,
    )
    rows = _draw(settings, screen)
    texts = [text for _, _, text in rows]
    groups = [group for _, group, _ in rows]
    guard = SafetyGuard.from_pretrained(settings.guard)
    names = guard.head_names
    runs: dict[str, Any] = {}
    for dtype in settings.dtypes:
        model, tokenizer = load_model(settings.model, dtype=getattr(torch, dtype))
        guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
        start = time.perf_counter()
        reports, _ = _screen(guarded, tokenizer, texts, "", screen)
        seconds = time.perf_counter() - start
        scores = torch.tensor([[h.score for h in r.heads] for r in reports], dtype=torch.float64)  # [rows, heads]
        flagged = [bool(r.flagged) for r in reports]
        runs[dtype] = {"scores": scores, "flagged": flagged, "seconds": seconds}
        del model, guarded
    reference = settings.dtypes[0]
    results: dict[str, Any] = {
        "rows": {group: groups.count(group) for group in dict.fromkeys(groups)},
        "reference": reference,
        "dtypes": {},
    }
    for dtype, run_ in runs.items():
        entry: dict[str, Any] = {
            "seconds": run_["seconds"],
            "flagged": {
                group: sum(f for f, g in zip(run_["flagged"], groups) if g == group) for group in results["rows"]
            },
        }
        if dtype != reference:
            base = runs[reference]
            for i, name in enumerate(names):
                # the harm head's score is a probability: compared on the logit scale its threshold lives on
                a, b = base["scores"][:, i], run_["scores"][:, i]
                diff = (_logit(b) - _logit(a)) if name != "anomaly" else (b - a)
                entry[f"{name}_difference"] = {
                    "scale": "probability" if name == "anomaly" else "logit",
                    "median_absolute": float(diff.abs().median()),
                    "max_absolute": float(diff.abs().max()),
                    "mean": float(diff.mean()),
                }
            pairs = zip(groups, base["flagged"], run_["flagged"])
            changed = [(g, before, after) for g, before, after in pairs if before != after]
            entry["verdicts_changed"] = {
                group: {
                    "now_flagged": sum(1 for g, before, _ in changed if g == group and not before),
                    "no_longer_flagged": sum(1 for g, before, _ in changed if g == group and before),
                }
                for group in results["rows"]
            }
            entry["slowdown"] = run_["seconds"] / base["seconds"]
        results["dtypes"][dtype] = entry
    return results
