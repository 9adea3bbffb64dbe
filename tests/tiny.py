"""A tiny seeded Llama with a guard fitted on its activations, shared by tests (built once)."""

from __future__ import annotations

import contextlib
import copy
import threading
from functools import cache

import torch

from hf_lsad.capture.collect import collect_activations
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.core.locking import held_alone
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.guard import SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.sae.training import SAETrainConfig, train_sae
from hf_lsad.testing import tiny_model

LAYER = 2
PROMPTS = [f"question {i}: what is {i} plus {i * 3 % 7}?" for i in range(48)] + [
    f"please write a short note number {i} about the weather" for i in range(48)
]
MIXED_BATCH = ["hi", "a much longer prompt about baking bread at home, step by step", "medium prompt here"]


@cache
def tiny_guard(position: str = "response_last"):
    """(model, tokenizer, guard) with the guard fitted on :data:`PROMPTS` at ``position``."""
    model, tokenizer = tiny_model("llama", seed=0)
    collected = collect_activations(
        model, tokenizer, PROMPTS, layer=LAYER, position=position, batch_size=16, max_new_tokens=6, progress=False
    )
    sae = train_sae(
        collected.activations, 64, SAETrainConfig(epochs=20, batch_size=32, l1_coefficient=1e-3), progress=False
    )
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=16)
    hook = HookPoint.from_model(model, LAYER, position, base_model="tiny-llama")
    guard = fit_guard(collected.activations, hook, "freqmask-km", config, sae, progress=False).guard
    return model, tokenizer, guard


RUNNING_MAX_NEW = 8
"""Response length the running guard's threshold was set at."""


@cache
def tiny_running_guard(patience: int = 2):
    """(model, tokenizer, fit, sequences): a ``response_running`` guard fitted on the responses to :data:`PROMPTS`."""
    from hf_lsad.guard.running_fit import collect_response_activations, fit_running_guard

    model, tokenizer, base = tiny_guard("response_last")
    sequences = collect_response_activations(model, tokenizer, PROMPTS, layer=LAYER, max_new_tokens=RUNNING_MAX_NEW)
    hook = HookPoint.from_model(model, LAYER, "response_running", base_model="tiny-llama")
    config = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=3), mask_size=16)
    fit = fit_running_guard(
        sequences,
        hook,
        "freqmask-km",
        config,
        base.sae,
        patience=patience,
        max_new_tokens=RUNNING_MAX_NEW,
        target_fpr=0.1,
    )
    return model, tokenizer, fit, sequences


def fresh_guard(position: str = "response_last") -> SafetyGuard:
    """A copy of the cached guard that a test may modify."""
    _, _, guard = tiny_guard(position)
    detector = type(guard.detector)(guard.detector.config, guard.detector.d_in, guard.detector.d_sae)
    detector.load_state_dict(guard.detector.state_dict())
    copied = SafetyGuard(copy.deepcopy(guard.config), detector, copy.deepcopy(guard.sae))
    copied.set_holdout_scores(guard.holdout_scores)
    return copied


def last_layer_output(model, sequence: torch.Tensor) -> torch.Tensor:
    """Hidden state after decoder block LAYER at the last position of an unpadded sequence."""
    with torch.no_grad():
        return model(sequence[None], output_hidden_states=True).hidden_states[LAYER + 1][0, -1]


def reports_of(model, guards, inputs, *, max_new_tokens: int = 4) -> list:
    """The reports of a guarded greedy ``generate`` on ``inputs``, once per guard (to compare saved and loaded)."""
    from hf_lsad.generation.model import GuardedModelForCausalLM

    return [
        GuardedModelForCausalLM(model, g)
        .generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        .safety
        for g in guards
    ]


HEAD_READS = [(1, "prompt_mean"), (LAYER, "prompt_last")]
"""The tiny supervised head's reads: another layer and position than the anomaly head's, and its own."""
UNSAFE_PROMPTS = [f"explain how to steal the password of account {i} from my neighbour" for i in range(48)]
"""The tiny head's kind of harm."""


HEAD_PROBES: dict[str, dict] = {
    "logistic": {},
    "mlp": {"kind": "mlp", "mlp_units": 8},
    "mlp-2-fits": {"kind": "mlp", "mlp_units": 8, "mlp_members": 2},
}
"""Every kind of supervised head, and an MLP that averages two fits: their probe settings beside the reads."""

PROBE_KINDS = list(HEAD_PROBES)
"""The heads of :data:`HEAD_PROBES`, for tests that run over all of them."""

TRAFFIC = [f"how do I reset the password of my own account number {i}?" for i in range(150)]
"""A benign kind of traffic the tiny guard's heads were not fitted on: it flags all of it at its thresholds."""
SAMPLE = [t for i, t in enumerate(TRAFFIC) if i % 3]
HELD_OUT = [t for i, t in enumerate(TRAFFIC) if not i % 3]
"""A user's sample of :data:`TRAFFIC` (100 prompts) and more traffic of the same kind (50)."""
SHORT_POOLS = ["harmful", "toxic_text", "questions", "statements"]
ROWS_PER_POOL = 12
"""Bundled pools of short prompts and fit rows per pool for tests that teach a head or fill a cache (the release fits
on every row of 13 pools)."""
SHOP_TURN = "You are the support assistant of a small web shop."
"""A deployment's own system turn."""


@cache
def tiny_head_rows() -> tuple[dict, torch.Tensor, list[str]]:
    """The rows :func:`tiny_head` is fitted on, read on the tiny model: :data:`HEAD_READS` of :data:`PROMPTS` then
    :data:`UNSAFE_PROMPTS`, their 0/1 labels and groups (``benign``, ``stealing``)."""
    from hf_lsad.capture.collect import collect_prompt_features

    model, tokenizer, _ = tiny_guard("prompt_last")
    reads, _ = collect_prompt_features(model, tokenizer, PROMPTS + UNSAFE_PROMPTS, HEAD_READS, progress=False)
    labels = torch.tensor([0] * len(PROMPTS) + [1] * len(UNSAFE_PROMPTS))
    groups = ["benign"] * len(PROMPTS) + ["stealing"] * len(UNSAFE_PROMPTS)
    return reads, labels, groups


@cache
def tiny_head(kind: str = "logistic"):
    """A supervised head ``harm`` of ``kind`` (:data:`HEAD_PROBES`) fitted on the tiny model: :data:`UNSAFE_PROMPTS`
    against :data:`PROMPTS`."""
    from hf_lsad.guard.heads import ProbeConfig
    from hf_lsad.guard.heads.training import fit_head

    reads, labels, groups = tiny_head_rows()
    return fit_head("harm", reads, labels, groups, ProbeConfig(reads=HEAD_READS, **HEAD_PROBES[kind]))


def two_headed_guard(target_fpr: float = 0.25, kind: str = "logistic") -> SafetyGuard:
    """A fresh ``prompt_last`` tiny guard with :func:`tiny_head` of ``kind`` added and the budget set on
    :data:`PROMPTS`."""
    from hf_lsad.capture.collect import collect_prompt_features

    model, tokenizer, _ = tiny_guard("prompt_last")
    guard = fresh_guard("prompt_last")
    guard.add_head(copy.deepcopy(tiny_head(kind)))
    benign, _ = collect_prompt_features(model, tokenizer, PROMPTS, guard.reads, progress=False)
    guard.fit_budget(benign, target_fpr=target_fpr, shares=[0.5, 0.5], rows="tiny benign prompts")
    return guard


@contextlib.contextmanager
def held_by_another_run(path):
    """``path`` held by another run until the block ends: a thread of its own holding it with ``held_alone``."""
    holding, done = threading.Event(), threading.Event()

    def hold():
        with held_alone(path, "held by another run"):
            holding.set()
            done.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(10), f"{path} could not be held"
        yield
    finally:
        done.set()
        thread.join()


def refused_to_another_run(path) -> bool:
    """Whether another run (a thread of its own) is refused ``path``."""
    refused = []

    def attempt():
        try:
            with held_alone(path, "busy"):
                pass
        except ValueError:
            refused.append(True)

    thread = threading.Thread(target=attempt)
    thread.start()
    thread.join()
    return bool(refused)
