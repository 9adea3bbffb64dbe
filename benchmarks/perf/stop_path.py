"""The stop path on SmolLM2 as a new user meets it: right padding (the tokenizer's default) and threads.

1. Right padding. Harmful prompts that the bundled guard flags alone, batched with chat prompts it
   passes, tokenised with SmolLM2's own default (``padding_side="right"``): on ``on_flag="report"``,
   ``on_flag="stop"`` and ``on_step``, every row must get its verdict alone, and on the stop path every
   flagged row must be stopped before its first token.
2. Threads. ``--threads`` x ``--calls`` concurrent guarded ``generate`` calls on one model, per path
   (report, stop, on_step, and a running guard), half of them right-padded (running guard: left-padded,
   see ``concurrent_calls``): nothing raised, every report equal to the same prompt alone (scores
   within 1e-4, same verdicts). The running guard is the bundled guard's detector read
   at every response token (position ``response_running``, patience 2, threshold halfway between the two
   middle statistics of the calls' prompts alone, so that no row sits on it within float noise): it checks the
   per-token path, not a detection claim.

"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hf_lsad import GuardedModelForCausalLM, SafetyGuard
from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_prompts
from hf_lsad.guard.running import RunningConfig
from perf.harness import environment

PATHS = ("report", "stop", "on_step", "running")


def generate(guarded: GuardedModelForCausalLM, prompts: list[str], path: str, side: str, new: int) -> Any:
    steps: list[Any] = []
    options: dict[str, Any] = {"on_flag": "stop" if path in ("stop", "on_step") else "report"}
    if path == "on_step":
        options["on_step"] = steps.append
    inputs = encode_prompts(guarded.tokenizer, prompts, padding_side=side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' right-padding notice
        out = guarded.generate(**inputs, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, **options)
    out.prompt_length = inputs["input_ids"].shape[1]
    out.steps = steps
    return out


def running_guard(guard: SafetyGuard) -> SafetyGuard:
    """The bundled guard's detector and SAE, read at every response token (uncalibrated, patience 2)."""
    config = copy.deepcopy(guard.config)
    config.hook = dataclasses.replace(config.hook, position="response_running")
    running = SafetyGuard(config, guard.detector, guard.sae)
    running.running = RunningConfig(patience=2)
    return running


def right_padding_case(guarded: GuardedModelForCausalLM, harmful: list[str], chat: list[str]) -> dict[str, Any]:
    alone = {p: guarded.screen([p])[0] for p in harmful + chat}
    flagged_alone = [p for p in harmful if alone[p].flagged][:3]
    passed_alone = [p for p in chat if not alone[p].flagged][:4]
    batch = flagged_alone + passed_alone
    eos = guarded.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    result: dict[str, Any] = {"prompts": batch, "alone_probability": [alone[p].probability for p in batch]}
    for path in ("report", "stop", "on_step"):
        out = generate(guarded, batch, path, "right", 16)
        rows = []
        for row, (prompt, report) in enumerate(zip(batch, out.safety)):
            first = int(out.sequences[row, out.prompt_length])
            rows.append(
                {
                    "flagged_alone": alone[prompt].flagged,
                    "flagged": report.flagged,
                    "stopped": report.stopped,
                    "first_token_is_eos": first in eos,
                    "probability": report.probability,
                    "score_delta": abs(report.score - alone[prompt].score),
                }
            )
        should_stop = path != "report"
        result[path] = {
            "rows": rows,
            "verdicts_equal_alone": all(r["flagged"] == r["flagged_alone"] for r in rows),
            "flagged_alone_stopped_before_first_token": all(
                r["stopped"] and r["first_token_is_eos"] for r in rows if r["flagged_alone"]
            )
            if should_stop
            else None,
            "max_score_delta": max(r["score_delta"] for r in rows),
        }
        print(
            f"right padding, {path}: {result[path]['verdicts_equal_alone']=}, "
            f"stopped={result[path]['flagged_alone_stopped_before_first_token']}, "
            f"max |delta| {result[path]['max_score_delta']:.2e}"
        )
    return result


def threads_case(guarded: dict[str, GuardedModelForCausalLM], pool: list[str], threads: int, calls: int) -> dict:
    results = {}
    for path in PATHS:
        results[path] = concurrent_calls(
            guarded["running" if path == "running" else "screening"], path, pool, threads, calls
        )
        print(f"threads {threads} x {calls}, {path}: {results[path]}")
    return results


def concurrent_calls(model: GuardedModelForCausalLM, path: str, pool: list[str], threads: int, calls: int) -> dict:
    """``threads`` x ``calls`` calls on ``path`` (batches of 1-3 prompts, left or right padded) against each alone."""
    specs = {}
    for t in range(threads):
        for i in range(calls):
            start, size = (t * 31 + i * 7) % len(pool), 1 + (t + i) % 3
            # A right-padded row gets another response than alone (transformers picks its first token at a pad),
            # so the running guard, which scores the response, is compared on left-padded calls here; the test
            # suite checks its right-padded rows against a fresh pass over the response they got.
            side = "right" if (t + i) % 2 and path != "running" else "left"
            specs[t, i] = ([pool[(start + k) % len(pool)] for k in range(size)], side)
    new = 12 if path == "running" else 4
    alone = {p: generate(model, [p], path, "left", new).safety[0] for p in pool}
    barrier = threading.Barrier(threads)
    failures: list[str] = []
    errors: list[str] = []

    def worker(t: int) -> tuple[int, int]:
        barrier.wait()
        raised = 0
        for i in range(calls):
            prompts, side = specs[t, i]
            try:
                out = generate(model, prompts, path, side, new)
            except Exception as err:  # counted, not hidden: the acceptance is 0 raised
                raised += 1
                errors.append(f"{path} {side}: {type(err).__name__}: {err}")
                continue
            for prompt, report in zip(prompts, out.safety):
                want = alone[prompt]
                if abs(report.score - want.score) > 1e-4 or report.flagged != want.flagged:
                    failures.append(f"{path} {side} {prompt[:40]!r}: {report.score} vs {want.score}")
        return calls, raised

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as executor:
        counts = list(executor.map(worker, range(threads)))
    return {
        "calls": sum(c for c, _ in counts),
        "raised": sum(r for _, r in counts),
        "different_from_alone": len(failures),
        "failures": failures[:10],
        "errors": errors[:10],
        "seconds": round(time.perf_counter() - start, 1),
    }


@dataclass
class Settings:
    threads: int = 4
    """Concurrent threads."""
    calls: int = 10
    """Calls per thread and path."""
    harmful: int = 40
    """Harmful prompts searched for ones the guard flags alone."""


def run(args: Settings) -> dict[str, Any]:
    model, tokenizer = load_model("default")
    assert tokenizer.padding_side == "right", "SmolLM2's tokenizer pads on the right by default"
    guard = SafetyGuard.from_pretrained("default")
    screening = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    harmful = [p.text for p in load_prompts("harmful", limit=args.harmful, seed=0)]
    chat = [p.text for p in load_prompts("chat", limit=20, seed=0)]
    right = right_padding_case(screening, harmful, chat)

    running = GuardedModelForCausalLM(model, running_guard(guard), tokenizer=tokenizer)
    pool = right["prompts"]
    statistics = sorted(generate(running, [p], "running", "left", 12).safety[0].score for p in pool)
    # A threshold equal to a row's own statistic would let a 1e-5 wobble of batched arithmetic decide that row.
    middle = len(statistics) // 2
    running.guard.config.threshold = (statistics[middle - 1] + statistics[middle]) / 2
    threads = threads_case({"screening": screening, "running": running}, pool, args.threads, args.calls)
    return {"environment": environment(model.device), "right_padding": right, "threads": threads}
