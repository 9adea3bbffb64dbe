"""Evaluation: the protocol (splits, metrics of a detector or a guard, calibration), method grids, reports.

- :mod:`.protocol`: the splits, fitting on them, :func:`~.protocol.evaluate_detector`,
  :func:`~.protocol.evaluate_guard` and :func:`~.protocol.calibrate_guard`;
- :mod:`.grid`: method grids with selection on validation (:func:`~.grid.run_grid`);
- :mod:`.report`: the report folder (:func:`~.report.write_report`);
- :mod:`.sae_cache`: the evaluation's SAE, trained once on the fit split;
- :mod:`.diagnostics`: FreqMask-KM diagnostics and plots (the measures: :mod:`.diagnostic_measures`);
- :mod:`.evaluate_metric`: the metrics as an ``evaluate`` metric (imported on demand).
"""

from .grid import AblationSpec, GridConfig, MethodSpec, aggregate, build_config, default_grid, grid_points, run_grid
from .protocol import (
    EvalData,
    Splits,
    calibrate_guard,
    evaluate_detector,
    evaluate_guard,
    fit_detector,
    held_out_safe,
    load_eval_data,
    make_splits,
)
from .report import package_versions, render_report, write_report
from .sae_cache import SAE_TRAINING_FILE, load_or_train_sae, sae_summary

__all__ = [
    "SAE_TRAINING_FILE",
    "AblationSpec",
    "EvalData",
    "GridConfig",
    "MethodSpec",
    "Splits",
    "aggregate",
    "build_config",
    "calibrate_guard",
    "default_grid",
    "evaluate_detector",
    "evaluate_guard",
    "fit_detector",
    "grid_points",
    "held_out_safe",
    "load_eval_data",
    "load_or_train_sae",
    "make_splits",
    "package_versions",
    "render_report",
    "run_grid",
    "sae_summary",
    "write_report",
]
