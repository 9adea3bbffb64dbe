"""LearnedMask-LoRA (paper, Algorithm 2; appendices "Framework instantiations" and "Ablations for LearnedMask-LoRA").

Fit on safe activations ``a`` with SAE ``(E, D)``: k-means on the SAE codes
``z = E(a)`` into K clusters (as FreqMask-KM), then per cluster ``c``: **Stage 1**, a
sparse feature mask ``m_c`` (its ``lambda`` picked on held-out members), and **Stage 2**,
peft LoRA adapters ``E_c = E + dE_c``, ``D_c = D + dD_c`` with the mask fixed; both are
described in :mod:`hf_lsad.detectors.learned_mask.training`. The settings and fitted state
are in :mod:`hf_lsad.detectors.learned_mask.config` and importable from here.

Clusters smaller than ``min_cluster_size`` keep the base SAE (no mask, no
adapter); clusters smaller than ``lora_min_cluster_size`` (or all, with
``stage1_only``) keep their mask without an adapter. What each cluster got is
recorded in the detector's fitted state (:class:`LearnedMaskState`: ``cluster_stages``,
``cluster_ranks``, ``cluster_lambdas``), saved with the config in the guard's ``config.json``.

**Scoring.** A row is assigned to its nearest centroid ``c`` in base SAE code
space and its residual ``r = a - D_c(m_c * E_c(a))`` is scored by

- ``whitened_l2`` (default): ``||(r - mu_c) / sqrt((1 - alpha) v_c + alpha v + eps)||_2``,
  where ``mu_c`` and ``v_c`` are the per-dimension mean and (population)
  variance of the fit residuals of cluster ``c``, ``v`` the per-dimension
  variance of all fit residuals pooled, ``alpha = shrinkage`` (0.3) and
  ``eps = 1e-6 * mean(v)`` keeps constant dimensions finite;
- ``mahalanobis`` (ablation): ``sqrt((r - mu_c)^T (S_c + ridge I)^-1 (r - mu_c))``
  with ``S_c`` the cluster's residual covariance.

Adapters are kept as stacked, rank-padded tensors (zero rows/columns add
nothing) so a batch mixing clusters is scored in one call: rows are gathered
by cluster id and each adapted cluster's rows go through its own factors. This
was faster than peft's mixed-adapter batches (``adapter_names=``), see
``benchmarks/perf/learned_mask_inference.py`` and its results file. :meth:`LearnedMaskLoRA.peft_model`
and :meth:`LearnedMaskLoRA.save_peft_adapters` give the same adapters as peft
objects and peft folders.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ...sae.model import SparseAutoencoder
from ..base import Detector, DetectorOutput, register_detector
from ..clustering import assign_clusters, cluster_space, fit_kmeans
from ..scores import check_precision_size, mahalanobis, ridge_precision, scaled_norm
from .config import (
    BASE_SAE,
    MASK_AND_LORA,
    MASK_ONLY,
    LearnedMaskConfig,
    LearnedMaskState,
)
from .training import (
    LORA_FACTORS,
    adapter_name,
    add_adapter,
    fit_lora,
    fit_mask,
    lora_layers,
    lora_ranks,
    peft_sae,
)

if TYPE_CHECKING:  # peft imports transformers: loaded only when Stage 2 or the peft views run
    from peft import PeftModel

__all__ = ["LearnedMaskLoRA"]


@register_detector
class LearnedMaskLoRA(Detector):
    """Per-cluster learned masks and LoRA-adapted SAEs, scored by the whitened reconstruction residual."""

    method = "learned-mask-lora"
    config_class = LearnedMaskConfig
    state_class = LearnedMaskState
    config: LearnedMaskConfig
    state: LearnedMaskState
    d_sae: int  # the base class refuses None for a method that reads SAE codes

    centroids: Tensor  # [k, d_sae] member means in the clustering space
    cluster_sizes: Tensor  # [k] long
    masks: Tensor  # [k, d_sae] learned masks (ones for a cluster on the base SAE)
    encoder_lora_A: Tensor  # [k, rank, d_in]
    encoder_lora_B: Tensor  # [k, rank, d_sae]
    decoder_lora_A: Tensor  # [k, rank, d_sae]
    decoder_lora_B: Tensor  # [k, rank, d_in]
    residual_mean: Tensor  # [k, d_in]
    residual_scale: Tensor  # [k, d_in] (whitened_l2 only)
    precision: Tensor  # [k, d_in, d_in] (mahalanobis only)

    def __init__(
        self, config: LearnedMaskConfig, d_in: int, d_sae: int | None, state: LearnedMaskState | None = None
    ) -> None:
        super().__init__(config, d_in, d_sae, state)
        d_sae = self.d_sae
        self.state.check(config)
        k, rank = config.kmeans.n_clusters, max(config.lora_ranks)
        if config.score_metric == "mahalanobis":
            check_precision_size(k, d_in, "dimensions")
        self.register_buffer("centroids", torch.zeros(k, d_sae))
        self.register_buffer("cluster_sizes", torch.zeros(k, dtype=torch.long))
        self.register_buffer("masks", torch.ones(k, d_sae))
        # Stacked adapters, zero-padded to the largest rank; B factors carry the LoRA scaling.
        self.register_buffer("encoder_lora_A", torch.zeros(k, rank, d_in))
        self.register_buffer("encoder_lora_B", torch.zeros(k, rank, d_sae))
        self.register_buffer("decoder_lora_A", torch.zeros(k, rank, d_sae))
        self.register_buffer("decoder_lora_B", torch.zeros(k, rank, d_in))
        self.register_buffer("residual_mean", torch.zeros(k, d_in))
        if config.score_metric == "whitened_l2":
            self.register_buffer("residual_scale", torch.ones(k, d_in))
        else:
            self.register_buffer("precision", torch.zeros(k, d_in, d_in))

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` ran (or a fitted detector was loaded): the clusters have their stages."""
        return bool(self.state.cluster_stages)

    @property
    def n_clusters(self) -> int:
        return self.config.kmeans.n_clusters

    def fit(self, activations: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True) -> None:
        config = self.config
        sae = _require_sae(sae)
        with torch.no_grad():
            codes = sae.encode(activations)
            space = cluster_space(codes, config.kmeans.metric)
            members = assign_clusters(space, fit_kmeans(space, config.kmeans), config.kmeans.metric)
            k = config.kmeans.n_clusters
            sizes = torch.bincount(members, minlength=k)
            one_hot = torch.nn.functional.one_hot(members, k).to(space.dtype)
            # Centroids in the clustering space: member means (binarised means = frequencies for hamming).
            self.centroids.copy_(one_hot.T @ space / sizes.clamp_min(1).unsqueeze(1))
            self.cluster_sizes.copy_(sizes)
            self.masks.fill_(1.0)
            for name in LORA_FACTORS:
                getattr(self, name).zero_()

        stages = [MASK_ONLY if n >= config.min_cluster_size else BASE_SAE for n in sizes.tolist()]
        lambdas = [0.0] * k
        ranks = lora_ranks(config, sizes.tolist(), stages)
        with torch.enable_grad():  # fit may be called under no_grad; both stages train by gradient
            for c in tqdm(range(k), desc="stage 1 masks", disable=not progress):
                if stages[c] == MASK_ONLY:
                    index = (members == c).nonzero().squeeze(1)
                    lambdas[c], mask = fit_mask(config, activations[index], codes[index], sae, c)
                    with torch.no_grad():
                        self.masks[c] = mask
            lora_clusters = [c for c in range(k) if ranks[c] > 0]
            if lora_clusters:
                model = peft_sae(sae)
                for c in tqdm(lora_clusters, desc="stage 2 LoRA", disable=not progress):
                    factors = fit_lora(config, model, activations[members == c], self.masks[c], c, ranks[c])
                    with torch.no_grad():
                        for name, factor in factors.items():
                            getattr(self, name)[c, : ranks[c]] = factor
                    stages[c] = MASK_AND_LORA
        self.state = LearnedMaskState(cluster_stages=stages, cluster_ranks=ranks, cluster_lambdas=lambdas)
        with torch.no_grad():
            self._fit_residual_statistics(activations - self.reconstruct(activations, sae, members), members)

    def forward(self, activations: Tensor, sae: SparseAutoencoder | None) -> DetectorOutput:
        if not self.fitted:
            raise RuntimeError("LearnedMaskLoRA is not fitted: call fit() or load a saved guard")
        sae = _require_sae(sae)
        metric = self.config.kmeans.metric
        pre = sae.encoder(activations)  # shared by the cluster assignment and the reconstruction
        clusters = assign_clusters(cluster_space(sae.activate(pre), metric), self.centroids, metric)
        diff = activations - self._reconstruct(activations, sae, clusters, pre) - self.residual_mean[clusters]
        if self.config.score_metric == "whitened_l2":
            scores = scaled_norm(diff, self.residual_scale[clusters])
        else:
            scores = mahalanobis(diff, self.precision[clusters])
        return DetectorOutput(scores, clusters)

    def reconstruct(self, activations: Tensor, sae: SparseAutoencoder, clusters: Tensor) -> Tensor:
        """``D_c(m_c * E_c(a))`` for each row under its given cluster, all clusters in one pass."""
        return self._reconstruct(activations, sae, clusters, sae.encoder(activations))

    def _reconstruct(self, activations: Tensor, sae: SparseAutoencoder, clusters: Tensor, pre: Tensor) -> Tensor:
        groups = _adapter_groups(clusters, self.state.cluster_ranks)
        if groups:
            pre = pre + _stacked_lora(activations, self.encoder_lora_A, self.encoder_lora_B, groups)
        masked = sae.activate(pre) * self.masks[clusters]
        reconstruction = sae.decoder(masked)
        if groups:
            reconstruction = reconstruction + _stacked_lora(masked, self.decoder_lora_A, self.decoder_lora_B, groups)
        return reconstruction

    def peft_model(self, sae: SparseAutoencoder) -> PeftModel:
        """A peft model of a copy of ``sae`` with one adapter ``cluster_{c}`` per adapted cluster.

        Its forward is ``model(activations, masks)`` (``masks``: ``[batch, d_sae]``, the rows'
        cluster masks) and accepts peft's ``adapter_names=[...]`` for mixed-cluster batches
        (``"__base__"`` for clusters without an adapter); without it, the first adapter is active.
        """
        adapted = [c for c, r in enumerate(self.state.cluster_ranks) if r > 0]
        if not adapted:
            raise ValueError("this detector has no LoRA adapters (stage1_only or all clusters too small)")
        model = peft_sae(sae)
        for c in adapted:
            add_adapter(model, c, self.state.cluster_ranks[c], self.config.seed)
            layers = lora_layers(model)
            rank = self.state.cluster_ranks[c]
            name = adapter_name(c)
            with torch.no_grad():
                layers["encoder"].lora_A[name].weight.copy_(self.encoder_lora_A[c, :rank])
                layers["encoder"].lora_B[name].weight.copy_(self.encoder_lora_B[c, :rank].T)
                layers["decoder"].lora_A[name].weight.copy_(self.decoder_lora_A[c, :rank])
                layers["decoder"].lora_B[name].weight.copy_(self.decoder_lora_B[c, :rank].T)
        model.set_adapter(adapter_name(adapted[0]))  # peft needs an active adapter; adapter_names overrides it
        return model.eval()

    def save_peft_adapters(self, save_directory: str | os.PathLike, sae: SparseAutoencoder) -> list[Path]:
        """Write each adapter as a peft folder ``cluster_{c}/`` (adapter_config.json + adapter_model.safetensors).

        ``PeftModel.from_pretrained(base, folder)`` loads one back onto a module with
        ``encoder``/``decoder`` linear layers; the guard itself keeps the stacked tensors.
        """
        model = self.peft_model(sae)
        names = [name for name in model.peft_config]
        model.save_pretrained(str(save_directory), selected_adapters=names)
        return [Path(save_directory) / name for name in names]

    # --- scoring statistics --------------------------------------------------------------

    def _fit_residual_statistics(self, residuals: Tensor, members: Tensor) -> None:
        k = self.config.kmeans.n_clusters
        one_hot = torch.nn.functional.one_hot(members, k).to(residuals.dtype)
        counts = one_hot.sum(0).clamp_min(1).unsqueeze(1)
        means = one_hot.T @ residuals / counts
        self.residual_mean.copy_(means)
        centred = residuals - means[members]
        if self.config.score_metric == "whitened_l2":
            pooled = centred.pow(2).mean(0)
            # An empty cluster has no variance of its own: it uses the pooled one.
            own = torch.where(one_hot.sum(0).unsqueeze(1) > 0, one_hot.T @ centred.pow(2) / counts, pooled)
            alpha = self.config.shrinkage
            variance = (1 - alpha) * own + alpha * pooled + 1e-6 * pooled.mean()
            self.residual_scale.copy_(variance.sqrt())
        else:
            for c in range(k):
                diff = centred[members == c]
                self.precision[c] = ridge_precision(diff.T @ diff / max(len(diff), 1), self.config.ridge)


def _adapter_groups(clusters: Tensor, ranks: list[int]) -> list[tuple[int, int, Tensor]]:
    """``(cluster, rank, row indices)`` for each adapted cluster present in the batch."""
    order = torch.argsort(clusters, stable=True)
    present, counts = torch.unique_consecutive(clusters[order], return_counts=True)
    groups = []
    for cluster, rows in zip(present.tolist(), torch.split(order, counts.tolist())):
        if ranks[cluster] > 0:
            groups.append((cluster, ranks[cluster], rows))
    return groups


def _stacked_lora(inputs: Tensor, lora_a: Tensor, lora_b: Tensor, groups: list[tuple[int, int, Tensor]]) -> Tensor:
    """``B_c A_c x`` per row for its cluster ``c`` (zero for clusters without an adapter).

    ``A`` is ``[K, r, d_in]`` and ``B`` ``[K, r, d_out]``. Rows are gathered by cluster id and
    each cluster's rows go through its own rank-``r_c`` factors. Against a dense matmul over
    all stacked factors, per-row gathered factors and peft's ``adapter_names`` batches this was
    the fastest on mixed batches of 16 rows and more, and within 0.4 ms of the fastest (per-row
    gather) on one row (``benchmarks/perf/learned_mask_inference.py``).
    """
    out = inputs.new_zeros(len(inputs), lora_b.shape[-1])
    for cluster, rank, rows in groups:
        out[rows] = (inputs[rows] @ lora_a[cluster, :rank].T) @ lora_b[cluster, :rank]
    return out


def _require_sae(sae: SparseAutoencoder | None) -> SparseAutoencoder:
    if sae is None:
        raise ValueError("LearnedMask-LoRA reconstructs through the SAE: the guard has no SAE")
    return sae
