"""The supervised head: a small classifier on the raw residual stream, read at one or more layers and positions.

It learns kinds of harm from labelled rows (many unsafe sources against many benign domains and benign
look-alikes), where the anomaly head of the paper learns only what safe traffic looks like. Features are the
concatenated activations of its reads (``[batch, n_reads * hidden]``), standardised with the mean and scale
of the rows it was fitted on, ``z = (f(x) - mean) / scale``. Two kinds of probe map them to a probability:

    logistic:  p(x) = sigmoid(w . z + b)
    mlp:       p(x) = sigmoid(v . relu(W z + c) + b)        (one ReLU layer of ``mlp_units``)

An MLP of ``mlp_members`` fits (seeds ``seed``, ``seed + 1``, ...) averages their logits, which is itself one MLP:
their hidden layers side by side (``mlp_members * mlp_units`` units) and their output weights divided by
``mlp_members``. Fits of one configuration vary with the seed; their mean varies less.

and the head flags rows whose ``p`` exceeds its threshold (set on held-out benign rows, see
:mod:`hf_lsad.guard.threshold`). Fitting uses scikit-learn (L2-regularised ``LogisticRegression`` with lbfgs;
``MLPClassifier`` with adam, an L2 penalty and early stopping, seeded) with a weight per row, so that every source
counts alike whatever its size; the fitted weights are plain tensors (safetensors), so scoring needs neither
scikit-learn nor pickles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from ...core.hook_point import Read
from ...core.prompt_tokens import PromptTokens
from ...core.validation import NON_NEGATIVE, POSITIVE, POSITIVE_NUMBER, check_ranges, ranged
from ..types import ANOMALY_HEAD, FeatureContribution, TokenContribution

ProbeKind = Literal["logistic", "mlp"]

Balance = Literal["source", "none", "given"]
"""How a head's fit rows were weighed: every source of each label alike (``source``, :func:`balanced_weights`), every
row alike (``none``), or by weights the caller gave (``given``)."""


@dataclass
class ProbeConfig:
    """Settings of a supervised head."""

    reads: list[tuple[int, str]] = field(default_factory=lambda: [(16, "prompt_last"), (16, "prompt_mean")])
    """The (layer, position) activations concatenated into the features, in this order."""

    kind: ProbeKind = "logistic"
    """``logistic``: a logistic regression on the standardised reads; ``mlp``: one ReLU layer of ``mlp_units``
    before the logistic output (module docstring)."""

    inverse_regularisation: float = ranged(POSITIVE_NUMBER, 1.0)
    """``logistic``: scikit-learn's ``C``; smaller is a stronger L2 penalty on the standardised features."""

    max_iter: int = ranged(POSITIVE, 2000)
    """Iterations at most: lbfgs steps (``logistic``), epochs (``mlp``)."""

    mlp_units: int = ranged(POSITIVE, 128)
    """``mlp``: width of the hidden ReLU layer."""

    mlp_alpha: float = ranged(POSITIVE_NUMBER, 1e-3)
    """``mlp``: scikit-learn's L2 penalty ``alpha``."""

    seed: int = ranged(NON_NEGATIVE, 0)
    """``mlp``: seeds the initial weights and the 10% of the fit rows held back for early stopping."""

    mlp_members: int = ranged(POSITIVE, 1)
    """``mlp``: fits (seeds ``seed`` onwards) whose logits are averaged; the head then holds ``mlp_members *
    mlp_units`` hidden units (module docstring)."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.kind not in PROBES:
            raise ValueError(f"kind must be one of {sorted(PROBES)}, got {self.kind!r}")
        self.reads = [(int(layer), str(position)) for layer, position in self.reads]
        if not self.reads or len(set(self.reads)) != len(self.reads):
            raise ValueError(f"reads must be distinct (layer, position) pairs, got {self.reads}")
        bad = [position for _, position in self.reads if position not in ("prompt_last", "prompt_mean")]
        if bad:
            raise ValueError(f"a supervised head reads the prompt: positions {bad} are not prompt_last/prompt_mean")

    @property
    def label(self) -> str:
        """The kind in a word or two: ``logistic``, ``mlp 256`` (its hidden units), ``mlp 256 x 3 fits``."""
        if self.kind == "logistic":
            return self.kind
        return f"mlp {self.mlp_units}" + (f" x {self.mlp_members} fits" if self.mlp_members > 1 else "")

    def describe(self) -> str:
        """The kind and what it reads: ``mlp 256 on layer 16 prompt_mean, ...``."""
        return f"{self.label} on " + ", ".join(f"layer {layer} {position}" for layer, position in self.reads)


class Probe(nn.Module):
    """What both kinds share: the reads concatenated and standardised, the checks of a fit, the probability.

    A kind defines :meth:`logit` of standardised features, :meth:`local_weights` (the gradient of the logit with
    respect to them, for explanations) and :meth:`fit_standard` (scikit-learn's fit, copied into buffers).
    """

    mean: Tensor  # [width], the fit rows' mean of each concatenated read
    scale: Tensor  # [width], their standard deviation

    def __init__(self, config: ProbeConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        width = hidden_size * len(config.reads)
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))

    @property
    def width(self) -> int:
        """Features per row: the hidden size times the number of reads."""
        return int(self.mean.shape[0])

    def extra_repr(self) -> str:
        return f"{self.config.describe()}, width={self.width}"

    def features(self, reads: dict[Read, Tensor]) -> Tensor:
        """``[batch, width]``: the head's reads of ``reads`` concatenated in its order."""
        missing = [read for read in self.config.reads if read not in reads]
        if missing:
            raise KeyError(f"the supervised head reads {missing}, which were not recorded")
        return torch.cat([reads[read].float() for read in self.config.reads], dim=1)

    def standardise(self, features: Tensor) -> Tensor:
        """``[batch, width]`` features, checked, as ``z = (f - mean) / scale`` in float32."""
        if features.ndim != 2 or features.shape[1] != self.width:
            raise ValueError(f"the supervised head reads {self.width} features per row, got {tuple(features.shape)}")
        return (features.to(self.mean.device, torch.float32) - self.mean) / self.scale

    def logit(self, standard: Tensor) -> Tensor:
        """``[batch]`` logits of standardised features ``[batch, width]``."""
        raise NotImplementedError

    def local_weights(self, standard: Tensor) -> Tensor:
        """``[batch, width]``: d logit / d z at each row (for the logistic probe, ``w`` on every row)."""
        raise NotImplementedError

    def fit_standard(self, standard: Tensor, labels: Tensor, weights: Tensor | None) -> None:
        """Fit on float64 standardised features ``[n, width]`` and copy the result into the buffers."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, features: Tensor) -> Tensor:
        """Probabilities ``[batch]`` of ``features`` ``[batch, width]``."""
        return torch.sigmoid(self.logit(self.standardise(features)))

    @torch.no_grad()
    def fit(self, features: Tensor, labels: Tensor, weights: Tensor | None = None) -> Probe:
        """Fit on ``features`` ``[n, width]`` with 0/1 ``labels`` and per-row ``weights`` (default: equal)."""
        if features.ndim != 2 or features.shape[1] != self.width:
            raise ValueError(f"expected features [n, {self.width}], got {tuple(features.shape)}")
        if not torch.isfinite(features).all():
            raise ValueError("features hold NaN or inf")
        labels = labels.to(torch.int64)
        if labels.shape != (features.shape[0],):
            raise ValueError(f"expected labels [{features.shape[0]}], got {tuple(labels.shape)}")
        if set(labels.unique().tolist()) != {0, 1}:
            raise ValueError("a supervised head needs both safe (0) and unsafe (1) rows")
        if weights is not None:
            check_weights(weights, labels)
        values = features.double()
        mean, scale = values.mean(0), values.std(0).clamp_min(1e-6)
        self.fit_standard((values - mean) / scale, labels, weights)
        self.mean.copy_(mean.float())
        self.scale.copy_(scale.float())
        return self


class LogisticProbe(Probe):
    """``sigmoid(w . z + b)`` over the standardised reads (module docstring)."""

    weight: Tensor  # [width] w
    bias: Tensor  # [1] b

    def __init__(self, config: ProbeConfig, hidden_size: int) -> None:
        super().__init__(config, hidden_size)
        self.register_buffer("weight", torch.zeros(self.width))
        self.register_buffer("bias", torch.zeros(1))

    def logit(self, standard: Tensor) -> Tensor:
        return standard @ self.weight + self.bias

    def local_weights(self, standard: Tensor) -> Tensor:
        return self.weight.expand_as(standard)

    def fit_standard(self, standard: Tensor, labels: Tensor, weights: Tensor | None) -> None:
        from sklearn.linear_model import LogisticRegression  # seconds to import: only fits pay for it

        model = LogisticRegression(C=self.config.inverse_regularisation, max_iter=self.config.max_iter)
        model.fit(standard.numpy(), labels.numpy(), sample_weight=None if weights is None else weights.double().numpy())
        self.weight.copy_(torch.from_numpy(model.coef_[0]).float())
        self.bias.copy_(torch.tensor(model.intercept_).float())


class MLPProbe(Probe):
    """``sigmoid(v . relu(W z + c) + b)`` over the standardised reads: one ReLU layer, of ``mlp_members`` fits side by
    side (module docstring)."""

    hidden_weight: Tensor  # [units, width] W
    hidden_bias: Tensor  # [units] c
    weight: Tensor  # [units] v
    bias: Tensor  # [1] b

    def __init__(self, config: ProbeConfig, hidden_size: int) -> None:
        super().__init__(config, hidden_size)
        units = config.mlp_units * config.mlp_members
        self.register_buffer("hidden_weight", torch.zeros(units, self.width))  # W
        self.register_buffer("hidden_bias", torch.zeros(units))  # c
        self.register_buffer("weight", torch.zeros(units))  # v
        self.register_buffer("bias", torch.zeros(1))  # b

    def logit(self, standard: Tensor) -> Tensor:
        hidden = torch.relu(standard @ self.hidden_weight.T + self.hidden_bias)  # [batch, units]
        return hidden @ self.weight + self.bias

    def local_weights(self, standard: Tensor) -> Tensor:
        # The logit is linear where the same units are active: sum over active units j of v_j W_j.
        active = (standard @ self.hidden_weight.T + self.hidden_bias) > 0  # [batch, units]
        return (active * self.weight) @ self.hidden_weight  # [batch, width]

    def fit_standard(self, standard: Tensor, labels: Tensor, weights: Tensor | None) -> None:
        from sklearn.neural_network import MLPClassifier  # seconds to import: only fits pay for it

        config = self.config
        x, y = standard.numpy(), labels.numpy()
        sample_weight = None if weights is None else weights.double().numpy()
        fits = []
        for member in range(config.mlp_members):
            model = MLPClassifier(
                hidden_layer_sizes=(config.mlp_units,),
                alpha=config.mlp_alpha,
                early_stopping=True,
                max_iter=config.max_iter,
                random_state=config.seed + member,
            )
            fits.append(model.fit(x, y, sample_weight=sample_weight))
        # The mean of the fits' logits: their hidden units side by side, each output weight divided by their number.
        members = len(fits)
        self.hidden_weight.copy_(torch.from_numpy(np.concatenate([m.coefs_[0].T for m in fits])).float())
        self.hidden_bias.copy_(torch.from_numpy(np.concatenate([m.intercepts_[0] for m in fits])).float())
        self.weight.copy_(torch.from_numpy(np.concatenate([m.coefs_[1][:, 0] for m in fits]) / members).float())
        self.bias.copy_(torch.from_numpy(sum(m.intercepts_[1] for m in fits) / members).float())


PROBES: dict[str, type[Probe]] = {"logistic": LogisticProbe, "mlp": MLPProbe}
"""Probe kind -> its class: the one registration of a kind."""


def make_probe(config: ProbeConfig, hidden_size: int) -> Probe:
    """An unfitted probe of ``config.kind`` reading ``config.reads`` of width ``hidden_size`` each."""
    return PROBES[config.kind](config, hidden_size)


def check_weights(weights: Tensor, labels: Tensor) -> None:
    """Per-row fit weights, checked against ``labels`` ``[n]``: one finite, non-negative weight a row, and some weight
    on each label (a label of weight 0 would not be learnt at all)."""
    if not isinstance(weights, Tensor):
        raise TypeError(f"weights must be a tensor, got {type(weights).__name__}")
    if weights.shape != labels.shape:
        raise ValueError(f"expected one weight per row, [{len(labels)}], got {tuple(weights.shape)}")
    if not torch.isfinite(weights).all() or (weights < 0).any():
        raise ValueError("weights must be finite and non-negative")
    for label, name in ((0, "safe"), (1, "unsafe")):
        if not weights[labels == label].sum() > 0:
            raise ValueError(f"the {name} rows' weights sum to 0; the head would not learn them")


def balanced_weights(groups: Sequence[str], labels: Tensor, shares: Mapping[str, float] | None = None) -> Tensor:
    """Per-row weights under which every group (a source or domain) of each label weighs the same, and the two
    labels weigh the same in total: no single source dominates the fit, whatever its size. ``shares`` fixes some
    groups' share of their label's weight instead (``{"chat": 0.5}``: half of the benign weight on that group);
    the label's other groups split the rest alike. Mean 1."""
    labels = labels.to(torch.int64)
    shares = dict(shares or {})
    unknown = sorted(set(shares) - set(groups))
    if unknown:
        raise ValueError(f"shares name groups no row belongs to: {unknown}")
    if any(not 0.0 < share <= 1.0 for share in shares.values()):
        raise ValueError(f"a group's share of its label's weight is in (0, 1], got {shares}")
    weights = torch.zeros(len(groups), dtype=torch.float64)
    for label in (0, 1):
        rows = (labels == label).nonzero().flatten().tolist()
        names = sorted({groups[i] for i in rows})
        fixed = {name: shares[name] for name in names if name in shares}
        free = [name for name in names if name not in fixed]
        rest = 1.0 - sum(fixed.values())
        if rest < -1e-9 or (free and rest <= 0.0) or (not free and abs(rest) > 1e-9):
            raise ValueError(f"label {label}: the groups' shares {fixed} leave {rest:.3g} for the other groups {free}")
        for name in names:
            members = [i for i in rows if groups[i] == name]
            if name in fixed:
                weights[members] = fixed[name] / len(members)
            else:
                weights[members] = rest / (len(free) * len(members))
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

    balance: Balance = "source"
    """How rows were weighted: ``source`` (every source of each label weighs alike), ``none`` (every row alike),
    ``given`` (the caller's own weights)."""

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


def check_name_free(name: str, names: Sequence[str]) -> None:
    """Refuse ``name`` for a new head when a head in ``names`` has it, in any case: ``heads/Harm.safetensors`` and
    ``heads/harm.safetensors`` are one file on macOS and Windows, where such a guard folder (or its Hub repo, cloned)
    would lose a head's weights."""
    taken = next((other for other in names if other.casefold() == name.casefold()), None)
    if taken == name:
        raise ValueError(f"the guard already has a head named {name!r}")
    if taken is not None:
        raise ValueError(
            f"the guard already has a head named {taken!r}: {name!r} differs from it only in case, and their weights "
            "would be one file on macOS and Windows; choose another name"
        )


class SupervisedHead(nn.Module):
    """A named :class:`Probe` in a guard: scores the reads it needs out of all the guard recorded."""

    def __init__(self, config: SupervisedHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.probe = make_probe(config.probe, config.hidden_size)

    @property
    def name(self) -> str:
        """The head's name in its guard (reports' ``decided_by``, the budget's ``heads``)."""
        return self.config.name

    def extra_repr(self) -> str:
        config = self.config
        return f"name={config.name!r}, fitted on {config.n_unsafe} unsafe and {config.n_safe} safe rows"

    @property
    def reads(self) -> list[Read]:
        """The ``(layer, position)`` reads the head scores, in the order its features concatenate them."""
        return list(self.config.probe.reads)

    @torch.no_grad()
    def forward(self, reads: dict[Read, Tensor]) -> Tensor:
        """``[batch]`` probabilities of the rows of ``reads`` (each ``[batch, hidden]``)."""
        return self.probe(self.probe.features(reads))

    @torch.no_grad()
    def logit(self, reads: dict[Read, Tensor]) -> Tensor:
        """``[batch]`` log-odds of the rows of ``reads``: what :meth:`forward` passes through a sigmoid."""
        return self.probe.logit(self.probe.standardise(self.probe.features(reads)))

    @torch.no_grad()
    def explain(self, reads: dict[Read, Tensor], *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the feature dimensions that push its logit up most, largest first.

        Each term is ``z_i * g_i``, the standardised feature ``z_i = (x_i - mean_i) / scale_i`` times the gradient
        ``g_i`` of the logit with respect to it: for a logistic probe ``g = w`` and the terms sum to the logit less
        its bias; for an MLP ``g`` is the weight of the linear piece the row falls on (input times gradient). Each
        is a :class:`~hf_lsad.guard.types.FeatureContribution` with ``feature`` the dimension of the concatenated
        reads (``read_index * hidden_size + unit``), ``activation`` the row's value, ``contribution`` the term and
        ``typical`` the mean of the rows the head was fitted on.
        """
        probe = self.probe
        features = probe.features(reads).to(probe.mean.device, torch.float32)
        standard = probe.standardise(features)
        terms = standard * probe.local_weights(standard)  # [batch, width]
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

    @torch.no_grad()
    def explain_tokens(self, tokens: PromptTokens, *, top_k: int | None = 10) -> list[tuple[TokenContribution, ...]]:
        """Per row, the prompt tokens that raise the head's logit most, largest first.

        A token's contribution is the logit less the logit with that token's residual taken out of the mean over the
        prompt's real tokens, at every ``prompt_mean`` read (``prompt_last`` reads are kept as they are): what the
        head makes of the stream at that token. It does not follow what the token did to the other tokens' residuals
        through attention. Tokens whose stream is the same whatever the prompt says (``tokens.fixed``: the chat
        template's opening, or the first token) are in the mean but not listed. Rows of one real token, and heads
        without a ``prompt_mean`` read, list none.
        """
        missing = sorted({layer for layer, _ in self.reads} - set(tokens.hidden))
        if missing:
            raise KeyError(f"the supervised head reads blocks {missing}, whose token outputs were not kept")
        if all(position != "prompt_mean" for _, position in self.reads):
            return [()] * len(tokens.mask)
        probe = self.probe
        explained: list[tuple[TokenContribution, ...]] = []
        for r in range(len(tokens.mask)):
            real = tokens.mask[r].nonzero().flatten()  # [n] positions of the row's real tokens
            n = len(real)
            if n < 2:
                explained.append(())
                continue
            full, without = [], []
            for layer, position in self.reads:
                hidden = tokens.hidden[layer][r, real.to(tokens.hidden[layer].device)].float()  # [n, hidden]
                if position == "prompt_mean":
                    total = hidden.sum(0)
                    full.append(total / n)
                    without.append((total - hidden) / (n - 1))  # [n, hidden]: the mean without each token
                else:
                    full.append(hidden[-1])
                    without.append(hidden[-1].expand_as(hidden))
            logit = probe.logit(probe.standardise(torch.cat(full).unsqueeze(0)))  # [1]
            terms = logit - probe.logit(probe.standardise(torch.cat(without, dim=1)))  # [n]
            listed = torch.arange(n) >= int(tokens.fixed[r])
            terms = terms.masked_fill(~listed.to(terms.device), float("-inf"))
            k = int(listed.sum()) if top_k is None else min(top_k, int(listed.sum()))
            order = terms.topk(k).indices.tolist()
            ids = tokens.input_ids[r, real.to(tokens.input_ids.device)].tolist()
            explained.append(tuple(TokenContribution(i, int(ids[i]), float(terms[i])) for i in order))
        return explained
