"""Is the unseen benign domain a matter of model size? The shipped supervised head on several models' residual streams.

Held out of the fit, a benign domain is flagged far above the budget by the supervised head on SmolLM2-135M
(``heads/report``: 33% in the median against the target of 8%), and fitting on more benign domains barely lowers it
(``heads/domain_curve``). This study asks whether a larger model's residual stream separates harm from an unseen
benign domain better: the same head (kind, width, penalty, fits) is put through the same protocol
(:func:`hf_lsad.evaluation.sources.leave_one_source_out`: each unsafe source and each benign domain held out of the
fit, thresholds on validation chat) on each model's activations of **the same rows**, the rows collected for every
model in ``folders`` (a seeded subset of the large pools for the larger models, whose forward passes cost about three
and nine times SmolLM2's here). Each model is read at the same relative depths (``reads``). The study chooses nothing.
``heads/model_size`` compares SmolLM2-135M with Qwen2.5-Coder-0.5B; ``heads/model_size_1_5b`` adds Qwen2.5-Coder-1.5B.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import EVAL_DOMAINS, EVAL_SOURCES, leave_one_source_out, load_source_rows
from hf_lsad.guard.heads import ProbeConfig

from .two_heads import fit_supervised

SMOLLM2 = "SmolLM2-135M-Instruct"
QWEN05 = "Qwen2.5-Coder-0.5B-Instruct"


@dataclass
class Settings:
    folders: dict[str, str] = field(
        default_factory=lambda: {SMOLLM2: "artifacts/smollm2", QWEN05: "artifacts/qwen05/stores"}
    )
    """Per model, where its collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    reads: dict[str, list[list[Any]]] = field(
        default_factory=lambda: {
            SMOLLM2: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"], [28, "prompt_mean"]],
            QWEN05: [[13, "prompt_mean"], [16, "prompt_mean"], [19, "prompt_mean"], [22, "prompt_mean"]],
        }
    )
    """Per model, the head's reads: the shipped guard's on SmolLM2 (blocks 16, 20, 24, 28 of 30), and the same
    fractions of the depth on a model of another depth (13, 16, 19, 22 of Qwen's 24)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    kind: str = "mlp"
    """The head's kind (:class:`hf_lsad.guard.heads.ProbeConfig`); the shipped one by default."""
    mlp_units: int = 256
    """An ``mlp`` head's hidden ReLU units."""
    mlp_alpha: float = 0.1
    """An ``mlp`` head's L2 penalty."""
    mlp_members: int = 3
    """An ``mlp`` head's fits whose logits are averaged."""
    evaluate_on: str = "validation"
    """The rows the rates are measured on: ``validation`` (the study chooses nothing, so no test rows are needed)."""
    held_out_sources: list[str] = field(default_factory=lambda: list(EVAL_SOURCES))
    """The unsafe sources held out one at a time."""
    held_out_domains: list[str] = field(default_factory=lambda: list(EVAL_DOMAINS))
    """The benign domains held out one at a time."""
    seed: int = 0
    """Seed of the row splits and of the fits."""


def run(settings: Settings) -> dict[str, Any]:
    if set(settings.folders) != set(settings.reads):
        raise ValueError(f"folders name {sorted(settings.folders)}, reads name {sorted(settings.reads)}")
    rows = {
        model: load_source_rows(folder, settings.pools, [tuple(r) for r in settings.reads[model]], seed=settings.seed)
        for model, folder in settings.folders.items()
    }
    common = set.intersection(*(set(r.ids) for r in rows.values()))
    results: dict[str, Any] = {"rows": len(common), "models": {}}
    for model, model_rows in rows.items():
        chosen = model_rows.select([row_id in common for row_id in model_rows.ids])
        config = ProbeConfig(
            reads=[tuple(r) for r in settings.reads[model]],
            kind=settings.kind,
            mlp_units=settings.mlp_units,
            mlp_alpha=settings.mlp_alpha,
            mlp_members=settings.mlp_members,
            seed=settings.seed,
        )
        print(f"{model}: {len(chosen)} rows, hidden size {next(iter(chosen.features.values())).shape[1]}", flush=True)

        def method(train, config=config):
            head = fit_supervised(train, config)
            return lambda scored: head(scored.features)

        table = leave_one_source_out(
            chosen,
            method,
            evaluate_on=settings.evaluate_on,
            sources=settings.held_out_sources,
            domains=settings.held_out_domains,
            progress=lambda message: print(f"  {message}", flush=True),
        )
        counts = {
            split: {
                "unsafe": sum(1 for s, label in zip(chosen.splits, chosen.labels.tolist()) if s == split and label),
                "benign": sum(1 for s, label in zip(chosen.splits, chosen.labels.tolist()) if s == split and not label),
            }
            for split in ("fit", "validation", "test")
        }
        results["models"][model] = {"rows_by_split": counts, **table}
        print(f"  {table['summary@0.05']}", flush=True)
    return results
