"""Degenerate fits say so, with the number: an SAE that explains little variance, clusters too small.

Both finish without an error (a small or odd data set may still be what the user wants),
but warn with :class:`~hf_lsad.errors.DegenerateFitWarning`, which can be turned into an
error with ``warnings.simplefilter("error", DegenerateFitWarning)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DegenerateFitWarning, warn

MIN_FRACTION_VARIANCE_EXPLAINED = 0.5
"""An SAE whose reconstructions explain less of the training variance than this is not a usable dictionary
(the SAEs in the paper explain well above 0.7; a broken one goes negative)."""

MIN_CLUSTER_ROWS = 10
"""Fewest rows per cluster for a centroid and activation frequencies that mean something."""


def check_sae_fit(fraction_variance_explained: float, *, n_rows: int) -> None:
    """Warn when an SAE explains less than :data:`MIN_FRACTION_VARIANCE_EXPLAINED` of its training data's variance."""
    if not fraction_variance_explained >= MIN_FRACTION_VARIANCE_EXPLAINED:  # also catches NaN
        warn(
            f"the trained SAE explains {fraction_variance_explained:.3f} of the variance of its {n_rows} training "
            f"activations, below {MIN_FRACTION_VARIANCE_EXPLAINED}: its codes are a poor basis for a detector "
            "(lower the L1 coefficient, train longer, or widen it)",
            DegenerateFitWarning,
        )


def check_cluster_sizes(sizes: Sequence[int], *, min_rows: int, why: str) -> None:
    """Warn when a non-empty cluster has fewer than ``min_rows`` rows, or a cluster is empty."""
    small = [(c, n) for c, n in enumerate(sizes) if n < min_rows]
    if not small:
        return
    empty = sum(n == 0 for _, n in small)
    warn(
        f"{len(small)} of {len(sizes)} cluster(s) with fewer than {min_rows} rows ({why}); smallest: "
        f"{min(n for _, n in small)} rows{f', {empty} empty' if empty else ''}; clusters {[c for c, _ in small][:10]}"
        f"{'...' if len(small) > 10 else ''}. Fit on more rows or use fewer clusters",
        DegenerateFitWarning,
    )
