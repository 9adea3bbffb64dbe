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

:func:`hf_lsad.cli.explain.explain_command` is the body of ``hf-lsad explain``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .types import FeatureContribution

if TYPE_CHECKING:
    from ..detectors.base import Detector
    from ..sae.model import SparseAutoencoder


@torch.no_grad()
def explain_scores(
    detector: Detector, sae: SparseAutoencoder | None, activations: Tensor, *, top_k: int | None = 10
) -> list[tuple[FeatureContribution, ...]]:
    """Per row of ``activations`` (float32 ``[batch, hidden]``), the ``top_k`` largest terms of its score."""
    terms = detector.score_terms(activations, sae)
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


def store_texts(records: list[dict[str, Any]]) -> list[str]:
    """Prompt text of each store record: from the record, else looked up by id in the bundled pools."""
    from ..data import POOLS, load_pool

    texts: dict[str, str] = {}
    wanted = {r.get("id") for r in records if "text" not in r and "prompt" not in r}
    if wanted:
        for pool in POOLS:
            texts.update((p.id, p.text) for p in load_pool(pool) if p.id in wanted)
    return [r.get("text") or r.get("prompt") or texts.get(r.get("id") or "", f"<{r.get('id')}>") for r in records]


@torch.no_grad()
def top_activating(
    sae: SparseAutoencoder | None, store: Any, features: list[int], *, n: int = 3, batch_size: int = 1024
) -> dict[int, list[tuple[float, int]]]:
    """For each SAE feature, the ``n`` rows of ``store`` (an :class:`~hf_lsad.data.store.ActivationStore`) activating
    it most."""
    if sae is None:
        raise ValueError("the guard has no SAE")
    index = torch.tensor(features, dtype=torch.long)
    best_values = torch.full((len(features), 0), float("-inf"))
    best_rows = torch.zeros((len(features), 0), dtype=torch.long)
    device = next(sae.parameters()).device
    for start in range(0, len(store), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(store)))
        codes = sae.encode(store.take(rows).float().to(device))[:, index.to(device)].T.cpu()  # [features, rows]
        values = torch.cat([best_values, codes], dim=1)
        ids = torch.cat([best_rows, rows.expand(len(features), -1)], dim=1)
        top = values.topk(min(n, values.shape[1]), dim=1)
        best_values, best_rows = top.values, ids.gather(1, top.indices)
    return {
        f: [(float(v), int(r)) for v, r in zip(best_values[i].tolist(), best_rows[i].tolist())]
        for i, f in enumerate(features)
    }
