"""Screening before decoding with a ``prompt_last`` guard: throughput against a forward pass cut at the deepest
hooked block (every head's reads come from that one pass), and the stop path on harmful prompts.

1. Throughput (prompts/s, median of ``repeats``, the variants interleaved in each repeat so load drift hits
   all): ``screen()`` on pre-tokenised batches, ``screen()`` from strings (tokenisation included), a forward
   pass cut after the deepest hooked block (:func:`hf_lsad.capture.recorder.prefill_activations`, what ``screen`` is
   built on), ``generate(max_new_tokens=1)`` and a full forward pass, on the ``n_prompts`` shortest prompts
   of the safe pool in batches of ``batch_size``.
2. ``on_flag="stop"`` on ``harmful`` prompts of the harmful pool (greedy, ``new_tokens``): flagged rows must
   generate no token of their own (only EOS), unflagged rows exactly the tokens of plain ``generate``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import prefill_activations
from hf_lsad.data import load_pool
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import SafetyGuard
from perf.harness import environment, load_average, timed


def batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass
class Settings:
    guard: str = "default"
    """Guard folder or Hub repo with a ``prompt_last`` guard (``default``: the bundled guard)."""
    n_prompts: int = 64
    """Safe prompts screened (the shortest of the pool)."""
    batch_size: int = 16
    """Prompts per batch."""
    repeats: int = 5
    """Timed runs per variant, after one warm-up."""
    harmful: int = 0
    """Harmful prompts for the stop check (0: the whole pool)."""
    new_tokens: int = 32
    """Tokens generated per row in the stop check."""
    stop_check: bool = True
    """Run the stop check."""


@torch.no_grad()
def run(args: Settings) -> dict[str, Any]:
    load_before = load_average()
    model, tokenizer = load_model("default")
    guard = SafetyGuard.from_pretrained(args.guard)
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    layer = max(layer for layer, _ in guard.reads)  # the deepest block any head reads: where screening stops

    # short chat prompts: the shortest of the safe pool
    safe = sorted((p.text for p in load_pool("safe")), key=len)[: args.n_prompts]
    text_batches = batches(safe, args.batch_size)
    encoded = [encode_prompts(tokenizer, b) for b in text_batches]
    variants = {
        "screen_ids": lambda: [guarded.screen(e["input_ids"], e["attention_mask"]) for e in encoded],
        "screen_strings": lambda: [guarded.screen(b) for b in text_batches],
        "forward_cut_at_layer": lambda: [
            prefill_activations(model, layer, e["input_ids"], e["attention_mask"]) for e in encoded
        ],
        "generate_1_token": lambda: [
            model.generate(**e, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id) for e in encoded
        ],
        "full_forward": lambda: [model(**e, use_cache=False) for e in encoded],
    }
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    throughput = {name: len(safe) / statistics.median(t) for name, t in times.items()}
    load_after_throughput = load_average()
    for name, value in throughput.items():
        print(f"{name:>22}: {value:7.1f} prompts/s (median of {args.repeats})")
    ratio = throughput["screen_ids"] / throughput["forward_cut_at_layer"]
    print(f"screen / forward cut at layer {layer}: {ratio:.3f}")
    print(f"load average before {load_before}, after {load_after_throughput}")

    stop_check = None
    if args.stop_check:
        harmful = [p.text for p in load_pool("harmful", limit=args.harmful or None, seed=0)]
        n_flagged = n_rows = 0
        mismatched_unflagged = flagged_with_tokens = 0
        start = time.perf_counter()
        for batch in batches(harmful, args.batch_size):
            inputs = encode_prompts(tokenizer, batch)
            prompt_length = inputs["input_ids"].shape[1]
            settings = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            plain = model.generate(**inputs, **settings)
            out = guarded.generate(**inputs, **settings, on_flag="stop", return_dict_in_generate=True)
            width = out.sequences.shape[1]
            for row, report in enumerate(out.safety):
                n_rows += 1
                new = out.sequences[row, prompt_length:]
                if report.flagged:
                    n_flagged += 1
                    eos = tokenizer.eos_token_id
                    if not (new[0] == eos and (new[1:] == tokenizer.pad_token_id).all()):
                        flagged_with_tokens += 1
                elif not (
                    torch.equal(out.sequences[row], plain[row, :width])
                    and (plain[row, width:] == tokenizer.pad_token_id).all()
                ):
                    mismatched_unflagged += 1
        stop_check = {
            "harmful_prompts": n_rows,
            "flagged": n_flagged,
            "flagged_rows_with_own_tokens": flagged_with_tokens,
            "unflagged_rows_differing_from_plain_generate": mismatched_unflagged,
            "new_tokens": args.new_tokens,
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(stop_check)

    return {
        "environment": environment(torch.device("cpu")),
        "load_average_before": load_before,
        "load_average_after_throughput": load_after_throughput,
        "load_average_after": load_average(),
        "n_prompts": len(safe),
        "seconds": times,
        "prompts_per_second": throughput,
        "screen_over_forward_cut": ratio,
        "stop_check": stop_check,
    }
