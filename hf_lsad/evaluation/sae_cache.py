"""The SAE of an evaluation: trained once on the safe fit split and cached in a folder with its provenance."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from ..core.serialization import config_to_dict, read_json, write_json
from ..sae.model import SparseAutoencoder
from ..sae.training import SAETrainConfig, sae_stats, train_sae
from .protocol import EvalData, Splits

SAE_TRAINING_FILE = "training.json"
"""Written next to an SAE trained by :func:`load_or_train_sae`: the split and settings it was trained on."""


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
                raise ValueError(
                    f"{path} was trained on other safe rows than this split's fit rows; use another folder"
                )
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
    write_json(
        path / SAE_TRAINING_FILE, {"training": config_to_dict(training), "fit_rows": rows, "train_seconds": seconds}
    )
    return sae, {
        "path": str(path),
        "trained_here": True,
        "training": config_to_dict(training),
        "train_seconds": seconds,
    }


def sae_summary(sae: SparseAutoencoder, data: EvalData, splits: Splits, info: Mapping[str, Any]) -> dict[str, Any]:
    """SAE width and its L0 / FVE / dead fraction on the fit and validation safe rows, with ``info``."""
    return {
        **info,
        "d_sae": sae.config.d_sae,
        "fit": sae_stats(sae, data.safe[splits.safe_fit])._asdict(),
        "validation": sae_stats(sae, data.safe[splits.safe_validation])._asdict(),
    }
