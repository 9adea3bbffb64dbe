"""ReLU sparse autoencoder with an L1 penalty (paper, appendix "SAE Training").

``z = E(a) = ReLU(W_E a + b_E)`` and ``a_hat = D(z) = W_D z + b_D``, trained on
safe activations to minimise ``||a - D(E(a))||^2 + l1_coefficient * ||E(a)||_1``
with Adam (lr 1e-3, batch 256). Decoder columns are renormalised to unit norm
after every step: without that constraint the L1 penalty can be dodged by
shrinking ``z`` and growing ``W_D``.

The encoder and decoder are plain ``nn.Linear`` modules named ``encoder`` and
``decoder`` so that peft's ``LoraConfig(target_modules=["encoder", "decoder"])``
can adapt them per cluster (LearnedMask-LoRA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .checks import check_activations
from .serialization import (
    FORMAT_VERSION,
    GuardFormatError,
    config_from_dict,
    config_to_dict,
    load_module,
    read_json,
    save_module,
    write_json,
)

SAE_WEIGHTS = "sae.safetensors"
SAE_CONFIG = "config.json"


@dataclass
class SAEConfig:
    """Shape of a sparse autoencoder."""

    d_in: int
    """Width of the activations it reads: the hidden size of the hooked model."""

    d_sae: int
    """Number of dictionary features (the paper uses 16384)."""

    def __post_init__(self) -> None:
        if self.d_in <= 0 or self.d_sae <= 0:
            raise ValueError(f"SAE sizes must be positive, got d_in={self.d_in}, d_sae={self.d_sae}")


@dataclass
class SAETrainConfig:
    """How to train a sparse autoencoder (defaults follow the paper where it gives one)."""

    l1_coefficient: float = 3e-3
    """Weight of the L1 penalty; scale it with the activations' RMS (paper, app. "SAE Training")."""

    lr: float = 1e-3
    """Adam learning rate."""

    batch_size: int = 256
    """Activations per optimisation step."""

    epochs: int = 30
    """Passes over the training activations."""

    seed: int = 0
    """Seed for initialisation and shuffling."""


class SAEOutput(NamedTuple):
    codes: Tensor
    """Sparse features ``z``, shape ``[batch, d_sae]``."""
    reconstruction: Tensor
    """``D(z)``, shape ``[batch, d_in]``."""


class SAEStats(NamedTuple):
    l0: float
    """Mean number of active features per activation."""
    fraction_variance_explained: float
    """``1 - sum ||a - a_hat||^2 / sum ||a - mean(a)||^2``."""
    dead_fraction: float
    """Fraction of features that never fire on the evaluated activations."""


class SparseAutoencoder(nn.Module):
    """A ReLU SAE: ``encode`` gives sparse codes, ``decode`` maps them back."""

    def __init__(self, config: SAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = nn.Linear(config.d_in, config.d_sae)
        self.decoder = nn.Linear(config.d_sae, config.d_in)

    def encode(self, activations: Tensor) -> Tensor:
        return torch.relu(self.encoder(activations))

    def decode(self, codes: Tensor) -> Tensor:
        return self.decoder(codes)

    def forward(self, activations: Tensor) -> SAEOutput:
        codes = self.encode(activations)
        return SAEOutput(codes, self.decode(codes))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.decoder.weight /= self.decoder.weight.norm(dim=0, keepdim=True).clamp_min(1e-8)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``sae.safetensors`` into ``save_directory``."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        write_json(path / SAE_CONFIG, {"format_version": FORMAT_VERSION, "sae": config_to_dict(self.config)})
        save_module(self, path / SAE_WEIGHTS)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> SparseAutoencoder:
        """Load an SAE written by :meth:`save_pretrained`; strict about keys and shapes."""
        path = Path(directory)
        raw = read_json(path / SAE_CONFIG)
        if raw.get("format_version") != FORMAT_VERSION:
            raise GuardFormatError(
                f"{path / SAE_CONFIG}: format_version {raw.get('format_version')!r}, expected {FORMAT_VERSION}"
            )
        if "sae" not in raw:
            raise GuardFormatError(f"{path / SAE_CONFIG}: missing config key 'sae'")
        sae = cls(config_from_dict(SAEConfig, raw["sae"], source=str(path / SAE_CONFIG)))
        load_module(sae, path / SAE_WEIGHTS)
        return sae


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
    return sae.eval()


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
