"""A position the issue did not list: the MEAN of the prompt's token activations, not its last token (issue 13).

``prompt_last`` reads one token, the end of the chat template, where the model has already turned the request
into "what do I answer". Here every row of the study snapshot is read again at layer ``--layer`` and its
activations are averaged over the user turn and the generation prompt (the system preamble, identical in every
prompt, is left out). Everything else is the chat study's main table (``chat_study.run_layer``: the same rows,
splits, SAE settings, detectors, calibration and probe), run on these mean-pooled rows. Benchmark only: the
package has no such position.

    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/mean_pool.py collect --shard 0 --num-shards 2
    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/mean_pool.py collect --shard 1 --num-shards 2
    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/mean_pool.py study --num-shards 2
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import chat_study
import study_data as sd
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from token_sae import preamble_tokens, prefill_block_output

from hf_lsad.capture.pretrained import load_model
from hf_lsad.data import POOLS, load_pool

CACHE = sd.STUDY / "mean_pool"


@torch.no_grad()
def collect(args) -> None:
    rows = sd.load_rows("smollm2", "prompt_last", args.layer)
    mine = rows.ids[args.shard :: args.num_shards]
    text = {p.id: p.text for pool in POOLS for p in load_pool(pool)}
    order = sorted(mine, key=lambda i: len(text[i]))  # batch by length: little padding
    model, tokenizer = load_model("default")
    skip = preamble_tokens(tokenizer)
    out, start = torch.empty(len(order), model.config.hidden_size), time.time()
    for b in range(0, len(order), args.batch_size):
        batch = order[b : b + args.batch_size]
        hidden, lengths = prefill_block_output(model, tokenizer, [text[i] for i in batch], args.layer)  # [B, T, H], [B]
        T = hidden.shape[1]
        for i in range(len(batch)):
            out[b + i] = hidden[i, T - int(lengths[i]) + skip :].mean(0)
        if (b // args.batch_size) % 20 == 0 or b + len(batch) == len(order):
            done = b + len(batch)
            print(
                f"[{time.strftime('%H:%M:%S')}] {done}/{len(order)} rows, {done / (time.time() - start):.2f} rows/s",
                flush=True,
            )
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file(
        {"X": out},
        str(CACHE / f"layer{args.layer}_{args.shard}of{args.num_shards}.safetensors"),
        metadata={"ids": json.dumps(order), "skip": str(skip)},
    )


def mean_pooled_rows(layer: int, num_shards: int) -> sd.Rows:
    """The snapshot's ``prompt_last`` rows (labels, splits, ids) with their activations replaced by the mean-pooled
    ones."""
    rows = sd.load_rows("smollm2", "prompt_last", layer)
    position = {i: k for k, i in enumerate(rows.ids)}
    X = torch.full_like(rows.X, float("nan"))
    for shard in range(num_shards):
        with safe_open(str(CACHE / f"layer{layer}_{shard}of{num_shards}.safetensors"), "pt") as f:
            ids = json.loads(f.metadata()["ids"])
            X[torch.tensor([position[i] for i in ids])] = f.get_tensor("X")
    if torch.isnan(X).any():
        raise SystemExit(
            f"{int(torch.isnan(X).any(1).sum())} rows have no mean-pooled activation: collect every shard first"
        )
    rows.X = X
    return rows


def study(args) -> None:
    rows = mean_pooled_rows(args.layer, args.num_shards)
    run_args = SimpleNamespace(
        model="smollm2", position="prompt_mean", d_sae=2304, l1_rel=0.1, epochs=5, lr=1e-3, learned_layers=[]
    )
    record = {
        "model": "smollm2",
        "position": "prompt_mean (benchmark only)",
        "env": sd.environment(),
        "settings": dict(vars(args)),
        "protocol": sd.__doc__,
    }
    start = time.time()
    record["layers"] = {str(args.layer): chat_study.run_layer(run_args, args.layer, rows)}
    record["status"] = "complete"
    record["wall_seconds"] = round(time.time() - start)
    name = f"chat_study_smollm2_prompt_mean_L{args.layer}"
    sd.write_json(sd.RESULTS / f"{name}.json", record)
    (sd.RESULTS / f"{name}.md").write_text(chat_study.markdown(record))
    print((sd.RESULTS / f"{name}.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["collect", "study"])
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard", type=int, default=0, help="collect: this process's shard (run one per core)")
    parser.add_argument("--num-shards", type=int, default=1)
    args = parser.parse_args()
    collect(args) if args.step == "collect" else study(args)


if __name__ == "__main__":
    main()
