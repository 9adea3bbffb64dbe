"""The terse head of ``heads/terse_head`` on test rows: the hand-written triples of ``heads/terse_requests`` and the
bundled pools' test rows, read once, after the choice made on validation rows.

The guard is built as ``heads/terse_head`` builds it (:func:`studies.terse_head.with_terse_head`: the released guard,
the terse head added with ``add_head``, every threshold set again on validation chat) and screened beside the
released guard on the hand-written requests (terse, full, twin), on the test rows of every benign pool (chat and the
look-alikes all of them, the others a seeded draw) and on the test rows of each unsafe source. Nothing is fitted or
chosen on these rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_lsad import GuardedModelForCausalLM, SafetyGuard, load_model
from hf_lsad.guard.heads.bundled import release_rows, sample_rows

from .terse_head import Settings as HeadSettings, _rates, _rows_of, with_terse_head
from .terse_requests import load_triples


@dataclass
class Settings:
    head: HeadSettings = field(default_factory=HeadSettings)
    """How the terse head is built (``heads/terse_head``'s settings)."""
    triples: str = "benchmarks/studies/terse_requests.jsonl"
    """The hand-written triples of ``heads/terse_requests``."""
    test_rows: int = 400
    """Test rows per benign pool screened besides chat and the look-alikes, which are screened whole (seeded draw)."""


def run(settings: Settings) -> dict[str, Any]:
    triples = load_triples(settings.triples)
    groups: dict[str, list[str]] = {f"hand-written {kind}": [t[kind] for t in triples] for kind in ("terse", "full")}
    groups["hand-written twin"] = [t["twin"] for t in triples]
    for source in settings.head.unsafe_sources:
        groups[f"unsafe test: {source}"] = [row.text for row in _rows_of([source], "test")]
    for pool in ("chat", "lookalike", "safe", "benign_ood", "questions", "statements"):
        rows = release_rows(pool, "test")
        rows = rows if pool in ("chat", "lookalike") else sample_rows(rows, settings.test_rows, settings.head.seed)
        groups[f"benign test: {pool}"] = [row.text for row in rows]
    groups = {name: texts for name, texts in groups.items() if texts}

    model, tokenizer = load_model(settings.head.model)
    results: dict[str, Any] = {"guards": {}}
    print("the released guard", flush=True)
    released = SafetyGuard.from_pretrained(settings.head.guard)
    results["guards"]["released"] = _rates(GuardedModelForCausalLM(model, released, tokenizer=tokenizer), groups)
    guard = with_terse_head(model, tokenizer, settings.head)
    assert guard.budget is not None  # add_head sets it
    results["budget"] = {"heads": guard.budget.heads, "thresholds": guard.budget.thresholds}
    print("with the terse head", guard.budget.thresholds, flush=True)
    results["guards"]["with a terse head"] = _rates(GuardedModelForCausalLM(model, guard, tokenizer=tokenizer), groups)
    return results
