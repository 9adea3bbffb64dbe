"""What ``add_head``'s ``safe_weight`` does on real rows: a head for a category learnt from 100 examples against 100
of the user's own benign prompts that look like it, at several weights of those prompts, judged on validation rows.

The scenario is a deployment that adds a head for mild risky questions (do-not-answer: requests for medical or
legal advice, a named person's private details) and passes 100 of its own everyday questions (the ``questions``
pool: FreshQA and PersistBench, which ``add_head``'s bundled benign pools do not hold) as ``--safe``. By default
those carry a fifth of the benign weight, as one bundled pool does; ``safe_weight`` gives them more. Each guard is
the released one with the head added by ``add_head`` (every threshold set again on 1,000 validation chat rows, the
new head a third of the budget), screened on validation rows: the category's, the questions', chat and benign OOD.
Reported per weight: rows flagged by the guard and by the new head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, add_head, load_model
from hf_lsad.guard.heads.bundled import release_rows, sample_rows

from .terse_head import _rates
from .unseen import wilson_share

HEAD = "advice"
"""The new head's name."""


@dataclass
class Settings:
    model: str = "default"
    """The bundled SmolLM2-135M-Instruct."""
    guard: str = "default"
    """The released two-headed guard the head is added to."""
    category: str = "donotanswer"
    """The unsafe source whose fit rows are the category's examples."""
    safe_pool: str = "questions"
    """The benign pool whose fit rows are the user's own safe prompts (not one of ``add_head``'s bundled pools)."""
    examples: int = 100
    """Examples of the category and safe prompts drawn from the fit rows (seeded)."""
    weights: list[float | None] = field(default_factory=lambda: [None, 0.5, 0.8])
    """The ``safe_weight`` values compared (``None``: the default, a fifth)."""
    validation_rows: int = 400
    """Validation rows of benign OOD screened (seeded draw); the category, the safe pool and chat are screened
    whole."""
    cache_dir: str = "artifacts/safe-weight/bundled"
    """Where the bundled pools' activations are kept between the weights."""
    seed: int = 0
    """Seed of the draws."""


def run(settings: Settings) -> dict[str, Any]:
    category = [row for row in release_rows("toxic", "fit") if row.source == settings.category]
    unsafe = [row.text for row in sample_rows(category, settings.examples, settings.seed)]
    safe = [row.text for row in sample_rows(release_rows(settings.safe_pool, "fit"), settings.examples, settings.seed)]
    groups = {
        "category": [r.text for r in release_rows("toxic", "validation") if r.source == settings.category],
        "own safe pool": [r.text for r in release_rows(settings.safe_pool, "validation")],
        "chat": [r.text for r in release_rows("chat", "validation")],
        "benign_ood": [
            r.text
            for r in sample_rows(release_rows("benign_ood", "validation"), settings.validation_rows, settings.seed)
        ],
    }
    model, tokenizer = load_model(settings.model)
    results: dict[str, Any] = {"examples": {"unsafe": len(unsafe), "safe": len(safe)}, "guards": {}, "budgets": {}}
    print("the released guard", flush=True)
    released = SafetyGuard.from_pretrained(settings.guard)
    results["guards"]["released"] = _rates(GuardedModelForCausalLM(model, released, tokenizer=tokenizer), groups)
    for weight in settings.weights:
        name = f"safe_weight={weight}"
        guard = SafetyGuard.from_pretrained(settings.guard)
        budget = add_head(
            model,
            tokenizer,
            guard,
            HEAD,
            unsafe,
            safe,
            safe_weight=weight,
            cache_dir=settings.cache_dir,
            seed=settings.seed,
        )
        results["budgets"][name] = budget.thresholds
        print(name, budget.thresholds, flush=True)
        rows = _rates(GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), groups)
        for group in rows.values():
            group["by the new head"] = sum(n for who, n in group["decided_by"].items() if HEAD in who.split("+"))
        results["guards"][name] = rows
    results["shares"] = {
        name: {group: wilson_share(v["flagged"], v["rows"]) for group, v in rows.items()}
        for name, rows in results["guards"].items()
    }
    return results
