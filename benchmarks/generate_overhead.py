"""Wall time of guarded vs plain ``generate`` on the same model, interleaved, median of repeats.

    python benchmarks/generate_overhead.py [--batch-sizes 1 8] [--new-tokens 64] [--repeats 5]

Both runs generate exactly ``--new-tokens`` tokens greedily from the same
prompts (``min_new_tokens`` = ``max_new_tokens``), so they do the same model
work; plain and guarded calls alternate so drift on the machine hits both.
Writes ``benchmarks/results/generate_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard

RESULTS = Path(__file__).parent / "results"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--guard", default="default")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model)
    guarded = GuardedModelForCausalLM(model, SafetyGuard.from_pretrained(args.guard))
    prompts = [p.text for p in load_pool("safe", limit=max(args.batch_sizes), seed=1)]
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    results = {}
    for batch_size in args.batch_sizes:
        inputs = encode_prompts(tokenizer, prompts[:batch_size])
        with torch.no_grad():
            plain_fn = partial(model.generate, **inputs, **settings)
            guarded_fn = partial(guarded.generate, **inputs, **settings)
            assert torch.equal(plain_fn(), guarded_fn())  # warm-up, and the same sequences
            plain, guard = [], []
            for _ in range(args.repeats):
                plain.append(timed(plain_fn))
                guard.append(timed(guarded_fn))
        results[f"batch_{batch_size}"] = {
            "plain_median_s": statistics.median(plain),
            "guarded_median_s": statistics.median(guard),
            "ratio": statistics.median(guard) / statistics.median(plain),
            "plain_s": plain,
            "guarded_s": guard,
        }
        print(batch_size, json.dumps(results[f"batch_{batch_size}"], indent=2))
    RESULTS.mkdir(exist_ok=True)
    record = {
        "command": "python benchmarks/generate_overhead.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
        ),
        "machine": (
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}"
        ),
        "results": results,
    }
    (RESULTS / "generate_overhead.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
