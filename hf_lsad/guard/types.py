"""A guard's plain records: :class:`GuardConfig` (``config.json``'s ``guard`` block), :class:`BudgetConfig` (how a
guard with several heads split its false-positive budget), :class:`GuardOutput` (what
:meth:`hf_lsad.guard.SafetyGuard.forward` returns), :class:`HeadVerdict` (one head's part in a verdict),
:class:`FeatureContribution` and :class:`TokenContribution` (explanations), :class:`SafetyReport` (the verdict on one
sequence) and :class:`ModelFingerprint` (what the model the thresholds were set through made of fixed prompts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..core.hook_point import HookPoint
from ..core.validation import CONFIDENCE, NON_NEGATIVE, OPEN_UNIT, POSITIVE, check_ranges, ranged

ANOMALY_HEAD = "anomaly"
"""The name of the paper's head (the guard's detector, SAE and calibration), always the first head."""


@dataclass
class GuardConfig:
    """Everything about a guard that is not a tensor."""

    hook: HookPoint
    """Where the guard reads the model."""

    method: str
    """Registered detector method (``freqmask-km``, ...)."""

    threshold: float
    """Scores strictly above this are flagged."""

    target_fpr: float = ranged(OPEN_UNIT)
    """Safe false-positive rate the threshold was set for on held-out safe data."""

    n_fit: int = ranged(POSITIVE)
    """Safe activations the detector was fitted on."""

    n_holdout: int = ranged(POSITIVE)
    """Held-out safe activations the threshold was set on."""

    seed: int = ranged(NON_NEGATIVE)
    """Seed of the fit/held-out split."""

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass
class BudgetConfig:
    """How a guard with several heads shares one false-positive budget (``config.json``'s ``budget`` block).

    Head ``h`` flags the rows whose score exceeds ``thresholds[h]``; the thresholds were set together on
    ``n_rows`` held-out benign rows (``rows`` says which) so that the rows flagged by *any* head are at most
    ``target_fpr`` of them, head ``h`` taking ``shares[h]`` of the budget
    (:func:`hf_lsad.guard.threshold.budget_thresholds`); with a ``confidence``, so that fresh rows of the same kind
    are flagged at most at ``target_fpr`` with that probability.
    """

    heads: list[str]
    """The heads in order: ``"anomaly"`` first, then the supervised heads."""

    shares: list[float]
    """Each head's share of the budget (positive, summing to 1)."""

    thresholds: list[float]
    """Each head flags a score strictly above its threshold (the anomaly head: its calibrated probability for a
    calibrated guard, its score otherwise; a supervised head: its probability)."""

    target_fpr: float = ranged(OPEN_UNIT)
    """The combined flag rate asked for on held-out benign rows."""

    measured_fpr: float = ranged(NON_NEGATIVE)
    """The combined flag rate on those rows with these thresholds."""

    n_rows: int = ranged(POSITIVE)
    """Held-out benign rows the thresholds were set on."""

    rows: str = "validation chat"
    """Which rows those were."""

    confidence: float | None = ranged(CONFIDENCE, None)
    """``None``: the rows flagged are at most ``target_fpr`` of the ``n_rows`` (fresh rows: about ``target_fpr``, above
    it about half the time); a number ``c``: few enough are flagged that fresh rows of the same kind are flagged at
    most at ``target_fpr`` with probability ``c`` (:func:`hf_lsad.guard.threshold.allowed_flags`). Folders written
    before this field existed load as ``None``."""

    def __post_init__(self) -> None:
        check_ranges(self)
        if not (len(self.heads) == len(self.shares) == len(self.thresholds)) or not self.heads:
            raise ValueError(
                f"budget: {len(self.heads)} heads, {len(self.shares)} shares, {len(self.thresholds)} thresholds"
            )
        if self.heads[0] != ANOMALY_HEAD or len(set(self.heads)) != len(self.heads):
            raise ValueError(f"budget heads must be distinct and start with {ANOMALY_HEAD!r}, got {self.heads}")
        if any(share <= 0 for share in self.shares) or abs(sum(self.shares) - 1.0) > 1e-6:
            raise ValueError(f"budget shares must be positive and sum to 1, got {self.shares}")


class FeatureContribution(NamedTuple):
    """One feature's part in a score: an SAE feature's for the anomaly head, a dimension of its reads' for a
    supervised head (:meth:`hf_lsad.guard.heads.SupervisedHead.explain`)."""

    feature: int
    """The anomaly head: index of the SAE feature (column of the SAE's encoder). A supervised head: dimension of its
    concatenated reads, ``read_index * hidden_size + unit`` (``read_index`` in the order of its ``reads``)."""
    activation: float
    """The row's value of the feature (the anomaly head: its SAE code; a supervised head: the residual's unit)."""
    contribution: float
    """The feature's term of the score (module docstring). The anomaly head: the terms over all masked features sum
    to the score; a supervised head: standardised value times the logit's gradient (input times gradient)."""
    typical: float
    """The anomaly head: the assigned cluster's typical activation of the feature (centroid value); a supervised
    head: the mean of the rows it was fitted on."""


class TokenContribution(NamedTuple):
    """One prompt token's part in a supervised head's score (:meth:`hf_lsad.guard.heads.SupervisedHead.explain_tokens`):
    how much the head's logit falls when the residual stream at that token leaves the mean over the prompt."""

    position: int
    """Index of the token among its row's real tokens (0: the first; padding is not counted, so a row names the same
    positions in any batch)."""
    token_id: int
    """The token (``tokenizer.decode([token_id])`` is its text)."""
    contribution: float
    """The head's logit less its logit without this token's residual in its ``prompt_mean`` reads."""

    def text(self, tokenizer: Any) -> str:
        """The token as text."""
        return str(tokenizer.decode([self.token_id]))


class GuardOutput(NamedTuple):
    """What a guard's forward returns for a batch of reads."""

    scores: Tensor
    """Anomaly score per row, ``[batch]``."""
    clusters: Tensor
    """Assigned cluster per row (``-1`` for methods without clusters)."""
    flagged: Tensor
    """``[batch]`` bool: flagged by any head (a single-head guard: ``scores > threshold``)."""
    head_scores: dict[str, Tensor] | None = None
    """A guard with supervised heads: each head's ``[batch]`` scores (the anomaly head's deciding quantity)."""


class BoundaryRows(NamedTuple):
    """The benign rows nearest the guard's thresholds, of a set of benign rows (those the thresholds were set on,
    where they are bundled rows), with the verdicts the model the thresholds were set through gave them
    (:func:`hf_lsad.guard.fingerprint.boundary_rows`): read again through another model, the verdicts that change
    estimate how far its flag rate on the whole set moved."""

    input_ids: Tensor
    """``[rows, tokens]`` int64: the rows as the model read them (template and system turn included), left-padded."""
    attention_mask: Tensor
    """``[rows, tokens]`` int64: 1 at real tokens, 0 at the padding."""
    flagged: Tensor
    """``[rows]`` int64 0/1: the guard's verdict on each row, read in this batch."""
    n_rows: int
    """How many rows the set holds (these are the nearest of them to the thresholds)."""
    flagged_rows: int
    """How many of the set the guard flagged through the model."""
    rows: str
    """What the set is (e.g. ``"validation chat"``)."""

    def check(self) -> None:
        """Raise ``ValueError`` unless the rows are well-formed."""
        ids, mask, flagged = self.input_ids, self.attention_mask, self.flagged
        if ids.dtype != torch.int64 or ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(
                f"boundary input_ids must be int64 [rows >= 1, tokens], got {ids.dtype} {tuple(ids.shape)}"
            )
        if mask.dtype != torch.int64 or mask.shape != ids.shape or not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"boundary attention_mask must be int64 0/1 of shape {tuple(ids.shape)}")
        if not mask[:, -1].all() or (ids < 0).any():
            raise ValueError("boundary rows must be left-padded token ids (>= 0) ending at a real token")
        if (
            flagged.dtype != torch.int64
            or flagged.shape != (ids.shape[0],)
            or not ((flagged == 0) | (flagged == 1)).all()
        ):
            raise ValueError(f"boundary flagged must be int64 0/1 of shape ({ids.shape[0]},)")
        if not 0 <= self.flagged_rows <= self.n_rows or self.n_rows < ids.shape[0]:
            raise ValueError(
                f"boundary rows: {self.flagged_rows} flagged of {self.n_rows} rows, {ids.shape[0]} of them kept"
            )
        if int(flagged.sum()) > self.flagged_rows or int((1 - flagged).sum()) > self.n_rows - self.flagged_rows:
            raise ValueError("boundary rows: more kept rows flagged (or not) than the rows they were drawn from")


class ModelFingerprint(NamedTuple):
    """Every head's scores on the probe prompts as the model the guard's thresholds were set through read them
    (:mod:`hf_lsad.guard.fingerprint`), and the benign rows nearest the thresholds with their verdicts; saved in the
    guard folder's ``fingerprint.safetensors``."""

    heads: tuple[str, ...]
    """The guard's heads when it was recorded, in order (the rows of :attr:`scores`)."""
    input_ids: Tensor
    """``[probes, tokens]`` int64: the probe prompts as the model read them (template and system turn included),
    left-padded."""
    attention_mask: Tensor
    """``[probes, tokens]`` int64: 1 at real tokens, 0 at the padding."""
    scores: Tensor
    """``[heads, probes]`` float64: each head's score on each probe before any map to a probability
    (:meth:`hf_lsad.guard.SafetyGuard.raw_head_scores`)."""
    boundary: BoundaryRows | None = None
    """The benign rows nearest the thresholds (``None``: not recorded). They are recorded from rows the guard folder
    may carry: the bundled rows, or a user's own prompts only when asked (``keep_nearest=True``)."""

    def check(self, head_names: list[str]) -> None:
        """Raise ``ValueError`` unless the fingerprint is well-formed and recorded for the heads ``head_names``."""
        if list(self.heads) != list(head_names):
            raise ValueError(f"the fingerprint was recorded for heads {list(self.heads)}, the guard has {head_names}")
        ids, mask, scores = self.input_ids, self.attention_mask, self.scores
        if ids.dtype != torch.int64 or ids.ndim != 2 or ids.shape[0] < 2 or ids.shape[1] < 1:
            got = f"{ids.dtype} {tuple(ids.shape)}"
            raise ValueError(f"fingerprint input_ids must be int64 [probes >= 2, tokens], got {got}")
        if mask.dtype != torch.int64 or mask.shape != ids.shape or not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"fingerprint attention_mask must be int64 0/1 of shape {tuple(ids.shape)}")
        if not mask[:, -1].all() or (ids < 0).any():
            raise ValueError("fingerprint rows must be left-padded token ids (>= 0) ending at a real token")
        if scores.dtype != torch.float64 or scores.shape != (len(self.heads), ids.shape[0]):
            expected = (len(self.heads), ids.shape[0])
            raise ValueError(f"fingerprint scores must be float64 {expected}, got {scores.dtype} {tuple(scores.shape)}")
        if not torch.isfinite(scores).all() or not (scores.std(dim=1) > 0).all():
            raise ValueError("fingerprint scores must be finite and spread over the probes for every head")
        if self.boundary is not None:
            self.boundary.check()


SHIFT_TOLERANCE = 0.15
"""The largest shift (:func:`hf_lsad.guard.fingerprint.score_shift`) a model may give any head and still be guarded at
the recorded thresholds. Measured by ``heads/score_shift`` on the bundled guard: float16 and bfloat16 shift it by
0.003 and 0.025; two LoRA fine-tunes merged into the weights are refused from their 8th and their 1st optimiser step
of 60. ``heads/quant_shift``: the bundled Q4_1 weights quantised again in Q5_1, Q5_0 and Q4_0, and copies as far from
them as the float weights, are refused (0.27-1.42); in Q8_0 they shift it by 0.07 and pass the probes, with 6 of 270
test verdicts changed (the rows nearest the thresholds refuse them: :data:`RATE_TOLERANCE`)."""

RATE_TOLERANCE = 0.20
"""The largest change of the estimated flag rate on the boundary rows' set
(:func:`hf_lsad.guard.fingerprint.boundary_flag_rate`), relative to the recorded rate, that a model may make and
still be guarded at the recorded thresholds. Chosen by ``heads/boundary_rows`` on validation rows, by a rule stated
before the run: the smallest of 0.10-0.50 at which both bundled guards pass float16, bfloat16 and Gaussian noise at
0.5% and 1% of each matrix's spread (they move the two-headed guard's estimate by 1, 4, 10 and 11 of its 55 flagged
rows of 1,338). At it, the bundled weights requantised in Q8_0, which the probes pass, are refused (70 against 55)."""


class HeadVerdict(NamedTuple):
    """One head's part in a verdict."""

    name: str
    """``"anomaly"`` (the paper's head) or the name of a supervised head."""
    score: float
    """What the head compares with its threshold: a supervised head's probability of its kind of harm; the anomaly
    head's calibrated probability (calibrated) or score."""
    threshold: float
    flagged: bool
    """``score > threshold``."""


class SafetyReport(NamedTuple):
    """The verdict on one sequence.

    ``flagged`` is the guard's verdict. ``score``, ``threshold``, ``cluster``, ``probability`` and ``p_value`` are
    the anomaly head's (the paper's detector), with or without supervised heads beside it; every head's score and
    threshold is in :attr:`heads`, and :attr:`decided_by` names the heads that flagged the row."""

    score: float
    """The anomaly head's score."""
    threshold: float
    """The anomaly head's score threshold; for a calibrated guard, the probability threshold it uses."""
    flagged: bool
    """The guard's verdict: some head above its threshold (in guarded generation, at some step), or a row that could
    not be scored (:attr:`error`)."""
    cluster: int
    """The anomaly head's cluster for the row."""
    probability: float | None
    """The anomaly head's calibrated probability of being unsafe; ``None`` for an uncalibrated guard. A supervised
    head's probability is its score in :attr:`heads`."""
    p_value: float | None = None
    """Conformal p-value of the anomaly head's score against the held-out safe scores
    (:func:`hf_lsad.guard.threshold.conformal_p_values`):
    ``0.008`` reads "more unusual than 99.2% of safe prompts". ``None`` for a guard saved without them."""
    error: str | None = None
    """Why this row could not be scored (e.g. a NaN activation), ``None`` when it was.

    A row that could not be scored fails closed: ``flagged`` is ``True``, ``score`` (and a
    calibrated ``probability``) ``nan`` and ``cluster`` ``-1``."""

    step: int | None = None
    """Guarded generation only: the step at which the row was flagged (0: at the prefill, before any
    new token; ``t``: after ``t`` new tokens), ``None`` if it was not flagged or not scored during generation."""
    stopped: bool = False
    """Whether guarded generation ended the row when it was flagged (``on_flag="stop"``)."""
    features: tuple[FeatureContribution, ...] | None = None
    """With ``explain=True``: the features with the largest contributions to the score of the head that decided
    (:attr:`explained_head`: the first flagging head; the anomaly head when none flagged). For the anomaly head they
    are SAE features (:mod:`hf_lsad.guard.explain`), for a supervised head dimensions of its reads
    (:meth:`hf_lsad.guard.heads.SupervisedHead.explain`; :attr:`tokens` says which prompt tokens matter)."""
    heads: tuple[HeadVerdict, ...] = ()
    """A guard with supervised heads: every head's score and threshold, the anomaly head first. Empty for a
    single-head guard (its one verdict is ``score`` / ``probability`` against ``threshold``)."""
    decided_by: tuple[str, ...] = ()
    """The heads that flagged the row (empty when none did, or the row could not be scored)."""
    reading: str | None = None
    """``"known"``: a supervised head recognised a kind of harm it was trained on; ``"novel"``: only the anomaly
    head objected; ``None``: not flagged, or a single-head guard."""
    tokens: tuple[TokenContribution, ...] | None = None
    """With ``explain=True``, when the head explained (:attr:`explained_head`) is a supervised head that averages the
    prompt (a ``prompt_mean`` read): the prompt tokens that raise its logit most, largest first. ``None`` otherwise
    (the anomaly head reads one token)."""

    @property
    def explained_head(self) -> str:
        """The head whose score ``features`` and ``tokens`` explain: the first head that flagged the row, else the
        anomaly head."""
        return next((head.name for head in self.heads if head.flagged), ANOMALY_HEAD)

    def describe(self) -> str:
        """One line a person can read, comparing the quantity that decided the verdict with its threshold.

        Calibrated: ``ok: P(unsafe) 0.127 <= 0.7013 (score 49.62, cluster 17, p-value 0.375)``;
        uncalibrated: ``FLAGGED: score 301.2 > 230.5 (cluster 3, p-value 0.002)``; with supervised heads:
        ``FLAGGED by harm (known): anomaly 0.1271 <= 0.9602; harm 0.9885 > 0.3574 (anomaly cluster 17, p-value
        0.375)``."""
        verdict = "FLAGGED" if self.flagged else "ok"
        if self.error is not None:
            return f"{verdict}: not scored ({self.error})"
        sign = ">" if self.flagged else "<="
        p_value = f", p-value {self.p_value:.3g}" if self.p_value is not None else ""
        if self.heads:
            if self.decided_by:
                verdict = f"{verdict} by {', '.join(self.decided_by)} ({self.reading})"
            parts = [
                f"{head.name} {head.score:.4g} {'>' if head.flagged else '<='} {head.threshold:.4g}"
                for head in self.heads
            ]
            return f"{verdict}: {'; '.join(parts)} (anomaly cluster {self.cluster}{p_value})"
        if self.probability is not None:
            return (
                f"{verdict}: P(unsafe) {self.probability:.3f} {sign} {self.threshold:.4g} "
                f"(score {self.score:.4g}, cluster {self.cluster}{p_value})"
            )
        return f"{verdict}: score {self.score:.4g} {sign} {self.threshold:.4g} (cluster {self.cluster}{p_value})"

    def head_verdicts(self) -> tuple[HeadVerdict, ...]:
        """Every head's verdict; a single-head guard's one verdict as the ``anomaly`` head's (what decided:
        the calibrated probability, else the score)."""
        if self.heads:
            return self.heads
        decided = self.probability if self.probability is not None else self.score
        return (HeadVerdict(ANOMALY_HEAD, decided, self.threshold, self.flagged and self.error is None),)

    def to_json(self, tokenizer: Any = None) -> dict[str, Any]:
        """The report as JSON-ready plain values (what ``hf-lsad screen`` writes and ``hf-lsad serve`` returns):
        ``flagged``, ``decided_by`` (every guard's, a single-head guard's included), ``reading``, ``probability`` and
        ``p_value`` (the anomaly head's), ``heads`` (name -> ``{"score", "threshold", "flagged"}``), ``cluster``,
        ``error``, and ``step`` / ``stopped`` of guarded generation. A NaN score (a row that failed closed) becomes
        ``None``. A report that names its prompt tokens (:attr:`tokens`) adds ``tokens``: ``{"token_id",
        "position", "contribution"}`` each, and its ``text`` when given the ``tokenizer``."""
        verdicts = self.head_verdicts()
        record = {
            "flagged": bool(self.flagged),
            "decided_by": [v.name for v in verdicts if v.flagged],
            "reading": self.reading,
            "probability": _finite_or_none(self.probability),
            "p_value": _finite_or_none(self.p_value),
            "heads": {
                v.name: {"score": _finite_or_none(v.score), "threshold": float(v.threshold), "flagged": bool(v.flagged)}
                for v in verdicts
            },
            "cluster": int(self.cluster),
            "error": self.error,
            "step": self.step,
            "stopped": bool(self.stopped),
        }
        if self.tokens is not None:
            record["tokens"] = [
                {
                    **({"text": t.text(tokenizer)} if tokenizer is not None else {}),
                    "token_id": t.token_id,
                    "position": t.position,
                    "contribution": t.contribution,
                }
                for t in self.tokens
            ]
        return record


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)
