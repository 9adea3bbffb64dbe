"""The supervised head: a logistic regression on the raw residual stream, read at one or more layers and positions.

It learns kinds of harm from labelled rows (many unsafe sources against many benign domains and benign
look-alikes), where the anomaly head of the paper learns only what safe traffic looks like. Features are the
concatenated activations of its reads (``[batch, n_reads * hidden]``), standardised with the mean and scale
of the rows it was fitted on; the head's score is the logistic probability

    p(x) = sigmoid(w . (f(x) - mean) / scale + b)

and it flags rows whose ``p`` exceeds its threshold (set on held-out benign rows, see
:mod:`hf_lsad.guard.threshold`). Fitting uses scikit-learn's L2-regularised logistic regression (lbfgs,
deterministic) with a weight per row, so that every source counts alike whatever its size; the fitted
weights are plain tensors (safetensors), so scoring needs neither scikit-learn nor pickles.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...core.validation import POSITIVE, POSITIVE_NUMBER, check_ranges, ranged
from ..types import ANOMALY_HEAD, FeatureContribution

Read = tuple[int, str]
"""A layer (0-based decoder block) and a position (``prompt_last`` or ``prompt_mean``)."""


@dataclass
class ProbeConfig:
    """Settings of a supervised head."""

    reads: list[tuple[int, str]] = field(default_factory=lambda: [(16, "prompt_last"), (16, "prompt_mean")])
    """The (layer, position) activations concatenated into the features, in this order."""

    inverse_regularisation: float = ranged(POSITIVE_NUMBER, 1.0)
    """scikit-learn's ``C``: smaller is a stronger L2 penalty on the standardised features."""

    max_iter: int = ranged(POSITIVE, 2000)
    """lbfgs iterations at most."""

    def __post_init__(self) -> None:
        check_ranges(self)
        self.reads = [(int(layer), str(position)) for layer, position in self.reads]
        if not self.reads or len(set(self.reads)) != len(self.reads):
            raise ValueError(f"reads must be distinct (layer, position) pairs, got {self.reads}")
        bad = [position for _, position in self.reads if position not in ("prompt_last", "prompt_mean")]
        if bad:
            raise ValueError(f"a supervised head reads the prompt: positions {bad} are not prompt_last/prompt_mean")


class LogisticProbe(nn.Module):
    """``sigmoid(w . (f - mean) / scale + b)`` over the concatenated reads (module docstring)."""

    def __init__(self, config: ProbeConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        width = hidden_size * len(config.reads)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("weight", torch.zeros(width))
        self.register_buffer("bias", torch.zeros(1))

    @property
    def width(self) -> int:
        return int(self.weight.shape[0])

    def features(self, reads: dict[Read, Tensor]) -> Tensor:
        """``[batch, width]``: the head's reads of ``reads`` concatenated in its order."""
        missing = [read for read in self.config.reads if read not in reads]
        if missing:
            raise KeyError(f"the supervised head reads {missing}, which were not recorded")
        return torch.cat([reads[read].float() for read in self.config.reads], dim=1)

    @torch.no_grad()
    def forward(self, features: Tensor) -> Tensor:
        """Probabilities ``[batch]`` of ``features`` ``[batch, width]``."""
        if features.ndim != 2 or features.shape[1] != self.width:
            raise ValueError(f"the supervised head reads {self.width} features per row, got {tuple(features.shape)}")
        standard = (features.to(self.mean.device, torch.float32) - self.mean) / self.scale
        return torch.sigmoid(standard @ self.weight + self.bias)

    @torch.no_grad()
    def fit(self, features: Tensor, labels: Tensor, weights: Tensor | None = None) -> LogisticProbe:
        """Fit on ``features`` ``[n, width]`` with 0/1 ``labels`` and per-row ``weights`` (default: equal)."""
        from sklearn.linear_model import LogisticRegression  # seconds to import: only fits pay for it

        if features.ndim != 2 or features.shape[1] != self.width:
            raise ValueError(f"expected features [n, {self.width}], got {tuple(features.shape)}")
        if not torch.isfinite(features).all():
            raise ValueError("features hold NaN or inf")
        labels = labels.to(torch.int64)
        if set(labels.unique().tolist()) != {0, 1}:
            raise ValueError("a supervised head needs both safe (0) and unsafe (1) rows")
        mean = features.double().mean(0)
        scale = features.double().std(0).clamp_min(1e-6)
        standard = ((features.double() - mean) / scale).numpy()
        model = LogisticRegression(C=self.config.inverse_regularisation, max_iter=self.config.max_iter)
        model.fit(standard, labels.numpy(), sample_weight=None if weights is None else weights.double().numpy())
        self.mean.copy_(mean.float())
        self.scale.copy_(scale.float())
        self.weight.copy_(torch.from_numpy(model.coef_[0]).float())
        self.bias.copy_(torch.tensor(model.intercept_).float())
        return self


def balanced_weights(groups: Sequence[str], labels: Tensor) -> Tensor:
    """Per-row weights under which every group (a source or domain) of each label weighs the same, and the two
    labels weigh the same in total: no single source dominates the fit, whatever its size."""
    labels = labels.to(torch.int64)
    weights = torch.zeros(len(groups), dtype=torch.float64)
    for label in (0, 1):
        rows = (labels == label).nonzero().flatten().tolist()
        names = sorted({groups[i] for i in rows})
        for name in names:
            members = [i for i in rows if groups[i] == name]
            weights[members] = 1.0 / (len(names) * len(members))
    return weights * len(groups) / weights.sum()


@dataclass
class SupervisedHeadConfig:
    """A supervised head in a guard folder (``heads/<name>/config.json``): what it reads and what it learnt from."""

    name: str
    """The head's name in reports (``decided_by``), the card and the folder (``heads/<name>``)."""

    probe: ProbeConfig
    """Its reads and fit settings."""

    hidden_size: int = ranged(POSITIVE)
    """Width of each read (the model's hidden size)."""

    n_safe: int = ranged(POSITIVE)
    """Benign rows it was fitted on."""

    n_unsafe: int = ranged(POSITIVE)
    """Unsafe rows it was fitted on."""

    sources: list[str] = field(default_factory=list)
    """The unsafe sources it learnt from (what it can be expected to recognise)."""

    balance: str = "source"
    """How rows were weighted: ``source`` (every source of each label weighs alike), ``none``."""

    def __post_init__(self) -> None:
        check_ranges(self)
        check_head_name(self.name)


def check_head_name(name: str) -> None:
    """A head name is a folder name and a word in reports: letters, digits, ``-`` and ``_``; not ``anomaly``."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", name):
        raise ValueError(
            f"a head name is 1-64 letters, digits, '-' or '_' (starting with a letter or digit), got {name!r}"
        )
    if name == ANOMALY_HEAD:
        raise ValueError(f"{ANOMALY_HEAD!r} names the paper's head; choose another name")


class SupervisedHead(nn.Module):
    """A named :class:`LogisticProbe` in a guard: scores the reads it needs out of all the guard recorded."""

    def __init__(self, config: SupervisedHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.probe = LogisticProbe(config.probe, config.hidden_size)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def reads(self) -> list[Read]:
        return list(self.config.probe.reads)

    @torch.no_grad()
    def forward(self, reads: dict[Read, Tensor]) -> Tensor:
        """``[batch]`` probabilities of the rows of ``reads`` (each ``[batch, hidden]``)."""
        return self.probe(self.probe.features(reads))

    @torch.no_grad()
    def explain(self, reads: dict[Read, Tensor], *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the feature dimensions that push its logit up most, largest first.

        The logit is ``sum_i w_i (x_i - mean_i) / scale_i + b``; each term is a
        :class:`~hf_lsad.guard.types.FeatureContribution` with ``feature`` the dimension of the concatenated reads
        (``read_index * hidden_size + unit``), ``activation`` the row's value, ``contribution`` the term and
        ``typical`` the mean of the rows the head was fitted on.
        """
        probe = self.probe
        features = probe.features(reads).to(probe.mean.device, torch.float32)
        terms = (features - probe.mean) / probe.scale * probe.weight  # [batch, width]
        k = terms.shape[1] if top_k is None else min(top_k, terms.shape[1])
        order = terms.topk(k, dim=1).indices
        return [
            tuple(
                FeatureContribution(
                    feature=int(i),
                    activation=float(features[r, i]),
                    contribution=float(terms[r, i]),
                    typical=float(probe.mean[i]),
                )
                for i in order[r].tolist()
            )
            for r in range(len(order))
        ]
