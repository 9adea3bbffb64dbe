"""Leave-one-source-out selection of the supervised head (and its text baseline) on collected activations.

For every candidate (reads: layers and positions; regularisation) the protocol of
:mod:`hf_lsad.evaluation.sources` holds out each unsafe source and each benign domain in turn and reports
TPR / FPR at thresholds set on held-out benign chat (5% and 1%). A TF-IDF bag-of-words classifier trained on
the same rows runs through the same protocol: a head that does not beat it on a held-out source has learnt
wording, not intent.

The activations come from ``hf-lsad collect`` (one store per pool and read under ``folder``)::

    hf-lsad collect --pool chat --layer 8 12 16 20 24 --position prompt_last prompt_mean \
        --out artifacts/smollm2/chat          # and likewise for every pool of Settings.pools
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import (
    EVAL_DOMAINS,
    EVAL_SOURCES,
    SourceRows,
    leave_one_source_out,
    load_source_rows,
)
from hf_lsad.guard.heads import LogisticProbe, ProbeConfig, balanced_weights, make_probe
from hf_lsad.sae import SparseAutoencoder


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part (fitting, thresholds, held-out groups)."""
    candidates: list[list[list[Any]]] = field(
        default_factory=lambda: [
            [[16, "prompt_last"]],
            [[20, "prompt_last"]],
            [[16, "prompt_last"], [16, "prompt_mean"]],
            [[8, "prompt_mean"], [16, "prompt_mean"], [24, "prompt_mean"]],
        ]
    )
    """The reads of each candidate head: lists of ``[layer, position]``."""
    inverse_regularisation: list[float] = field(default_factory=lambda: [1.0])
    """Values of scikit-learn's ``C`` tried for each candidate."""
    evaluate_on: str = "validation"
    """``validation`` to choose among candidates, ``test`` to report the chosen one."""
    text_baseline: bool = True
    """Also run the TF-IDF bag-of-words baseline through the same protocol."""
    mlp_widths: list[int] = field(default_factory=list)
    """Hidden widths of a small MLP (the library's ``mlp`` probe: one ReLU layer, sources balanced as for the head)
    tried on each candidate's reads beside the logistic regression: the issue's "only if leave-one-source-out says it
    earns it"."""
    mlp_alphas: list[float] = field(default_factory=lambda: [1e-3])
    """L2 penalties (scikit-learn's ``alpha``) tried for each MLP width."""
    balance_powers: list[Any] = field(default_factory=lambda: [0.0])
    """How each MLP weighs its groups (sources and benign domains' sources), tried in turn: a group of ``n`` rows
    weighs ``n ** power`` within its label (:func:`tempered_weights`). ``0`` weighs every source alike, as the
    shipped head does (ShareGPT's 3,554 fit rows then weigh what vauban's 22 look-alikes weigh); ``1`` weighs every
    row alike; ``0.5`` between. A pair ``[benign, unsafe]`` sets each label's power."""
    mlp_seeds: list[int] = field(default_factory=list)
    """Seeds of each MLP's fit (its initial weights and early-stopping rows), each tried as its own candidate with the
    row splits fixed by ``seed``: how much a figure moves between fits of one configuration. Empty: ``seed``."""
    mlp_ensemble: int = 1
    """MLPs fitted with seeds ``seed .. seed + mlp_ensemble - 1`` whose probabilities are averaged: does a steadier
    head (the fits of one width vary with the seed) carry over better?"""
    mlp_members: int = 1
    """The library's own mean of fits (``ProbeConfig.mlp_members``): each MLP is that many fits, seeds ``fit seed``
    onwards, whose logits are averaged, one MLP of ``mlp_members`` times the width that a guard can ship."""
    source_directions: list[int] = field(default_factory=list)
    """Numbers ``k`` of source-style directions projected out of the standardised reads before the logistic fit (see
    :func:`nullspace_method`), tried on each candidate beside the plain head: does a head that cannot see which
    source a row came from carry over to a source it never saw?"""
    mass_mean: bool = False
    """Also try each candidate as a mass-mean probe (:func:`mass_mean_method`): the direction between the labels'
    source means, no fit. Probes of that kind are reported to carry over to unseen distributions better than a
    logistic fit (Marks & Tegmark, "The Geometry of Truth", 2023): does it flag fewer rows of an unseen benign
    domain?"""
    lda_shrinkage: list[float] = field(default_factory=list)
    """Shrinkages ``lambda`` tried for a linear discriminant on each candidate's reads (:func:`lda_method`): the
    mass-mean direction whitened by the rows' spread around their label's mean, the covariance shrunk towards its
    mean variance by ``lambda`` (1: the mass mean; near 0: close to what a linear fit finds). The spread between
    sources of one label is in that covariance, so the directions along which sources differ weigh less: does a head
    between the two flag fewer rows of an unseen benign domain at a price in harm a guard can pay?"""
    knn_neighbours: list[int] = field(default_factory=list)
    """Numbers ``k`` of nearest training rows tried as a head on each candidate's reads (:func:`knn_method`): a local
    score that does not extrapolate beyond the rows it knows. Does it flag fewer rows of an unseen benign domain
    than the heads that fit a boundary?"""
    knn_weighing: list[Literal["balanced", "similarity"]] = field(default_factory=lambda: ["balanced"])
    """How each neighbour's vote weighs, tried in turn: ``balanced`` (each source of a label alike, as the head's fit
    weighs its rows) or ``similarity`` (its cosine similarity to the row scored, every row alike)."""
    robust_objectives: list[list[Any]] = field(default_factory=list)
    """Objectives of a one-layer ReLU MLP (``robust_units`` wide, our own torch fit, see :func:`robust_method`) tried
    on each candidate's reads, each a pair ``[kind, strength]``: ``["balanced", 0]`` (every training source's mean
    loss weighing alike: the control, what the shipped head's weighing asks), ``["group_dro", step]`` (Group DRO,
    Sagawa et al. 2020: the sources' weights follow their losses by exponentiated gradient with that step, so the
    worst-fitted source leads) or ``["rex", penalty]`` (V-REx, Krueger et al. 2021: the balanced loss plus
    ``penalty`` times the variance of the sources' losses, proposed for what lies beyond the training sources). Does
    an objective that asks every source to be fitted alike carry over to a benign domain the fit never saw?"""
    robust_units: int = 256
    """Hidden units of each :func:`robust_method` MLP (the shipped head's 256)."""
    robust_alpha: float = 0.1
    """L2 penalty of each :func:`robust_method` MLP, as scikit-learn's ``alpha`` (the shipped head's 0.1)."""
    robust_steps: int = 600
    """Optimiser steps of each :func:`robust_method` fit (Adam, learning rate 1e-3)."""
    robust_rows_per_source: int = 16
    """Rows drawn from every training source at each step (with replacement), so every source is in every batch."""
    sae: str = ""
    """An SAE folder (``save_pretrained`` layout, e.g. the paper guard's ``sae/``, which reads layer 12 at the last
    prompt token): each candidate is also tried on the SAE's codes of its reads instead of the raw residual, the
    issue's "raw residual vs SAE codes". Empty: raw residual only."""
    held_out_sources: list[str] = field(default_factory=lambda: list(EVAL_SOURCES))
    """The unsafe sources held out one at a time (default: the seven the guard is judged on)."""
    held_out_domains: list[str] = field(default_factory=lambda: list(EVAL_DOMAINS))
    """The benign domains held out one at a time (default: the four the guard is judged on)."""
    seed: int = 0
    """Seed of the row splits."""


def probe_method(config: ProbeConfig, hidden_size: int):
    """The library's probe of ``config.kind`` (logistic or MLP), sources balanced as the guard's head is."""

    def fit(train: SourceRows):
        probe = make_probe(config, hidden_size)
        features = probe.features(train.features)
        probe.fit(features, train.labels, balanced_weights(train.sources, train.labels))
        return lambda rows: probe(probe.features(rows.features))

    return fit


def tempered_weights(groups: list[str], labels: torch.Tensor, power: float | Sequence[float]) -> torch.Tensor:
    """Per-row weights under which a group of ``n`` rows weighs ``n ** power`` of its label's total and the two labels
    weigh the same (``power=0``: :func:`~hf_lsad.guard.heads.balanced_weights`; ``1``: every row of a label alike;
    a pair: the benign label's power, then the unsafe label's)."""
    powers = (float(power), float(power)) if isinstance(power, (int, float)) else tuple(map(float, power))
    if powers == (0.0, 0.0):
        return balanced_weights(groups, labels)
    labels = labels.to(torch.int64)
    weights = torch.zeros(len(groups), dtype=torch.float64)
    for label in (0, 1):
        rows = (labels == label).nonzero().flatten().tolist()
        sizes = {name: sum(1 for i in rows if groups[i] == name) for name in {groups[i] for i in rows}}
        total = sum(n ** powers[label] for n in sizes.values())
        for i in rows:
            weights[i] = sizes[groups[i]] ** powers[label] / (total * sizes[groups[i]])
    return weights * len(groups) / weights.sum()


def mlp_method(config: ProbeConfig, hidden_size: int, members: int, power: float | Sequence[float]):
    """``members`` library probes of ``config`` (seeds ``config.seed`` onwards), groups weighed by
    :func:`tempered_weights`, their probabilities averaged (one member at power 0: :func:`probe_method`'s head)."""

    def fit(train: SourceRows):
        weights = tempered_weights(train.sources, train.labels, power)
        probes = []
        for member in range(members):
            probe = make_probe(replace(config, seed=config.seed + member), hidden_size)
            probe.fit(probe.features(train.features), train.labels, weights)
            probes.append(probe)
        return lambda rows: torch.stack([p(p.features(rows.features)) for p in probes]).mean(0)

    return fit


def standardised_reads(config: ProbeConfig, hidden_size: int, train: SourceRows):
    """``(standardise, standard)``: a map from rows to their concatenated reads standardised with the mean and scale
    of ``train`` (as :class:`LogisticProbe` standardises), and ``train``'s own standardised reads ``[n, width]``."""
    reader = LogisticProbe(config, hidden_size)
    features = reader.features(train.features).double()  # [n, width]
    mean, scale = features.mean(0), features.std(0).clamp_min(1e-6)

    def standardise(rows: SourceRows) -> torch.Tensor:
        return (reader.features(rows.features).double() - mean) / scale

    return standardise, (features - mean) / scale


def sklearn_scorer(model, transform):
    """A scorer of rows: a fitted scikit-learn ``model``'s probability of the unsafe label on ``transform(rows)``
    (a tensor or anything ``predict_proba`` takes)."""

    def score(rows: SourceRows) -> torch.Tensor:
        features = transform(rows)
        features = features.numpy() if isinstance(features, torch.Tensor) else features
        return torch.from_numpy(model.predict_proba(features)[:, 1]).float()

    return score


def means_by_source(standard: torch.Tensor, train: SourceRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each training source's mean standardised row ``[n_sources, width]`` and the source's label ``[n_sources]``."""
    names = sorted(set(train.sources))
    means = torch.stack([standard[[s == name for s in train.sources]].mean(0) for name in names])
    labels = torch.tensor([int(train.labels[train.sources.index(name)]) for name in names])
    return means, labels


def nullspace_method(config: ProbeConfig, hidden_size: int, k: int):
    """The logistic head restricted to the complement of the training sources' style.

    Style directions: the mean of each training source's standardised rows minus the mean of its label's source
    means (``[n_sources, width]``), whose top ``k`` right singular vectors span what tells sources of one label
    apart; they are projected out of the features before the fit. The difference between the labels' means
    (harm) is untouched, and the head stays linear in the reads (the projection folds into its weights).
    """
    from sklearn.linear_model import LogisticRegression

    def fit(train: SourceRows):
        standardise, standard = standardised_reads(config, hidden_size, train)
        source_means, source_labels = means_by_source(standard, train)
        label_means = torch.stack([source_means[source_labels == label].mean(0) for label in (0, 1)])
        style = source_means - label_means[source_labels]  # [n_sources, width]
        directions = torch.linalg.svd(style, full_matrices=False).Vh[:k]  # [k, width]

        def project(values: torch.Tensor) -> torch.Tensor:
            return values - (values @ directions.T) @ directions

        model = LogisticRegression(C=config.inverse_regularisation, max_iter=config.max_iter)
        weights = balanced_weights(train.sources, train.labels).numpy()
        model.fit(project(standard).numpy(), train.labels.numpy(), sample_weight=weights)
        return sklearn_scorer(model, lambda rows: project(standardise(rows)))

    return fit


def mass_mean_method(config: ProbeConfig, hidden_size: int):
    """Score: the standardised reads projected on the difference between the mean of the unsafe sources' means and
    the mean of the benign sources' means (each source weighing alike, as for the head). Nothing is fitted beyond the
    means, so nothing can fit a source's style beyond its mean."""

    def fit(train: SourceRows):
        standardise, standard = standardised_reads(config, hidden_size, train)
        source_means, source_labels = means_by_source(standard, train)
        direction = source_means[source_labels == 1].mean(0) - source_means[source_labels == 0].mean(0)  # [width]
        return lambda rows: (standardise(rows) @ direction).float()

    return fit


def lda_method(config: ProbeConfig, hidden_size: int, shrinkage: float):
    """Score: the standardised reads projected on ``inverse(covariance) @ (unsafe mean - benign mean)``, each label's
    mean the mean of its sources' means and the covariance that of every row around its label's mean, rows weighing
    as the head's fit weighs them (each source alike), shrunk as ``(1 - shrinkage) * covariance + shrinkage *
    mean variance * identity``."""
    if not 0.0 <= shrinkage <= 1.0:
        raise ValueError(f"lda_shrinkage must be in [0, 1], got {shrinkage}")

    def fit(train: SourceRows):
        standardise, standard = standardised_reads(config, hidden_size, train)  # [n, width]
        source_means, source_labels = means_by_source(standard, train)
        label_means = torch.stack([source_means[source_labels == label].mean(0) for label in (0, 1)])  # [2, width]
        weights = balanced_weights(train.sources, train.labels).double()  # [n]
        residuals = standard - label_means[train.labels.long()]  # [n, width]
        covariance = (residuals * weights[:, None]).T @ residuals / weights.sum()  # [width, width]
        target = covariance.diagonal().mean() * torch.eye(len(covariance), dtype=covariance.dtype)
        shrunk = (1.0 - shrinkage) * covariance + shrinkage * target
        direction = torch.linalg.solve(shrunk, label_means[1] - label_means[0])  # [width]
        return lambda rows: (standardise(rows) @ direction).float()

    return fit


def knn_method(config: ProbeConfig, hidden_size: int, neighbours: int, weighing: str):
    """Score: the weighted share of unsafe rows among the ``neighbours`` training rows nearest to a row (cosine
    similarity of the standardised reads, faiss's exact inner-product search). ``weighing`` is ``balanced`` (each
    neighbour weighs as :func:`~hf_lsad.guard.heads.balanced_weights` weighs its row) or ``similarity`` (its
    similarity, clamped at zero, every row alike). Nothing is fitted beyond the rows, so a row far from all of them
    is scored by whichever rows are least far, not by a boundary drawn past them."""
    import faiss

    if weighing not in ("balanced", "similarity"):
        raise ValueError(f"knn_weighing must be 'balanced' or 'similarity', got {weighing!r}")

    def fit(train: SourceRows):
        standardise, standard = standardised_reads(config, hidden_size, train)
        index = faiss.IndexFlatIP(standard.shape[1])
        index.add(torch.nn.functional.normalize(standard.float(), dim=1).numpy())
        row_weights = balanced_weights(train.sources, train.labels).float()
        unsafe = train.labels.float()

        def score(rows: SourceRows) -> torch.Tensor:
            query = torch.nn.functional.normalize(standardise(rows).float(), dim=1).numpy()
            similarity, found = index.search(query, neighbours)  # [n, neighbours] each
            found = torch.from_numpy(found)
            if weighing == "balanced":
                weights = row_weights[found]
            else:
                weights = torch.from_numpy(similarity).clamp_min(1e-6)
            return (weights * unsafe[found]).sum(1) / weights.sum(1)

        return score

    return fit


class SourceDraws:
    """The training sources of a fit that draws rows of every source at each step: each source's rows, its label and
    its weight in the loss (each label's sources weighing half, alike within it, as
    :func:`~hf_lsad.guard.heads.balanced_weights` weighs rows)."""

    def __init__(self, train: SourceRows) -> None:
        self.names = sorted(set(train.sources))
        self.members = [torch.tensor([i for i, s in enumerate(train.sources) if s == name]) for name in self.names]
        self.labels = torch.tensor([float(train.labels[int(rows[0])]) for rows in self.members])  # [sources]
        self.weights = torch.stack([1.0 / (2 * (self.labels == label).sum()) for label in self.labels])  # [sources]

    def draw(self, rows_per_source: int, generator: torch.Generator) -> torch.Tensor:
        """``[sources * rows_per_source]`` row indices, ``rows_per_source`` of each source in turn (with
        replacement)."""
        picks = [rows[torch.randint(len(rows), (rows_per_source,), generator=generator)] for rows in self.members]
        return torch.cat(picks)


ROBUST_OBJECTIVES = ("balanced", "group_dro", "rex")


def robust_method(
    config: ProbeConfig, hidden_size: int, objective: str, strength: float, steps: int, rows_per_source: int
):
    """A one-layer ReLU MLP of ``config.mlp_units`` units on the standardised reads, fitted by Adam on batches that
    draw ``rows_per_source`` rows of every training source, under ``objective``:

    - ``balanced``: the mean over sources of each source's mean loss, each label's sources weighing half (the
      weighing of :func:`~hf_lsad.guard.heads.balanced_weights`);
    - ``group_dro``: the sources' weights start there and are multiplied by ``exp(strength * loss)`` at every step
      (Group DRO's online update), so the loss of the worst-fitted sources leads;
    - ``rex``: the balanced loss plus ``strength`` times the variance of the sources' losses (V-REx).

    The L2 penalty is ``config.mlp_alpha`` as scikit-learn's MLP applies it (``alpha / 2 * |W|^2 / n``); seeded by
    ``config.seed``."""
    if objective not in ROBUST_OBJECTIVES:
        raise ValueError(f"a robust objective is one of {ROBUST_OBJECTIVES}, got {objective!r}")
    if strength < 0 or (objective == "balanced" and strength != 0):
        raise ValueError(f"{objective} takes a strength >= 0 (0 for balanced), got {strength}")

    def fit(train: SourceRows):
        standardise, standard = standardised_reads(config, hidden_size, train)  # [n, width]
        generator = torch.Generator().manual_seed(config.seed)
        sources = SourceDraws(train)
        weights = sources.weights.clone()
        x, y = standard.float(), train.labels.float()
        torch.manual_seed(config.seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(x.shape[1], config.mlp_units), torch.nn.ReLU(), torch.nn.Linear(config.mlp_units, 1)
        )
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
        penalty = config.mlp_alpha / (2 * len(x))
        for _ in range(steps):
            batch = sources.draw(rows_per_source, generator)  # [sources * rows_per_source]
            logits = model(x[batch]).squeeze(1)  # [sources * rows_per_source]
            per_row = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[batch], reduction="none")
            losses = per_row.view(len(sources.names), rows_per_source).mean(1)  # [sources]
            if objective == "group_dro":
                weights = weights * torch.exp(strength * losses.detach())
                weights = weights / weights.sum()
            loss = (weights * losses).sum() / weights.sum()
            if objective == "rex":
                loss = loss + strength * losses.var(unbiased=False)
            loss = loss + penalty * sum((layer.weight**2).sum() for layer in (model[0], model[2]))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        model.eval()

        @torch.no_grad()
        def score(rows: SourceRows) -> torch.Tensor:
            return torch.sigmoid(model(standardise(rows).float()).squeeze(1))

        return score

    return fit


def sae_method(config: ProbeConfig, sae):
    """The logistic head on the SAE's codes of each read (``[n, d_sae]`` per read) instead of the residual."""

    @torch.no_grad()
    def encode(rows: SourceRows) -> dict:
        return {read: sae.encode(rows.features[read].float()) for read in config.reads}

    def fit(train: SourceRows):
        probe = LogisticProbe(config, sae.config.d_sae)
        probe.fit(probe.features(encode(train)), train.labels, balanced_weights(train.sources, train.labels))
        return lambda rows: probe(probe.features(encode(rows)))

    return fit


def text_method(train: SourceRows):
    """TF-IDF unigrams and bigrams + logistic regression, sources balanced as for the head."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    matrix = vectorizer.fit_transform(train.texts)
    model = LogisticRegression(C=1.0, max_iter=2000)
    model.fit(matrix, train.labels.numpy(), sample_weight=balanced_weights(train.sources, train.labels).numpy())
    return sklearn_scorer(model, lambda rows: vectorizer.transform(rows.texts))


def run(settings: Settings) -> dict[str, Any]:
    reads = sorted({(int(layer), str(position)) for candidate in settings.candidates for layer, position in candidate})
    rows = load_source_rows(settings.folder, settings.pools, reads, seed=settings.seed)
    hidden = next(iter(rows.features.values())).shape[1]
    sae = SparseAutoencoder.from_pretrained(settings.sae).eval() if settings.sae else None
    if sae is not None and sae.config.d_in != hidden:
        raise ValueError(f"the SAE at {settings.sae} reads {sae.config.d_in} features, the stores hold {hidden}")
    results: dict[str, Any] = {"rows": len(rows), "candidates": {}}

    protocol = dict(
        evaluate_on=settings.evaluate_on, sources=settings.held_out_sources, domains=settings.held_out_domains
    )

    def progress(message: str) -> None:
        print(f"  {message}", flush=True)

    def judge(name: str, method) -> None:
        print(f"candidate {name}")
        table = leave_one_source_out(rows, method, progress=progress, **protocol)
        results["candidates"][name] = table
        print(f"  {table['summary@0.05']}")

    for candidate in settings.candidates:
        reads_of = " + ".join(f"L{layer} {position}" for layer, position in candidate)
        for c in settings.inverse_regularisation:
            config = ProbeConfig(reads=[tuple(read) for read in candidate], inverse_regularisation=c)
            judge(f"{reads_of}, C={c:g}", probe_method(config, hidden))
            if sae is not None:
                judge(f"{reads_of}, SAE codes, C={c:g}", sae_method(config, sae))
        for neighbours, weighing in itertools.product(settings.knn_neighbours, settings.knn_weighing):
            config = ProbeConfig(reads=[tuple(read) for read in candidate])
            judge(
                f"{reads_of}, {neighbours} nearest rows, {weighing} votes",
                knn_method(config, hidden, neighbours, weighing),
            )
        for shrinkage in settings.lda_shrinkage:
            config = ProbeConfig(reads=[tuple(read) for read in candidate])
            judge(f"{reads_of}, linear discriminant, shrinkage {shrinkage:g}", lda_method(config, hidden, shrinkage))
        if settings.mass_mean:
            config = ProbeConfig(reads=[tuple(read) for read in candidate])
            judge(f"{reads_of}, mass mean", mass_mean_method(config, hidden))
        for objective, strength in settings.robust_objectives:
            config = ProbeConfig(
                reads=[tuple(read) for read in candidate],
                kind="mlp",
                mlp_units=settings.robust_units,
                mlp_alpha=settings.robust_alpha,
                seed=settings.seed,
            )
            judge(
                f"{reads_of}, MLP {config.mlp_units}, {objective}" + (f" {strength:g}" if strength else ""),
                robust_method(
                    config,
                    hidden,
                    str(objective),
                    float(strength),
                    settings.robust_steps,
                    settings.robust_rows_per_source,
                ),
            )
        for k in settings.source_directions:
            config = ProbeConfig(reads=[tuple(read) for read in candidate])
            judge(f"{reads_of}, {k} source directions removed", nullspace_method(config, hidden, k))
        for width in settings.mlp_widths:
            for alpha in settings.mlp_alphas:
                for power, fit_seed in itertools.product(
                    settings.balance_powers, settings.mlp_seeds or [settings.seed]
                ):
                    name = f"{reads_of}, MLP {width}" + ("" if alpha == 1e-3 else f", alpha={alpha:g}")
                    if isinstance(power, (int, float)):
                        name += f", groups weigh n^{power:g}" if power else ""
                    else:
                        name += f", benign groups weigh n^{power[0]:g}, unsafe n^{power[1]:g}"
                    name += f", mean of {settings.mlp_ensemble} seeds" if settings.mlp_ensemble > 1 else ""
                    name += f", logits of {settings.mlp_members} fits" if settings.mlp_members > 1 else ""
                    name += f", fit seed {fit_seed}" if settings.mlp_seeds else ""
                    config = ProbeConfig(
                        reads=[tuple(read) for read in candidate],
                        kind="mlp",
                        mlp_units=width,
                        mlp_alpha=alpha,
                        seed=fit_seed,
                        mlp_members=settings.mlp_members,
                    )
                    judge(name, mlp_method(config, hidden, settings.mlp_ensemble, power))
    if settings.text_baseline:
        print("text baseline (TF-IDF)")
        results["text_baseline"] = leave_one_source_out(rows, text_method, **protocol)
    return results
