"""Stopping an unsafe response as it is written, on SmolLM2: false stops, detection, tokens before the stop, wall time.

    python benchmarks/archive/task-prompt-study/running_guard_smollm2.py [--fit 240] [--eval-safe 80] [--harmful 80]
        [--patience 3] [--target-fpr 0.03] [--new-tokens 64] [--repeats 5] [--timing-batches 2]

1. Collect (cached under ``artifacts/running/``): the greedy responses (``--new-tokens``) of
   SmolLM2 to ``--fit`` safe prompts (chat and task pools, seeded, at most 1,000 chars), to
   ``--eval-safe`` *other* safe prompts, and to ``--harmful`` harmful plus as many
   vauban-harmful prompts, with the activation at the bundled guard's layer of every
   consumed response token (:func:`hf_lsad.guard.running_fit.collect_response_activations`).
2. Fit a ``response_running`` FreqMask-KM guard (the bundled guard's SAE and layer, K=20,
   local mask 100) on the fit responses; its per-sequence threshold is set on a third of
   them at ``--target-fpr`` (:mod:`hf_lsad.guard.running`). Beside it, a ``response_last``
   guard (same detector settings) fitted on the last consumed token of the same fit
   responses (``--last-k`` clusters: it has one row per response, not one per token), threshold at
   ``--target-fpr`` on the same held-out third.
3. Evaluate on responses that played no part in fitting or thresholds: fraction of held-out
   safe responses stopped, fraction of harmful responses stopped and the median tokens
   written before the stop; the ``response_last`` guard's flag rates on the same rows.
   The offline statistic is checked against real guarded ``generate(on_flag="stop")`` on the
   timing batches (same verdicts).
4. Wall time: guarded ``generate(on_flag="stop")`` vs plain ``generate`` on ``--timing-batches``
   batches of 8 held-out safe prompts, ``--new-tokens`` new tokens, interleaved, median of
   ``--repeats``.

Writes ``benchmarks/results/running_guard_smollm2.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from common import environment, load_average, write_result
from safetensors.torch import load_file, save_file

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import load_pool
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard import DEFAULT_GUARD, SafetyGuard
from hf_lsad.guard.fitting import fit_guard
from hf_lsad.guard.running import sequence_statistic
from hf_lsad.guard.running_fit import collect_response_activations, fit_running_guard

CACHE = Path("artifacts/running")
DETECTOR = FreqMaskConfig(kmeans=KMeansConfig(n_clusters=20), mask_size=100, mask_scope="local")


def pick(pool: str, n: int, seed: int, skip: set[str] = frozenset()) -> list[str]:
    texts = [p.text for p in load_pool(pool) if len(p.text) <= 1000 and p.text not in skip]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def collected(name: str, prompts: list[str], model, tokenizer, layer: int, new_tokens: int) -> list[torch.Tensor]:
    """Per-token response activations of ``prompts``, cached as one safetensors file per set."""
    file = CACHE / f"{name}_l{layer}_t{new_tokens}_n{len(prompts)}.safetensors"
    if file.exists():
        tensors = load_file(str(file))
        return list(torch.split(tensors["rows"], tensors["lengths"].tolist()))
    start = time.perf_counter()
    sequences = collect_response_activations(
        model, tokenizer, prompts, layer=layer, max_new_tokens=new_tokens, batch_size=8, progress=True
    )
    CACHE.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(s) for s in sequences])
    save_file({"rows": torch.cat(sequences).contiguous(), "lengths": lengths}, str(file))
    print(f"{name}: {len(prompts)} responses collected in {time.perf_counter() - start:.0f} s", flush=True)
    return sequences


def stop_table(guard: SafetyGuard, sequences: list[torch.Tensor], patience: int) -> dict[str, float]:
    """Fraction stopped and median tokens written before the stop (offline, the module docstring of running_guard)."""
    stats, at = [], []
    with torch.no_grad():
        for seq in sequences:
            scores = guard.detector(seq.float(), guard.sae).scores[None].float()
            s, t = sequence_statistic(scores, patience)
            stats.append(float(s[0]))
            at.append(int(t[0]))
    stopped = [t + 1 for s, t in zip(stats, at) if s > guard.threshold]  # tokens consumed when the window closed
    return {
        "n": len(sequences),
        "stopped": len(stopped) / len(sequences),
        "median_tokens_before_stop": statistics.median(stopped) if stopped else None,
    }


def last_token_rate(guard: SafetyGuard, sequences: list[torch.Tensor]) -> float:
    rows = torch.stack([s[-1] for s in sequences if len(s)])
    return float(guard(rows).flagged.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", type=int, default=240)
    parser.add_argument("--eval-safe", type=int, default=80)
    parser.add_argument("--harmful", type=int, default=80)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--target-fpr", type=float, default=0.03)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timing-batches", type=int, default=2)
    parser.add_argument(
        "--last-k", type=int, default=4, help="clusters of the response_last guard (one row per response)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    load_before = load_average()
    model, tokenizer = load_model("default")
    bundled = SafetyGuard.from_pretrained(DEFAULT_GUARD)
    layer = bundled.config.hook.layer
    half = args.fit // 2
    fit_prompts = pick("chat", half, args.seed) + pick("safe", args.fit - half, args.seed)
    seen = set(fit_prompts)
    eval_prompts = pick("chat", args.eval_safe // 2, args.seed + 1, seen) + pick(
        "safe", args.eval_safe - args.eval_safe // 2, args.seed + 1, seen
    )
    harmful = {pool: pick(pool, args.harmful, args.seed) for pool in ("harmful", "harmful_vauban")}

    fit_seqs = collected("fit", fit_prompts, model, tokenizer, layer, args.new_tokens)
    eval_seqs = collected("eval_safe", eval_prompts, model, tokenizer, layer, args.new_tokens)
    harmful_seqs = {p: collected(p, t, model, tokenizer, layer, args.new_tokens) for p, t in harmful.items()}

    hook = replace(bundled.config.hook, position="response_running")
    start = time.perf_counter()
    running = fit_running_guard(
        fit_seqs,
        hook,
        "freqmask-km",
        DETECTOR,
        bundled.sae,
        patience=args.patience,
        max_new_tokens=args.new_tokens,
        target_fpr=args.target_fpr,
        holdout_fraction=1 / 3,
        seed=args.seed,
    )
    fit_seconds = time.perf_counter() - start
    guard = running.guard
    guard.save_pretrained(CACHE / "guard")

    # response_last beside it: the same fit / held-out sequences, their last consumed token
    # (fit_running_guard splits the non-empty sequences with split_safe(n, 1/3, seed): fit_guard does the same)
    last_rows = torch.stack([s[-1] for s in fit_seqs if len(s)])
    last_hook = replace(bundled.config.hook, position="response_last")
    last_detector = replace(DETECTOR, kmeans=replace(DETECTOR.kmeans, n_clusters=args.last_k))  # one row per response
    last = fit_guard(
        last_rows,
        last_hook,
        "freqmask-km",
        last_detector,
        bundled.sae,
        target_fpr=args.target_fpr,
        holdout_fraction=1 / 3,
        seed=args.seed,
        progress=False,
    ).guard

    table = {
        "held-out safe": {
            **stop_table(guard, eval_seqs, args.patience),
            "response_last_flagged": last_token_rate(last, eval_seqs),
        }
    }
    for pool, seqs in harmful_seqs.items():
        table[pool] = {**stop_table(guard, seqs, args.patience), "response_last_flagged": last_token_rate(last, seqs)}

    # real guarded generation on the timing batches: same verdicts as offline, and the wall time
    guarded = GuardedModelForCausalLM(model, guard, tokenizer=tokenizer)
    batches = [eval_prompts[i * 8 : (i + 1) * 8] for i in range(args.timing_batches)]
    encoded = [encode_prompts(tokenizer, b) for b in batches]
    settings = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    offline = [stop_table(guard, [s], args.patience)["stopped"] for s in eval_seqs[: 8 * args.timing_batches]]
    online = [
        float(r.flagged)
        for e in encoded
        for r in guarded.generate(**e, **settings, on_flag="stop", return_dict_in_generate=True).safety
    ]
    plain_s, guarded_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for e in encoded:
            model.generate(**e, **settings)
        plain_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for e in encoded:
            guarded.generate(**e, **settings, on_flag="stop")
        guarded_s.append(time.perf_counter() - t0)
    ratio = statistics.median(guarded_s) / statistics.median(plain_s)

    record = {
        **environment(torch.device("cpu")),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "settings": vars(args),
        "detector": f"freqmask-km K=20, local mask 100, bundled SAE (layer {layer}); response_last: K={args.last_k}",
        "threshold": guard.threshold,
        "fit_sequences": len(running.fit_sequences),
        "threshold_sequences": len(running.holdout_sequences),
        "fit_seconds": round(fit_seconds, 1),
        "table": table,
        "online_matches_offline": online == offline,
        "online_stopped": online,
        "wall_time": {"plain_s": plain_s, "guarded_s": guarded_s, "ratio_of_medians": ratio},
    }
    print(f"wrote {write_result('running_guard_smollm2', record)}")
    lines = [
        f"# Running response guard on SmolLM2 (layer {layer}, patience {args.patience}, threshold at "
        f"{args.target_fpr:.0%} of {len(running.holdout_sequences)} held-out safe responses, {args.new_tokens} new "
        f"tokens)",
        "",
        "| prompts | n | stopped while writing | median tokens before stop | response_last guard flagged |",
        "|---|---|---|---|---|",
    ]
    for name, row in table.items():
        tokens = "-" if row["median_tokens_before_stop"] is None else f"{row['median_tokens_before_stop']:.0f}"
        lines.append(f"| {name} | {row['n']} | {row['stopped']:.1%} | {tokens} | {row['response_last_flagged']:.1%} |")
    lines += [
        "",
        f"Wall time, guarded with stopping / plain generate ({args.timing_batches} batches of 8 held-out safe prompts, "
        f"median of {args.repeats}): {ratio:.3f} ({statistics.median(guarded_s):.1f} s / "
        f"{statistics.median(plain_s):.1f} s). "
        f"Online stops equal the offline statistic: {online == offline}.",
        "",
        "Command: `python benchmarks/archive/task-prompt-study/running_guard_smollm2.py` (settings above).",
    ]
    Path("benchmarks/results/running_guard_smollm2.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
