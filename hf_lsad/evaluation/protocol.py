"""The evaluation protocol: the splits, fitting on them, and the metrics of a detector or a guard.

Protocol (what :func:`hf_lsad.evaluation.grid.run_grid` does, and what the report states):

- **Safe split.** The safe store is permuted with ``split_seed`` and cut into
  *test* (``test_fraction``), *validation* (``validation_fraction``) and *fit*
  (the rest). Detectors and the SAE are fitted on the fit rows only.
- **Unsafe split.** Each unsafe category is permuted with ``split_seed`` and
  cut into *probe* (``unsafe_probe_fraction``: training positives of the
  supervised linear probe, and nothing else), *validation*
  (``unsafe_validation_fraction``) and *test* (the rest).
- **Selection.** For each method, the grid point (hyperparameter setting)
  with the highest validation AUROC, averaged over the unsafe categories and
  the seeds, is selected; negatives are the validation safe rows, positives
  the validation unsafe rows. Ties keep the earlier grid point. Test rows and
  benign-OOD rows are never used to select anything.
- **Test metrics** of the selected point, per seed and category
  (:func:`hf_lsad.core.metrics.detection_metrics`): AUROC and TPR@5%FPR with the
  test safe rows as negatives (the paper's protocol), FPR@95%TPR, AUROC with
  pooled negatives (test safe + benign OOD), the share of the category flagged
  and the benign-OOD FPR at the threshold that flags 5% of the test safe rows
  (:func:`hf_lsad.guard.threshold.fpr_threshold`), i.e. at the operating point where
  TPR@5%FPR is read. The category mean is over the unsafe categories present;
  mean and sample std over seeds.
- **Ablations** vary one field of a method's *selected* configuration at a
  time (first seed only unless ``ablation_seeds`` says otherwise, as in the
  paper's appendix) and report test metrics for every value, the selected
  value included; they describe the design space and select nothing.
- **Seeds.** A seed sets every ``seed`` field of a config (nested ones
  included, e.g. ``kmeans.seed``); the data splits and the SAE stay fixed.
  A method whose config has no seed (Mahalanobis) is deterministic and runs once.

A single guard (``hf-lsad evaluate --guard``) is measured on the safe rows it held out
(:func:`held_out_safe`) with :func:`evaluate_guard`, and calibrated per cluster with
:func:`calibrate_guard` (the paper's coupled-budget protocol).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from ..core.metrics import detection_metrics, flag_rate
from ..core.serialization import config_to_dict
from ..core.splits import holdout_rows, seeded_cut
from ..data.store import load_activations
from ..detectors import Detector, detector_class
from ..guard.calibration import AffineCalibration, coupled_budget_sample, fit_affine_calibration, importance_weights
from ..guard.guard import SafetyGuard
from ..guard.threshold import fpr_threshold
from ..sae.model import SparseAutoencoder


class SplitFractions(Protocol):
    """The split settings :func:`make_splits` reads (a :class:`~hf_lsad.evaluation.grid.GridConfig` has them)."""

    test_fraction: float
    validation_fraction: float
    unsafe_validation_fraction: float
    unsafe_probe_fraction: float
    split_seed: int


class Splits(NamedTuple):
    """Row indices of every split (module docstring); the unsafe ones per category."""

    safe_fit: Tensor
    """Safe rows the detectors and the SAE are fitted on."""
    safe_validation: Tensor
    """Safe rows that select the grid point (negatives of the validation AUROC)."""
    safe_test: Tensor
    """Safe rows of the test metrics and of the 5% threshold they are read at."""
    unsafe_probe: dict[str, Tensor]
    """Training positives of the supervised linear probe, and nothing else."""
    unsafe_validation: dict[str, Tensor]
    """Positives that select the grid point."""
    unsafe_test: dict[str, Tensor]
    """Positives of the test metrics."""


def make_splits(n_safe: int, n_unsafe: Mapping[str, int], config: SplitFractions) -> Splits:
    """The row indices of every split (module docstring), from ``config.split_seed``."""
    safe_test, safe_validation, safe_fit = seeded_cut(
        n_safe, [config.test_fraction, config.validation_fraction], config.split_seed
    )
    probe, validation, test = {}, {}, {}
    for category, n in n_unsafe.items():
        probe[category], validation[category], test[category] = seeded_cut(
            n, [config.unsafe_probe_fraction, config.unsafe_validation_fraction], config.split_seed
        )
    return Splits(safe_fit, safe_validation, safe_test, probe, validation, test)


class EvalData(NamedTuple):
    """Activations of one evaluation: safe, unsafe per category, optional benign OOD."""

    safe: Tensor
    unsafe: dict[str, Tensor]
    benign_ood: Tensor | None
    hook: dict[str, Any]
    """The safe store's hook point (as a dict), for the report."""
    sources: dict[str, str]
    """Where each set came from (store folders)."""


def load_eval_data(
    safe: str | os.PathLike, unsafe: Sequence[str | os.PathLike], benign_ood: str | os.PathLike | None
) -> EvalData:
    """Read activation stores; an unsafe store's category is its folder name. All must share the hook point."""
    safe_set = load_activations(safe)
    unsafe_sets: dict[str, Tensor] = {}
    sources = {"safe": str(safe)}
    for folder in unsafe:
        name = Path(folder).name
        if name in unsafe_sets:
            raise ValueError(f"two unsafe stores are named {name!r}: the folder name is the category")
        data = load_activations(folder)
        if data.hook != safe_set.hook:
            raise ValueError(f"{folder} was read at {data.hook}, the safe store at {safe_set.hook}")
        unsafe_sets[name], sources[name] = data.activations, str(folder)
    ood = None
    if benign_ood is not None:
        data = load_activations(benign_ood)
        if data.hook != safe_set.hook:
            raise ValueError(f"{benign_ood} was read at {data.hook}, the safe store at {safe_set.hook}")
        ood, sources["benign_ood"] = data.activations, str(benign_ood)
    if not unsafe_sets:
        raise ValueError("need at least one unsafe store")
    return EvalData(safe_set.activations, unsafe_sets, ood, config_to_dict(safe_set.hook), sources)


def score_rows(
    detector: Detector, activations: Tensor, sae: SparseAutoencoder | None, batch_size: int = 4096
) -> np.ndarray:
    """The detector's scores (float64 numpy), ``batch_size`` rows at a time."""
    with torch.no_grad():
        parts = [detector(activations[i : i + batch_size], sae).scores for i in range(0, len(activations), batch_size)]
    return torch.cat(parts).double().numpy()


def fit_detector(
    method: str, config: Any, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, *, progress: bool = False
) -> Detector:
    """Fit one detector on the safe fit rows (a supervised method also on the unsafe probe rows of every category)."""
    cls = detector_class(method)
    detector = cls(config, data.safe.shape[1], sae.config.d_sae if (sae is not None and cls.uses_sae) else None)
    unsafe = torch.cat([data.unsafe[c][splits.unsafe_probe[c]] for c in data.unsafe]) if cls.supervised else None
    detector.fit_split(data.safe[splits.safe_fit], sae if cls.uses_sae else None, unsafe=unsafe, progress=progress)
    return detector.eval()


def evaluate_detector(
    detector: Detector, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, target_fpr: float
) -> dict[str, Any]:
    """Validation and test metrics of a fitted detector (module docstring)."""
    reads_sae = sae if type(detector).uses_sae else None

    def score(x: Tensor) -> np.ndarray:
        return score_rows(detector, x, reads_sae)

    safe_val, safe_test = score(data.safe[splits.safe_validation]), score(data.safe[splits.safe_test])
    ood = score(data.benign_ood) if data.benign_ood is not None else None
    threshold = fpr_threshold(torch.from_numpy(safe_test), target_fpr)
    validation: dict[str, Any] = {}
    test: dict[str, Any] = {}
    for category, activations in data.unsafe.items():
        val_pos = score(activations[splits.unsafe_validation[category]])
        test_pos = score(activations[splits.unsafe_test[category]])
        validation[category] = detection_metrics(safe_val, val_pos, target_fpr=target_fpr)
        test[category] = detection_metrics(
            safe_test,
            test_pos,
            target_fpr=target_fpr,
            target_tpr=0.95,
            flagged=test_pos > threshold,
            pooled_negatives=ood,
        )
    validation["mean"] = {k: float(np.mean([validation[c][k] for c in data.unsafe])) for k in ("auroc", "tpr_at_fpr")}
    test["mean"] = {k: float(np.mean([test[c][k] for c in data.unsafe])) for k in test[next(iter(data.unsafe))]}
    out = {
        "validation": validation,
        "test": test,
        "threshold": threshold,
        "safe_test_flagged": flag_rate(safe_test, threshold),
    }
    if ood is not None:
        out["benign_ood_fpr"] = flag_rate(ood, threshold)
    return out


def held_out_safe(guard: SafetyGuard, store: str | os.PathLike) -> Tensor:
    """The rows of the guard's safe store that it held out from fitting (its threshold split)."""
    safe = load_activations(store).activations
    n = guard.config.n_fit + guard.config.n_holdout
    if len(safe) != n:
        raise ValueError(f"{store} has {len(safe)} rows; the guard was fitted on {n}")
    return safe[holdout_rows(guard.config.n_fit, guard.config.n_holdout, guard.config.seed)]


def evaluate_guard(
    guard: SafetyGuard,
    safe: str | os.PathLike,
    unsafe: Sequence[str | os.PathLike],
    benign_ood: str | os.PathLike | None = None,
    *,
    target_fpr: float = 0.05,
) -> dict[str, dict[str, float]]:
    """Per unsafe store (named by its folder): :func:`~hf_lsad.core.metrics.detection_metrics` against the guard's
    held-out safe rows; ``flagged`` as the guard flags (by probability once calibrated). With ``benign_ood``,
    also ``auroc_pooled`` and a ``benign_ood`` row holding its flag rate (the paper's Table-5 setting)."""
    negatives = guard(held_out_safe(guard, safe)).scores.numpy()
    benign = guard(load_activations(benign_ood).activations) if benign_ood else None
    rows = {}
    for folder in unsafe:
        output = guard(load_activations(folder).activations)
        rows[Path(folder).name] = detection_metrics(
            negatives,
            output.scores.numpy(),
            target_fpr=target_fpr,
            flagged=output.flagged.numpy(),
            pooled_negatives=benign.scores.numpy() if benign is not None else None,
        )
    if benign is not None:
        rows["benign_ood"] = {"flagged": benign.flagged.double().mean().item()}
    return rows


def calibrate_guard(
    guard: SafetyGuard,
    safe: str | os.PathLike,
    unsafe: Sequence[str | os.PathLike],
    benign_ood: str | os.PathLike,
    *,
    budget: float = 0.01,
    seed: int = 0,
    probability_threshold: float = 0.5,
) -> tuple[AffineCalibration, dict[str, int]]:
    """Fit the per-cluster affine calibration of ``guard`` on a coupled-budget labelled sample.

    Half of the guard's held-out safe rows and ``budget`` of the pooled unsafe and of the benign-OOD
    rows are labelled (:func:`~hf_lsad.guard.calibration.coupled_budget_sample`). Works for every detector
    with clusters (``detector.n_clusters > 0``). Returns the calibration (not yet set on the guard)
    and the number of labelled rows per group.
    """
    n_clusters = guard.detector.n_clusters
    if n_clusters == 0:
        raise ValueError(f"per-cluster calibration needs a clustered detector; {guard.config.method} has no clusters")
    groups = {
        "safe": held_out_safe(guard, safe),  # only held-out rows: the detector was fitted on the others
        "unsafe": torch.cat([load_activations(folder).activations for folder in unsafe]),
        "benign_ood": load_activations(benign_ood).activations,
    }
    split = coupled_budget_sample({g: len(a) for g, a in groups.items()}, budget, seed)
    with torch.no_grad():
        outputs = {g: guard(a[torch.from_numpy(split[g][0])]) for g, a in groups.items()}
    names = [g for g, out in outputs.items() for _ in range(len(out.scores))]
    calibration = fit_affine_calibration(
        torch.cat([o.scores for o in outputs.values()]),
        torch.cat([o.clusters for o in outputs.values()]),
        torch.tensor([float(n == "unsafe") for n in names]),
        importance_weights(names, budget),
        n_clusters,
        seed=seed,
        threshold=probability_threshold,
    )
    return calibration, {g: len(o.scores) for g, o in outputs.items()}
