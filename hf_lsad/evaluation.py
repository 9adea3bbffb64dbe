"""Method grids on cached activations: selection on validation, metrics on test, a report folder.

Protocol (what :func:`run_grid` does, and what the report states):

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
- **Test metrics** of the selected point, per seed and category: AUROC and
  TPR@5%FPR with the test safe rows as negatives (the paper's protocol),
  FPR@95%TPR, AUROC with pooled negatives (test safe + benign OOD), and the
  benign-OOD FPR: the fraction of benign-OOD rows above the threshold that
  flags 5% of the test safe rows (:func:`hf_lsad.calibration.fpr_threshold`),
  i.e. at the operating point where TPR@5%FPR is read. The category mean is
  over the unsafe categories present; mean and sample std over seeds.
- **Ablations** vary one field of a method's *selected* configuration at a
  time (first seed only unless ``ablation_seeds`` says otherwise, as in the
  paper's appendix) and report test metrics for every value, the selected
  value included; they describe the design space and select nothing.
- **Seeds.** A seed sets every ``seed`` field of a config (nested ones
  included, e.g. ``kmeans.seed``); the data splits and the SAE stay fixed.
  A method whose config has no seed (Mahalanobis) is deterministic and runs once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .calibration import fpr_threshold
from .detectors import Detector, detector_class
from .detectors.freqmask import FreqMaskKM
from .diagnostics import freqmask_diagnostics, save_plots
from .metrics import auroc, flag_rate, fpr_at_tpr, mean_std, tpr_at_fpr
from .model_card import BENIGN_OOD_WARNING_FPR, benign_ood_warning
from .sae import SAETrainConfig, SparseAutoencoder, sae_stats, train_sae
from .serialization import config_from_dict, config_to_dict, read_json, write_json
from .store import load_activations

SAE_TRAINING_FILE = "training.json"
"""Written next to an SAE trained by :func:`load_or_train_sae`: the split and settings it was trained on."""


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
    """Run :func:`hf_lsad.diagnostics.freqmask_diagnostics` on each selected FreqMask-KM method (first seed)."""

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
            MethodSpec("FreqMask-KM", "freqmask-km", grid={"kmeans.n_clusters": [10, 25, 50], "mask_size": [50, 100, 200]}, local=True),
            MethodSpec(
                "Local FreqMask-KM", "freqmask-km", base={"mask_scope": "local"},
                grid={"kmeans.n_clusters": [10, 25, 50], "mask_size": [50, 100, 200]}, local=True,
            ),  # fmt: skip
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


class Splits(NamedTuple):
    safe_fit: Tensor
    safe_validation: Tensor
    safe_test: Tensor
    unsafe_probe: dict[str, Tensor]
    unsafe_validation: dict[str, Tensor]
    unsafe_test: dict[str, Tensor]


def _cut(n: int, fractions: Sequence[float], seed: int) -> list[Tensor]:
    """A seeded permutation of ``range(n)`` cut into ``len(fractions)`` leading parts and the rest (each sorted)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for fraction in fractions:
        size = round(n * fraction)
        parts.append(order[start : start + size].sort().values)
        start += size
    parts.append(order[start:].sort().values)
    if any(len(part) == 0 for part in parts):
        raise ValueError(f"cannot cut {n} rows into parts of fractions {list(fractions)} and the rest: a part is empty")
    return parts


def make_splits(n_safe: int, n_unsafe: Mapping[str, int], config: GridConfig) -> Splits:
    """The row indices of every split (module docstring), from ``config.split_seed``."""
    safe_test, safe_validation, safe_fit = _cut(n_safe, [config.test_fraction, config.validation_fraction], config.split_seed)
    probe, validation, test = {}, {}, {}
    for category, n in n_unsafe.items():
        probe[category], validation[category], test[category] = _cut(
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


def load_eval_data(safe: str | os.PathLike, unsafe: Sequence[str | os.PathLike], benign_ood: str | os.PathLike | None) -> EvalData:
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


def load_or_train_sae(
    directory: str | os.PathLike,
    fit_activations: Tensor,
    fit_rows: Tensor,
    *,
    d_sae: int | None = None,
    training: SAETrainConfig | None = None,
    progress: bool = True,
) -> tuple[SparseAutoencoder, dict[str, Any]]:
    """The SAE in ``directory``, or one trained on ``fit_activations`` and saved there.

    ``fit_rows`` are the safe-store row indices of ``fit_activations``; they are
    saved in ``training.json`` with the settings, and a cached SAE whose
    ``training.json`` names other rows or settings is refused (it may have seen
    validation or test rows). An SAE folder without ``training.json`` (trained
    elsewhere) is used as given. ``d_sae`` is needed only to train.
    """
    path = Path(directory)
    rows = [int(i) for i in fit_rows]
    if (path / "config.json").is_file():
        sae = SparseAutoencoder.from_pretrained(path)
        info: dict[str, Any] = {"path": str(path), "trained_here": False}
        if (path / SAE_TRAINING_FILE).is_file():
            saved = read_json(path / SAE_TRAINING_FILE)
            if saved["fit_rows"] != rows:
                raise ValueError(f"{path} was trained on other safe rows than this split's fit rows; use another folder")
            if training is not None and saved["training"] != config_to_dict(training):
                raise ValueError(f"{path} was trained with {saved['training']}, asked for {config_to_dict(training)}")
            info["training"] = saved["training"]
            info["train_seconds"] = saved["train_seconds"]
        return sae, info
    if d_sae is None:
        raise ValueError(f"no SAE in {path} and no d_sae to train one")
    training = training or SAETrainConfig()
    start = time.perf_counter()
    sae = train_sae(fit_activations, d_sae, training, progress=progress)
    seconds = time.perf_counter() - start
    sae.save_pretrained(path)
    write_json(path / SAE_TRAINING_FILE, {"training": config_to_dict(training), "fit_rows": rows, "train_seconds": seconds})
    return sae, {"path": str(path), "trained_here": True, "training": config_to_dict(training), "train_seconds": seconds}


# ---------------------------------------------------------------- configs


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    target = data
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            raise ValueError(f"config has no nested field {part!r} (in {key!r})")
        target = target[part]
    if parts[-1] not in target:
        raise ValueError(f"config has no field {parts[-1]!r} (in {key!r}); fields: {sorted(target)}")
    if isinstance(target[parts[-1]], tuple) and isinstance(value, list):
        value = tuple(value)  # JSON has no tuples
    target[parts[-1]] = value


def _set_seeds(data: dict[str, Any], seed: int) -> bool:
    """Set every ``seed`` field (nested included); whether there was one."""
    found = False
    for key, value in data.items():
        if key == "seed":
            data[key], found = seed, True
        elif isinstance(value, dict):
            found = _set_seeds(value, seed) or found
    return found


def build_config(method: str, settings: Mapping[str, Any], seed: int | None) -> tuple[Any, bool]:
    """The config of ``method`` with dotted ``settings`` applied and every seed field set; and whether it has seeds."""
    cls = detector_class(method).config_class
    data = config_to_dict(cls())  # asdict keeps tuples, so list values from JSON are converted back
    for key, value in settings.items():
        _set_dotted(data, key, value)
    seeded = _set_seeds(data, seed if seed is not None else 0)
    return config_from_dict(cls, data, source=f"{method} grid point {dict(settings)}"), seeded


def grid_points(spec: MethodSpec) -> list[dict[str, Any]]:
    """All settings of a method: its base merged with each point of the product of its grid."""
    keys = list(spec.grid)
    return [{**spec.base, **dict(zip(keys, values))} for values in itertools.product(*(spec.grid[k] for k in keys))]


# ---------------------------------------------------------------- running


def _scores(detector: Detector, activations: Tensor, sae: SparseAutoencoder | None, batch_size: int = 4096) -> np.ndarray:
    with torch.no_grad():
        parts = [detector(activations[i : i + batch_size], sae).scores for i in range(0, len(activations), batch_size)]
    return torch.cat(parts).double().numpy()


def fit_detector(
    method: str, config: Any, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, *, progress: bool = False
) -> Detector:
    """Fit one detector on the safe fit rows (the supervised probe also on the unsafe probe rows of every category)."""
    cls = detector_class(method)
    detector = cls(config, data.safe.shape[1], sae.config.d_sae if (sae is not None and cls.uses_sae) else None)
    safe_fit = data.safe[splits.safe_fit]
    if cls.supervised:
        unsafe = torch.cat([data.unsafe[c][splits.unsafe_probe[c]] for c in data.unsafe])
        detector.fit_supervised(safe_fit, unsafe, sae if cls.uses_sae else None, progress=progress)
    else:
        detector.fit(safe_fit, sae if cls.uses_sae else None, progress=progress)
    return detector.eval()


def evaluate_detector(
    detector: Detector, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, target_fpr: float
) -> dict[str, Any]:
    """Validation and test metrics of a fitted detector (module docstring)."""
    reads_sae = sae if type(detector).uses_sae else None
    score = lambda x: _scores(detector, x, reads_sae)  # noqa: E731
    safe_val, safe_test = score(data.safe[splits.safe_validation]), score(data.safe[splits.safe_test])
    ood = score(data.benign_ood) if data.benign_ood is not None else None
    threshold = fpr_threshold(torch.from_numpy(safe_test), target_fpr)
    validation: dict[str, Any] = {}
    test: dict[str, Any] = {}
    for category, activations in data.unsafe.items():
        val_pos = score(activations[splits.unsafe_validation[category]])
        test_pos = score(activations[splits.unsafe_test[category]])
        validation[category] = {"auroc": auroc(safe_val, val_pos), "tpr_at_fpr": tpr_at_fpr(safe_val, val_pos, target_fpr)}
        row = {
            "auroc": auroc(safe_test, test_pos),
            "tpr_at_fpr": tpr_at_fpr(safe_test, test_pos, target_fpr),
            "fpr_at_95tpr": fpr_at_tpr(safe_test, test_pos, 0.95),
            "flagged_at_threshold": flag_rate(test_pos, threshold),
        }
        if ood is not None:
            row["auroc_pooled"] = auroc(np.concatenate([safe_test, ood]), test_pos)
        test[category] = row
    validation["mean"] = {k: float(np.mean([validation[c][k] for c in data.unsafe])) for k in ("auroc", "tpr_at_fpr")}
    test["mean"] = {k: float(np.mean([test[c][k] for c in data.unsafe])) for k in test[next(iter(data.unsafe))]}
    out = {"validation": validation, "test": test, "threshold": threshold, "safe_test_flagged": flag_rate(safe_test, threshold)}
    if ood is not None:
        out["benign_ood_fpr"] = flag_rate(ood, threshold)
    return out


class _Runner:
    """Fits and evaluates grid points, caching each (method, settings, seed) run."""

    def __init__(self, data: EvalData, splits: Splits, sae: SparseAutoencoder | None, config: GridConfig, progress: bool):
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
            print(f"  {method} {dict(settings)} seed={result['seed']}: val AUROC {metrics['validation']['mean']['auroc']:.3f}, "
                  f"test AUROC {metrics['test']['mean']['auroc']:.3f} ({fit_seconds:.1f} s fit)", flush=True)  # fmt: skip
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
    data: EvalData, config: GridConfig, sae: SparseAutoencoder | None, *, splits: Splits | None = None, progress: bool = True
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
        points = []
        for settings in grid_points(spec):
            runs = runner.run_seeds(spec.method, settings, config.seeds)
            points.append({
                "settings": settings,
                "validation_auroc": mean_std([r["validation"]["mean"]["auroc"] for r in runs])[0],
                "runs": runs,
            })  # fmt: skip
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
            rows.append({"value": value, "validation": aggregate(runs, "validation"), "test": aggregate(runs), "seeds": len(runs)})
        selected_value = config_to_dict(build_config(spec.method, base, None)[0])
        for part in ablation.key.split("."):
            selected_value = selected_value[part]
        ablations.append({
            "name": ablation.name, "method": ablation.method, "key": ablation.key, "base": base,
            "selected_value": selected_value, "rows": rows,
        })  # fmt: skip
    diagnostics = {}
    if config.diagnostics:
        for spec in config.methods:
            if spec.method == FreqMaskKM.method:
                diagnostics[spec.name] = _diagnose(spec, methods[spec.name], data, splits, sae, config)
    return {"methods": methods, "ablations": ablations, "diagnostics": diagnostics}


def _diagnose(
    spec: MethodSpec, result: Mapping[str, Any], data: EvalData, splits: Splits, sae: SparseAutoencoder, config: GridConfig
) -> dict[str, Any]:
    """Refit the selected FreqMask-KM point at the first seed and run the diagnostics on held-out sets."""
    run = result["runs"][0]
    detector_config, _ = build_config(spec.method, result["selected"], run["seed"])
    detector = fit_detector(spec.method, detector_config, data, splits, sae)
    sets = {"safe_test": data.safe[splits.safe_test]}
    sets.update({c: x[splits.unsafe_test[c]] for c, x in data.unsafe.items()})
    if data.benign_ood is not None:
        sets["benign_ood"] = data.benign_ood
    out = freqmask_diagnostics(
        detector, sae, data.safe[splits.safe_fit], sets, unsafe_sets=tuple(data.unsafe), threshold=run["threshold"]
    )
    out["settings"], out["seed"] = result["selected"], run["seed"]
    return out


# ---------------------------------------------------------------- report


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages that change the numbers."""
    import faiss
    import sklearn
    import transformers

    from . import __version__

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hf_lsad": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "scikit-learn": sklearn.__version__,
        "faiss": faiss.__version__,
        "numpy": np.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }


def _pm(value: Sequence[float]) -> str:
    return f"{value[0]:.3f} ± {value[1]:.3f}"


def _table2(results: Mapping[str, Any], categories: Sequence[str], metric: str, title: str) -> list[str]:
    columns = [*categories, "mean"]
    lines = [f"**{title}** (↑)", "", "| Method | Local | " + " | ".join(columns) + " |", "|---|:-:|" + "---:|" * len(columns)]
    methods = results["methods"]
    unsupervised = [name for name, m in methods.items() if not m["supervised"]]
    ranks: dict[str, list[str]] = {}
    for column in columns:
        ranked = sorted(unsupervised, key=lambda n: -methods[n]["test"][column][metric][0])
        ranks[column] = ranked[:2]
    for name in [n for n, m in methods.items() if m["supervised"]] + unsupervised:
        m = methods[name]
        cells = []
        for column in columns:
            cell = _pm(m["test"][column][metric])
            if not m["supervised"] and ranks[column] and name == ranks[column][0]:
                cell = f"**{cell}**"
            elif not m["supervised"] and len(ranks[column]) > 1 and name == ranks[column][1]:
                cell = f"<u>{cell}</u>"
            cells.append(cell)
        label = f"{name} (SUPERVISED reference)" if m["supervised"] else name
        lines.append(f"| {label} | {'●' if m['local'] else '–'} | " + " | ".join(cells) + " |")
    return lines


def _settings(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


def render_report(report: Mapping[str, Any]) -> str:
    """The Markdown report of :func:`write_report`'s ``results.json`` content."""
    results, protocol = report["results"], report["protocol"]
    methods = results["methods"]
    categories = report["categories"]
    fpr = protocol["target_fpr"]
    lines = [
        f"# {report['title']}",
        "",
        "Regenerate with:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Hook point: `{report['hook'].get('base_model')}` {report['hook'].get('layer_module')} "
        f"({report['hook'].get('position')}). Rows: " + ", ".join(f"{k} {v}" for k, v in report["rows"].items()) + ".",
        "",
        "## Protocol",
        "",
        protocol["text"],
        "",
        "## Main results (Table 2 layout)",
        "",
        f"Test split; mean ± sample std over seeds {report['seeds']} (deterministic methods run once, std 0). "
        f"Columns are unsafe categories and their mean. Bold: best unsupervised, underlined: second; "
        f"the supervised linear probe is a reference trained on unsafe labels and is excluded from the ranking.",
        "",
        *_table2(results, categories, "auroc", "AUROC"),
        "",
        *_table2(results, categories, "tpr_at_fpr", f"TPR@{fpr:.0%}FPR"),
        "",
        *(_table2(results, categories, "auroc_pooled", "AUROC, pooled negatives (test safe + benign OOD)") + [""]
          if "auroc_pooled" in next(iter(methods.values()))["test"]["mean"] else []),
        "## Operating point, benign OOD and selection",
        "",
        f"Benign-OOD FPR: fraction of benign-OOD rows flagged at the threshold that flags {fpr:.0%} of the test safe rows. "
        "Pooled AUROC: negatives are test safe + benign-OOD rows. FPR@95%TPR and pooled AUROC are category means.",
        "",
        "| Method | selected (validation) | val. AUROC | benign-OOD FPR | pooled AUROC | FPR@95%TPR | fit s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in methods.items():
        test = m["test"]
        ood = _pm(test["benign_ood_fpr"]) if "benign_ood_fpr" in test else "–"
        pooled = _pm(test["mean"]["auroc_pooled"]) if "auroc_pooled" in test["mean"] else "–"
        label = f"{name} (supervised)" if m["supervised"] else name
        lines.append(
            f"| {label} | {_settings(m['selected'])} | {m['selected_validation_auroc']:.3f} | {ood} | {pooled} | "
            f"{_pm(test['mean']['fpr_at_95tpr'])} | {m['fit_seconds']:.1f} |"
        )
    warned = [
        (name, m["test"]["benign_ood_fpr"][0])
        for name, m in methods.items()
        if "benign_ood_fpr" in m["test"] and benign_ood_warning(m["test"]["benign_ood_fpr"][0])
    ]
    if warned:
        lines += ["", f"> **Warning:** {', '.join(f'{name} flags {rate:.0%}' for name, rate in warned)} of benign "
                  f"out-of-distribution prompts at the {fpr:.0%}-safe-FPR threshold (more than "
                  f"{BENIGN_OOD_WARNING_FPR:.0%}). These scores measure how unlike the safe pool a prompt is; "
                  "calibrate per cluster (`hf-lsad calibrate`) or broaden the safe pool before deploying."]  # fmt: skip
    if results["ablations"]:
        lines += ["", "## Ablations", "", "One field of the selected configuration varied at a time; test metrics "
                  f"(seeds {report['ablation_seeds']}). They describe the design space and select nothing.", ""]  # fmt: skip
        for ablation in results["ablations"]:
            lines += [
                f"### {ablation['name']} ({ablation['method']}, `{ablation['key']}`; selected: {_settings(ablation['base'])})",
                "",
                "| value | val. AUROC | " + " | ".join(f"{c} AUROC" for c in categories) + " | mean AUROC | mean TPR@5%FPR |",
                "|---|---:|" + "---:|" * (len(categories) + 2),
            ]
            for row in ablation["rows"]:
                mark = " (selected)" if row["value"] == ablation["selected_value"] else ""
                cells = [f"{row['test'][c]['auroc'][0]:.3f}" for c in categories]
                lines.append(
                    f"| {row['value']}{mark} | {row['validation']['mean']['auroc'][0]:.3f} | " + " | ".join(cells)
                    + f" | {row['test']['mean']['auroc'][0]:.3f} | {row['test']['mean']['tpr_at_fpr'][0]:.3f} |"
                )
            lines.append("")
    for name, diag in results["diagnostics"].items():
        dims, occ = diag["effective_dimension"], diag["occupancy"]
        summary = dims["per_cluster_summary"]
        lines += [
            f"## Diagnostics: {name} ({_settings(diag['settings'])}, seed {diag['seed']})",
            "",
            f"Effective dimension d90 on the safe fit rows: raw SAE {dims['raw_sae']} (of {dims['raw_sae_dim']}), "
            f"global mask {dims['global_mask']} (k={dims['mask_size']}); per cluster (own top-k mask, clusters with "
            f">= {dims['per_cluster_min_size']} members: {dims['per_cluster_eligible']} of {dims['per_cluster_total']}): "
            + (f"median {summary['median']:.1f}, min {summary['min']:.0f}, max {summary['max']:.0f}." if summary["n"] else "no eligible cluster."),
            "",
            "| set | rows | TV distance to train occupancy | clusters holding half | empty clusters |",
            "|---|---:|---:|---:|---:|",
        ]
        for set_name, entry in occ["sets"].items():
            lines.append(f"| {set_name} | {entry['n']} | {entry['tv_to_reference']:.3f} | {entry['clusters_holding_half']} | {entry['empty_clusters']} |")
        if "support_overlap" in diag:
            overlap = diag["support_overlap"]
            counts, jac = overlap["counts"], overlap["jaccard_summary"]
            lines += [
                "",
                f"Within-cluster active support (features on > 50% of the population, restricted to the cluster's mask; "
                f"test safe vs pooled test unsafe, {overlap['clusters_compared']} clusters with both): both {counts['both']}, "
                f"safe only {counts['safe_only']}, unsafe only {counts['unsafe_only']}, neither {counts['neither']}; "
                + (f"Jaccard median {jac['median']:.2f} (min {jac['min']:.2f}, {jac['n']} clusters)." if jac["n"] else "no Jaccard defined."),
            ]
        if "threshold" in diag["scores"]:
            t = diag["scores"]["threshold"]
            lines += [
                "",
                f"Per-cluster scores (full summaries in results.json): of {t['clusters_eligible']} clusters with >= {t['min_safe']} "
                f"test safe rows, the global threshold {t['value']:.4g} is above every safe score in {t['above_every_safe_score']} "
                f"and below the median safe score in {t['below_median_safe_score']}.",
            ]
        lines.append("")
    lines += ["## Plots", "", report["plots"], "", "## Versions", ""]
    lines += [f"- {k}: {v}" for k, v in report["versions"].items()]
    if report.get("sae"):
        lines += ["", "## SAE", "", "```json", json.dumps(report["sae"], indent=2), "```"]
    return "\n".join(lines) + "\n"


PROTOCOL_TEXT = (
    "Safe rows are cut (seeded) into fit / validation / test ({fit:.0%} / {val:.0%} / {test:.0%}); each unsafe category "
    "into probe / validation / test ({probe:.0%} / {uval:.0%} / {utest:.0%}). The SAE and every detector are fitted on "
    "the safe fit rows only; the supervised linear probe also sees the unsafe *probe* rows. **Hyperparameters are selected "
    "on the validation split only**: for each method, the grid point with the highest AUROC of validation safe (negatives) "
    "vs validation unsafe (positives), averaged over categories and seeds. Test rows and benign-OOD rows select nothing. "
    "Benign-OOD rows are all used as test negatives."
)


def write_report(
    folder: str | os.PathLike,
    results: Mapping[str, Any],
    *,
    data: EvalData,
    config: GridConfig,
    command: str,
    title: str,
    sae_info: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``results.json``, ``report.md`` (and PNGs when matplotlib is installed) into ``folder``."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    splits = make_splits(len(data.safe), {c: len(x) for c, x in data.unsafe.items()}, config)
    plot_lines = []
    for name, diag in results["diagnostics"].items():
        written, reason = save_plots(diag, path / "plots" / name.lower().replace(" ", "-"))
        plot_lines.append(f"- {name}: " + (", ".join(f"`plots/{name.lower().replace(' ', '-')}/{w}`" for w in written) if written else reason))
    rows = {"safe fit": len(splits.safe_fit), "safe validation": len(splits.safe_validation), "safe test": len(splits.safe_test)}
    for category in data.unsafe:
        rows[f"{category} probe/val/test"] = "/".join(
            str(len(s[category])) for s in (splits.unsafe_probe, splits.unsafe_validation, splits.unsafe_test)
        )
    if data.benign_ood is not None:
        rows["benign_ood"] = len(data.benign_ood)
    utest = 1 - config.unsafe_probe_fraction - config.unsafe_validation_fraction
    report = {
        "title": title,
        "command": command,
        "hook": data.hook,
        "sources": data.sources,
        "categories": list(data.unsafe),
        "rows": rows,
        "seeds": config.seeds,
        "ablation_seeds": config.ablation_seeds or config.seeds[:1],
        "grid": dataclasses.asdict(config),
        "protocol": {
            "target_fpr": config.target_fpr,
            "text": PROTOCOL_TEXT.format(
                fit=1 - config.test_fraction - config.validation_fraction, val=config.validation_fraction,
                test=config.test_fraction, probe=config.unsafe_probe_fraction, uval=config.unsafe_validation_fraction, utest=utest,
            ),  # fmt: skip
        },
        "versions": package_versions(),
        "sae": dict(sae_info) if sae_info else None,
        "plots": "\n".join(plot_lines) or "no diagnostics, no plots",
        "results": results,
    }
    (path / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (path / "report.md").write_text(render_report(report))
    return path


def sae_summary(sae: SparseAutoencoder, data: EvalData, splits: Splits, info: Mapping[str, Any]) -> dict[str, Any]:
    """SAE width and its L0 / FVE / dead fraction on the fit and validation safe rows, with ``info``."""
    return {
        **info,
        "d_sae": sae.config.d_sae,
        "fit": sae_stats(sae, data.safe[splits.safe_fit])._asdict(),
        "validation": sae_stats(sae, data.safe[splits.safe_validation])._asdict(),
    }
