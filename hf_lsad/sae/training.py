"""Training a ReLU sparse autoencoder with an L1 penalty (paper, appendix "SAE Training").

Trained on safe activations to minimise ``||a - D(E(a))||^2 + l1_coefficient * ||E(a)||_1``
with Adam (lr 1e-3, batch 256). Decoder columns are renormalised to unit norm after every
step: without that constraint the L1 penalty can be dodged by shrinking ``z`` and growing ``W_D``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.checks import check_activations
from ..core.fit_checks import check_sae_fit
from ..core.validation import NON_NEGATIVE, POSITIVE, POSITIVE_NUMBER, check_ranges, ranged
from .model import SAEConfig, SparseAutoencoder


@dataclass
class SAETrainConfig:
    """How to train a sparse autoencoder (defaults follow the paper where it gives one)."""

    l1_coefficient: float = ranged(NON_NEGATIVE, 3e-3)
    """Weight of the L1 penalty; scale it with the activations' RMS (paper, app. "SAE Training")."""

    lr: float = ranged(POSITIVE_NUMBER, 1e-3)
    """Adam learning rate."""

    batch_size: int = ranged(POSITIVE, 256)
    """Activations per optimisation step."""

    epochs: int = ranged(POSITIVE, 30)
    """Passes over the training activations."""

    seed: int = 0
    """Seed for initialisation and shuffling."""

    def __post_init__(self) -> None:
        check_ranges(self)


class SAEStats(NamedTuple):
    """How well an SAE reconstructs a set of activations, and how sparsely."""

    l0: float
    """Mean number of active features per activation."""
    fraction_variance_explained: float
    """``1 - sum ||a - a_hat||^2 / sum ||a - mean(a)||^2``."""
    dead_fraction: float
    """Fraction of features that never fire on the evaluated activations."""


def train_sae(
    activations: Tensor,
    d_sae: int,
    config: SAETrainConfig | None = None,
    *,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> SparseAutoencoder:
    """Train a :class:`SparseAutoencoder` on ``activations`` (``[n, d_in]``, safe data only)."""
    config = config or SAETrainConfig()
    check_activations(activations)
    device = torch.device(device or activations.device)
    data = activations.to(device=device, dtype=torch.float32)
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    sae = SparseAutoencoder(SAEConfig(d_in=data.shape[1], d_sae=d_sae)).to(device)
    with torch.no_grad():
        # Tied initialisation and b_D at the data mean: the usual warm start.
        sae.normalize_decoder()
        sae.encoder.weight.copy_(sae.decoder.weight.T)
        sae.encoder.bias.zero_()
        sae.decoder.bias.copy_(data.mean(0))
    optimizer = torch.optim.Adam(sae.parameters(), lr=config.lr)
    steps = config.epochs * -(-len(data) // config.batch_size)
    bar = tqdm(total=steps, desc="train SAE", disable=not progress)
    for _ in range(config.epochs):
        order = torch.randperm(len(data), generator=generator).to(device)
        for start in range(0, len(data), config.batch_size):
            batch = data[order[start : start + config.batch_size]]
            codes, reconstruction = sae(batch)
            mse = (batch - reconstruction).pow(2).sum(-1).mean()
            loss = mse + config.l1_coefficient * codes.abs().sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sae.normalize_decoder()
            bar.update()
        bar.set_postfix(mse=f"{mse.item():.3g}", l0=f"{(codes > 0).float().sum(-1).mean().item():.1f}")
    bar.close()
    sae.eval()
    check_sae_fit(sae_stats(sae, data).fraction_variance_explained, n_rows=len(data))
    return sae


@torch.no_grad()
def sae_stats(sae: SparseAutoencoder, activations: Tensor, batch_size: int = 1024) -> SAEStats:
    """L0, fraction of variance explained and dead-feature fraction on ``activations``."""
    check_activations(activations)
    device = sae.encoder.weight.device
    mean = activations.float().mean(0).to(device)
    active = torch.zeros(sae.config.d_sae, dtype=torch.bool, device=device)
    l0 = residual = total = 0.0
    for start in range(0, len(activations), batch_size):
        batch = activations[start : start + batch_size].to(device=device, dtype=torch.float32)
        codes, reconstruction = sae(batch)
        l0 += (codes > 0).sum().item()
        active |= (codes > 0).any(0)
        residual += (batch - reconstruction).pow(2).sum().item()
        total += (batch - mean).pow(2).sum().item()
    return SAEStats(
        l0=l0 / len(activations),
        fraction_variance_explained=1.0 - residual / total,
        dead_fraction=1.0 - active.float().mean().item(),
    )
