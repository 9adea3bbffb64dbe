"""A probe that reads the model after it is asked whether the request is harmful: does it carry over to unseen benign
domains better than a probe on the request alone?

Every head tried against the held-out benign domain target reads the prompt as the user wrote it, and flags an unseen
benign domain for how much its style resembles harm's (``heads/domain_curve``). Here each prompt is followed, inside
the user turn, by a fixed question (``question``), and the heads read the model where it would answer: its last
prompt token, and the mean over the prompt. The question points every prompt's last token at one judgement, whatever
the prompt's style; the model itself (SmolLM2-135M) refuses almost nothing, so what is asked is whether a probe on that
token is less bound to style, not whether the model answers well.

For time, each pool is a seeded sample of at most ``rows_per_pool`` rows (the same rows for both reads): the stores of
``folder`` are cut to those rows (the baseline, read without the question) and the prompts with the question are
collected into ``asked_folder``. Both go through :func:`studies.heads.run`'s leave-one-source-out and
leave-one-benign-domain-out protocol with the same MLP head, so the comparison is paired; the figures of the full
pools (``heads/two_heads_deep_reads4``) are not comparable to these row for row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_lsad.capture.collect import collect_prompt_features
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import GUARD_POOLS, load_pool
from hf_lsad.data.store import load_activations, save_activations

from . import heads


@dataclass
class Settings:
    question: str = "\n\nIs the request above harmful? Answer yes or no."
    """Appended to every prompt inside its user turn."""
    rows_per_pool: int = 1500
    """A seeded sample of at most this many rows of each pool (``load_pool(limit=..., seed=0)``), for both reads."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """The pools whose rows take part."""
    folder: str = "artifacts/smollm2"
    """The collected stores of the prompts as written (``hf-lsad collect``), cut to the sample for the baseline."""
    baseline_folder: str = "artifacts/smollm2-sample"
    """Where the baseline's cut stores are written (once)."""
    asked_folder: str = "artifacts/smollm2-asked"
    """Where the stores of the prompts with the question are written (once)."""
    baseline_candidates: list[list[list[Any]]] = field(
        default_factory=lambda: [
            [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]],
            [[16, "prompt_last"], [20, "prompt_last"], [24, "prompt_last"], [28, "prompt_last"]],
        ]
    )
    """Reads of the heads on the prompts as written (the shipped reads first)."""
    asked_candidates: list[list[list[Any]]] = field(
        default_factory=lambda: [
            [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]],
            [[16, "prompt_last"], [20, "prompt_last"], [24, "prompt_last"], [28, "prompt_last"]],
            [[28, "prompt_last"]],
        ]
    )
    """Reads of the heads on the prompts with the question."""
    mlp_width: int = 256
    """The head: one ReLU layer of this many units (the shipped head's width, one fit)."""
    mlp_alpha: float = 0.1
    """Its L2 penalty (the shipped head's)."""
    max_batch_tokens: int = 4096
    """Padded tokens a collection pass holds at most."""


def _reads(candidates: list[list[list[Any]]]) -> list[tuple[int, str]]:
    return sorted({(int(layer), str(position)) for candidate in candidates for layer, position in candidate})


def cut_baseline(settings: Settings) -> None:
    """The stores of ``folder`` cut to each pool's sample, under ``baseline_folder``."""
    for pool in settings.pools:
        keep = {prompt.id for prompt in load_pool(pool, limit=settings.rows_per_pool, seed=0)}
        for layer, position in _reads(settings.baseline_candidates):
            target = Path(settings.baseline_folder) / pool / f"layer{layer}-{position}"
            if (target / "index.json").is_file():
                continue
            store = load_activations(Path(settings.folder) / pool / f"layer{layer}-{position}")
            rows = [i for i, record in enumerate(store.records) if record["id"] in keep]
            save_activations(
                target, store.activations[rows], [store.records[i] for i in rows], store.hook, inputs=store.inputs
            )


def collect_asked(settings: Settings) -> None:
    """The sample's prompts with the question, collected at the asked reads under ``asked_folder``."""
    reads = _reads(settings.asked_candidates)
    model, tokenizer = load_model("default")
    for pool in settings.pools:
        targets = {read: Path(settings.asked_folder) / pool / f"layer{read[0]}-{read[1]}" for read in reads}
        if all((target / "index.json").is_file() for target in targets.values()):
            continue
        prompts = load_pool(pool, limit=settings.rows_per_pool, seed=0)
        # the stores of the prompts as written give each read's hook and each row's record (id, source, domain)
        written = {read: load_activations(Path(settings.folder) / pool / f"layer{read[0]}-{read[1]}") for read in reads}
        print(f"{pool}: {len(prompts)} prompts", flush=True)
        features, inputs = collect_prompt_features(
            model,
            tokenizer,
            [prompt.text + settings.question for prompt in prompts],
            reads,
            max_batch_tokens=settings.max_batch_tokens,
        )
        for read, target in targets.items():
            record_of = {record["id"]: record for record in written[read].records}
            records = [record_of[prompt.id] for prompt in prompts]
            save_activations(target, features[read], records, written[read].hook, inputs=inputs)


def run(settings: Settings) -> dict[str, Any]:
    cut_baseline(settings)
    collect_asked(settings)
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    for name, folder, candidates in (
        ("as written", settings.baseline_folder, settings.baseline_candidates),
        ("asked", settings.asked_folder, settings.asked_candidates),
    ):
        print(f"== {name}", flush=True)
        results[name] = heads.run(
            heads.Settings(
                folder=folder,
                pools=settings.pools,
                candidates=candidates,
                inverse_regularisation=[],
                mlp_widths=[settings.mlp_width],
                mlp_alphas=[settings.mlp_alpha],
                text_baseline=False,
                evaluate_on="validation",
            )
        )
    return results
