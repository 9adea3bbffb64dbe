"""Per-cluster affine calibration from a small labelled budget (paper, appendix "Per-Cluster Calibration").

A fitted detector gives each input a score ``s`` and a cluster ``c``. The
calibration replaces the score by ``g = a_c s + b_c`` and reports
``P(unsafe | x) = sigmoid(g)``:

- **Importance weights** (:func:`importance_weights`): the labelled sample holds
  a fraction ``p`` of the unsafe and of the benign out-of-distribution inputs
  (the coupled budget) and half of the in-distribution safe inputs, so each
  point is weighted by the reciprocal of its group's sampling fraction:
  ``1/p`` (unsafe, benign-OOD), ``2`` (safe). Benign-OOD points are labelled safe.
- **Global anchor** ``(a0, b0)``: weighted logistic regression over all labelled
  points with ridge ``epsilon (a^2 + b^2)``, ``epsilon = 1e-3``.
- **Per cluster** ``(a_c, b_c)``: the same weighted loss on the cluster's points
  plus ``lambda ||(a, b) - (a0, b0)||^2``, started at the anchor. A cluster with
  no labelled point keeps the anchor exactly; negative slopes are allowed (they
  repair clusters where unsafe inputs sit *closer* to the centroid).
- ``lambda`` is chosen from ``{1, 10, 100}`` by stratified k-fold cross-validation
  inside the labelled sample: mean importance-weighted AUROC of the out-of-fold
  ``g`` (anchor and per-cluster maps refitted on each training fold); ties go to
  the larger ``lambda``. With fewer than two labelled points of a class no fold
  can be scored and the largest ``lambda`` is used.

By default (``standardize=True``) the maps are fitted on the standardised score
``(s - mean) / std`` of the labelled sample and converted back to raw-score units
(``a = a' / std``, ``b = b' - a' mean / std``). This departs from the paper's raw-score
parametrisation on purpose: with raw scores the ridge and the pull price a change of
slope in score units, so on a detector whose scores are in the hundreds moving a
cluster's slope to zero is almost free and a cluster holding only safe labels flattens
its own ranking; standardising makes the penalties the same for every detector and
model. ``standardize=False`` is the paper's literal form.

All fits are damped Newton iterations in float64 (the objectives are strictly
convex), so a calibration is deterministic. :func:`coupled_budget_sample` draws
the labelled sample of the paper's protocol.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..core.validation import CLOSED_UNIT, NON_NEGATIVE, check_ranges, ranged

CALIBRATION_LAMBDAS = (1.0, 10.0, 100.0)
"""The paper's grid for the pull towards the anchor."""
ANCHOR_RIDGE = 1e-3
"""epsilon of the anchor's ridge."""
GROUPS = ("safe", "unsafe", "benign_ood")


@dataclass
class AffineCalibration:
    """Per-cluster affine maps of a detector's score; stored in a guard's ``config.json``."""

    slopes: list[float]
    """``a_c`` per cluster (may be negative)."""

    intercepts: list[float]
    """``b_c`` per cluster."""

    anchor: list[float]
    """``[a0, b0]``: the pooled fit, used by clusters without labels and rows without a cluster."""

    lam: float = ranged(NON_NEGATIVE)
    """The selected pull towards the anchor."""

    labelled: list[int] = field(default_factory=list)
    """Labelled points per cluster in the calibration sample (0: the cluster kept the anchor)."""

    labelled_unsafe: list[int] = field(default_factory=list)
    """Labelled *unsafe* points per cluster (empty in guards saved before it was recorded). A cluster with labels
    but none unsafe had its map fitted on safe labels alone: an unsafe input that falls there is scored by how
    the cluster's safe rows look, so few clusters with unsafe labels means a calibration that sees little."""

    threshold: float = ranged(CLOSED_UNIT, 0.5)
    """Rows whose calibrated probability is strictly above this are flagged."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if len(self.slopes) != len(self.intercepts):
            raise ValueError(f"{len(self.slopes)} slopes but {len(self.intercepts)} intercepts")
        if self.labelled and len(self.labelled) != len(self.slopes):
            raise ValueError(f"labelled has {len(self.labelled)} entries for {len(self.slopes)} clusters")
        if self.labelled_unsafe and len(self.labelled_unsafe) != len(self.slopes):
            raise ValueError(f"labelled_unsafe has {len(self.labelled_unsafe)} entries for {len(self.slopes)} clusters")
        if self.labelled and self.labelled_unsafe and any(u > n for u, n in zip(self.labelled_unsafe, self.labelled)):
            raise ValueError("labelled_unsafe exceeds labelled in some cluster")
        if any(n < 0 for n in (*self.labelled, *self.labelled_unsafe)):
            raise ValueError("labelled counts must be non-negative")
        if len(self.anchor) != 2:
            raise ValueError(f"anchor must be [a0, b0], got {self.anchor}")
        if not all(math.isfinite(v) for v in (*self.slopes, *self.intercepts, *self.anchor, self.lam)):
            raise ValueError("calibration coefficients must be finite")

    @property
    def n_clusters(self) -> int:
        """Clusters calibrated: one slope and intercept each."""
        return len(self.slopes)

    def coverage(self) -> str:
        """How the labels cover the clusters.

        E.g. ``"20 clusters: 6 with labelled unsafe rows; 0 without any label, on the pooled anchor"``.
        """
        unlabelled = (
            f"{self.labelled.count(0)} without any label, on the pooled anchor"
            if self.labelled
            else "labels per cluster not recorded"
        )
        if not self.labelled_unsafe:
            return f"{self.n_clusters} clusters, {unlabelled}"
        with_unsafe = sum(n > 0 for n in self.labelled_unsafe)
        return f"{self.n_clusters} clusters: {with_unsafe} with labelled unsafe rows; {unlabelled}"

    def logits(self, scores: Tensor, clusters: Tensor) -> Tensor:
        """``g = a_c s + b_c`` (float64); rows with a cluster outside ``[0, K)`` (e.g. ``-1``) use the anchor."""
        scores = scores.detach().to(torch.float64)
        slopes = torch.tensor([*self.slopes, self.anchor[0]], dtype=torch.float64, device=scores.device)
        intercepts = torch.tensor([*self.intercepts, self.anchor[1]], dtype=torch.float64, device=scores.device)
        index = torch.where((clusters >= 0) & (clusters < self.n_clusters), clusters, self.n_clusters)
        return slopes[index] * scores + intercepts[index]

    def probabilities(self, scores: Tensor, clusters: Tensor) -> Tensor:
        """``sigmoid(a_c s + b_c)`` per row (float64)."""
        return torch.sigmoid(self.logits(scores, clusters))


def importance_weights(groups: Sequence[str], budget: float) -> np.ndarray:
    """``1/p`` for ``unsafe`` and ``benign_ood`` points, ``2`` for ``safe`` ones (``p = budget``)."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown groups {unknown}; expected {GROUPS}")
    return np.array([2.0 if g == "safe" else 1.0 / budget for g in groups])


def coupled_budget_sample(sizes: dict[str, int], budget: float, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Split each group's rows into (calibration, evaluation) index arrays, seeded.

    ``round(budget * n)`` rows of ``unsafe`` and ``benign_ood`` and half (rounded down) of
    ``safe`` go to calibration; the rest is the evaluation set. Errors if a group would get
    no calibration row, since the budget is then below one labelled point.
    """
    rng = np.random.default_rng(seed)
    split = {}
    for group, n in sizes.items():
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}; expected {GROUPS}")
        take = n // 2 if group == "safe" else round(budget * n)
        if take < 1 or take >= n:
            raise ValueError(f"budget {budget} gives {take} calibration rows of {n} {group} rows")
        order = rng.permutation(n)
        split[group] = (np.sort(order[:take]), np.sort(order[take:]))
    return split


def fit_affine_calibration(
    scores: Tensor | np.ndarray,
    clusters: Tensor | np.ndarray,
    labels: Tensor | np.ndarray,
    weights: np.ndarray,
    n_clusters: int,
    *,
    lambdas: Sequence[float] = CALIBRATION_LAMBDAS,
    ridge: float = ANCHOR_RIDGE,
    n_folds: int = 5,
    seed: int = 0,
    threshold: float = 0.5,
    standardize: bool = True,
) -> AffineCalibration:
    """Fit the anchor and per-cluster maps on a labelled sample (labels: 1 unsafe, 0 safe or benign-OOD).

    ``clusters`` are the detector's assignments (``-1`` or values outside ``[0, n_clusters)``
    only inform the anchor); ``weights`` usually come from :func:`importance_weights`;
    ``standardize`` as in the module docstring.
    """
    s, c, y, w = _as_arrays(scores, clusters, labels, weights)
    if not lambdas or any(lam <= 0 for lam in lambdas):
        raise ValueError(f"lambdas must be positive, got {list(lambdas)}")
    if len(np.unique(y)) < 2:
        raise ValueError("the labelled sample needs both unsafe (1) and safe (0) points")
    centre, scale = (s.mean(), s.std()) if standardize and s.std() > 0 else (0.0, 1.0)
    s = (s - centre) / scale
    lam = _select_lambda(s, c, y, w, n_clusters, lambdas, ridge, n_folds, seed)
    anchor, slopes, intercepts = _fit_maps(s, c, y, w, n_clusters, lam, ridge)
    # Back to raw-score units: a s' + b = (a / scale) s + (b - a centre / scale).
    anchor = np.array([anchor[0] / scale, anchor[1] - anchor[0] * centre / scale])
    slopes, intercepts = slopes / scale, intercepts - slopes * centre / scale
    known = (c >= 0) & (c < n_clusters)
    labelled = np.bincount(c[known], minlength=n_clusters)
    labelled_unsafe = np.bincount(c[known & (y == 1)], minlength=n_clusters)
    return AffineCalibration(
        slopes=slopes.tolist(),
        intercepts=intercepts.tolist(),
        anchor=anchor.tolist(),
        lam=float(lam),
        labelled=labelled.tolist(),
        labelled_unsafe=labelled_unsafe.tolist(),
        threshold=threshold,
    )


def _as_arrays(*values: Tensor | np.ndarray) -> tuple[np.ndarray, ...]:
    s, c, y, w = (v.detach().cpu().numpy() if isinstance(v, Tensor) else np.asarray(v) for v in values)
    s, y, w = (v.astype(np.float64).ravel() for v in (s, y, w))
    c = c.astype(np.int64).ravel()
    if not len(s) == len(c) == len(y) == len(w):
        lengths = f"{len(s)}, {len(c)}, {len(y)}, {len(w)}"
        raise ValueError(f"scores, clusters, labels and weights differ in length: {lengths}")
    if not np.isfinite(s).all() or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError("scores must be finite and weights finite and positive")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 (safe, benign-OOD) or 1 (unsafe)")
    return s, c, y, w


def _fit_maps(
    s: np.ndarray, c: np.ndarray, y: np.ndarray, w: np.ndarray, n_clusters: int, lam: float, ridge: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    anchor = _newton(s, y, w, ridge, np.zeros(2))
    slopes, intercepts = np.full(n_clusters, anchor[0]), np.full(n_clusters, anchor[1])
    for cluster in np.unique(c[(c >= 0) & (c < n_clusters)]):
        members = c == cluster
        slopes[cluster], intercepts[cluster] = _newton(s[members], y[members], w[members], lam, anchor)
    return anchor, slopes, intercepts


def _newton(s: np.ndarray, y: np.ndarray, w: np.ndarray, penalty: float, centre: np.ndarray) -> np.ndarray:
    """argmin over (a, b) of ``sum w logloss(y, a s + b) + penalty ||(a, b) - centre||^2``, from ``centre``."""

    def objective(theta: np.ndarray) -> float:
        z = theta[0] * s + theta[1]
        return float(np.sum(w * (np.logaddexp(0.0, z) - y * z)) + penalty * np.sum((theta - centre) ** 2))

    x = np.stack([s, np.ones_like(s)], axis=1)
    theta = centre.astype(np.float64).copy()
    value = objective(theta)
    for _ in range(100):
        p = np.exp(-np.logaddexp(0.0, -(x @ theta)))  # sigmoid without overflow warnings
        gradient = x.T @ (w * (p - y)) + 2 * penalty * (theta - centre)
        hessian = (x * (w * p * (1 - p))[:, None]).T @ x + 2 * penalty * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        size = 1.0
        # Backtracking keeps every step a decrease: Newton can overshoot on near-separable clusters.
        while size > 1e-10 and objective(theta - size * step) > value:
            size /= 2
        if size <= 1e-10:
            break
        theta = theta - size * step
        new_value = objective(theta)
        if value - new_value <= 1e-12 * max(1.0, abs(value)):
            value = new_value
            break
        value = new_value
    return theta


def _select_lambda(
    s: np.ndarray,
    c: np.ndarray,
    y: np.ndarray,
    w: np.ndarray,
    n_clusters: int,
    lambdas: Sequence[float],
    ridge: float,
    n_folds: int,
    seed: int,
) -> float:
    folds = min(n_folds, int(y.sum()), int((1 - y).sum()))
    if folds < 2:
        return float(max(lambdas))
    from sklearn.metrics import roc_auc_score  # sklearn takes seconds to import: only calibration fits pay for it
    from sklearn.model_selection import StratifiedKFold

    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    results = []
    for lam in lambdas:
        aurocs = []
        for train, test in splitter.split(s, y):
            anchor, slopes, intercepts = _fit_maps(s[train], c[train], y[train], w[train], n_clusters, lam, ridge)
            known = (c[test] >= 0) & (c[test] < n_clusters)
            index = np.where(known, c[test], 0)
            g = np.where(known, slopes[index] * s[test] + intercepts[index], anchor[0] * s[test] + anchor[1])
            aurocs.append(roc_auc_score(y[test], g, sample_weight=w[test]))
        results.append((float(np.mean(aurocs)), lam))
    return float(max(results)[1])  # ties: the larger lambda (tuples compare lambda second)
