"""The fingerprint check on models that keep the weights and on fine-tunes merged into them: where it refuses, and how
far the operating point has moved by then.

A guard records every head's score on fixed probe prompts through the model its thresholds were set through, and
refuses a model on which some head's scores moved by more than ``SHIFT_TOLERANCE`` of their spread, or (a guard that
keeps them) on which the verdicts of the rows nearest its thresholds move its estimated flag rate by more than
``RATE_TOLERANCE`` (:mod:`hf_lsad.guard.fingerprint`). This study measures that shift for the released guard:

- on the bundled model in float16 and bfloat16 (the same weights, rounded: the operating point barely moves,
  ``heads/dtype_shift``), which should pass;
- along the training of LoRA fine-tunes merged into the weights (peft's ``merge_and_unload``: no adapter is left for
  :func:`hf_lsad.capture.adapters.check_adapter` to see). The fine-tunes are those of ``heads/adapter_shift``: a
  support bot's system turn distilled into the weights, on the bundled model's own answers to fit-split chat prompts.
  After each of ``checkpoints`` optimiser steps, the adapter is merged into a copy of the model; the copy's shift is
  measured, and a seeded draw of test rows (``chat_rows`` of chat, ``rows_per_source`` per unsafe source, as
  ``heads/dtype_shift`` draws them) is screened through it at the released thresholds, the guard allowed the shift.

So each checkpoint says whether the check refuses the model, and what the released thresholds would do on it: chat
flagged, harm caught, verdicts changed against the base model, and how far the harm head's logit moved on the rows
(median of the absolute change; mean of the signed one; a guard without a harm head: the anomaly head's calibrated
log-odds, :func:`logit_head`). It fits no head and chooses nothing; the tolerance was
set before this run, on scratch measurements of a lighter fine-tune and of weight noise (the claim says which).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, load_model
from hf_lsad.errors import ModelMismatchError
from hf_lsad.guard.fingerprint import SHIFT_TOLERANCE, boundary_flag_rate, check_fingerprint, score_shift

from .adapter_shift import SUPPORT_BOT, Settings as AdapterSettings, _answers, _batch, _chat, _examples
from .dtype_shift import Settings as DrawSettings, _draw
from .system_prompt import Settings as ScreenSettings, _screen


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard (its fingerprint recorded through the bundled model in float32)."""
    dtypes: list[str] = field(default_factory=lambda: ["float16", "bfloat16"])
    """The bundled model's weights rounded to these dtypes: the shift alone is measured."""
    adapters: list[dict[str, Any]] = field(
        default_factory=lambda: [
            {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
            {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        ]
    )
    """peft ``LoraConfig`` arguments of each fine-tune (``lora_dropout`` 0.05), those of ``heads/adapter_shift``."""
    train_prompts: int = 240
    """Fit-split chat prompts the fine-tunes are trained on (as ``heads/adapter_shift``)."""
    epochs: int = 2
    """Passes over the training prompts (as ``heads/adapter_shift``: 60 steps in batches of 8)."""
    checkpoints: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 15, 30, 60])
    """Optimiser steps after which the fine-tune is merged, measured and screened."""
    chat_rows: int = 200
    """Test rows of chat screened at each checkpoint (seeded draw)."""
    rows_per_source: int = 10
    """Test rows per unsafe source screened at each checkpoint."""
    seed: int = 0
    """Seed of the draws, the adapters' initialisation and the order of training."""


def logit_head(guard: SafetyGuard) -> str:
    """The head whose log-odds a study follows: the harm head, or the anomaly head of a guard without one (the paper
    guard, whose calibrated probability is its score)."""
    return "harm" if "harm" in guard.head_names else "anomaly"


def _screened(
    model: Any, tokenizer: Any, guard: SafetyGuard, texts: list[str], screen: ScreenSettings
) -> tuple[list[bool], torch.Tensor]:
    """The released thresholds' verdicts on ``texts`` through ``model`` (the guard allowed whatever shift it has) and
    the log-odds of :func:`logit_head` on each."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ScoreShiftWarning the refusal below is measured by instead
        guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer, allow_score_shift=True)
    reports, _ = _screen(guarded, tokenizer, texts, "", screen)
    if guard.heads:
        name = logit_head(guard)
        scores = [next(h.score for h in r.heads if h.name == name) for r in reports]
    else:  # a single-head guard: its one verdict is the anomaly head's calibrated probability
        if guard.calibration is None:
            raise ValueError("an uncalibrated single-head guard has no probability to follow")
        scores = [r.probability for r in reports]
    probability = torch.tensor(scores, dtype=torch.float64)
    return [bool(report.flagged) for report in reports], torch.logit(probability.clamp(1e-12, 1 - 1e-12))


def _measure(
    model: Any, tokenizer: Any, guard: SafetyGuard, rows: list, base: tuple[list[bool], torch.Tensor], screen: Any
) -> dict[str, Any]:
    shift = score_shift(model, guard)
    try:
        check_fingerprint(model, guard)
        refused = False
    except ModelMismatchError:
        refused = True
    flagged, logit = _screened(model, tokenizer, guard, [text for _, _, text in rows], screen)
    groups = [group for _, group, _ in rows]
    return {
        "shift": shift,
        "shift_refuses": not max(shift.values()) <= SHIFT_TOLERANCE,
        "boundary_rate": boundary_flag_rate(model, guard),  # (recorded, estimated); None without boundary rows
        "refused": refused,  # the whole check: the probes' shift, then the boundary rows
        "flagged": {group: sum(f for f, g in zip(flagged, groups) if g == group) for group in dict.fromkeys(groups)},
        "verdicts_changed": sum(a != b for a, b in zip(flagged, base[0])),
        f"{logit_head(guard)}_logit_moved_median": float((logit - base[1]).abs().median()),
        f"{logit_head(guard)}_logit_moved_mean": float((logit - base[1]).mean()),
    }


def run(settings: Settings) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    draw = DrawSettings(chat_rows=settings.chat_rows, lookalike_rows=0, rows_per_source=settings.rows_per_source)
    screen = ScreenSettings(model=settings.model, guard=settings.guard, rows_per_source=settings.rows_per_source)
    rows = [row for row in _draw(draw, screen) if row[1] != "lookalike"]
    guard = SafetyGuard.from_pretrained(settings.guard)
    model, tokenizer = load_model(settings.model)
    texts = [text for _, _, text in rows]
    base = _screened(model, tokenizer, guard, texts, screen)
    groups = [group for _, group, _ in rows]
    results_groups = list(dict.fromkeys(groups))
    results: dict[str, Any] = {
        "tolerance": SHIFT_TOLERANCE,
        "rows": {group: groups.count(group) for group in dict.fromkeys(groups)},
        "base": {
            "shift": score_shift(model, guard),
            "flagged": {group: sum(f for f, g in zip(base[0], groups) if g == group) for group in results_groups},
        },
        "dtypes": {},
        "fine_tunes": [],
    }
    for dtype in settings.dtypes:
        rounded = copy.deepcopy(model).to(getattr(torch, dtype))
        shift = score_shift(rounded, guard)
        results["dtypes"][dtype] = {"shift": shift, "refused": max(shift.values()) > SHIFT_TOLERANCE}
        del rounded

    train = AdapterSettings(train_prompts=settings.train_prompts, seed=settings.seed)
    prompts = _chat("fit", train.train_prompts, train)
    examples = _examples(tokenizer, prompts, _answers(model, tokenizer, prompts, SUPPORT_BOT, train))
    for adapter in settings.adapters:
        torch.manual_seed(settings.seed)
        tuned = get_peft_model(copy.deepcopy(model), LoraConfig(lora_dropout=0.05, **adapter))
        optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=train.learning_rate)
        generator = torch.Generator().manual_seed(settings.seed)
        order = [i for _ in range(settings.epochs) for i in torch.randperm(len(examples), generator=generator).tolist()]
        steps = range(0, len(order), train.train_batch_size)
        entry: dict[str, Any] = {"adapter": adapter, "checkpoints": {}}
        for step, start in enumerate(tqdm(steps, desc=f"fine-tune {adapter['target_modules']}"), start=1):
            tuned.train()
            batch = _batch([examples[i] for i in order[start : start + train.train_batch_size]], tokenizer.pad_token_id)
            tuned(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step in settings.checkpoints:
                tuned.eval()
                merged = copy.deepcopy(tuned).merge_and_unload()
                entry["checkpoints"][step] = _measure(merged, tokenizer, guard, rows, base, screen)
                print(step, entry["checkpoints"][step], flush=True)
                del merged
        results["fine_tunes"].append(entry)
    results["summary"] = {
        "dtypes_largest_shift": max((max(d["shift"].values()) for d in results["dtypes"].values()), default=None),
        "first_refused_step": [
            min((s for s, c in e["checkpoints"].items() if c["refused"]), default=None) for e in results["fine_tunes"]
        ],
    }
    return results
