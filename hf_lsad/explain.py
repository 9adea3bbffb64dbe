"""Explaining a score: which SAE features make a row far from its cluster.

FreqMask-KM scores an SAE code ``z`` by the distance of its masked difference to the
assigned centroid, ``d = m_c * (z - mu_c)``. The score splits into one term per masked
feature ``i``, and the terms sum to the score exactly:

- ``l1``: ``contribution_i = |d_i|`` (score ``sum_i |d_i|``);
- ``l2``: ``contribution_i = d_i^2 / score`` (score ``sqrt(sum_i d_i^2)``);
- ``mahalanobis``: ``contribution_i = d_i (P_c d)_i / score`` with ``P_c`` the cluster's
  precision (score ``sqrt(d^T P_c d)``); a term can be negative when correlated
  features offset each other, and the largest terms are listed.

Each :class:`FeatureContribution` also gives the feature's activation ``z_i`` and the
cluster's typical value ``mu_c,i`` (the centroid: the mean code of the safe rows in
that cluster), so ``activation - typical`` is the deviation the score counts.

:func:`explain_command` is the body of ``hf-lsad explain``: it also lists, for each
feature, the prompts of an activation store that activate it most, so a person can
name the feature.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .detectors import Detector
    from .guard import SafetyGuard
    from .sae import SparseAutoencoder


class FeatureContribution(NamedTuple):
    """One SAE feature's part in a score."""

    feature: int
    """Index of the SAE feature (column of the SAE's encoder)."""
    activation: float
    """The row's activation of the feature (its SAE code)."""
    contribution: float
    """The feature's term of the score (module docstring); the terms over all masked features sum to the score."""
    typical: float
    """The assigned cluster's typical activation of the feature (centroid value)."""


@torch.no_grad()
def explain_scores(
    detector: Detector, sae: SparseAutoencoder | None, activations: Tensor, *, top_k: int | None = 10
) -> list[tuple[FeatureContribution, ...]]:
    """Per row of ``activations`` (float32 ``[batch, hidden]``), the ``top_k`` largest terms of its score."""
    explain = getattr(detector, "score_terms", None)
    if explain is None:
        raise NotImplementedError(
            f"{detector.method} does not score SAE features; explanations need a FreqMask-KM guard"
        )
    terms = explain(activations, sae)
    k = terms.contributions.shape[1] if top_k is None else min(top_k, terms.contributions.shape[1])
    order = terms.contributions.topk(k, dim=1).indices
    rows = []
    for r in range(len(order)):
        picked = order[r].tolist()
        rows.append(
            tuple(
                FeatureContribution(
                    feature=int(terms.features[r, j]),
                    activation=float(terms.activations[r, j]),
                    contribution=float(terms.contributions[r, j]),
                    typical=float(terms.typical[r, j]),
                )
                for j in picked
            )
        )
    return rows


class ScoreTerms(NamedTuple):
    """All terms of a batch's scores, ``[batch, width]`` each (width: masked features)."""

    features: Tensor
    activations: Tensor
    contributions: Tensor
    typical: Tensor
    scores: Tensor
    """``[batch]``, the scores the terms sum to (as ``forward`` computes them)."""
    clusters: Tensor


def _store_texts(records: list[dict[str, Any]]) -> list[str]:
    """Prompt text of each store record: from the record, else looked up by id in the bundled pools."""
    from .data import POOLS, load_pool

    texts: dict[str, str] = {}
    wanted = {r.get("id") for r in records if "text" not in r and "prompt" not in r}
    if wanted:
        for pool in POOLS:
            try:
                prompts = load_pool(pool)
            except Exception:  # noqa: BLE001 - a pool that cannot be read just names no prompt
                continue
            texts.update((p.id, p.text) for p in prompts if p.id in wanted)
    return [r.get("text") or r.get("prompt") or texts.get(r.get("id"), f"<{r.get('id')}>") for r in records]


@torch.no_grad()
def top_activating(
    guard: SafetyGuard, store: Any, features: list[int], *, n: int = 3, batch_size: int = 1024
) -> dict[int, list[tuple[float, int]]]:
    """For each feature, the ``n`` rows of ``store`` (an :class:`~hf_lsad.store.ActivationStore`) activating it most."""
    if guard.sae is None:
        raise ValueError("the guard has no SAE")
    index = torch.tensor(features, dtype=torch.long)
    best_values = torch.full((len(features), 0), float("-inf"))
    best_rows = torch.zeros((len(features), 0), dtype=torch.long)
    device = next(guard.sae.parameters()).device
    for start in range(0, len(store), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(store)))
        codes = guard.sae.encode(store.take(rows).float().to(device))[:, index.to(device)].T.cpu()  # [features, rows]
        values = torch.cat([best_values, codes], dim=1)
        ids = torch.cat([best_rows, rows.expand(len(features), -1)], dim=1)
        top = values.topk(min(n, values.shape[1]), dim=1)
        best_values, best_rows = top.values, ids.gather(1, top.indices)
    return {
        f: [(float(v), int(r)) for v, r in zip(best_values[i].tolist(), best_rows[i].tolist())]
        for i, f in enumerate(features)
    }


def explain_command(args: argparse.Namespace, out: TextIO | None = None) -> None:
    """``hf-lsad explain --guard G --activations STORE [--model M] [--top-k K] [--examples N] PROMPT...``.

    Runs the guard on each prompt (a forward pass cut at the hooked block for a
    ``prompt_last`` guard, greedy generation otherwise) and prints its report with the
    top features, each followed by the store's prompts that activate it most.
    ``args``: ``guard``, ``activations``, ``model`` (default ``default``), ``top_k``
    (default 10), ``examples`` (default 3), ``prompts``, ``max_new_tokens`` (default 64).
    """
    import sys

    from .guard import SafetyGuard
    from .modeling import GuardedModelForCausalLM
    from .models import load_model
    from .pretrained import resolve_guard
    from .store import ActivationStore

    out = out or sys.stdout
    guard = SafetyGuard.from_pretrained(resolve_guard(args.guard))
    model, tokenizer = load_model(getattr(args, "model", None) or "default")
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    top_k = getattr(args, "top_k", None) or 10
    if guard.config.hook.position == "prompt_last":
        reports = guarded.screen(list(args.prompts), explain=True, top_k=top_k)
    else:
        from .capture import encode_prompts

        inputs = encode_prompts(tokenizer, list(args.prompts))
        reports = guarded.generate(
            **inputs,
            max_new_tokens=getattr(args, "max_new_tokens", None) or 64,
            do_sample=False,
            return_dict_in_generate=True,
            explain=True,
            explain_top_k=top_k,
        ).safety
    store = ActivationStore(args.activations)
    features = sorted({f.feature for report in reports for f in report.features})
    examples = top_activating(guard, store, features, n=getattr(args, "examples", None) or 3)
    texts = _store_texts([store.records[r] for values in examples.values() for _, r in values])
    text_of: dict[int, str] = {}
    i = 0
    for values in examples.values():
        for _, r in values:
            text_of[r] = texts[i]
            i += 1
    for prompt, report in zip(args.prompts, reports):
        verdict = "FLAGGED" if report.flagged else "ok"
        print(f"prompt: {prompt!r}", file=out)
        print(
            f"  {verdict}: score {report.score:.3f} (threshold {guard.threshold:.3f}), cluster {report.cluster}",
            file=out,
        )
        print(f"  {'feature':>8} {'activation':>10} {'typical':>8} {'contribution':>12}  top prompts in the store", file=out)
        for f in report.features:
            print(f"  {f.feature:>8} {f.activation:>10.3f} {f.typical:>8.3f} {f.contribution:>12.3f}", file=out)
            for value, r in examples[f.feature]:
                text = " ".join(text_of[r].split())
                print(f"  {'':>8} {value:>10.3f}  {text[:100]!r}", file=out)
        total = sum(f.contribution for f in report.features)
        print(f"  (the {len(report.features)} features listed make {total:.3f} of the score {report.score:.3f})", file=out)
