"""SafetyGuard: the paper's anomaly head (an SAE, a fitted detector, a threshold and an optional calibration),
optionally beside supervised heads that share one false-positive budget; saved as JSON + safetensors.

A guard with supervised heads (:mod:`hf_lsad.guard.heads`) reads several activations of one forward pass (its
:attr:`~SafetyGuard.reads`: the anomaly head's first) and flags a row when *any* head's score exceeds that head's
threshold. The thresholds were set together (:meth:`SafetyGuard.fit_budget`) so that the combined flag rate on
held-out benign rows meets one target; the split is recorded in :attr:`SafetyGuard.budget`.

Its folder on disk (the files, strict loading, the integrity record) is :mod:`hf_lsad.guard.files`;
:meth:`SafetyGuard.save_pretrained`, :meth:`SafetyGuard.from_pretrained` and
:meth:`SafetyGuard.push_to_hub` delegate there.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from huggingface_hub import CommitInfo, ModelCard
from torch import Tensor, nn

from ..core.checks import check_activations
from ..core.hook_point import Read
from ..core.hub import resolve_pretrained_dir
from ..core.prompt_inputs import InputProfile
from ..core.prompt_tokens import PromptTokens, check_explain, check_top_k
from ..core.serialization import folder_path
from ..detectors import Detector
from ..errors import GuardFormatError, warn
from ..sae.model import SparseAutoencoder
from .calibration import AffineCalibration
from .card import DEFAULT_LICENSE, guard_model_card
from .explain import explain_scores
from .files import (
    BUNDLED_GUARDS,
    MODEL_CARD,
    GuardParts,
    check_guard_destination,
    load_guard_folder,
    save_guard_files,
    upload_guard,
    verify_guard_folder,
)
from .heads import SupervisedHead, check_name_free
from .running import RunningConfig
from .threshold import budget_thresholds, conformal_p_values, sorted_holdout, union_flag_rate
from .types import (
    ANOMALY_HEAD,
    BudgetConfig,
    FeatureContribution,
    GuardConfig,
    GuardOutput,
    HeadVerdict,
    ModelFingerprint,
    SafetyReport,
)

Activations = Tensor | Mapping[Read, Tensor]
"""What a guard scores: the anomaly head's ``[batch, hidden]`` read, or every read of :attr:`SafetyGuard.reads`."""

__all__ = ["GuardConfig", "GuardOutput", "SafetyGuard", "SafetyReport", "upgrade_guard_folder"]


class SafetyGuard(nn.Module):
    """Scores residual-stream activations: the anomaly head reads ``config.hook``, supervised heads their own reads."""

    def __init__(self, config: GuardConfig, detector: Detector, sae: SparseAutoencoder | None) -> None:
        super().__init__()
        if detector.method != config.method:
            raise ValueError(f"config names method {config.method!r} but the detector is {detector.method!r}")
        if detector.uses_sae and sae is None:
            raise ValueError(f"{config.method} needs an SAE")
        if sae is not None:
            sae.check_reads(config.hook)
        self.config = config
        self.detector = detector
        self.sae = sae
        self.calibration: AffineCalibration | None = None
        """Per-cluster affine calibration (:meth:`set_calibration`); when set, rows are flagged by probability."""
        self.holdout_scores: Tensor | None = None
        """Sorted held-out safe scores the threshold was set on (:meth:`set_holdout_scores`), for p-values."""
        self.running: RunningConfig | None = None
        """For a ``response_running`` guard: patience and how its threshold was set (:mod:`hf_lsad.guard.running`)."""
        if config.hook.position == "response_running":
            self.running = RunningConfig()
        self.inputs: InputProfile | None = None
        """How the fitting prompts were formatted and their longest length: ``generate`` warns on inputs that differ
        (:mod:`hf_lsad.core.prompt_inputs`). ``None`` for guards fitted from stores that did not record it."""
        self.heads = nn.ModuleDict()
        """Supervised heads (:class:`~hf_lsad.guard.heads.SupervisedHead`) by name, in order (:meth:`add_head`)."""
        self.budget: BudgetConfig | None = None
        """With supervised heads: every head's threshold and share of the false-positive budget (:meth:`fit_budget`)."""
        self.fingerprint: ModelFingerprint | None = None
        """Every head's scores on fixed probe prompts through the model the thresholds were set through
        (:mod:`hf_lsad.guard.fingerprint`): a model given to the guard that scores them otherwise is refused.
        ``None`` for guards whose thresholds were set from stored activations; dropped when a head is added (the
        anomaly head's scores are compared before any calibration, which leaves it)."""

    @property
    def head_names(self) -> list[str]:
        """``["anomaly", *supervised heads]``: the order of :attr:`budget` and of reports' ``heads``."""
        return [ANOMALY_HEAD, *self.heads.keys()]

    @property
    def reads(self) -> list[Read]:
        """Every ``(layer, position)`` the guard scores, the anomaly head's first: one forward pass records them all."""
        reads = [(self.config.hook.layer, self.config.hook.position)]
        for head in self._supervised_heads():
            reads += [read for read in head.reads if read not in reads]
        return reads

    def _supervised_heads(self) -> list[SupervisedHead]:
        """:attr:`heads` in order, typed (an ``nn.ModuleDict`` yields plain modules)."""
        return [cast(SupervisedHead, head) for head in self.heads.values()]

    def add_head(self, head: SupervisedHead) -> None:
        """Add a supervised head after the others. Its threshold is set with the others' by :meth:`fit_budget`
        (until then the guard refuses to score: its budget no longer covers every head)."""
        if not isinstance(head, SupervisedHead):
            raise TypeError(f"expected a SupervisedHead, got {type(head).__name__}")
        hook = self.config.hook
        check_name_free(head.name, self.head_names)
        if hook.position != "prompt_last":
            raise ValueError(
                f"supervised heads read the prompt and decide before the response; this guard's anomaly head reads "
                f"{hook.position}, so its verdict comes at another time. Add heads to a prompt_last guard."
            )
        if head.config.hidden_size != hook.hidden_size:
            raise ValueError(
                f"head {head.name!r} reads width {head.config.hidden_size}, the model's is {hook.hidden_size}"
            )
        outside = [layer for layer, _ in head.reads if not 0 <= layer < hook.num_hidden_layers]
        if outside:
            raise ValueError(
                f"head {head.name!r} reads layers {outside}; the model has {hook.num_hidden_layers} blocks"
            )
        self.heads[head.name] = head.to(self._device())
        self.budget = None
        self.fingerprint = None

    def set_budget(self, budget: BudgetConfig | None) -> None:
        """Set (or, for a guard without supervised heads, remove) the heads' thresholds and shares."""
        if budget is not None and budget.heads != self.head_names:
            raise ValueError(f"the budget names heads {budget.heads}, the guard has {self.head_names}")
        if budget is None and self.heads:
            raise ValueError("a guard with supervised heads needs a budget")
        self.budget = budget
        self._drop_boundary_rows()

    def _drop_boundary_rows(self) -> None:
        """The fingerprint's boundary rows hold verdicts at the thresholds they were recorded at: new thresholds
        leave the probes' scores (before any threshold) and drop the rows."""
        if self.fingerprint is not None and self.fingerprint.boundary is not None:
            self.fingerprint = self.fingerprint._replace(boundary=None)

    @torch.no_grad()
    def fit_budget(
        self,
        benign: Mapping[Read, Tensor],
        *,
        target_fpr: float = 0.05,
        shares: Sequence[float] | None = None,
        rows: str = "validation chat",
        confidence: float | None = None,
        groups: Tensor | None = None,
    ) -> BudgetConfig:
        """Set every head's threshold so that, together, they flag at most ``target_fpr`` of the held-out
        ``benign`` rows (each of :attr:`reads`, ``[n, hidden]``), head ``h`` taking ``shares[h]`` of the budget
        (default: equal shares); see :func:`hf_lsad.guard.threshold.budget_thresholds`. With ``confidence``, fewer
        rows are flagged, so that fresh benign rows of the same kind are flagged at most at ``target_fpr`` with that
        probability. ``rows`` says which rows these are (recorded). ``groups`` (``[n]`` integers) names several kinds
        of benign rows, each of which the heads together must flag within the budget on its own
        (:func:`~hf_lsad.guard.threshold.budget_thresholds`). Returns the :class:`BudgetConfig` it set."""
        shares = [1.0 / len(self.head_names)] * len(self.head_names) if shares is None else list(shares)
        if len(shares) != len(self.head_names) or any(share <= 0 for share in shares):
            raise ValueError(f"need a positive share for each of the heads {self.head_names}, got {shares}")
        total = sum(shares)
        deciding = self._head_scores(self._check_reads(benign))[1]
        scores = torch.stack([deciding[name] for name in self.head_names], dim=1)  # [n, heads]
        thresholds = budget_thresholds(scores.cpu(), target_fpr, shares, confidence=confidence, groups=groups)
        budget = BudgetConfig(
            heads=self.head_names,
            shares=[share / total for share in shares],
            thresholds=thresholds,
            target_fpr=target_fpr,
            measured_fpr=union_flag_rate(scores.cpu(), thresholds),
            n_rows=int(scores.shape[0]),
            rows=rows,
            confidence=confidence,
        )
        self.set_budget(budget)
        return budget

    def set_holdout_scores(self, holdout_scores: Tensor | None) -> None:
        """Keep the held-out safe scores (``config.n_holdout`` of them) so that reports carry p-values."""
        if holdout_scores is not None:
            holdout_scores = sorted_holdout(holdout_scores)
            if len(holdout_scores) != self.config.n_holdout:
                raise ValueError(
                    f"{len(holdout_scores)} held-out scores, the config says n_holdout={self.config.n_holdout}"
                )
        self.holdout_scores = holdout_scores

    def set_calibration(self, calibration: AffineCalibration | None) -> None:
        """Calibrate the guard (``None`` removes it).

        A calibrated guard reports ``sigmoid(a_c s + b_c)`` and flags rows above ``calibration.threshold``.
        """
        if calibration is not None:
            if self.running is not None:
                raise ValueError("a response_running guard scores every token; per-cluster calibration is per prompt")
            n_clusters = self.detector.n_clusters
            if calibration.n_clusters != n_clusters:
                raise ValueError(
                    f"calibration has {calibration.n_clusters} clusters, the {self.config.method} detector {n_clusters}"
                )
        self.calibration = calibration
        self._drop_boundary_rows()

    def set_fingerprint(self, fingerprint: ModelFingerprint | None) -> None:
        """Set (``None``: remove) the scores a model given to the guard is checked against
        (:func:`hf_lsad.guard.fingerprint.record_fingerprint` records them); they must be recorded for this guard's
        heads."""
        if fingerprint is not None:
            fingerprint.check(self.head_names)
        self.fingerprint = fingerprint

    @property
    def threshold(self) -> float:
        """The anomaly head's threshold, the one place it is decided: with supervised heads, the one the budget
        gave it (:attr:`budget`); else a calibrated guard flags a probability above ``calibration.threshold``,
        any other guard a score above ``config.threshold``."""
        if self.budget is not None:
            return self.budget.thresholds[0]
        return self.calibration.threshold if self.calibration is not None else self.config.threshold

    def head_thresholds(self) -> dict[str, float]:
        """Each head's threshold by name, as reports carry them (:meth:`SafetyReport.head_verdicts`): the budget's,
        else the anomaly head's alone (:attr:`threshold`)."""
        if self.budget is not None:
            return dict(zip(self.budget.heads, self.budget.thresholds))
        if self.heads:
            raise ValueError("the guard has no thresholds yet: set them with fit_budget")
        return {ANOMALY_HEAD: self.threshold}

    def describe(self) -> str:
        """One line naming each head, what it reads and how the guard flags: ``anomaly (freqmask-km on
        model.layers.12 (prompt_last)); harm (mlp 256 x 3 fits on layer 16 prompt_mean, ...). A row is flagged when
        any head is above its threshold (together at most 5% of benign traffic like validation chat with 95%
        confidence; 4.0% of the rows it was set on)``."""
        hook = self.config.hook
        anomaly = f"{self.config.method} on {hook.layer_module} ({hook.position})"
        if self.heads:
            heads = "; ".join(f"{head.name} ({head.config.probe.describe()})" for head in self._supervised_heads())
            budget = self.budget
            if budget is None:  # a head was just added: no thresholds yet
                return f"anomaly ({anomaly}); {heads}. No thresholds yet: set them with fit_budget"
            together = f"together {budget.target_fpr:.0%} of {budget.rows}"
            if budget.confidence is not None:
                together = (
                    f"together at most {budget.target_fpr:.0%} of benign traffic like {budget.rows} "
                    f"with {budget.confidence:.0%} confidence; {budget.measured_fpr:.1%} of the rows it was set on"
                )
            return f"anomaly ({anomaly}); {heads}. A row is flagged when any head is above its threshold ({together})"
        if self.calibration is not None:
            return f"{anomaly}, calibrated: flags P(unsafe) > {self.threshold:.4g}"
        return f"{anomaly}: flags scores > {self.threshold:.4g} ({self.config.target_fpr:.0%} safe FPR)"

    def extra_repr(self) -> str:
        return f"base_model={self.config.hook.base_model!r}, {self.describe()}"

    @torch.no_grad()
    def forward(self, activations: Activations) -> GuardOutput:
        """Score ``[batch, hidden_size]`` activations of the anomaly head's read, or, for a guard with supervised
        heads, a mapping of every read of :attr:`reads` to its ``[batch, hidden_size]`` activations (any float
        dtype, any device: moved to the guard's)."""
        return self._score(self._check_reads(activations))[0]

    def _check_reads(self, activations: Activations, *, finite: bool = True) -> dict[Read, Tensor]:
        """Every read the guard needs, as float32 on the guard's device, checked: tensors ``[batch, hidden_size]``
        of one batch, and (``finite=True``) free of NaN and inf."""
        if isinstance(activations, Tensor):
            if self.heads:
                raise ValueError(
                    f"this guard's heads read {self.reads}: pass a mapping {{(layer, position): [batch, hidden]}}"
                )
            activations = {self.reads[0]: activations}
        if not isinstance(activations, Mapping):
            raise TypeError(
                f"activations must be a Tensor or a mapping of reads to Tensors, got {type(activations).__name__}"
            )
        missing = [read for read in self.reads if read not in activations]
        if missing:
            raise ValueError(f"the guard reads {self.reads}; missing {missing}")
        reads = {read: activations[read] for read in self.reads}
        for read, tensor in reads.items():
            rows = tensor.nan_to_num() if isinstance(tensor, Tensor) and not finite else tensor
            check_activations(rows, self.config.hook.hidden_size, name=f"activations of {read}")
        sizes = {read: tensor.shape[0] for read, tensor in reads.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"the reads hold different numbers of rows: {sizes}")
        return {read: self._on_guard(tensor) for read, tensor in reads.items()}

    def _head_scores(self, reads: dict[Read, Tensor]) -> tuple[tuple[Tensor, Tensor, Tensor | None], dict[str, Tensor]]:
        """The anomaly head's ``(scores, clusters, probabilities)`` and what each head compares with its threshold."""
        scores, clusters = self.detector(reads[self.reads[0]], self.sae)
        probabilities = self.calibration.probabilities(scores, clusters) if self.calibration is not None else None
        deciding = {ANOMALY_HEAD: scores if probabilities is None else probabilities}
        deciding.update({name: head(reads) for name, head in self.heads.items()})
        return (scores, clusters, probabilities), deciding

    @torch.no_grad()
    def deciding_scores(self, activations: Activations) -> dict[str, Tensor]:
        """Each head's ``[batch]`` score as it is compared with its threshold (:meth:`head_thresholds`), by name: the
        anomaly head's probability when it is calibrated (else its score), a supervised head's probability
        (``activations`` as :meth:`forward`'s)."""
        return self._head_scores(self._check_reads(activations))[1]

    @torch.no_grad()
    def raw_head_scores(self, activations: Activations) -> dict[str, Tensor]:
        """Each head's ``[batch]`` score before any map to a probability, by name: the anomaly head's detector score
        (uncalibrated), a supervised head's log-odds (``activations`` as :meth:`forward`'s; rows that are not finite
        give scores that are not finite)."""
        reads = self._check_reads(activations, finite=False)
        scores, _ = self.detector(reads[self.reads[0]], self.sae)
        return {ANOMALY_HEAD: scores, **{head.name: head.logit(reads) for head in self._supervised_heads()}}

    @torch.no_grad()
    def _score(self, reads: dict[Read, Tensor]) -> tuple[GuardOutput, Tensor | None]:
        """The output and, for a calibrated guard, the probabilities it flagged by (computed once)."""
        (scores, clusters, probabilities), deciding = self._head_scores(reads)
        if not self.heads:
            return GuardOutput(scores, clusters, deciding[ANOMALY_HEAD] > self.threshold), probabilities
        if self.budget is None:
            raise RuntimeError("this guard's supervised heads have no thresholds yet: call fit_budget(...) first")
        thresholds = self.budget.thresholds
        flagged = torch.stack([deciding[name] > t for name, t in zip(self.head_names, thresholds)]).any(0)
        return GuardOutput(scores, clusters, flagged, deciding), probabilities

    def reports(
        self,
        activations: Activations,
        *,
        explain: bool = False,
        top_k: int = 10,
        tokens: PromptTokens | None = None,
    ) -> list[SafetyReport]:
        """One :class:`SafetyReport` per row (``activations`` as in :meth:`forward`).

        ``explain=True`` fills :attr:`SafetyReport.features` with the ``top_k`` features that contribute most to
        the score of the head that decided (:attr:`SafetyReport.explained_head`; :meth:`explain`,
        :meth:`SupervisedHead.explain`), and, given the prompts' ``tokens`` and a supervised head deciding,
        :attr:`SafetyReport.tokens` with the ``top_k`` tokens that raise its logit most
        (:meth:`SupervisedHead.explain_tokens`).

        Fails closed: a row holding NaN or inf in any read gets a report with ``flagged=True`` and an
        ``error`` saying so (and a ``RuntimeWarning``); the other rows are scored as usual.
        Shape and width errors still raise.
        """
        check_explain(explain, top_k)
        reads = self._check_reads(activations, finite=False)
        finite = torch.stack([torch.isfinite(tensor).all(1).cpu() for tensor in reads.values()]).all(0)
        if tokens is not None and len(tokens.mask) != len(finite):
            raise ValueError(f"tokens of {len(tokens.mask)} prompts for {len(finite)} rows of activations")
        if bool(finite.all()):
            return self._reports(reads, explain=explain, top_k=top_k, tokens=tokens)
        bad = (~finite).nonzero().flatten().tolist()
        warn(
            f"guard activations of rows {bad} hold NaN or inf: those rows are reported as flagged (fail closed)",
            RuntimeWarning,
        )
        kept = {read: tensor[finite.to(tensor.device)] for read, tensor in reads.items()}
        kept_tokens = None if tokens is None else tokens.rows(finite)
        scored = iter(self._reports(kept, explain=explain, top_k=top_k, tokens=kept_tokens) if finite.any() else [])
        failed = SafetyReport(
            score=math.nan,
            threshold=self.threshold,
            flagged=True,
            cluster=-1,
            probability=math.nan if self.calibration is not None else None,
            error="the activation holds NaN or inf, so the row could not be scored; flagged (fail closed)",
        )
        return [next(scored) if ok else failed for ok in finite.tolist()]

    def _reports(
        self, reads: dict[Read, Tensor], *, explain: bool, top_k: int, tokens: PromptTokens | None
    ) -> list[SafetyReport]:
        output, probabilities = self._score(reads)
        n = len(output.scores)
        row_probabilities = [None] * n if probabilities is None else probabilities.tolist()
        if self.holdout_scores is None:
            p_values = [None] * n
        else:
            p_values = conformal_p_values(output.scores, self.holdout_scores).tolist()
        heads: list[tuple[HeadVerdict, ...]] = [()] * n
        if output.head_scores is not None:
            assert self.budget is not None  # _score refuses a guard with heads and no budget
            table = {name: output.head_scores[name].tolist() for name in self.head_names}
            heads = [
                tuple(
                    HeadVerdict(name, table[name][r], t, table[name][r] > t)
                    for name, t in zip(self.head_names, self.budget.thresholds)
                )
                for r in range(n)
            ]
        reports = []
        for r, (s, c, f) in enumerate(zip(output.scores.tolist(), output.clusters.tolist(), output.flagged.tolist())):
            decided_by = tuple(head.name for head in heads[r] if head.flagged)
            reading = None
            if decided_by:
                reading = "novel" if decided_by == (ANOMALY_HEAD,) else "known"
            reports.append(
                SafetyReport(
                    score=s,
                    threshold=self.threshold,
                    flagged=f,
                    cluster=c,
                    probability=row_probabilities[r],
                    p_value=p_values[r],
                    heads=heads[r],
                    decided_by=decided_by,
                    reading=reading,
                )
            )
        return self._explained(reports, reads, top_k, tokens) if explain else reports

    def _explained(
        self, reports: list[SafetyReport], reads: dict[Read, Tensor], top_k: int, tokens: PromptTokens | None
    ) -> list[SafetyReport]:
        """``reports`` with the explanation of the head each one names (:attr:`SafetyReport.explained_head`)."""
        explained = list(reports)
        for name in dict.fromkeys(report.explained_head for report in reports):
            rows = torch.tensor([r for r, report in enumerate(reports) if report.explained_head == name])
            subset = {read: tensor[rows.to(tensor.device)] for read, tensor in reads.items()}
            named: list[Any] = [None] * len(rows)  # the tokens behind a supervised head's score
            if name == ANOMALY_HEAD:
                features = explain_scores(self.detector, self.sae, subset[self.reads[0]], top_k=top_k)
            else:
                head = cast(SupervisedHead, self.heads[name])
                features = head.explain(subset, top_k=top_k)
                if tokens is not None:
                    named = list(head.explain_tokens(tokens.rows(rows), top_k=top_k))
            for r, row_features, row_tokens in zip(rows.tolist(), features, named):
                explained[r] = reports[r]._replace(features=row_features, tokens=row_tokens or None)
        return explained

    @torch.no_grad()
    def explain(self, activations: Tensor, *, top_k: int | None = 10) -> list[tuple[FeatureContribution, ...]]:
        """Per row, the SAE features behind its anomaly score, largest contribution first (``top_k=None``: all).

        ``activations`` are the anomaly head's read. See :func:`hf_lsad.guard.explain.explain_scores` for what a
        contribution is; detectors that do not score SAE features (e.g. ``mahalanobis`` on raw activations) raise
        ``NotImplementedError``. A supervised head explains itself (:meth:`SupervisedHead.explain`); reports with
        ``explain=True`` explain whichever head decided.
        """
        check_top_k(top_k, allow_all=True)
        check_activations(activations, self.config.hook.hidden_size)
        return explain_scores(self.detector, self.sae, self._on_guard(activations), top_k=top_k)

    def _device(self) -> torch.device:
        tensor = next(itertools.chain(self.detector.buffers(), self.detector.parameters()), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    def _on_guard(self, activations: Tensor) -> Tensor:
        """``activations`` as float32 on the guard's device: a model split over devices (``device_map="auto"``)
        records block L wherever that block lives, not where the guard is."""
        tensor = next(itertools.chain(self.buffers(), self.parameters()), None)
        return activations.to(tensor.device if tensor is not None else activations.device, torch.float32)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        data: str | None = None,
        datasets: str | list[str] | None = None,
        license: str = DEFAULT_LICENSE,
    ) -> None:
        """Write the guard folder described in :mod:`hf_lsad.guard.files`.

        With ``metrics`` or ``data`` given, also write a ``README.md`` model card
        (:func:`hf_lsad.guard.card.guard_model_card`): ``metrics`` maps each unsafe category to
        its measured ``{"auroc": ..., "tpr_at_5fpr": ...}`` (as ``hf-lsad evaluate`` prints),
        ``data`` describes the prompts the guard was fitted on, ``datasets`` and ``license``
        go to the card metadata. A ``README.md`` hf-lsad did not write (a project's own) is not overwritten: the
        save is refused before anything is written (``FileExistsError``).
        """
        path = folder_path(save_directory, "save_directory")
        with_card = metrics is not None or data is not None
        if with_card:  # before any file is written
            check_guard_destination(path, with_card=True)
        save_guard_files(self.parts(), path)
        if with_card:
            self.model_card(metrics=metrics, data=data, datasets=datasets, license=license).save(path / MODEL_CARD)

    def model_card(self, **kwargs: Any) -> ModelCard:
        """This guard's :class:`huggingface_hub.ModelCard`; ``kwargs`` as in
        :func:`hf_lsad.guard.card.guard_model_card`."""
        return guard_model_card(self.parts(), **kwargs)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str = "",
        commit_message: str = "Upload hf-lsad guard",
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        data: str | None = None,
        datasets: str | list[str] | None = None,
        license: str = DEFAULT_LICENSE,
        card: ModelCard | None = None,
    ) -> CommitInfo:
        """Upload the guard, with its model card, to a Hub repo in one commit (creating the repo if needed).

        Args:
            repo_id: ``"org/name"``, or ``"name"`` for the token owner's namespace.
            subfolder: Folder in the repo for this guard (``""``: the root). Several guards for one
                base model (other layers or methods) can share a repo, one per subfolder.
            commit_message: Commit summary.
            private: Visibility if the repo is created (``None``: the Hub default).
            token: Hub token (``None``: the saved or ``HF_TOKEN`` token).
            revision: Branch to push to (default ``main``; created if missing).
            create_pr: Open a pull request instead of committing to the branch.
            metrics, data, datasets, license: Model card content, as in :meth:`save_pretrained`.
                Without ``metrics`` the card says that none were measured.
            card: A card to upload as it is instead (the ``README.md`` of a guard folder: ``hf-lsad push``
                keeps the figures it holds); ``metrics``, ``data``, ``datasets`` and ``license`` must then be unset.

        Returns:
            The :class:`huggingface_hub.CommitInfo`; ``.oid`` is the commit sha to pin as
            ``revision`` when loading.

        Files already in the repo folder that this guard does not write are left as they are.
        """
        if card is not None:
            if metrics is not None or data is not None or datasets is not None or license != DEFAULT_LICENSE:
                raise ValueError("pass either card or the card's content (metrics, data, datasets, license)")
        else:
            card = self.model_card(
                metrics=metrics,
                data=data,
                datasets=datasets,
                license=license,
                repo_id=repo_id,
                subfolder=subfolder,
                revision=revision,
            )
        return upload_guard(
            self.parts(),
            card,
            repo_id,
            subfolder=subfolder,
            commit_message=commit_message,
            revision=revision,
            private=private,
            token=token,
            create_pr=create_pr,
        )

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, **hub_kwargs: Any) -> SafetyGuard:
        """Load a guard from a local folder, a Hub repo, ``"default"`` (:data:`DEFAULT_GUARD`, two heads) or
        ``"paper"`` (:data:`~hf_lsad.guard.files.PAPER_GUARD`, the paper's anomaly head alone).

        ``hub_kwargs`` (``revision``, ``subfolder``, ``token``, ``cache_dir``,
        ``local_files_only``, ``force_download``) behave as in transformers.

        Everything is checked before the guard is returned (docs/guard-format.md):
        the folder's tree (:func:`~hf_lsad.core.integrity.check_guard_tree`), every key's
        type and range, unknown keys at every level, every tensor's presence, shape and
        finiteness, each tensor file's SHA-256 and the settings the threshold was set for
        (:func:`~hf_lsad.core.integrity.verify_integrity`).

        Raises:
            hf_lsad.GuardFormatError: a missing, malformed or inconsistent file or key.
            hf_lsad.GuardMismatchError: files or settings changed since the guard was saved.
            hf_lsad.UnsafeGuardFileError: pickle files, or links leaving the folder.
        """
        name_or_path = BUNDLED_GUARDS.get(str(name_or_path), name_or_path)
        path = resolve_pretrained_dir(name_or_path, **hub_kwargs)
        parts, raw = load_guard_folder(path)
        guard = cls.from_parts(parts, source=str(path))
        verify_guard_folder(path, raw, parts)
        return guard

    @classmethod
    def from_parts(cls, parts: GuardParts, *, source: str = "guard") -> SafetyGuard:
        """Assemble a guard from the parts of its folder (:func:`hf_lsad.guard.files.load_guard_folder`); parts
        that do not fit together (a detector of another method, a calibration of another cluster count) are a
        :class:`~hf_lsad.errors.GuardFormatError` naming ``source``."""
        try:
            guard = cls(parts.config, parts.detector, parts.sae).eval()
            guard.set_holdout_scores(parts.holdout_scores)
            guard.running = parts.running
            guard.inputs = parts.inputs
            guard.set_calibration(parts.calibration)
            for head in parts.heads:
                guard.add_head(head)
            if parts.heads:
                guard.set_budget(parts.budget)
            guard.set_fingerprint(parts.fingerprint)
        except ValueError as err:
            raise GuardFormatError(f"{source}: {err}") from err
        return guard

    def parts(self) -> GuardParts:
        """The guard as the plain parts its folder holds (what :meth:`save_pretrained` writes)."""
        return GuardParts(
            self.config,
            self.detector,
            self.sae,
            self.holdout_scores,
            self.calibration,
            self.running,
            self.inputs,
            tuple(self._supervised_heads()),
            self.budget,
            self.fingerprint,
        )


def upgrade_guard_folder(path: str | os.PathLike) -> None:
    """Add the ``integrity`` record to a guard saved by an older hf-lsad, in place (an explicit act of trust).

    The guard is loaded with every other check and re-saved with :meth:`SafetyGuard.save_pretrained`:
    its tensors are written again unchanged, so its scores stay identical. Only for files you
    trust: the record makes whatever they hold now the reference.
    """
    guard = SafetyGuard.from_parts(load_guard_folder(Path(path))[0], source=str(path))
    guard.save_pretrained(path)
