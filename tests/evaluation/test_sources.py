"""The leave-one-source-out protocol on synthetic rows whose answers are known."""

from __future__ import annotations

import pytest
import torch

from hf_lsad.core.splits import split_of
from hf_lsad.evaluation.sources import EVAL_DOMAINS, EVAL_SOURCES, SourceRows, leave_one_source_out, threshold_at
from hf_lsad.guard.heads import LogisticProbe, ProbeConfig, balanced_weights

READ = (1, "prompt_last")
DOMAINS = EVAL_DOMAINS


def synthetic_rows(n_per_group: int = 200, seed: int = 0) -> SourceRows:
    """Benign rows around 0 in four domains; each unsafe source around its own direction (all share axis 0)."""
    generator = torch.Generator().manual_seed(seed)
    features, ids, sources, domains, labels = [], [], [], [], []
    for domain in DOMAINS:
        features.append(torch.randn(n_per_group, 8, generator=generator))
        ids += [f"{domain}-{i}" for i in range(n_per_group)]
        sources += [domain] * n_per_group
        domains += [domain] * n_per_group
        labels += [0] * n_per_group
    for k, source in enumerate(EVAL_SOURCES):
        shift = torch.zeros(8)
        shift[0], shift[1 + k % 7] = 4.0, 2.0
        features.append(torch.randn(n_per_group, 8, generator=generator) + shift)
        ids += [f"{source}-{i}" for i in range(n_per_group)]
        sources += [source] * n_per_group
        domains += ["unsafe"] * n_per_group
        labels += [1] * n_per_group
    return SourceRows(
        features={READ: torch.cat(features)},
        ids=ids,
        texts=ids,
        sources=sources,
        domains=domains,
        labels=torch.tensor(labels),
        splits=[split_of(i) for i in ids],
    )


def probe_method(seen: list[set[str]]):
    def fit(train: SourceRows):
        seen.append(set(train.sources))
        probe = LogisticProbe(ProbeConfig(reads=[READ]), hidden_size=8)
        probe.fit(train.features[READ], train.labels, balanced_weights(train.sources, train.labels))
        return lambda rows: probe(rows.features[READ])

    return fit


def test_split_is_a_stable_hash_of_the_id_near_60_20_20():
    splits = [split_of(f"row-{i}") for i in range(5000)]
    assert splits == [split_of(f"row-{i}") for i in range(5000)]
    shares = {s: splits.count(s) / len(splits) for s in ("fit", "validation", "test")}
    assert shares["fit"] == pytest.approx(0.6, abs=0.03) and shares["test"] == pytest.approx(0.2, abs=0.03)
    assert split_of("row-1", seed=1) != split_of("row-1") or split_of("row-2", seed=1) != split_of("row-2")


def test_each_source_and_domain_is_held_out_of_the_fit_and_separable_harm_is_caught():
    seen: list[set[str]] = []
    result = leave_one_source_out(synthetic_rows(), probe_method(seen))
    for held_out, trained_on in zip([*EVAL_SOURCES, *DOMAINS], seen):
        assert held_out not in trained_on
    for source, entry in result["sources"].items():
        assert entry["rows"] > 0 and entry["tpr@0.05"] >= 0.9, source  # axis 0 is shared by every source
    for domain, entry in result["domains"].items():
        assert entry["fpr@0.05"] <= 0.25, domain  # the same distribution as the chat the threshold was set on
    summary = result["summary@0.05"]
    assert summary["worst_tpr"] <= summary["median_tpr"] and summary["worst_source"] in EVAL_SOURCES


def test_threshold_flags_the_requested_share_of_benign_rows():
    scores = torch.arange(1000, dtype=torch.float32)
    (threshold,) = threshold_at(scores, 0.05)
    assert (scores > threshold).float().mean().item() == pytest.approx(0.05, abs=0.002)


def test_two_heads_share_one_budget_and_their_union_meets_it():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2000, 2, generator=generator)  # two independent heads
    for shares in ([0.5, 0.5], [0.2, 0.8]):
        thresholds = threshold_at(scores, 0.05, shares)
        flagged = scores > torch.tensor(thresholds)
        assert flagged.any(1).float().mean().item() == pytest.approx(0.05, abs=0.002)
        rates = flagged.float().mean(0)
        assert (rates[0] < rates[1]) == (shares[0] < shares[1])  # the larger share flags more on its own


def test_a_two_headed_method_is_judged_by_the_union_of_its_heads():
    rows = synthetic_rows()

    def fit(train: SourceRows):
        probe = LogisticProbe(ProbeConfig(reads=[READ]), hidden_size=8)
        probe.fit(train.features[READ], train.labels, balanced_weights(train.sources, train.labels))
        # a second head that sees nothing: the union must still catch what the first catches, at the same budget
        return lambda r: torch.stack([probe(r.features[READ]), torch.rand(len(r), generator=torch.Generator())], 1)

    result = leave_one_source_out(rows, fit, shares=[0.9, 0.1])
    assert result["summary@0.05"]["median_tpr"] >= 0.9
    assert result["summary@0.05"]["median_domain_fpr"] <= 0.25


def test_balanced_weights_give_every_source_of_a_label_the_same_total():
    labels = torch.tensor([0] * 10 + [0] * 90 + [1] * 5 + [1] * 45)
    groups = ["a"] * 10 + ["b"] * 90 + ["c"] * 5 + ["d"] * 45
    weights = balanced_weights(groups, labels)
    totals = {g: float(weights[[i for i, x in enumerate(groups) if x == g]].sum()) for g in "abcd"}
    assert totals["a"] == pytest.approx(totals["b"]) == pytest.approx(totals["c"]) == pytest.approx(totals["d"])


def test_balanced_weights_give_a_named_group_its_share_of_its_label():
    labels = torch.tensor([0] * 10 + [0] * 90 + [0] * 30 + [1] * 5 + [1] * 45)
    groups = ["a"] * 10 + ["b"] * 90 + ["e"] * 30 + ["c"] * 5 + ["d"] * 45
    weights = balanced_weights(groups, labels, {"a": 0.6})
    totals = {g: float(weights[[i for i, x in enumerate(groups) if x == g]].sum()) for g in "abecd"}
    benign = totals["a"] + totals["b"] + totals["e"]
    assert totals["a"] / benign == pytest.approx(0.6) and totals["b"] == pytest.approx(totals["e"])
    assert benign == pytest.approx(totals["c"] + totals["d"]) and totals["c"] == pytest.approx(totals["d"])
    assert weights.mean().item() == pytest.approx(1.0)
    assert torch.equal(balanced_weights(groups, labels, {}), balanced_weights(groups, labels))
    with pytest.raises(ValueError, match="no row belongs to"):
        balanced_weights(groups, labels, {"z": 0.5})
    with pytest.raises(ValueError, match="leave"):
        balanced_weights(groups, labels, {"a": 0.6, "b": 0.4})  # nothing left for "e"
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        balanced_weights(groups, labels, {"a": 0.0})


def test_a_probe_needs_both_labels_and_finite_features_of_its_width():
    probe = LogisticProbe(ProbeConfig(reads=[READ]), hidden_size=8)
    with pytest.raises(ValueError, match="both safe"):
        probe.fit(torch.randn(10, 8), torch.zeros(10))
    with pytest.raises(ValueError, match="NaN"):
        probe.fit(torch.full((10, 8), float("nan")), torch.tensor([0, 1] * 5))
    with pytest.raises(ValueError, match="features per row"):
        probe(torch.randn(3, 9))
    with pytest.raises(ValueError, match="prompt_last/prompt_mean"):
        ProbeConfig(reads=[(1, "response_last")])
