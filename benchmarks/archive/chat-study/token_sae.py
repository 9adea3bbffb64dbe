"""Does a data-rich SAE rescue the paper's mechanism? An SAE trained on every prompt TOKEN, not one row per
prompt (issue 13).

The study's SAEs see one ``prompt_last`` vector per fit prompt (about 6.5k rows for 2304 features: 72-86%
of the features never fire on validation rows). Here the SAE of layer ``--layer`` is trained on the
per-token activations of the fit split's prompts instead (the user turn and the generation prompt of the
chat template; the system preamble, identical in every prompt, is left out; at most ``--tokens-per-prompt``
positions per prompt, seeded, the last one always kept), and FreqMask-KM is fitted and evaluated exactly as
in the chat study's mechanism sweep (``chat_study.eval_freqmask_grid``: detectors on the ``prompt_last`` rows,
calibrated and uncalibrated, same splits, same probe).

Two steps, both cached under ``$HF_LSAD_STUDY/token_sae``:

    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/token_sae.py collect --prompts 7000 --shard 0 --num-shards 2
    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/token_sae.py collect --prompts 7000 --shard 1 --num-shards 2
    HF_LSAD_ARTIFACTS=artifacts/study/snap_pl2 PYTHONPATH=. \\
        python benchmarks/archive/chat-study/token_sae.py study --num-shards 2 \
        --l1-rels 0.1 0.3 --name chat_study_smollm2_prompt_last_token_sae_L12_part1
    (part2: --l1-rels 1.0; part3: --widths 4608 --l1-rels 0.3)

The collect step checks, per batch, that the last token's activation equals the study store's ``prompt_last``
row of the same prompt (the same layer, the same numbers).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import study_data as sd
import torch
from chat_study import eval_freqmask_grid, markdown
from safetensors.torch import load_file, save_file

from hf_lsad.capture.collect import encode_prompts
from hf_lsad.capture.pretrained import load_model
from hf_lsad.core.hook_point import decoder_layer
from hf_lsad.data import POOLS, load_pool
from hf_lsad.sae.training import SAETrainConfig, sae_stats, train_sae

CACHE = sd.STUDY / "token_sae"


def preamble_tokens(tokenizer) -> int:
    """Tokens before the user's text in the chat template (the same in every prompt)."""
    a, b = (encode_prompts(tokenizer, [t])["input_ids"][0].tolist() for t in ("Alpha", "Zulu"))
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class BlockOutput:
    """Forward hook keeping the full ``[batch, seq, hidden]`` output of one decoder block on the prefill call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.output: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, module, args, output) -> None:
        if self.output is None:
            self.output = (output[0] if isinstance(output, tuple) else output).detach().float()


@torch.no_grad()
def prefill_block_output(model, tokenizer, texts: list[str], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, T, H] output of decoder block ``layer`` on the prefill, [B] real-token counts)`` of left-padded
    prompts."""
    inputs = encode_prompts(tokenizer, texts)
    recorder = BlockOutput(decoder_layer(model, layer)[1])
    try:
        model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    finally:
        recorder.handle.remove()
    return recorder.output, inputs["attention_mask"].sum(1)


@torch.no_grad()
def collect(args) -> None:
    rows = sd.load_rows("smollm2", "prompt_last", args.layer)
    by_id = {i: k for k, i in enumerate(rows.ids)}
    fit_ids = [i for i, s in zip(rows.ids, rows.split) if s == "fit"]
    chosen = sorted(
        np.random.default_rng(args.seed).choice(len(fit_ids), size=min(args.prompts, len(fit_ids)), replace=False)
    )
    wanted = {fit_ids[k] for k in chosen}
    prompts = [p for pool in POOLS for p in load_pool(pool) if p.id in wanted]
    prompts.sort(key=lambda p: len(p.text))
    prompts = prompts[args.shard :: args.num_shards]  # one process per core: shard K of N
    model, tokenizer = load_model("default")
    skip = preamble_tokens(tokenizer)
    rng = np.random.default_rng(args.seed)
    tokens, max_delta, start = [], 0.0, time.time()
    for b in range(0, len(prompts), args.batch_size):
        batch = prompts[b : b + args.batch_size]
        hidden, lengths = prefill_block_output(model, tokenizer, [p.text for p in batch], args.layer)  # [B, T, H], [B]
        T = hidden.shape[1]
        for i, p in enumerate(batch):
            positions = np.arange(T - int(lengths[i]) + skip, T)
            if len(positions) > args.tokens_per_prompt:
                positions = np.append(
                    np.sort(rng.choice(positions[:-1], args.tokens_per_prompt - 1, replace=False)), T - 1
                )
            tokens.append(hidden[i, positions])
            max_delta = max(max_delta, float((hidden[i, -1] - rows.X[by_id[p.id]]).abs().max()))
        done = b + len(batch)
        print(
            f"[{time.strftime('%H:%M:%S')}] {done}/{len(prompts)} prompts, {sum(len(t) for t in tokens)} tokens, "
            f"{done / (time.time() - start):.2f} prompts/s, max |last token - store row| {max_delta:.2e}",
            flush=True,
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    save_file(
        {"tokens": torch.cat(tokens)},
        str(CACHE / f"layer{args.layer}_tokens_{args.shard}of{args.num_shards}.safetensors"),
        metadata={"prompts": str(len(prompts)), "max_delta": f"{max_delta:.3e}", "skip": str(skip)},
    )


def study(args) -> None:
    start = time.time()
    files = sorted(CACHE.glob(f"layer{args.layer}_tokens_*of{args.num_shards}.safetensors"))
    if len(files) != args.num_shards:
        raise SystemExit(f"expected {args.num_shards} shard files in {CACHE}, found {[f.name for f in files]}")
    data = torch.cat([load_file(str(f))["tokens"] for f in files])  # [n_tokens, H]
    rows = sd.load_rows("smollm2", "prompt_last", args.layer)
    fit_rows = torch.from_numpy(np.flatnonzero(rows.fit_mask))
    rms = data.pow(2).mean().sqrt().item()
    record: dict[str, Any] = {
        "model": "smollm2",
        "position": "prompt_last",
        "env": sd.environment(),
        "settings": dict(vars(args)),
        "protocol": sd.__doc__,
        "n_tokens": len(data),
        "sweep": {},
    }
    entries = record["sweep"][str(args.layer)] = {"saes": []}
    for d_sae, rel in [(d, r) for d in args.widths for r in args.l1_rels]:
        l1 = round(rel * rms, 4)
        t = time.time()
        sae = train_sae(data, d_sae, SAETrainConfig(l1_coefficient=l1, epochs=args.epochs), progress=False)
        stats = sae_stats(sae, rows.X[torch.from_numpy(rows.m(sd.BENIGN_POOLS, "val"))])
        meta = {
            "d_sae": d_sae,
            "l1": l1,
            "l1_rel": rel,
            "epochs": args.epochs,
            "n_fit": len(data),
            "train_seconds": round(time.time() - t, 1),
            "val_l0": round(stats.l0, 2),
            "val_fve": round(stats.fraction_variance_explained, 4),
            "val_dead_fraction": round(stats.dead_fraction, 4),
        }
        print(f"[{time.strftime('%H:%M:%S')}] SAE {meta}", flush=True)
        codes = sd.encode(sae, rows.X)
        entry = {
            "sae": meta,
            "freqmask": eval_freqmask_grid(codes, rows, fit_rows, args.ks, args.masks, ["global", "local"], sae=sae),
        }
        entry["probe (SAE codes)"] = sd.evaluate_scores(sd.probe_scores(codes.numpy(), rows), None, 1, rows)
        entries["saes"].append(entry)
        print(f"[{time.strftime('%H:%M:%S')}] evaluated", flush=True)
    record["status"] = "complete"
    record["wall_seconds"] = round(time.time() - start)
    name = args.name or f"chat_study_smollm2_prompt_last_token_sae_L{args.layer}"
    sd.write_json(sd.RESULTS / f"{name}.json", record)
    (sd.RESULTS / f"{name}.md").write_text(
        markdown(record).replace(
            "# Chat study: smollm2 prompt_last",
            f"# Chat study: smollm2 prompt_last, SAE trained on {len(data)} prompt tokens",
        )
    )
    print((sd.RESULTS / f"{name}.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["collect", "study"])
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=7000, help="fit-split prompts whose tokens are collected")
    parser.add_argument("--tokens-per-prompt", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard", type=int, default=0, help="collect: this process's shard (run one per core)")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--widths", type=int, nargs="+", default=[2304])
    parser.add_argument("--name", default=None, help="study: results file stem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--l1-rels", type=float, nargs="+", default=[0.1, 0.3, 1.0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--masks", type=int, nargs="+", default=[100, 400])
    args = parser.parse_args()
    collect(args) if args.step == "collect" else study(args)


if __name__ == "__main__":
    main()
