"""LearnedMask-LoRA (paper, Algorithm 2; appendices "Framework instantiations" and "Ablations for LearnedMask-LoRA").

Fit on safe activations ``a`` with SAE ``(E, D)``: k-means on the SAE codes
``z = E(a)`` into K clusters (as FreqMask-KM), then per cluster ``c``:

**Stage 1, mask.** Logits ``l_c`` (one per SAE feature, initialised at
``logit_init = 0.5``, i.e. every feature on) are trained to minimise
``mean_{a in C_c} ||a - D(m_c * E(a))||^2 + lambda * ||sigmoid(l_c)||_1``. The
binary mask is ``m_c = 1[l_c > 0]`` in the forward pass with the gradient of
``sigmoid(l_c)`` in the backward pass (:func:`straight_through_mask`); the
continuous-mask ablation uses ``m_c = sigmoid(l_c)`` throughout. With ``E`` and
``D`` frozen the loss is a quadratic in ``m_c`` whose coefficients are cluster
statistics (:class:`_ClusterQuadratic`), so Stage 1 runs full-batch and exact.

``lambda`` is chosen per cluster from ``lambdas`` (the paper's sweep) by this
rule: the cluster's members are split (seeded) into a training part and a
validation part of ``validation_fraction``; one mask is trained per ``lambda``
on the training part; the selected ``lambda`` is the **largest** whose mean
validation reconstruction error is at most ``(1 + lambda_tolerance)`` times the
smallest validation error over the sweep (the sparsest mask that reconstructs
held-out safe members almost as well as the best). The final mask is then
retrained with that ``lambda`` on all of the cluster's members.

**Stage 2, LoRA.** With the mask fixed, peft LoRA adapters
(``LoraConfig(target_modules=["encoder", "decoder"])``) are trained on the
cluster: ``E_c = E + dE_c``, ``D_c = D + dD_c``, minimising
``mean ||a - D_c(m_c * E_c(a))||^2 + lora_sparsity * mean(|dE_c a|_1 + |dD_c(m_c z_c)|_1)``
with Adam for ``lora_epochs`` at ``lora_lr``. The rank is 2/4/8 for the
small/medium/large third of the Stage-2 clusters by size (``lora_ranks``);
``lora_alpha`` equals the rank so the update is never rescaled.

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
``benchmarks/learned_mask_inference.py`` and its results file. :meth:`LearnedMaskLoRA.peft_model`
and :meth:`LearnedMaskLoRA.save_peft_adapters` give the same adapters as peft
objects and peft folders.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..clustering import KMeansConfig, assign_clusters, cluster_space, fit_kmeans
from ..masks import straight_through_mask
from ..sae import SparseAutoencoder
from ..scores import check_precision_size, mahalanobis, ridge_precision, scaled_norm
from .base import Detector, DetectorConfig, DetectorOutput, register_detector

if TYPE_CHECKING:  # peft imports transformers: loaded only when Stage 2 or the peft views run
    from peft import PeftModel

LAMBDA_SWEEP = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
"""The paper's per-cluster sparsity sweep for Stage 1."""

MaskType = Literal["binary", "continuous"]
ResidualScore = Literal["whitened_l2", "mahalanobis"]
MASK_TYPES = get_args(MaskType)
SCORE_METRICS = get_args(ResidualScore)
BASE_SAE, MASK_ONLY, MASK_AND_LORA = 0, 1, 2
"""Values of ``cluster_stages``: what a cluster was fitted with."""


@dataclass
class LearnedMaskConfig(DetectorConfig):
    """Settings of LearnedMask-LoRA."""

    kmeans: KMeansConfig = field(default_factory=lambda: KMeansConfig(n_clusters=100))
    """Clustering of the safe codes (the paper uses K=100, L2)."""

    mask_type: MaskType = "binary"
    """``binary`` (hard mask, straight-through gradient) or ``continuous`` (sigmoid mask, ablation)."""

    lambdas: list[float] = field(default_factory=lambda: list(LAMBDA_SWEEP))
    """Stage-1 sparsity weights swept per cluster."""

    lambda_tolerance: float = 0.05
    """Relative slack on held-out reconstruction error when picking the sparsest ``lambda``."""

    validation_fraction: float = 0.2
    """Share of a cluster's members held out to select ``lambda``."""

    logit_init: float = 0.5
    """Initial mask logit of every feature (sigmoid 0.62, hard mask all on)."""

    stage1_steps: int = 300
    """Full-batch Adam steps per Stage-1 mask."""

    stage1_lr: float = 0.05
    """Adam learning rate on the mask logits."""

    min_cluster_size: int = 50
    """Clusters with fewer fit members keep the base SAE (paper: 50)."""

    stage1_only: bool = False
    """Skip Stage 2 (the paper's setting for Qwen 1.5B and GPT-oss)."""

    lora_min_cluster_size: int = 50
    """Clusters with fewer fit members get no LoRA adapter (paper: 20 to 500 by model)."""

    lora_ranks: list[int] = field(default_factory=lambda: [2, 4, 8])
    """LoRA ranks of the small, medium and large third of the Stage-2 clusters by size."""

    lora_epochs: int = 30
    """Passes over a cluster's members in Stage 2."""

    lora_lr: float = 1e-3
    """Adam learning rate of the adapters."""

    lora_sparsity: float = 1e-3
    """Weight of the L1 penalty on the adapters' outputs."""

    lora_batch_size: int = 32
    """Members per Stage-2 step."""

    score_metric: ResidualScore = "whitened_l2"
    """``whitened_l2`` (default) or ``mahalanobis`` (ablation) on the reconstruction residual."""

    shrinkage: float = 0.3
    """alpha: weight of the pooled residual variance in the whitening."""

    ridge: float = 1.0
    """Ridge added to each residual covariance before inversion (``mahalanobis`` only)."""

    seed: int = 0
    """Seed of the validation splits, LoRA initialisation and Stage-2 shuffling."""

    def __post_init__(self) -> None:
        if self.mask_type not in MASK_TYPES:
            raise ValueError(f"mask_type must be one of {MASK_TYPES}, got {self.mask_type!r}")
        if self.score_metric not in SCORE_METRICS:
            raise ValueError(f"score_metric must be one of {SCORE_METRICS}, got {self.score_metric!r}")
        if not self.lambdas or any(lam < 0 for lam in self.lambdas):
            raise ValueError(f"lambdas must be a non-empty list of non-negative weights, got {self.lambdas}")
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if self.lambda_tolerance < 0:
            raise ValueError(f"lambda_tolerance must be >= 0, got {self.lambda_tolerance}")
        if self.min_cluster_size < 2:
            raise ValueError(
                f"min_cluster_size must be >= 2 (a mask needs a validation member), got {self.min_cluster_size}"
            )
        if self.lora_min_cluster_size < 1:
            raise ValueError(f"lora_min_cluster_size must be >= 1, got {self.lora_min_cluster_size}")
        if len(self.lora_ranks) != 3 or any(r < 1 for r in self.lora_ranks):
            raise ValueError(f"lora_ranks must be three positive ranks (small, medium, large), got {self.lora_ranks}")
        for name in ("stage1_steps", "lora_epochs", "lora_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("stage1_lr", "lora_lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.lora_sparsity < 0:
            raise ValueError(f"lora_sparsity must be >= 0, got {self.lora_sparsity}")
        if not 0.0 <= self.shrinkage <= 1.0:
            raise ValueError(f"shrinkage must be in [0, 1], got {self.shrinkage}")
        if self.score_metric == "mahalanobis" and self.ridge <= 0:
            raise ValueError(f"ridge must be > 0 for Mahalanobis scoring, got {self.ridge}")


@dataclass
class LearnedMaskState:
    """What :meth:`LearnedMaskLoRA.fit` chose per cluster (empty lists: not fitted)."""

    cluster_stages: list[int] = field(default_factory=list)
    """Per cluster: 0 base SAE (too small), 1 mask only, 2 mask and LoRA."""

    cluster_ranks: list[int] = field(default_factory=list)
    """Per cluster: LoRA rank (0 without an adapter)."""

    cluster_lambdas: list[float] = field(default_factory=list)
    """Per cluster: selected Stage-1 ``lambda`` (0.0 for base-SAE clusters)."""

    def check(self, config: LearnedMaskConfig) -> None:
        """``ValueError`` unless this state fits ``config`` (one entry per cluster, known stages, ranks in range)."""
        k = config.kmeans.n_clusters
        fitted = (self.cluster_stages, self.cluster_ranks, self.cluster_lambdas)
        if any(fitted) and any(len(values) != k for values in fitted):
            raise ValueError(f"cluster_stages, cluster_ranks and cluster_lambdas need one entry per cluster ({k})")
        if any(s not in (BASE_SAE, MASK_ONLY, MASK_AND_LORA) for s in self.cluster_stages):
            raise ValueError(f"cluster_stages must hold 0, 1 or 2, got {self.cluster_stages}")
        if any(r < 0 or r > max(config.lora_ranks) for r in self.cluster_ranks):
            raise ValueError(f"cluster_ranks must be in [0, {max(config.lora_ranks)}], got {self.cluster_ranks}")


@register_detector
class LearnedMaskLoRA(Detector):
    """Per-cluster learned masks and LoRA-adapted SAEs, scored by the whitened reconstruction residual."""

    method = "learned-mask-lora"
    config_class = LearnedMaskConfig
    state_class = LearnedMaskState

    def __init__(self, config: LearnedMaskConfig, d_in: int, d_sae: int | None, state: LearnedMaskState | None = None) -> None:
        super().__init__(config, d_in, d_sae, state)
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
            for name in ("encoder_lora_A", "encoder_lora_B", "decoder_lora_A", "decoder_lora_B"):
                getattr(self, name).zero_()

        stages = [MASK_ONLY if n >= config.min_cluster_size else BASE_SAE for n in sizes.tolist()]
        lambdas = [0.0] * k
        ranks = self._lora_ranks(sizes.tolist(), stages)
        with torch.enable_grad():  # fit may be called under no_grad; both stages train by gradient
            for c in tqdm(range(k), desc="stage 1 masks", disable=not progress):
                if stages[c] == MASK_ONLY:
                    index = (members == c).nonzero().squeeze(1)
                    lambdas[c], mask = self._fit_mask(activations[index], codes[index], sae, c)
                    with torch.no_grad():
                        self.masks[c] = mask
            lora_clusters = [c for c in range(k) if ranks[c] > 0]
            if lora_clusters:
                peft_sae = _peft_sae(sae)
                for c in tqdm(lora_clusters, desc="stage 2 LoRA", disable=not progress):
                    self._fit_lora(peft_sae, activations[members == c], c, ranks[c])
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
        clusters = assign_clusters(cluster_space(torch.relu(pre), metric), self.centroids, metric)
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
        masked = torch.relu(pre) * self.masks[clusters]
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
        model = _peft_sae(sae)
        for c in adapted:
            self._add_adapter(model, c, self.state.cluster_ranks[c])
            layers = _lora_layers(model)
            rank = self.state.cluster_ranks[c]
            name = _adapter_name(c)
            with torch.no_grad():
                layers["encoder"].lora_A[name].weight.copy_(self.encoder_lora_A[c, :rank])
                layers["encoder"].lora_B[name].weight.copy_(self.encoder_lora_B[c, :rank].T)
                layers["decoder"].lora_A[name].weight.copy_(self.decoder_lora_A[c, :rank])
                layers["decoder"].lora_B[name].weight.copy_(self.decoder_lora_B[c, :rank].T)
        model.set_adapter(_adapter_name(adapted[0]))  # peft needs an active adapter; adapter_names overrides it
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

    # --- Stage 1 -------------------------------------------------------------------------

    def _fit_mask(
        self, activations: Tensor, codes: Tensor, sae: SparseAutoencoder, cluster: int
    ) -> tuple[float, Tensor]:
        config = self.config
        n = len(activations)
        generator = torch.Generator().manual_seed(config.seed * 100_003 + cluster)
        order = torch.randperm(n, generator=generator).to(activations.device)
        n_val = max(1, round(n * config.validation_fraction))
        train, val = order[n_val:], order[:n_val]
        lambdas = torch.tensor(config.lambdas, dtype=activations.dtype, device=activations.device)
        masks = self._train_masks(_ClusterQuadratic(activations[train], codes[train], sae), lambdas)
        with torch.no_grad():
            target = activations[val] - sae.decoder.bias
            errors = torch.stack(
                [(target - (codes[val] * m) @ sae.decoder.weight.T).pow(2).sum(-1).mean() for m in masks]
            )
        acceptable = (errors <= errors.min() * (1.0 + config.lambda_tolerance)).nonzero().squeeze(1)
        chosen = max(acceptable.tolist(), key=lambda i: (config.lambdas[i], -i))
        final = self._train_masks(_ClusterQuadratic(activations, codes, sae), lambdas[chosen : chosen + 1])
        return config.lambdas[chosen], final[0]

    def _train_masks(self, quadratic: _ClusterQuadratic, lambdas: Tensor) -> Tensor:
        """One mask per ``lambda`` (``[L, d_sae]``), trained jointly: each row's loss involves its own logits only.

        Returns, per ``lambda``, the visited mask with the lowest Stage-1 objective
        ``L_rec(m) + lambda ||m||_1``: the straight-through gradient of a feature that is on
        is only its residual correlation, so needed features oscillate around logit 0 and
        the last iterate alone would be arbitrary.
        """
        shape = (len(lambdas), self.d_sae)
        logits = torch.full(shape, self.config.logit_init, device=lambdas.device, requires_grad=True)
        optimizer = torch.optim.Adam([logits], lr=self.config.stage1_lr)
        mask_of = straight_through_mask if self.config.mask_type == "binary" else torch.sigmoid
        best = torch.full_like(lambdas, float("inf"))
        best_masks = torch.zeros(len(lambdas), self.d_sae, device=lambdas.device)

        def visit() -> Tensor:
            nonlocal best
            masks = mask_of(logits)
            reconstruction = quadratic(masks)
            with torch.no_grad():
                # Store the exact hard mask: soft + (hard - soft) can be off by an ulp.
                kept = (logits > 0).to(masks.dtype) if self.config.mask_type == "binary" else masks
                objective = reconstruction + lambdas * kept.sum(-1)
                better = objective < best
                best = torch.where(better, objective, best)
                best_masks[better] = kept[better]
            return reconstruction

        for _ in range(self.config.stage1_steps):
            loss = (visit() + lambdas * torch.sigmoid(logits).sum(-1)).sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            visit()  # the final iterate is a candidate too
        return best_masks

    # --- Stage 2 -------------------------------------------------------------------------

    def _lora_ranks(self, sizes: list[int], stages: list[int]) -> list[int]:
        config = self.config
        eligible = [] if config.stage1_only else [
            c for c, (n, s) in enumerate(zip(sizes, stages)) if s == MASK_ONLY and n >= config.lora_min_cluster_size
        ]
        ranks = [0] * len(sizes)
        if eligible:
            # Small / medium / large = size terciles of the Stage-2 clusters (ties share a rank).
            cuts = torch.quantile(torch.tensor([float(sizes[c]) for c in eligible]), torch.tensor([1 / 3, 2 / 3]))
            for c in eligible:
                ranks[c] = config.lora_ranks[int((sizes[c] > cuts).sum())]
        return ranks

    def _add_adapter(self, model: PeftModel, cluster: int, rank: int) -> None:
        from peft import LoraConfig

        lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["encoder", "decoder"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.config.seed * 100_003 + cluster)
            model.add_adapter(_adapter_name(cluster), lora)

    def _fit_lora(self, model: PeftModel, activations: Tensor, cluster: int, rank: int) -> None:
        config = self.config
        name = _adapter_name(cluster)
        self._add_adapter(model, cluster, rank)
        model.set_adapter(name)
        model.train()
        layers = _lora_layers(model)
        outputs: list[Tensor] = []
        hooks = [
            layer.lora_B[name].register_forward_hook(lambda _m, _i, out: outputs.append(out)) for layer in layers.values()
        ]
        mask = self.masks[cluster]
        parameters = [p for p in model.parameters() if p.requires_grad]  # set_adapter froze the others
        optimizer = torch.optim.Adam(parameters, lr=config.lora_lr)
        generator = torch.Generator().manual_seed(config.seed * 100_003 + cluster)
        try:
            for _ in range(config.lora_epochs):
                order = torch.randperm(len(activations), generator=generator).to(activations.device)
                for start in range(0, len(activations), config.lora_batch_size):
                    batch = activations[order[start : start + config.lora_batch_size]]
                    outputs.clear()
                    reconstruction = model(batch, mask.expand(len(batch), -1))
                    loss = (batch - reconstruction).pow(2).sum(-1).mean()
                    loss = loss + config.lora_sparsity * sum(out.abs().sum(-1).mean() for out in outputs)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        finally:
            for hook in hooks:
                hook.remove()
            model.eval()
        with torch.no_grad():
            self.encoder_lora_A[cluster, :rank] = layers["encoder"].lora_A[name].weight
            encoder, decoder = layers["encoder"], layers["decoder"]
            self.encoder_lora_B[cluster, :rank] = encoder.lora_B[name].weight.T * encoder.scaling[name]
            self.decoder_lora_A[cluster, :rank] = layers["decoder"].lora_A[name].weight
            self.decoder_lora_B[cluster, :rank] = decoder.lora_B[name].weight.T * decoder.scaling[name]

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


class _ClusterQuadratic:
    """Mean Stage-1 reconstruction error of a cluster as a function of the mask, from sufficient statistics.

    With ``t = a - b_D`` and ``W = W_D``, ``mean ||t - W (m * z)||^2 = c0 - 2 m.g + m^T H m`` with
    ``g = mean(z * W^T t)`` and ``H = (W^T W) * mean(z z^T)``. Features that never fire in the cluster
    have zero rows in ``g`` and ``H``, so only the cluster's support is kept.
    """

    def __init__(self, activations: Tensor, codes: Tensor, sae: SparseAutoencoder) -> None:
        with torch.no_grad():
            weight = sae.decoder.weight
            target = activations - sae.decoder.bias
            self.support = (codes > 0).any(0).nonzero().squeeze(1)
            z = codes[:, self.support]
            w = weight[:, self.support]
            n = len(activations)
            self.constant = target.pow(2).sum(-1).mean()
            self.linear = (z * (target @ w)).mean(0)
            self.quadratic = (w.T @ w) * (z.T @ z / n)

    def __call__(self, masks: Tensor) -> Tensor:
        m = masks[:, self.support]
        return self.constant - 2 * m @ self.linear + ((m @ self.quadratic) * m).sum(-1)


class _MaskedSAE(nn.Module):
    """The SAE as peft sees it: ``forward(a, masks) = D(masks * E(a))`` with ``encoder``/``decoder`` linears."""

    def __init__(self, sae: SparseAutoencoder) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(sae.encoder)
        self.decoder = copy.deepcopy(sae.decoder)

    def forward(self, activations: Tensor, masks: Tensor) -> Tensor:
        return self.decoder(masks * torch.relu(self.encoder(activations)))


def _peft_sae(sae: SparseAutoencoder) -> PeftModel:
    """An empty peft wrapper of a frozen copy of ``sae``, ready for :meth:`PeftModel.add_adapter`."""
    from peft import LoraConfig, get_peft_model

    base = _MaskedSAE(sae)
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    # get_peft_model needs a first adapter; a rank-1 placeholder is deleted right away.
    model = get_peft_model(base, LoraConfig(r=1, target_modules=["encoder", "decoder"]), adapter_name="placeholder")
    model.base_model.delete_adapter("placeholder")
    return model


def _lora_layers(model: PeftModel) -> dict[str, nn.Module]:
    inner = model.base_model.model
    return {"encoder": inner.encoder, "decoder": inner.decoder}


def _adapter_name(cluster: int) -> str:
    return f"cluster_{cluster}"


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
    gather) on one row (``benchmarks/learned_mask_inference.py``).
    """
    out = inputs.new_zeros(len(inputs), lora_b.shape[-1])
    for cluster, rank, rows in groups:
        out[rows] = (inputs[rows] @ lora_a[cluster, :rank].T) @ lora_b[cluster, :rank]
    return out


def _require_sae(sae: SparseAutoencoder | None) -> SparseAutoencoder:
    if sae is None:
        raise ValueError("LearnedMask-LoRA reconstructs through the SAE: the guard has no SAE")
    return sae
