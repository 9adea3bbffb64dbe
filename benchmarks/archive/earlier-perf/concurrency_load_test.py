"""Load test: one GuardedModelForCausalLM, N threads x M guarded generate calls with mixed prompts.

Every concurrent call must return the same sequences and reports as the same call run alone
(scores within 1e-4, same verdicts and clusters), nothing raised, nothing lost.

    python benchmarks/archive/earlier-perf/concurrency_load_test.py --model default --threads 4 --calls 25

Writes ``benchmarks/results/concurrency_load_test_<model>.json``.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import environment, load_average, write_result

from hf_lsad import GuardedModelForCausalLM, SafetyGuard
from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--guard", default="default")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()

    load_before = load_average()
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(args.guard))
    print(f"loaded in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
    pool = [p.text for p in load_prompts("safe", limit=40, seed=0)] + [
        p.text for p in load_prompts("harmful", limit=20, seed=0)
    ]
    specs = {}
    for t in range(args.threads):
        for i in range(args.calls):
            start, size = (t * 31 + i * 7) % len(pool), 1 + (t + i) % 3
            specs[(t, i)] = (
                [pool[(start + k) % len(pool)] for k in range(size)],
                2 + (t * 3 + i) % (args.max_new_tokens - 1),
            )

    def call(key):
        prompts, new = specs[key]
        out = guarded.generate(
            **encode_prompts(tokenizer, prompts), max_new_tokens=new, do_sample=False, return_dict_in_generate=True
        )
        return out.sequences, out.safety

    t0 = time.perf_counter()
    alone = {key: call(key) for key in specs}
    sequential = time.perf_counter() - t0
    barrier = threading.Barrier(args.threads)

    def worker(t):
        barrier.wait()
        return {(t, i): call((t, i)) for i in range(args.calls)}

    t0 = time.perf_counter()
    results, errors = {}, []
    with ThreadPoolExecutor(args.threads) as ex:
        for future in [ex.submit(worker, t) for t in range(args.threads)]:
            try:
                results.update(future.result())
            except Exception as err:  # any failure in a worker is recorded, not raised
                errors.append(repr(err))
    concurrent = time.perf_counter() - t0
    mismatches, max_delta, rows, flagged = 0, 0.0, 0, 0
    for key, (sequences, reports) in results.items():
        want_sequences, want_reports = alone[key]
        same = torch.equal(sequences, want_sequences) and len(reports) == len(want_reports)
        for r, w in zip(reports, want_reports):
            max_delta = max(max_delta, abs(r.score - w.score))
            same &= abs(r.score - w.score) <= 1e-4 and r.flagged == w.flagged and r.cluster == w.cluster
            rows += 1
            flagged += r.flagged
        mismatches += not same
    n = args.threads * args.calls
    print(
        f"{args.threads} threads x {args.calls} calls ({rows} rows, {flagged} flagged): {len(results)}/{n} returned, "
        f"{len(errors)} raised, {mismatches} differ from the call alone, max |score delta| {max_delta:.2e}"
    )
    print(
        f"wall: sequential {sequential:.1f} s ({sequential / n:.2f} s/call), concurrent {concurrent:.1f} s "
        f"({concurrent / n:.2f} s/call)"
    )
    if errors:
        print("errors:", errors[:3])
    record = {
        **environment(torch.device("cpu")),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "settings": vars(args),
        "calls": n,
        "returned": len(results),
        "raised": len(errors),
        "rows": rows,
        "flagged": flagged,
        "differ_from_call_alone": mismatches,
        "max_abs_score_delta": max_delta,
        "sequential_s": sequential,
        "concurrent_s": concurrent,
        "errors": errors[:3],
    }
    print(f"wrote {write_result(f'concurrency_load_test_{args.model}', record)}")


if __name__ == "__main__":
    main()
