"""The fingerprint check on other quantisations of the bundled model, and on copies as far from it as the float
weights it was quantised from.

The bundled SmolLM2-135M-Instruct is a GGUF file whose decoder blocks are stored in Q4_1 (4 bits a weight, blocks of
32) and its tied embedding in Q8_0; transformers de-quantises it to float32, and the released guard's thresholds and
fingerprint were set through those weights. A user may load another quantisation of the same model, or the float
weights it was quantised from (``HuggingFaceTB/SmolLM2-135M-Instruct`` on the Hub), under the same name. This study
measures the fingerprint's check on such copies made here (the probes' shift,
:func:`hf_lsad.guard.fingerprint.score_shift`, and, for a guard that keeps them, the rows nearest its thresholds,
:func:`hf_lsad.guard.fingerprint.boundary_flag_rate`), and what the released thresholds do on them (the check
allowed), row by row against the bundled model:

- **requantised**: every Q4_1 tensor quantised again in each of ``quant_types`` (gguf's own legacy quantisers, blocks
  of 32 along a row, as a GGUF file of that type stores them and transformers reads them back), the embedding again
  in Q8_0. ``Q4_1`` again is the check of the method: it should give back the bundled weights.
- **float-like**: the float weights are not here (no network), but the rounding tells where they lay: Q4_1 rounds
  each weight to the nearest of 16 levels ``m + q d`` of its block (``d`` the block's range over 15, its least and
  largest weights exact), Q8_0 to the nearest ``q d`` (``d`` the block's largest magnitude over 127). Each of
  ``float_like_seeds`` draws a copy with every other weight moved uniformly within its rounding interval (half a
  level either way): weights the file would round to the bundled ones, as far from them as the float weights are.

Rows: the draw of ``heads/score_shift`` (200 test rows of chat, 10 per unsafe source). It fits no head and chooses
nothing; the tolerance (``SHIFT_TOLERANCE``) is not changed on its figures.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from gguf import GGMLQuantizationType, quants

from hf_lsad import SafetyGuard, load_model
from hf_lsad.guard.fingerprint import RATE_TOLERANCE, SHIFT_TOLERANCE, boundary_flag_rate, score_shift

from .dtype_shift import Settings as DrawSettings, _draw
from .score_shift import _measure, _screened
from .system_prompt import Settings as ScreenSettings

BLOCK = 32
"""Weights per block of the legacy GGUF quantisations (Q4_0 to Q8_0)."""

BLOCK_TENSORS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder blocks' matrices, Q4_1 in the bundled file."""


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct (its blocks de-quantised from Q4_1, its embedding from Q8_0)."""
    guard: str = "hf_lsad/guards/smollm2-135m-instruct"
    """The released guard (its fingerprint recorded through the bundled model)."""
    quant_types: list[str] = field(default_factory=lambda: ["Q4_1", "Q8_0", "Q5_1", "Q5_0", "Q4_0"])
    """Legacy GGUF quantisations the blocks' matrices are quantised again in (the embedding again in Q8_0)."""
    float_like_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    """Seeds of the copies moved within the rounding intervals of the bundled file."""
    chat_rows: int = 200
    """Test rows of chat screened on each copy (the draw of heads/score_shift)."""
    rows_per_source: int = 10
    """Test rows per unsafe source screened on each copy."""
    seed: int = 0
    """Seed of the row draw."""


def _quantised_weights(model: Any) -> list[tuple[str, torch.nn.Parameter, str]]:
    """Each matrix the bundled file stores quantised, with its GGUF type there: the blocks' (Q4_1), the embedding
    (Q8_0; the output layer is tied to it)."""
    found = [
        (name, p, "Q4_1")
        for name, p in model.named_parameters()
        if name.endswith(".weight") and name.split(".")[-2] in BLOCK_TENSORS
    ]
    embedding = model.get_input_embeddings().weight
    return [*found, ("embed_tokens", embedding, "Q8_0")]


def _requantised(weight: torch.Tensor, quant_type: str) -> torch.Tensor:
    kind = GGMLQuantizationType[quant_type]
    rows = weight.detach().cpu().numpy()  # [out, in]: a GGUF file blocks each row along its inputs
    return torch.from_numpy(quants.dequantize(quants.quantize(rows, kind), kind).reshape(rows.shape))


def _float_like(weight: torch.Tensor, stored_as: str, generator: torch.Generator) -> torch.Tensor:
    """``weight`` with every weight a rounding could have come from moved uniformly within its interval, the block's
    exact weights (its least and largest in Q4_1, its largest magnitude in Q8_0) kept."""
    blocks = weight.detach().reshape(-1, BLOCK)  # [blocks, 32]
    if stored_as == "Q4_1":
        low, high = blocks.min(dim=1, keepdim=True).values, blocks.max(dim=1, keepdim=True).values
        step = (high - low) / 15  # [blocks, 1]
        exact = (blocks == low) | (blocks == high)
    else:  # Q8_0
        magnitude = blocks.abs().max(dim=1, keepdim=True).values
        step = magnitude / 127
        exact = blocks.abs() == magnitude
    noise = (torch.rand(blocks.shape, generator=generator) - 0.5) * step
    return torch.where(exact, blocks, blocks + noise).reshape(weight.shape)


def _requantised_copy(model: Any, kind: str) -> Any:
    """A copy of ``model`` with its Q4_1 matrices quantised again in ``kind``, its embedding again in Q8_0."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for _, weight, stored_as in _quantised_weights(copied):
            weight.copy_(_requantised(weight, kind if stored_as == "Q4_1" else "Q8_0"))
    return copied


def _float_like_copy(model: Any, seed: int) -> Any:
    """A copy of ``model`` with every quantised weight moved within its rounding interval (:func:`_float_like`)."""
    copied, generator = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, weight, stored_as in _quantised_weights(copied):
            weight.copy_(_float_like(weight, stored_as, generator))
    return copied


@torch.no_grad()
def _relative_change(model: Any, base: Any) -> float:
    """Mean absolute change of the quantised matrices' weights, over their mean magnitude."""
    changed = {name: p for name, p, _ in _quantised_weights(model)}
    reference = {name: p for name, p, _ in _quantised_weights(base)}
    moved = sum(float((changed[name] - reference[name]).abs().sum()) for name in reference)
    return moved / sum(float(p.abs().sum()) for p in reference.values())


def run(settings: Settings) -> dict[str, Any]:
    draw = DrawSettings(chat_rows=settings.chat_rows, lookalike_rows=0, rows_per_source=settings.rows_per_source)
    screen = ScreenSettings(model=settings.model, guard=settings.guard, rows_per_source=settings.rows_per_source)
    rows = [row for row in _draw(draw, screen) if row[1] != "lookalike"]
    groups = [group for _, group, _ in rows]
    guard = SafetyGuard.from_pretrained(settings.guard)
    model, tokenizer = load_model(settings.model)
    base = _screened(model, tokenizer, guard, [text for _, _, text in rows], screen)
    results: dict[str, Any] = {
        "tolerance": {"shift": SHIFT_TOLERANCE, "rate": RATE_TOLERANCE},
        "rows": {group: groups.count(group) for group in dict.fromkeys(groups)},
        "base": {
            "shift": score_shift(model, guard),
            "boundary_rate": boundary_flag_rate(model, guard),
            "flagged": {
                group: sum(f for f, g in zip(base[0], groups) if g == group) for group in dict.fromkeys(groups)
            },
        },
        "copies": {},
    }
    copies = [(f"requantised {kind}", lambda k=kind: _requantised_copy(model, k)) for kind in settings.quant_types]
    copies += [
        (f"float-like seed {seed}", lambda s=seed: _float_like_copy(model, s)) for seed in settings.float_like_seeds
    ]
    for label, make in copies:
        copied = make()
        entry = {
            "weights_moved": _relative_change(copied, model),
            **_measure(copied, tokenizer, guard, rows, base, screen),
        }
        results["copies"][label] = entry
        print(label, entry, flush=True)
        del copied
    float_like = [c for label, c in results["copies"].items() if label.startswith("float-like")]
    results["summary"] = {
        "refused": [label for label, c in results["copies"].items() if c["refused"]],
        "float_like_largest_shift": max((max(c["shift"].values()) for c in float_like), default=None),
    }
    return results
