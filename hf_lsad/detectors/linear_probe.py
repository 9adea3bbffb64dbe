"""SUPERVISED reference: a linear probe (with bias) on SAE codes.

This is not an unsafe-data-free detector. It is the paper's supervised
reference (appendix "Supervised reference", the "SAE features / Linear (with
bias)" row): logistic regression ``s(x) = <w, z(x)> + b`` on the SAE codes
``z(x)``, trained with binary cross-entropy against safe (0) / unsafe (1)
labels by Adam on seeded shuffled minibatches, from zero weights. It needs
unsafe examples, so :meth:`LinearProbe.fit` refuses to run and
:meth:`LinearProbe.fit_supervised` takes both sets; ``supervised = True``
marks it in the registry so evaluation code can keep it out of "best
unsupervised" comparisons. A row scores its logit.

The paper reports the probe's probability; the sigmoid is strictly increasing
and changes neither AUROC nor the rows flagged at a safe-FPR threshold, so the
logit is the score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.checks import check_activations
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector
from .deep_svdd import train


@dataclass
class LinearProbeConfig(DetectorConfig):
    """Settings of the supervised linear probe."""

    lr: float = 1e-3
    """Adam learning rate. Default ``1e-3``: the paper takes the best of ``{1e-3, 1e-4}``."""

    epochs: int = 20
    """Passes over the labelled rows."""

    batch_size: int = 256
    """Rows per Adam step."""

    weight_decay: float = 0.0
    """Adam L2 weight decay (the paper does not mention any)."""

    seed: int = 0
    """Seed of the batch order (the weights start at zero)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


@register_detector
class LinearProbe(Detector):
    """SUPERVISED: logistic-regression logit on SAE codes, trained on safe and unsafe rows."""

    method = "linear-probe"
    config_class = LinearProbeConfig
    uses_sae = True
    supervised = True
    config: LinearProbeConfig
    d_sae: int  # the base class refuses None for a method that reads SAE codes

    def __init__(self, config: LinearProbeConfig, d_in: int, d_sae: int | None) -> None:
        super().__init__(config, d_in, d_sae)
        self.weight = nn.Parameter(torch.zeros(self.d_sae))
        self.bias = nn.Parameter(torch.zeros(1))

    def fit(self, activations: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True) -> None:
        raise TypeError(
            "linear-probe is a SUPERVISED reference and cannot be fitted on safe activations alone: "
            "call fit_supervised(safe_activations, unsafe_activations, sae)"
        )

    def fit_supervised(
        self, safe: Tensor, unsafe: Tensor, sae: SparseAutoencoder | None, *, progress: bool = True
    ) -> None:
        """Fit on safe (label 0) and unsafe (label 1) activations, each ``[n, d_in]``."""
        check_activations(safe, self.d_in, name="safe activations")
        check_activations(unsafe, self.d_in, name="unsafe activations")
        config = self.config
        with torch.no_grad():
            codes = torch.cat([_encode(sae, safe.float()), _encode(sae, unsafe.float())])
            labels = torch.cat([torch.zeros(len(safe)), torch.ones(len(unsafe))]).to(codes.device)
            data = torch.cat([codes, labels.unsqueeze(1)], dim=1)  # label rides along in the last column
            self.weight.zero_()
            self.bias.zero_()
        self.train()
        train(
            [self.weight, self.bias],
            lambda batch, _: nn.functional.binary_cross_entropy_with_logits(self._logits(batch[:, :-1]), batch[:, -1]),
            data,
            config,
            epochs=config.epochs,
            generator=torch.Generator().manual_seed(config.seed),
            desc="linear probe (supervised)",
            progress=progress,
        )
        self.eval()

    def _logits(self, codes: Tensor) -> Tensor:
        return codes @ self.weight + self.bias

    @torch.no_grad()
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None) -> DetectorOutput:
        scores = self._logits(_encode(sae, activations.float()))
        return DetectorOutput(scores, torch.full_like(scores, -1, dtype=torch.long))


def _encode(sae: SparseAutoencoder | None, activations: Tensor) -> Tensor:
    if sae is None:
        raise ValueError("the linear probe reads SAE codes: pass an SAE")
    return sae.encode(activations)
