"""Deep SVDD baseline (Ruff et al., ICML 2018; paper, appendix "Activation-space baselines").

Raw activations are standardized (per-dimension mean and standard deviation
of the fit split, zero std -> 1; Ruff et al. also normalise their inputs).
A small MLP encoder ``phi`` (bias-free linear layers with leaky ReLUs between
them, as Ruff et al. prescribe so that ``phi`` cannot collapse onto a constant
and reach a trivial zero loss) is

1. pretrained as the encoder of an autoencoder (mirror-image decoder,
   mean squared reconstruction error; the decoder is discarded),
2. then the center ``c`` is fixed to the mean of ``phi(x)`` over the fit rows
   (coordinates with ``|c_i| < eps`` are pushed to ``+-eps``, as in Ruff et
   al.'s code), and ``phi`` is trained to minimise

   - ``one-class``: ``mean ||phi(x) - c||^2`` (the paper's description), or
   - ``soft-boundary``: ``R^2 + 1/nu * mean(max(0, ||phi(x) - c||^2 - R^2))``,
     ``R`` being set after ``warm_up_epochs`` to the ``(1 - nu)``-quantile of
     the batch distances (Ruff et al.'s schedule),

   with Adam and L2 weight decay. A row scores ``||phi(x) - c||^2`` (one-class)
   or ``||phi(x) - c||^2 - R^2`` (soft-boundary).

Everything random (initial weights, batch order) is drawn from ``seed``, so a
fit is reproducible on a given machine and device. The paper maps scores to
``[0, 1]`` (percentile or sigmoid); those maps are strictly increasing and
change neither AUROC nor the rows flagged at a safe-FPR threshold, so they are
not implemented.

The building blocks (encoder, seeded minibatch training, autoencoder
pretraining) are shared with :mod:`hf_lsad.detectors.cvdd`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.checks import check_activations
from ..sae.model import SparseAutoencoder
from .base import Detector, DetectorConfig, DetectorOutput, register_detector
from .gmm import fit_standardizer

Objective = Literal["one-class", "soft-boundary"]
OBJECTIVES = get_args(Objective)


def mlp(widths: Sequence[int]) -> nn.Sequential:
    """Bias-free linear layers ``widths[0] -> ... -> widths[-1]`` with leaky ReLUs between them."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(widths)):
        if i:
            layers.append(nn.LeakyReLU())
        layers.append(nn.Linear(a, b, bias=False))
    return nn.Sequential(*layers)


def seeded_init(module: nn.Module, seed: int) -> None:
    """Re-initialise every linear layer of ``module`` from ``seed`` (default PyTorch init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                fresh = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
                with torch.no_grad():
                    layer.weight.copy_(fresh.weight)
                    if layer.bias is not None:
                        layer.bias.copy_(fresh.bias)


def minibatches(data: Tensor, batch_size: int, generator: torch.Generator) -> Iterator[Tensor]:
    """``data`` in shuffled batches, the order drawn from ``generator`` (a CPU generator)."""
    order = torch.randperm(len(data), generator=generator).to(data.device)
    yield from data[order].split(batch_size)


class OptimiserSettings(Protocol):
    """The config fields :func:`train` reads (Deep SVDD's, CVDD's and the linear probe's configs have them)."""

    lr: float
    weight_decay: float
    batch_size: int


def train(
    parameters: Sequence[Tensor],
    loss_of_batch: Callable[[Tensor, int], Tensor],
    data: Tensor,
    config: OptimiserSettings,
    *,
    epochs: int,
    generator: torch.Generator,
    desc: str,
    progress: bool,
    after_step: Callable[[Tensor, int], None] | None = None,
) -> None:
    """Adam (``config``'s lr, weight decay, batch size) over shuffled minibatches for ``epochs``;
    ``loss_of_batch(batch, epoch)``; a tqdm bar over epochs."""
    optimizer = torch.optim.Adam(parameters, lr=config.lr, weight_decay=config.weight_decay)
    bar = tqdm(range(epochs), desc=desc, disable=not progress)
    for epoch in bar:
        total, count = 0.0, 0
        for batch in minibatches(data, config.batch_size, generator):
            loss = loss_of_batch(batch, epoch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step(batch, epoch)
            total, count = total + loss.item() * len(batch), count + len(batch)
        bar.set_postfix(loss=total / max(count, 1))


def pretrain_autoencoder(
    encoder: nn.Sequential, data: Tensor, config: EncoderTrainingConfig, generator: torch.Generator, progress: bool
) -> None:
    """Train ``encoder`` with a mirror-image decoder on mean squared reconstruction error."""
    widths = [layer.in_features for layer in encoder if isinstance(layer, nn.Linear)] + [config.rep_dim]
    decoder = mlp(widths[::-1]).to(data.device)
    seeded_init(decoder, config.seed + 1)
    train(
        [*encoder.parameters(), *decoder.parameters()],
        lambda batch, _: (decoder(encoder(batch)) - batch).pow(2).sum(-1).mean(),
        data,
        config,
        epochs=config.pretrain_epochs,
        generator=generator,
        desc="autoencoder pretraining",
        progress=progress,
    )


@dataclass
class EncoderTrainingConfig(DetectorConfig):
    """The encoder and optimiser settings that Deep SVDD and CVDD share."""

    rep_dim: int = 128
    """Output width of the encoder. Default 128: Deep SVDD's selection on 4 of the paper's 6
    models (sweep ``{16, 32, 64, 128}``); CVDD does not report one."""

    hidden_dims: tuple[int, ...] = (512,)
    """Widths of the encoder's hidden layers (the paper says "a small MLP" without sizes)."""

    lr: float = 1e-3
    """Adam learning rate (pretraining and training). Default ``1e-3``: the paper's Deep SVDD
    selections disagree (``1e-3`` on 3 models, ``1e-4`` on 2, ``1e-2`` on 1); the middle of the sweep."""

    weight_decay: float = 1e-6
    """Adam L2 weight decay (Ruff et al.'s value), on the encoder and CVDD's contexts."""

    epochs: int = 30
    """Training epochs of the one-class objective."""

    pretrain_epochs: int = 10
    """Autoencoder pretraining epochs (0 skips pretraining)."""

    batch_size: int = 256
    """Rows per Adam step."""

    seed: int = 0
    """Seed of the initial weights, the batch order and CVDD's context initialisation."""

    def __post_init__(self) -> None:
        self.hidden_dims = tuple(int(w) for w in self.hidden_dims)
        if any(w < 1 for w in self.hidden_dims):
            raise ValueError(f"hidden_dims must be positive widths, got {list(self.hidden_dims)}")
        for name in ("rep_dim", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("epochs", "pretrain_epochs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass
class DeepSVDDConfig(EncoderTrainingConfig):
    """Settings of Deep SVDD."""

    objective: Objective = "one-class"
    """``one-class`` (mean squared distance to ``c``, the paper's description) or ``soft-boundary``."""

    nu: float = 0.1
    """Soft-boundary outlier fraction in ``(0, 1]`` (unused by ``one-class``). Default 0.1: the
    paper's selections disagree (0.2 on 3 models, 0.1 on 2, 0.05 on 1); 0.1 is the middle
    of the sweep ``{0.05, 0.1, 0.2}``."""

    warm_up_epochs: int = 10
    """Soft-boundary only: epochs before the radius starts being updated."""

    center_eps: float = 0.1
    """Center coordinates closer to 0 than this are moved to ``+-center_eps``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0.0 < self.nu <= 1.0:
            raise ValueError(f"nu must be in (0, 1], got {self.nu}")
        if self.warm_up_epochs < 0 or self.center_eps < 0:
            raise ValueError("warm_up_epochs and center_eps must be >= 0")


class StandardizedEncoder:
    """Mixin of Deep SVDD and CVDD: an ``encoder`` on inputs standardized by the
    ``input_mean`` / ``input_scale`` buffers of the fit split."""

    encoder: nn.Sequential
    input_mean: Tensor
    input_scale: Tensor

    @torch.no_grad()
    def _standardize_fit(self, activations: Tensor) -> Tensor:
        """Set the buffers from ``activations`` and return them standardized."""
        mean, scale = fit_standardizer(activations)
        self.input_mean.copy_(mean)
        self.input_scale.copy_(scale)
        return (activations.float() - self.input_mean) / self.input_scale

    def represent(self, activations: Tensor) -> Tensor:
        """``phi(x)``: the encoder on standardized activations."""
        return self.encoder((activations.float() - self.input_mean) / self.input_scale)


@register_detector
class DeepSVDD(StandardizedEncoder, Detector):
    """Squared distance of the learned representation to a fixed center (raw activations)."""

    method = "deep-svdd"
    config_class = DeepSVDDConfig
    uses_sae = False
    config: DeepSVDDConfig

    center: Tensor  # [rep_dim]
    radius: Tensor  # [1] (soft-boundary objective; 0 for one-class)

    def __init__(self, config: DeepSVDDConfig, d_in: int, d_sae: int | None = None) -> None:
        super().__init__(config, d_in, d_sae)
        self.encoder = mlp([d_in, *config.hidden_dims, config.rep_dim])
        self.register_buffer("input_mean", torch.zeros(d_in))
        self.register_buffer("input_scale", torch.ones(d_in))
        self.register_buffer("center", torch.zeros(config.rep_dim))
        self.register_buffer("radius", torch.zeros(1))

    def fit(self, activations: Tensor, sae: SparseAutoencoder | None = None, *, progress: bool = True) -> None:
        check_activations(activations, self.d_in, name="safe activations")
        config = self.config
        if len(activations) < 2:
            raise ValueError(f"Deep SVDD needs at least 2 safe rows, got {len(activations)}")
        data = self._standardize_fit(activations)
        generator = torch.Generator().manual_seed(config.seed)
        seeded_init(self.encoder, config.seed)
        self.radius.zero_()
        self.train()
        if config.pretrain_epochs:
            pretrain_autoencoder(self.encoder, data, config, generator, progress)
        with torch.no_grad():
            center = self.encoder(data).mean(0)
            small = center.abs() < config.center_eps
            center[small] = torch.where(center[small] < 0, -config.center_eps, config.center_eps)
            self.center.copy_(center)

        def loss(batch: Tensor, epoch: int) -> Tensor:
            distance = (self.encoder(batch) - self.center).pow(2).sum(-1)
            if config.objective == "one-class":
                return distance.mean()
            excess = (distance - self.radius.pow(2)).clamp_min(0)
            return self.radius.pow(2).squeeze() + excess.mean() / config.nu

        def update_radius(batch: Tensor, epoch: int) -> None:
            if config.objective == "soft-boundary" and epoch >= config.warm_up_epochs:
                with torch.no_grad():
                    distance = (self.encoder(batch) - self.center).pow(2).sum(-1)
                    self.radius.fill_(torch.quantile(distance.sqrt(), 1 - config.nu).item())

        train(
            list(self.encoder.parameters()),
            loss,
            data,
            config,
            epochs=config.epochs,
            generator=generator,
            desc="Deep SVDD",
            progress=progress,
            after_step=update_radius,
        )
        self.eval()

    @torch.no_grad()
    def forward(self, activations: Tensor, sae: SparseAutoencoder | None = None) -> DetectorOutput:
        scores = (self.represent(activations) - self.center).pow(2).sum(-1)
        if self.config.objective == "soft-boundary":
            scores = scores - self.radius.pow(2)
        return DetectorOutput(scores, torch.full_like(scores, -1, dtype=torch.long))
