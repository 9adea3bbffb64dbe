"""Collect activation stores "anytime": every pool grows in steps, and its store is rewritten after each step.

For the chat study (issue 13) on a shared 2-core CPU, where how many prompts fit in
the time left is not known in advance. Each pool's target set of prompts
(``load_pool(name, limit=N, seed=SEED)``, the whole pool without a limit) is put
in a seeded random order (``--first-domains`` first, whole); the work goes
round-robin over the pools, ``--steps`` chunks per pool, and after each chunk the
pool's stores (one per layer) are rewritten, atomically, with every row done so
far, in pool-file order. Stop the run at any time: each store holds a random
subset of its target set (plus the first domains), and a line
``<what> READY <time> <rows>`` in ``--ready-file`` says what it holds.

Three modes, each computing exactly what its dedicated script computes:

- ``smollm2-prompt-last``: ``benchmarks/collect_layer_sweep.py``'s ``collect_pool``
  (prefill + one greedy token, record of the prefill call); records as there.
- ``smollm2-response-last``: ``benchmarks/collect_response_layers.py``'s
  ``generate_batch`` (greedy, ``--max-new-tokens``; the row picked by
  ``hf_lsad.capture.recorder.final_call_index``); records carry ``response``.
- ``qwen05-prompt-last``: ``benchmarks/collect_qwen05.py``'s ``prefill_layers``
  (forward pass cut after the highest layer); records carry ``prompt_tokens``.

Stores that exist for every layer are resumed: their rows are kept (matched by prompt id)
and only the missing prompts are collected.

``--check N`` first compares one layer on N prompts with
``hf_lsad.capture.collect.collect_activations`` and logs the max |delta|.

    python benchmarks/collect_anytime.py smollm2-prompt-last --out artifacts/smollm2/prompt_last \\
        --pools chat --first-domains assistant_requests mtbench writingbench --steps 4
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import collect_layer_sweep
import collect_qwen05
import collect_response_layers
from qwen05_model import load_qwen05

from hf_lsad.capture.collect import collect_activations
from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.data import Prompt, load_pool
from hf_lsad.data.store import INDEX, load_activations, save_activations

BatchFn = Callable[[list[str]], tuple[dict[int, torch.Tensor], list[dict[str, Any]]]]


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(message: str) -> None:
    print(f"[{datetime.now(timezone.utc).strftime('%H:%M:%S')}] {message}", flush=True)


def priority_order(prompts: list[Any], seed: int, first_domains: list[str]) -> list[int]:
    """Indices of ``prompts``: rows of ``first_domains`` first, then a seeded random order of the rest."""
    rest = list(range(len(prompts)))
    random.Random(seed).shuffle(rest)
    first = [i for i in rest if getattr(prompts[i], "domain", "") in first_domains]
    return first + [i for i in rest if getattr(prompts[i], "domain", "") not in first_domains]


def length_batches(lengths: list[int], batch_size: int, max_chars: int | None) -> list[list[int]]:
    """Indices sorted by length, in batches of at most ``batch_size`` rows and (if set) ``max_chars`` padded chars.

    A long prompt padded with short ones costs the long one's length per row: the char budget keeps one
    very long prompt (jailbreaks run to 25k chars) from multiplying its cost by the batch size.
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        last = batches[-1] if batches else None
        if (
            last is not None
            and len(last) < batch_size
            and (max_chars is None or (len(last) + 1) * lengths[i] <= max_chars)
        ):
            last.append(i)
        else:
            batches.append([i])
    return batches


def write_stores(
    out: Path,
    pool: str,
    layers: list[int],
    acts: dict[int, torch.Tensor],
    records: list[dict[str, Any]],
    hook_of: Callable[[int], HookPoint],
) -> None:
    """Replace ``out/layer{L}/pool`` by a store of ``acts[L]`` (written aside, then renamed into place)."""
    for layer in layers:
        target = out / f"layer{layer}" / pool
        tmp = target.with_name(f".{pool}.tmp")
        old = target.with_name(f".{pool}.old")
        shutil.rmtree(tmp, ignore_errors=True)
        save_activations(tmp, acts[layer], records, hook_of(layer))
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)


def run(args: argparse.Namespace, batch_fn: BatchFn, hook_of: Callable[[int], HookPoint], hidden: int) -> None:
    state = []
    for spec in args.pools:
        name, _, limit = spec.partition(":")
        prompts = load_pool(name, limit=int(limit) if limit else None, seed=args.seed)
        acts = {layer: torch.empty(len(prompts), hidden) for layer in args.layers}
        extras: list[dict[str, Any]] = [{} for _ in prompts]
        done: list[int] = []
        if all((args.out / f"layer{layer}" / name / INDEX).is_file() for layer in args.layers):
            # resume: the rows already in the stores are kept (matched by prompt id), the rest collected
            position = {p.id: i for i, p in enumerate(prompts)}
            for layer in args.layers:
                stored = load_activations(args.out / f"layer{layer}" / name)
                rows = [position[r["id"]] for r in stored.records]
                acts[layer][rows] = stored.activations
            done = rows
            for i, record in zip(rows, stored.records):
                extras[i] = {k: v for k, v in record.items() if k not in Prompt._fields}
            if len(done) == len(prompts):
                log(f"{name}: complete stores exist ({len(done)} rows), skipped")
                continue
            log(f"{name}: resuming with {len(done)}/{len(prompts)} rows from the existing stores")
        kept = set(done)
        order = [i for i in priority_order(prompts, args.seed, args.first_domains) if i not in kept]
        state.append(
            {
                "name": name,
                "prompts": prompts,
                "order": done + order,
                "done": list(done),
                "acts": acts,
                "extras": extras,
                "step": -(-len(prompts) // args.steps),
                "seconds": 0.0,
            }
        )
    total_start = time.perf_counter()
    while any(len(s["done"]) < len(s["prompts"]) for s in state):
        for s in state:
            if len(s["done"]) == len(s["prompts"]):
                continue
            chunk = s["order"][len(s["done"]) : len(s["done"]) + s["step"]]
            texts = [s["prompts"][i].text for i in chunk]
            t0 = time.perf_counter()
            for rows in length_batches([len(t) for t in texts], args.batch_size, args.max_batch_chars):
                acts, extras = batch_fn([texts[j] for j in rows])
                index = [chunk[j] for j in rows]
                for layer in args.layers:
                    s["acts"][layer][index] = acts[layer]
                for i, extra in zip(index, extras):
                    s["extras"][i] = extra
            seconds = time.perf_counter() - t0
            s["seconds"] += seconds
            s["done"].extend(chunk)
            rows_done = sorted(s["done"])
            records = [
                {k: v for k, v in s["prompts"][i]._asdict().items() if k != "text"} | {"response": ""} | s["extras"][i]
                for i in rows_done
            ]
            write_stores(
                args.out,
                s["name"],
                args.layers,
                {layer: s["acts"][layer][rows_done] for layer in args.layers},
                records,
                hook_of,
            )
            n, total = len(rows_done), len(s["prompts"])
            log(
                f"{s['name']}: +{len(chunk)} prompts in {seconds:.0f} s ({len(chunk) / seconds:.2f} prompts/s); "
                f"store now {n}/{total} rows x {len(args.layers)} layers ({s['seconds']:.0f} s in all)"
            )
            if args.ready_file is not None:
                what = f"{args.tag}/layer{{{','.join(map(str, args.layers))}}}/{s['name']}" + (
                    "" if n == total else f" (partial {n}/{total})"
                )
                with args.ready_file.open("a") as f:
                    f.write(f"{what} READY {stamp()} {n}\n")
    log(f"all pools complete in {time.perf_counter() - total_start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["smollm2-prompt-last", "smollm2-response-last", "qwen05-prompt-last"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, nargs="+")
    parser.add_argument("--pools", nargs="+", required=True, help="pool or pool:limit")
    parser.add_argument("--first-domains", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=4, help="chunks per pool")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-batch-chars", type=int, help="cap on rows x longest prompt (chars) per batch")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--gguf", type=Path, default=Path("artifacts/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    parser.add_argument("--check", type=int, default=0)
    parser.add_argument("--check-layer", type=int)
    parser.add_argument("--ready-file", type=Path)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.mode.startswith("smollm2"):
        model, tokenizer = load_model("default")
        args.layers = args.layers or [4, 8, 12, 16, 20, 24, 28]
    else:
        model, tokenizer = load_qwen05(args.gguf)
        args.layers = args.layers or [6, 10, 14, 18, 22]
    log(
        f"{args.mode}: model {model.config.name_or_path} loaded in {time.perf_counter() - start:.0f} s; layers "
        f"{args.layers}; "
        f"pad {tokenizer.pad_token!r}, tokenizer padding_side {tokenizer.padding_side!r} (encode_prompts pads left); "
        f"torch threads {torch.get_num_threads()}"
    )
    position = "response_last" if args.mode == "smollm2-response-last" else "prompt_last"

    def batch_fn(texts: list[str]) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
        if args.mode == "smollm2-prompt-last":
            return collect_layer_sweep.collect_pool(model, tokenizer, texts, args.layers, len(texts)), [
                {} for _ in texts
            ]
        if args.mode == "smollm2-response-last":
            acts, responses, counts = collect_response_layers.generate_batch(
                model, tokenizer, texts, args.layers, args.max_new_tokens
            )
            return acts, [{"response": r, "response_tokens": n, "stopped": s} for r, (n, s) in zip(responses, counts)]
        lengths = collect_qwen05._lengths(tokenizer, texts)
        inputs = collect_qwen05.encode_prompts(tokenizer, texts)
        return collect_qwen05.prefill_layers(model, args.layers, inputs["input_ids"], inputs["attention_mask"]), [
            {"prompt_tokens": n} for n in lengths
        ]

    if args.check:
        layer = args.check_layer if args.check_layer is not None else args.layers[len(args.layers) // 2]
        name, _, limit = args.pools[0].partition(":")
        texts = [p.text for p in load_pool(name, limit=int(limit) if limit else None, seed=args.seed)[: args.check]]
        t0 = time.perf_counter()
        acts, extras = batch_fn(sorted(texts, key=len))
        ref = collect_activations(
            model,
            tokenizer,
            sorted(texts, key=len),
            layer=layer,
            position=position,
            batch_size=len(texts),
            max_new_tokens=args.max_new_tokens,
            progress=False,
        )
        delta = float((acts[layer] - ref.activations).abs().max())
        same_text = position == "prompt_last" or ref.responses == [e["response"] for e in extras]
        log(
            f"check ({time.perf_counter() - t0:.0f} s): {len(texts)} {name} prompts, layer {layer}, {position}: "
            f"max |delta| vs collect_activations = {delta:.3g}; responses identical: {same_text}"
        )
    run(args, batch_fn, lambda layer: HookPoint.from_model(model, layer, position), model.config.hidden_size)


if __name__ == "__main__":
    main()
