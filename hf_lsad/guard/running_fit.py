"""Collecting per-token response activations and fitting a ``response_running`` guard (:mod:`hf_lsad.guard.running`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from .running import RunningConfig, sequence_statistic

if TYPE_CHECKING:
    from ..core.hook_point import HookPoint
    from ..detectors import DetectorConfig
    from ..sae.model import SparseAutoencoder
    from .guard import SafetyGuard


class RunningFit(NamedTuple):
    """A running guard and the safe responses it was fitted and thresholded on."""

    guard: SafetyGuard
    holdout_statistics: Tensor
    """``S`` of each held-out safe response, the values the threshold was set on."""
    fit_sequences: Tensor
    """Indices, among the non-empty safe responses, of those the detector was fitted on."""
    holdout_sequences: Tensor
    """Indices, among the non-empty safe responses, of those the threshold was set on."""


@torch.no_grad()
def collect_response_activations(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    layer: int,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    chat_template: bool = True,
    progress: bool = False,
) -> list[Tensor]:
    """Per prompt, ``[n_i, hidden]``: the activation at block ``layer`` of each consumed token of its greedy response.

    Row ``t`` is the hidden state of response token ``t`` (what a ``response_running`` guard
    scores at generation step ``t + 1``); tokens after the first EOS are dropped.
    """
    from tqdm.auto import tqdm

    from ..capture.collect import encode_prompts
    from ..capture.generate_call import eos_token_ids
    from ..capture.recorder import LastPositionRecorder, decoder_layer

    _, module = decoder_layer(model, layer)
    eos = torch.tensor(eos_token_ids(model, {}))
    out: list[Tensor] = [None] * len(prompts)  # type: ignore[list-item]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in tqdm(range(0, len(order), batch_size), desc="collect response tokens", disable=not progress):
        batch = order[start : start + batch_size]
        prompts_batch = [prompts[i] for i in batch]
        inputs = encode_prompts(tokenizer, prompts_batch, chat_template=chat_template, device=model.device)
        with LastPositionRecorder(module) as recorder:
            sequences = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = sequences[:, inputs["input_ids"].shape[1] :].cpu()
        records = torch.stack(recorder.records[1:], dim=1).float().cpu() if len(recorder.records) > 1 else None
        for row, i in enumerate(batch):
            is_eos = torch.isin(new[row], eos) if len(eos) else torch.zeros(new.shape[1], dtype=torch.bool)
            n = int(is_eos.nonzero()[0]) + 1 if is_eos.any() else new.shape[1]  # tokens generated, EOS included
            consumed = n - 1  # the last one is never fed back
            out[i] = records[row, :consumed] if records is not None else torch.empty(0, model.config.hidden_size)
    return out


def fit_running_guard(
    safe_sequences: Sequence[Tensor],
    hook: HookPoint,
    method: str,
    detector_config: DetectorConfig,
    sae: SparseAutoencoder | None,
    *,
    patience: int = 3,
    stride: int = 1,
    max_new_tokens: int = 64,
    target_fpr: float = 0.05,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = False,
) -> RunningFit:
    """Fit a ``response_running`` guard on per-response activations (:func:`collect_response_activations`).

    Sequences are split ``1 - holdout_fraction`` / ``holdout_fraction`` (seeded); the detector
    is fitted on every ``stride``-th token of the fit sequences, and the threshold set on the
    held-out sequences' statistics ``S`` at ``target_fpr`` (module docstring).
    """
    from ..core.splits import split_safe
    from ..detectors import detector_class
    from .guard import GuardConfig, SafetyGuard
    from .threshold import fpr_threshold

    if hook.position != "response_running":
        raise ValueError(f"a running guard reads position response_running, not {hook.position}")
    if sae is not None:
        sae.check_reads(hook)
    sequences = [s for s in safe_sequences if len(s) > 0]
    split = split_safe(len(sequences), holdout_fraction, seed)
    fit_rows = torch.cat([sequences[i][::stride] for i in split.fit.tolist()]).float()
    detector = detector_class(method)(detector_config, hook.hidden_size, sae.config.d_sae if sae else None)
    detector.fit(fit_rows, sae, progress=progress)
    with torch.no_grad():
        statistics = torch.stack(
            [
                sequence_statistic(detector(sequences[i].float(), sae).scores[None].float().cpu(), patience)[0][0]
                for i in split.holdout.tolist()
            ]
        )
    config = GuardConfig(
        hook=hook,
        method=method,
        threshold=fpr_threshold(statistics, target_fpr),
        target_fpr=target_fpr,
        n_fit=len(fit_rows),
        n_holdout=int(sum(len(sequences[i]) for i in split.holdout.tolist())),
        seed=seed,
    )
    guard = SafetyGuard(config, detector, sae).eval()
    guard.running = replace(
        RunningConfig(),
        patience=patience,
        stride=stride,
        max_new_tokens=max_new_tokens,
        n_holdout_sequences=len(split.holdout),
    )
    return RunningFit(guard, statistics, split.fit, split.holdout)
