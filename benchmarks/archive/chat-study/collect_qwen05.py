"""Collect ``prompt_last`` activations of Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) at several layers.

The second model of the chat study (issue 13), benchmarks only. The model is the
GGUF assembled by ``benchmarks/qwen05_model.py`` (header checked before loading).
Prompts go through the chat template with left padding
(:func:`hf_lsad.capture.collect.encode_prompts`); each batch runs one forward pass that
stops after the highest requested block, as
:func:`hf_lsad.capture.recorder.prefill_activations` does for one block (same position
ids, no cache, no LM head), with a :class:`hf_lsad.capture.LastPositionRecorder`
on every requested block. ``--check`` compares one layer on a few prompts with
:func:`hf_lsad.capture.collect.collect_activations` (``position="prompt_last"``).

Batches hold prompts of similar token length, at most ``--batch-size`` prompts
and ``--max-batch-tokens`` padded tokens. One store per layer and pool::

    OUT/layer{L}/{pool}/index.json + shard-*.safetensors

Records are the prompt's fields minus its text plus ``response`` ("") and
``prompt_tokens``. Pools are seeded subsets (``load_pool(name, limit=N,
seed=SEED)``); a pool whose stores exist for every layer is skipped.

    python benchmarks/collect_qwen05.py --gguf artifacts/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --out artifacts/qwen05/prompt_last --pools chat:1500 safe:1500 ...
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen05_model import load_qwen05

from hf_lsad.capture.collect import collect_activations, encode_prompts
from hf_lsad.capture.recorder import LastPositionRecorder
from hf_lsad.core.hook_point import HookPoint, decoder_layer
from hf_lsad.data import load_pool
from hf_lsad.data.store import INDEX, save_activations

POSITION = "prompt_last"


class _Stop(Exception):
    """Raised once the highest requested block has run."""


class _RecordThenStop(LastPositionRecorder):
    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        super()._hook(module, args, output)
        raise _Stop


@torch.no_grad()
def prefill_layers(model: Any, layers: list[int], input_ids: Tensor, attention_mask: Tensor) -> dict[int, Tensor]:
    """``{layer: [batch, hidden]}`` last-position activations from one forward pass cut after ``max(layers)``."""
    top = max(layers)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as prefill_activations / generate
    with ExitStack() as stack:
        recorders = {
            layer: stack.enter_context(
                (_RecordThenStop if layer == top else LastPositionRecorder)(decoder_layer(model, layer)[1])
            )
            for layer in layers
        }
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        except _Stop:
            pass
    for layer, recorder in recorders.items():
        if len(recorder.records) != 1:
            raise RuntimeError(f"block {layer} ran {len(recorder.records)} times in one forward pass")
    return {layer: recorder.records[0].float().cpu() for layer, recorder in recorders.items()}


def batches(lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches of at most ``batch_size`` rows and ``max_tokens`` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < batch_size and (len(out[-1]) + 1) * lengths[i] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def collect_pool(
    model: Any, tokenizer: Any, texts: list[str], layers: list[int], batch_size: int, max_tokens: int, label: str = ""
) -> tuple[dict[int, Tensor], list[int]]:
    """``({layer: [len(texts), hidden]}, prompt token counts)`` in the order of ``texts``."""
    lengths = _lengths(tokenizer, texts)
    out = {layer: torch.empty(len(texts), model.config.hidden_size) for layer in layers}
    start_time, done, last_report = time.perf_counter(), 0, time.perf_counter()
    for batch in batches(lengths, batch_size, max_tokens):
        inputs = encode_prompts(tokenizer, [texts[i] for i in batch])
        acts = prefill_layers(model, layers, inputs["input_ids"], inputs["attention_mask"])
        for layer in layers:
            out[layer][batch] = acts[layer]
        done += len(batch)
        if time.perf_counter() - last_report > 60:
            elapsed = time.perf_counter() - start_time
            print(f"  {label} {done}/{len(texts)} prompts, {elapsed:.0f} s, {done / elapsed:.2f} prompts/s", flush=True)
            last_report = time.perf_counter()
    return out, lengths


def _lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of the prompts as encode_prompts formats them (chat template, no padding)."""
    formatted = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    return [len(ids) for ids in tokenizer(formatted, add_special_tokens=False)["input_ids"]]


def ready(path: Path | None, what: str, rows: int) -> None:
    if path is not None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with path.open("a") as f:
            f.write(f"{what} READY {stamp} {rows}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=Path("artifacts/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    parser.add_argument("--out", type=Path, default=Path("artifacts/qwen05/prompt_last"))
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 10, 14, 18, 22])
    parser.add_argument(
        "--pools",
        nargs="+",
        default=[
            "chat:1500",
            "safe:1500",
            "benign_ood:600",
            "harmful:720",
            "harmful_vauban:228",
            "toxic:400",
            "jailbreak:150",
        ],
        help="pool:limit",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--check", type=int, default=0, help="first compare N prompts of the first pool with collect_activations"
    )
    parser.add_argument("--check-layer", type=int, default=14)
    parser.add_argument("--ready-file", type=Path, default=None)
    parser.add_argument("--tag", default="qwen05/prompt_last")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pools = [(spec.split(":")[0], int(spec.split(":")[1]) if ":" in spec else None) for spec in args.pools]
    start = time.perf_counter()
    model, tokenizer = load_qwen05(args.gguf)
    print(
        f"model loaded in {time.perf_counter() - start:.0f} s: {model.config.model_type}, "
        f"{model.config.num_hidden_layers} layers, "
        f"hidden {model.config.hidden_size}; pad {tokenizer.pad_token!r} ({tokenizer.pad_token_id}), eos "
        f"{tokenizer.eos_token!r}, "
        f"chat template {'yes' if tokenizer.chat_template else 'NO'}; torch threads {torch.get_num_threads()}",
        flush=True,
    )
    if args.check:
        texts = [p.text for p in load_pool(pools[0][0], limit=pools[0][1], seed=args.seed)[: args.check]]
        acts, _ = collect_pool(model, tokenizer, texts, args.layers, len(texts), 10**9)
        ref = collect_activations(
            model, tokenizer, texts, layer=args.check_layer, position=POSITION, batch_size=len(texts), progress=False
        )
        delta = float((acts[args.check_layer] - ref.activations).abs().max())
        print(
            f"check: {len(texts)} {pools[0][0]} prompts, layer {args.check_layer}: max |delta| vs collect_activations "
            f"= {delta:.3g}",
            flush=True,
        )
    total_rows, total_start = 0, time.perf_counter()
    for pool, limit in pools:
        if all((args.out / f"layer{layer}" / pool / INDEX).is_file() for layer in args.layers):
            print(f"{pool}: stores exist, skipped", flush=True)
            continue
        prompts = load_pool(pool, limit=limit, seed=args.seed)
        t0 = time.perf_counter()
        acts, lengths = collect_pool(
            model, tokenizer, [p.text for p in prompts], args.layers, args.batch_size, args.max_batch_tokens, pool
        )
        records = [
            {k: v for k, v in p._asdict().items() if k != "text"} | {"response": "", "prompt_tokens": n}
            for p, n in zip(prompts, lengths)
        ]
        for layer in args.layers:
            save_activations(
                args.out / f"layer{layer}" / pool, acts[layer], records, HookPoint.from_model(model, layer, POSITION)
            )
        elapsed = time.perf_counter() - t0
        print(
            f"{pool}: {len(prompts)} prompts ({sum(lengths)} tokens, max {max(lengths)}) x {len(args.layers)} layers "
            f"in {elapsed:.0f} s "
            f"({len(prompts) / elapsed:.2f} prompts/s, {sum(lengths) / elapsed:.0f} tokens/s)",
            flush=True,
        )
        ready(args.ready_file, f"{args.tag}/{pool} layers {','.join(map(str, args.layers))}", len(prompts))
        total_rows += len(prompts)
    print(f"all pools: {total_rows} prompts in {time.perf_counter() - total_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
