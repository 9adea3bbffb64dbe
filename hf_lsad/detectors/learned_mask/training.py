"""LearnedMask-LoRA's two training stages (paper, Algorithm 2), run per cluster by :meth:`LearnedMaskLoRA.fit`.

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

The peft side (:func:`peft_sae`, :func:`add_adapter`) also builds the detector's peft views
(:meth:`LearnedMaskLoRA.peft_model`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from ...sae.model import SparseAutoencoder, apply_activation
from ..masks import straight_through_mask
from .config import MASK_ONLY, LearnedMaskConfig

if TYPE_CHECKING:  # peft imports transformers: loaded only when Stage 2 or the peft views run
    from peft import PeftModel

LORA_FACTORS = ("encoder_lora_A", "encoder_lora_B", "decoder_lora_A", "decoder_lora_B")
"""The detector's stacked adapter buffers (``[K, r, d_in or d_sae]``; B factors carry the LoRA scaling)."""


# --- Stage 1 -----------------------------------------------------------------------------


def fit_mask(
    config: LearnedMaskConfig, activations: Tensor, codes: Tensor, sae: SparseAutoencoder, cluster: int
) -> tuple[float, Tensor]:
    """The cluster's selected ``lambda`` and its mask (``[d_sae]``) retrained with it on all members."""
    n = len(activations)
    generator = torch.Generator().manual_seed(config.seed * 100_003 + cluster)
    order = torch.randperm(n, generator=generator).to(activations.device)
    n_val = max(1, round(n * config.validation_fraction))
    train, val = order[n_val:], order[:n_val]
    lambdas = torch.tensor(config.lambdas, dtype=activations.dtype, device=activations.device)
    masks = train_masks(config, _ClusterQuadratic(activations[train], codes[train], sae), lambdas, codes.shape[1])
    with torch.no_grad():
        target = activations[val] - sae.decoder.bias
        errors = torch.stack([(target - (codes[val] * m) @ sae.decoder.weight.T).pow(2).sum(-1).mean() for m in masks])
    acceptable = (errors <= errors.min() * (1.0 + config.lambda_tolerance)).nonzero().squeeze(1)
    chosen = max(acceptable.tolist(), key=lambda i: (config.lambdas[i], -i))
    whole = _ClusterQuadratic(activations, codes, sae)
    final = train_masks(config, whole, lambdas[chosen : chosen + 1], codes.shape[1])
    return config.lambdas[chosen], final[0]


def train_masks(config: LearnedMaskConfig, quadratic: _ClusterQuadratic, lambdas: Tensor, d_sae: int) -> Tensor:
    """One mask per ``lambda`` (``[L, d_sae]``), trained jointly: each row's loss involves its own logits only.

    Returns, per ``lambda``, the visited mask with the lowest Stage-1 objective
    ``L_rec(m) + lambda ||m||_1``: the straight-through gradient of a feature that is on
    is only its residual correlation, so needed features oscillate around logit 0 and
    the last iterate alone would be arbitrary.
    """
    shape = (len(lambdas), d_sae)
    logits = torch.full(shape, config.logit_init, device=lambdas.device, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=config.stage1_lr)
    mask_of = straight_through_mask if config.mask_type == "binary" else torch.sigmoid
    best = torch.full_like(lambdas, float("inf"))
    best_masks = torch.zeros(len(lambdas), d_sae, device=lambdas.device)

    def visit() -> Tensor:
        nonlocal best
        masks = mask_of(logits)
        reconstruction = quadratic(masks)
        with torch.no_grad():
            # Store the exact hard mask: soft + (hard - soft) can be off by an ulp.
            kept = (logits > 0).to(masks.dtype) if config.mask_type == "binary" else masks
            objective = reconstruction + lambdas * kept.sum(-1)
            better = objective < best
            best = torch.where(better, objective, best)
            best_masks[better] = kept[better]
        return reconstruction

    for _ in range(config.stage1_steps):
        loss = (visit() + lambdas * torch.sigmoid(logits).sum(-1)).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        visit()  # the final iterate is a candidate too
    return best_masks


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


# --- Stage 2 -----------------------------------------------------------------------------


def lora_ranks(config: LearnedMaskConfig, sizes: list[int], stages: list[int]) -> list[int]:
    """Per cluster: the rank of its Stage-2 adapter, 0 for a cluster that gets none."""
    eligible = (
        []
        if config.stage1_only
        else [c for c, (n, s) in enumerate(zip(sizes, stages)) if s == MASK_ONLY and n >= config.lora_min_cluster_size]
    )
    ranks = [0] * len(sizes)
    if eligible:
        # Small / medium / large = size terciles of the Stage-2 clusters (ties share a rank).
        cuts = torch.quantile(torch.tensor([float(sizes[c]) for c in eligible]), torch.tensor([1 / 3, 2 / 3]))
        for c in eligible:
            ranks[c] = config.lora_ranks[int((sizes[c] > cuts).sum())]
    return ranks


def fit_lora(
    config: LearnedMaskConfig, model: PeftModel, activations: Tensor, mask: Tensor, cluster: int, rank: int
) -> dict[str, Tensor]:
    """Train the cluster's adapter on ``model`` (from :func:`peft_sae`); its factors by :data:`LORA_FACTORS` name."""
    name = adapter_name(cluster)
    add_adapter(model, cluster, rank, config.seed)
    model.set_adapter(name)
    model.train()
    layers = lora_layers(model)
    outputs: list[Tensor] = []
    hooks = [
        layer.lora_B[name].register_forward_hook(lambda _m, _i, out: outputs.append(out)) for layer in layers.values()
    ]
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
        encoder, decoder = layers["encoder"], layers["decoder"]
        return {
            "encoder_lora_A": encoder.lora_A[name].weight.clone(),
            "encoder_lora_B": encoder.lora_B[name].weight.T * encoder.scaling[name],
            "decoder_lora_A": decoder.lora_A[name].weight.clone(),
            "decoder_lora_B": decoder.lora_B[name].weight.T * decoder.scaling[name],
        }


class _MaskedSAE(nn.Module):
    """The SAE as peft sees it: ``forward(a, masks) = D(masks * E(a))`` with ``encoder``/``decoder`` linears."""

    def __init__(self, sae: SparseAutoencoder) -> None:
        super().__init__()
        self.encoder = copy.deepcopy(sae.encoder)
        self.decoder = copy.deepcopy(sae.decoder)
        self.sae_config = sae.config
        self.threshold: Tensor | None  # the SAE's JumpReLU thresholds, None for other activations
        self.register_buffer("threshold", None if sae.threshold is None else sae.threshold.detach().clone())

    def forward(self, activations: Tensor, masks: Tensor) -> Tensor:
        return self.decoder(masks * apply_activation(self.encoder(activations), self.sae_config, self.threshold))


def peft_sae(sae: SparseAutoencoder) -> PeftModel:
    """An empty peft wrapper of a frozen copy of ``sae``, ready for :meth:`PeftModel.add_adapter`."""
    from peft import LoraConfig, get_peft_model

    base = _MaskedSAE(sae)
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    # get_peft_model needs a first adapter; a rank-1 placeholder is deleted right away.
    model = get_peft_model(base, LoraConfig(r=1, target_modules=["encoder", "decoder"]), adapter_name="placeholder")
    tuner: Any = model.base_model  # peft's LoraModel; PeftModel annotates it as a plain nn.Module
    tuner.delete_adapter("placeholder")
    return cast("PeftModel", model)  # not a PeftMixedModel: get_peft_model was not asked for mixed=True


def add_adapter(model: PeftModel, cluster: int, rank: int, seed: int) -> None:
    """Add the cluster's adapter ``cluster_{c}``, initialised from a seed of its own."""
    from peft import LoraConfig

    lora = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=["encoder", "decoder"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 100_003 + cluster)
        model.add_adapter(adapter_name(cluster), lora)


def lora_layers(model: PeftModel) -> dict[str, Any]:
    """The encoder's and decoder's peft LoRA layers (``Any``: peft builds their ``lora_A``/``lora_B`` at run time)."""
    inner: Any = model.base_model.model  # the _MaskedSAE, its linears replaced by peft's LoRA layers
    return {"encoder": inner.encoder, "decoder": inner.decoder}


def adapter_name(cluster: int) -> str:
    return f"cluster_{cluster}"
