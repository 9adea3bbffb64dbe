"""Acting on the guard's verdict while ``generate`` runs: stop a flagged row, force EOS or a refusal.

The guard reads the hidden state that the model computes anyway. The recorder of
:func:`hf_lsad.capture.recorder.generation_recorder` (the same one the report path and collection
use: it ignores other threads' forward passes and reads a right-padded prompt at its last
real token) keeps the last position of every forward call (prefill, then one call per new
token); transformers calls the logits processors right after each
forward call and before it picks the next token, so that is where the verdict is
made:

- ``prompt_last`` guard: the prefill record is scored on the first call. A flagged
  row is *screened*: its first token is forced to be the refusal (if any) and then
  EOS, so it generates no token of its own.
- ``response_running`` guard (:mod:`hf_lsad.guard.running`): on each decoding call
  the record of the newest consumed response token is scored; a row flagged on
  ``patience`` consecutive tokens is stopped there, its next token forced as above.

Forcing a token sets every other logit of that row to ``-inf`` (so greedy search,
sampling and any logits warper pick it), the :class:`GuardStoppingCriteria` ends the
row once its forced tokens are out (transformers' stopping criteria are per row), and
the other rows of the batch go on unchanged. Both objects are built per ``generate``
call around one :class:`GuardedGenerationState`; nothing is stored on the model or
the guard, so concurrent calls do not share state.

Under beam search the logits processor sees each prompt's beams as consecutive rows, and a
screened prompt's verdict is forced on every one of its beams. Each beam then holds the same
forced tokens, so whichever beam search keeps, the prompt's best hypothesis is the refusal
and EOS, which ends it (beam search checks its stopping criteria on candidate rows, not on
the beams, so it is EOS that ends a stopped prompt there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, cast, get_args

import torch
from torch import Tensor
from transformers import LogitsProcessor, StoppingCriteria

from ..capture.recorder import LastPositionRecorder, PromptReader
from ..errors import InputError
from ..guard.guard import SafetyGuard, SafetyReport

OnFlag = Literal["report", "stop"]
"""``report``: score only (the sequences are those of plain ``generate``); ``stop``: end flagged rows."""
ON_FLAG = get_args(OnFlag)

SCREEN_POSITIONS = ("prompt_last",)
RUNNING_POSITIONS = ("response_running",)


def refusal_token_ids(
    refusal: str | Sequence[int] | Tensor | None, tokenizer: Any = None, vocab_size: int | None = None
) -> list[int]:
    """Token ids of a refusal given as ids or as text (text needs a tokenizer); ``None`` is no refusal.

    With ``vocab_size``, an id outside ``[0, vocab_size)`` is an :class:`~hf_lsad.errors.InputError`
    here, before generation, rather than an ``IndexError`` on the step that would force it.
    """
    if refusal is None:
        return []
    if isinstance(refusal, str):
        if tokenizer is None:
            raise ValueError("a refusal given as text needs the tokenizer: pass tokenizer=... (or give token ids)")
        return list(tokenizer(refusal, add_special_tokens=False)["input_ids"])
    wanted = "refusal must be text, token ids (a list of ints or a 1-D tensor) or None, got"
    ids: list[Any]
    if isinstance(refusal, Tensor):
        if refusal.ndim != 1:
            raise TypeError(f"{wanted} a tensor of shape {tuple(refusal.shape)}")
        ids = refusal.tolist()
    elif isinstance(refusal, Sequence):
        ids = list(refusal)
    else:
        raise TypeError(f"{wanted} {refusal!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"refusal token ids must be ints, got {ids!r}")
    outside = [i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)]
    if outside:
        raise InputError(f"refusal token ids {outside} are outside the model's vocabulary [0, {vocab_size})")
    return ids


def decided_at_prefill(reports: list[SafetyReport]) -> list[SafetyReport]:
    """Reports of a guard that reads the prompt, with ``step`` 0 on flagged rows and ``None`` on the others: the
    verdict is the prefill's, whether the guard decides while generating (``on_flag="stop"``, ``on_step``) or
    reports after it."""
    return [report._replace(step=0 if report.flagged else None) for report in reports]


class StepVerdict(NamedTuple):
    """What the guard knows after scoring one step (``generate(..., on_step=...)``)."""

    step: int
    """0: the prefill (prompt_last); ``t``: response token ``t - 1`` was scored (response_running)."""
    scores: Tensor
    """``[batch]`` scores of this step (``nan`` for rows not scored: ended or already flagged)."""
    flagged: Tensor
    """``[batch]`` bool: rows flagged so far."""


@dataclass
class GuardedGenerationState:
    """What one guarded ``generate`` call knows about its rows (one object per call)."""

    guard: SafetyGuard
    batch_size: int
    """Rows the logits processor sees: the prompts times the returned sequences, or times the beams under beam
    search."""
    eos_token_ids: list[int]
    stop: bool = False
    """Whether flagged rows are ended (``on_flag="stop"``)."""
    forced_tokens: list[int] = field(default_factory=list)
    """Tokens a stopped row emits: the refusal, then the first EOS id (if there is one)."""
    patience: int = 1
    """Consecutive flagged tokens that flag a row (running guards)."""
    recorder: LastPositionRecorder | None = None
    """Reads the hooked block during the call (:func:`hf_lsad.capture.recorder.generation_recorder`)."""
    prompt_reader: PromptReader | None = None
    """A guard with supervised heads: reads every prompt read of the guard on the prefill call
    (:func:`hf_lsad.capture.recorder.generation_prompt_reader`)."""
    on_step: Callable[[StepVerdict], None] | None = None
    """Called after every scoring step (from the thread running ``generate``)."""
    beams: int = 1
    """Beam search: beams per prompt (the rows of a prompt the logits processor sees); 1 otherwise."""
    returned: int = 1
    """Beam search: sequences returned per prompt, one report each."""

    def __post_init__(self) -> None:
        if self.stop and not self.forced_tokens:
            raise ValueError("stopping a row needs an EOS token id or a refusal (the model has no eos_token_id)")
        if self.beams > 1 and self.batch_size % self.beams:
            raise ValueError(f"{self.batch_size} rows are not a whole number of prompts of {self.beams} beams")
        n = self.batch_size
        self.calls = 0
        """Logits-processor calls so far (= new tokens picked so far)."""
        self.flag_step = torch.full((n,), -1, dtype=torch.long)
        """Step at which the row was flagged (``-1``: never); step 0 is the prefill, before any new token."""
        self.forced_done = torch.zeros(n, dtype=torch.long)
        """Forced tokens a stopped row has emitted so far."""
        self.finished = torch.zeros(n, dtype=torch.bool)
        """Rows that ended (EOS of their own, or their forced tokens are out)."""
        self.streak = torch.zeros(n, dtype=torch.long)
        self.step_scores: list[Tensor] = []
        """Running guards: the score of each row at each decoding step (``nan`` where not scored)."""
        self.step_clusters: list[Tensor] = []
        self.screen_reports: list[SafetyReport] | None = None

    @property
    def position(self) -> str:
        return self.guard.config.hook.position

    @property
    def records(self) -> list[Tensor]:
        """Hidden state at the read position of each forward call so far, ``[batch, hidden]`` each."""
        if self.recorder is None:
            raise RuntimeError("GuardedGenerationState has no recorder")
        return self.recorder.records

    @property
    def stopped(self) -> Tensor:
        """Rows that were flagged and ended by the guard."""
        return self.flag_step >= 0 if self.stop else torch.zeros(self.batch_size, dtype=torch.bool)

    def update(self, input_ids: Tensor) -> None:
        """Score what the latest forward call produced (called once per new token, before it is picked)."""
        step = self.calls
        self.calls += 1
        if step > 0 and self.eos_token_ids:  # rows that emitted EOS of their own on the previous step
            last = input_ids[:, -1].cpu()
            self.finished |= torch.isin(last, torch.tensor(self.eos_token_ids))
        if len(self.records) != self.calls:
            raise RuntimeError(
                f"guarded generation saw {len(self.records)} forward calls for {self.calls} new tokens; "
                "was prefill chunked or the cache disabled mid-way?"
            )
        if self.position in SCREEN_POSITIONS:
            if step == 0:
                self.screen_reports = self.guard.reports(self._prompt_activations())
                flagged = torch.tensor([r.flagged for r in self.screen_reports], dtype=torch.bool)
                self.flag_step[self.rows_of(flagged)] = 0
        elif self.position in RUNNING_POSITIONS and step > 0:
            # records[step] is the hidden state of response token step - 1 (the one just consumed).
            active = ~self.finished & (self.flag_step < 0)
            output = self.guard(self.records[step])
            flags = output.flagged.cpu() & active
            scores = output.scores.float().cpu().masked_fill(~active, float("nan"))
            self.step_scores.append(scores)
            self.step_clusters.append(output.clusters.cpu())
            self.streak = torch.where(flags, self.streak + 1, torch.zeros_like(self.streak))
            newly = (self.streak >= self.patience) & (self.flag_step < 0)
            self.flag_step[newly] = step
            if self.on_step is not None:
                self.on_step(StepVerdict(step, scores, self.flag_step >= 0))
            return
        if self.on_step is not None and step == 0 and self.screen_reports is not None:
            scores = torch.tensor([r.score for r in self.screen_reports])
            self.on_step(StepVerdict(0, scores, self.of_reports(self.flag_step >= 0)))

    def rows_of(self, per_report: Tensor) -> Tensor:
        """A value per report as a value per row the logits processor sees: under beam search a prompt's value
        (its first returned sequence's; all of a prompt's reports are alike) on each of its beams."""
        if self.beams == 1:
            return per_report
        return per_report[:: self.returned].repeat_interleave(self.beams)

    def of_reports(self, per_row: Tensor) -> Tensor:
        """A value per row the logits processor sees as a value per report: under beam search a prompt's first
        beam's for each sequence it returns (a screened prompt's beams are alike)."""
        if self.beams == 1:
            return per_row
        return per_row[:: self.beams].repeat_interleave(self.returned)

    def _prompt_activations(self) -> Any:
        """What the guard scores at the prefill: its one read, or every read of a guard with supervised heads."""
        if not self.guard.heads:
            return self.records[0]
        if self.prompt_reader is None:
            raise RuntimeError("a guard with supervised heads needs the prompt reader of the call")
        return self.prompt_reader.features(self.guard.reads)

    def force(self, scores: Tensor) -> Tensor:
        """Set the logits of stopped rows so that their next forced token is the only choice."""
        if not self.stop:
            return scores
        rows = (self.flag_step >= 0) & (self.forced_done < len(self.forced_tokens)) & ~self.finished
        if not rows.any():
            return scores
        index = rows.nonzero().flatten()
        tokens = torch.tensor(self.forced_tokens)[self.forced_done[index]]
        scores = scores.clone()
        scores[index.to(scores.device)] = float("-inf")
        scores[index.to(scores.device), tokens.to(scores.device)] = 0.0
        self.forced_done[index] += 1
        done = index[self.forced_done[index] >= len(self.forced_tokens)]
        self.finished[done] = True
        return scores

    def reports(self, *, explain: bool = False, top_k: int = 10, opening: Sequence[int] = ()) -> list[SafetyReport]:
        """The call's reports: the screening verdict, or the running statistic (:mod:`hf_lsad.guard.running`);
        ``opening``: the chat template's ids before the user's text, which explanations do not name."""
        stopped = self.of_reports(self.stopped).tolist()
        if self.position in SCREEN_POSITIONS:
            if not self.records:
                raise RuntimeError("generate made no forward call")
            tokens = self.prompt_reader.tokens(opening) if explain and self.prompt_reader is not None else None
            reports = self.guard.reports(self._prompt_activations(), explain=explain, top_k=top_k, tokens=tokens)
            return [r._replace(stopped=bool(stop)) for r, stop in zip(decided_at_prefill(reports), stopped)]
        from ..guard.running import sequence_statistic

        n = self.batch_size
        threshold = self.guard.threshold
        if not self.step_scores:  # one token per row: nothing consumed, nothing scored
            return [SafetyReport(float("-inf"), threshold, False, -1, None) for _ in range(n)]
        scores = torch.stack(self.step_scores, dim=1)  # [batch, steps]; step j scores response token j
        clusters = torch.stack(self.step_clusters, dim=1)
        statistic, at = sequence_statistic(scores, self.patience)
        features: list[Any] = [None] * n
        if explain:
            best = at.clamp_min(0)
            activations = torch.stack([self.records[int(best[r]) + 1][r] for r in range(n)])
            features = self.guard.explain(activations, top_k=top_k)
        out = []
        for r in range(n):
            flagged = bool(statistic[r] > threshold)
            step = int(self.flag_step[r]) if self.flag_step[r] >= 0 else (int(at[r]) + 1 if flagged else None)
            cluster = int(clusters[r, at[r]]) if at[r] >= 0 else -1
            out.append(
                SafetyReport(
                    score=float(statistic[r]),
                    threshold=threshold,
                    flagged=flagged,
                    cluster=cluster,
                    probability=None,
                    step=step,
                    stopped=bool(stopped[r]),
                    features=features[r],
                )
            )
        return out


class GuardLogitsProcessor(LogitsProcessor):
    """Scores each forward call's activation and forces stopped rows' tokens (see module docstring)."""

    def __init__(self, state: GuardedGenerationState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.state.update(input_ids)
        return cast(torch.FloatTensor, self.state.force(scores))  # transformers' annotation; a plain Tensor


class GuardStoppingCriteria(StoppingCriteria):
    """Per row: done once a stopped row's forced tokens are out (covers models without an EOS id)."""

    def __init__(self, state: GuardedGenerationState) -> None:
        self.state = state

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        state = self.state
        done = state.stopped & (state.forced_done >= len(state.forced_tokens))
        return cast(torch.BoolTensor, done.to(input_ids.device))  # as transformers annotates it
