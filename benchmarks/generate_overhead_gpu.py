"""Guarded vs plain ``generate`` on a Llama-3-8B-shaped model with random bf16 weights, on a GPU.

    python benchmarks/generate_overhead_gpu.py [--batch-sizes 1 32] [--new-tokens 128] [--repeats 5]

The model has Llama-3-8B's shape (32 layers, hidden 4096, MLP 14336, 32 query
and 8 key/value heads, vocabulary 128256) and random weights in bfloat16. The
guard reads block ``--layer``: its SAE (4096 x 16384, random, bias set for about
60 active features per row) and its FreqMask-KM detector (K=100) are fitted on
that block's outputs for random prompts. Prompts are random token ids; both
calls generate exactly ``--new-tokens`` tokens greedily (``min_new_tokens`` =
``max_new_tokens``), so they do the same model work, and plain and guarded
calls alternate so drift hits both; the ratio is of the medians. The shape
flags make a small smoke run possible on the CPU. Writes
``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from common import environment, load_average, mean_l0, set_threads, sparse_random_sae, write_result
from hf_lsad.core.hook_point import HookPoint
from hf_lsad.detectors import FreqMaskConfig
from hf_lsad.detectors.clustering import KMeansConfig
from hf_lsad.generation.model import GuardedModelForCausalLM
from hf_lsad.guard.fitting import fit_guard


@torch.no_grad()
def block_outputs(model: PreTrainedModel, layer: int, prompts: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Float32 outputs of decoder block ``layer`` at every position of ``prompts``, ``[rows, hidden]``."""
    parts = []
    for start in range(0, len(prompts), batch_size):
        hidden = model(prompts[start : start + batch_size], output_hidden_states=True).hidden_states[layer + 1]
        parts.append(hidden.reshape(-1, hidden.shape[-1]).float())
    return torch.cat(parts)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of ``fn()``, waiting for queued CUDA work before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="generate_overhead_gpu", help="results file name (without .json)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--intermediate-size", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--layer", type=int, default=16, help="decoder block the guard reads")
    parser.add_argument("--d-sae", type=int, default=16384)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--fit-prompts", type=int, default=128, help="random prompts whose block outputs fit the guard")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="CPU threads for torch and faiss (default: one per core)")
    args = parser.parse_args()
    set_threads(args.threads)
    device = torch.device(args.device)

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    model.generation_config.pad_token_id = config.eos_token_id
    generator = torch.Generator().manual_seed(args.seed)

    fit_prompts = torch.randint(args.vocab_size, (args.fit_prompts, args.prompt_tokens), generator=generator)
    activations = block_outputs(model, args.layer, fit_prompts.to(device), max(args.batch_sizes))
    sae = sparse_random_sae(activations[:2048].cpu(), args.d_sae, 60.0, args.seed).to(device)
    kmeans = KMeansConfig(n_clusters=args.clusters, seed=args.seed, max_points_per_centroid=256)
    detector = FreqMaskConfig(kmeans=kmeans)
    hook = HookPoint.from_model(model, args.layer, "response_last")
    guard = fit_guard(activations, hook, "freqmask-km", detector, sae, seed=args.seed, progress=False).guard
    guarded = GuardedModelForCausalLM(model, guard)

    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    prompts = torch.randint(args.vocab_size, (max(args.batch_sizes), args.prompt_tokens), generator=generator)
    prompts = prompts.to(device)
    results = {}
    for batch_size in args.batch_sizes:
        inputs = dict(input_ids=prompts[:batch_size], attention_mask=torch.ones_like(prompts[:batch_size]))
        with torch.no_grad():
            plain_fn = partial(model.generate, **inputs, **settings)
            guarded_fn = partial(guarded.generate, **inputs, **settings)
            assert torch.equal(plain_fn(), guarded_fn())  # warm-up, and the same sequences
            load_before, plain, guard_s = load_average(), [], []
            for _ in range(args.repeats):
                plain.append(timed(plain_fn, device))
                guard_s.append(timed(guarded_fn, device))
        results[f"batch_{batch_size}"] = {
            "plain_median_s": statistics.median(plain),
            "guarded_median_s": statistics.median(guard_s),
            "ratio": statistics.median(guard_s) / statistics.median(plain),
            "plain_s": plain,
            "guarded_s": guard_s,
            "load_average_before": load_before,
            "load_average_after": load_average(),
        }
        print(batch_size, results[f"batch_{batch_size}"], flush=True)
    record = {
        **environment(device),
        "settings": {k: v for k, v in vars(args).items() if k != "name"},
        "sae_l0_on_fit_activations": mean_l0(sae, activations[-2048:]),
        "results": results,
    }
    print(write_result(args.name, record))


if __name__ == "__main__":
    main()
