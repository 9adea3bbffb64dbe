"""Collect ``prompt_last`` activations of SmolLM2-135M-Instruct at several layers in one pass.

For the extraction-layer sweep of the SmolLM2 report. Every prompt is run once
(prefill plus one greedy token, as ``hf-lsad collect --position prompt_last``
does) with a :class:`hf_lsad.capture.LastPositionRecorder` on each requested
decoder block, so the residual stream of the last prompt token is read at all
layers from the same forward pass. One activation store is written per layer
and pool::

    OUT/layer{L}/{pool}/index.json + shard-*.safetensors

Prompts are seeded subsets of the bundled pools (``hf_lsad.data.load_pool``
with ``seed``); a pool whose stores already exist for every layer is skipped, so
an interrupted run resumes.

    python benchmarks/collect_layer_sweep.py [--out artifacts/smollm2/layer_sweep]
        [--layers 4 8 12 16 20 24 28] [--safe 1200] [--per-pool 300]
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import LastPositionRecorder
from hf_lsad.core.hook_point import HookPoint, decoder_layer
from hf_lsad.data import load_pool
from hf_lsad.data.store import INDEX, save_activations

POSITION = "prompt_last"


@torch.no_grad()
def collect_pool(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], layers: list[int], batch_size: int
) -> dict[int, torch.Tensor]:
    """``{layer: [len(texts), hidden]}`` last-prompt-token activations, in the order of ``texts``."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batch by length: little padding
    out = {layer: torch.empty(len(texts), model.config.hidden_size) for layer in layers}
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        inputs = encode_prompts(tokenizer, [texts[i] for i in batch])
        with ExitStack() as stack:
            recorders = {
                layer: stack.enter_context(LastPositionRecorder(decoder_layer(model, layer)[1])) for layer in layers
            }
            model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        for layer, recorder in recorders.items():
            out[layer][batch] = recorder.records[0].float().cpu()  # record 0: the prefill call
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("artifacts/smollm2/layer_sweep"))
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 28])
    parser.add_argument("--safe", type=int, default=1200, help="safe prompts (seeded subset)")
    parser.add_argument("--per-pool", type=int, default=300, help="prompts per unsafe / benign-OOD pool")
    parser.add_argument("--pools", nargs="+", default=["safe", "harmful", "toxic", "benign_ood", "jailbreak"])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, tokenizer = load_model("default")
    for pool in args.pools:
        if all((args.out / f"layer{layer}" / pool / INDEX).is_file() for layer in args.layers):
            print(f"{pool}: stores exist, skipped", flush=True)
            continue
        prompts = load_pool(pool, limit=args.safe if pool == "safe" else args.per_pool, seed=args.seed)
        start = time.perf_counter()
        acts = collect_pool(model, tokenizer, [p.text for p in prompts], args.layers, args.batch_size)
        records = [{k: v for k, v in p._asdict().items() if k != "text"} | {"response": ""} for p in prompts]
        for layer in args.layers:
            hook = HookPoint.from_model(model, layer, POSITION)
            save_activations(args.out / f"layer{layer}" / pool, acts[layer], records, hook)
        print(
            f"{pool}: {len(prompts)} prompts x {len(args.layers)} layers in {time.perf_counter() - start:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
