"""Diagnostics of a fitted FreqMask-KM detector (paper, section 5.4 and appendices).

:func:`freqmask_diagnostics` computes, for one detector, the measures of
:mod:`hf_lsad.evaluation.diagnostic_measures` (``d90``, cluster occupancy,
within-cluster active-support overlap, per-cluster score summaries; re-exported
here) and returns JSON-ready dicts of plain Python numbers.
:func:`save_plots` draws PNGs with matplotlib when it is installed (extra
``plots``) and otherwise returns the reason it drew nothing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..detectors.freqmask import FreqMaskKM
from ..detectors.masks import top_k_mask
from ..sae.model import SparseAutoencoder
from .diagnostic_measures import (
    VARIANCE_THRESHOLD,
    active_support_overlap,
    cluster_occupancy,
    cluster_score_summary,
    clusters_holding,
    effective_dimension,
    effective_dimensions,
    total_variation,
)

__all__ = [
    "VARIANCE_THRESHOLD",
    "active_support_overlap",
    "cluster_occupancy",
    "cluster_score_summary",
    "clusters_holding",
    "effective_dimension",
    "effective_dimensions",
    "freqmask_diagnostics",
    "plots_available",
    "save_plots",
    "total_variation",
]


@torch.no_grad()
def freqmask_diagnostics(
    detector: FreqMaskKM,
    sae: SparseAutoencoder,
    fit_activations: Tensor,
    sets: Mapping[str, Tensor],
    *,
    unsafe_sets: tuple[str, ...],
    safe_set: str = "safe_test",
    threshold: float | None = None,
) -> dict[str, Any]:
    """All diagnostics for one fitted FreqMask-KM detector.

    ``fit_activations`` are the safe rows it was fitted on (the ``train``
    occupancy and the ``d90`` data); ``sets`` maps names to held-out
    activations (``safe_set``, each unsafe category, ``benign_ood``);
    ``unsafe_sets`` names the unsafe ones, pooled for the support overlap.
    """
    config = detector.config
    fit_codes = sae.encode(fit_activations)
    fit_out = detector(fit_activations, sae)
    outputs = {name: detector(acts, sae) for name, acts in sets.items()}
    codes = {name: sae.encode(acts) for name, acts in sets.items()}
    n_clusters = config.kmeans.n_clusters
    pooled_frequency = (fit_codes > 0).float().mean(0)
    mask_size = config.mask_size
    global_mask = top_k_mask(pooled_frequency, mask_size)
    mask_indices = detector.mask_indices if config.use_mask else torch.arange(detector.d_sae).expand(n_clusters, -1)
    result: dict[str, Any] = {
        "effective_dimension": effective_dimensions(fit_codes, fit_out.clusters, global_mask, mask_size=mask_size),
        "occupancy": cluster_occupancy(
            {"train": fit_out.clusters, **{name: out.clusters for name, out in outputs.items()}}, n_clusters
        ),
        "scores": cluster_score_summary(
            {name: out.scores for name, out in outputs.items()},
            {name: out.clusters for name, out in outputs.items()},
            n_clusters,
            threshold=threshold,
            safe_set=safe_set,
        ),
    }
    present = [name for name in unsafe_sets if name in sets]
    if safe_set in sets and present:
        result["support_overlap"] = active_support_overlap(
            codes[safe_set],
            outputs[safe_set].clusters,
            torch.cat([codes[name] for name in present]),
            torch.cat([outputs[name].clusters for name in present]),
            mask_indices,
        )
        result["support_overlap"]["unsafe_sets"] = present
    return result


def plots_available() -> bool:
    """Whether matplotlib (the ``plots`` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def save_plots(diagnostics: Mapping[str, Any], folder: str | Path) -> tuple[list[str], str | None]:
    """Draw the occupancy histograms and the per-cluster ``d90`` histogram as PNGs in ``folder``.

    Returns ``(file names written, None)``, or ``([], reason)`` when matplotlib
    is not installed (``pip install 'hf-lsad[plots]'``).
    """
    if not plots_available():
        return [], "plots skipped: matplotlib is not installed (pip install 'hf-lsad[plots]')"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    written = []
    occupancy = diagnostics["occupancy"]
    train = occupancy["sets"][occupancy["reference"]]["occupancy"]
    others = [name for name in occupancy["sets"] if name != occupancy["reference"]]
    if others:
        fig, axes = plt.subplots(len(others), 1, figsize=(8, 2.2 * len(others)), sharex=True, squeeze=False)
        xs = range(len(train))
        for ax, name in zip(axes[:, 0], others):
            entry = occupancy["sets"][name]
            ax.bar(xs, train, color="lightblue", label="safe train")
            ax.bar(xs, entry["occupancy"], color="tab:red", alpha=0.6, label=name)
            ax.set_ylabel("fraction")
            ax.set_title(f"{name} (n={entry['n']}): TV to train = {entry['tv_to_reference']:.3f}", fontsize=9)
            ax.legend(fontsize=7)
        axes[-1, 0].set_xlabel("cluster")
        fig.tight_layout()
        fig.savefig(path / "occupancy.png", dpi=120)
        plt.close(fig)
        written.append("occupancy.png")
    dims = diagnostics["effective_dimension"]
    fig, ax = plt.subplots(figsize=(6, 3))
    values = list(dims["per_cluster"].values())
    if values:
        ax.hist(values, bins=min(20, max(1, len(set(values)))), color="tab:blue", label="per cluster (own mask)")
    ax.axvline(dims["raw_sae"], color="tab:orange", linestyle="--", label=f"raw SAE ({dims['raw_sae']})")
    ax.axvline(dims["global_mask"], color="tab:green", label=f"global mask ({dims['global_mask']})")
    ax.set_xlabel("d90")
    ax.set_ylabel("clusters")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path / "effective_dimension.png", dpi=120)
    plt.close(fig)
    written.append("effective_dimension.png")
    return written, None
