"""Collecting with the opening every prompt shares run once, against running each prompt whole, on fit prompts
``hf-lsad teach`` collects on the bundled model, under the template's default system turn and under a deployment's.

:func:`hf_lsad.capture.collect.collect_prompt_features` runs the tokens every prompt opens with (the chat template's
opening and the system turn) once (:class:`hf_lsad.capture.recorder.PromptPrefix`) and each batch's rests against
them. The whole-prompt way is what it ran before: the same batches, each prompt encoded whole (left-padded) and read
by :func:`hf_lsad.capture.recorder.prompt_features`. Both read the default guard's reads on a seeded draw of the fit
prompts, with the same batch plan (16 prompts or 4,096 padded tokens); medians of interleaved repeats, and the
largest difference between the two ways' features.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import torch

from hf_lsad.capture.collect import (
    collect_prompt_features,
    encode_prompts,
    prompt_batches,
    prompt_token_ids,
    shared_prefix_length,
)
from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import prompt_features
from hf_lsad.data import GUARD_POOLS
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads.bundled import release_rows
from perf.harness import environment, interleaved_medians


@dataclass
class Settings:
    prompts: int = 200
    """Fit prompts drawn (seeded) from every bundled pool."""
    batch_size: int = 16
    """Prompts per forward pass, the most."""
    max_batch_tokens: int = 4096
    """Padded tokens per forward pass, the most (as teach batches)."""
    repeats: int = 3
    """Interleaved repeats of each way."""
    turns: str = "benchmarks/studies/system_turns.json"
    """The system turns; the second ``test`` turn (a bank's support bot) is the deployment's."""
    seed: int = 0
    """Seed of the draw."""


def run(settings: Settings) -> dict[str, Any]:
    model, tokenizer = load_model("default")
    reads = list(SafetyGuard.from_pretrained("default").reads)
    prompts = [p.text for pool in GUARD_POOLS for p in release_rows(pool, "fit")]
    prompts = random.Random(settings.seed).sample(prompts, settings.prompts)
    with open(settings.turns) as file:
        bank = json.load(file)["test"][1]
    results: dict[str, Any] = {}
    for name, system in (("default turn", None), ("a bank's support bot's turn", bank)):
        outputs: dict[str, dict] = {}
        plan = prompt_batches(
            tokenizer, prompts, settings.batch_size, settings.max_batch_tokens, chat_template=True, system=system
        )

        def shared_prefix(system: str | None = system, outputs: dict = outputs) -> None:
            outputs["shared prefix"] = collect_prompt_features(
                model,
                tokenizer,
                prompts,
                reads,
                batch_size=settings.batch_size,
                max_batch_tokens=settings.max_batch_tokens,
                system=system,
                progress=False,
            )[0]

        def whole(system: str | None = system, outputs: dict = outputs, plan: list = plan) -> None:
            out = {read: torch.empty(len(prompts), model.config.hidden_size) for read in reads}
            for batch in plan:
                inputs = encode_prompts(tokenizer, [prompts[i] for i in batch], system=system)
                features = prompt_features(model, reads, inputs["input_ids"], inputs["attention_mask"])
                for read, values in features.items():
                    out[read][torch.tensor(batch)] = values.float()
            outputs["whole prompts"] = out

        timed = interleaved_medians({"whole prompts": whole, "shared prefix": shared_prefix}, settings.repeats)
        token_ids = prompt_token_ids(tokenizer, prompts, system=system)
        shared = shared_prefix_length(token_ids)
        results[name] = {
            "shared_prefix_tokens": shared,
            "prompt_tokens": sum(len(ids) for ids in token_ids),
            "batches": len(plan),
            **timed,
            "speedup": timed["median_s"]["whole prompts"] / timed["median_s"]["shared prefix"],
            "max_abs_feature_difference": max(
                float((outputs["whole prompts"][r] - outputs["shared prefix"][r]).abs().max()) for r in reads
            ),
            "max_relative_feature_difference": max(
                float((outputs["whole prompts"][r] - outputs["shared prefix"][r]).abs().max())
                / float(outputs["whole prompts"][r].abs().max())
                for r in reads
            ),
        }
        print(name, {k: v for k, v in results[name].items() if k != "seconds"}, flush=True)
    return {"environment": environment(torch.device("cpu")), "reads": reads, "prompts": settings.prompts, **results}
