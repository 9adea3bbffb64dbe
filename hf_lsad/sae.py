"""ReLU sparse autoencoder with an L1 penalty (paper, appendix "SAE Training").

``z = E(a) = ReLU(W_E a + b_E)`` and ``a_hat = D(z) = W_D z + b_D``, trained on
safe activations to minimise ``||a - D(E(a))||^2 + l1_coefficient * ||E(a)||_1``
with Adam (lr 1e-3, batch 256). Decoder columns are renormalised to unit norm
after every step: without that constraint the L1 penalty can be dodged by
shrinking ``z`` and growing ``W_D``.

The encoder and decoder are plain ``nn.Linear`` modules named ``encoder`` and
``decoder`` so that peft's ``LoraConfig(target_modules=["encoder", "decoder"])``
can adapt them per cluster (LearnedMask-LoRA).

Loaded SAEs (:mod:`hf_lsad.sae_formats`: SAELens, sparsify, Gemma Scope) may use another
nonlinearity on the same pre-activations ``pre = W_E a + b_E`` (``SAEConfig.activation``):

- ``relu``: ``z = ReLU(pre)`` (the SAEs hf-lsad trains);
- ``jumprelu``: ``z = ReLU(pre) * 1[pre > threshold]`` with a per-feature ``threshold``
  (a buffer, saved in ``sae.safetensors``);
- ``topk``: ``ReLU`` of the ``k`` largest entries of ``pre``, zero elsewhere.

All three give codes ``z >= 0``, so "feature j is active" is ``z_j > 0`` for every one of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .checks import check_activations
from .config_validation import require_keys
from .fit_checks import check_sae_fit
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

Activation = Literal["relu", "jumprelu", "topk"]
ACTIVATIONS: tuple[str, ...] = ("relu", "jumprelu", "topk")

#: SAE config keys added with JumpReLU / TopK support, and the values that SAEs saved before
#: them (``sae/config.json`` holding only ``d_in`` and ``d_sae``, e.g. the bundled guards) had:
#: every such SAE is a ReLU SAE. :meth:`SparseAutoencoder.from_pretrained` fills them in only
#: when *all* of them are absent; any other missing or unknown key is still an error.
LEGACY_SAE_CONFIG_DEFAULTS: dict[str, object] = {"activation": "relu", "k": None}


@dataclass
class SAEConfig:
    """Shape of a sparse autoencoder."""

    d_in: int
    """Width of the activations it reads: the hidden size of the hooked model."""

    d_sae: int
    """Number of dictionary features (the paper uses 16384)."""

    activation: Activation = "relu"
    """Nonlinearity on ``pre = W_E a + b_E``: ``relu``, ``jumprelu`` or ``topk`` (module docstring)."""

    k: int | None = None
    """Number of features kept by ``topk`` (``None`` for the other activations)."""

    def __post_init__(self) -> None:
        if self.d_in <= 0 or self.d_sae <= 0:
            raise ValueError(f"SAE sizes must be positive, got d_in={self.d_in}, d_sae={self.d_sae}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown SAE activation {self.activation!r}; choose one of {ACTIVATIONS}")
        if self.activation == "topk":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= self.d_sae:
                raise ValueError(f"a topk SAE needs an integer k in [1, d_sae={self.d_sae}], got k={self.k!r}")
        elif self.k is not None:
            raise ValueError(f"k is only used by the topk activation, got k={self.k!r} with {self.activation!r}")


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


def apply_activation(pre: Tensor, config: SAEConfig, threshold: Tensor | None = None) -> Tensor:
    """Codes ``z`` from pre-activations ``pre`` (``[..., d_sae]``) under ``config.activation``.

    ``threshold`` (``[d_sae]``) is required by, and only used by, ``jumprelu``.
    """
    if config.activation == "relu":
        return torch.relu(pre)
    if config.activation == "jumprelu":
        if threshold is None:
            raise ValueError("a jumprelu SAE needs its per-feature threshold")
        return torch.relu(pre) * (pre > threshold).to(pre.dtype)
    values, indices = pre.topk(config.k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))


class SparseAutoencoder(nn.Module):
    """An SAE: ``encode`` gives sparse codes, ``decode`` maps them back.

    ``encode(a) = activate(encoder(a))``; ``activate`` is ReLU, JumpReLU or TopK as
    ``config.activation`` says. A JumpReLU SAE also holds a ``threshold`` buffer (``[d_sae]``).
    """

    threshold: Tensor | None

    def __init__(self, config: SAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = nn.Linear(config.d_in, config.d_sae)
        self.decoder = nn.Linear(config.d_sae, config.d_in)
        if config.activation == "jumprelu":
            self.register_buffer("threshold", torch.zeros(config.d_sae))
        else:
            self.threshold = None

    def activate(self, pre: Tensor) -> Tensor:
        """The nonlinearity alone: codes from pre-activations ``encoder(a)`` (possibly adapted, e.g. by LoRA)."""
        return apply_activation(pre, self.config, self.threshold)

    def encode(self, activations: Tensor) -> Tensor:
        return self.activate(self.encoder(activations))

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
        require_keys(raw, {"format_version", "sae"}, set(), source=str(path / SAE_CONFIG))
        fields = raw["sae"]
        if isinstance(fields, dict) and not set(LEGACY_SAE_CONFIG_DEFAULTS) & set(fields):
            # Written before JumpReLU / TopK support: a ReLU SAE (see LEGACY_SAE_CONFIG_DEFAULTS).
            fields = {**fields, **LEGACY_SAE_CONFIG_DEFAULTS}
        sae = cls(config_from_dict(SAEConfig, fields, source=str(path / SAE_CONFIG)))
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
