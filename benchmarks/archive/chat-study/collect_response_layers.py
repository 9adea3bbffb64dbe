"""Collect ``response_last`` activations of SmolLM2-135M-Instruct at several layers from one generation.

For the chat study (issue 13). Every prompt is answered once (greedy, ``--max-new-tokens``
new tokens, left-padded batches of prompts of similar length) with a
:class:`hf_lsad.capture.LastPositionRecorder` on each requested decoder block; the
row of each layer is picked with :func:`hf_lsad.capture.recorder.final_call_index`, exactly
as :func:`hf_lsad.capture.recorder.generate_with_activations` picks it for one layer, so a
layer's store holds what ``hf-lsad collect --position response_last --layer L``
records (``--check`` verifies this against
:func:`hf_lsad.capture.collect.collect_activations` on a few prompts). One store per
layer and pool::

    OUT/layer{L}/{pool}/index.json + shard-*.safetensors

Records are the prompt's fields minus its text, plus ``response`` (the decoded
greedy response, special tokens skipped), ``response_tokens`` (new tokens up to
and including the first EOS; ``max_new_tokens`` when cut) and ``stopped`` (whether
the model emitted EOS within ``max_new_tokens``).
Prompts are seeded subsets (``load_pool(name, limit=N, seed=SEED)``); a pool whose
stores exist for every layer is skipped, so an interrupted run resumes.

    python benchmarks/collect_response_layers.py --out artifacts/smollm2/response_last \\
        --pools chat:800 safe:800 benign_ood:400 harmful:300 harmful_vauban:228 toxic:300
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_lsad.capture.collect import collect_activations, encode_prompts
from hf_lsad.capture.generate_call import eos_token_ids
from hf_lsad.capture.pretrained import load_model
from hf_lsad.capture.recorder import LastPositionRecorder, final_call_index
from hf_lsad.core.hook_point import HookPoint, decoder_layer
from hf_lsad.data import load_pool
from hf_lsad.data.store import INDEX, save_activations

POSITION = "response_last"


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], layers: list[int], max_new_tokens: int
) -> tuple[dict[int, torch.Tensor], list[str], list[tuple[int, bool]]]:
    """``({layer: [batch, hidden]}, responses, [(response tokens, stopped by EOS)])`` of one greedy generation."""
    inputs = encode_prompts(tokenizer, texts)
    kwargs = dict(inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with ExitStack() as stack:
        recorders = {
            layer: stack.enter_context(LastPositionRecorder(decoder_layer(model, layer)[1])) for layer in layers
        }
        output = model.generate(**kwargs)
    new_tokens = output[:, inputs["input_ids"].shape[1] :]
    index = final_call_index(new_tokens, eos_token_ids(model, kwargs), POSITION)
    rows = torch.arange(len(index))
    acts = {}
    for layer, recorder in recorders.items():
        if len(recorder.records) != new_tokens.shape[1]:
            raise RuntimeError(
                f"layer {layer}: {len(recorder.records)} forward calls for {new_tokens.shape[1]} new tokens"
            )
        acts[layer] = torch.stack(recorder.records)[index, rows].float().cpu()
    responses = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    eos = eos_token_ids(model, kwargs)
    stopped = torch.isin(new_tokens, torch.tensor(eos)).any(dim=1) if eos else torch.zeros(len(index), dtype=torch.bool)
    return acts, responses, [(int(n), bool(s)) for n, s in zip(index + 1, stopped)]


def collect_pool(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    layers: list[int],
    batch_size: int,
    max_new_tokens: int,
    label: str = "",
) -> tuple[dict[int, torch.Tensor], list[str], list[tuple[int, bool]]]:
    """All of ``texts``, batched by length (as ``collect_activations`` batches); results in input order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = {layer: torch.empty(len(texts), model.config.hidden_size) for layer in layers}
    responses, counts = [""] * len(texts), [(0, False)] * len(texts)
    start_time = time.perf_counter()
    for number, start in enumerate(range(0, len(order), batch_size)):
        batch = order[start : start + batch_size]
        acts, texts_out, n_tokens = generate_batch(model, tokenizer, [texts[i] for i in batch], layers, max_new_tokens)
        for layer in layers:
            out[layer][batch] = acts[layer]
        for row, i in enumerate(batch):
            responses[i], counts[i] = texts_out[row], n_tokens[row]
        if number % 10 == 9:
            done = start + len(batch)
            elapsed = time.perf_counter() - start_time
            print(f"  {label} {done}/{len(texts)} prompts, {elapsed:.0f} s, {done / elapsed:.2f} prompts/s", flush=True)
    return out, responses, counts


def check_equal(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    layers: list[int],
    layer: int,
    max_new_tokens: int,
) -> float:
    """Max |delta| between this script's layer-``layer`` activations and ``collect_activations``'s."""
    acts, responses, _ = collect_pool(model, tokenizer, texts, layers, len(texts), max_new_tokens)
    ref = collect_activations(
        model,
        tokenizer,
        texts,
        layer=layer,
        position=POSITION,
        batch_size=len(texts),
        max_new_tokens=max_new_tokens,
        progress=False,
    )
    if ref.responses != responses:
        raise AssertionError("responses differ from collect_activations'")
    return float((acts[layer] - ref.activations).abs().max())


def ready(path: Path | None, what: str, rows: int) -> None:
    if path is not None:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        with path.open("a") as f:
            f.write(f"{what} READY {stamp} {rows}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("artifacts/smollm2/response_last"))
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 28])
    parser.add_argument(
        "--pools",
        nargs="+",
        default=["chat:800", "safe:800", "benign_ood:400", "harmful:300", "harmful_vauban:228", "toxic:300"],
        help="pool:limit",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check", type=int, default=0, help="first compare N prompts of the first pool with collect_activations"
    )
    parser.add_argument("--check-layer", type=int, default=20)
    parser.add_argument("--ready-file", type=Path, default=None, help="append '<what> READY <time> <rows>' per pool")
    parser.add_argument("--tag", default="smollm2/response_last")
    args = parser.parse_args()
    pools = [(spec.split(":")[0], int(spec.split(":")[1]) if ":" in spec else None) for spec in args.pools]
    start = time.perf_counter()
    model, tokenizer = load_model("default")
    print(
        f"model loaded in {time.perf_counter() - start:.0f} s; padding side {tokenizer.padding_side!r} "
        f"(encode_prompts pads left)",
        flush=True,
    )
    if args.check:
        texts = [p.text for p in load_pool(pools[0][0], limit=pools[0][1], seed=args.seed)[: args.check]]
        delta = check_equal(model, tokenizer, texts, args.layers, args.check_layer, args.max_new_tokens)
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
        acts, responses, counts = collect_pool(
            model, tokenizer, [p.text for p in prompts], args.layers, args.batch_size, args.max_new_tokens, pool
        )
        records = [
            {k: v for k, v in p._asdict().items() if k != "text"} | {"response": r, "response_tokens": n, "stopped": s}
            for p, r, (n, s) in zip(prompts, responses, counts)
        ]
        for layer in args.layers:
            save_activations(
                args.out / f"layer{layer}" / pool, acts[layer], records, HookPoint.from_model(model, layer, POSITION)
            )
        elapsed = time.perf_counter() - t0
        cut = sum(not s for _, s in counts)
        print(
            f"{pool}: {len(prompts)} prompts x {len(args.layers)} layers in {elapsed:.0f} s "
            f"({len(prompts) / elapsed:.2f} prompts/s); "
            f"{cut} responses cut at {args.max_new_tokens} tokens (no EOS)",
            flush=True,
        )
        ready(args.ready_file, f"{args.tag}/{pool} layers {','.join(map(str, args.layers))}", len(prompts))
        total_rows += len(prompts)
    print(f"all pools: {total_rows} prompts in {time.perf_counter() - total_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
