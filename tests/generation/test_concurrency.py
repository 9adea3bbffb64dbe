"""One GuardedModelForCausalLM serving concurrent generate calls from several threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from tiny import PROMPTS, tiny_guard

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.generation.model import GuardedModelForCausalLM

MIXED = ["hi", "a much longer prompt about baking bread at home, step by step", "medium prompt here", *PROMPTS[::7]]


def call_spec(thread: int, i: int) -> tuple[list[str], int]:
    """Prompts and max_new_tokens of call ``i`` of ``thread``: batches of 1-3 prompts of mixed lengths."""
    start = (thread * 31 + i * 7) % len(MIXED)
    size = 1 + (thread + i) % 3
    prompts = [MIXED[(start + k) % len(MIXED)] for k in range(size)]
    return prompts, 2 + (thread * 3 + i) % 5


def run(guarded, tokenizer, prompts, new_tokens):
    inputs = encode_prompts(tokenizer, prompts)
    out = guarded.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    assert guarded.last_safety is out.safety  # this thread's reports, not another's
    return out.sequences, out.safety


def assert_same(got, want):
    (sequences, reports), (want_sequences, want_reports) = got, want
    assert torch.equal(sequences, want_sequences)
    assert len(reports) == len(want_reports)
    for r, w in zip(reports, want_reports):
        assert abs(r.score - w.score) <= 1e-4 and r.cluster == w.cluster and r.flagged == w.flagged


def load_test(n_threads: int, n_calls: int) -> int:
    """Every call of ``n_threads`` x ``n_calls`` concurrent calls equals the same call run alone; returns calls
    checked."""
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    specs = {(t, i): call_spec(t, i) for t in range(n_threads) for i in range(n_calls)}
    alone = {key: run(guarded, tokenizer, *spec) for key, spec in specs.items()}
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> dict:
        barrier.wait()
        return {(t, i): run(guarded, tokenizer, *specs[(t, i)]) for i in range(n_calls)}

    with ThreadPoolExecutor(n_threads) as pool:
        results = {}
        for part in pool.map(worker, range(n_threads)):  # re-raises any worker's exception
            results.update(part)
    assert set(results) == set(specs)  # nothing lost
    for key in specs:
        assert_same(results[key], alone[key])
    return len(results)


def test_two_threads_never_exchange_reports():
    """Fails on code whose calls share one hook: both calls hooked the same block and saw each other's passes."""
    assert load_test(2, 10) == 20


def test_four_threads_by_25_calls_match_each_call_alone():
    assert load_test(4, 25) == 100


def test_last_safety_is_per_thread():
    model, tokenizer, guard = tiny_guard()
    guarded = GuardedModelForCausalLM(model, guard)
    guarded.generate(**encode_prompts(tokenizer, ["hello"]), max_new_tokens=2, do_sample=False)
    mine = guarded.last_safety
    seen = []
    thread = threading.Thread(target=lambda: seen.append(guarded.last_safety))
    thread.start()
    thread.join()
    assert seen == [None] and len(mine) == 1
