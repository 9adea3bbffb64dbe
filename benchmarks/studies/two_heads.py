"""The two-headed guard against each of its heads alone, the way a user meets harm: leave one source out.

Three methods go through the protocol of :mod:`hf_lsad.evaluation.sources` (fit rows without the held-out group,
thresholds at 5% and 1% on validation chat, rates on the held-out group's ``evaluate_on`` rows):

- **anomaly**: the paper's head alone (the bundled paper guard: FreqMask-KM on SAE codes of layer 12, fitted on
  benign rows only), its raw score or its calibrated probability;
- **supervised**: the supervised head alone, of the kind in ``Settings.kind`` (the shipped one: an MLP of 256 ReLU
  units, ``heads/registry_mlp_width``) on the reads chosen by ``heads/registry_sources``;
- **two heads**: both, flagging when either exceeds its threshold, the thresholds sharing one budget
  (:func:`hf_lsad.guard.threshold.budget_thresholds`) at each anomaly share of ``Settings.anomaly_shares``.

Every run also fits the supervised head on every fit row and reports how far its logit follows the prompt's length
(:func:`length_correlation`). ``prompt_mean="after_opening"`` takes the chat template's opening out of every prompt
mean first (:func:`mean_after_opening`); ``system_turn_copies`` adds fit rows again under training system turns
(:mod:`studies.system_turns`).

With ``evaluate_on="test"`` the run also measures the guard as it ships (:func:`shipped`): the supervised head
fitted on the fit rows of every pool, thresholds on validation chat (with the budget's ``confidence``, as the
release sets them), and on test rows the flag rate of chat and of each benign domain, the TPR of each unsafe
source, and the rows only the anomaly head catches, by source. ``leave_one_out=False`` measures only that, on the
rows of ``evaluate_on`` (on validation rows, chat is the rows the thresholds were set on; the other domains and
the sources are held out of both the fit and the thresholds).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hf_lsad.data import GUARD_POOLS
from hf_lsad.evaluation.sources import (
    EVAL_DOMAINS,
    EVAL_SOURCES,
    Read,
    SourceRows,
    leave_one_source_out,
    load_source_rows,
    threshold_at,
    threshold_reference,
)
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.heads import ProbeConfig, SupervisedHead
from hf_lsad.guard.heads.training import fit_head
from hf_lsad.guard.threshold import union_flag_rate


@dataclass
class Settings:
    folder: str = "artifacts/smollm2"
    """Where the collected stores are (``<folder>/<pool>/layer<L>-<position>``)."""
    pools: list[str] = field(default_factory=lambda: list(GUARD_POOLS))
    """Pools whose rows take part."""
    anomaly_guard: str = "hf_lsad/guards/smollm2-135m-instruct-paper"
    """The paper's guard whose detector is the anomaly head (its read must be collected under ``folder``)."""
    anomaly_score: str = "score"
    """``score``: the anomaly head decides on its raw score; ``probability``: on its calibrated probability."""
    reads: list[list[Any]] = field(
        default_factory=lambda: [[16, "prompt_mean"], [20, "prompt_mean"], [24, "prompt_mean"]]
    )
    """The supervised head's reads (by default those chosen by ``heads/registry_sources`` and
    ``heads/registry_regularisation``; ``heads/two_heads_deep_reads4`` added layer 28, which the experiments of the
    shipped guard set)."""
    inverse_regularisation: float = 1.0
    """The supervised head's ``C``."""
    kind: str = "logistic"
    """The supervised head's kind: ``logistic`` or ``mlp`` (:class:`hf_lsad.guard.heads.ProbeConfig`)."""
    mlp_units: int = 128
    """An ``mlp`` head's hidden ReLU units."""
    mlp_alpha: float = 1e-3
    """An ``mlp`` head's L2 penalty."""
    mlp_members: int = 1
    """An ``mlp`` head's fits whose logits are averaged (``ProbeConfig.mlp_members``)."""
    anomaly_shares: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.5])
    """The anomaly head's share of the false-positive budget, tried in turn (the supervised head has the rest)."""
    evaluate_on: str = "validation"
    """``validation`` to choose the share, ``test`` to report."""
    confidence: float | None = None
    """Thresholds as a budget with this confidence sets them (``None``: the plain quantile of validation chat)."""
    leave_one_out: bool = True
    """Run leave-one-source-out; ``False``: only the guard as shipped, on the ``evaluate_on`` rows."""
    held_out_sources: list[str] = field(default_factory=lambda: list(EVAL_SOURCES))
    """The unsafe sources held out one at a time (default: the seven the guard is judged on)."""
    held_out_domains: list[str] = field(default_factory=lambda: list(EVAL_DOMAINS))
    """The benign domains held out one at a time (default: the four the guard is judged on)."""
    seed: int = 0
    """Seed of the row splits."""
    prompt_mean: str = "all"
    """What the supervised head's ``prompt_mean`` reads average: ``all`` the prompt's tokens, as collected and
    shipped; ``after_opening`` only those after the chat template's opening (:func:`mean_after_opening`)."""
    model: str = "default"
    """The model the stores were collected from (read by ``prompt_mean="after_opening"`` and ``system_turn_copies``)."""
    system_turn_copies: float = 0.0
    """Share of each source's fit rows added again, each under a training system turn of ``heads/system_turns``
    (:func:`studies.system_turns.copies_under_turns`, the same seed and cache); 0: none. A held-out source or domain
    takes its copies with it."""


def mean_after_opening(rows: SourceRows, model_name: str, check_rows: int = 12) -> tuple[SourceRows, dict[str, Any]]:
    """``rows`` with every ``prompt_mean`` read averaged over the tokens after the chat template's opening.

    The opening (the system turn and the user turn's header, ``TemplateMarkers.opening``) is the same in every
    templated prompt, and so, in a causal model, is the residual stream at its ``k`` tokens; the first of them holds
    the attention sink. Its share of a stored mean is ``k / n`` for a prompt of ``n`` tokens, so the stored mean
    carries the prompt's length. Without it: ``(n * mean - opening_sum) / (n - k)``, exact up to float round-off,
    with ``opening_sum`` from one forward pass over the opening alone. Checked against a forward pass over
    ``check_rows`` rows spread over the pools (the largest deviation is returned with ``k``)."""
    from hf_lsad.capture.collect import encode_prompts, prompt_token_lengths
    from hf_lsad.capture.pretrained import load_model
    from hf_lsad.capture.recorder import PromptReader
    from hf_lsad.core.hook_point import decoder_layer
    from hf_lsad.core.prompt_inputs import template_opening

    model, tokenizer = load_model(model_name)
    opening = template_opening(tokenizer)
    if not opening:
        raise ValueError(f"{model_name}'s tokenizer has no chat template opening to take out")
    layers = sorted({layer for layer, position in rows.features if position == "prompt_mean"})
    modules = {layer: decoder_layer(model, layer)[1] for layer in layers}

    def read(input_ids: torch.Tensor, mask: torch.Tensor) -> PromptReader:
        with torch.no_grad(), PromptReader(modules, mask, stop_after=False, input_ids=input_ids) as reader:
            model(input_ids=input_ids, attention_mask=mask, use_cache=False)
        return reader

    ids = torch.tensor([opening])
    opening_sum = {layer: hidden[0].sum(0) for layer, hidden in read(ids, torch.ones_like(ids)).hidden.items()}
    k = len(opening)
    lengths = torch.tensor(prompt_token_lengths(tokenizer, rows.texts), dtype=torch.float32)[:, None]  # [n, 1]
    if bool((lengths <= k).any()):
        raise ValueError("a prompt holds no token after the template's opening")
    features = dict(rows.features)
    for (layer, position), values in rows.features.items():
        if position == "prompt_mean":
            features[(layer, position)] = (lengths * values - opening_sum[layer]) / (lengths - k)  # [n, hidden]
    derived = replace(rows, features=features)

    # The check: the same rows read by a forward pass, their mean over the tokens after the opening.
    picks = torch.linspace(0, len(rows) - 1, check_rows).long().tolist()
    encoded = encode_prompts(tokenizer, [rows.texts[i] for i in picks], padding_side="right")
    reader = read(encoded["input_ids"], encoded["attention_mask"])
    deviation = 0.0
    for row, i in enumerate(picks):
        n = int(encoded["attention_mask"][row].sum())
        if encoded["input_ids"][row, :k].tolist() != list(opening):
            raise ValueError(f"row {rows.ids[i]} does not start with the template's opening")
        for layer in layers:
            direct = reader.hidden[layer][row, k:n].mean(0)
            deviation = max(deviation, float((derived.features[(layer, "prompt_mean")][i] - direct).abs().max()))
    return derived, {"opening_tokens": k, "checked_rows": len(picks), "largest_deviation": deviation}


def anomaly_scores(guard: SafetyGuard, features: dict[Read, torch.Tensor], kind: str) -> torch.Tensor:
    """The anomaly head's deciding quantity for every row of ``features`` (``[n, hidden]`` per read): its raw score,
    or its calibrated probability."""
    read = guard.reads[0]
    out = []
    for start in range(0, len(features[read]), 4096):
        batch = features[read][start : start + 4096]
        scores, clusters = guard.detector(batch, guard.sae)
        out.append(scores if kind == "score" else guard.calibration.probabilities(scores, clusters))
    return torch.cat(out).float()


def probe_config(settings: Any) -> ProbeConfig:
    """The supervised head's :class:`ProbeConfig` from a study's settings (``reads``, ``kind``,
    ``inverse_regularisation``, ``mlp_units``, ``mlp_alpha``, ``mlp_members``, ``seed``)."""
    return ProbeConfig(
        reads=[tuple(r) for r in settings.reads],
        kind=settings.kind,
        inverse_regularisation=settings.inverse_regularisation,
        mlp_units=settings.mlp_units,
        mlp_alpha=settings.mlp_alpha,
        mlp_members=settings.mlp_members,
        seed=settings.seed,
    )


def anomaly_lookup(anomaly: dict[str, float]) -> Callable[[SourceRows], torch.Tensor]:
    """A scorer of rows by the anomaly head's scores computed once for every row (``{row id: score}``)."""
    return lambda rows: torch.tensor([anomaly[i] for i in rows.ids])


def two_headed(anomaly_of: Callable[[SourceRows], torch.Tensor], head: SupervisedHead):
    """A scorer of rows: ``[n, 2]``, the anomaly head's score beside the supervised head's."""
    return lambda rows: torch.stack([anomaly_of(rows), head(rows.features)], dim=1)


def fit_supervised(train: SourceRows, config: ProbeConfig) -> SupervisedHead:
    """The ``harm`` head as the release fits it (:func:`hf_lsad.guard.heads.training.fit_head`, sources alike)."""
    return fit_head("harm", train.features, train.labels, train.sources, config)


def length_correlation(rows: SourceRows, head: SupervisedHead, settings: Settings) -> dict[str, Any]:
    """How much the head's logit follows the prompt's length in tokens: per benign domain and over the unsafe rows,
    Spearman's rank correlation of the two, and the rows' median length."""
    from scipy.stats import spearmanr

    from hf_lsad.capture.collect import prompt_token_lengths
    from hf_lsad.capture.pretrained import load_tokenizer

    lengths = torch.tensor(prompt_token_lengths(load_tokenizer(settings.model), rows.texts), dtype=torch.float64)
    logits = head(rows.features).double()
    out: dict[str, Any] = {}
    for domain in sorted(set(rows.domains)):
        mask = torch.tensor([d == domain for d in rows.domains])
        rho = spearmanr(logits[mask].numpy(), lengths[mask].numpy()).statistic
        out[domain] = {"rows": int(mask.sum()), "spearman": float(rho), "median_tokens": float(lengths[mask].median())}
    return out


def run(settings: Settings) -> dict[str, Any]:
    if settings.prompt_mean not in ("all", "after_opening"):
        raise ValueError(f"prompt_mean must be 'all' or 'after_opening', got {settings.prompt_mean!r}")
    guard = SafetyGuard.from_pretrained(settings.anomaly_guard)
    config = probe_config(settings)
    reads = sorted({guard.reads[0], *config.reads})
    rows = load_source_rows(settings.folder, settings.pools, reads, seed=settings.seed)
    results: dict[str, Any] = {"rows": len(rows), "methods": {}}
    if settings.prompt_mean == "after_opening":
        rows, results["prompt_mean_check"] = mean_after_opening(rows, settings.model)
        print(f"prompt means without the template's opening: {results['prompt_mean_check']}")
    if settings.system_turn_copies:
        from . import system_turns

        turned = system_turns.Settings(
            folder=settings.folder,
            pools=settings.pools,
            model=settings.model,
            augment_share=settings.system_turn_copies,
            seed=settings.seed,
        )
        copies = system_turns.copies_under_turns(rows, turned, system_turns.TurnCollector(turned, reads))
        rows = system_turns.join_rows(rows, copies)
        results["system_turn_copies"] = len(copies)
        print(f"{len(copies)} fit rows copied under a training system turn", flush=True)
    anomaly = anomaly_scores(guard, rows.features, settings.anomaly_score)
    anomaly_of = anomaly_lookup(dict(zip(rows.ids, anomaly.tolist())))

    def anomaly_method(train: SourceRows):
        return anomaly_of

    # The supervised head alone and each share of the two heads hold out the same rows: fit each training set once.
    fitted: dict[tuple[str, ...], SupervisedHead] = {}

    def fitted_on(train: SourceRows) -> SupervisedHead:
        key = tuple(train.ids)
        if key not in fitted:
            fitted[key] = fit_supervised(train, config)
        return fitted[key]

    def supervised_method(train: SourceRows):
        head = fitted_on(train)
        return lambda r: head(r.features)

    def two_headed_method(train: SourceRows):
        return two_headed(anomaly_of, fitted_on(train))

    def progress(message: str) -> None:
        print(f"  {message}", flush=True)

    protocol = dict(
        evaluate_on=settings.evaluate_on,
        sources=settings.held_out_sources,
        domains=settings.held_out_domains,
        confidence=settings.confidence,
    )
    if settings.leave_one_out:
        print("anomaly head alone")
        results["methods"]["anomaly"] = leave_one_source_out(rows, anomaly_method, **protocol)
        print("supervised head alone")
        results["methods"]["supervised"] = leave_one_source_out(rows, supervised_method, progress=progress, **protocol)
        for share in settings.anomaly_shares:
            print(f"two heads, anomaly share {share:g}")
            results["methods"][f"two heads, anomaly share {share:g}"] = leave_one_source_out(
                rows, two_headed_method, shares=[share, 1 - share], progress=progress, **protocol
            )
    fitted_head = fitted_on(rows.select(rows.where(split="fit")))
    results["length"] = length_correlation(rows.select(rows.where(split=settings.evaluate_on)), fitted_head, settings)
    if not settings.leave_one_out or settings.evaluate_on == "test":
        scores = two_headed(anomaly_of, fitted_head)
        results["shipped"] = {
            f"anomaly share {share:g}": shipped(rows, scores, share, settings.confidence, settings.evaluate_on)
            for share in settings.anomaly_shares
        }
    return results


def shipped(
    rows: SourceRows,
    scores: Callable[[SourceRows], torch.Tensor],
    share: float,
    confidence: float | None,
    evaluate_on: str,
) -> dict[str, Any]:
    """The guard as it ships, on the ``evaluate_on`` rows: ``scores`` the two heads with the supervised one fitted on
    every fit row (:func:`two_headed`), thresholds on validation chat (5% and 1%)."""
    evaluated = rows.select(rows.where(split=evaluate_on))
    chat = threshold_reference(rows)

    out: dict[str, Any] = {}
    benign_scores, evaluated_scores = scores(chat), scores(evaluated)
    for fpr in (0.05, 0.01):
        thresholds = threshold_at(benign_scores, fpr, [share, 1 - share], confidence)
        flags = evaluated_scores > torch.tensor(thresholds)
        flagged = flags.any(1)
        only_anomaly = flags[:, 0] & ~flags[:, 1]
        entry: dict[str, Any] = {
            "thresholds": thresholds,
            "confidence": confidence,
            "validation_chat_fpr": union_flag_rate(benign_scores, thresholds),
            "domains": {},
            "benign_sources": {},
            "sources": {},
            "only_anomaly": {},
        }
        for domain in sorted(set(evaluated.domains) - {"unsafe"}):
            mask = torch.tensor([d == domain for d in evaluated.domains])
            entry["domains"][domain] = {"rows": int(mask.sum()), "fpr": float(flagged[mask].double().mean())}
        for source, label in sorted(set(zip(evaluated.sources, evaluated.labels.tolist()))):
            mask = torch.tensor([s == source for s in evaluated.sources])
            rate = float(flagged[mask].double().mean())
            if label == 0:
                entry["benign_sources"][source] = {"rows": int(mask.sum()), "fpr": rate}
            else:
                entry["sources"][source] = {"rows": int(mask.sum()), "tpr": rate}
                entry["only_anomaly"][source] = int(only_anomaly[mask].sum())
        tprs = [v["tpr"] for v in entry["sources"].values()]
        entry["median_source_tpr"], entry["worst_source_tpr"] = statistics.median(tprs), min(tprs)
        out[f"at {fpr:g}"] = entry
    return out
