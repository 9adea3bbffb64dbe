"""The measures behind the FreqMask-KM diagnostics (paper, section 5.4 and appendices), each a
function of SAE codes, cluster labels or scores that returns JSON-ready dicts of plain Python numbers.

- :func:`effective_dimension`: ``d90``, the smallest number of principal
  components explaining at least 90% of the variance (appendix "Effective
  dimension"), and :func:`effective_dimensions` for the paper's three settings:
  raw SAE codes, the global-mask subspace, and each cluster's own top-k
  subspace ``M_c`` (clusters with ``n_c >= max(20, 2k)`` only).
- :func:`cluster_occupancy`: the fraction of each data set assigned to each
  cluster, and its total-variation distance to the training occupancy
  (figure "cluster occupancy"), with the number of clusters holding half of
  each set.
- :func:`active_support_overlap`: within-cluster safe/unsafe active supports
  (features firing on > 50% of a population in the cluster) restricted to the
  cluster's mask, their counts and per-cluster Jaccard (appendix
  "Within-cluster active-support overlap").
- :func:`cluster_score_summary`: per-cluster score distributions (summary
  statistics) of each data set, and how one global threshold sits in them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..detectors.masks import top_k_mask

VARIANCE_THRESHOLD = 0.9
"""``d90``: the share of variance the leading principal components must reach."""


def effective_dimension(x: Tensor, threshold: float = VARIANCE_THRESHOLD) -> int:
    """``d90`` of the rows of ``x`` (``[n, d]``): min ``k`` with ``rho(k) >= threshold``.

    ``Sigma = X^T X / n - mean mean^T`` (float64), eigenvalues clamped at zero,
    ``rho(k)`` the cumulative explained-variance ratio. Returns 0 when the rows
    have no variance at all (every eigenvalue is zero).
    """
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"need a non-empty [n, d] matrix, got shape {tuple(x.shape)}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    data = x.detach().to(torch.float64)
    mean = data.mean(0)
    covariance = data.T @ data / len(data) - torch.outer(mean, mean)
    eigenvalues = torch.linalg.eigvalsh(covariance).clamp_min(0).flip(0)  # decreasing
    total = eigenvalues.sum()
    if total <= 0:
        return 0
    ratio = eigenvalues.cumsum(0) / total
    # rho(d) is 1 up to rounding, so some index always qualifies.
    reached = (ratio >= threshold - 1e-9).nonzero()  # a ratio equal to the threshold up to rounding counts
    return int(reached[0].item()) + 1


def _distribution(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "min": None, "median": None, "mean": None, "max": None}
    tensor = torch.tensor(values, dtype=torch.float64)
    return {
        "n": len(values),
        "min": float(tensor.min()),
        "median": float(tensor.quantile(0.5)),
        "mean": float(tensor.mean()),
        "max": float(tensor.max()),
    }


def effective_dimensions(
    codes: Tensor,
    clusters: Tensor,
    global_mask: Tensor,
    *,
    mask_size: int | None = None,
    min_cluster_size: int | None = None,
    threshold: float = VARIANCE_THRESHOLD,
) -> dict[str, Any]:
    """``d90`` in the raw SAE space, the global-mask subspace and per cluster (paper, appendix "Effective dimension").

    Args:
        codes: SAE codes ``[n, d_sae]`` of the safe rows (the detector's fit rows).
        clusters: their cluster ``[n]`` (long).
        global_mask: feature indices ``M`` of the global mask (``[k]``).
        mask_size: ``k`` of the per-cluster masks ``M_c = top_k(sum_i 1[z_i > 0])``;
            default ``len(global_mask)`` ("with k as for the global mask").
        min_cluster_size: clusters with fewer members are left out of the
            per-cluster distribution; default ``max(20, 2k)`` (the paper's rule
            against rank-limited estimates).
    """
    if len(codes) != len(clusters):
        raise ValueError(f"{len(codes)} code rows but {len(clusters)} cluster labels")
    k = int(mask_size if mask_size is not None else len(global_mask))
    minimum = int(min_cluster_size if min_cluster_size is not None else max(20, 2 * k))
    per_cluster: dict[str, int] = {}
    sizes = torch.bincount(clusters, minlength=int(clusters.max()) + 1 if len(clusters) else 0)
    for c in range(len(sizes)):
        if sizes[c] < minimum:
            continue
        members = codes[clusters == c]
        local_mask = top_k_mask((members > 0).float().sum(0), k)
        per_cluster[str(c)] = effective_dimension(members[:, local_mask], threshold)
    return {
        "threshold": threshold,
        "raw_sae": effective_dimension(codes, threshold),
        "raw_sae_dim": int(codes.shape[1]),
        "global_mask": effective_dimension(codes[:, global_mask], threshold),
        "mask_size": k,
        "per_cluster": per_cluster,
        "per_cluster_min_size": minimum,
        "per_cluster_eligible": len(per_cluster),
        "per_cluster_total": int((sizes > 0).sum()),
        "per_cluster_summary": _distribution([float(v) for v in per_cluster.values()]),
    }


def total_variation(p: Tensor, q: Tensor) -> float:
    """``0.5 * sum |p - q|`` between two distributions over the same clusters."""
    if p.shape != q.shape:
        raise ValueError(f"distributions of different shapes {tuple(p.shape)} and {tuple(q.shape)}")
    return float(0.5 * (p.double() - q.double()).abs().sum())


def _occupancy(clusters: Tensor, n_clusters: int) -> Tensor:
    return torch.bincount(clusters, minlength=n_clusters).double() / max(len(clusters), 1)


def clusters_holding(occupancy: Tensor, share: float = 0.5) -> int:
    """How many clusters, taken in decreasing order of occupancy, hold at least ``share`` of the rows."""
    if occupancy.sum() <= 0:
        return 0
    cumulative = occupancy.sort(descending=True).values.cumsum(0)
    return int((cumulative < share - 1e-12).sum()) + 1


def cluster_occupancy(
    assignments: Mapping[str, Tensor], n_clusters: int, *, reference: str = "train"
) -> dict[str, Any]:
    """Per-cluster occupancy of each set and its total-variation distance to ``reference``.

    ``assignments`` maps a set name (``train``, ``safe_test``, ``harmful``,
    ``benign_ood``, ...) to its cluster labels. For each set: row count, the
    occupancy histogram (fraction per cluster), TV distance to the reference
    set's histogram, and the number of clusters that together hold half of the set.
    """
    if reference not in assignments:
        raise ValueError(f"reference set {reference!r} is not among {sorted(assignments)}")
    base = _occupancy(assignments[reference], n_clusters)
    out: dict[str, Any] = {"reference": reference, "n_clusters": n_clusters, "sets": {}}
    for name, clusters in assignments.items():
        occupancy = _occupancy(clusters, n_clusters)
        out["sets"][name] = {
            "n": len(clusters),
            "occupancy": [float(v) for v in occupancy],
            "tv_to_reference": total_variation(occupancy, base),
            "clusters_holding_half": clusters_holding(occupancy),
            "empty_clusters": int((occupancy == 0).sum()),
        }
    return out


def active_support_overlap(
    safe_codes: Tensor,
    safe_clusters: Tensor,
    unsafe_codes: Tensor,
    unsafe_clusters: Tensor,
    mask_indices: Tensor,
    *,
    majority: float = 0.5,
) -> dict[str, Any]:
    """Within-cluster safe/unsafe active supports on each cluster's mask (paper, appendix "active-support overlap").

    For cluster ``c`` with safe rows ``C_c^safe`` and unsafe rows ``C_c^unsafe``
    assigned to it, ``S_c^safe`` is the set of masked features ``j in M_c``
    (``mask_indices[c]``) with firing frequency ``mean 1[z_j > 0] > majority``
    over ``C_c^safe``; ``S_c^unsafe`` likewise. Only clusters with at least one
    safe and one unsafe row count. Counts ``both``, ``safe_only``,
    ``unsafe_only`` and ``neither`` are summed over those clusters; the
    per-cluster restricted Jaccard is ``|S^safe & S^unsafe| / |S^safe | S^unsafe|``,
    undefined (left out, counted in ``clusters_empty_union``) when both sets are empty.
    """
    n_clusters = len(mask_indices)
    counts = {"both": 0, "safe_only": 0, "unsafe_only": 0, "neither": 0}
    jaccard: dict[str, float] = {}
    compared, empty_union = 0, 0
    for c in range(n_clusters):
        safe, unsafe = safe_codes[safe_clusters == c], unsafe_codes[unsafe_clusters == c]
        if len(safe) == 0 or len(unsafe) == 0:
            continue
        compared += 1
        mask = mask_indices[c]
        s_safe = (safe[:, mask] > 0).float().mean(0) > majority
        s_unsafe = (unsafe[:, mask] > 0).float().mean(0) > majority
        both, union = int((s_safe & s_unsafe).sum()), int((s_safe | s_unsafe).sum())
        counts["both"] += both
        counts["safe_only"] += int((s_safe & ~s_unsafe).sum())
        counts["unsafe_only"] += int((~s_safe & s_unsafe).sum())
        counts["neither"] += int((~s_safe & ~s_unsafe).sum())
        if union == 0:
            empty_union += 1
        else:
            jaccard[str(c)] = both / union
    return {
        "majority": majority,
        "mask_size": int(mask_indices.shape[1]),
        "clusters_compared": compared,
        "clusters_empty_union": empty_union,
        "counts": counts,
        "jaccard": jaccard,
        "jaccard_summary": _distribution(list(jaccard.values())),
    }


def _summary(scores: Tensor) -> dict[str, float | int]:
    values = scores.double()
    quantiles = values.quantile(torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64))
    return {
        "n": len(values),
        "mean": float(values.mean()),
        "std": float(values.std(unbiased=False)),
        "min": float(values.min()),
        "q05": float(quantiles[0]),
        "q25": float(quantiles[1]),
        "median": float(quantiles[2]),
        "q75": float(quantiles[3]),
        "q95": float(quantiles[4]),
        "max": float(values.max()),
    }


def cluster_score_summary(
    scores: Mapping[str, Tensor],
    clusters: Mapping[str, Tensor],
    n_clusters: int,
    *,
    threshold: float | None = None,
    safe_set: str = "safe_test",
    min_safe: int = 10,
) -> dict[str, Any]:
    """Summary statistics of each set's scores within each cluster.

    ``per_cluster[c][set]`` holds n, mean, std, min, quartiles, 5/95th
    percentiles and max (clusters with no row of a set omit it). With a
    global ``threshold``, also counts, over clusters with at least ``min_safe``
    rows of ``safe_set``, those where it lies above every safe score and
    those where it lies below the median safe score (paper, appendix
    "Per-cluster calibration": one threshold flags nothing in the first group
    and more than half of the safe rows in the second).
    """
    if set(scores) != set(clusters):
        raise ValueError(f"scores and clusters name different sets: {sorted(scores)} vs {sorted(clusters)}")
    per_cluster: dict[str, dict[str, Any]] = {}
    for c in range(n_clusters):
        row = {name: _summary(s[clusters[name] == c]) for name, s in scores.items() if (clusters[name] == c).any()}
        if row:
            per_cluster[str(c)] = row
    out: dict[str, Any] = {"per_cluster": per_cluster}
    if threshold is not None and safe_set in scores:
        eligible = [row[safe_set] for row in per_cluster.values() if row.get(safe_set, {}).get("n", 0) >= min_safe]
        out["threshold"] = {
            "value": float(threshold),
            "safe_set": safe_set,
            "min_safe": min_safe,
            "clusters_eligible": len(eligible),
            "above_every_safe_score": sum(row["max"] < threshold for row in eligible),
            "below_median_safe_score": sum(row["median"] > threshold for row in eligible),
        }
    return out
