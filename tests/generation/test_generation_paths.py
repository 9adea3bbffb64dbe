"""Every generation path reads the hooked block through one recorder.

Table: path (report, stop, on_step, running guard reporting, running guard stopping) x padding side
(left, right) x threads (1, 4). Each row of a batched call must get the report it gets alone (same
prompt, batch of one, no padding) within 1e-4, and on a stop path every row flagged alone is stopped.
Before the stop path shared the report path's recorder, right-padded rows were scored at a pad token
and concurrent calls counted each other's forward passes.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import pytest
import torch
from tiny import MIXED_BATCH, PROMPTS, RUNNING_MAX_NEW, fresh_guard, tiny_guard, tiny_running_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

UNDER_TEST = [*MIXED_BATCH, PROMPTS[3], PROMPTS[60], "x y z", "tell me a story about a dragon, please"]
PATHS = ("report", "stop", "on_step", "running_report", "running_stop")
PADDING = ("left", "right")
CALLS_PER_THREAD = {(1, "left"): 4, (1, "right"): 4, (4, "left"): 10, (4, "right"): 25}
"""Calls each thread makes. Before the stop path shared the recorder, 4 threads x 100 right-padded calls raised in 395
of 400 calls; 4 x 25 cannot all pass by chance under that bug, at a quarter of the suite's time."""
NEW_TOKENS = {"report": 3, "stop": 3, "on_step": 3, "running_report": RUNNING_MAX_NEW, "running_stop": RUNNING_MAX_NEW}
"""A prompt_last verdict exists after the prefill, so those paths need few tokens; running guards score each one."""


@cache
def guarded_for(path: str) -> GuardedModelForCausalLM:
    """A guarded tiny model whose threshold flags about half of :data:`UNDER_TEST` (so both verdicts occur)."""
    if path.startswith("running"):
        model, tokenizer, fit, _ = tiny_running_guard()
        guard = SafetyGuard(copy.deepcopy(fit.guard.config), fit.guard.detector, fit.guard.sae)  # threshold set below
        guard.running = fit.guard.running
    else:
        model, tokenizer, _ = tiny_guard("prompt_last")
        guard = fresh_guard("prompt_last")
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    scores = sorted(alone(guarded, prompt, "report").score for prompt in UNDER_TEST)
    guard.config.threshold = (scores[len(scores) // 2 - 1] + scores[len(scores) // 2]) / 2
    return guarded


def call(guarded: GuardedModelForCausalLM, prompts: list[str], path: str, padding_side: str = "left") -> Any:
    """One guarded generate of ``prompts`` on ``path``; returns the dict output (``.steps``: on_step verdicts)."""
    steps: list[Any] = []
    options: dict[str, Any] = {"on_flag": "stop" if path.endswith("stop") else "report"}
    if path == "on_step":
        options["on_step"] = steps.append
    inputs = encode_prompts(guarded.tokenizer, prompts, padding_side=padding_side)
    out = guarded.generate(
        **inputs, max_new_tokens=NEW_TOKENS[path], do_sample=False, return_dict_in_generate=True, **options
    )
    out.steps = steps
    out.prompt_length = inputs["input_ids"].shape[1]
    return out


def alone(guarded: GuardedModelForCausalLM, prompt: str, path: str) -> Any:
    """The report of ``prompt`` alone on the report path."""
    return call(guarded, [prompt], "running_report" if path.startswith("running") else "report").safety[0]


def running_reference(guarded: GuardedModelForCausalLM, prompt: str, response: torch.Tensor, stop: bool) -> Any:
    key = (id(guarded), prompt, tuple(response.tolist()), stop)
    if key not in _references:
        _references[key] = _running_reference(guarded, prompt, response, stop)
    return _references[key]


_references: dict[tuple, Any] = {}


def _running_reference(guarded: GuardedModelForCausalLM, prompt: str, response: torch.Tensor, stop: bool) -> Any:
    """What a running guard must report for ``response`` to ``prompt``, from one fresh unpadded forward pass.

    Step ``s`` scores the consumed response token ``s - 1`` while the row is active: it has emitted no
    EOS and has not been flagged (``patience`` consecutive scores above the threshold). Returns
    ``(statistic, flagged, stopped, step)`` as the report gives them.
    """
    from hf_lsad.guard.running import sequence_statistic

    guard, eos = guarded.guard, guarded.generation_config.eos_token_id
    ids = encode_prompts(guarded.tokenizer, [prompt])["input_ids"][0]
    with torch.no_grad():
        hidden = guarded.model(torch.cat([ids, response])[None], output_hidden_states=True).hidden_states
    hidden = hidden[guard.config.hook.layer + 1][0, len(ids) :]  # [response tokens, hidden]
    ends = (response == eos).nonzero().flatten().tolist()
    consumed = min(ends[0] + 1 if ends else len(response), len(response) - 1) if stop or not ends else ends[0]
    consumed = min(consumed, len(response) - 1)  # the last picked token is never fed back
    scores = guard(hidden[:consumed]).scores if consumed else torch.empty(0)
    patience, streak, flag_step = guard.running.patience, 0, None
    for t, score in enumerate(scores.tolist()):
        streak = streak + 1 if score > guard.threshold else 0
        if streak >= patience:
            flag_step = t + 1
            scores = scores[: t + 1]
            break
    statistic = float(sequence_statistic(scores[None], patience)[0][0]) if len(scores) else float("-inf")
    return statistic, statistic > guard.threshold, stop and flag_step is not None, flag_step


def check_call(
    guarded: GuardedModelForCausalLM, prompts: list[str], path: str, out: Any, want: dict, padding_side: str
) -> None:
    eos = guarded.generation_config.eos_token_id
    # transformers decodes the tokens after a right-padded prompt slightly differently from an unpadded pass
    # (hidden states up to 3e-4 apart on the tiny model; it warns that right padding is wrong for generation);
    # the running guard scores exactly what the model computed, so its tolerance there is relative.
    running_tolerance = {"abs": 1e-4} if padding_side == "left" else {"abs": 1e-4, "rel": 3e-3}
    for row, (prompt, report) in enumerate(zip(prompts, out.safety)):
        if path.startswith("running"):
            # the report equals a fresh pass over the response this call generated (a right-padded row's
            # response can differ from the one it gets alone: transformers picks its first token at a pad)
            response = out.sequences[row, out.prompt_length :]
            statistic, flagged, stopped, step = running_reference(guarded, prompt, response, path == "running_stop")
            assert report.score == pytest.approx(statistic, **running_tolerance), (path, prompt)
            assert report.flagged == flagged and report.stopped == stopped, (path, prompt)
            if stopped:
                assert report.step == step and int(response[step]) == eos, (path, prompt)
            continue
        expected = want[prompt]
        assert report.score == pytest.approx(expected.score, abs=1e-4), (path, prompt)
        assert report.flagged == expected.flagged and report.cluster == expected.cluster, (path, prompt)
        if path == "stop":
            assert report.stopped == expected.flagged, prompt  # every row flagged alone is stopped
            if report.stopped:
                assert int(out.sequences[row, out.prompt_length]) == eos  # before any token of its own
        else:
            assert not report.stopped
    if path == "on_step":
        assert out.steps[0].step == 0
        torch.testing.assert_close(
            out.steps[0].scores, torch.tensor([want[p].score for p in prompts]), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("threads", (1, 4))
@pytest.mark.parametrize("padding_side", PADDING)
@pytest.mark.parametrize("path", PATHS)
def test_every_row_gets_its_report_alone(path: str, padding_side: str, threads: int):
    guarded = guarded_for(path)
    want = {prompt: alone(guarded, prompt, path) for prompt in UNDER_TEST}
    assert any(r.flagged for r in want.values()) and not all(r.flagged for r in want.values())

    def batch(thread: int, i: int) -> list[str]:  # 2-5 prompts of mixed lengths, varying by call
        start = (thread * 5 + i * 3) % len(UNDER_TEST)
        return [UNDER_TEST[(start + k) % len(UNDER_TEST)] for k in range(2 + (thread + i) % 4)]

    barrier = threading.Barrier(threads)

    def worker(thread: int) -> int:
        barrier.wait()
        for i in range(CALLS_PER_THREAD[threads, padding_side]):
            prompts = batch(thread, i)
            check_call(guarded, prompts, path, call(guarded, prompts, path, padding_side), want, padding_side)
        return CALLS_PER_THREAD[threads, padding_side]

    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(worker, range(threads)))  # re-raises a worker's exception
    assert done == threads * CALLS_PER_THREAD[threads, padding_side]
