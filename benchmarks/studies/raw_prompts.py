"""The released guards on prompts read as they are, without the chat template: what a raw prompt costs.

Every fit, threshold and choice of the bundled guards read prompts as user turns of SmolLM2's chat template, as
:func:`hf_lsad.capture.collect.encode_prompts` makes them. Three public paths read a prompt as it is instead:
``hf-lsad screen --raw``, ``GuardedModelForCausalLM.screen(chat_template=False)`` and the server's
``/v1/completions`` route. This study screens a seeded draw of each guard pool's test rows both ways through the
path ``hf-lsad screen`` takes (:func:`hf_lsad.generation.bulk.plan_batches`, then
:meth:`~hf_lsad.generation.model.GuardedModelForCausalLM.screen`), with each bundled guard as released, and reports
each pool's flag rate with its Wilson 95% interval and the heads that decided, under the template and raw.
Nothing is fitted or chosen.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.splits import split_of
from hf_lsad.data import GUARD_POOLS, is_reserved, is_unsafe_pool, load_pool
from hf_lsad.data.tables import PromptRow
from hf_lsad.generation.bulk import plan_batches
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

from .unseen import screen_batches, wilson_share

READINGS = {"template": True, "raw": False}
"""How a prompt is given to the model: a user turn of the chat template, or as it is."""


@dataclass
class Settings:
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools whose test rows are screened (the release's)."""
    rows_per_pool: int = 300
    """Test rows drawn from each pool (all of them when a pool has fewer)."""
    seed: int = 0
    """Seed of the draw."""
    guards: list[str] = field(default_factory=lambda: ["default", "paper"])
    """The guards screened with, as ``SafetyGuard.from_pretrained`` names them."""
    model: str = "default"
    """The base model (``default``: the bundled SmolLM2-135M-Instruct)."""
    batch_size: int = 16
    """Prompts per forward pass (rows are batched by length)."""


def draw_test_rows(pool: str, settings: Settings) -> list[PromptRow]:
    """A seeded draw of ``pool``'s test rows (the README's demo prompts left out), in file order."""
    rows = [p for p in load_pool(pool) if split_of(p.id) == "test" and not is_reserved(p.text)]
    drawn = sorted(
        random.Random(f"{settings.seed}:{pool}").sample(range(len(rows)), min(len(rows), settings.rows_per_pool))
    )
    return [PromptRow(rows[i].id, rows[i].text) for i in drawn]


def run(settings: Settings) -> dict[str, Any]:
    drawn = {pool: draw_test_rows(pool, settings) for pool in settings.pools}
    model, tokenizer = load_model(settings.model)
    guarded = {
        name: GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(name), tokenizer=tokenizer)
        for name in settings.guards
    }
    results: dict[str, Any] = {
        "rows": {pool: len(rows) for pool, rows in drawn.items()},
        "unsafe_pools": [pool for pool in settings.pools if is_unsafe_pool(pool)],
        "guards": {},
    }
    for name, model_with_guard in guarded.items():
        entry: dict[str, Any] = {}
        for reading, chat_template in READINGS.items():
            print(f"screening with the {name} guard, prompts read {reading}", flush=True)
            pools: dict[str, Any] = {}
            for pool, rows in drawn.items():
                batches, unreadable = plan_batches(
                    model_with_guard, rows, batch_size=settings.batch_size, chat_template=chat_template
                )
                if unreadable:
                    raise RuntimeError(f"{pool}: {len(unreadable)} rows cannot be screened, e.g. {unreadable[0]}")
                reports = screen_batches(model_with_guard, tokenizer, batches)
                flagged = [row.id for row in rows if reports[row.id].flagged]
                pools[pool] = {
                    "flagged": wilson_share(len(flagged), len(rows)),
                    "decided_by": dict(Counter("+".join(reports[i].decided_by) for i in flagged)),
                }
            entry[reading] = pools
            print(
                f"  {name}, {reading}: " + "; ".join(f"{p} {v['flagged']['rate']:.3f}" for p, v in pools.items()),
                flush=True,
            )
        results["guards"][name] = entry
    return results
