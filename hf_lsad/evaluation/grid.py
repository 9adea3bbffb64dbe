"""Method grids on cached activations: selection on validation, metrics on test (protocol: :mod:`.protocol`).

A grid is a list of methods (a registered detector, fixed settings, swept settings), ablations
and seeds (:class:`GridConfig`, readable from JSON). :func:`run_grid` fits every point on the
fit split, selects each method's point on validation, and returns JSON-ready results that
:func:`hf_lsad.evaluation.report.write_report` renders.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.metrics import mean_std
from ..core.serialization import config_to_dict
from ..core.settings import build_config as build_settings, has_seed
from ..detectors import detector_class
from ..detectors.freqmask import FreqMaskKM
from ..sae.model import SparseAutoencoder
from .diagnostics import freqmask_diagnostics
from .protocol import EvalData, Splits, evaluate_detector, fit_detector, make_splits


@dataclass
class MethodSpec:
    """One method of the grid: a registered detector, fixed settings and the settings swept."""

    name: str
    """Display name in the report (``FreqMask-KM``, ``Local FreqMask-KM``, ...)."""

    method: str
    """Registered detector method (``freqmask-km``, ``mahalanobis``, ...)."""

    base: dict[str, Any] = field(default_factory=dict)
    """Config fields fixed for this method, dotted for nested ones (``kmeans.metric``)."""

    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Config fields swept (dotted name -> values); the product is the method's grid."""

    local: bool = False
    """Whether the method scores on a sparse local subspace (Table 2's "Local" column)."""


@dataclass
class AblationSpec:
    """One ablation table: one config field of a method's selected setting, varied."""

    name: str
    """Table title (``clusters K``, ``mask on/off``, ...)."""

    method: str
    """:attr:`MethodSpec.name` of the method whose selected config is varied."""

    key: str
    """Dotted config field varied."""

    values: list[Any]
    """Values tried (the selected value may be among them)."""


@dataclass
class GridConfig:
    """A full evaluation: methods, ablations, seeds and the split protocol (module docstring)."""

    methods: list[MethodSpec]
    ablations: list[AblationSpec] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    ablation_seeds: list[int] | None = None
    """Seeds of the ablation runs; default: the first of :attr:`seeds`."""
    test_fraction: float = 0.2
    validation_fraction: float = 0.2
    unsafe_validation_fraction: float = 0.2
    unsafe_probe_fraction: float = 0.2
    split_seed: int = 0
    target_fpr: float = 0.05
    diagnostics: bool = True
    """Run :func:`hf_lsad.evaluation.diagnostics.freqmask_diagnostics` on each selected FreqMask-KM method (first
    seed)."""

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("the grid has no method")
        if not self.seeds:
            raise ValueError("the grid has no seed")
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"method names must be unique, got {names}")
        for ablation in self.ablations:
            if ablation.method not in names:
                raise ValueError(f"ablation {ablation.name!r} refers to unknown method {ablation.method!r}")
        for name in ("test_fraction", "validation_fraction", "unsafe_validation_fraction", "unsafe_probe_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")
        if self.test_fraction + self.validation_fraction >= 1.0:
            raise ValueError("test_fraction + validation_fraction leave no safe rows to fit on")
        if self.unsafe_validation_fraction + self.unsafe_probe_fraction >= 1.0:
            raise ValueError("unsafe_validation_fraction + unsafe_probe_fraction leave no unsafe test rows")
        if not 0.0 < self.target_fpr < 1.0:
            raise ValueError(f"target_fpr must be in (0, 1), got {self.target_fpr}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GridConfig:
        """Build from a JSON object with the fields of this class (methods and ablations as objects)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown grid key(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(data)
        kwargs["methods"] = [MethodSpec(**m) for m in data.get("methods", [])]
        kwargs["ablations"] = [AblationSpec(**a) for a in data.get("ablations", [])]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> GridConfig:
        """Read a grid file (JSON object, see :meth:`from_dict`)."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def default_grid() -> GridConfig:
    """The paper's methods with small CPU-sized sweeps, and the FreqMask-KM ablations."""
    return GridConfig(
        methods=[
            MethodSpec(
                "FreqMask-KM",
                "freqmask-km",
                grid={"kmeans.n_clusters": [10, 25, 50], "mask_size": [50, 100, 200]},
                local=True,
            ),
            MethodSpec(
                "Local FreqMask-KM",
                "freqmask-km",
                base={"mask_scope": "local"},
                grid={"kmeans.n_clusters": [10, 25, 50], "mask_size": [50, 100, 200]},
                local=True,
            ),
            MethodSpec("Mahalanobis", "mahalanobis", grid={"ridge": [1e-5, 1e-3, 1e-1]}),
            MethodSpec("GMM", "gmm", grid={"n_components": [5, 10, 50]}),
            MethodSpec("One-Class SVM", "ocsvm", grid={"nu": [0.01, 0.1], "gamma": [1e-3, 1e-2]}),
            MethodSpec("Deep SVDD", "deep-svdd", grid={"rep_dim": [32, 128]}),
            MethodSpec("CVDD", "cvdd", grid={"n_contexts": [10, 50]}),
            MethodSpec("Linear probe", "linear-probe", grid={"lr": [1e-3, 1e-4]}),
        ],
        ablations=[
            AblationSpec("clusters K", "FreqMask-KM", "kmeans.n_clusters", [5, 10, 25, 50, 100]),
            AblationSpec("mask size k", "FreqMask-KM", "mask_size", [25, 50, 100, 200, 400]),
            AblationSpec("clustering metric", "FreqMask-KM", "kmeans.metric", ["l2", "l1", "hamming"]),
            AblationSpec("scoring metric", "FreqMask-KM", "score_metric", ["l1", "l2", "mahalanobis"]),
            AblationSpec("mask on/off", "FreqMask-KM", "use_mask", [True, False]),
        ],
        seeds=[0, 1, 2],
    )


def build_config(method: str, settings: Mapping[str, Any], seed: int | None) -> tuple[Any, bool]:
    """The config of ``method`` with dotted ``settings`` applied and every seed field set (to 0 without
    a seed); and whether it has seeds."""
    cls = detector_class(method).config_class
    config = build_settings(
        cls, settings, seed=seed if seed is not None else 0, source=f"{method} grid point {dict(settings)}"
    )
    return config, has_seed(cls)


def grid_points(spec: MethodSpec) -> list[dict[str, Any]]:
    """All settings of a method: its base merged with each point of the product of its grid."""
    keys = list(spec.grid)
    return [{**spec.base, **dict(zip(keys, values))} for values in itertools.product(*(spec.grid[k] for k in keys))]


class _Runner:
    """Fits and evaluates grid points, caching each (method, settings, seed) run."""

    def __init__(
        self, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, config: GridConfig, progress: bool
    ):
        self.data, self.splits, self.sae, self.config, self.progress = data, splits, sae, config, progress
        self.cache: dict[str, dict[str, Any]] = {}

    def run(self, method: str, settings: Mapping[str, Any], seed: int) -> dict[str, Any]:
        config, seeded = build_config(method, settings, seed)
        key = json.dumps([method, config_to_dict(config)], sort_keys=True, default=str)
        if key in self.cache:
            return self.cache[key]
        start = time.perf_counter()
        detector = fit_detector(method, config, self.data, self.splits, self.sae)
        fit_seconds = time.perf_counter() - start
        start = time.perf_counter()
        metrics = evaluate_detector(detector, self.data, self.splits, self.sae, self.config.target_fpr)
        result = {
            "method": method,
            "settings": dict(settings),
            "seed": seed if seeded else None,
            "config": config_to_dict(config),
            "fit_seconds": fit_seconds,
            "score_seconds": time.perf_counter() - start,
            **metrics,
        }
        if self.progress:
            print(
                f"  {method} {dict(settings)} seed={result['seed']}: val AUROC "
                f"{metrics['validation']['mean']['auroc']:.3f}, "
                f"test AUROC {metrics['test']['mean']['auroc']:.3f} ({fit_seconds:.1f} s fit)",
                flush=True,
            )
        self.cache[key] = result
        return result

    def run_seeds(self, method: str, settings: Mapping[str, Any], seeds: Sequence[int]) -> list[dict[str, Any]]:
        runs = [self.run(method, settings, seeds[0])]
        if runs[0]["seed"] is None:
            return runs  # deterministic: one run stands for every seed
        return runs + [self.run(method, settings, seed) for seed in seeds[1:]]


def aggregate(runs: Sequence[Mapping[str, Any]], split: str = "test") -> dict[str, dict[str, list[float]]]:
    """``{category: {metric: [mean, std]}}`` over the runs (seeds) of one grid point; ``benign_ood_fpr`` too."""
    first = runs[0][split]
    out: dict[str, Any] = {
        category: {metric: list(mean_std([r[split][category][metric] for r in runs])) for metric in first[category]}
        for category in first
    }
    if split == "test" and "benign_ood_fpr" in runs[0]:
        out["benign_ood_fpr"] = list(mean_std([r["benign_ood_fpr"] for r in runs]))
    return out


def run_grid(
    data: EvalData,
    config: GridConfig,
    sae: SparseAutoencoder | None,
    *,
    splits: Splits | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every method's grid over the seeds, select on validation, run the ablations and diagnostics.

    Returns a JSON-ready dict: ``methods`` (per method: every grid point's
    validation AUROC, the selected settings, their per-seed runs and test
    aggregates), ``ablations`` and ``diagnostics``.
    """
    splits = splits or make_splits(len(data.safe), {c: len(x) for c, x in data.unsafe.items()}, config)
    runner = _Runner(data, splits, sae, config, progress)
    methods: dict[str, Any] = {}
    for spec in config.methods:
        cls = detector_class(spec.method)
        if cls.uses_sae and sae is None:
            raise ValueError(f"{spec.name} ({spec.method}) reads SAE codes: give an SAE")
        if progress:
            print(f"{spec.name}: {len(grid_points(spec))} grid point(s) x {len(config.seeds)} seed(s)", flush=True)
        points: list[dict[str, Any]] = []
        for settings in grid_points(spec):
            runs = runner.run_seeds(spec.method, settings, config.seeds)
            points.append(
                {
                    "settings": settings,
                    "validation_auroc": mean_std([r["validation"]["mean"]["auroc"] for r in runs])[0],
                    "runs": runs,
                }
            )
        best = max(range(len(points)), key=lambda i: (points[i]["validation_auroc"], -i))
        selected = points[best]
        methods[spec.name] = {
            "method": spec.method,
            "local": spec.local,
            "supervised": cls.supervised,
            "grid": [{"settings": p["settings"], "validation_auroc": p["validation_auroc"]} for p in points],
            "selected": selected["settings"],
            "selected_validation_auroc": selected["validation_auroc"],
            "deterministic": selected["runs"][0]["seed"] is None,
            "runs": selected["runs"],
            "test": aggregate(selected["runs"]),
            "validation": aggregate(selected["runs"], "validation"),
            "fit_seconds": float(np.mean([r["fit_seconds"] for r in selected["runs"]])),
        }
    ablations = []
    seeds = config.ablation_seeds or config.seeds[:1]
    for ablation in config.ablations:
        spec = next(m for m in config.methods if m.name == ablation.method)
        base = methods[spec.name]["selected"]
        rows = []
        for value in ablation.values:
            runs = runner.run_seeds(spec.method, {**base, ablation.key: value}, seeds)
            rows.append(
                {
                    "value": value,
                    "validation": aggregate(runs, "validation"),
                    "test": aggregate(runs),
                    "seeds": len(runs),
                }
            )
        selected_value = config_to_dict(build_config(spec.method, base, None)[0])
        for part in ablation.key.split("."):
            selected_value = selected_value[part]
        ablations.append(
            {
                "name": ablation.name,
                "method": ablation.method,
                "key": ablation.key,
                "base": base,
                "selected_value": selected_value,
                "rows": rows,
            }
        )
    diagnostics = {}
    if config.diagnostics:
        for spec in config.methods:
            if spec.method == FreqMaskKM.method:
                assert sae is not None  # refused above: FreqMask-KM reads SAE codes
                diagnostics[spec.name] = _diagnose(spec, methods[spec.name], data, splits, sae, config)
    return {"methods": methods, "ablations": ablations, "diagnostics": diagnostics}


def _diagnose(
    spec: MethodSpec,
    result: Mapping[str, Any],
    data: EvalData,
    splits: Splits,
    sae: SparseAutoencoder,
    config: GridConfig,
) -> dict[str, Any]:
    """Refit the selected FreqMask-KM point at the first seed and run the diagnostics on held-out sets."""
    run = result["runs"][0]
    detector_config, _ = build_config(spec.method, result["selected"], run["seed"])
    detector = fit_detector(spec.method, detector_config, data, splits, sae)
    assert isinstance(detector, FreqMaskKM)  # the caller diagnoses FreqMask-KM only
    sets = {"safe_test": data.safe[splits.safe_test]}
    sets.update({c: x[splits.unsafe_test[c]] for c, x in data.unsafe.items()})
    if data.benign_ood is not None:
        sets["benign_ood"] = data.benign_ood
    out = freqmask_diagnostics(
        detector, sae, data.safe[splits.safe_fit], sets, unsafe_sets=tuple(data.unsafe), threshold=run["threshold"]
    )
    out["settings"], out["seed"] = result["selected"], run["seed"]
    return out
